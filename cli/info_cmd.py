"""`cuflash2 info`: the GPU, the toolchain, the interop frameworks and the kernel cache."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib

import click

from . import gpu

FRAMEWORKS = (("torch", "torch"), ("jax", "jax"))  # (module, distribution)
#: The problem whose kernel family `info` reports unless its options describe another: (batch,
#: seqlen, heads, head dim, causal), bf16.
FAMILY_PROBLEM = (2, 512, 8, 128, True)
#: The arch the family choice is shown for when there is no GPU (and no --arch).
DEFAULT_ARCH = 90
#: SMs the forward's plan is shown for without a GPU of the chosen arch (an H100 or H200 SXM).
DEFAULT_SM_COUNT = 132


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def framework_status(module: str, dist: str) -> str:
    """Version of an interop framework, found without importing it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "not installed"
    return _dist_version(dist) or "installed (version unknown)"


def kernel_cache_dir() -> pathlib.Path:
    """CuPy's on-disk kernel cache (where compiled cuflash2 kernels live)."""
    return pathlib.Path(os.environ.get("CUPY_CACHE_DIR") or pathlib.Path.home() / ".cupy" / "kernel_cache")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cache_summary(path: pathlib.Path) -> str:
    if not path.is_dir():
        return f"{path} (empty: not created yet)"
    files = [p for p in path.rglob("*") if p.is_file()]
    return f"{path} ({len(files)} files, {_human_bytes(sum(p.stat().st_size for p in files))})"


def _safe(fn, *args) -> str:
    try:
        return str(fn(*args))
    except Exception as exc:  # info must never fail: report the problem as the value
        return f"unavailable ({type(exc).__name__}: {exc})"


def _gpu_section(cp) -> list[tuple[str, str]]:
    info = gpu.gpu_info(cp)
    return [("device", f"{info.name} (cuda:{info.device_id}, {cp.cuda.runtime.getDeviceCount()} visible)"),
            ("compute capability", f"{info.major}.{info.minor} ({info.arch})"),
            ("SMs", str(info.sm_count)),
            ("max dynamic smem", f"{info.smem_optin_bytes // 1024} KiB per block ({info.smem_optin_bytes} B)"),
            ("L2 cache", _human_bytes(info.l2_bytes)),
            ("memory", _human_bytes(info.memory_bytes))]


def _cuda_versions(cp) -> list[tuple[str, str]]:
    def nvrtc():
        major, minor = cp.cuda.nvrtc.getVersion()
        return f"{major}.{minor}"

    return [("CUDA driver", _safe(lambda: gpu.cuda_version(cp.cuda.runtime.driverGetVersion()))),
            ("CUDA runtime", _safe(lambda: gpu.cuda_version(cp.cuda.runtime.runtimeGetVersion()))),
            ("NVRTC", _safe(nvrtc)),
            ("CuPy", cp.__version__)]


def _peak(gpu_name: str | None) -> str:
    from cuflash2 import bench

    if gpu_name is None:
        return "n/a (no GPU)"
    peak, source = bench.peak_tflops(gpu_name)
    if peak is None:
        return f"unknown ({source}): `cuflash2 bench` measures a bf16 GEMM instead, or pass --peak"
    return f"{peak:g} TFLOP/s ({source})"


def default_problem():
    """FAMILY_PROBLEM as an AttentionProblem."""
    from cuflash2.problem.features import AttentionProblem
    from cuflash2.problem.tensors import AttentionShape

    batch, seqlen, heads, head_dim, causal = FAMILY_PROBLEM
    return AttentionProblem(AttentionShape(batch, seqlen, seqlen, heads, heads, head_dim, "bfloat16",
                                           head_dim ** -0.5), causal)


def describe_problem(problem) -> str:
    """A problem in words: its shape, mask, score changes and dtype."""
    s, f = problem.shape, problem.features
    lengths = f"seqlen {s.seqlen_q}" if s.seqlen_q == s.seqlen_k else f"seqlen {s.seqlen_q} x {s.seqlen_k}"
    heads = f"{s.nheads} heads" if s.nheads == s.nheads_kv else f"{s.nheads} / {s.nheads_kv} heads"
    extras = [f"window ({f.window_left}, {f.window_right})" if (f.window_left, f.window_right) != (-1, -1) else "",
              f"softcap {f.softcap:g}" if f.softcap else "", "ALiBi" if f.alibi is not None else "",
              f"dropout {f.dropout_p:g}" if f.dropout_p else ""]
    return ", ".join([f"batch {s.batch}", lengths, heads, f"head dim {s.head_dim}",
                      "causal" if problem.causal else "not causal", *filter(None, extras),
                      {"bfloat16": "bf16", "float16": "fp16"}.get(s.dtype, s.dtype)])


