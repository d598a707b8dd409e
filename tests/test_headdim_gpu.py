"""Head dims that are not multiples of 8 (1 to 256) and layouts that are not 16-byte aligned, on the
GPU: the kernels' narrow vector widths (config.vector_width), against the float references of the
other GPU tests, with FA2's error rule."""

import numpy as np
import pytest

from attention_ref import stable_seed
from test_backward_gpu import check_backward
from test_features_gpu import VARLEN_CASES, test_varlen_matches_per_sequence_reference
from test_forward_gpu import check_forward, make_inputs
from test_kvcache_gpu import CASES as KVCACHE_CASES
from test_kvcache_gpu import test_kvcache_matches_numpy_path

pytestmark = pytest.mark.gpu

HEAD_DIMS = (1, 3, 59, 111, 200, 255)  # widths 2, 2, 2, 2, 16, 2 when contiguous
SEQLENS = ((1, 1), (113, 203), (203, 113), (257, 512))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward_and_backward_any_head_dim(head_dim, seqlens, causal, dtype):
    import cupy as cp

    sq, sk = seqlens
    seed = stable_seed("headdim", head_dim, sq, sk, causal, dtype)
    q, k, v = make_inputs(cp, 2, sq, sk, 4, 4, head_dim, dtype, seed)
    check_forward(cp, q, k, v, causal)
    (dout,) = make_inputs(cp, 2, sq, 1, 4, 1, head_dim, dtype, seed + 1)[:1]
    check_backward(cp, q, k, v, dout, causal)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS + (72, 100))
@pytest.mark.parametrize("heads,heads_kv", [(8, 2), (6, 1)])
def test_forward_and_backward_gqa_any_head_dim(heads, heads_kv, head_dim, causal, dtype):
    """GQA: the fp32 dK/dV accumulators with rows padded to 8 columns."""
    import cupy as cp

    seed = stable_seed("headdim-gqa", heads, heads_kv, head_dim, causal, dtype)
    q, k, v = make_inputs(cp, 2, 150, 190, heads, heads_kv, head_dim, dtype, seed)
    check_forward(cp, q, k, v, causal)
    (dout,) = make_inputs(cp, 2, 150, 1, heads, 1, head_dim, dtype, seed + 1)[:1]
    check_backward(cp, q, k, v, dout, causal)


@pytest.mark.parametrize("width,head_dim", [(64, 59), (64, 60), (64, 62), (128, 100), (256, 255)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True])
def test_column_views_of_wider_tensors(width, head_dim, causal):
    """q[..., :59] of a 64-wide tensor: 16-byte aligned rows, but the row ends inside a 16-byte chunk
    (the width then comes from head_dim * 2); columns past head_dim are never read (they hold NaN
    here) and never written (the gradients are views of wider buffers too)."""
    import cupy as cp

    import cuflash2

    seed = stable_seed("headdim-view", width, head_dim, causal)
    wide = make_inputs(cp, 2, 130, 170, 4, 2, width, "fp16", seed)
    for x in wide:
        x[..., head_dim:] = np.nan
    q, k, v = (x[..., :head_dim] for x in wide)
    out, lse = check_forward(cp, q, k, v, causal)
    (dout,) = make_inputs(cp, 2, 130, 1, 4, 1, head_dim, "fp16", seed + 1)[:1]
    check_backward(cp, q, k, v, dout, causal)
    grads = [cp.full(x.shape, 7, dtype=x.dtype) for x in wide]
    cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, dq=grads[0][..., :head_dim],
                                 dk=grads[1][..., :head_dim], dv=grads[2][..., :head_dim])
    for g in grads:
        assert bool((g[..., head_dim:] == 7).all()), "a column past head_dim was written"


@pytest.mark.parametrize("offset", [1, 2, 4])
def test_views_at_unaligned_offsets(offset):
    """Base pointers 2, 4 and 8 bytes past a 16-byte boundary (widths 2, 4 and 8), head dim 64."""
    import cupy as cp

    seed = stable_seed("headdim-offset", offset)
    q, k, v = (cp.ascontiguousarray(x) for x in make_inputs(cp, 2, 100, 120, 4, 4, 64, "bf16", seed))
    shifted = []
    for x in (q, k, v):
        flat = cp.empty(x.size + offset, dtype=x.dtype)
        view = flat[offset:].reshape(x.shape)
        view[...] = x
        shifted.append(view)
    check_forward(cp, *shifted, True)
    (dout,) = make_inputs(cp, 2, 100, 1, 4, 1, 64, "bf16", seed + 1)[:1]
    check_backward(cp, *shifted, dout, True)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("feature", ["plain", "causal", "all"])
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_head_dim_59(case, feature, dtype):
    test_varlen_matches_per_sequence_reference(case, feature, 59, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [59, 100])
@pytest.mark.parametrize("case", ["decode-gqa", "decode-mqa-splits3", "chunk-causal", "leftpad-batchidx",
                                  "paged-7", "paged-16-splits", "decode-rotary"])
def test_kvcache_append_head_dims_59_and_100(case, head_dim, dtype):
    """k_new appended into the cache (paged and not), split-KV partials with padded rows."""
    assert case in KVCACHE_CASES
    test_kvcache_matches_numpy_path(case, head_dim, dtype)


@pytest.mark.parametrize("head_dim", [72, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_autograd_vision_head_dims(head_dim, causal):
    torch = pytest.importorskip("torch")
    from test_torch_gpu import reference

    import cuflash2

    torch.manual_seed(head_dim)
    q = torch.randn(2, 197, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 197, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    out = cuflash2.flash_attn_func(q, k, v, causal=causal)
    grad = torch.randn_like(out)
    out.backward(grad)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference(q32, k32, v32, causal)
    ref.backward(grad.float())
    assert (out.float() - ref).abs().max().item() < 2e-2
    for got, want in ((q.grad, q32.grad), (k.grad, k32.grad), (v.grad, v32.grad)):
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max().item() < 5e-2 * max(1.0, want.abs().max().item())
