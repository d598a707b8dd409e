"""Drop-in behaviour of a flash-attn user on the GPU: dropout that follows torch's RNG (manual_seed,
activation checkpointing, CUDA-graph replays), the drop probability applied exactly, torch-owned
memory, CUDA graphs (torch and CuPy) and torch.compile of the KV-cache call."""

import math

import numpy as np
import pytest

import cuflash2

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _qkv(b=2, s=160, h=4, d=64, dtype=torch.bfloat16, grad=True, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen, requires_grad=grad) for _ in range(3)]


def test_manual_seed_reproduces_the_dropout_mask():
    q, k, v = _qkv()
    torch.manual_seed(7)
    a = cuflash2.flash_attn_func(q, k, v, dropout_p=0.17, causal=True)
    torch.manual_seed(7)
    b = cuflash2.flash_attn_func(q, k, v, dropout_p=0.17, causal=True)
    c = cuflash2.flash_attn_func(q, k, v, dropout_p=0.17, causal=True)  # the generator moved on
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_activation_checkpointing_regenerates_the_mask(reentrant, varlen):
    """The recomputed forward draws the same (seed, offset) as the first, so the gradients equal
    those of the same step without checkpointing (they were wrong before: a fresh seed)."""
    q, k, v = _qkv(s=192)
    cu = torch.tensor([0, 100, 192, 384], dtype=torch.int32, device="cuda")

    def attention(q, k, v):
        if varlen:
            flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
            return cuflash2.flash_attn_varlen_func(*flat, cu, cu, 192, 192, dropout_p=0.2, causal=True)
        return cuflash2.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)

    def step(checkpoint):
        for x in (q, k, v):
            x.grad = None
        torch.manual_seed(11)
        if checkpoint:
            out = torch.utils.checkpoint.checkpoint(attention, q, k, v, use_reentrant=reentrant)
        else:
            out = attention(q, k, v)
        out.float().square().sum().backward()
        return out.detach(), [x.grad.clone() for x in (q, k, v)]

    out_plain, grads_plain = step(False)
    out_ckpt, grads_ckpt = step(True)
    assert torch.equal(out_plain, out_ckpt)
    for name, g, h in zip("qkv", grads_plain, grads_ckpt):
        assert torch.equal(g, h), f"d{name} differs under checkpointing"


@pytest.mark.parametrize("p", [0.17, 0.5])
def test_drop_probability_and_scale_are_exact(p):
    """The kept fraction matches p (not a multiple of 1/256) and the output is the kept
    probabilities times 1 / (1 - p), flash-attn's reference rule."""
    q, k, v = _qkv(b=2, s=512, h=4, d=64, grad=False)
    torch.manual_seed(3)
    out, lse, probs = cuflash2.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    dropped = (probs < 0).float().mean().item()
    sigma = math.sqrt(p * (1 - p) / probs.numel())
    assert abs(dropped - p) < 5 * sigma + 2.0 ** -17
    kept = torch.where(probs > 0, probs, torch.zeros_like(probs)) / (1 - p)
    expected = torch.einsum("bhqk,bkhd->bqhd", kept, v.float())
    assert (out.float() - expected).abs().max().item() < 2e-2


def test_probabilities_stay_in_torchs_allocator():
    """Every buffer of a torch call (outputs, scratch, return_attn_probs) comes from torch's caching
    allocator: nothing is left in CuPy's pool, and torch.cuda.memory_allocated counts it."""
    import cupy as cp

    q, k, v = _qkv(b=1, s=1024, h=8, d=64)
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    torch_before = torch.cuda.memory_allocated()
    out, lse, probs = cuflash2.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    out.float().sum().backward()
    assert torch.cuda.memory_allocated() - torch_before >= probs.numel() * 4
    assert pool.total_bytes() == before, "a torch call allocated from CuPy's memory pool"
    del out, lse, probs


