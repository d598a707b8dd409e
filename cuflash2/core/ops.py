"""The attention operations on described device tensors: validated problems in, work queued on the
caller's stream out. Framework-free: the adapters (cuflash2.frameworks) describe the arrays, pick the
stream and allocate the outputs; the kernel family (cuflash2.families.family_for) launches.

Forward and backward calls launch directly and keep a Replay of their launches for the call's key
(cuflash2.core.replay); varlen calls run their launches from a Recording per described signature.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..families import family_for
from ..problem.features import AttentionProblem
from ..problem.tensors import TensorInfo
from ..runtime import launcher
from ..runtime.device import device_arch
from . import replay


def forward(problem: AttentionProblem, q, k, v, out, lse, device_id: int, stream) -> None:
    """out, lse <- attention(q, k, v) for a validated dense problem."""
    shape = problem.shape
    if shape.batch == 0 or shape.seqlen_q == 0:  # empty output, nothing to compute
        return
    if shape.seqlen_k == 0:  # FA2: no keys -> output 0, LSE +inf
        launcher.fill(out, 0, device_id)
        launcher.fill(lse, np.inf, device_id)
        return
    tensors = (("q", q), ("k", k), ("v", v), ("out", out))
    family = family_for(device_arch(device_id), problem, "forward", tensors)
    family.forward(problem, q, k, v, out, lse, device_id, stream)


def backward(problem: AttentionProblem, deterministic: bool, dout, q, k, v, out, lse, dq, dk, dv, device_id: int,
             stream) -> None:
    """dq, dk, dv <- gradients for a validated dense problem."""
    shape = problem.shape
    if shape.seqlen_k == 0 or shape.seqlen_q == 0 or shape.batch == 0:  # no query sees a key: zero gradients
        for info in (dq, dk, dv):
            launcher.fill(info, 0, device_id)
        return
    tensors = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("softmax_lse", lse), ("dq", dq),
               ("dk", dk), ("dv", dv))
    family = family_for(device_arch(device_id), problem, "backward", tensors, deterministic)
    family.backward(problem, dout, q, k, v, out, lse, dq, dk, dv, device_id, stream, deterministic)


def _launches_kernels(problem: AttentionProblem) -> bool:
    """Empty problems are filled (zeros, LSE +inf) without the attention kernels."""
    shape = problem.shape
    return bool(shape.batch and shape.seqlen_q and shape.seqlen_k)


def _keep_replay(key, ops, arrays, infos, output_infos, output_dtypes, run, device_id: int) -> None:
    if not replay.used_as_given(ops, arrays, infos) or not all(map(replay.is_contiguous, output_infos)):
        return

    def make_replay():
        recording = replay.record(run, list(infos + output_infos), device_id)
        if recording is None or not recording.launches:
            return None
        outputs = [(tuple(info.shape), dtype) for info, dtype in zip(output_infos, output_dtypes, strict=True)]
        return replay.Replay(recording, ops, device_id, outputs, aligned_inputs=len(infos))

    replay.CALLS.keep_recorded(key, make_replay)


def keep_forward_replay(key, ops, arrays, infos, output_infos, problem: AttentionProblem, device_id: int) -> None:
    """After a direct forward of arrays (q, k, v) -> (out, lse): keep its Replay under `key` (a
    framework's call key; `ops` its operations), when later calls can take it."""
    if key is None or key in replay.CALLS or not problem.features.replayable or not _launches_kernels(problem):
        return

    def run(q, k, v, out, lse):
        forward(problem, q, k, v, out, lse, device_id, None)

    _keep_replay(key, ops, arrays, infos, output_infos, (arrays[0].dtype, ops.float32), run, device_id)


def keep_backward_replay(key, ops, arrays, infos, output_infos, problem: AttentionProblem, deterministic: bool,
                         device_id: int) -> None:
    """After a direct backward of (dout, q, k, v, out, lse) -> (dq, dk, dv): keep its Replay."""
    if key is None or key in replay.CALLS or not problem.features.replayable or not _launches_kernels(problem):
        return

    def run(dout, q, k, v, out, lse, dq, dk, dv):
        backward(problem, deterministic, dout, q, k, v, out, lse, dq, dk, dv, device_id, None)

    _keep_replay(key, ops, arrays, infos, output_infos, tuple(x.dtype for x in arrays[1:4]), run, device_id)


# ---- varlen -------------------------------------------------------------------------------------

_FEATURE_TENSORS = ("cu_seqlens_q", "cu_seqlens_k", "alibi", "dropout_rng_state")


def _signature(info: TensorInfo | None):
    return None if info is None else (info.shape, info.strides, info.dtype, info.device, info.data_ptr % 16)


def _run_recorded(key, run, infos: list, device_id: int, stream) -> None:
    """run(*infos) through the Recording kept for `key` (recorded on the first call of a signature:
    `key` holds everything the launches depend on but the addresses, which it holds modulo 16)."""
    recording = replay.RECORDINGS.lookup(key)
    if recording is None and key not in replay.RECORDINGS:
        recording = replay.record(run, infos, device_id, tuple(0 if i is None else i.data_ptr % 16 for i in infos))
        replay.RECORDINGS.keep(key, recording)
    if recording is None:
        run(*infos)
    else:
        recording.run_direct([0 if i is None else i.data_ptr for i in infos], stream)


def _run_with_features(problem: AttentionProblem, name: str, launch, tensors: list, device_id: int, stream,
                       extra=()) -> None:
    """launch(problem, *tensors) with the problem's feature tensors among the recorded buffers; calls
    whose kernel arguments hold a host dropout seed (new each call) launch directly."""
    features = problem.features
    if features.dropout_p and features.dropout_rng_state is None:
        launch(problem, *tensors)
        return
    feature_infos = [getattr(features, field) for field in _FEATURE_TENSORS]
    bare = dataclasses.replace(features, **dict.fromkeys(_FEATURE_TENSORS))
    count = len(tensors)

    def run(*buffers):
        given = dataclasses.replace(bare, **dict(zip(_FEATURE_TENSORS, buffers[count:])))
        launch(dataclasses.replace(problem, features=given), *buffers[:count])

    infos = list(tensors) + feature_infos
    key = (name, device_id, dataclasses.replace(problem, features=bare), tuple(map(_signature, infos)), extra)
    _run_recorded(key, run, infos, device_id, stream)


def varlen_forward(problem: AttentionProblem, q, k, v, out, lse, device_id: int, stream) -> None:
    """out, lse <- attention of packed q, k, v (q, k, v, out as (batch, max_seqlen, nheads, dim)
    views with batch stride 0: features.as_batched; rows outside every sequence filled by the
    caller). Nothing to launch without query rows."""
    if problem.shape.seqlen_q == 0:
        return

    def launch(problem, q, k, v, out, lse):
        family_for(device_arch(device_id), problem, "forward").forward(problem, q, k, v, out, lse, device_id, stream)

    _run_with_features(problem, "varlen-forward", launch, [q, k, v, out, lse], device_id, stream)


def varlen_backward(problem: AttentionProblem, deterministic: bool, dout, q, k, v, out, lse, dq, dk, dv,
                    device_id: int, stream) -> None:
    """Gradients of a varlen call (tensors batched as in varlen_forward; rows outside every
    sequence zeroed by the caller)."""
    if problem.shape.seqlen_q == 0 or problem.shape.seqlen_k == 0:
        return

    def launch(problem, dout, q, k, v, out, lse, dq, dk, dv):
        family = family_for(device_arch(device_id), problem, "backward", deterministic=deterministic)
        family.backward(problem, dout, q, k, v, out, lse, dq, dk, dv, device_id, stream, deterministic)

    _run_with_features(problem, "varlen-backward", launch, [dout, q, k, v, out, lse, dq, dk, dv], device_id, stream,
                       deterministic)


def paged_varlen_forward(problem: AttentionProblem, q, k_cache, v_cache, out, lse, block_table, page_size: int,
                         device_id: int, stream) -> None:
    """out, lse <- attention of packed q against paged K/V (q, out packed (total_q, nheads, d))."""
    if problem.shape.seqlen_q == 0 or problem.shape.batch == 0:
        return

    def launch(problem, q, k_cache, v_cache, out, lse, block_table):
        family_for(device_arch(device_id), problem, "kvcache").paged_forward(problem, q, k_cache, v_cache, out, lse,
                                                                             block_table, page_size, device_id, stream)

    _run_with_features(problem, "paged-varlen-forward", launch, [q, k_cache, v_cache, out, lse, block_table],
                       device_id, stream, page_size)


__all__ = ["backward", "forward", "keep_backward_replay", "keep_forward_replay", "paged_varlen_forward",
           "varlen_backward", "varlen_forward"]
