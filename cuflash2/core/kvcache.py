"""The KV-cache operation on described tensors: one call signature's launches recorded once and run
with each call's buffers (cuflash2.core.replay), and the Replay a decoding loop's later steps take
without describing or checking anything.

Validation, the tile and split choice and the kernels' argument lists depend on the call's
signature (shapes, strides, dtypes, options and the alignment of q, k_cache and v_cache), not on
its addresses: they are worked out when a signature is first seen.
"""

from __future__ import annotations

from ..families import family_for
from ..problem.features import AttentionProblem, Features, check_alibi
from ..problem.kvcache import KVCacheProblem, validate_kvcache
from ..runtime.device import device_arch
from ..runtime.tensors import contiguous_info
from . import replay

#: The array arguments of flash_attn_with_kvcache, in the order of the recorded buffers (then out,
#: and lse when the call returns it).
INPUT_BUFFERS = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx", "cache_leftpad",
                 "block_table", "alibi_slopes", "rotary_cos", "rotary_sin")


def _signature(info):
    return None if info is None else (info.shape, info.strides, info.dtype, info.device)


def recording_for(device_id: int, infos: dict, softmax_scale, causal: bool, window: tuple[int, int], softcap: float,
                  interleaved: bool, num_splits: int, return_lse: bool) -> tuple[KVCacheProblem, replay.Recording]:
    """(the validated call, its Recording) for described inputs `infos` (INPUT_BUFFERS -> TensorInfo
    or None); validated and recorded on the signature's first call."""
    # The launches' vector width depends on the alignment of the attention kernel's pointers (up to
    # 16 bytes) as well as on the strides: both are part of the key.
    aligns = tuple(infos[name].data_ptr & 15 for name in ("q", "k_cache", "v_cache"))
    key = ("kvcache", device_id, tuple(_signature(infos[name]) for name in INPUT_BUFFERS), softmax_scale, causal,
           window, softcap, interleaved, num_splits, return_lse, aligns)
    entry = replay.RECORDINGS.lookup(key)
    if entry is not None:
        return entry
    cache = _validate(infos, softmax_scale)
    shape = cache.shape
    if infos["alibi_slopes"] is not None:
        check_alibi(infos["alibi_slopes"], shape.batch, shape.nheads, infos["q"].device)
    problem = AttentionProblem(shape, causal, Features(window[0], window[1], softcap, infos["alibi_slopes"]))
    family = family_for(device_arch(device_id), problem, "kvcache")
    q = infos["q"]
    out = contiguous_info(q.shape, q.dtype, q.itemsize, q.device)
    lse = contiguous_info((cache.batch, cache.nheads, cache.seqlen_q), "float32", 4, q.device) if return_lse else None
    names = INPUT_BUFFERS + ("out", "lse")

    def run(*buffers):
        tensors = dict(zip(names, buffers))
        tensors.setdefault("lse", None)  # not returned: the family takes scratch
        features = Features(window[0], window[1], softcap, tensors["alibi_slopes"])
        family.kvcache(cache, tensors, causal, features, interleaved, num_splits, aligns, device_id, None)

    buffers = [infos[name] for name in INPUT_BUFFERS] + [out] + ([lse] if return_lse else [])
    recording = replay.record(run, buffers, device_id)
    entry = (cache, recording)
    replay.RECORDINGS.keep(key, entry)
    return entry


def _validate(infos: dict, softmax_scale) -> KVCacheProblem:
    return validate_kvcache(infos["q"], infos["k_cache"], infos["v_cache"], infos["k"], infos["v"],
                            infos["rotary_cos"], infos["rotary_sin"], infos["cache_seqlens"],
                            infos["cache_batch_idx"], infos["cache_leftpad"], infos["block_table"], softmax_scale,
                            check_pointers=False)


def keep_step(key, ops, arrays: tuple, infos: dict, recording: replay.Recording, q, lse_shape: tuple,
              return_lse: bool, device_id: int) -> None:
    """Keep the Replay of a decoding step under `key` (a framework's call key) when the full path
    used the caller's buffers as given."""
    if key is None or not recording.launches or key in replay.KVCACHE_STEPS:
        return
    if not replay.used_as_given(ops, arrays, [infos[name] for name in INPUT_BUFFERS]):
        return  # copied or converted on the way (a last stride, fp16 rotary tables, ...)
    outputs = [(tuple(q.shape), q.dtype)] + ([(lse_shape, ops.float32)] if return_lse else [])
    replay.KVCACHE_STEPS.keep(key, replay.Replay(recording, ops, device_id, outputs, aligned_inputs=3,
                                                 single=not return_lse))


__all__ = ["INPUT_BUFFERS", "keep_step", "recording_for"]
