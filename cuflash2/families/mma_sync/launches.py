"""The mma.sync kernels' forward and backward launches on described device tensors (pointer, shape,
strides), with their argument lists: no array objects are built on the hot path, so a call costs
little more than the launches themselves.

Every function here runs on the given CuPy stream and assumes its inputs were validated. Launches
and scratch go through cuflash2.runtime.launcher, so a call's launches can be recorded and replayed.
"""

from __future__ import annotations

import math

import numpy as np

from ...dropout import dropout_threshold, rescale
from ...problem.features import PLAIN, Features
from ...problem.tensors import SHORT_DTYPE, AttentionShape, TensorInfo
from ...runtime import launcher
from ...runtime.device import device_arch
from .backward_plans import backward_plan, narrow_backward_plan
from .forward_tiles import forward_config
from .kernel_config import BWD_CONVERT, MAX_GRID_YZ, KernelConfig, fp32_cols, vector_width, with_vector_width

_ELEMENTWISE_THREADS = 256
_i32, _i64, _f32, _ptr = np.int32, np.int64, np.float32, np.uint64


def call_vector_width(head_dim: int, *tensors: TensorInfo | None) -> int:
    """Bytes per global access the kernels of a call can use (config.vector_width) over the 16-bit
    tensors they read or write: base pointers and the strides of every dim but the last (stride 1)
    that has more than one entry."""
    offsets = []
    for t in tensors:
        if t is not None:
            offsets.append(t.data_ptr)
            offsets += [s * t.itemsize for s, n in zip(t.strides[:-1], t.shape) if n > 1]
    return vector_width(head_dim, 2, offsets)


def _strides3(t: TensorInfo):
    return [_i64(s) for s in t.strides[:3]]


#: Window sides at or beyond this are unbounded (keeps the kernels' int arithmetic far from overflow).
UNBOUNDED = 1 << 30
LOG2_E = 1.0 / math.log(2.0)


def feature_args(features: Features, causal: bool, softmax_scale: float) -> tuple:
    """(scale_log2, softmax_scale, cu_seqlens_q, cu_seqlens_k, window_left, window_right, softcap,
    alibi_slopes, alibi_batch_stride, dropout_seed, dropout_offset, dropout_threshold,
    dropout_rescale, dropout_rng_state) as the kernels take them (CF_VARIANT_PARAMS)."""
    left = UNBOUNDED if features.window_left < 0 else min(features.window_left, UNBOUNDED)
    right = UNBOUNDED if features.window_right < 0 else min(features.window_right, UNBOUNDED)
    if causal:
        right = 0
    scale_log2 = LOG2_E if features.modifies_scores else softmax_scale * LOG2_E
    alibi = features.alibi
    alibi_ptr = alibi.data_ptr if alibi is not None else 0
    alibi_batch_stride = alibi.strides[0] if alibi is not None and len(alibi.shape) == 2 else 0
    rng_state = features.dropout_rng_state
    return (np.float32(scale_log2), np.float32(softmax_scale),
            np.uint64(features.cu_seqlens_q.data_ptr if features.varlen else 0),
            np.uint64(features.cu_seqlens_k.data_ptr if features.varlen else 0),
            np.int32(left), np.int32(right), np.float32(features.softcap),
            np.uint64(alibi_ptr), np.int64(alibi_batch_stride), np.int64(features.dropout_seed),
            np.int64(features.dropout_offset & 0xFFFFFFFF), np.int32(dropout_threshold(features.dropout_p)),
            np.float32(rescale(features.dropout_p)),
            np.uint64(rng_state.data_ptr if rng_state is not None else 0))


def _main_grid(config: KernelConfig, device_id: int, blocks: int, nheads: int, batch: int) -> tuple[int, int, int]:
    slots = launcher.resident_slots(config, device_id) if config.grouped_grid else 0
    return config.grid(blocks, nheads, batch, slots)


def _seqlen_args(shape: AttentionShape, features: Features):
    """The kernels' seqlen_q/seqlen_k arguments: varlen kernels read the lengths from cu_seqlens and
    take the packed row counts here instead (the LSE and D layout (nheads, total_q))."""
    if features.varlen:
        return _i32(features.total_q), _i32(features.total_k)
    return _i32(shape.seqlen_q), _i32(shape.seqlen_k)


