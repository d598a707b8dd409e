"""Measurements behind `cuflash2 bench`: problem grid, runners (cuflash2, torch SDPA), peak, environment."""

from __future__ import annotations

import dataclasses
import datetime
import pathlib
import subprocess
import time

from cuflash2 import bench

MODEL_DIM = 2048
TOKENS = 16384
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HEAD_DIMS = (64, 128, 256)
SDPA_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                 "torch-efficient": "EFFICIENT_ATTENTION"}
GEMM_N = 8192
SKIPPED = "skipped: "  # error-column prefix of a comparison that would not measure the same problem


class NotComparable(ValueError):
    """This implementation would compute a different problem (reported as skipped, not failed)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    mode: str
    dtype: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    seqlen_k: int = 0  # key/value length; 0: seqlen
    heads_kv: int = 0  # key/value heads (GQA / MQA); 0: heads
    dropout_p: float = 0.0  # attention dropout (cuflash2 with a fixed seed, SDPA from torch's generator)
    deterministic: bool = False  # cuflash2's deterministic backward (SDPA's backends run as they are)

    def __post_init__(self):
        object.__setattr__(self, "seqlen_k", self.seqlen_k or self.seqlen)
        object.__setattr__(self, "heads_kv", self.heads_kv or self.heads)

    @property
    def flops(self) -> float:
        return bench.attention_flops(self.batch, self.seqlen, self.seqlen_k, self.heads, self.head_dim, self.causal,
                                     self.mode)

    def label(self) -> str:
        kv = (f" k{self.seqlen_k}" if self.seqlen_k != self.seqlen else "") + (
            f" hkv{self.heads_kv}" if self.heads_kv != self.heads else "")
        return (f"{self.mode} d{self.head_dim} s{self.seqlen}{kv} b{self.batch} h{self.heads}"
                f"{' causal' if self.causal else ''}{f' dropout {self.dropout_p:g}' if self.dropout_p else ''}"
                f"{' deterministic' if self.deterministic else ''}")

    def fields(self) -> dict:
        return dataclasses.asdict(self)


def problem_grid(mode, dtype, seqlens, head_dims, causals, batch=None, heads=None, seqlen_k=None,
                 heads_kv=None, dropout_p=0.0, deterministic=False) -> list[Problem]:
    """FA2's benchmark grid: batch * seqlen = 16k tokens, nheads * head_dim = 2048, unless given.
    `seqlen_k` fixes the key length of every problem, `heads_kv` the key/value heads (GQA), which
    must divide every problem's query heads (ValueError otherwise)."""
    problems = [Problem(mode, dtype, batch or max(1, TOKENS // seqlen), seqlen, heads or max(1, MODEL_DIM // head_dim),
                        head_dim, causal, seqlen_k or 0, heads_kv or 0, dropout_p, deterministic)
                for head_dim in head_dims for causal in causals for seqlen in seqlens]
    for p in problems:
        if p.heads % p.heads_kv:
            raise ValueError(f"heads_kv: expected a divisor of the query heads ({p.heads} at head dim "
                             f"{p.head_dim}), got {p.heads_kv}")
    return problems


# --------------------------------------------------------------------------------------------
# Inputs and runners
# --------------------------------------------------------------------------------------------

def random_array(cp, shape, dtype: str):
    """Random normal CuPy array of fp16 / bf16 made on the GPU (bf16 by rounding fp32 bits)."""
    from cuflash2.checks import host_dtype, round_to

    x = cp.random.standard_normal(shape, dtype=cp.float32)
    if dtype == "fp16":
        return x.astype(cp.float16)
    bits = (round_to(cp, x, "bfloat16").view(cp.uint32) >> 16).astype(cp.uint16)
    return bits.view(host_dtype("bf16"))


def make_inputs(cp, p: Problem):
    q_shape, kv_shape = (p.batch, p.seqlen, p.heads, p.head_dim), (p.batch, p.seqlen_k, p.heads_kv, p.head_dim)
    return [random_array(cp, shape, p.dtype) for shape in (q_shape, kv_shape, kv_shape, q_shape)]  # q, k, v, dout


def cuflash2_runner(p: Problem, q, k, v, dout):
    import cuflash2

    options = {"causal": p.causal}
    if p.dropout_p:
        options.update(dropout_p=p.dropout_p, dropout_seed=1234)

    def fwd():
        return cuflash2.flash_attn_forward(q, k, v, **options)

    if p.mode == "fwd":
        return fwd
    backward_options = {**options, "deterministic": p.deterministic}
    if p.mode == "bwd":
        out, lse = fwd()
        return lambda: cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **backward_options)
    return lambda: cuflash2.flash_attn_backward(dout, q, k, v, *fwd(), **backward_options)


def torch_runner(impl: str, p: Problem, q, k, v, dout):
    """torch SDPA with one backend on the same data, as (b, h, s, d) views; backward through autograd."""
    if p.causal and p.seqlen != p.seqlen_k:
        raise NotComparable("torch SDPA's is_causal aligns the mask top-left, cuflash2 (like FA2) bottom-right: "
                            "not the same problem when seqlen_q != seqlen_k")
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[impl])
    gqa = {"enable_gqa": True} if p.heads_kv != p.heads else {}
    leaves = [torch.from_dlpack(x).detach().requires_grad_(p.mode != "fwd") for x in (q, k, v)]
    qt, kt, vt = (x.transpose(1, 2) for x in leaves)
    grad = torch.from_dlpack(dout).transpose(1, 2)

    def fwd():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=p.causal,
                                                                    dropout_p=p.dropout_p, **gqa)

    def backward(out, retain):
        for x in leaves:
            x.grad = None  # no gradient accumulation in the timed region (as FA2's benchmark)
        out.backward(grad, retain_graph=retain)

    if p.mode == "fwd":
        return fwd
    if p.mode == "bwd":
        out = fwd()
        return lambda: backward(out, True)
    return lambda: backward(fwd(), False)


