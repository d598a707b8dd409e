"""NumPy reference implementations of FlashAttention-2 attention (forward and backward).

Two flavours are provided:

* ``attention_naive`` / ``attention_backward_naive``: dense float64 maths, the ground
  truth every other implementation is checked against.
* ``attention_tiled`` / ``attention_backward_tiled``: float32 code that walks the same
  blocks, in the same order, with the same masking decisions and online-softmax
  arithmetic (exp2 domain) as the CUDA kernels.  Their block-scheduling helpers
  (``key_block_range``, ``query_block_range``, ``block_needs_mask``) are the rules the
  kernels use, so testing them here tests the kernels' scheduling logic.

Conventions follow FlashAttention-2: tensors are (batch, seqlen, nheads, headdim);
k/v may have fewer heads than q (GQA/MQA, query head h reads kv head h // (hq // hk));
masks are aligned bottom-right (shift = seqlen_k - seqlen_q); ``window_size`` entries
below 0 mean unbounded and ``causal`` forces the right window to 0.  A query row that
sees no key gets out = 0, lse = +inf and zero gradients.
"""

import math
import numbers
from typing import NamedTuple, Optional, Tuple

import numpy as np

__all__ = [
    "visible_mask",
    "key_block_range",
    "query_block_range",
    "block_needs_mask",
    "attention_naive",
    "attention_tiled",
    "attention_backward_naive",
    "attention_backward_tiled",
]

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# --------------------------------------------------------------------------- masks


def _window(causal: bool, window_size) -> Tuple[int, int]:
    """Effective (left, right) window; negative means unbounded, causal sets right = 0."""
    left, right = (int(w) for w in window_size)
    return left, (0 if causal else right)


def _visible(rows, cols, seqlen_q, seqlen_k, causal, window_size) -> np.ndarray:
    """Visibility of query rows x key cols (absolute indices) as a bool (len(rows), len(cols))."""
    left, right = _window(causal, window_size)
    i = np.asarray(rows)[:, None] + (seqlen_k - seqlen_q)  # row mapped onto key axis
    j = np.asarray(cols)[None, :]
    vis = (j >= 0) & (j < seqlen_k) & np.ones_like(i, dtype=bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)) -> np.ndarray:
    """Bool (seqlen_q, seqlen_k) mask: True where query row i may attend to key col j."""
    return _visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k,
                    causal, window_size)


def _span_to_blocks(lo: int, hi: int, block: int) -> Tuple[int, int]:
    """Blocks [first, last + 1) covering the index interval [lo, hi]; (0, 0) if empty."""
    if hi < lo:
        return 0, 0
    return lo // block, hi // block + 1


def key_block_range(m_block, block_m, block_n, seqlen_q, seqlen_k, causal=False,
                    window_size=(-1, -1)) -> Tuple[int, int]:
    """Key blocks [n_min, n_max) holding any key visible to any row of query block m_block.

    Row i sees the contiguous key interval [i + shift - left, i + shift + right]; these
    intervals slide by one per row, so the union over the block's rows is contiguous and
    the returned range is tight (every block in it has a visible entry).  An empty range
    (n_min >= n_max) means the whole query block sees nothing.
    """
    left, right = _window(causal, window_size)
    shift = seqlen_k - seqlen_q
    row_lo = m_block * block_m
    row_hi = min(row_lo + block_m, seqlen_q) - 1
    if row_hi < row_lo:
        return 0, 0
    col_lo = 0 if left < 0 else max(0, row_lo + shift - left)
    col_hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, row_hi + shift + right)
    return _span_to_blocks(col_lo, col_hi, block_n)


def query_block_range(n_block, block_m, block_n, seqlen_q, seqlen_k, causal=False,
                      window_size=(-1, -1)) -> Tuple[int, int]:
    """Query blocks [m_min, m_max) holding any row that sees any key of key block n_block.

    The transpose of ``key_block_range``, used by the backward kernel which loops over
    query blocks for a fixed key/value block.  Key j is seen by rows
    [j - shift - right, j - shift + left].
    """
    left, right = _window(causal, window_size)
    shift = seqlen_k - seqlen_q
    col_lo = n_block * block_n
    col_hi = min(col_lo + block_n, seqlen_k) - 1
    if col_hi < col_lo:
        return 0, 0
    row_lo = 0 if right < 0 else max(0, col_lo - shift - right)
    row_hi = seqlen_q - 1 if left < 0 else min(seqlen_q - 1, col_hi - shift + left)
    return _span_to_blocks(row_lo, row_hi, block_m)


