"""`cuflash2 bench`: TFLOP/s and % of peak on FA2's benchmark grid, next to torch SDPA backends."""

from __future__ import annotations

import contextlib
import sys

import click

from cuflash2 import bench

from . import bench_run, decode_bench, gpu
from .formats import FORMATS, Column, render, render_table
from .options import COMPARE_CHOICES, parse_compare, parse_head_dims, parse_positive_ints, positive_int
from .plot import plot_results, require_matplotlib

MODES = ("fwd", "bwd", "fwd+bwd")
COLUMNS = [
    Column("impl", "impl", align="<"), Column("mode", "mode", align="<"), Column("dtype", "dtype", align="<"),
    Column("batch", "batch"), Column("seqlen", "seqlen"), Column("seqlen_k", "kv len"), Column("heads", "heads"),
    Column("heads_kv", "kv heads"), Column("head_dim", "hdim"),
    Column("causal", "causal"), Column("first_call_s", "1st call s", ".2f"), Column("ms", "ms", ".3f"),
    Column("tflops", "TFLOP/s", ".1f"), Column("pct_peak", "% peak", ".1f"), Column("speedup", "cuflash2/x", ".2f"),
]
ERROR_COLUMN = Column("error", "error", align="<")
# Sustained runs (--sustain): the board's mean SM clock and power during each.
BOARD_COLUMNS = [Column("sm_clock_mhz", "SM MHz", ".0f"), Column("power_w", "W", ".0f")]


CONSTANT_KEYS = ("mode", "dtype")  # left out of the text table when one value covers every row


# In compact output, shown only where some problem differs from the square MHA case.
OPTIONAL_COLUMNS = {"seqlen_k": "seqlen", "heads_kv": "heads"}


def columns_for(rows: list[dict], compact: bool = False) -> list[Column]:
    """Every column for machine formats (a fixed header); `compact` (table, markdown) drops the
    columns that say nothing for these rows."""
    board = BOARD_COLUMNS if any("sm_clock_mhz" in r for r in rows) else []
    columns = COLUMNS + board + ([ERROR_COLUMN] if any(r.get("error") for r in rows) else [])
    if compact:
        columns = [c for c in columns if c.key not in CONSTANT_KEYS or len({r[c.key] for r in rows}) > 1]
        columns = [c for c in columns if c.key not in OPTIONAL_COLUMNS
                   or any(r.get(c.key) != r.get(OPTIONAL_COLUMNS[c.key]) for r in rows)]
    return columns


def require_backward(mode: str) -> None:
    import cuflash2

    if mode != "fwd" and not hasattr(cuflash2, "flash_attn_backward"):
        raise click.UsageError(f"--mode {mode} needs cuflash2.flash_attn_backward, which this version does not "
                               "have yet: use --mode fwd")


def require_torch() -> None:
    try:
        import torch
        from torch.nn.attention import sdpa_kernel  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(f"--compare needs PyTorch (>= 2.3) with CUDA: {exc}") from None
    if not torch.cuda.is_available():
        raise click.ClickException(f"--compare needs a CUDA build of PyTorch; torch {torch.__version__} sees no GPU")


def _flush_bytes(cp, flush: bool) -> int:
    if not flush:
        return 0
    l2 = gpu.gpu_info(cp).l2_bytes or 64 << 20
    return 2 * l2  # writing twice the L2's size evicts everything the timed call could reuse


def _progress(problems):
    """A progress bar on stderr for runs of several problems."""
    if len(problems) < 2:
        return contextlib.nullcontext(problems)
    return click.progressbar(problems, label="benchmarking", file=sys.stderr,
                             item_show_func=lambda p: p.label() if p else "")


def run_all(cp, problems, impls, settings: dict, peak, rounds: int = 1) -> list[dict]:
    """One row per (problem, implementation). With several rounds every implementation is timed
    once per round and its median round is kept. The order rotates from round to round, with cuDNN
    last in each (bench.round_order): the GPU's clock follows its power draw with some lag, and
    after a cuDNN run the next kernel measured up to 13% slower than it did later in the same
    process, so a plain rotation timed cuflash2 right after cuDNN in two of three rounds."""
    rows = []
    with _progress(problems) as bar:
        for problem in bar:
            inputs = bench_run.make_inputs(cp, problem)
            runs = {impl: [] for impl in impls}
            for r in range(rounds):
                for impl in bench.round_order(impls, r):
                    runs[impl].append(bench_run.run_one(cp, impl, problem, inputs, settings, peak))
            rows += [bench_run.median_round(runs[impl]) for impl in impls]
            del inputs
    bench_run.add_speedups(rows)
    return rows


def _rounds_note(rounds: int) -> str:
    return f", the median of {rounds} rounds timed in rotating order" if rounds > 1 else ""


