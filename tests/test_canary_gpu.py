"""Canaries: no read outside the inputs, no write outside the outputs.

Every input is a view inside a larger buffer whose padding (rows before and after each sequence,
heads on both sides, columns past the head dim, whole batch entries on both sides) holds NaN: one
NaN read from the padding would poison the results. Every output is a view inside a buffer filled
with a different NaN bit pattern: after the call every element of the view must be a finite result
(proves it was written) and every element outside it must still hold the pattern bit for bit
(proves nothing else was). The results must also equal, bit for bit, those of the same call on
contiguous copies (strides do not change the arithmetic; for the backward plans that add dQ with
fp32 reductions in a varying order, equality is up to that order and FA2's rule is checked instead),
and pass FA2's tolerance rule against the fp32 reference.
"""

import zlib

import numpy as np
import pytest
from reliability_helpers import (
    backward_is_reproducible,
    bits,
    check_backward,
    check_forward,
    f32,
    random_inputs,
    same_bits,
)

from cuflash2.families.mma_sync import head_dim_bucket

pytestmark = pytest.mark.gpu

# NaN bit patterns: inputs' padding, outputs' padding (bf16 / fp16 / fp32).
IN_BITS = {"bfloat16": 0x7FC5, "float16": 0x7E05, "float32": 0x7FC0DEAD}
OUT_BITS = {"bfloat16": 0xFFA5, "float16": 0xFE5A, "float32": 0xFFC0BEEF}


class Padded:
    """A (batch, seqlen, nheads, head_dim) view inside a bigger buffer filled with `pattern`.

    layout "bshd": the buffer is (batch+2, seqlen+2*pad, nheads+2, d_pad), the usual layout;
    layout "bhsd": the buffer is (batch+2, nheads+2, seqlen+2*pad, d_pad), viewed transposed (head
    stride larger than row stride). d_pad leaves NaN columns up to and past the kernel's head-dim
    bucket (a head dim of 40 runs the 64-wide kernel), and is a multiple of 8 so every stride and
    the view's offset keep 16-byte alignment."""

    def __init__(self, cp, shape, dtype, pattern, layout="bshd", pad=3):
        self.cp, self.shape, self.layout, self.pad = cp, tuple(shape), layout, pad
        b, s, h, d = shape
        d_pad = head_dim_bucket(d) + 8
        full = (b + 2, s + 2 * pad, h + 2, d_pad) if layout == "bshd" else (b + 2, h + 2, s + 2 * pad, d_pad)
        self.dtype = np.dtype(dtype)
        self.pattern = pattern[self.dtype.name]
        self.buffer = cp.empty(full, dtype=self.dtype)
        self._raw(self.buffer).fill(self.pattern)
        self.view = self.slice(self.buffer)

    def _raw(self, array):
        return array.view(self.cp.uint16 if self.dtype.itemsize == 2 else self.cp.uint32)

    def slice(self, buffer):
        b, s, h, d = self.shape
        p = self.pad
        if self.layout == "bshd":
            return buffer[1:1 + b, p:p + s, 1:1 + h, :d]
        return buffer[1:1 + b, 1:1 + h, p:p + s, :d].transpose(0, 2, 1, 3)

    def fill_from(self, x):
        """Copy a contiguous array of the view's shape into the view (bit for bit)."""
        self.slice(self._raw(self.buffer))[...] = self._raw(self.cp.ascontiguousarray(x))
        return self.view

    def outside_untouched(self) -> bool:
        raw = self._raw(self.buffer).copy()
        self.slice(raw)[...] = self.pattern
        return bool((raw == self.pattern).all())


class PaddedLse:
    """A contiguous (batch, nheads, seqlen_q) fp32 view with whole padding batch entries around it
    (the LSE must be contiguous)."""

    def __init__(self, cp, shape, pattern):
        self.cp, self.pattern = cp, pattern["float32"]
        b, h, s = shape
        self.buffer = cp.empty((b + 2, h, s), dtype=np.float32)
        self.buffer.view(cp.uint32).fill(self.pattern)
        self.view = self.buffer[1:1 + b]

    def outside_untouched(self) -> bool:
        raw = self.buffer.view(self.cp.uint32)
        return bool((raw[0] == self.pattern).all()) and bool((raw[-1] == self.pattern).all())


