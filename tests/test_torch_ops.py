"""The torch integration's plumbing, on the CPU: which path a call takes (the eager
torch.autograd.Function or the custom ops torch.compile sees), what reaches the implementation,
what comes back to autograd. The kernels are replaced by recorders; tests/test_torch_gpu.py runs
the real ones."""

import pytest

torch = pytest.importorskip("torch")

import cuflash2  # noqa: E402
from cuflash2.frameworks import torch_adapter as torch_ops  # noqa: E402
from cuflash2.problem.options import AttentionOptions  # noqa: E402


@pytest.fixture
def recorded(monkeypatch):
    """Replace the implementations with functions of known gradients: out = 2 q (k, v unused),
    dq = 3 dout, dk = 5, dv = 7 (elementwise), recording each call's arguments."""
    calls = {"fwd": [], "bwd": []}

    def fwd(q, k, v, *options):
        calls["fwd"].append(options)
        return 2 * q.detach(), torch.zeros(q.shape[0], q.shape[2], q.shape[1]), ("fwd", "key")

    def bwd(dout, q, k, v, out, lse, *options, forward_key=None):
        calls["bwd"].append((dout, options))
        assert forward_key in (None, ("fwd", "key"))  # the eager Function hands the forward's key over
        return 3 * dout, torch.full_like(k, 5.0), torch.full_like(v, 7.0)

    monkeypatch.setattr(torch_ops, "_forward", fwd)
    monkeypatch.setattr(torch_ops, "_bwd_impl", bwd)
    return calls


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(2, 16, 4, 8, dtype=torch.float16, requires_grad=True) for _ in range(3)]


def test_eager_call_takes_the_function_and_differentiates(recorded):
    q, k, v = _inputs()
    out = cuflash2.flash_attn_func(q, k, v, causal=True, window_size=(4, -1), softcap=3.0)
    assert torch.equal(out, 2 * q.detach())
    assert out.grad_fn is not None and "EagerAttention" in type(out.grad_fn).__name__
    (options,) = recorded["fwd"]
    assert options == (pytest.approx(8 ** -0.5), True, 4, -1, 3.0, None, 0.0, 0, False, None)
    grad = torch.randn_like(out)
    out.backward(grad)
    (dout, bwd_options), = recorded["bwd"]
    assert torch.equal(dout, grad) and bwd_options == options
    assert torch.equal(q.grad, 3 * grad)
    assert torch.equal(k.grad, torch.full_like(k, 5.0)) and torch.equal(v.grad, torch.full_like(v, 7.0))


def test_softmax_lse_is_not_differentiable(recorded):
    q, k, v = _inputs()
    out, lse, _ = torch_ops.forward(q, k, v, AttentionOptions(None, False), None)
    assert out.requires_grad and not lse.requires_grad


def test_compiling_takes_the_custom_op(monkeypatch, recorded):
    seen = []
    monkeypatch.setattr(torch_ops, "_compiling", lambda: True)
    monkeypatch.setattr(torch_ops, "_flash_attn_fwd", lambda *args: seen.append(args) or (args[0], args[0]))
    q, k, v = _inputs()
    cuflash2.flash_attn_func(q, k, v)
    assert len(seen) == 1 and not recorded["fwd"]


def test_not_compiling_outside_torch_compile():
    assert torch_ops._compiling() is False


def test_no_grad_call_records_no_graph(recorded):
    q, k, v = _inputs()
    with torch.no_grad():
        out = cuflash2.flash_attn_func(q, k, v)
    assert out.grad_fn is None and not out.requires_grad


def test_out_argument_receives_the_result(recorded):
    q, k, v = _inputs()
    given = torch.empty_like(q, requires_grad=False)
    with torch.no_grad():
        out = cuflash2.flash_attn_func(q, k, v, out=given)
    assert out is given and torch.equal(given, 2 * q.detach())


def test_varlen_eager_call_takes_the_function(monkeypatch):
    calls = []

    def fwd(q, k, v, cu_q, cu_k, *options):
        calls.append((cu_q, cu_k, options))
        return 2 * q.detach(), torch.zeros(q.shape[1], q.shape[0])

    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, *options):
        return 3 * dout, torch.full_like(k, 5.0), torch.full_like(v, 7.0)

    monkeypatch.setattr(torch_ops, "_varlen_fwd_impl", fwd)
    monkeypatch.setattr(torch_ops, "_varlen_bwd_impl", bwd)
    q, k, v = (torch.randn(12, 2, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = cuflash2.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
    assert "EagerVarlenAttention" in type(out.grad_fn).__name__
    (cu_q, cu_k, options), = calls
    assert cu_q is cu and cu_k is cu and options[:3] == (7, 7, pytest.approx(8 ** -0.5))
    out.backward(torch.ones_like(out))
    assert torch.equal(q.grad, torch.full_like(q, 3.0)) and torch.equal(v.grad, torch.full_like(v, 7.0))


@pytest.mark.parametrize("make, copied", [
    (lambda: torch.ones(2, 8, 4, 16, dtype=torch.float16), False),
    (lambda: torch.ones(()).expand(2, 8, 4, 16).half(), False),
    (lambda: torch.ones((), dtype=torch.float16).expand(2, 8, 4, 16), True),  # stride 0 everywhere
    (lambda: torch.ones(2, 8, 4, 32, dtype=torch.float16)[..., :16], False),  # a column slice, rows still 16 B
    (lambda: torch.ones(2, 8, 4, 16, dtype=torch.float16).transpose(1, 3), True),  # last stride not 1
    # Base or rows off 16 B: read as they are, through narrower accesses (config.vector_width)
    (lambda: torch.ones(2, 8, 4, 20, dtype=torch.float16)[..., 2:18], False),
    (lambda: torch.ones(1 + 2 * 8 * 4 * 16, dtype=torch.float16)[1:].view(2, 8, 4, 16), False),
    (lambda: torch.ones(2, 8, 4, 59, dtype=torch.float16), False),
])
def test_kernel_ready_copies_only_what_the_kernels_cannot_read(make, copied):
    grad = make()
    ready = torch_ops._kernel_ready(grad)
    assert (ready is not grad) == copied
    assert torch.equal(ready, grad) and ready.stride(-1) == 1


def test_meta_tensors_take_the_custom_ops_fake_implementation():
    """Tracing without torch.compile (make_fx, meta tensors) reaches the ops' fake kernels."""
    q, k, v = (torch.empty(2, 16, 4, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    out, lse, _ = torch_ops.forward(q, k, v, AttentionOptions(None, True), None)
    assert out.is_meta and out.shape == q.shape and out.dtype == q.dtype
    assert lse.is_meta and lse.shape == (2, 4, 16) and lse.dtype == torch.float32


def test_no_double_backward_through_the_eager_path(recorded):
    q, k, v = _inputs()
    out = cuflash2.flash_attn_func(q, k, v)
    # the gradient reaching the backward (2 out) depends on q: a second derivative would exist
    (dq,) = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(dq.float().sum(), q)