def _run_time_note(env: dict) -> str:
    if env.get("sustain_s"):
        return (f"run time: mean of back-to-back calls for {env['sustain_s']:g} s after {env['warmup']} warm-up "
                f"calls{_rounds_note(env.get('rounds', 1))}; 'SM MHz' and 'W': the board's mean SM clock and "
                f"power (NVML) past each run's first {bench.SETTLE_S:g} s")
    return (f"run time: median of {env['repeats']} CUDA-event timings after {env['warmup']} warm-up calls"
            f"{_rounds_note(env.get('rounds', 1))}{', L2 flushed before each' if env['flush_bytes'] else ''}")


def summary_lines(rows: list[dict], env: dict) -> list[str]:
    peak = env["peak_tflops"]
    modes = ", ".join(dict.fromkeys(f"{r['mode']} {r['dtype']}" for r in rows))
    lines = [f"{modes} on {env['gpu']} ({env['arch']}); peak {f'{peak:.0f} TFLOP/s' if peak else 'unknown'} "
             f"({env['peak_source']})",
             f"{_run_time_note(env)}; '1st call s' is the first call's wall time (kernel compile/load included)"]
    ours = [r["first_call_s"] for r in rows if r["impl"] == "cuflash2" and r.get("first_call_s") is not None]
    if ours:
        lines.append(f"cuflash2 first calls: {sum(ours):.1f} s in all, longest {max(ours):.2f} s")
    skipped = [r for r in rows if str(r.get("error", "")).startswith(bench_run.SKIPPED)]
    failed = [r for r in rows if r.get("error") and r not in skipped]
    if skipped:
        lines.append(f"{len(skipped)} measurement(s) skipped (not the same problem): see the 'error' column")
    if failed:
        lines.append(f"{len(failed)} measurement(s) failed: see the 'error' column")
    return lines


def emit(rows, fmt: str, output: str | None, env: dict) -> None:
    """Chosen format to stdout, or to FILE with the table on stdout; context lines where they fit."""
    text = render(fmt, rows, columns_for(rows, compact=fmt in ("table", "markdown")), env)
    context = "\n".join(summary_lines(rows, env))
    if output:
        with open(output, "w") as f:
            f.write(text)
        click.echo(render_table(rows, columns_for(rows, compact=True)) + "\n" + context)
        click.echo(f"wrote {output} ({fmt})", err=True)
    elif fmt == "table":
        click.echo(text + "\n" + context)
    else:
        click.echo(text, nl=False)
        click.echo(context, err=True)


@click.command("bench")
@click.option("--mode", type=click.Choice(MODES), default="fwd", show_default=True,
              help="Forward, backward, or both (FLOPs x1, x2.5, x3.5).")
@click.option("--batch", type=int, default=None, callback=positive_int, help="Default: 16384 // seqlen.")
@click.option("--seqlen", "seqlens", default=None, callback=parse_positive_ints, metavar="N[,N...]",
              help="Comma list. Default: 512,1024,2048,4096,8192,16384.")
@click.option("--seqlen-k", type=int, default=None, callback=positive_int,
              help="Key/value length of every problem (default: the query length).")
@click.option("--heads", type=int, default=None, callback=positive_int, help="Default: 2048 // head dim.")
@click.option("--heads-kv", type=int, default=None, callback=positive_int,
              help="Key/value heads (GQA / MQA; must divide the query heads). Default: the query heads.")
@click.option("--head-dim", "head_dims", default=None, callback=parse_head_dims, metavar="D[,D...]",
              help="Comma list. Default: 64,128,256.")
@click.option("--causal/--no-causal", default=None, help="Default: both.")
@click.option("--dtype", type=click.Choice(("bf16", "fp16")), default="bf16", show_default=True)
@click.option("--dropout", "dropout_p", type=click.FloatRange(min=0, max=1, max_open=True), default=0.0,
              show_default=True, help="Attention dropout probability of every problem (and of the SDPA runs).")
@click.option("--deterministic", is_flag=True,
              help="cuflash2's backward with deterministic=True (the same bits every run); SDPA runs as it is.")
@click.option("--compare", default=None, callback=parse_compare, metavar="NAME[,NAME...]",
              help=f"Comma list of torch SDPA backends to time beside cuflash2: {', '.join(COMPARE_CHOICES)}.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Time every implementation once per round, in an order that rotates between rounds, and "
                   "keep its median round (--decode has interleaved rounds of its own).")
@click.option("--flush-l2", is_flag=True, help="Overwrite twice the L2's size before each timed call.")
@click.option("--sustain", "sustain_s", type=click.FloatRange(min=0), default=0.0, metavar="SECONDS",
              help="Time each implementation by back-to-back calls for SECONDS per round instead of --repeats "
                   "samples, as a training loop loads the GPU (large problems reach the board's power limit "
                   "within a second and run at a lower clock), and report its mean SM clock and power.")
@click.option("--peak", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Peak TFLOP/s for '% peak' (default: datasheet figure for the GPU, else a measured GEMM).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the chosen format to FILE (the table still goes to stdout).")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Save TFLOP/s against seqlen to FILE.png (needs matplotlib).")
@click.option("--decode", is_flag=True,
              help="Decoding benchmark instead: one query token against a KV cache (32 query / 8 kv heads, "
                   "head dim 128), GB/s of K+V read; --seqlen sets the cache lengths (default 2k,8k,32k,64k), "
                   "--batch one batch size (default 1, 16 and 64).")
