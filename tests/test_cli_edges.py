"""The CLI at its edges: no CuPy, no NVRTC, no GPU give one `Error: ...` line naming the fix (exit 1);
`cuflash2 compile`'s progress and summary; `cuflash2 info --json`; the compile log. CPU only, and
nothing here compiles a kernel."""

import json
import logging
import re
import sys
import types

import pytest
from click.testing import CliRunner

import cuflash2
from cuflash2.runtime import compiler
from cuflash2.families import mma_sync as cfg
from cuflash2.cli import errors, gpu, main as main_module, progress
from cuflash2.cli.main import main


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def text_of(result) -> str:
    text = result.output
    try:
        if result.stderr and result.stderr not in text:
            text += result.stderr
    except ValueError:  # click < 8.2 without separate stderr
        pass
    return text


def assert_one_error_line(result, *fragments):
    """Exit 1, no traceback, and the whole output is one `Error: ...` line containing fragments."""
    text = text_of(result)
    assert result.exit_code == 1, (result.exit_code, text, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), text
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def no_cupy(monkeypatch):
    """`import cupy` and `import cupy_backends...` raise ImportError, as without the extra."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("cupy", "cupy_backends"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy_backends", None)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(gpu, "find_gpu", lambda: (None, "no CUDA GPU found (test)"))


class DynamicLibNotFoundError(RuntimeError):
    """Stands for cuda.pathfinder's error (CuPy for CUDA 13 looks NVRTC up through it)."""


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


# ----------------------------------------------------------------------------- one line per edge

@pytest.mark.parametrize("args", [["compile", "--arch", "sm_90", "--head-dims", "128", "--dtypes", "bf16"],
                                  ["compile", "--head-dims", "128"]])
def test_compile_without_cupy(no_cupy, args):
    assert_one_error_line(invoke(*args), "CuPy", "pip install '.[cuda12]'", "'.[cuda13]'")


def test_bench_without_cupy(no_cupy):
    assert_one_error_line(invoke("bench", "--seqlen", "1024", "--head-dim", "64"),
                          "needs a CUDA GPU", "pip install '.[cuda12]'")


@pytest.mark.parametrize("major,fix", [(12, "nvidia-cuda-nvrtc-cu12"), (13, "'nvidia-cuda-nvrtc>=13,<14'")])
def test_compile_without_nvrtc(monkeypatch, major, fix):
    monkeypatch.setattr(errors, "cupy_cuda_major", lambda: major)
    monkeypatch.setattr(compiler, "nvrtc_version", _raise(DynamicLibNotFoundError(
        f'Failure finding "libnvrtc.so.{major}": No such file: libnvrtc.so.{major}\nmore detail')))
    line = assert_one_error_line(invoke("compile", "--arch", "sm_90", "--head-dims", "128", "--dtypes", "bf16"),
                                 f"NVRTC {major}", f"pip install '.[cuda{major}]'", fix)
    assert "more detail" not in line  # the first line of the cause only


def test_compile_without_nvrtc_cupy12_wording(monkeypatch):
    """CuPy for CUDA 12 words it differently (no cuda-pathfinder): the same one line."""
    monkeypatch.setattr(errors, "cupy_cuda_major", lambda: 12)
    monkeypatch.setattr(compiler, "nvrtc_version", _raise(RuntimeError(
        "CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: cannot open shared object file")))
    assert_one_error_line(invoke("compile", "--arch", "sm_80"), "NVRTC 12", "nvidia-cuda-nvrtc-cu12")


def test_compile_without_gpu_asks_for_arch(monkeypatch, no_gpu):
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (12, 9))
    assert_one_error_line(invoke("compile", "--head-dims", "64"), "needs a CUDA GPU", "--arch")


def test_bench_without_gpu(no_gpu):
    assert_one_error_line(invoke("bench", "--seqlen", "1024", "--head-dim", "64"), "needs a CUDA GPU")


def test_cuda_no_device_error_mid_command(monkeypatch):
    """A CUDA runtime error saying there is no device, from deep inside a command."""
    cuda_error = type("CUDARuntimeError", (RuntimeError,), {})
    monkeypatch.setattr(gpu, "find_gpu", _raise(cuda_error("cudaErrorNoDevice: no CUDA-capable device is detected")))
    assert_one_error_line(invoke("check", "--quick"), "needs a CUDA GPU", "cudaErrorNoDevice")


