"""flash_attn_varlen_func with block_table (paged K/V, FA2's chunked-prefill call) on the CPU: the
NumPy path against the varlen NumPy path on the same keys gathered, the checks made before any
compile or launch, the kernel choice and the torch plumbing. tests/test_paged_varlen_gpu.py runs
the kernels."""

import dataclasses

import numpy as np
import pytest

import cuflash2
from cuflash2.problem.options import AttentionOptions
from cuflash2.families import mma_sync as cfg
from cuflash2.problem.tensors import contiguous_info
from cuflash2.problem.varlen import validate_paged_varlen
from cuflash2.varlen import gather_pages


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def paged_problem(rng, lens_q, lens_k, page_size, heads=4, heads_kv=2, head_dim=32, dtype=np.float16, spare_pages=3,
                  extra_q_rows=0):
    """(q, k packed, v packed, k cache, v cache, block table, cu_q, cu_k): the packed keys scattered
    over shuffled pages, the unused page slots and spare pages filled with noise."""
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q = rng.standard_normal((int(cu_q[-1]) + extra_q_rows, heads, head_dim)).astype(dtype)
    k = rng.standard_normal((int(cu_k[-1]), heads_kv, head_dim)).astype(dtype)
    v = rng.standard_normal((int(cu_k[-1]), heads_kv, head_dim)).astype(dtype)
    max_pages = max(1, max(-(-n // page_size) for n in lens_k)) + 1  # one unused column
    num_blocks = len(lens_q) * max_pages + spare_pages
    table = rng.permutation(num_blocks)[:len(lens_q) * max_pages].reshape(len(lens_q), max_pages).astype(np.int32)
    k_cache = rng.standard_normal((num_blocks, page_size, heads_kv, head_dim)).astype(dtype)
    v_cache = rng.standard_normal((num_blocks, page_size, heads_kv, head_dim)).astype(dtype)
    for b, n in enumerate(lens_k):
        j = np.arange(n)
        k_cache[table[b, j // page_size], j % page_size] = k[cu_k[b]:cu_k[b + 1]]
        v_cache[table[b, j // page_size], j % page_size] = v[cu_k[b]:cu_k[b + 1]]
    return q, k, v, k_cache, v_cache, table, cu_q, cu_k


# chunked prefill: every sequence has more keys (cached prefix + chunk) than queries; some none
CHUNKED = ([5, 0, 17, 1, 9], [40, 13, 17, 300, 9])


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_path_equals_varlen_on_the_gathered_keys(page_size, causal):
    rng = np.random.default_rng(page_size * 2 + causal)
    lens_q, lens_k = CHUNKED
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = paged_problem(rng, lens_q, lens_k, page_size, extra_q_rows=2)
    expected = cuflash2.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    got = cuflash2.flash_attn_varlen_forward(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k),
                                             causal=causal, block_table=table)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    assert not got[0][-2:].any() and np.isposinf(got[1][:, -2:]).all()  # rows past the last sequence
    out = cuflash2.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), 0.0, None,
                                          causal, (-1, -1), 0.0, None, False, False, table)  # flash-attn's order
    np.testing.assert_array_equal(out, expected[0])


def test_numpy_path_with_window_softcap_alibi():
    rng = np.random.default_rng(7)
    lens_q, lens_k = [3, 8, 0], [20, 8, 5]
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = paged_problem(rng, lens_q, lens_k, 7)
    slopes = rng.uniform(0.01, 0.3, (3, 4)).astype(np.float32)
    options = dict(causal=True, window_size=(6, -1), softcap=4.0, alibi_slopes=slopes)
    expected = cuflash2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 20, return_attn_probs=True, **options)
    got = cuflash2.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 8, 20, return_attn_probs=True,
                                          block_table=table, **options)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_gather_pages_rebuilds_the_packed_keys():
    rng = np.random.default_rng(3)
    _, k, v, k_cache, v_cache, table, _, cu_k = paged_problem(rng, *CHUNKED, page_size=16)
    np.testing.assert_array_equal(gather_pages(k_cache, table, cu_k), k)
    np.testing.assert_array_equal(gather_pages(v_cache, table, cu_k), v)


def test_out_argument_and_empty_sequences():
    rng = np.random.default_rng(4)
    q, k, v, k_cache, v_cache, table, cu_q, cu_k = paged_problem(rng, [0, 4, 2], [0, 0, 3], 2)
    given = np.full_like(q, 7)
    out, lse = cuflash2.flash_attn_varlen_forward(q, k_cache, v_cache, cu_q, cu_k, 4, 3, causal=True, out=given,
                                                  block_table=table)
    assert out is given
    assert not out[:4].any() and np.isposinf(lse[:, :4]).all()  # sequence 1: no keys
    expected = cuflash2.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 3, causal=True)
    np.testing.assert_array_equal(out, expected[0])


# ---- checks before any compile or launch ------------------------------------------------------------

def _bad_call(**changes):
    rng = np.random.default_rng(0)
    q, _, _, k_cache, v_cache, table, cu_q, cu_k = paged_problem(rng, [2, 3], [10, 20], 4)
    args = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=20,
                block_table=table)
    args.update(changes)
    return cuflash2.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("changes, error, message", [
    (lambda t, k: dict(block_table=t.astype(np.int64)), TypeError, "block_table: expected dtype int32, got int64"),
    (lambda t, k: dict(block_table=t.reshape(-1)), ValueError, "block_table: expected 2 dims"),
    (lambda t, k: dict(block_table=t[:1]), ValueError, "block_table: expected shape (2, max_num_blocks_per_seq)"),
    (lambda t, k: dict(block_table=t[:, :4]), ValueError,
     "block_table: expected at most 4 pages x 4 rows = 16 keys per sequence, got sequence 1 with 20 keys"),
    (lambda t, k: dict(v=k[:, :2]), ValueError, "v: expected shape"),
    (lambda t, k: dict(k=k[0], v=k[0]), ValueError, "k: expected 4 dims (num_blocks, page_size, nheads_k, headdim)"),
    (lambda t, k: dict(k=k.astype(np.float32), v=k.astype(np.float32)), TypeError, "k: expected dtype float16"),
    (lambda t, k: dict(block_table=np.where(t == t[1, 2], 99, t).astype(np.int32)), ValueError,
     "block_table: expected page ids in [0, 15) for the pages sequence 1 uses, got 99"),
    (lambda t, k: dict(dropout_p=0.1), ValueError, "dropout_p: expected 0.0 with block_table"),
    (lambda t, k: dict(cu_seqlens_k=np.array([0, 10, 35], np.int32), max_seqlen_k=25), ValueError,
     "block_table: expected at most 6 pages x 4 rows = 24 keys per sequence, got sequence 1 with 25 keys"),
    (lambda t, k: dict(cu_seqlens_k=np.array([0, 10, 35], np.int32)), ValueError,
     "cu_seqlens_k: expected sequences of at most max_seqlen = 20, got one of 25"),
])
def test_bad_arguments_raise(changes, error, message):
    rng = np.random.default_rng(0)
    _, _, _, k_cache, _, table, _, _ = paged_problem(rng, [2, 3], [10, 20], 4)
    with pytest.raises(error) as info:
        _bad_call(**changes(table, k_cache))
    assert message in str(info.value)


