"""Dropout on the GPU: the kernels' mask equals the NumPy/CuPy Philox mask (whatever the tiles),
keep-rate statistics, forward and gradients against references given that mask (FA2's tolerance
rule), torch autograd and varlen."""

import math

import numpy as np
import pytest

from attention_ref import attention_features_ref, check_fa2_rule
from test_forward_gpu import make_inputs

import cuflash2
from cuflash2 import dropout
from cuflash2.materialize import as_float32

pytestmark = pytest.mark.gpu


_check = check_fa2_rule


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (40, -1), 5.0)])
@pytest.mark.parametrize("p", [0.17, 0.5])
def test_dropout_forward_and_backward(p, causal, window, softcap, head_dim, dtype):
    import cupy as cp

    seed = 1234 + head_dim
    q, k, v = make_inputs(cp, 2, 150, 211, 4, 2, head_dim, dtype, seed)
    (dout,) = make_inputs(cp, 2, 150, 1, 4, 1, head_dim, dtype, seed + 1)[:1]
    options = dict(causal=causal, window_size=window, softcap=softcap, dropout_p=p, dropout_seed=seed)
    out, lse = cuflash2.flash_attn_forward(q, k, v, **options)
    grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, **options)
    keep = dropout.keep_mask(cp, seed, 0, 2, 4, 150, 211, p)
    rescale = dropout.rescale(p)
    f32 = [as_float32(cp, x) for x in (q, k, v, dout)]
    kw = dict(causal=causal, window=window, softcap=softcap, keep=keep, rescale=rescale)
    ref = attention_features_ref(cp, *f32, **kw)
    naive = attention_features_ref(cp, *f32, **kw, low_precision=np.dtype(q.dtype).name)
    _check(cp, "out", out, ref[0], naive[0], 2)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref[2:], naive[2:]):
        _check(cp, name, g, r, n, 3)


def test_mask_is_the_same_whatever_the_tile_shape():
    """The kernels draw the mask from absolute (row, key) positions: other tile shapes give the
    same dropped entries (checked through the output, bit-compared over a one-hot V)."""
    import cupy as cp

    from cuflash2.families.mma_sync import launches as launch
    from cuflash2.runtime import launcher
    from cuflash2.families.mma_sync import FWD, KernelConfig
    from cuflash2.problem.features import Features
    from cuflash2.frameworks.arrays import describe
    from cuflash2.problem.tensors import validate_qkv

    q, k, _ = make_inputs(cp, 1, 64, 96, 2, 2, 64, "fp16", 3)
    v = cp.zeros((1, 96, 2, 64), dtype=cp.float16)
    v[0, cp.arange(64), :, cp.arange(64)] = 1  # out[i, :, c] = kept weight of key c: zero iff dropped
    shape = validate_qkv(*(describe(n, x) for n, x in (("q", q), ("k", k), ("v", v))))
    features = Features(dropout_p=0.5, dropout_seed=77)
    outs = []
    for block_m, block_n, warps, stages in ((128, 64, 8, 3), (64, 32, 4, 2), (128, 128, 8, 2)):
        out, lse = cp.empty_like(q), cp.empty((1, 2, 64), dtype=cp.float32)
        config = KernelConfig(FWD, "fp16", 64, block_m, block_n, warps, stages, False, variant=True)
        launch.forward(*(describe("x", x) for x in (q, k, v, out, lse)), shape, False, 0,
                       cp.cuda.get_current_stream(), config=config, features=features)
        outs.append(cp.asnumpy(out))
    dropped = [o[0, :, :, :64].transpose(1, 0, 2) == 0 for o in outs]  # (heads, rows, keys < 64)
    expected = ~cp.asnumpy(dropout.keep_mask(cp, 77, 0, 1, 2, 64, 96, 0.5))[0, :, :, :64]
    for d in dropped:
        np.testing.assert_array_equal(d, expected)


def test_keep_rate_and_marked_probabilities():
    import cupy as cp

    q, k, v = make_inputs(cp, 2, 256, 256, 4, 4, 64, "bf16", 9)
    out, lse, probs = cuflash2.flash_attn_func(q, k, v, dropout_p=0.3, return_attn_probs=True, dropout_seed=5)
    dropped = float((probs < 0).mean())
    expected = dropout.effective_dropout(0.3)
    assert abs(dropped - expected) < 5 * math.sqrt(expected * (1 - expected) / probs.size)
    rescale = dropout.rescale(0.3)
    manual = cp.einsum("bhqk,bkhd->bqhd", cp.where(probs > 0, probs, 0) * rescale, as_float32(cp, v))
    assert float(cp.abs(manual - as_float32(cp, out)).max()) < 2e-2


def test_dropout_torch_autograd_reproducible():
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 130, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
               for _ in range(3))

    def run(seed):
        for x in (q, k, v):
            x.grad = None
        out = cuflash2.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, dropout_seed=seed)
        out.float().square().sum().backward()
        return out.detach().clone(), [x.grad.clone() for x in (q, k, v)]

    a, ga = run(3)
    b, gb = run(3)
    c, _ = run(4)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert (a != c).any()
    unseeded = cuflash2.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)  # fresh seed each call
    assert unseeded.shape == a.shape


def test_varlen_dropout_matches_numpy_path():
    import cupy as cp

    rng = np.random.default_rng(0)
    lengths = [7, 130, 64]
    total = sum(lengths)
    q, k, v, dout = (rng.standard_normal((total, 4, 64)).astype(np.float16) for _ in range(4))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    kw = dict(causal=True, dropout_p=0.25, dropout_seed=21)
    out_np, lse_np = cuflash2.flash_attn_varlen_forward(q, k, v, cu, cu, 130, 130, **kw)
    out, lse = cuflash2.flash_attn_varlen_forward(*(cp.asarray(x) for x in (q, k, v, cu, cu)), 130, 130, **kw)
    assert np.abs(cp.asnumpy(out).astype(np.float32) - out_np.astype(np.float32)).max() < 5e-3
    grads = cuflash2.flash_attn_varlen_backward(*(cp.asarray(x) for x in (dout, q, k, v)), out, lse,
                                                cp.asarray(cu), cp.asarray(cu), 130, 130, **kw)
    grads_np = cuflash2.flash_attn_varlen_backward(dout, q, k, v, out_np, lse_np, cu, cu, 130, 130, **kw)
    for g, e in zip(grads, grads_np):
        scale = max(1.0, float(np.abs(e.astype(np.float32)).max()))
        assert np.abs(cp.asnumpy(g).astype(np.float32) - e.astype(np.float32)).max() < 2e-2 * scale