def test_api_missing_cupy_error_in_a_command(monkeypatch):
    from cuflash2.runtime import device as interop
    from cuflash2.cli import check_cmd

    monkeypatch.setattr(check_cmd, "_plan", _raise(RuntimeError(interop.CUPY_MISSING)))
    assert_one_error_line(invoke("check"), "CuPy", "pip install '.[cuda12]'")


def test_other_errors_still_raise(monkeypatch):
    """Only edge errors are reworded: a bug keeps its traceback."""
    from cuflash2.cli import check_cmd

    monkeypatch.setattr(check_cmd, "_plan", _raise(ZeroDivisionError("a bug")))
    result = invoke("check")
    assert isinstance(result.exception, ZeroDivisionError)


def test_hints_are_runnable_commands():
    for message in (errors.cupy_missing(), errors.nvrtc_missing(), cuflash2.runtime.device.CUPY_MISSING):
        assert re.search(r"pip install '\.\[cuda1[23]\]'", message) and "checkout" in message, message
        assert "cuflash2[cuda" not in message  # not on a package index yet


# ----------------------------------------------------------------------------- compile: progress, summary, jobs

class FakeReport:
    def __init__(self, config, arch, status):
        self.config, self.arch, self.status = config, arch, status
        self.ok, self.error = status == "ok", ("boom\nlog" if status == "ERROR" else "")

    def line(self):
        return f"{self.status:5s} {self.arch:6s} {self.config.short_id()} regs=100"


@pytest.fixture
def fake_compiles(monkeypatch):
    """Offline compiles that only report (no NVRTC): the 2nd kernel spills, the 3rd fails."""
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (13, 0))
    calls = []

    def report(item):
        calls.append(item)
        status = {2: "SPILL", 3: "ERROR"}.get(len(calls), "ok")
        return FakeReport(*item, status)

    monkeypatch.setattr(compiler, "offline_report", report)
    return calls


def _kernel_count(arch=90):
    return len(main_module._configs(arch, [64], ["bf16"], ("fwd", "bwd")))


def test_compile_summary_counts_and_exit_code(fake_compiles):
    result = invoke("compile", "--arch", "sm_90", "--head-dims", "64", "--dtypes", "bf16", "--jobs", "1")
    assert result.exit_code == 1
    n = _kernel_count()
    assert len(fake_compiles) == n
    summary = [line for line in result.output.splitlines() if "kernels for" in line]
    assert len(summary) == 1, result.output
    assert re.fullmatch(rf"{n}/{n} kernels for sm_90: {n - 2} ok, 1 failed, 1 spills \(or stack frames\) in "
                        r"[0-9.]+ s, 1 job \(checked, not cached\)", summary[0]), summary[0]
    assert "boom" in text_of(result)  # the compile log of the failure
    assert "\r" not in result.output and "ETA" not in result.output  # not a terminal: plain lines


def test_compile_progress_bar_on_a_terminal(fake_compiles, monkeypatch):
    monkeypatch.setattr(progress, "is_terminal", lambda: True)
    result = invoke("compile", "--arch", "sm_90", "--head-dims", "64", "--dtypes", "bf16", "--jobs", "1")
    text = text_of(result)
    n = _kernel_count()
    assert f" {n}/{n}  elapsed " in text and "ETA" in text and "\r\033[K" in text
    assert re.search(rf"\[#+\] {n}/{n}  elapsed 0:\d\d  ETA 0:00", text)


def test_progress_bar_text():
    assert progress.clock(0) == "0:00" and progress.clock(75) == "1:15" and progress.clock(3725) == "1:02:05"
    assert progress.bar_text(0, 10, 0.0).endswith("0/10  elapsed 0:00  ETA ?")
    text = progress.bar_text(5, 10, 30.0)
    assert text.startswith("[" + "#" * 12 + "." * 12 + "]") and text.endswith(" 5/10  elapsed 0:30  ETA 0:30")


def test_compile_jobs_default_is_the_cpu_count():
    import os

    option = next(p for p in main_module.compile_command.params if p.name == "jobs")
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert option.default is main_module._default_jobs
    assert main_module._default_jobs() == expected >= 1
    assert "CPU count" in invoke("compile", "--help").output


def test_compile_help_says_arch_builds_are_not_cached():
    text = " ".join(invoke("compile", "--help").output.split())
    assert "checked" in text and "not cached" in text and "progress bar" in text


# ----------------------------------------------------------------------------- info --json

def _keys(value, path=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}.{key}", key
            yield from _keys(item, f"{path}.{key}")