def family_choice(arch: int, problem=None, deterministic: bool = False, sm_count: int = DEFAULT_SM_COUNT) -> dict:
    """Which kernel family runs each direction of `problem` (default: FAMILY_PROBLEM) on `arch`, why
    the families tried before it do not (passed_over), the forward's plan where its family has one,
    and the variable that can force a family (an invalid value is reported as the value, not
    raised: info never fails)."""
    from cuflash2 import families

    problem = problem or default_problem()
    choice = {"arch": arch, "variable": os.environ.get(families.FAMILY_VARIABLE, "") or "auto",
              "problem": describe_problem(problem), "passed_over": {}, "forward_plan": None}
    for direction in families.DIRECTIONS:
        try:
            family = families.family_for(arch, problem, direction, deterministic=deterministic)
        except ValueError as exc:
            choice[direction] = f"unavailable ({exc})"
            continue
        choice[direction] = family.name
        choice["passed_over"][direction] = [
            {"family": name, "reason": reason}
            for name, reason in families.passed_over(arch, problem, direction, deterministic)]
        if direction == "forward":
            choice["forward_plan"] = _safe(family.describe, problem, direction, sm_count) or None
    return choice


def _arch_of(cp, arch: int | None) -> tuple[int, str]:
    """(arch, where it comes from): --arch, the local GPU, or DEFAULT_ARCH without one."""
    if arch is not None:
        return arch, "--arch"
    if cp is not None:
        info = gpu.gpu_info(cp)
        return info.major * 10 + info.minor, "this GPU"
    return DEFAULT_ARCH, "no GPU: the default"


def _sm_count(cp, arch: int) -> int:
    """The local GPU's SMs when it is of `arch`, else DEFAULT_SM_COUNT."""
    if cp is not None:
        info = gpu.gpu_info(cp)
        if info.major * 10 + info.minor == arch:
            return info.sm_count
    return DEFAULT_SM_COUNT


def _family_section(cp, arch: int | None, problem=None, deterministic: bool = False) -> list[tuple[str, str]]:
    arch, source = _arch_of(cp, arch)
    choice = family_choice(arch, problem, deterministic, _sm_count(cp, arch))
    rows = [("problem", f"{choice['problem']} on sm_{arch} ({source})"),
            ("CUFLASH2_FAMILY", choice["variable"])]
    for direction in ("forward", "backward", "kvcache"):
        skipped = "; ".join(f"{entry['family']}: {entry['reason']}" for entry in choice["passed_over"].get(direction, []))
        rows.append((direction, f"{choice[direction]} ({skipped})" if skipped else choice[direction]))
        if direction == "forward" and choice["forward_plan"]:
            rows.append(("forward plan", choice["forward_plan"]))
    return rows


def collect(arch: int | None = None, problem=None, deterministic: bool = False) -> list[tuple[str, list[tuple[str, str]]]]:
    """Sections of (key, value) pairs; works without a GPU and without CuPy. `problem` (default:
    FAMILY_PROBLEM) and `deterministic` (its backward) are what the kernel families section is for."""
    import cuflash2
    from cuflash2.runtime import compiler

    cp, reason = gpu.find_gpu()
    try:
        import cupy
    except ImportError:
        cupy = None
    gpu_name = gpu.gpu_info(cp).name if cp is not None else None
    backward = "available" if hasattr(cuflash2, "flash_attn_backward") else "not in this version"
    sections = [("cuflash2", [("version", cuflash2.__version__), ("backward", backward),
                              ("kernel sources hash", _safe(compiler.sources_hash)),
                              ("kernel cache", cache_summary(kernel_cache_dir()))])]
    sections.append(("GPU", _gpu_section(cp) if cp is not None else [("device", f"none: {reason}")]))
    versions = _cuda_versions(cupy) if cupy is not None else [("CuPy", "not installed")]
    versions += [("NumPy", _dist_version("numpy") or "?"), ("ml_dtypes", framework_status("ml_dtypes", "ml_dtypes"))]
    sections.append(("Versions", versions))
    sections.append(("Interop", [(module, framework_status(module, dist)) for module, dist in FRAMEWORKS]))
    sections.append(("Utilisation", [("peak", _peak(gpu_name))]))
    sections.append(("Kernel families", _family_section(cp, arch, problem, deterministic)))
    return sections