# (dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_kv, causal, layout)
CASES = [
    ("bf16", 64, 1, 1, 2, 2, False, "bshd"),
    ("fp16", 128, 1, 1, 2, 1, True, "bhsd"),
    ("bf16", 256, 1, 203, 2, 2, True, "bshd"),
    ("fp16", 40, 113, 203, 4, 4, False, "bshd"),
    ("bf16", 40, 113, 203, 4, 2, True, "bhsd"),
    ("fp16", 64, 113, 203, 4, 1, True, "bshd"),
    ("bf16", 64, 127, 513, 4, 4, False, "bhsd"),
    ("fp16", 128, 127, 513, 8, 2, False, "bshd"),
    ("bf16", 128, 113, 203, 4, 4, True, "bshd"),
    ("fp16", 256, 113, 203, 2, 2, False, "bhsd"),
    ("bf16", 256, 127, 513, 4, 2, True, "bshd"),
    ("bf16", 128, 203, 113, 4, 4, True, "bhsd"),  # rows 0..89 see no key: output 0, LSE +inf
    ("fp16", 40, 513, 127, 2, 1, True, "bshd"),
    ("bf16", 64, 239, 1, 2, 2, False, "bshd"),
    ("fp16", 256, 203, 113, 2, 1, True, "bshd"),
    ("bf16", 128, 127, 513, 6, 3, False, "bhsd"),
]


def _case_id(c):
    dtype, d, sq, sk, h, hk, causal, layout = c
    return f"{dtype}-d{d}-{sq}x{sk}-h{h}kv{hk}-{'causal' if causal else 'full'}-{layout}"


def _inputs(cp, case, seed, with_dout=False):
    dtype, d, sq, sk, h, hk, _, _ = case
    shapes = [(2, sq, h, d), (2, sk, hk, d), (2, sk, hk, d)] + ([(2, sq, h, d)] if with_dout else [])
    return random_inputs(cp, shapes, dtype, seed)


def _padded_inputs(cp, arrays, layout):
    padded = [Padded(cp, x.shape, x.dtype, IN_BITS, layout) for x in arrays]
    return padded, [p.fill_from(x) for p, x in zip(padded, arrays)]