def _infos(device="cuda:0", table_device="cuda:0", table_shape=(2, 8), table_dtype="int32"):
    q = contiguous_info((5, 4, 64), "bfloat16", 2, device, 256)
    k = contiguous_info((9, 16, 2, 64), "bfloat16", 2, device, 512)
    table = contiguous_info(table_shape, table_dtype, 4, table_device, 1024)
    cu = contiguous_info((3,), "int32", 4, device, 2048)
    return q, k, table, cu


def test_validation_is_pure_and_names_the_argument():
    q, k, table, cu = _infos()
    call = validate_paged_varlen(q, k, k, table, None, cu, [0, 2, 5], cu, [0, 100, 228], 3, 128)
    assert call.page_size == 16 and call.shape.batch == 2 and call.shape.seqlen_k == 128 and call.covers_all_rows
    with pytest.raises(ValueError, match=r"block_table: expected device cuda:0 \(same as q\), got cuda:1"):
        validate_paged_varlen(q, k, k, _infos(table_device="cuda:1")[2], None, cu, [0, 2, 5], cu, [0, 1, 2], 3, 1)
    with pytest.raises(ValueError, match=r"block_table: expected at most 8 pages x 16 rows = 128 keys per sequence, "
                                         r"got sequence 0 with 129 keys"):
        validate_paged_varlen(q, k, k, table, None, cu, [0, 2, 5], cu, [0, 129, 130], 3, 129)
    with pytest.raises(ValueError, match="block_table: expected a contiguous last dim"):
        strided = dataclasses.replace(table, strides=(16, 2))
        validate_paged_varlen(q, k, k, strided, None, cu, [0, 2, 5], cu, [0, 1, 2], 3, 1)
    with pytest.raises(ValueError, match="k: expected a data pointer aligned"):  # half an element
        validate_paged_varlen(q, dataclasses.replace(k, data_ptr=513), k, table, None, cu, [0, 2, 5], cu, [0, 1, 2], 3,
                              1)
    v_other = dataclasses.replace(k, shape=(9, 8, 2, 64))
    with pytest.raises(ValueError, match=r"v: expected shape \(9, 16, 2, 64\) \(same as k"):
        validate_paged_varlen(q, k, v_other, table, None, cu, [0, 2, 5], cu, [0, 1, 2], 3, 1)


