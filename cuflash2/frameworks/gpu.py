"""GPU arrays of any framework: described as device tensors, outputs allocated in the caller's
framework, work queued on the caller's stream; the entry points every GPU adapter shares.

GPU work always runs on the caller's stream: CuPy's current stream for CuPy arrays, torch's current
stream for torch tensors (cuflash2.frameworks.torch_adapter), CuPy's current stream for other DLPack
producers (they make their data ready on it when exporting). Nothing synchronises the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import warnings

import numpy as np

from .. import dropout as dropout_rng
from ..core import kvcache as core_kvcache
from ..core import ops, replay
from ..problem.features import AttentionProblem, Features, as_batched, check_alibi, check_rng_state
from ..problem.kvcache import check_cache_rows
from ..problem.options import AttentionOptions
from ..problem.tensors import (AttentionShape, TensorInfo, check_alignment, check_grid, check_like_input, check_lse,
                               softmax_scale_or_default, validate_out, validate_qkv)
from ..problem.varlen import check_packed_like, check_varlen_lse, validate_paged_varlen, validate_varlen
from ..materialize import as_float32, attention_probs_of, gather_pages_of, varlen_probs_of
from ..runtime import launcher
from ..runtime.device import import_cupy
from .arrays import check_cuda, describe, framework_of
from .base import Adapter

_external_streams: dict[tuple[int, int], object] = {}


def external_stream(cp, handle: int, device_id: int):
    """A (cached) CuPy wrapper of a stream owned by another framework."""
    stream = _external_streams.get((handle, device_id))
    if stream is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cp.cuda.ExternalStream(handle, device_id)
        _external_streams[(handle, device_id)] = stream
    return stream


class GpuCall:
    """One GPU call on CuPy arrays or DLPack producers: the inputs described as device tensors,
    outputs allocated in the caller's framework, and the stream to launch on. Copies made on the
    way (a non-unit last stride) are kept alive here until the call ends."""

    def __init__(self, framework: str, device_id: int, stream):
        self.framework, self.device_id, self.stream = framework, device_id, stream
        self.keep: list = []

    def tensor(self, name: str, x) -> TensorInfo:
        """Describe a GPU input (the kernels need a unit last stride: copy when it is not, as FA2)."""
        return describe(name, self.to_cupy(name, x))

    def output(self, name: str, x) -> TensorInfo:
        """Describe a caller-given output buffer. Never copies (the kernels must write into the
        caller's memory), so a last dimension that is not contiguous is rejected."""
        cp = import_cupy()
        if framework_of(x, name) != "cupy":
            check_cuda(name, x)
            x = cp.from_dlpack(x)
        return self.checked_output(name, describe(name, x))

    @staticmethod
    def checked_output(name: str, info: TensorInfo) -> TensorInfo:
        if info.shape and info.shape[-1] > 1 and info.strides[-1] != 1:
            raise ValueError(f"{name}: expected an output with a contiguous last dim (stride 1), "
                             f"got stride {info.strides[-1]}")
        return info

    def to_cupy(self, name: str, x):
        """A CuPy view of a GPU input (zero-copy through DLPack, except the last-stride copy)."""
        cp = import_cupy()
        if self.framework != "cupy":
            check_cuda(name, x)
            x = cp.from_dlpack(self.exportable(x))
        if x.ndim and x.strides[-1] != x.dtype.itemsize and x.shape[-1] > 1:
            x = cp.ascontiguousarray(x)
        self.keep.append(x)
        return x

    @staticmethod
    def exportable(x):
        return x

    def empty(self, shape, dtype_name: str, like=None):
        """(array in the caller's framework, its TensorInfo) for a new output."""
        cp = import_cupy()
        dtype = like.dtype if like is not None and np.dtype(like.dtype).name == dtype_name else np.dtype(dtype_name)
        array = cp.empty(shape, dtype=dtype)
        return array, describe("out", array)

    def result(self, x):
        """Hand an output back in the caller's framework (CuPy arrays converted zero-copy)."""
        return x


class CupyOps:
    """A replay's operations on CuPy arrays (cuflash2.core.replay.Replay): CuPy's pool and current
    stream, on the current device (a replay runs only there)."""

    pointer = operator.attrgetter("data.ptr")

    def __init__(self):
        cp = import_cupy()
        self.cp = cp
        self.array_type = cp.ndarray
        self.current_device = cp.cuda.runtime.getDevice
        self.float32 = np.dtype(np.float32)

    @staticmethod
    def signature(x):
        return x.shape, x.strides, x.dtype, x.data.device_id

    @staticmethod
    def strides_in_elements(x) -> tuple:
        return tuple(s // x.itemsize for s in x.strides)

    def stream_getter(self, device_id: int):
        get_current_stream = self.cp.cuda.get_current_stream
        return lambda: get_current_stream().ptr

    def allocator(self, shape, dtype, device_id: int):
        return functools.partial(self.cp.empty, shape, dtype=dtype)

    def scratch_allocator(self, nbytes: int, device_id: int):
        return functools.partial(self.cp.empty, nbytes, dtype=np.uint8)


_OPTION_TYPES = frozenset((type(None), bool, int, float))


def _plain_option(value) -> bool:
    """Options compared by value: Python scalars and tuples of them. Anything else (a tensor or a
    NumPy scalar as softmax_scale, say) may hash by identity or change in place: the full path."""
    if type(value) is tuple:
        return all(type(v) in _OPTION_TYPES for v in value)
    return type(value) in _OPTION_TYPES


def call_key(framework: str, replay_ops, arrays: tuple, options: tuple):
    """The replay key of a call (None when the call cannot take a replay): the framework, each array
    argument's shape, strides, dtype and device, and the options with their types (so that
    num_splits=True, which the full path rejects, never matches num_splits=1)."""
    if replay_ops is None:
        return None
    for value in options:  # _plain_option, inlined: this runs on every call
        if type(value) not in _OPTION_TYPES and not (type(value) is tuple and _plain_option(value)):
            return None
    array_type, signature = replay_ops.array_type, replay_ops.signature
    sig = []
    for x in arrays:
        if x is None:
            sig.append(None)
        elif type(x) is array_type or isinstance(x, array_type):
            sig.append(signature(x))
        else:  # a Python int, a NumPy array, another framework's tensor: the full path
            return None
    return framework, tuple(sig), options, tuple(map(type, options))


_OWN_KEY = object()  # GpuAdapter.backward's default: the call's key is backward_key's


def _replayable(options: AttentionOptions, alibi_slopes) -> bool:
    return (alibi_slopes is None and options.dropout.p == 0 and replay.FAST_CALLS and launcher.PACKED_LAUNCH)


class GpuAdapter(Adapter):
    """The entry points on GPU arrays; a framework's adapter overrides `call` (its GpuCall and
    stream), `replay_ops` (None: no replays) and the differentiable entry points."""

    replay_ops = None
    call_type = GpuCall

    def __init__(self, name: str = "cupy"):
        self.name = name  # "cupy", or "dlpack" for another CUDA producer
        if name == "cupy":
            self.replay_ops = CupyOps()

    @contextlib.contextmanager
    def call(self, first_input):
        """Context for one GPU call: makes the input's device and the caller's stream current."""
        cp = import_cupy()
        if self.name == "cupy":
            device_id = first_input.device.id
        else:
            check_cuda("q", first_input)
            device_id = int(first_input.__dlpack_device__()[1])
        with cp.cuda.Device(device_id):
            stream = cp.cuda.get_current_stream()
            with stream:
                yield self.call_type(self.name, device_id, stream)

    # ---- dense ------------------------------------------------------------------------------------

    def forward_key(self, q, k, v, options: AttentionOptions, alibi_slopes):
        if self.replay_ops is None or not _replayable(options, alibi_slopes):
            return None
        return call_key(("fwd", self.name), self.replay_ops, (q, k, v),
                        (options.softmax_scale, options.causal, options.window, options.softcap))

    def backward_key(self, dout, q, k, v, out, lse, options: AttentionOptions, alibi_slopes):
        if self.replay_ops is None or not _replayable(options, alibi_slopes):
            return None
        return call_key(("bwd", self.name), self.replay_ops, (dout, q, k, v, out, lse),
                        (options.softmax_scale, options.causal, options.window, options.softcap,
                         options.deterministic))

    def forward(self, q, k, v, alibi_slopes, options: AttentionOptions, out=None):
        """(out, softmax_lse) of flash_attn_forward."""
        key = self.forward_key(q, k, v, options, alibi_slopes) if out is None else None
        result = replay.replay(key, (q, k, v))
        if result is not None:  # a call signature seen before
            return result
        with self.call(q) as call:
            shape, infos = _validated_inputs(call, q, k, v, options.softmax_scale)
            problem = _problem(call, shape, infos[0].device, options, alibi_slopes)
            out_array, out_info = _output(call, out, shape, q)
            lse, lse_info = call.empty((shape.batch, shape.nheads, shape.seqlen_q), "float32")
            ops.forward(problem, *infos, out_info, lse_info, call.device_id, call.stream)
            ops.keep_forward_replay(key, self.replay_ops, (q, k, v), infos, (out_info, lse_info), problem,
                                    call.device_id)
            return (out if out is not None else call.result(out_array)), call.result(lse)

    def forward_into(self, q, k, v, out, softmax_lse, alibi_slopes, options: AttentionOptions) -> None:
        """Forward pass writing into caller-allocated out and softmax_lse."""
        key = self.forward_key(q, k, v, options, alibi_slopes)
        with self.call(q) as call:
            shape, infos = _validated_inputs(call, q, k, v, options.softmax_scale)
            problem = _problem(call, shape, infos[0].device, options, alibi_slopes)
            _, out_info = _output(call, out, shape, q)
            lse_info = call.output("softmax_lse", softmax_lse)
            expected = (shape.batch, shape.nheads, shape.seqlen_q)
            if lse_info.shape != expected or lse_info.dtype != "float32" or (all(expected) and lse_info.strides != (
                    shape.nheads * shape.seqlen_q, shape.seqlen_q, 1)):
                raise ValueError(f"softmax_lse: expected a contiguous float32 array of shape {expected}, "
                                 f"got {lse_info.dtype} {lse_info.shape}")
            ops.forward(problem, *infos, out_info, lse_info, call.device_id, call.stream)
            ops.keep_forward_replay(key, self.replay_ops, (q, k, v), infos, (out_info, lse_info), problem,
                                    call.device_id)

    def backward(self, dout, q, k, v, out, softmax_lse, alibi_slopes, options: AttentionOptions, dq=None, dk=None,
                 dv=None, *, replay_key=_OWN_KEY):
        """(dq, dk, dv) of flash_attn_backward. `replay_key`: the key the call's Replay is kept
        under (a framework adapter that keys calls its own way), else backward_key's."""
        outputs_given = dq is not None or dk is not None or dv is not None
        key = (self.backward_key(dout, q, k, v, out, softmax_lse, options, alibi_slopes) if replay_key is _OWN_KEY
               else replay_key)
        result = None if outputs_given else replay.replay(key, (dout, q, k, v, out, softmax_lse))
        if result is not None:  # a call signature seen before
            return result
        with self.call(q) as call:
            q_i, k_i, v_i = (call.tensor(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
            shape = validate_qkv(q_i, k_i, v_i, options.softmax_scale)
            check_grid(shape)
            problem = _problem(call, shape, q_i.device, options, alibi_slopes)
            do_i, out_i, lse_i = (call.tensor(n, x) for n, x in (("dout", dout), ("out", out),
                                                                 ("softmax_lse", softmax_lse)))
            check_like_input("dout", do_i, q_i)
            check_like_input("out", out_i, q_i)
            check_lse(lse_i, shape)
            for name, info in (("dout", do_i), ("out", out_i)):
                check_alignment(name, info)
            arrays, grads = _gradient_outputs(call, (("dq", dq, q, q_i), ("dk", dk, k, k_i), ("dv", dv, v, v_i)),
                                              check_like_input)
            inputs = (do_i, q_i, k_i, v_i, out_i, lse_i)
            ops.backward(problem, options.deterministic, *inputs, *grads, call.device_id, call.stream)
            ops.keep_backward_replay(key, self.replay_ops, (dout, q, k, v, out, softmax_lse), inputs, tuple(grads),
                                     problem, options.deterministic, call.device_id)
            return tuple(call.result(a) for a in arrays)

    def probs(self, q, k, softmax_lse, alibi_slopes, options: AttentionOptions):
        with self.call(q) as call:
            qa, ka, la = (call.to_cupy(n, x) for n, x in (("q", q), ("k", k), ("softmax_lse", softmax_lse)))
            slopes = None if alibi_slopes is None else call.to_cupy("alibi_slopes", alibi_slopes)
            probs = attention_probs_of(import_cupy(), qa, ka, la, options.softmax_scale, options.causal,
                                       options.window, options.softcap, slopes, _host_dropout(call, options.dropout))
            return call.result(probs)

    # ---- varlen -----------------------------------------------------------------------------------

    def varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                       options: AttentionOptions, out=None):
        with self.call(q) as call:
            packed, problem = _varlen_inputs(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             alibi_slopes, options)
            shape = problem.shape
            out, out_info, lse, lse_info = _varlen_outputs(call, out, q, packed)
            ops.varlen_forward(problem, *(as_batched(i, shape.batch, m) for i, m in (
                (packed.q, shape.seqlen_q), (packed.k, shape.seqlen_k), (packed.v, shape.seqlen_k),
                (out_info, shape.seqlen_q))), lse_info, call.device_id, call.stream)
            return call.result(out), call.result(lse)

    def varlen_backward(self, dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, alibi_slopes, options: AttentionOptions, dq=None, dk=None, dv=None):
        with self.call(q) as call:
            packed, problem = _varlen_inputs(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             alibi_slopes, options)
            shape = problem.shape
            do_i, out_i, lse_i = (call.tensor(n, x) for n, x in (("dout", dout), ("out", out),
                                                                 ("softmax_lse", softmax_lse)))
            for name, info in (("dout", do_i), ("out", out_i)):
                check_packed_like(name, info, packed.q)
                check_alignment(name, info)
            check_varlen_lse(lse_i, shape.nheads, packed.q.shape[0])
            arrays, grads = _gradient_outputs(call, (("dq", dq, q, packed.q), ("dk", dk, k, packed.k),
                                                     ("dv", dv, v, packed.v)), check_packed_like)
            if not packed.covers_all_rows or shape.seqlen_q == 0 or shape.seqlen_k == 0:
                for info in grads:
                    launcher.fill(info, 0, call.device_id)
            b, rows = shape.batch, {"q": shape.seqlen_q, "k": shape.seqlen_k}
            batched = [as_batched(i, b, rows[r]) for i, r in ((do_i, "q"), (packed.q, "q"), (packed.k, "k"),
                                                               (packed.v, "k"), (out_i, "q"))]
            grads = [as_batched(i, b, rows[r]) for i, r in zip(grads, "qkk")]
            ops.varlen_backward(problem, options.deterministic, *batched, lse_i, *grads, call.device_id, call.stream)
            return tuple(call.result(a) for a in arrays)

    def varlen_probs(self, q, k, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                     options: AttentionOptions):
        with self.call(q) as call:
            arrays = [call.to_cupy(n, x) for n, x in (("q", q), ("k", k), ("softmax_lse", softmax_lse))]
            cu_q, cu_k = (call.to_cupy(n, x).get() for n, x in (("cu_seqlens_q", cu_seqlens_q),
                                                                 ("cu_seqlens_k", cu_seqlens_k)))
            slopes = None if alibi_slopes is None else call.to_cupy("alibi_slopes", alibi_slopes)
            return call.result(varlen_probs_of(import_cupy(), *arrays, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                               options.softmax_scale, options.causal, options.window, options.softcap,
                                               slopes, _host_dropout(call, options.dropout)))

    def paged_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k,
                      alibi_slopes, options: AttentionOptions, out=None):
        with self.call(q) as call:
            infos = [call.tensor(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
            if framework_of(block_table, "block_table") == "numpy":
                raise TypeError("block_table: expected a GPU array like q, got a NumPy array")
            table = call.tensor("block_table", block_table)
            cu = _cu_seqlens(call, cu_seqlens_q, cu_seqlens_k)
            paged = validate_paged_varlen(*infos, table, options.softmax_scale, *cu[0], *cu[1], max_seqlen_q,
                                          max_seqlen_k)
            shape = paged.shape
            base = _features(call, shape, infos[0].device, options, alibi_slopes, dropout_rng.NO_DROPOUT)
            features = dataclasses.replace(base, cu_seqlens_q=cu[0][0], cu_seqlens_k=cu[1][0], total_q=q.shape[0])
            out, out_info, lse, lse_info = _varlen_outputs(call, out, q, paged)
            ops.paged_varlen_forward(AttentionProblem(shape, bool(options.causal), features), paged.q, paged.k,
                                     paged.v, out_info, lse_info, paged.block_table, paged.page_size, call.device_id,
                                     call.stream)
            return call.result(out), call.result(lse)

    def gather_pages(self, cache, block_table, cu_seqlens_k):
        with self.call(cache) as call:
            arrays = [call.to_cupy(n, x) for n, x in (("k", cache), ("block_table", block_table))]
            cu = call.to_cupy("cu_seqlens_k", cu_seqlens_k).get()
            return call.result(gather_pages_of(import_cupy(), *arrays, cu))

    # ---- KV cache ---------------------------------------------------------------------------------

    def kvcache_key(self, arrays: tuple, options: tuple):
        if self.replay_ops is None or not launcher.PACKED_LAUNCH:
            return None
        return call_key(self.name, self.replay_ops, arrays, options)

    def kvcache_step(self, key, arrays: tuple):
        """The outputs of the decoding-step Replay kept under `key`, or None (the full path then)."""
        step = replay.KVCACHE_STEPS.lookup(key)
        return None if step is None else step(arrays)

    def kvcache(self, arrays: tuple, softmax_scale, causal: bool, window, softcap: float, interleaved: bool,
                num_splits: int, return_softmax_lse: bool, key, host_lengths, checked: bool):
        """flash_attn_with_kvcache on GPU arrays (`arrays` in core.kvcache.INPUT_BUFFERS order); `key`:
        the decoding-step replay key to keep this call's Replay under (None: none), `host_lengths`:
        cache_seqlens on the host, checked against the cache when `checked` (device ones read back)."""
        with self.call(arrays[0]) as call:
            if checked and host_lengths is None:
                host_lengths = call.to_cupy("cache_seqlens", arrays[5]).get()
            return _kvcache_gpu(self.replay_ops, call, arrays, softmax_scale, causal, window, softcap, interleaved,
                                num_splits, return_softmax_lse, key, host_lengths)


# ---- shared pieces --------------------------------------------------------------------------------

def _validated_inputs(call, q, k, v, softmax_scale):
    infos = tuple(call.tensor(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    shape = validate_qkv(*infos, softmax_scale)
    check_grid(shape)
    return shape, infos


def _features(call, shape: AttentionShape, device: str, options: AttentionOptions, alibi_slopes,
              dropout: dropout_rng.DropoutSpec) -> Features:
    """Validated Features of a GPU call (window, softcap and dropout already checked)."""
    alibi = rng_state = None
    if alibi_slopes is not None:
        alibi = call.tensor("alibi_slopes", alibi_slopes)
        check_alibi(alibi, shape.batch, shape.nheads, device)
    if dropout.rng_state is not None:
        rng_state = call.tensor("dropout_rng_state", dropout.rng_state)
        check_rng_state(rng_state, device)
    window = options.window
    return Features(window[0], window[1], options.softcap, alibi, dropout_p=dropout.p, dropout_seed=dropout.seed,
                    dropout_offset=dropout.offset, dropout_rng_state=rng_state)


def _problem(call, shape: AttentionShape, device: str, options: AttentionOptions, alibi_slopes) -> AttentionProblem:
    features = _features(call, shape, device, options, alibi_slopes, options.dropout)
    return AttentionProblem(shape, bool(options.causal), features)


def _output(call, out, shape: AttentionShape, q):
    """(array, info) of the output: the caller's `out` (validated) or a new array."""
    if out is None:
        return call.empty((shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim), shape.dtype, like=q)
    info = call.output("out", out)
    validate_out(info, shape)
    return out, info


def _gradient_outputs(call, requests, check_like):
    """(arrays, infos) of dq, dk, dv: for each (name, given, like, like_info), the caller's buffer
    (checked with check_like and for alignment) or a new array shaped like the input."""
    arrays, infos = [], []
    for name, given, like, like_i in requests:
        if given is None:
            array, info = call.empty(like_i.shape, like_i.dtype, like=like)
        else:
            array, info = given, call.output(name, given)
            check_like(name, info, like_i)
            check_alignment(name, info)
        arrays.append(array)
        infos.append(info)
    return arrays, infos


def _host_dropout(call, dropout: dropout_rng.DropoutSpec) -> dropout_rng.DropoutSpec:
    """The spec with the seed and offset on the host (reads a device rng_state back: a synchronising
    copy, for the paths that rebuild the mask on the host side, probabilities and references)."""
    if dropout.rng_state is None:
        return dropout
    seed, offset = (int(x) for x in call.to_cupy("dropout_rng_state", dropout.rng_state).get())
    return dropout_rng.DropoutSpec(dropout.p, seed, offset)


def _cu_seqlens(call, cu_seqlens_q, cu_seqlens_k) -> list:
    """[(info, host values)] of the two cu_seqlens arrays (GPU arrays; a small copy for the checks)."""
    cu = []
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if framework_of(x, name) == "numpy":
            raise TypeError(f"{name}: expected a GPU array like q, got a NumPy array")
        cu.append((call.tensor(name, x), call.to_cupy(name, x).get()))
    return cu


def _varlen_inputs(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                   options: AttentionOptions):
    infos = [call.tensor(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
    cu = _cu_seqlens(call, cu_seqlens_q, cu_seqlens_k)
    packed = validate_varlen(*infos, options.softmax_scale, *cu[0], *cu[1], max_seqlen_q, max_seqlen_k,
                             check_pointers=True)
    base = _features(call, packed.shape, infos[0].device, options, alibi_slopes, options.dropout)
    features = dataclasses.replace(base, cu_seqlens_q=cu[0][0], cu_seqlens_k=cu[1][0], total_q=q.shape[0],
                                   total_k=k.shape[0])
    return packed, AttentionProblem(packed.shape, bool(options.causal), features)


def _varlen_outputs(call, out, q, packed):
    """(out, its info, lse, its info) of a varlen forward: the caller's out (checked) or a new one,
    and rows outside every sequence set to output 0 and LSE +inf."""
    shape = packed.shape
    if out is None:
        out, out_info = call.empty(packed.q.shape, shape.dtype, like=q)
    else:
        out_info = call.output("out", out)
        check_packed_like("out", out_info, packed.q)
        check_alignment("out", out_info)
    lse, lse_info = call.empty((shape.nheads, packed.q.shape[0]), "float32")
    if not packed.covers_all_rows:
        launcher.fill(out_info, 0, call.device_id)
        launcher.fill(lse_info, np.inf, call.device_id)
    return out, out_info, lse, lse_info


def _kvcache_gpu(replay_ops, call, arrays, softmax_scale, causal, window, softcap, interleaved, num_splits,
                 return_softmax_lse, step_key, host_lengths):
    cp = import_cupy()
    infos, keep = _describe_kvcache_inputs(call, cp, arrays)
    if softmax_scale is not None and type(softmax_scale) is not float:
        softmax_scale = softmax_scale_or_default(softmax_scale, 1)  # a hashable float (or a clear error)
    cache, recording = core_kvcache.recording_for(call.device_id, infos, softmax_scale, causal, window, softcap,
                                                  interleaved, num_splits, bool(return_softmax_lse))
    for name in ("q", "k_cache", "v_cache"):  # addresses change per call; shapes and strides were checked
        check_alignment(name, infos[name])
    if host_lengths is not None:
        check_cache_rows(host_lengths, cache.seqlen_new, cache.cache_rows, cache.page_size > 0)
    q = arrays[0]
    out, out_i = call.empty(infos["q"].shape, cache.shape.dtype, like=q)
    pointers = [0 if infos[name] is None else infos[name].data_ptr for name in core_kvcache.INPUT_BUFFERS]
    pointers.append(out_i.data_ptr)
    lse_shape = (cache.batch, cache.nheads, cache.seqlen_q)
    lse = None
    if return_softmax_lse:
        lse, lse_i = call.empty(lse_shape, "float32")
        pointers.append(lse_i.data_ptr)
    recording.run_direct(pointers, call.stream)
    if replay_ops is not None:
        core_kvcache.keep_step(step_key, replay_ops, arrays, infos, recording, q, lse_shape,
                               bool(return_softmax_lse), call.device_id)
    del keep  # stream-ordered: the copies are reused only by work queued after this point
    return (call.result(out), call.result(lse)) if return_softmax_lse else call.result(out)


def _describe_kvcache_inputs(call, cp, arrays) -> tuple[dict, list]:
    """({buffer name: TensorInfo or None}, arrays to keep alive). The caches are outputs (written in
    place, never copied); rotary tables are described as given but point at fp32 copies."""
    (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_cos,
     rotary_sin) = arrays
    infos = {"q": call.tensor("q", q), "k_cache": call.output("k_cache", k_cache),
             "v_cache": call.output("v_cache", v_cache),
             "k": call.tensor("k", k) if k is not None else None,
             "v": call.tensor("v", v) if v is not None else None}
    keep = []
    batch = infos["q"].shape[0] if len(infos["q"].shape) == 4 else 0
    for name, x in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("cache_leftpad", cache_leftpad)):
        if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            x = cp.full((batch,), int(x), dtype=np.int32)
            keep.append(x)
            infos[name] = describe(name, x)
        else:
            infos[name] = call.tensor(name, x) if x is not None else None
    infos["block_table"] = call.tensor("block_table", block_table) if block_table is not None else None
    infos["alibi_slopes"] = call.tensor("alibi_slopes", alibi_slopes) if alibi_slopes is not None else None
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        infos[name] = None
        if x is not None:
            given = call.to_cupy(name, x)
            fp32 = given if given.dtype == np.float32 and given.flags.c_contiguous else \
                cp.ascontiguousarray(as_float32(cp, given))
            keep.append(fp32)
            infos[name] = dataclasses.replace(describe(name, given), data_ptr=fp32.data.ptr)
    if infos["rotary_cos"] is not None and infos["cache_seqlens"] is None:
        # q's rotary position is the cache length: without lengths every sequence fills the cache
        rows = infos["k_cache"].shape[1] if len(infos["k_cache"].shape) == 4 else 0
        if block_table is not None and len(infos["block_table"].shape) == 2:
            rows *= infos["block_table"].shape[1]
        full = cp.full((batch,), rows, dtype=np.int32)
        keep.append(full)
        infos["cache_seqlens"] = describe("cache_seqlens", full)
    return infos, keep


__all__ = ["CupyOps", "GpuAdapter", "GpuCall", "call_key", "external_stream"]
