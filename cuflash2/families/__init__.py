"""Kernel families: each one a set of kernels with its tile tables, planners and launches.

The core asks `family_for(arch, problem, direction)` which family runs a call and calls that
family's entry point for the direction with the problem description, the described device tensors
and the stream. A family is an object with:

    name: str
    unsupported_reason(arch: int, problem: AttentionProblem, direction: str, tensors=(),
                       deterministic=False) -> str                          # "": it runs the call
    supports(...same arguments...) -> bool                                  # not unsupported_reason
    describe(problem, direction: str, sm_count: int) -> str                 # its plan for the call
    forward(problem, q, k, v, out, lse, device_id: int, stream) -> None     # "forward"
    backward(problem, dout, q, k, v, out, lse, dq, dk, dv, device_id, stream,
             deterministic) -> None                                         # "backward"
    kvcache(cache, tensors, causal, features, interleaved, num_splits, aligns, device_id,
            stream) -> None, paged_forward(...) -> None                     # "kvcache"

(only the entry points of the directions its `supports` accepts; q, k, ... are described tensors,
cuflash2.runtime.tensors.TensorInfo, and stream a CuPy stream; `tensors` lists (name, TensorInfo)
of the call's 16-bit tensors where the caller has them, for families whose copies need a layout,
and is empty when only the problem is known, as for `cuflash2 info`), plus `all_configs(arch)`, the
instantiations it compiles, and `compile_configs(arch, dims, dtypes, kinds)`, those `cuflash2
compile` builds for these head dims, dtypes ("bf16", "fp16") and kinds ("fwd", "bwd"). A new
family is a subpackage here whose FAMILY object is added to FAMILIES (the most preferred first).
Entry points launch through cuflash2.runtime.launcher, which is what lets cuflash2.core.replay
record and replay their launches.

Families are tried in the order of FAMILIES: the first that supports a call runs it. The
environment variable CUFLASH2_FAMILY (auto, the default, or a family's name) puts one family
first: it then runs every call it supports, and the others go to the usual choice.
"""

from __future__ import annotations

import os

from ..problem.features import AttentionProblem
from . import mma_sync, wgmma

FAMILY_VARIABLE = "CUFLASH2_FAMILY"
DIRECTIONS = ("forward", "backward", "kvcache")
#: Registered families, most preferred first: the Hopper family runs what it supports on sm_90.
FAMILIES: tuple = (wgmma.FAMILY, mma_sync.FAMILY)


def family_names() -> tuple[str, ...]:
    return tuple(family.name for family in FAMILIES)


def forced_family() -> str:
    """The family named by CUFLASH2_FAMILY ("auto" when unset or empty)."""
    value = os.environ.get(FAMILY_VARIABLE, "").strip() or "auto"
    if value != "auto" and value not in family_names():
        expected = ", ".join(("auto",) + family_names())
        raise ValueError(f"{FAMILY_VARIABLE}: expected one of {expected}, got {value!r}")
    return value


def passed_over(arch: int, problem: AttentionProblem, direction: str, deterministic: bool = False) -> list:
    """(name, reason) of each family tried before the one that runs `problem` in `direction` on
    `arch` (family_for), in the order tried: why a call does not run on a faster family."""
    skipped = []
    for family in candidates():
        reason = family.unsupported_reason(arch, problem, direction, (), deterministic)
        if not reason:
            break
        skipped.append((family.name, reason))
    return skipped


def compile_configs(arch: int, dims: list[int], dtypes: list[str], kinds: tuple[str, ...] = ("fwd", "bwd")) -> list:
    """Every instantiation the families launch on `arch` for these head dims and dtypes, sorted by
    name (what `cuflash2 compile` builds)."""
    unique: dict = {}
    for family in FAMILIES:
        unique.update(dict.fromkeys(family.compile_configs(arch, dims, dtypes, kinds)))
    return sorted(unique, key=lambda config: config.short_id())


def environment() -> tuple:
    """The environment variables the choice of kernels depends on, as set now (recorded launches
    hold the kernels chosen when they were recorded, so replays are dropped when this changes)."""
    get = os.environ.get
    return (get(FAMILY_VARIABLE, ""), get(wgmma.HANG_CHECK_VARIABLE, ""), get(wgmma.ZERO_TMA_SCRATCH_VARIABLE, ""),
            get(wgmma.SPLIT_TAIL_VARIABLE, ""), get(wgmma.KV_CLUSTERS_VARIABLE, ""))


def candidates() -> tuple:
    """The families in the order they are tried (the forced one first)."""
    forced = forced_family()
    if forced == "auto":
        return FAMILIES
    return tuple(sorted(FAMILIES, key=lambda family: family.name != forced))


def family_for(arch: int, problem: AttentionProblem, direction: str, tensors=(), deterministic: bool = False):
    """The family that runs `problem` in `direction` ("forward", "backward" or "kvcache") on a GPU
    of compute capability `arch` (90 for sm_90); `tensors`: (name, TensorInfo) of the call's
    tensors when known; `deterministic`: a backward that must give the same bits run to run."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected one of {', '.join(DIRECTIONS)}, got {direction!r}")
    for family in candidates():
        if family.supports(arch, problem, direction, tensors, deterministic):
            return family
    raise ValueError(f"arch: no kernel family runs {direction} attention on sm_{arch} (families: "
                     f"{', '.join(family_names())})")


__all__ = ["DIRECTIONS", "FAMILIES", "FAMILY_VARIABLE", "candidates", "compile_configs", "environment", "family_for",
           "family_names", "forced_family", "passed_over"]
