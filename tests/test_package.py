"""The package as users meet it: imports, packaged kernel sources, the `cuflash2` CLI. CPU only."""

import importlib.metadata
import importlib.util
import pathlib
import re

import pytest
from click.testing import CliRunner

import cuflash2
from cuflash2.runtime import compiler
from cuflash2.cli.main import main


def _gpu_available():
    try:
        import cupy

        return cupy.cuda.is_available()
    except Exception:
        return False


def run_cli(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def combined_output(result):
    text = result.output
    try:
        text += result.stderr
    except ValueError:  # older click without separate stderr
        pass
    return text


# ----------------------------------------------------------------------------------------- imports


@pytest.mark.parametrize("name", ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
                                  "flash_attn_forward", "attention_probs"])
def test_public_api(name):
    assert callable(getattr(cuflash2, name))
    assert name in cuflash2.__all__


def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+([.\-+].*)?", cuflash2.__version__)


def test_submodules_import_without_gpu():
    """Every module but the torch and JAX adapters (imported only with such arrays) imports without
    a GPU, CuPy, torch or JAX, and from this package (not another copy)."""
    import pkgutil

    folder = pathlib.Path(cuflash2.__file__).parent
    names = [info.name for info in pkgutil.walk_packages([str(folder)], "cuflash2.")
             if info.name not in ("cuflash2.__main__", "cuflash2.frameworks.torch_adapter",
                                  "cuflash2.frameworks.jax_adapter")]
    assert {"cuflash2.api", "cuflash2.core.replay", "cuflash2.families.mma_sync.launches",
            "cuflash2.runtime.compiler"} <= set(names)
    for module in names + ["cuflash2.cli", "cuflash2.cli.main"]:
        imported = importlib.import_module(module)
        if not module.startswith("cuflash2.cli"):
            assert folder in pathlib.Path(imported.__file__).parents, (module, imported.__file__)


def test_no_generic_top_level_cli_module():
    """cli/ is reached as cuflash2.cli (checkout: __path__ extension; wheel: package-dir mapping)."""
    assert cuflash2.cli.main.main is main
    assert main.name in ("main", "cuflash2") or callable(main)


def test_kernel_dir_has_sources():
    folder = compiler.kernel_dir()
    assert folder.is_dir()
    assert (folder / compiler.source_path("flash_fwd.cu")).is_file()
    assert any(p.suffix == ".cuh" for p in folder.rglob("*"))


def test_sources_hash_is_stable():
    assert compiler.sources_hash() == compiler.sources_hash()
    assert re.fullmatch(r"[0-9a-f]{16}", compiler.sources_hash())


# --------------------------------------------------------------------------------------------- CLI


def test_cli_help():
    result = run_cli("--help")
    assert result.exit_code == 0
    assert "compile" in result.output and "Usage" in result.output


def test_cli_version():
    result = run_cli("--version")
    assert result.exit_code == 0
    assert cuflash2.__version__ in result.output


def test_cli_compile_help():
    result = run_cli("compile", "--help")
    assert result.exit_code == 0
    for option in ("--arch", "--head-dims", "--dtypes"):
        assert option in result.output


@pytest.mark.compile
def test_cli_compile_offline():
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy")
    result = run_cli("compile", "--arch", "sm_80", "--head-dims", "64", "--dtypes", "bf16")
    assert result.exit_code == 0, combined_output(result)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines, "no output"
    summary = lines.pop()  # the closing summary
    assert re.fullmatch(rf"{len(lines)}/{len(lines)} kernels for sm_80: {len(lines)} ok, 0 failed, 0 spills .*"
                        r"\(checked, not cached\)", summary), summary
    for line in lines:  # one line per kernel
        assert "regs=" in line and "sm_80" in line and "-bf16" in line, line
        assert line.startswith("ok"), line
    forward = [line for line in lines if "fwd-bf16-d64-" in line]
    assert len(forward) == 4, result.output  # one bucket x one dtype x (full, causal) x (plain, variant)
    assert sum("-var-" in line for line in forward) == 2, result.output
    assert sum("fwd-kvcache-bf16-d64-" in line for line in lines) == 2, result.output
    assert {"full", "causal"} == {re.search(r"-(full|causal)-", line).group(1) for line in forward}
    backward = [line for line in lines if " bwd-" in line]
    assert any("bwd-dq-bf16-d64-" in line for line in backward), result.output
    assert any("bwd-bf16-d64-" in line and "dvdk" in line for line in backward), result.output


@pytest.mark.compile
def test_cli_compile_two_archs_dedups_head_dims():
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy")
    # 40 and 64 share the 64 bucket: one kernel per (arch, dtype, mask)
    result = run_cli("compile", "--arch", "sm_80,sm_90", "--head-dims", "40,64", "--dtypes", "fp16")
    assert result.exit_code == 0, combined_output(result)
    lines = [line for line in result.output.splitlines() if "regs=" in line and " fwd-fp16" in line]
    assert len(lines) == 8, result.output  # 2 archs x (full, causal) x (plain, variant)


@pytest.mark.parametrize("args,fragments", [
    (("--arch", "sm_70"), ("--arch", "sm_70", ">= sm_80")),
    (("--arch", "sm_80,sm_75"), ("--arch", "sm_75")),
    (("--arch", "hopper"), ("--arch", "hopper")),
    (("--arch", "sm_80", "--head-dims", "257"), ("--head-dims", "[1, 256]", "257")),
    (("--arch", "sm_80", "--head-dims", "264"), ("--head-dims", "264")),
    (("--arch", "sm_80", "--head-dims", "0"), ("--head-dims", "0")),
    (("--arch", "sm_80", "--head-dims", "sixty-four"), ("--head-dims", "sixty-four")),
    (("--arch", "sm_80", "--dtypes", "fp32"), ("--dtypes", "fp32")),
    (("--arch", "sm_80", "--dtypes", "bf16,float16"), ("--dtypes", "float16")),
])
def test_cli_compile_bad_arguments(args, fragments):
    result = CliRunner().invoke(main, ["compile", *args])
    assert result.exit_code != 0
    assert not isinstance(result.exception, (AssertionError, TypeError, AttributeError, KeyError)), result.exception
    text = combined_output(result)
    assert "regs=" not in text  # rejected before compiling anything
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"


@pytest.mark.skipif(_gpu_available(), reason="this machine has a GPU: compile without --arch would run")
def test_cli_compile_without_gpu_asks_for_arch():
    pytest.importorskip("cupy", reason="without CuPy the message is about installing it")
    result = CliRunner().invoke(main, ["compile", "--head-dims", "64", "--dtypes", "bf16"])
    assert result.exit_code != 0
    text = combined_output(result)
    assert "--arch" in text and "GPU" in text, text
    assert "regs=" not in text


def test_python_dash_m_entry_point():
    spec = importlib.util.find_spec("cuflash2.__main__")
    assert spec is not None and spec.origin.endswith("__main__.py")