def make_runner(impl: str, p: Problem, inputs):
    return cuflash2_runner(p, *inputs) if impl == "cuflash2" else torch_runner(impl, p, *inputs)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Timing:
    first_call_s: float  # compile + load + one run (wall clock)
    ms: float  # median of CUDA-event timings after warm-up, or the mean of a sustained run
    sm_clock_mhz: float | None = None  # sustained runs: mean SM clock past the first bench.SETTLE_S
    power_w: float | None = None  # sustained runs: mean board power past the first bench.SETTLE_S


def measure(cp, fn, warmup: int, repeats: int, flush_bytes: int, sustain_s: float = 0.0) -> Timing:
    """The first call's wall time, then either `repeats` CUDA-event samples or, with `sustain_s`,
    one run of back-to-back calls that long, with the board's mean SM clock and power (None where
    NVML cannot be read)."""
    device = cp.cuda.Device()
    device.synchronize()
    start = time.perf_counter()
    fn()
    device.synchronize()
    first = time.perf_counter() - start
    if not sustain_s:
        return Timing(first, bench.time_cuda_ms(fn, warmup, repeats, flush_bytes))
    return Timing(first, *bench.sustained_run(fn, sustain_s, device.pci_bus_id, warmup))


def run_one(cp, impl: str, p: Problem, inputs, settings: dict, peak: float | None) -> dict:
    """One (problem, implementation) measurement as a result row; failures become an 'error' entry."""
    row = {"impl": impl, **p.fields(), "flops": p.flops}
    try:
        timing = measure(cp, make_runner(impl, p, inputs), **settings)
    except NotComparable as exc:
        return {**row, "error": SKIPPED + str(exc)}
    except Exception as exc:  # an unavailable backend for this shape must not stop the run
        cp.cuda.Device().synchronize()
        return {**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"}
    tflops = p.flops / timing.ms / 1e9
    board = {"sm_clock_mhz": timing.sm_clock_mhz, "power_w": timing.power_w} if settings.get("sustain_s") else {}
    return {**row, "first_call_s": timing.first_call_s, "ms": timing.ms, "tflops": tflops,
            "pct_peak": 100.0 * tflops / peak if peak else None, **board}


def median_round(rows: list[dict]) -> dict:
    """One implementation's rows of the same problem, one per round: the round with the median run
    time (the lower middle one for an even count), keeping the first round's first-call time (the
    only one that includes compilation). An error in any round is the result."""
    failed = [r for r in rows if r.get("error")]
    if failed:
        return failed[0]
    chosen = sorted(rows, key=lambda r: r["ms"])[(len(rows) - 1) // 2]
    return {**chosen, "first_call_s": rows[0]["first_call_s"]}


def add_speedups(rows: list[dict]) -> None:
    """speedup = cuflash2 TFLOP/s / this implementation's, for rows of the same problem."""
    keys = ("mode", "dtype", "batch", "seqlen", "seqlen_k", "heads", "heads_kv", "head_dim", "causal")
    ours = {tuple(r[k] for k in keys): r.get("tflops") for r in rows if r["impl"] == "cuflash2"}
    for r in rows:
        mine = ours.get(tuple(r[k] for k in keys))
        r["speedup"] = mine / r["tflops"] if mine and r.get("tflops") and r["impl"] != "cuflash2" else None


# --------------------------------------------------------------------------------------------
# Peak and environment
# --------------------------------------------------------------------------------------------

def measure_gemm_tflops(cp) -> tuple[float, str]:
    """Dense GEMM TFLOP/s with cupy.matmul (bf16, fp16 where CuPy cannot multiply bf16)."""
    for dtype in ("bf16", "fp16"):
        try:
            a, b = (random_array(cp, (GEMM_N, GEMM_N), dtype) for _ in range(2))
            ms = bench.time_cuda_ms(lambda: cp.matmul(a, b), warmup=3, repeats=10)
            return 2.0 * GEMM_N ** 3 / ms / 1e9, f"measured: {dtype} GEMM {GEMM_N}^3 with cupy.matmul"
        except Exception:  # bf16 matmul unsupported by this CuPy: try fp16
            continue
    return None, "unknown (GEMM measurement failed)"


def resolve_peak(cp, gpu_name: str, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "--peak"
    peak, source = bench.peak_tflops(gpu_name)
    if peak is not None:
        return peak, source
    return measure_gemm_tflops(cp)


def git_commit() -> str | None:
    """Commit of the source checkout cuflash2 runs from (None for an installed wheel or without git)."""
    import cuflash2

    root = pathlib.Path(cuflash2.__file__).resolve().parent.parent

    def git(*args):
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=5)
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or pathlib.Path(top).resolve() != root:  # a repo around site-packages is not ours
            return None
        head = git("rev-parse", "HEAD")
        if not head:
            return None
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(cp, gpu_name: str, arch: str, peak: float | None, peak_source: str, settings: dict) -> dict:
    import sys

    import cuflash2

    torch = sys.modules.get("torch")
    return {"gpu": gpu_name, "arch": arch, "cuflash2": cuflash2.__version__, "git_commit": git_commit(),
            "cupy": cp.__version__, "torch": getattr(torch, "__version__", None),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "peak_tflops": peak, "peak_source": peak_source, **settings}