def block_needs_mask(m_block, n_block, block_m, block_n, seqlen_q, seqlen_k, causal=False,
                     window_size=(-1, -1)) -> bool:
    """True when tile (m_block, n_block) holds an invisible entry and so must be masked.

    Considers the tile's in-bounds rows (rows >= seqlen_q are never stored, so the
    kernel need not mask them) and all of its block_n columns: a column >= seqlen_k
    (ragged last key block) forces masking.  Otherwise only the two extreme corners
    can violate the window: the bottom-left one for the left bound and the top-right
    one for the right bound.
    """
    left, right = _window(causal, window_size)
    shift = seqlen_k - seqlen_q
    row_lo = m_block * block_m
    row_hi = min(row_lo + block_m, seqlen_q) - 1
    col_lo = n_block * block_n
    col_hi = col_lo + block_n - 1
    if col_hi >= seqlen_k:
        return True
    if left >= 0 and col_lo < row_hi + shift - left:
        return True
    return right >= 0 and col_hi > row_lo + shift + right


# ------------------------------------------------------------------- shared helpers


class _Problem(NamedTuple):
    """Everything about an attention call except the tensors."""

    seqlen_q: int
    seqlen_k: int
    scale: float
    softcap: float
    slopes: Optional[np.ndarray]  # (b, hq) in the working dtype, or None
    causal: bool
    window_size: Tuple[int, int]
    groups: int  # query heads per kv head