def _graph_training_step(q, k, v, dropout_p):
    out = cuflash2.flash_attn_func(q, k, v, causal=True, dropout_p=dropout_p)
    out.float().square().sum().backward()
    return out


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_torch_cuda_graph_training_step(dropout_p):
    """Forward and backward captured in one torch.cuda.graph replay correctly with new data in the
    captured buffers; with dropout each replay draws a new mask (the generator's offset advances)."""
    static = _qkv(s=256, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, records nothing
        for _ in range(2):
            for x in static:
                x.grad = None
            _graph_training_step(*static, dropout_p)
    torch.cuda.current_stream().wait_stream(side)
    for x in static:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _graph_training_step(*static, dropout_p)
    fresh = _qkv(s=256, seed=2, grad=False)
    with torch.no_grad():
        for x, y in zip(static, fresh):
            x.copy_(y)
            x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    first = (static_out.clone(), [x.grad.clone() for x in static])
    if dropout_p == 0:
        eager = [y.detach().clone().requires_grad_() for y in fresh]
        out = _graph_training_step(*eager, 0.0)
        assert torch.equal(first[0], out)
        for g, x in zip(first[1], eager):
            assert torch.equal(g, x.grad)
    else:
        with torch.no_grad():
            for x in static:
                x.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.equal(first[0], static_out), "replays reused the same dropout mask"


def test_torch_cuda_graph_kvcache_decoding_step():
    """A decoding step (append + attention) captured once and replayed with new tokens."""
    b, h, hk, d, cache_len = 4, 8, 2, 128, 512
    k_cache = torch.zeros(b, cache_len, hk, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    lengths = torch.full((b,), 37, dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        k_cache[:, :37].normal_()
        v_cache[:, :37].normal_()

    def step():
        return cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for _ in range(3):  # each replay appends at the current length, then the loop advances it
        q.normal_(), k_new.normal_(), v_new.normal_()
        before_k, before_v = k_cache.clone(), v_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        replayed_k, replayed_v = k_cache.clone(), v_cache.clone()
        k_cache.copy_(before_k), v_cache.copy_(before_v)
        eager = step()
        assert torch.equal(static_out, eager)
        assert torch.equal(replayed_k, k_cache) and torch.equal(replayed_v, v_cache)
        lengths += 1


def test_cupy_graph_capture_and_replay():
    """cupy.cuda.Graph: a captured forward replays with new data in its input buffers."""
    import cupy as cp

    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal((2, 300, 4, 128)).astype(np.float16)) for _ in range(3))
    out = cp.empty_like(q)
    cuflash2.flash_attn_func(q, k, v, causal=True, out=out)  # compiles outside the capture
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cuflash2.flash_attn_func(q, k, v, causal=True, out=out)
        graph = stream.end_capture()
    for seed in (1, 2):
        fresh = np.random.default_rng(seed)
        for x in (q, k, v):
            x[...] = cp.asarray(fresh.standard_normal(x.shape).astype(np.float16))
        graph.launch(stream)
        stream.synchronize()
        expected = cuflash2.flash_attn_func(q, k, v, causal=True)
        assert cp.array_equal(out, expected)


def test_torch_compile_kvcache_mutates_the_caches():
    """flash_attn_with_kvcache under torch.compile(fullgraph=True): a custom op that appends to the
    caches in place, with the same result as eager."""
    b, h, hk, d, cache_len = 2, 4, 2, 64, 256
    torch.manual_seed(0)
    q = torch.randn(b, 2, h, d, device="cuda", dtype=torch.float16)
    k_new, v_new = (torch.randn(b, 2, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
    k_cache, v_cache = (torch.randn(b, cache_len, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([5, 100], dtype=torch.int32, device="cuda")

    def step(q, kc, vc, kn, vn, lengths):
        out, lse = cuflash2.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lengths, causal=True,
                                                    return_softmax_lse=True)
        return out * 2, lse

    kc_eager, vc_eager = k_cache.clone(), v_cache.clone()
    out_eager, lse_eager = step(q, kc_eager, vc_eager, k_new, v_new, lengths)
    compiled = torch.compile(step, fullgraph=True)
    out, lse = compiled(q, k_cache, v_cache, k_new, v_new, lengths)
    assert torch.equal(out, out_eager) and torch.equal(lse, lse_eager)
    assert torch.equal(k_cache, kc_eager) and torch.equal(v_cache, vc_eager)
