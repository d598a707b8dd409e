"""Python cost per call of the ways to put a kernel behind torch autograd, with a trivial body (two
empty outputs) on CPU tensors, so only the dispatch is timed (no GPU needed):
    python benchmarks/bench_torch_dispatch.py
a torch.library custom op with registered autograd (what cuflash2's torch ops are), the same op
without gradients, a torch.autograd.Function, and the bare body.
"""

import time

import torch
from torch import Tensor


def body(q):
    return torch.empty(q.shape, dtype=q.dtype), torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("dispatch_bench::fwd", mutates_args=(), device_types="cpu")
def op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window_left: int, window_right: int,
       softcap: float, alibi: Tensor | None, dropout_p: float, seed: int, deterministic: bool) -> tuple[Tensor, Tensor]:
    return body(q)


@op.register_fake
def _(q, *rest):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)


op.register_autograd(lambda ctx, dout, dlse: (None,) * 12, setup_context=_setup)


class Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, *options):
        out, lse = body(q)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return (None,) * 12


def per_call_us(fn, calls=20000):
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    q, k, v = (torch.randn(2, 16, 4, 8, requires_grad=True) for _ in range(3))
    args = (q, k, v, 0.1, True, -1, -1, 0.0, None, 0.0, 0, False)
    print(f"torch {torch.__version__}")
    print(f"custom op + autograd, inputs requiring grad  {per_call_us(lambda: op(*args)):7.1f} us/call")
    with torch.no_grad():
        print(f"custom op, no grad                           {per_call_us(lambda: op(*args)):7.1f} us/call")
    print(f"torch.autograd.Function, requiring grad      {per_call_us(lambda: Function.apply(*args)):7.1f} us/call")
    print(f"bare body                                    {per_call_us(lambda: body(q)):7.1f} us/call")


if __name__ == "__main__":
    main()
