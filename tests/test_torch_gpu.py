"""PyTorch integration on the GPU: autograd, opcheck and torch.compile."""

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def reference(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    sq, sk = q.shape[1], k.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        visible = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + sk - sq
        s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1).nan_to_num(0.0), v)  # rows seeing no key: 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2])
def test_autograd_matches_float32_reference(causal, heads_kv):
    import cuflash2

    torch.manual_seed(0)
    q = torch.randn(2, 150, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 190, heads_kv, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = cuflash2.flash_attn_func(q, k, v, causal=causal)
    grad = torch.randn_like(out)
    out.backward(grad)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference(q32, k32, v32, causal)
    ref.backward(grad.float())
    assert (out.float() - ref).abs().max().item() < 2e-2
    for got, want in ((q.grad, q32.grad), (k.grad, k32.grad), (v.grad, v32.grad)):
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max().item() < 5e-2 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("options", [(-1, -1, 0.0, False, 0.0, False), (16, -1, 5.0, True, 0.25, False),
                                     (-1, -1, 0.0, False, 0.17, True)], ids=["plain", "variant", "rng-state"])
def test_opcheck(options):
    from cuflash2.frameworks import torch_adapter as torch_ops

    left, right, softcap, alibi, dropout_p, rng_state = options
    q, k, v = (torch.randn(1, 70, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.25, 0.5], device="cuda") if alibi else None
    rng = torch.tensor([12345, 6], dtype=torch.int64, device="cuda") if rng_state else None
    args = (0.125, True, left, right, softcap, slopes, dropout_p, 1234, False, rng)
    torch.library.opcheck(torch_ops._flash_attn_fwd, (q, k, v, *args))
    out, lse = torch_ops._flash_attn_fwd(q, k, v, *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch_ops._flash_attn_bwd,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *args))


def test_opcheck_varlen():
    from cuflash2.frameworks import torch_adapter as torch_ops

    q, k, v = (torch.randn(90, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 30, 90], dtype=torch.int32, device="cuda")
    args = (cu, cu, 60, 60, 0.125, True, -1, -1, 0.0, None, 0.1, 99, False, None)
    torch.library.opcheck(torch_ops._flash_attn_varlen_fwd, (q, k, v, *args))
    out, lse = torch_ops._flash_attn_varlen_fwd(q, k, v, *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch_ops._flash_attn_varlen_bwd,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), *args))


def test_torch_compile_fullgraph_forward_and_backward():
    import cuflash2

    def loss_fn(q, k, v):
        return cuflash2.flash_attn_func(q, k, v, causal=True).float().square().sum()

    compiled = torch.compile(loss_fn, fullgraph=True)
    q, k, v = (torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    loss = compiled(q, k, v)
    loss.backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    loss_eager = loss_fn(q, k, v)
    loss_eager.backward()
    assert torch.allclose(loss, loss_eager)
    for got, x in zip(grads, (q, k, v)):
        assert torch.equal(got, x.grad)


def _eager_and_op_results(monkeypatch, call, leaves):
    """call() run through the eager autograd.Function and through the custom ops (as under
    torch.compile): (output, gradients) of each."""
    from cuflash2.frameworks import torch_adapter as torch_ops

    results = []
    for compiling in (False, True):
        monkeypatch.setattr(torch_ops, "_compiling", lambda c=compiling: c)
        for x in leaves:
            x.grad = None
        out = call()
        out.float().square().sum().backward()
        results.append((out.detach().clone(), [x.grad.clone() for x in leaves]))
    return results


@pytest.mark.parametrize("variant", [False, True], ids=["plain", "variant"])
def test_eager_path_matches_the_custom_op_bitwise(monkeypatch, variant):
    """The eager Function and the custom ops run the same kernels: same bits, forward and backward."""
    import cuflash2

    torch.manual_seed(1)
    q = torch.randn(2, 130, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 170, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    options = {"window_size": (32, 8), "softcap": 10.0, "dropout_p": 0.1, "dropout_seed": 7} if variant else {}
    (out_a, grads_a), (out_b, grads_b) = _eager_and_op_results(
        monkeypatch, lambda: cuflash2.flash_attn_func(q, k, v, causal=True, deterministic=True, **options), (q, k, v))
    assert torch.equal(out_a, out_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


def test_only_calls_autograd_must_record_build_a_graph_node():
    """Inference calls (no input requires grad, or grad mode off) skip the autograd.Function and its
    host cost, with the same result; differentiable calls get the node their backward needs."""
    import cuflash2

    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 96, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    plain = cuflash2.flash_attn_func(q, k, v, causal=True)
    assert plain.grad_fn is None and not plain.requires_grad
    q.requires_grad_()
    with torch.no_grad():
        under_no_grad = cuflash2.flash_attn_func(q, k, v, causal=True)
    assert under_no_grad.grad_fn is None and torch.equal(under_no_grad, plain)
    recorded = cuflash2.flash_attn_func(q, k, v, causal=True)
    assert recorded.grad_fn is not None and torch.equal(recorded.detach(), plain)
    recorded.float().sum().backward()
    assert q.grad is not None and k.grad is None


def test_eager_varlen_path_matches_the_custom_op_bitwise(monkeypatch):
    import cuflash2

    torch.manual_seed(2)
    q, k, v = (torch.randn(150, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 40, 150], dtype=torch.int32, device="cuda")
    (out_a, grads_a), (out_b, grads_b) = _eager_and_op_results(
        monkeypatch, lambda: cuflash2.flash_attn_varlen_func(q, k, v, cu, cu, 110, 110, causal=True,
                                                             deterministic=True), (q, k, v))
    assert torch.equal(out_a, out_b)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)


def _sum(out):
    return out.sum()


def _after_one_element(out):
    """A loss whose gradient reaches out as a view 2 bytes into a buffer (CatBackward narrows)."""
    return torch.cat([out.new_zeros(1), out.flatten()]).float().square().sum() / 2


@pytest.mark.parametrize("loss", [_sum, _after_one_element], ids=["expanded", "odd-offset"])
@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "custom-op"])
def test_backward_of_gradients_in_any_layout(monkeypatch, compiling, loss):
    """Autograd passes the gradient in whatever layout the next op made (stride 0 everywhere from
    out.sum(), a misaligned view from a cat): both reach the kernels, as the reference says."""
    import cuflash2
    from cuflash2.frameworks import torch_adapter as torch_ops

    monkeypatch.setattr(torch_ops, "_compiling", lambda: compiling)
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 96, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    loss(cuflash2.flash_attn_func(q, k, v, causal=True)).backward()
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    loss(reference(q32, k32, v32, True)).backward()
    for got, want in ((q.grad, q32.grad), (k.grad, k32.grad), (v.grad, v32.grad)):
        assert (got.float() - want).abs().max().item() < 2e-2 * max(1.0, want.abs().max().item())
