"""The wgmma kernel family (Hopper, sm_90a): a warp-specialised forward and backward on warpgroup
MMAs fed by TMA tensor copies (kernels_cu/wgmma/). On compute capability 9.0 it runs the dense
forward, plain or causal, and the dense backward at head dims 32-128 and 192-256 (multiples of 8);
every other call goes to the next family (mma_sync).

Modules: forward and backward (tiles, what each runs, the launches with their parameter structs).
"""

from __future__ import annotations

from ...problem.features import AttentionProblem
from ...problem.tensors import DTYPE_NAMES
from . import backward as backward_kernel
from . import forward as forward_kernel
from .backward import ZERO_TMA_SCRATCH_VARIABLE
from .forward import (HANG_CHECK_VARIABLE, KV_CLUSTERS_VARIABLE, SPLIT_TAIL_VARIABLE, WgmmaFwdConfig, all_configs as all_forward_configs,
                      forward_config, unsupported_reason)


class WgmmaFamily:
    """The dense forward and the head-dim-64/128 backward on sm_90 (forward.unsupported_reason and
    backward.unsupported_reason say what they leave to others)."""

    name = "wgmma"

    @staticmethod
    def unsupported_reason(arch: int, problem: AttentionProblem, direction: str, tensors=(),
                           deterministic: bool = False) -> str:
        if direction == "backward":
            return backward_kernel.unsupported_reason(arch, problem, deterministic, tensors)
        if direction == "forward":
            return unsupported_reason(arch, problem, tensors)
        return "runs no KV-cache calls: decoding is memory-bound, and the mma.sync kernels run it"

    @staticmethod
    def supports(arch: int, problem: AttentionProblem, direction: str, tensors=(), deterministic: bool = False) -> bool:
        return not WgmmaFamily.unsupported_reason(arch, problem, direction, tensors, deterministic)

    @staticmethod
    def describe(problem: AttentionProblem, direction: str, sm_count: int) -> str:
        """The forward's tile and walk for a call it runs on `sm_count` SMs ("" for the other
        directions)."""
        return forward_kernel.describe_plan(problem, sm_count) if direction == "forward" else ""

    @staticmethod
    def backward(problem: AttentionProblem, dout, q, k, v, out, lse, dq, dk, dv, device_id: int, stream,
                 deterministic: bool = False) -> None:
        backward_kernel.backward(problem, dout, q, k, v, out, lse, dq, dk, dv, device_id, stream, deterministic)

    @staticmethod
    def forward(problem: AttentionProblem, q, k, v, out, lse, device_id: int, stream) -> None:
        forward_kernel.forward(problem, q, k, v, out, lse, device_id, stream)

    @staticmethod
    def all_configs(arch: int) -> list:
        return all_forward_configs() + backward_kernel.all_configs() if arch == forward_kernel.ARCH else []

    @staticmethod
    def compile_configs(arch: int, dims: list[int], dtypes: list[str], kinds=("fwd", "bwd")) -> list:
        """The instantiations for these head dims (the forward: multiples of 8; the backward: 64, 128)
        and dtypes ("bf16", "fp16") on sm_90; none elsewhere."""
        if arch != forward_kernel.ARCH:
            return []
        configs = []
        if "fwd" in kinds:
            configs += forward_kernel.with_pairs(
                [forward_config(dim, DTYPE_NAMES[dtype], causal, seqlen=seqlen) for dim in dims
                 if dim % 8 == 0 and dim <= forward_kernel.MAX_HEAD_DIM
                 for dtype in dtypes for causal in (False, True) for seqlen in forward_kernel.SEQLEN_CLASSES])
        if "bwd" in kinds:
            names = {DTYPE_NAMES[dtype] for dtype in dtypes}
            configs += [c for c in backward_kernel.all_configs() if c.dtype in names and c.head_dim in dims]
        return list(dict.fromkeys(configs))


FAMILY = WgmmaFamily()

__all__ = ["FAMILY", "HANG_CHECK_VARIABLE", "KV_CLUSTERS_VARIABLE", "SPLIT_TAIL_VARIABLE", "ZERO_TMA_SCRATCH_VARIABLE", "WgmmaFamily", "WgmmaFwdConfig", "all_forward_configs", "forward_config",
           "unsupported_reason"]