def _other(layout):
    return "bhsd" if layout == "bshd" else "bshd"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_reads_and_writes_only_its_views(case):
    import cupy as cp

    import cuflash2
    from attention_ref import forward_into

    causal, layout = case[6], case[7]
    q, k, v = _inputs(cp, case, seed=zlib.crc32(("fwd" + _case_id(case)).encode()))
    expected_out, expected_lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
    check_forward(cp, q, k, v, expected_out, expected_lse, causal)

    padded_in, (qv, kv, vv) = _padded_inputs(cp, (q, k, v), layout)
    before = [bits(cp, p.buffer) for p in padded_in]
    # public path: out= given, LSE allocated by the library
    out1 = Padded(cp, q.shape, q.dtype, OUT_BITS, _other(layout))
    result, lse1 = cuflash2.flash_attn_forward(qv, kv, vv, causal=causal, out=out1.view)
    assert result is out1.view
    # out and LSE both given (the entry point of the torch custom op)
    out2 = Padded(cp, q.shape, q.dtype, OUT_BITS, layout)
    lse2 = PaddedLse(cp, expected_lse.shape, OUT_BITS)
    forward_into(qv, kv, vv, out2.view, lse2.view, causal=causal)
    cp.cuda.get_current_stream().synchronize()

    for name, out in (("out=", out1), ("forward_into out", out2)):
        assert not bool(cp.isnan(f32(cp, out.view)).any()), f"{name}: NaN in the output (unwritten or NaN read)"
        assert same_bits(cp, out.view, expected_out), f"{name}: differs from the contiguous call"
        assert out.outside_untouched(), f"{name}: written outside the output view"
    assert same_bits(cp, lse1, expected_lse) and same_bits(cp, lse2.view, expected_lse), "LSE differs"
    assert lse2.outside_untouched(), "written outside the LSE view"
    for p, b in zip(padded_in, before):
        assert bool((bits(cp, p.buffer) == b).all()), "an input buffer was modified"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_backward_reads_and_writes_only_its_views(case):
    import cupy as cp

    import cuflash2
    from attention_ref import forward_into

    causal, layout = case[6], case[7]
    q, k, v, dout = _inputs(cp, case, seed=zlib.crc32(("bwd" + _case_id(case)).encode()), with_dout=True)
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
    expected = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
    check_backward(cp, q, k, v, dout, expected, causal)

    padded_in, (dov, qv, kv, vv, outv) = _padded_inputs(cp, (dout, q, k, v, out), layout)
    lse_p = PaddedLse(cp, lse.shape, IN_BITS)
    forward_into(qv, kv, vv, Padded(cp, q.shape, q.dtype, OUT_BITS).view, lse_p.view, causal=causal)
    assert same_bits(cp, lse_p.view, lse), "LSE written through a padded view differs"
    before = [bits(cp, p.buffer) for p in padded_in] + [bits(cp, lse_p.buffer)]

    grads_p = [Padded(cp, x.shape, x.dtype, OUT_BITS, _other(layout)) for x in (q, k, v)]
    result = cuflash2.flash_attn_backward(dov, qv, kv, vv, outv, lse_p.view, causal=causal,
                                          dq=grads_p[0].view, dk=grads_p[1].view, dv=grads_p[2].view)
    cp.cuda.get_current_stream().synchronize()
    bitwise = backward_is_reproducible(np.dtype(q.dtype).name, q.shape[3], q.shape[2], k.shape[2], causal)
    for name, r, g, e in zip(("dq", "dk", "dv"), result, grads_p, expected):
        assert r is g.view, f"{name}: the given array was not returned"
        assert not bool(cp.isnan(f32(cp, g.view)).any()), f"{name}: NaN (unwritten, or NaN read from padding)"
        assert not bitwise or same_bits(cp, g.view, e), f"{name}: differs from the contiguous call"
        assert g.outside_untouched(), f"{name}: written outside the view"
    if not bitwise:
        check_backward(cp, q, k, v, dout, [g.view for g in grads_p], causal)
    for p, b in zip(padded_in + [lse_p], before):
        assert bool((bits(cp, p.buffer) == b).all()), "an input buffer was modified"


def test_forward_out_with_strided_last_dim_is_rejected_or_written():
    """An `out` whose last dim is not contiguous cannot be written by the kernels: FA2 rejects it.
    Copying it (as inputs are) would drop the result silently."""
    import cupy as cp

    import cuflash2

    q, k, v = _inputs(cp, CASES[3], seed=7)
    expected = cuflash2.flash_attn_func(q, k, v)
    buffer = cp.zeros(q.shape[:-1] + (2 * q.shape[-1],), dtype=q.dtype)
    out = buffer[..., ::2]
    try:
        result = cuflash2.flash_attn_func(q, k, v, out=out)
    except (ValueError, TypeError) as exc:
        assert "out" in str(exc)
        return
    assert result is out
    assert same_bits(cp, out, expected), "out= with a strided last dim was not written (result went to a copy)"


def test_backward_grads_with_strided_last_dim_are_rejected_or_written():
    import cupy as cp

    import cuflash2

    q, k, v, dout = _inputs(cp, CASES[3], seed=8, with_dout=True)
    out, lse = cuflash2.flash_attn_forward(q, k, v)
    expected = cuflash2.flash_attn_backward(dout, q, k, v, out, lse)
    buffers = [cp.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype) for x in (q, k, v)]
    dq, dk, dv = (b[..., ::2] for b in buffers)
    try:
        result = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    except (ValueError, TypeError) as exc:
        assert any(name in str(exc) for name in ("dq", "dk", "dv"))
        return
    for name, r, g, e in zip(("dq", "dk", "dv"), result, (dq, dk, dv), expected):
        assert r is g and same_bits(cp, g, e), f"{name}: a strided-last-dim gradient was not written"