def forward(q: TensorInfo, k: TensorInfo, v: TensorInfo, out: TensorInfo, lse: TensorInfo, shape: AttentionShape,
            causal: bool, device_id: int, stream, config: KernelConfig | None = None,
            features: Features = PLAIN) -> None:
    """out, lse <- attention(q, k, v). `config` overrides the tile choice (tuning only). Varlen calls
    pass q, k, v, out as (batch, max_seqlen, nheads, dim) views with batch stride 0 (features.as_batched)."""
    if config is None:
        config = forward_config(shape.head_dim, SHORT_DTYPE[shape.dtype], causal, device_arch(device_id),
                                not features.is_plain(causal), max(shape.seqlen_q, shape.seqlen_k))
    config = with_vector_width(config, call_vector_width(shape.head_dim, q, k, v, out))
    m_blocks = math.ceil(shape.seqlen_q / config.block_m)
    if config.grouped_grid and m_blocks > MAX_GRID_YZ:  # grouped grids hold the query blocks in grid y
        raise ValueError(f"q: the causal forward handles at most {MAX_GRID_YZ * config.block_m} query rows per "
                         f"sequence with head dim {shape.head_dim}, got {shape.seqlen_q}")
    grid = _main_grid(config, device_id, m_blocks, shape.nheads, shape.batch)
    launcher.launch_kernel(config, device_id, stream, grid,
            (_ptr(q.data_ptr), _ptr(k.data_ptr), _ptr(v.data_ptr), _ptr(out.data_ptr), _ptr(lse.data_ptr),
             *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out),
             *_seqlen_args(shape, features), _i32(shape.head_dim), _i32(shape.kv_group),
             *feature_args(features, causal, shape.softmax_scale), _i32(shape.nheads)))


def backward(dout: TensorInfo, q: TensorInfo, k: TensorInfo, v: TensorInfo, out: TensorInfo, lse: TensorInfo,
             dq: TensorInfo, dk: TensorInfo, dv: TensorInfo, shape: AttentionShape, causal: bool,
             deterministic: bool, device_id: int, stream, atomic_dq: bool | None = None,
             split: bool | None = None, arch: int | None = None, features: Features = PLAIN,
             tile: tuple[int, int, int] | None = None, fused: bool | None = None) -> None:
    """dq, dk, dv <- gradients. `atomic_dq`/`split`/`arch` (another GPU's tile table)/`tile`/`fused`
    override the plan: tuning and tests only. Varlen tensors come as in `forward`."""
    h, d = shape.nheads, shape.head_dim
    gqa = shape.kv_group > 1
    variant = not features.is_plain(causal)
    if variant and atomic_dq:
        raise ValueError("atomic_dq: the variant kernels (window/softcap/ALiBi/varlen) use the dQ kernel only")
    plan = backward_plan(d, SHORT_DTYPE[shape.dtype], causal, arch or device_arch(device_id), deterministic, gqa,
                         split, atomic_dq, variant, tile, fused)
    if any(c.grouped_grid and math.ceil(shape.seqlen_k / c.block_n) > MAX_GRID_YZ for c in plan.main):
        if fused:  # its causal grid holds the key blocks in grid y (at most 65535)
            raise ValueError(f"fused: the causal one-pass backward handles at most {MAX_GRID_YZ} key blocks, "
                             f"got seqlen_k {shape.seqlen_k}")
        plan = backward_plan(d, SHORT_DTYPE[shape.dtype], causal, arch or device_arch(device_id), deterministic,
                             gqa, split, atomic_dq, variant, tile, fused=False)
    vec = call_vector_width(d, dout, q, k, v, out, dq, dk, dv)
    if vec != 16:  # rows that are not 16-byte aligned: the plan built for narrow accesses
        plan = narrow_backward_plan(d, SHORT_DTYPE[shape.dtype], causal, arch or device_arch(device_id), gqa, variant,
                                    vec)
    # Row-wise buffers (D, fp32 accumulators) cover (b, seqlen) rows, or the packed rows when varlen.
    if features.varlen:
        b, sq, sk = 1, features.total_q, features.total_k
    else:
        b, sq, sk = shape.batch, shape.seqlen_q, shape.seqlen_k
    keep = []  # scratch arrays must outlive the launches that use them (stream-ordered pool)

    delta, delta_i = launcher.scratch((b, h, sq))
    keep.append(delta)
    launcher.launch_kernel(plan.dot, device_id, stream, (math.ceil(h * sq * 8 / _ELEMENTWISE_THREADS), b),
            (_ptr(dout.data_ptr), _ptr(out.data_ptr), _ptr(delta_i.data_ptr), *_strides3(dout), *_strides3(out),
             _i32(sq), _i32(h), _i32(d)))

    dq_acc_ptr = delta_i.data_ptr  # unused unless the main kernel accumulates dQ
    if plan.dq is None:  # (b, h, sq rounded up to the query block, pitch): one block is one contiguous range
        dq_producer = next(c for c in plan.main if c.accumulates_dq)
        block_m = dq_producer.block_m
        pitch = dq_producer.dq_row_pitch(d)  # the convert kernel reads rows by their stride
        dq_acc, dq_acc_i = launcher.scratch((b, h, math.ceil(sq / block_m) * block_m, pitch), zero=True)
        keep.append(dq_acc)
        dq_acc_ptr = dq_acc_i.data_ptr
    if gqa:  # per-query-head fp32 dK/dV, summed over each group by the conversion kernel
        # Varlen: packed rows outside every sequence are never written by the main kernel, but the
        # conversion reads all of them, so the scratch starts at zero there.
        zero = features.varlen
        acc_shape = (b, sk, h, fp32_cols(d))  # rows padded to 8 columns (the kernels' fp32_cols)
        (dk_acc, dk_t), (dv_acc, dv_t) = launcher.scratch(acc_shape, zero=zero), launcher.scratch(acc_shape, zero=zero)
        keep += [dk_acc, dv_acc]
        dk_strides = dv_strides = [_i64(0)] * 3  # the kernel knows the contiguous fp32 layout
    else:
        dk_t, dv_t, dk_strides, dv_strides = dk, dv, _strides3(dk), _strides3(dv)
    scale = shape.softmax_scale
    tail = (*_seqlen_args(shape, features), _i32(d), _i32(shape.kv_group), *feature_args(features, causal, scale))
    for config in plan.main:
        grid = _main_grid(config, device_id, math.ceil(shape.seqlen_k / config.block_n), h, shape.batch)
        launcher.launch_kernel(config, device_id, stream, grid,
                (_ptr(q.data_ptr), _ptr(k.data_ptr), _ptr(v.data_ptr), _ptr(dout.data_ptr), _ptr(lse.data_ptr),
                 _ptr(delta_i.data_ptr), _ptr(dq_acc_ptr), _ptr(dk_t.data_ptr), _ptr(dv_t.data_ptr),
                 *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *dk_strides, *dv_strides, *tail,
                 _i32(h)))
    if plan.dq is not None:
        grid = (math.ceil(shape.seqlen_q / plan.dq.block_m), h, shape.batch)
        launcher.launch_kernel(plan.dq, device_id, stream, grid,
                (_ptr(q.data_ptr), _ptr(k.data_ptr), _ptr(v.data_ptr), _ptr(dout.data_ptr), _ptr(lse.data_ptr),
                 _ptr(delta_i.data_ptr), _ptr(dq.data_ptr), *_strides3(q), *_strides3(k), *_strides3(v),
                 *_strides3(dout), *_strides3(dq), *tail))
    else:
        _convert(plan.convert, device_id, stream, dq_acc_i, dq, b, sq, h, d, 1, scale, heads_major=True,
                 col_swizzle=dq_producer.dq_column_swizzle(d), row_interleave=dq_producer.dq_row_interleave)
    if gqa:
        for acc, grad in ((dk_t, dk), (dv_t, dv)):
            _convert(plan.convert, device_id, stream, acc, grad, b, sk, shape.nheads_kv, d, shape.kv_group, 1.0)
    del keep  # CuPy's pool reuses the memory only for work queued after this point on the stream