def bench_command(mode, batch, seqlens, seqlen_k, heads, heads_kv, head_dims, causal, dtype, dropout_p, deterministic,
                  compare, warmup, repeats, rounds, flush_l2, sustain_s, peak, fmt, output, plot, decode) -> None:
    """Measure TFLOP/s and % of peak, beside torch SDPA backends.

    The default grid is FA2's benchmark: model dim 2048 (heads = 2048 / head dim), batch x seqlen =
    16384 tokens for seqlen 512..16384, head dims 64, 128, 256, causal and not, bf16. FLOPs follow
    FA2's convention (backward 2.5x, forward+backward 3.5x the forward count). --seqlen-k and
    --heads-kv give cross-attention lengths and GQA; causal masks are aligned bottom-right (FA2's
    convention), so torch SDPA, which aligns them top-left, is not timed on causal problems with
    seqlen != seqlen_k.
    """
    if deterministic and mode == "fwd":
        raise click.UsageError("--deterministic changes the backward only: use it with --mode bwd or fwd+bwd")
    if sustain_s and flush_l2:
        raise click.UsageError("--sustain times back-to-back calls, which --flush-l2 would interrupt: use one")
    if decode:
        if sustain_s:
            raise click.UsageError("--sustain does not apply to --decode (its interleaved rounds time "
                                   "--repeats samples)")
        if seqlen_k or heads_kv:
            raise click.UsageError("--seqlen-k and --heads-kv do not apply to --decode (its cache lengths are "
                                   "--seqlen, its heads fixed at 32 query / 8 kv)")
        _decode(batch, seqlens, dtype, compare, warmup, repeats, fmt, output)
        return
    try:
        problems = bench_run.problem_grid(mode, dtype, seqlens or bench_run.DEFAULT_SEQLENS,
                                          head_dims or bench_run.DEFAULT_HEAD_DIMS,
                                          (False, True) if causal is None else (causal,), batch, heads, seqlen_k,
                                          heads_kv, dropout_p, deterministic)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    require_backward(mode)
    if plot:
        require_matplotlib()
    cp, reason = gpu.find_gpu()
    if cp is None:
        raise click.ClickException(gpu.no_gpu_error("bench", reason))
    if compare:
        require_torch()
    info = gpu.gpu_info(cp)
    peak_value, peak_source = bench_run.resolve_peak(cp, info.name, peak)
    settings = {"warmup": warmup, "repeats": repeats, "flush_bytes": _flush_bytes(cp, flush_l2), "sustain_s": sustain_s}
    rows = run_all(cp, problems, ["cuflash2", *compare], settings, peak_value, rounds)
    env = bench_run.environment(cp, info.name, info.arch, peak_value, peak_source, {**settings, "rounds": rounds})
    emit(rows, fmt, output, env)
    if plot:
        plot_results(rows, plot, f"{mode} {dtype} on {info.name}")
        click.echo(f"wrote {plot}", err=True)


DECODE_COLUMNS = [
    Column("impl", "impl", align="<"), Column("batch", "batch"), Column("kv_len", "kv len"),
    Column("ms", "ms", ".4f"), Column("gbps", "GB/s", ".0f"), Column("speedup", "cuflash2/x", ".2f"),
]


def _decode(batch, seqlens, dtype, compare, warmup, repeats, fmt, output) -> None:
    cp, reason = gpu.find_gpu()
    if cp is None:
        raise click.ClickException(gpu.no_gpu_error("bench", reason))
    if compare:
        require_torch()
    problems = decode_bench.decode_grid((batch,) if batch else decode_bench.DEFAULT_BATCHES,
                                        seqlens or decode_bench.DEFAULT_KV_LENS, dtype)
    rows = decode_bench.run_decode(cp, problems, compare, warmup, repeats)
    columns = DECODE_COLUMNS + ([ERROR_COLUMN] if any(r.get("error") for r in rows) else [])
    text = render(fmt, rows, columns, {"benchmark": "decode", "heads": decode_bench.HEADS,
                                       "kv_heads": decode_bench.KV_HEADS, "head_dim": decode_bench.HEAD_DIM})
    info = gpu.gpu_info(cp)
    context = (f"decode {dtype} on {info.name}: seqlen_q 1, {decode_bench.HEADS} query / {decode_bench.KV_HEADS} kv "
               f"heads, head dim {decode_bench.HEAD_DIM}; GB/s = K+V bytes / time; median of {decode_bench.ROUNDS} interleaved rounds "
               f"of {repeats} samples each")
    if output:
        with open(output, "w") as f:
            f.write(text)
        click.echo(render_table(rows, columns) + "\n" + context)
    else:
        click.echo(text + ("\n" + context if fmt == "table" else ""))