@pytest.mark.parametrize("with_gpu", [False, True])
def test_info_json_is_machine_readable(monkeypatch, tmp_path, with_gpu):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    (tmp_path / "k.cubin").write_bytes(b"x" * 3000)
    if with_gpu:
        fake = _fake_gpu_cupy()
        monkeypatch.setattr(gpu, "find_gpu", lambda: (fake, ""))
    else:
        monkeypatch.setattr(gpu, "find_gpu", lambda: (None, "no CUDA GPU found (test)"))
    result = invoke("info", "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    for where, key in _keys(facts):
        assert re.fullmatch(r"[a-z][a-z0-9_]*", key) or where.startswith(".interop."), where
    assert set(facts) == {"cuflash2", "kernel_cache", "gpu", "versions", "interop", "peak", "families"}
    assert facts["cuflash2"]["version"] == cuflash2.__version__
    assert isinstance(facts["cuflash2"]["backward_available"], bool)
    assert facts["kernel_cache"] == {"path": str(tmp_path), "exists": True, "files": 1, "size_bytes": 3000}
    for framework in facts["interop"].values():
        assert isinstance(framework["installed"], bool)
        assert framework["version"] is None or isinstance(framework["version"], str)
    g = facts["gpu"]
    assert isinstance(g["available"], bool) and g["available"] is with_gpu
    if with_gpu:
        assert g["reason"] is None and g["name"] == "NVIDIA H200" and g["arch"] == "sm_90"
        for key in ("device_id", "sm_count", "max_dynamic_smem_bytes", "l2_cache_bytes", "memory_bytes",
                    "compute_capability_major", "compute_capability_minor", "visible_devices"):
            assert type(g[key]) is int, key
        assert isinstance(facts["peak"]["tflops"], (int, float)) and isinstance(facts["peak"]["source"], str)
    else:
        assert isinstance(g["reason"], str)
        assert all(v is None for k, v in g.items() if k not in ("available", "reason"))
        assert facts["peak"] == {"tflops": None, "source": None}


def test_info_json_missing_cache_and_no_cupy(no_cupy, monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "missing"))
    facts = json.loads(invoke("info", "--json").output)
    assert facts["kernel_cache"] == {"path": str(tmp_path / "missing"), "exists": False, "files": 0, "size_bytes": 0}
    assert facts["versions"]["cupy"] is None and facts["versions"]["nvrtc"] is None
    assert facts["gpu"]["available"] is False


def _fake_gpu_cupy():
    props = {"name": b"NVIDIA H200", "major": 9, "minor": 0, "multiProcessorCount": 132,
             "sharedMemPerBlockOptin": 232448, "l2CacheSize": 62914560, "totalGlobalMem": 150 * 2**30}
    runtime = types.SimpleNamespace(getDeviceProperties=lambda i: props, getDeviceCount=lambda: 1,
                                    driverGetVersion=lambda: 12080, runtimeGetVersion=lambda: 12090)
    cuda = types.SimpleNamespace(Device=lambda *a: types.SimpleNamespace(id=0), runtime=runtime)
    return types.SimpleNamespace(cuda=cuda, __version__="14.2.0")


# ----------------------------------------------------------------------------- first-call compile log

def _fake_cupy_for_get_kernel():
    class Device:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Module:
        def __init__(self, **kwargs):
            pass

        def get_function(self, name):
            return types.SimpleNamespace(max_dynamic_shared_size_bytes=0)

    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device), RawModule=Module)


def test_first_call_of_a_variant_logs_once_at_info(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy_for_get_kernel())
    monkeypatch.setattr(compiler, "_loaded", {})
    config = cfg.forward_config(64, "bf16", False, 90, False, 1024)
    with caplog.at_level(logging.INFO, logger="cuflash2"):
        compiler.get_kernel(config, 0)
        compiler.get_kernel(config, 0)
    records = [r for r in caplog.records if r.name == "cuflash2"]
    compiling = [r for r in records if r.getMessage().startswith("compiling kernel")]
    assert len(compiling) == 1 and config.short_id() in compiling[0].getMessage()
    assert all(r.levelno == logging.INFO for r in records)


def test_compile_log_is_silent_by_default():
    logger = logging.getLogger("cuflash2")
    assert logger is compiler.logger
    assert logger.level == logging.NOTSET and not logger.handlers
    assert not logger.isEnabledFor(logging.INFO) or logging.getLogger().level <= logging.INFO