def _or_none(fn, *args):
    try:
        return fn(*args)
    except Exception:  # info must never fail: an unknown value is null
        return None


def cache_facts(path: pathlib.Path) -> dict:
    """The kernel cache as separate fields: its path, whether it exists, file count and bytes."""
    if not path.is_dir():
        return {"path": str(path), "exists": False, "files": 0, "size_bytes": 0}
    files = [p for p in path.rglob("*") if p.is_file()]
    return {"path": str(path), "exists": True, "files": len(files),
            "size_bytes": sum(p.stat().st_size for p in files)}


def _framework_facts(module: str, dist: str) -> dict:
    status = framework_status(module, dist)
    installed = status != "not installed"
    return {"installed": installed, "version": _dist_version(dist) if installed else None}


def collect_json(arch: int | None = None, problem=None, deterministic: bool = False) -> dict:
    """The facts of `cuflash2 info` for machines: snake_case keys, numbers and booleans as such,
    null where a value is absent or unknown, paths and sizes as separate fields."""
    import cuflash2
    from cuflash2 import bench
    from cuflash2.runtime import compiler

    cp, reason = gpu.find_gpu()
    try:
        import cupy
    except ImportError:
        cupy = None
    gpu_facts = {"available": cp is not None, "reason": reason or None, "device_id": None, "name": None,
                 "visible_devices": None, "compute_capability_major": None, "compute_capability_minor": None,
                 "arch": None, "sm_count": None, "max_dynamic_smem_bytes": None, "l2_cache_bytes": None,
                 "memory_bytes": None}
    peak = {"tflops": None, "source": None}
    if cp is not None:
        info = gpu.gpu_info(cp)
        gpu_facts.update(device_id=info.device_id, name=info.name,
                         visible_devices=_or_none(cp.cuda.runtime.getDeviceCount),
                         compute_capability_major=info.major, compute_capability_minor=info.minor, arch=info.arch,
                         sm_count=info.sm_count, max_dynamic_smem_bytes=info.smem_optin_bytes,
                         l2_cache_bytes=info.l2_bytes, memory_bytes=info.memory_bytes)
        value, source = bench.peak_tflops(info.name)
        peak = {"tflops": value, "source": source}

    def version(fn):
        text = _or_none(fn)
        return None if text in (None, "none") else str(text)

    versions = {"cupy": None, "cuda_driver": None, "cuda_runtime": None, "nvrtc": None}
    if cupy is not None:
        versions.update(
            cupy=cupy.__version__,
            cuda_driver=version(lambda: gpu.cuda_version(cupy.cuda.runtime.driverGetVersion())),
            cuda_runtime=version(lambda: gpu.cuda_version(cupy.cuda.runtime.runtimeGetVersion())),
            nvrtc=version(lambda: "{}.{}".format(*cupy.cuda.nvrtc.getVersion())))
    versions.update(numpy=_dist_version("numpy"), ml_dtypes=_dist_version("ml_dtypes"))
    kernel_dir = _or_none(compiler.kernel_dir)
    family_arch = _arch_of(cp, arch)[0]
    return {
        "cuflash2": {"version": cuflash2.__version__, "backward_available": hasattr(cuflash2, "flash_attn_backward"),
                     "kernel_sources_hash": _or_none(compiler.sources_hash),
                     "kernel_sources_path": str(kernel_dir) if kernel_dir is not None else None},
        "kernel_cache": cache_facts(kernel_cache_dir()),
        "gpu": gpu_facts,
        "versions": versions,
        "interop": {module: _framework_facts(module, dist) for module, dist in FRAMEWORKS},
        "peak": peak,
        "families": family_choice(family_arch, problem, deterministic, _sm_count(cp, family_arch)),
    }


def render_sections(sections) -> str:
    width = max(len(key) for _, pairs in sections for key, _ in pairs)
    lines = []
    for title, pairs in sections:
        lines.append(title)
        lines += [f"  {key:<{width}}  {value}" for key, value in pairs]
    return "\n".join(lines) + "\n"


