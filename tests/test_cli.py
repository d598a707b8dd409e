"""The `cuflash2` CLI without a GPU: help, argument errors, the CPU paths, renderers, check logic."""

import csv
import io
import json
import math
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import cuflash2
from cuflash2 import checks, reference
from cuflash2.cli import bench_cmd, bench_run, formats, gpu, info_cmd
from cuflash2.cli.main import main

ml_dtypes = pytest.importorskip("ml_dtypes")


def invoke(*args):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def no_gpu(monkeypatch):
    """Behave as on a machine without a GPU, even where there is one."""
    monkeypatch.setattr(gpu, "find_gpu", lambda: (None, "no CUDA GPU found (test)"))


@pytest.fixture
def no_backward(monkeypatch):
    monkeypatch.delattr(cuflash2, "flash_attn_backward", raising=False)


# --------------------------------------------------------------------------------------------
# Help and argument errors
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [[], ["info"], ["check"], ["bench"], ["compile"]])
def test_help(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_group_lists_commands():
    output = invoke("--help").output
    for name in ("info", "check", "bench", "compile"):
        assert name in output


@pytest.mark.parametrize("args, expected", [
    (["bench", "--mode", "sideways"], "--mode"),
    (["bench", "--format", "xml"], "--format"),
    (["bench", "--dtype", "fp32"], "--dtype"),
    (["bench", "--compare", "torch-flash,torch-magic"], "torch-magic"),
    (["bench", "--seqlen", "0"], "--seqlen"),
    (["bench", "--seqlen", "512,abc"], "--seqlen"),
    (["bench", "--head-dim", "36"], "--head-dim"),
    (["bench", "--head-dim", "512"], "--head-dim"),
    (["bench", "--batch", "0"], "--batch"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--peak", "-1"], "--peak"),
    (["check", "--dtype", "fp32"], "--dtype"),
    (["check", "--dtype", ""], "--dtype"),
    (["compile", "--dtypes", "fp8"], "--dtypes"),
])
def test_argument_errors(args, expected):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert expected in result.output


def test_bench_backward_modes_need_flash_attn_backward(no_backward):
    for mode in ("bwd", "fwd+bwd"):
        result = invoke("bench", "--mode", mode)
        assert result.exit_code == 2
        assert "flash_attn_backward" in result.output


# --------------------------------------------------------------------------------------------
# Commands without a GPU
# --------------------------------------------------------------------------------------------

def test_info_without_gpu(no_gpu):
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "none: no CUDA GPU found" in result.output
    assert "No GPU" in result.output
    for key in ("kernel sources hash", "kernel cache", "CuPy", "torch", "jax", "peak"):
        assert key in result.output


def test_info_json_without_gpu(no_gpu):
    result = invoke("info", "--json")
    assert result.exit_code == 0
    facts = json.loads(result.output)
    assert facts["gpu"]["available"] is False and facts["gpu"]["name"] is None
    assert "no CUDA GPU found" in facts["gpu"]["reason"]
    assert set(facts["interop"]) == {"torch", "jax"}


def test_info_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "CuPy" in result.output and "not installed" in result.output


def test_check_quick_without_gpu_runs_numpy_checks(no_gpu, no_backward):
    result = invoke("check", "--quick")
    assert result.exit_code == 0, result.output
    assert "GPU checks skipped" in result.output
    assert "NumPy" in result.output
    assert "backward checks skipped" in result.output
    assert " 0 failed" in result.output and "FAIL" not in result.output
    assert result.output.count("PASS") == len(checks.numpy_cases(["bf16", "fp16"], False))


def test_check_quick_without_gpu_as_installed(no_gpu):
    """With whatever backward this version has: the CPU sweep must pass (or skip) and say GPU skipped."""
    result = invoke("check", "--quick")
    assert result.exit_code == 0, result.output
    assert "GPU checks skipped" in result.output and " 0 failed" in result.output


def test_check_filter_and_empty_filter(no_gpu, no_backward):
    result = invoke("check", "--dtype", "fp16", "-k", "causal")
    assert result.exit_code == 0
    assert "bf16" not in result.output.split("case", 1)[1] and "-full" not in result.output
    assert invoke("check", "-k", "no-such-case").exit_code == 2


def _to_dtype(x, like):
    return np.asarray(x, np.float32).astype(like.dtype)


def _numpy_backward(scale=1.0):
    def backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False):
        grads = reference.attention_backward_naive(dout, q, k, v, out, lse, softmax_scale, causal)
        return tuple(_to_dtype(g * scale, x) for g, x in zip(grads, (q, k, v)))
    return backward


def test_check_runs_backward_cases_when_available(no_gpu, monkeypatch):
    monkeypatch.setattr(cuflash2, "flash_attn_backward", _numpy_backward(), raising=False)
    result = invoke("check", "--quick", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert "backward checks skipped" not in result.output
    assert ":dq" in result.output and ":dk" in result.output and ":dv" in result.output


def test_check_fails_on_wrong_gradients(no_gpu, monkeypatch):
    monkeypatch.setattr(cuflash2, "flash_attn_backward", _numpy_backward(scale=1.2), raising=False)
    result = invoke("check", "--dtype", "fp16", "-k", "bwd")
    assert result.exit_code == 1
    assert "FAIL" in result.output


def test_check_skips_backward_without_cpu_path(no_gpu, monkeypatch):
    def gpu_only(*args, **kwargs):
        raise TypeError("q: expected a CUDA tensor")

    monkeypatch.setattr(cuflash2, "flash_attn_backward", gpu_only, raising=False)
    result = invoke("check", "--dtype", "fp16")
    assert result.exit_code == 0, result.output
    assert "SKIP" in result.output and "0 failed" in result.output


def test_bench_without_gpu_fails_clearly(no_gpu):
    result = invoke("bench", "--seqlen", "1024", "--head-dim", "64")
    assert result.exit_code == 1
    assert "needs a CUDA GPU" in result.output


# --------------------------------------------------------------------------------------------
# Renderers on a fake result list
# --------------------------------------------------------------------------------------------

COLUMNS = [formats.Column("impl", "impl", align="<"), formats.Column("seqlen", "seqlen"),
           formats.Column("causal", "causal"), formats.Column("tflops", "TFLOP/s", ".1f"),
           formats.Column("speedup", "ratio", ".2f")]
ROWS = [{"impl": "cuflash2", "seqlen": 512, "causal": False, "tflops": 301.26, "speedup": None},
        {"impl": "torch-flash", "seqlen": 16384, "causal": True, "tflops": 250.0, "speedup": 1.2},
        {"impl": "torch-cudnn", "seqlen": 1024, "causal": True, "tflops": math.nan, "speedup": None}]


def test_cell_rules():
    assert formats.cell(None) == "-" and formats.cell(math.nan, ".1f") == "-"
    assert formats.cell(True) == "yes" and formats.cell(False) == "no"
    assert formats.cell(3.14159, ".2f") == "3.14" and formats.cell(7, ".1f") == "7.0"
    assert formats.cell("x", ".1f") == "x"


def test_render_table_is_aligned():
    lines = formats.render_table(ROWS, COLUMNS).splitlines()
    assert lines[0].split() == ["impl", "seqlen", "causal", "TFLOP/s", "ratio"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert len(lines) == 2 + len(ROWS)
    # right-aligned numbers end in the same column
    ends = {line.index("TFLOP/s") + len("TFLOP/s") for line in lines[:1]}
    assert all(line[:max(ends)].rstrip().endswith(value) for line, value in zip(lines[2:], ["301.3", "250.0", "-"]))
    assert lines[2].startswith("cuflash2 ")


def test_render_markdown():
    lines = formats.render_markdown(ROWS, COLUMNS).splitlines()
    assert lines[0] == "| impl | seqlen | causal | TFLOP/s | ratio |"
    assert lines[1] == "|:---|---:|---:|---:|---:|"
    assert lines[3] == "| torch-flash | 16384 | yes | 250.0 | 1.20 |"
    assert len(lines) == 2 + len(ROWS)


def test_render_csv_keeps_raw_values():
    parsed = list(csv.DictReader(io.StringIO(formats.render_csv(ROWS, COLUMNS))))
    assert list(parsed[0]) == [c.key for c in COLUMNS]
    assert parsed[0]["tflops"] == "301.26" and parsed[0]["speedup"] == ""
    assert parsed[2]["tflops"] == ""


def test_render_json_is_valid_and_carries_environment():
    payload = json.loads(formats.render_json(ROWS, {"gpu": "Fake GPU", "peak": math.inf}))
    assert payload["environment"] == {"gpu": "Fake GPU", "peak": None}
    assert payload["results"][2]["tflops"] is None  # NaN is not JSON
    assert payload["results"][1]["causal"] is True


def test_render_dispatch():
    for fmt in formats.FORMATS:
        assert formats.render(fmt, ROWS, COLUMNS, {})
    with pytest.raises(ValueError):
        formats.render("xml", ROWS, COLUMNS)


def _bench_rows():
    rows = []
    for impl, tflops in (("cuflash2", 300.0), ("torch-flash", 200.0)):
        for seqlen in (512, 1024):
            p = bench_run.Problem("fwd", "bf16", 16384 // seqlen, seqlen, 32, 64, False)
            rows.append({"impl": impl, **p.fields(), "flops": p.flops, "first_call_s": 0.5, "ms": 1.0,
                         "tflops": tflops, "pct_peak": tflops / 9.89})
    rows.append({"impl": "torch-cudnn", **p.fields(), "flops": p.flops, "error": "RuntimeError: no kernel"})
    bench_run.add_speedups(rows)
    return rows


ENV = {"gpu": "Fake GPU", "arch": "sm_90", "peak_tflops": 989.0, "peak_source": "test", "warmup": 1, "repeats": 2,
       "flush_bytes": 0}


def test_add_speedups():
    rows = _bench_rows()
    assert [r["speedup"] for r in rows] == [None, None, 1.5, 1.5, None]


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_bench_emit_to_file(fmt, tmp_path, capsys):
    path = tmp_path / f"out.{fmt}"
    bench_cmd.emit(_bench_rows(), fmt, str(path), ENV)
    text = path.read_text()
    if fmt == "json":
        assert json.loads(text)["environment"]["gpu"] == "Fake GPU"
    else:
        assert "torch-flash" in text
    stdout = capsys.readouterr().out
    assert "cuflash2/x" in stdout and "Fake GPU" in stdout and "error" in stdout


def test_bench_emit_json_to_stdout_is_pure_json(capsys):
    bench_cmd.emit(_bench_rows(), "json", None, ENV)
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["results"]) == 5
    assert "Fake GPU" in captured.err  # context lines go to stderr


def test_compact_columns_drop_constant_mode_and_dtype():
    keys = [c.key for c in bench_cmd.columns_for(_bench_rows(), compact=True)]
    assert "mode" not in keys and "dtype" not in keys and "error" in keys
    assert "mode" in [c.key for c in bench_cmd.columns_for(_bench_rows())]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from cuflash2.cli.plot import plot_results

    path = tmp_path / "bench.png"
    plot_results(_bench_rows(), str(path), "test")
    assert path.read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------
# Bench grid and info helpers
# --------------------------------------------------------------------------------------------

def test_default_grid_is_fa2s():
    grid = bench_run.problem_grid("fwd", "bf16", bench_run.DEFAULT_SEQLENS, bench_run.DEFAULT_HEAD_DIMS,
                                  (False, True))
    assert len(grid) == 6 * 3 * 2
    assert all(p.batch * p.seqlen == 16384 and p.heads * p.head_dim == 2048 for p in grid)
    overridden = bench_run.problem_grid("bwd", "fp16", [100], [40], [True], batch=3, heads=5)
    assert overridden == [bench_run.Problem("bwd", "fp16", 3, 100, 5, 40, True)]
    assert overridden[0].flops == pytest.approx(2.5 * 4 * 3 * 5 * 40 * 100 * 100 / 2)


def test_grid_with_key_length_and_kv_heads():
    grid = bench_run.problem_grid("fwd", "bf16", [1024, 4096], [128], [False, True], seqlen_k=2048, heads_kv=4)
    assert {(p.seqlen, p.seqlen_k, p.heads, p.heads_kv) for p in grid} == {(1024, 2048, 16, 4), (4096, 2048, 16, 4)}
    assert "k2048" in grid[0].label() and "hkv4" in grid[0].label()
    # Causal masks are aligned bottom-right: 1024 queries over 2048 keys see keys 0..1024+i.
    causal = next(p for p in grid if p.causal and p.seqlen == 1024)
    pairs = sum(1024 + i + 1 for i in range(1024))
    assert causal.flops == pytest.approx(4 * causal.batch * 16 * 128 * pairs)
    square = bench_run.Problem("fwd", "bf16", 1, 64, 4, 32, False)
    assert (square.seqlen_k, square.heads_kv) == (64, 4) and square.label() == "fwd d32 s64 b1 h4"
    with pytest.raises(ValueError, match="heads_kv: expected a divisor of the query heads"):
        bench_run.problem_grid("fwd", "bf16", [512], [128], [False], heads_kv=3)


def test_grid_with_a_deterministic_backward(no_gpu):
    grid = bench_run.problem_grid("bwd", "bf16", [1024], [128], [False], deterministic=True)
    assert grid[0].deterministic and grid[0].label().endswith("deterministic")
    result = invoke("bench", "--deterministic")  # the forward has nothing to make deterministic
    assert result.exit_code == 2 and "--deterministic" in result.output and "--mode bwd" in result.output


def test_grid_with_dropout_and_its_bounds(no_gpu):
    grid = bench_run.problem_grid("fwd+bwd", "bf16", [1024], [64], [True], dropout_p=0.1)
    assert grid[0].dropout_p == 0.1 and grid[0].label().endswith("causal dropout 0.1")
    assert grid[0].flops == bench_run.Problem("fwd+bwd", "bf16", 16, 1024, 32, 64, True).flops  # FLOPs as without
    result = invoke("bench", "--dropout", "1.0")
    assert result.exit_code == 2 and "--dropout" in result.output


def test_bench_kv_heads_must_divide_before_any_gpu_work(no_gpu):
    result = invoke("bench", "--head-dim", "128", "--heads-kv", "3")
    assert result.exit_code == 2
    assert "heads_kv: expected a divisor of the query heads (16 at head dim 128), got 3" in result.output


def test_torch_is_not_timed_on_differently_aligned_causal_masks():
    p = bench_run.Problem("fwd", "bf16", 1, 512, 8, 64, True, seqlen_k=1024)
    with pytest.raises(bench_run.NotComparable, match="top-left"):
        bench_run.torch_runner("torch-flash", p, None, None, None, None)
    row = bench_run.run_one(None, "torch-flash", p, [None] * 4, {}, None)
    assert row["error"].startswith(bench_run.SKIPPED)
    lines = bench_cmd.summary_lines(_bench_rows() + [row], ENV)
    assert any("1 measurement(s) skipped" in line for line in lines)
    assert any("1 measurement(s) failed" in line for line in lines)  # the cuDNN row of _bench_rows


def test_kv_columns_only_in_compact_output_when_some_problem_differs():
    rows = _bench_rows()
    keys = [c.key for c in bench_cmd.columns_for(rows, compact=True)]
    assert "seqlen_k" not in keys and "heads_kv" not in keys
    assert {"seqlen_k", "heads_kv"} <= {c.key for c in bench_cmd.columns_for(rows)}  # CSV/JSON: fixed header
    rows[0] = {**rows[0], "heads_kv": 8}
    keys = [c.key for c in bench_cmd.columns_for(rows, compact=True)]
    assert "heads_kv" in keys and "seqlen_k" not in keys


def test_sustain_excludes_flush_l2_and_decode_before_any_gpu_work(no_gpu):
    result = invoke("bench", "--sustain", "2", "--flush-l2")
    assert result.exit_code == 2 and "--flush-l2" in result.output
    result = invoke("bench", "--sustain", "2", "--decode")
    assert result.exit_code == 2 and "--sustain does not apply to --decode" in result.output
    assert invoke("bench", "--sustain", "-1").exit_code == 2


def test_sustained_rows_carry_the_board_clock_and_power(monkeypatch):
    """--sustain: the measurement's clock and power land in the row, their columns appear in every
    format, and the summary says how the run time was taken."""
    timing = bench_run.Timing(first_call_s=0.5, ms=2.0, sm_clock_mhz=1650.0, power_w=690.0)
    monkeypatch.setattr(bench_run, "measure", lambda cp, fn, **settings: timing)
    monkeypatch.setattr(bench_run, "make_runner", lambda impl, p, inputs: None)
    p = bench_run.Problem("fwd", "bf16", 2, 8192, 16, 128, False)
    settings = {"warmup": 1, "repeats": 2, "flush_bytes": 0, "sustain_s": 2.0}
    row = bench_run.run_one(None, "cuflash2", p, None, settings, 989.0)
    assert (row["sm_clock_mhz"], row["power_w"], row["ms"]) == (1650.0, 690.0, 2.0)
    for compact in (False, True):
        assert {"sm_clock_mhz", "power_w"} <= {c.key for c in bench_cmd.columns_for([row], compact=compact)}
    assert not {"sm_clock_mhz", "power_w"} & {c.key for c in bench_cmd.columns_for(_bench_rows())}
    line = bench_cmd.summary_lines([row], {**ENV, "sustain_s": 2.0})[1]
    assert "back-to-back calls for 2 s" in line and "NVML" in line
    assert "median of 2 CUDA-event timings" in bench_cmd.summary_lines(_bench_rows(), ENV)[1]


def test_board_monitor_without_nvml_reads_nothing():
    from cuflash2 import bench

    monitor = bench.BoardMonitor("0000:00:00.0", library="libno-such-nvml.so")
    assert not monitor.available
    assert monitor.read_now() is None
    assert all(math.isnan(x) for x in monitor.mean(0.0, 1e12))
    monitor.samples.extend([(1.0, 1500.0, 600.0), (2.0, 1700.0, 700.0), (3.0, 1900.0, 100.0)])
    assert monitor.mean(0.5, 2.5) == (1600.0, 650.0)  # the window's samples only


def test_decode_rejects_kv_shape_options(no_gpu):
    result = invoke("bench", "--decode", "--heads-kv", "2")
    assert result.exit_code == 2 and "do not apply to --decode" in result.output


def test_info_helpers(tmp_path, monkeypatch):
    assert gpu.cuda_version(12040) == "12.4" and gpu.cuda_version(13000) == "13.0"
    assert gpu.cuda_version(0) == "none"
    assert info_cmd.framework_status("surely_no_such_module_xyz", "surely-no-such-dist") == "not installed"
    assert info_cmd.framework_status("numpy", "numpy") == np.__version__
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    assert info_cmd.kernel_cache_dir() == tmp_path
    (tmp_path / "a.cubin").write_bytes(b"x" * 2048)
    assert "1 files, 2.0 KiB" in info_cmd.cache_summary(tmp_path)
    assert "not created yet" in info_cmd.cache_summary(tmp_path / "missing")


def test_git_commit_is_a_hash_or_none():
    commit = bench_run.git_commit()
    assert commit is None or len(commit.split("-")[0]) == 40


# --------------------------------------------------------------------------------------------
# Check logic: cases, references, the tolerance rule
# --------------------------------------------------------------------------------------------

def test_judge_rule():
    assert checks.judge("a", 2e-3, 1e-3, 2.0).passed
    assert not checks.judge("a", 2.1e-3, 1e-3, 2.0).passed
    assert checks.judge("a", 5e-6, 0.0, 2.0).passed  # the absolute floor
    assert not checks.judge("a", 1e-6, 1e-3, 2.0, note="LSE error").passed
    assert not checks.judge("a", math.nan, 1e-3, 2.0).passed
    assert checks.judge("a", 0.0, 0.0, 2.0).ratio == 0.0
    assert math.isinf(checks.judge("a", 1e-6, 0.0, 2.0).ratio)


def test_backward_check_with_a_single_key():
    """seqlen_k = 1 makes dq, dk exactly 0 in the naive computation: the scaled floor absorbs fp32 noise."""
    if not hasattr(cuflash2, "flash_attn_backward"):
        pytest.skip("cuflash2.flash_attn_backward not available")
    case = checks.Case("bwd", "fp16", 32, 23, 1, False, batch=1, heads=2, heads_kv=2)
    results = checks.run_case(np, case)
    assert [r.case_id.rsplit(":", 1)[1] for r in results] == ["dq", "dk", "dv"]
    assert all(r.passed for r in results), results


def test_gpu_case_lists():
    quick = checks.gpu_cases(True, ["bf16", "fp16"], backward=False)
    assert {c.kind for c in quick} == {"fwd"} and {c.dtype for c in quick} == {"bf16", "fp16"}
    assert {c.head_dim for c in quick} >= {64, 128, 256, 40}
    assert {c.causal for c in quick} == {False, True}
    assert any(c.heads != c.heads_kv for c in quick)
    shapes = {(c.seqlen_q, c.seqlen_k) for c in quick}
    assert {(113, 203), (203, 113), (1, 239)} <= shapes
    assert len({c.case_id() for c in quick}) == len(quick)
    full = checks.gpu_cases(False, ["bf16"], backward=True)
    assert {8, 40, 72, 96, 136, 192, 224, 256} <= {c.head_dim for c in full}
    assert {c.kind for c in full} == {"fwd", "bwd"}
    # --quick: the second dtype's backward is trimmed (compile time), the first one's is not
    quick_bwd = [c for c in checks.gpu_cases(True, ["fp16", "bf16"], backward=True) if c.kind == "bwd"]
    assert {c.head_dim for c in quick_bwd if c.dtype == "fp16"} >= {40, 64, 128, 256}
    assert {c.head_dim for c in quick_bwd if c.dtype == "bf16"} == {64, 128}


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_references_match_the_float64_reference(causal):
    q, k, v, dout = _random((2, 37, 4, 16), 0), _random((2, 53, 2, 16), 1), _random((2, 53, 2, 16), 2), \
        _random((2, 37, 4, 16), 3)
    out, lse = checks.attention_ref(np, q, k, v, causal)
    ref_out, ref_lse = reference.attention_naive(q, k, v, causal=causal)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    grads = checks.attention_backward_ref(np, dout, q, k, v, causal)
    ref_grads = reference.attention_backward_naive(dout, q, k, v, ref_out, ref_lse, causal=causal)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-4)


def test_fully_masked_rows_in_references():
    q, k, v = _random((1, 20, 2, 8), 0), _random((1, 5, 2, 8), 1), _random((1, 5, 2, 8), 2)
    out, lse = checks.attention_ref(np, q, k, v, causal=True)
    assert (out[:, :15] == 0).all() and np.isinf(lse[:, :, :15]).all()
    dq, _, _ = checks.attention_backward_ref(np, q, q, k, v, causal=True)
    assert (dq[:, :15] == 0).all()


def test_low_precision_reference_is_less_accurate():
    q, k, v = _random((1, 64, 2, 32), 4), _random((1, 64, 2, 32), 5), _random((1, 64, 2, 32), 6)
    exact, _ = checks.attention_ref(np, q, k, v)
    errors = {dt: np.abs(checks.attention_ref(np, q, k, v, low_precision=dt)[0] - exact).max()
              for dt in ("float16", "bfloat16")}
    assert 0 < errors["float16"] < errors["bfloat16"] < 0.1


def test_round_to_bfloat16_matches_ml_dtypes():
    x = _random((1000,), 7) * 100
    expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(checks.round_to(np, x, "bfloat16"), expected)


def test_bench_rounds_rotate_the_order_and_keep_the_median_round(monkeypatch):
    """With --rounds, every implementation is timed once per round, the order rotating, and the
    row kept is its median round (first-call time from the first round); an error wins."""
    order = []
    times = {"cuflash2": iter([3.0, 1.0, 2.0]), "torch-flash": iter([5.0, 4.0, 6.0])}

    def fake_run_one(cp, impl, problem, inputs, settings, peak):
        order.append(impl)
        ms = next(times[impl])
        return {"impl": impl, **problem.fields(), "flops": problem.flops, "ms": ms,
                "tflops": problem.flops / ms / 1e9, "first_call_s": 10 * ms, "pct_peak": None}

    monkeypatch.setattr(bench_run, "run_one", fake_run_one)
    monkeypatch.setattr(bench_run, "make_inputs", lambda cp, problem: None)
    problem = bench_run.Problem("fwd", "bf16", 4, 4096, 32, 64, False)
    rows = bench_cmd.run_all(None, [problem], ["cuflash2", "torch-flash"], {}, None, rounds=3)
    assert order == ["cuflash2", "torch-flash", "torch-flash", "cuflash2", "cuflash2", "torch-flash"]
    ours, flash = rows
    assert (ours["ms"], ours["first_call_s"]) == (2.0, 30.0)
    assert flash["ms"] == 5.0 and flash["speedup"] == pytest.approx(5.0 / 2.0)
    assert bench_run.median_round([{"ms": 1.0, "first_call_s": 1.0}, {"error": "boom"}]) == {"error": "boom"}


def test_bench_rounds_time_cudnn_last_so_no_one_follows_it_twice():
    """cuDNN heats the GPU and the next kernel measures slower: it ends every round, the others
    rotate, so each of them starts (follows the previous round's cuDNN) in one round of three."""
    from cuflash2 import bench

    impls = ["cuflash2", "torch-flash", "torch-cudnn"]
    orders = [bench.round_order(impls, r) for r in range(3)]
    assert orders == [["cuflash2", "torch-flash", "torch-cudnn"], ["torch-flash", "cuflash2", "torch-cudnn"],
                      ["cuflash2", "torch-flash", "torch-cudnn"]]
    sequence = [name for order in orders for name in order]
    after_cudnn = [b for a, b in zip(sequence, sequence[1:]) if a == "torch-cudnn"]
    assert sorted(after_cudnn) == ["cuflash2", "torch-flash"]
    assert bench.round_order(["cudnn", "kernel", "flash"], 1) == ["flash", "kernel", "cudnn"]
    assert bench.round_order(["torch-cudnn"], 2) == ["torch-cudnn"]


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_compile_command_covers_every_forward_instantiation(arch):
    """`cuflash2 compile` fills the cache with every forward kernel the library can launch, the
    short-sequence tiles included (config.forward_config's seqlen)."""
    from cuflash2.families import mma_sync as config
    from cuflash2.cli import main

    listed = set(main._configs(arch, list(config.HEAD_DIM_BUCKETS), list(config.DTYPES)))
    assert {c for c in config.all_forward_configs(arch) if c.vec == 16} <= listed


def test_compile_command_builds_the_hopper_forward_on_sm90_only():
    from cuflash2.cli import main
    from cuflash2.families import wgmma

    listed = main._configs(90, [64, 128, 100], ["bf16", "fp16"], ("fwd",))
    hopper = {c for c in listed if isinstance(c, wgmma.WgmmaFwdConfig)}
    chosen = {wgmma.forward_config(d, dtype, causal, seqlen=seqlen) for d in (64, 128)
              for dtype in ("bfloat16", "float16") for causal in (False, True)
              for seqlen in wgmma.forward.SEQLEN_CLASSES}  # not 100: not a multiple of 8
    # d64 causal: the short-sequence tile too; d128: the short calls' staged output and the calls'
    # from 8k 192-key blocks too.
    assert len(chosen) == 18
    # And the CTA-pair build of each non-causal one.
    assert hopper == set(wgmma.forward.with_pairs(sorted(chosen, key=lambda c: c.short_id())))
    assert len(hopper) == 18 + sum(not c.causal for c in chosen)
    assert not any(isinstance(c, wgmma.WgmmaFwdConfig) for c in main._configs(80, [64, 128], ["bf16"], ("fwd",)))
    assert not any(isinstance(c, wgmma.WgmmaFwdConfig) for c in main._configs(90, [128], ["bf16"], ("bwd",)))


# Contiguous head dims whose vector width and bucket are config.NARROW_SAMPLES' pairs.
_NARROW_SAMPLE_DIMS = (59, 90, 100, 111, 191, 255)


@pytest.mark.parametrize("arch", [80, 90])
def test_compile_command_lists_the_narrow_kernels_of_its_head_dims(arch):
    """`cuflash2 compile --head-dims 59,...` lists the kernels a contiguous call at those head dims
    launches (their vector width), and they hold the narrow samples the compile test covers."""
    from cuflash2.families import mma_sync as config
    from cuflash2.cli import main

    assert {(config.head_dim_bucket(d), config.vector_width(d)) for d in _NARROW_SAMPLE_DIMS} == \
        set(config.NARROW_SAMPLES)
    listed = set(main._configs(arch, list(_NARROW_SAMPLE_DIMS), [config.NARROW_SAMPLE_DTYPE]))
    narrow = {c for c in config.all_configs(arch) if c.vec != 16}
    assert narrow and narrow <= listed
    assert {c.vec for c in listed} <= {2, 4, 8, 16}
    only_59 = main._configs(arch, [59], ["fp16"])
    assert {c.vec for c in only_59 if c.kernel != config.ROTARY_COPY} == {2}


def test_compile_command_accepts_any_head_dim_up_to_256():
    from click.testing import CliRunner

    from cuflash2.cli import main

    result = CliRunner().invoke(main.main, ["compile", "--arch", "sm_80", "--head-dims", "0"])
    assert result.exit_code != 0 and "expected head dims in [1, 256], got 0" in result.output
    result = CliRunner().invoke(main.main, ["compile", "--arch", "sm_80", "--head-dims", "257"])
    assert result.exit_code != 0 and "got 257" in result.output
