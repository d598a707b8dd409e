"""The wgmma kernel family (Hopper, sm_90a): a warp-specialised forward on warpgroup MMAs fed by
TMA tensor copies (kernels_cu/wgmma/). It runs the dense forward, plain or causal, on compute
capability 9.0; every other call goes to the next family (mma_sync).

Modules: forward (tiles, what it runs, the launch with its parameter struct).
"""

from __future__ import annotations

from ...problem.features import AttentionProblem
from ...problem.tensors import DTYPE_NAMES
from . import backward as backward_kernel
from .backward import ENABLE_VARIABLE as BACKWARD_VARIABLE
from . import forward as forward_kernel
from .forward import (HANG_CHECK_VARIABLE, WgmmaFwdConfig, all_configs as all_forward_configs, forward_config,
                      unsupported_reason)


class WgmmaFamily:
    """The dense forward on sm_90 (see forward.unsupported_reason for what it leaves to others)."""

    name = "wgmma"

    @staticmethod
    def supports(arch: int, problem: AttentionProblem, direction: str, tensors=(), deterministic: bool = False) -> bool:
        if direction == "backward":
            return not backward_kernel.unsupported_reason(arch, problem, deterministic, tensors)
        return direction == "forward" and not unsupported_reason(arch, problem, tensors)

    @staticmethod
    def backward(problem: AttentionProblem, dout, q, k, v, out, lse, dq, dk, dv, device_id: int, stream,
                 deterministic: bool = False) -> None:
        backward_kernel.backward(problem, dout, q, k, v, out, lse, dq, dk, dv, device_id, stream)

    @staticmethod
    def forward(problem: AttentionProblem, q, k, v, out, lse, device_id: int, stream) -> None:
        forward_kernel.forward(problem, q, k, v, out, lse, device_id, stream)

    @staticmethod
    def all_configs(arch: int) -> list:
        return all_forward_configs() + backward_kernel.all_configs() if arch == forward_kernel.ARCH else []

    @staticmethod
    def compile_configs(arch: int, dims: list[int], dtypes: list[str], kinds=("fwd", "bwd")) -> list:
        """The forward instantiations for these head dims (multiples of 8) and dtypes ("bf16",
        "fp16") on sm_90; none elsewhere or without "fwd" in `kinds`."""
        if arch != forward_kernel.ARCH or "fwd" not in kinds:
            return []
        return list(dict.fromkeys(forward_config(dim, DTYPE_NAMES[dtype], causal, seqlen=seqlen) for dim in dims
                                  if dim % 8 == 0 and dim <= forward_kernel.MAX_HEAD_DIM
                                  for dtype in dtypes for causal in (False, True)
                                  for seqlen in forward_kernel.SEQLEN_CLASSES))


FAMILY = WgmmaFamily()

__all__ = ["BACKWARD_VARIABLE", "FAMILY", "HANG_CHECK_VARIABLE", "WgmmaFamily", "WgmmaFwdConfig", "all_forward_configs", "forward_config",
           "unsupported_reason"]