def convert_accumulator(dtype: str, device_id: int, stream, acc: TensorInfo, out: TensorInfo, batch, seqlen, nheads,
                        head_dim, group, scale, heads_major=False) -> None:
    """out (`dtype`: "bfloat16" or "float16") <- scale * the fp32 accumulator `acc` summed over each
    group of `group` heads (flash_bwd_convert_kernel, which other kernel families use too): see
    _convert, with the accumulator's columns and rows in order."""
    _convert(KernelConfig(BWD_CONVERT, SHORT_DTYPE[dtype], warps=8), device_id, stream, acc, out, batch, seqlen, nheads,
             head_dim, group, scale, heads_major)


def _convert(config, device_id, stream, acc: TensorInfo, out: TensorInfo, batch, seqlen, nheads, head_dim, group,
             scale, heads_major=False, col_swizzle=0, row_interleave=False):
    """out <- scale * acc summed over each group of `group` heads; acc is (b, s, h, d), or
    (b, h, s_padded, pitch) when heads_major (KernelConfig.dq_row_pitch; columns past d are not stored); its
    columns permuted by `col_swizzle` (KernelConfig.dq_column_swizzle), its rows by `row_interleave`
    (KernelConfig.dq_row_interleave; s_padded is a multiple of 8 then)."""
    batch_stride, row_stride, head_stride = acc.strides[:3]
    if heads_major:
        row_stride, head_stride = head_stride, row_stride
    rows_per_block = config.threads // (fp32_cols(head_dim) // 4)  # one thread per 4 columns (flash_bwd_prepost.cu)
    launcher.launch_kernel(config, device_id, stream, (math.ceil(seqlen / rows_per_block), nheads, batch),
            (_ptr(acc.data_ptr), _ptr(out.data_ptr), _i64(batch_stride), _i64(row_stride), _i64(head_stride),
             *_strides3(out), _i32(seqlen), _i32(nheads), _i32(head_dim), _i32(group), _f32(scale),
             _i32(col_swizzle), _i32(int(row_interleave))))