def _heads_first(x, dtype, groups=1) -> np.ndarray:
    """(b, s, h, d) -> (b, h * groups, s, d) in dtype; repeats kv heads for GQA/MQA."""
    x = np.asarray(x).astype(dtype)
    if groups > 1:
        x = np.repeat(x, groups, axis=2)
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _seq_first(x, groups=1) -> np.ndarray:
    """(b, hq, s, d) -> (b, s, hq // groups, d), summing each group of query heads."""
    b, hq, s, d = x.shape
    x = x.reshape(b, hq // groups, groups, s, d).sum(axis=2)
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _prepare(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dtype):
    """Validate shapes, move heads first in ``dtype`` and collect the call's parameters."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"bad shapes q={q.shape} k={k.shape} v={v.shape}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2] != 0:
        raise ValueError(f"incompatible q={q.shape} and k/v={k.shape}")
    groups = hq // k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    slopes = None
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float32).astype(dtype), (b, hq))
    prob = _Problem(sq, k.shape[1], scale, float(softcap), slopes, bool(causal),
                    tuple(int(w) for w in window_size), groups)
    tensors = (_heads_first(q, dtype), _heads_first(k, dtype, groups),
               _heads_first(v, dtype, groups))
    return tensors, prob


def _scores(qb, kb, rows, cols, prob: _Problem):
    """Unmasked logits for heads-first blocks qb (b,h,m,d), kb (b,h,n,d).

    Applies scale, then softcap (s = c * tanh(s / c)), then the ALiBi bias
    -slope * |i + shift - j|, in the dtype of the inputs.  Returns (s, t) where t is the
    tanh value needed by the backward pass (None without softcap).
    """
    s = np.matmul(qb, np.swapaxes(kb, -1, -2)) * prob.scale
    t = None
    if prob.softcap > 0:
        t = np.tanh(s / prob.softcap)
        s = prob.softcap * t
    if prob.slopes is not None:
        shift = prob.seqlen_k - prob.seqlen_q
        dist = np.abs(np.asarray(rows)[:, None] + shift - np.asarray(cols)[None, :])
        s = s - prob.slopes[:, :, None, None] * dist.astype(s.dtype)
    return s, t


def _mask(s, rows, cols, prob: _Problem):
    """Set logits of invisible (row, col) pairs to -inf."""
    vis = _visible(rows, cols, prob.seqlen_q, prob.seqlen_k, prob.causal, prob.window_size)
    return np.where(vis, s, -np.inf).astype(s.dtype, copy=False)


def _swap(x):
    """Transpose the last two axes."""
    return np.swapaxes(x, -1, -2)


def _num_blocks(n, block):
    """Number of blocks of size ``block`` needed to cover n items."""
    return (n + block - 1) // block


def _block_idx(block_id, block, n):
    """Absolute indices of block ``block_id`` clipped to [0, n)."""
    return np.arange(block_id * block, min((block_id + 1) * block, n))


# ---------------------------------------------------------------------- naive (fp64)


def _dense_softmax(s):
    """Row softmax of masked logits; returns (p, lse) with p = 0, lse = +inf on empty rows."""
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)  # empty row: avoid -inf - -inf = NaN
    e = np.exp(s - mx)
    tot = e.sum(axis=-1, keepdims=True)
    safe = np.where(tot > 0, tot, 1.0)
    p = np.where(tot > 0, e / safe, 0.0)
    lse = np.where(tot > 0, np.log(safe) + mx, np.inf)
    return p, lse[..., 0]


def attention_naive(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, dropout_mask=None, dropout_rescale=1.0):
    """Dense float64 attention: returns out (b, sq, hq, d) and lse (b, hq, sq), both float64.

    dropout_mask (b, hq, sq, sk) bool: kept entries of P, scaled by dropout_rescale (the LSE is
    that of the softmax before dropout)."""
    (qh, kh, vh), prob = _prepare(q, k, v, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, np.float64)
    rows, cols = np.arange(prob.seqlen_q), np.arange(prob.seqlen_k)
    s, _ = _scores(qh, kh, rows, cols, prob)
    p, lse = _dense_softmax(_mask(s, rows, cols, prob))
    if dropout_mask is not None:
        p = p * dropout_mask * dropout_rescale
    return _seq_first(p @ vh), lse


def attention_backward_naive(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_mask=None,
                             dropout_rescale=1.0):
    """Analytic float64 gradients (dq, dk, dv) of attention, shaped like q, k, v.

    P is recomputed from lse (so out/lse must come from the same forward); with
    D = rowsum(dO * O): dV = P^T dO, dS = P * (dO V^T - D) [* (1 - tanh^2) with softcap],
    dQ = scale dS K, dK = scale dS^T Q.  kv gradients are summed over the query heads of
    each GQA group.
    """
    (qh, kh, vh), prob = _prepare(q, k, v, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, np.float64)
    do, o = _heads_first(dout, np.float64), _heads_first(out, np.float64)
    lse = np.asarray(lse, np.float64)
    rows, cols = np.arange(prob.seqlen_q), np.arange(prob.seqlen_k)
    s, t = _scores(qh, kh, rows, cols, prob)
    vis = _visible(rows, cols, prob.seqlen_q, prob.seqlen_k, causal, window_size)
    keep = vis & np.isfinite(lse)[..., None]  # lse = +inf marks a row that sees nothing
    p = np.exp(np.where(keep, s - np.where(np.isfinite(lse), lse, 0.0)[..., None], -np.inf))
    dp = do @ _swap(vh)
    p_dropped = p
    if dropout_mask is not None:  # dV = (P Z r)^T dO, dS = P (Z r dP - D)
        p_dropped = p * dropout_mask * dropout_rescale
        dp = dp * dropout_mask * dropout_rescale
    ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
    if t is not None:
        ds = ds * (1.0 - t * t)
    dq = prob.scale * (ds @ kh)
    dk = prob.scale * (_swap(ds) @ qh)
    dv = _swap(p_dropped) @ do
    return _seq_first(dq), _seq_first(dk, prob.groups), _seq_first(dv, prob.groups)


# ------------------------------------------------------------ tiled forward (fp32)


#: The Hopper forward's slack for the exponentials' reference (kernels_cu/wgmma/flash_fwd_sm90.cu,
#: kReferenceSlack), in log2 units; the mma.sync kernels keep the exact running maximum (0).
HOPPER_RESCALE_SLACK = 8.0
#: The largest slack attention_tiled takes: probabilities stay below 2^16, finite in fp16.
MAX_RESCALE_SLACK = 15.0


def _online_update(m, l, acc, s2, vb, p_dtype, slack=0.0):
    """One online-softmax step over a key block, exactly as the kernel does it in fp32.

    s2 are the masked logits in log2 units.  m is each row's reference for the exponentials:
    it moves to the block's maximum only where that exceeds it by more than `slack` (0: the
    exact running maximum), so probabilities stay within [0, 2^slack] and O is rescaled only
    when it moves.  A reference of -inf is replaced by 0 as the subtrahend so exp2(-inf -
    (-inf)) never produces NaN.  The row sum uses fp32 P, while the P @ V product sees P
    rounded to p_dtype (the kernel's fp16/bf16 MMA input).
    """
    block_max = s2.max(axis=-1)
    with np.errstate(invalid="ignore"):  # -inf - -inf: a row with nothing visible yet keeps -inf
        m_new = np.where(block_max - m > slack, block_max, m)
    sub = np.where(m_new == -np.inf, np.float32(0), m_new)
    corr = np.exp2(m - sub)
    p = np.exp2(s2 - sub[..., None])
    l = l * corr + p.sum(axis=-1, dtype=np.float32)
    if p_dtype is not None:
        p = p.astype(p_dtype).astype(np.float32)
    acc = acc * corr[..., None] + p @ vb
    return m_new, l, acc


def _finalize(m, l, acc):
    """out = acc / l and lse = (m + log2 l) ln 2, with out = 0, lse = +inf where l == 0."""
    pos = l > 0
    safe = np.where(pos, l, np.float32(1))
    out = np.where(pos[..., None], acc / safe[..., None], np.float32(0))
    lse = np.where(pos, (m + np.log2(safe)) * np.float32(LN2), np.float32(np.inf))
    return out.astype(np.float32), lse.astype(np.float32)


def _forward_query_block(qh, kh, vh, m_block, block_m, block_n, prob, p_dtype, slack):
    """Forward for one query block over all batches/heads; returns (out, lse) for its rows."""
    sq, sk = prob.seqlen_q, prob.seqlen_k
    rows = _block_idx(m_block, block_m, sq)
    qb = qh[:, :, rows]
    m = np.full(qb.shape[:3], -np.inf, np.float32)
    l = np.zeros(qb.shape[:3], np.float32)
    acc = np.zeros(qb.shape[:3] + vh.shape[3:], np.float32)
    n_min, n_max = key_block_range(m_block, block_m, block_n, sq, sk, prob.causal,
                                   prob.window_size)
    for n_block in range(n_max - 1, n_min - 1, -1):  # kernel order: last key block first
        cols = _block_idx(n_block, block_n, sk)
        s, _ = _scores(qb, kh[:, :, cols], rows, cols, prob)
        s2 = s * np.float32(LOG2E)
        if block_needs_mask(m_block, n_block, block_m, block_n, sq, sk, prob.causal,
                            prob.window_size):
            s2 = _mask(s2, rows, cols, prob)
        m, l, acc = _online_update(m, l, acc, s2, vh[:, :, cols], p_dtype, slack)
    return _finalize(m, l, acc)


def attention_tiled(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, block_m=64, block_n=64, p_dtype=None,
                    rescale_slack=0.0):
    """Blocked float32 forward mirroring the kernel; returns out (b,sq,hq,d), lse (b,hq,sq).

    Inputs of any float dtype (fp16, bf16, fp32, fp64) are converted to float32.  Query
    blocks whose key range is empty are left at out = 0, lse = +inf.  ``p_dtype`` (any
    numpy dtype, e.g. np.float16 or ml_dtypes.bfloat16) rounds P before P @ V.
    ``rescale_slack`` (log2 units, >= 0): how far a key block's maximum may exceed a row's
    reference before the reference moves (0, the mma.sync kernels: the exact running maximum;
    HOPPER_RESCALE_SLACK: the Hopper forward).
    """
    # Probabilities reach 2^slack: below 2^16, fp16's largest finite value, when P is rounded to it.
    if isinstance(rescale_slack, bool) or not isinstance(rescale_slack, numbers.Real) or not (
            0 <= rescale_slack <= MAX_RESCALE_SLACK):
        raise ValueError(f"rescale_slack: expected a number in [0, {MAX_RESCALE_SLACK:g}], got {rescale_slack!r}")
    (qh, kh, vh), prob = _prepare(q, k, v, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, np.float32)
    p_dtype = None if p_dtype is None else np.dtype(p_dtype)
    b, hq, sq, d = qh.shape
    out = np.zeros((b, hq, sq, vh.shape[3]), np.float32)
    lse = np.full((b, hq, sq), np.inf, np.float32)
    for m_block in range(_num_blocks(sq, block_m)):
        rows = _block_idx(m_block, block_m, sq)
        out[:, :, rows], lse[:, :, rows] = _forward_query_block(
            qh, kh, vh, m_block, block_m, block_n, prob, p_dtype, np.float32(rescale_slack))
    return _seq_first(out), lse


# ----------------------------------------------------------- tiled backward (fp32)


def _backward_key_block(t, n_block, block_m, block_n, prob, dq_acc):
    """Backward for one key/value block: returns unscaled (dk, dv) per query head.

    ``t`` holds the heads-first fp32 tensors (q, k, v, do, lse2, delta).  Loops over the
    query blocks that see this key block (last first, as the kernel does), recomputes
    P = exp2(s log2e - lse log2e) and adds dS K into the shared fp32 dq_acc buffer (the
    kernel's atomicAdd).
    """
    qh, kh, vh, do, lse2, delta = t
    sq, sk = prob.seqlen_q, prob.seqlen_k
    cols = _block_idx(n_block, block_n, sk)
    kb, vb = kh[:, :, cols], vh[:, :, cols]
    dk = np.zeros(kb.shape, np.float32)
    dv = np.zeros(vb.shape, np.float32)
    m_min, m_max = query_block_range(n_block, block_m, block_n, sq, sk, prob.causal,
                                     prob.window_size)
    for m_block in range(m_max - 1, m_min - 1, -1):
        rows = _block_idx(m_block, block_m, sq)
        s, th = _scores(qh[:, :, rows], kb, rows, cols, prob)
        s2 = s * np.float32(LOG2E)
        if block_needs_mask(m_block, n_block, block_m, block_n, sq, sk, prob.causal,
                            prob.window_size):
            s2 = _mask(s2, rows, cols, prob)
        p = np.exp2(s2 - lse2[:, :, rows, None])  # lse = +inf -> p = 0, never NaN
        dob = do[:, :, rows]
        dv += _swap(p) @ dob
        ds = p * (dob @ _swap(vb) - delta[:, :, rows, None])
        if th is not None:
            ds = ds * (np.float32(1) - th * th)
        dk += _swap(ds) @ qh[:, :, rows]
        dq_acc[:, :, rows] += ds @ kb
    return dk, dv


def attention_backward_tiled(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             block_m=64, block_n=64):
    """Blocked float32 backward mirroring the kernel; returns float32 (dq, dk, dv).

    D = rowsum(dO * O) is precomputed (the kernel's preprocessing pass); each key block
    accumulates its dK/dV in fp32 per query head (GQA groups are summed at the end, like
    the kernel's expanded dk/dv buffers) and dQ accumulates in an fp32 buffer; the
    softmax scale is applied once at the end.
    """
    (qh, kh, vh), prob = _prepare(q, k, v, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, np.float32)
    do, o = _heads_first(dout, np.float32), _heads_first(out, np.float32)
    delta = (do * o).sum(axis=-1, dtype=np.float32)
    lse2 = np.asarray(lse, np.float32) * np.float32(LOG2E)
    tensors = (qh, kh, vh, do, lse2, delta)
    dq_acc = np.zeros(qh.shape, np.float32)
    dk = np.zeros(kh.shape, np.float32)
    dv = np.zeros(vh.shape, np.float32)
    for n_block in range(_num_blocks(prob.seqlen_k, block_n)):
        cols = _block_idx(n_block, block_n, prob.seqlen_k)
        dk[:, :, cols], dv[:, :, cols] = _backward_key_block(
            tensors, n_block, block_m, block_n, prob, dq_acc)
    scale = np.float32(prob.scale)
    return (_seq_first(dq_acc * scale), _seq_first(dk * scale, prob.groups),
            _seq_first(dv, prob.groups))