def test_gqa_heads_must_divide():
    q, k, table, cu = _infos()
    k3 = dataclasses.replace(k, shape=(9, 16, 3, 64), strides=(16 * 3 * 64, 3 * 64, 64, 1))
    with pytest.raises(ValueError, match="nheads of q"):
        validate_paged_varlen(q, k3, k3, table, None, cu, [0, 2, 5], cu, [0, 1, 2], 3, 1)


# ---- kernel choice -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", [80, 86, 90])
def test_paged_varlen_kernels_are_listed_for_compilation(arch):
    """Every kernel the paged varlen forward can launch is among the KV-cache configs that the compile
    tests and `cuflash2 compile` build, and none is the 16-row decoding kernel."""
    listed = set(cfg.all_kvcache_configs(arch))
    for bucket in cfg.HEAD_DIM_BUCKETS:
        for dtype in cfg.DTYPES:
            for causal in (False, True):
                for max_q in (0, 1, 16, 17, 32, 33, 64, 4096):
                    config = cfg.paged_varlen_config(bucket, dtype, causal, arch, max_q)
                    assert config in listed, config.short_id()
                    assert config.kernel == cfg.FWD_KVCACHE


# ---- torch plumbing (no kernels) -----------------------------------------------------------------------

def test_torch_refuses_inputs_that_require_grad(monkeypatch):
    torch = pytest.importorskip("torch")
    from cuflash2.frameworks import torch_adapter as torch_ops

    calls = []
    monkeypatch.setattr(torch_ops, "_varlen_paged_fwd_impl",
                        lambda q, *args: calls.append(args) or (2 * q, torch.zeros(q.shape[1], q.shape[0])))
    q = torch.randn(6, 2, 32, dtype=torch.float16, requires_grad=True)
    k = torch.randn(3, 4, 2, 32, dtype=torch.float16)
    cu_q, cu_k = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32)
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="q: flash_attn_varlen_func with block_table has no backward"):
        cuflash2.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 6, 10, block_table=table)
    assert not calls
    with torch.no_grad():
        out = cuflash2.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 6, 10, causal=True, block_table=table)
    assert torch.equal(out, 2 * q.detach()) and out.grad_fn is None
    (args,) = calls
    assert args[4] is table and args[5:8] == (6, 10, pytest.approx(32 ** -0.5)) and args[8] is True


def test_torch_compiling_takes_the_forward_only_custom_op(monkeypatch):
    torch = pytest.importorskip("torch")
    from cuflash2.frameworks import torch_adapter as torch_ops

    seen = []
    monkeypatch.setattr(torch_ops, "_compiling", lambda: True)
    monkeypatch.setattr(torch_ops, "_flash_attn_varlen_paged_fwd", lambda *args: seen.append(args) or (args[0], None))
    q = torch.randn(6, 2, 32, dtype=torch.float16)
    k = torch.randn(3, 4, 2, 32, dtype=torch.float16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    cuflash2.flash_attn_varlen_func(q, k, k, cu, cu, 6, 6, block_table=torch.zeros(1, 2, dtype=torch.int32))
    assert len(seen) == 1 and seen[0][5].dtype == torch.int32


def test_torch_meta_tensors_take_the_fake_implementation():
    torch = pytest.importorskip("torch")
    from cuflash2.frameworks import torch_adapter as torch_ops

    meta = dict(device="meta")
    q = torch.empty(9, 4, 64, dtype=torch.bfloat16, **meta)
    k = torch.empty(5, 16, 2, 64, dtype=torch.bfloat16, **meta)
    cu = torch.empty(3, dtype=torch.int32, **meta)
    out, lse = torch_ops.varlen_paged_forward(q, k, k, cu, cu, 4, 30, AttentionOptions(None, True), None,
                                              torch.empty(2, 3, dtype=torch.int32, **meta))
    assert out.is_meta and out.shape == q.shape and lse.shape == (4, 9) and lse.dtype == torch.float32


def test_torch_op_is_registered_without_autograd():
    torch = pytest.importorskip("torch")
    from cuflash2.frameworks import torch_adapter as torch_ops  # noqa: F401

    assert hasattr(torch.ops.cuflash2, "flash_attn_varlen_paged_fwd")