def problem_from_options(batch: int, seqlen: int, seqlen_k: int | None, heads: int, heads_kv: int | None,
                         head_dim: int, causal: bool, dtype: str, window: str | None, softcap: float, alibi: bool,
                         dropout: float):
    """The AttentionProblem the options describe (click.BadParameter naming the option when they do
    not describe one)."""
    from cuflash2.problem.features import AttentionProblem, Features
    from cuflash2.problem.tensors import AttentionShape, contiguous_info

    heads_kv = heads if heads_kv is None else heads_kv
    if heads % heads_kv:
        raise click.BadParameter(f"expected a divisor of --heads ({heads}), got {heads_kv}", param_hint="--heads-kv")
    left = right = -1
    if window is not None:
        try:
            left, right = (int(x) for x in window.split(","))
        except ValueError:
            raise click.BadParameter(f"expected LEFT,RIGHT (ints, -1 = unbounded), got {window!r}",
                                     param_hint="--window") from None
        if min(left, right) < -1:
            raise click.BadParameter(f"expected entries >= -1, got {window!r}", param_hint="--window")
    features = Features(window_left=left, window_right=right, softcap=softcap, dropout_p=dropout,
                        alibi=contiguous_info((heads,), "float32", 4, "", 0) if alibi else None)
    shape = AttentionShape(batch, seqlen, seqlen if seqlen_k is None else seqlen_k, heads, heads_kv, head_dim,
                           {"bf16": "bfloat16", "fp16": "float16"}[dtype], head_dim ** -0.5)
    return AttentionProblem(shape, causal, features)


@click.command("info")
@click.option("--json", "as_json", is_flag=True,
              help="Print the facts as JSON for machines: snake_case keys, numbers and booleans as such, null "
                   "where absent, paths and sizes in separate fields.")
@click.option("--arch", default=None, help="Show the kernel family choice for this arch, e.g. sm_90 (default: the "
                                           "local GPU's, or sm_90 without one).")
@click.option("--batch", type=click.IntRange(min=1), default=FAMILY_PROBLEM[0], show_default=True,
              help="The problem the kernel families are shown for: batch size.")
@click.option("--seqlen", type=click.IntRange(min=1), default=FAMILY_PROBLEM[1], show_default=True,
              help="Query length.")
@click.option("--seqlen-k", type=click.IntRange(min=1), default=None, help="Key length (default: --seqlen).")
@click.option("--heads", type=click.IntRange(min=1), default=FAMILY_PROBLEM[2], show_default=True,
              help="Query heads.")
@click.option("--heads-kv", type=click.IntRange(min=1), default=None,
              help="Key/value heads (GQA / MQA; must divide --heads). Default: --heads.")
@click.option("--head-dim", type=click.IntRange(1, 256), default=FAMILY_PROBLEM[3], show_default=True)
@click.option("--causal/--no-causal", default=FAMILY_PROBLEM[4], show_default=True)
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True)
@click.option("--window", default=None, metavar="LEFT,RIGHT", help="Sliding window (-1 = unbounded side).")
@click.option("--softcap", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option("--alibi", is_flag=True, help="ALiBi slopes.")
@click.option("--dropout", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.0, show_default=True)
@click.option("--deterministic", is_flag=True, help="The backward with deterministic=True.")
def info_command(as_json: bool, arch: str | None, batch: int, seqlen: int, seqlen_k: int | None, heads: int,
                 heads_kv: int | None, head_dim: int, causal: bool, dtype: str, window: str | None, softcap: float,
                 alibi: bool, dropout: float, deterministic: bool) -> None:
    """Show the GPU, toolchain versions, interop frameworks, kernel cache, peak and kernel families.

    The kernel families section says which family runs each direction of a problem (by default a
    short bf16 causal one; the problem options describe another), why the families tried before it
    do not, and the forward's tile and walk where its family has a plan. Works without a GPU (and
    without CuPy) and says so.
    """
    arch_number = None
    if arch is not None:
        text = arch.strip().lower().removeprefix("sm_").removesuffix("a")
        if not text.isdigit() or int(text) < 80:
            raise click.BadParameter(f"expected an arch like sm_80 or sm_90 (>= sm_80), got {arch!r}",
                                     param_hint="--arch")
        arch_number = int(text)
    problem = problem_from_options(batch, seqlen, seqlen_k, heads, heads_kv, head_dim, causal, dtype, window, softcap,
                                   alibi, dropout)
    if as_json:
        click.echo(json.dumps(collect_json(arch_number, problem, deterministic), indent=2))
        return
    sections = collect(arch_number, problem, deterministic)
    click.echo(render_sections(sections), nl=False)
    if dict(sections[1][1])["device"].startswith("none"):
        click.echo("\nNo GPU: GPU kernels cannot run here; `cuflash2 check` runs the NumPy (CPU) checks only.")
