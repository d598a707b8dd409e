"""Replays (cuflash2.core.replay) without a GPU: a recorded call, replayed with new addresses,
makes exactly the launches the full path makes with those addresses."""

import dataclasses
import math
import types
import warnings

import numpy as np
import pytest

from cuflash2.core import ops, replay
from cuflash2.families.mma_sync import launches as launch
from cuflash2.runtime import launcher
from cuflash2.problem.features import PLAIN, AttentionProblem, Features
from cuflash2.problem.options import AttentionOptions
from cuflash2.problem.tensors import AttentionShape, TensorInfo, contiguous_info
from cuflash2.runtime import launcher

_FAKE_KERNEL = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xABC))


def _info(shape, dtype="bfloat16", itemsize=2, address=0):
    return contiguous_info(shape, dtype, itemsize, "cuda:0", address)


@pytest.fixture
def h200(monkeypatch):
    """An sm_90 GPU running the mma.sync family (whose launches these tests record)."""
    monkeypatch.setenv("CUFLASH2_FAMILY", "mma_sync")
    monkeypatch.setattr(launch, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(ops, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(launcher, "resident_slots", lambda config, device_id: 264)


def _buffers(kind, shape: AttentionShape):
    """The TensorInfos of a forward (q, k, v, out, lse) or backward (dout, q, k, v, out, lse, dq, dk,
    dv) call, without addresses."""
    b, sq, sk, h, hk, d = shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.nheads_kv, shape.head_dim
    q, kv, lse = _info((b, sq, h, d)), _info((b, sk, hk, d)), _info((b, h, sq), "float32", 4)
    if kind == "fwd":
        return [q, kv, kv, q, lse]
    return [q, q, kv, kv, q, lse, q, kv, kv]


def _run(kind, infos, shape, causal, features, deterministic=False):
    if kind == "fwd":
        launch.forward(*infos, shape, causal, 0, None, features=features)
    else:
        launch.backward(*infos, shape, causal, deterministic, 0, None, features=features)


def _full_path_launches(monkeypatch, kind, infos, shape, causal, features, deterministic=False):
    """(launches as (config, grid, args), scratch addresses in request order) of the full path."""
    sent, scratch = [], []

    def fake_scratch(shape_, dtype=np.float32, zero=False):
        dtype = np.dtype(dtype)
        address = 0x7A00_0000_0000 + 0x100_0000 * len(scratch)
        scratch.append(address)
        return None, contiguous_info(shape_, dtype.name, dtype.itemsize, "", address)

    with monkeypatch.context() as patch:
        patch.setattr(launcher, "scratch", fake_scratch)
        patch.setattr(launcher, "launch_kernel", lambda config, device_id, stream, grid, args:
                      sent.append((config, grid, args)))
        _run(kind, infos, shape, causal, features, deterministic)
    return sent, scratch


def _recorded_plan(kind, infos, shape, causal, features, deterministic=False):
    stand_ins = [dataclasses.replace(info, data_ptr=replay.stand_in(i)) for i, info in enumerate(infos)]
    recorder = replay.Recorder(len(stand_ins))
    launcher.recording(recorder, lambda: _run(kind, stand_ins, shape, causal, features, deterministic))
    sources = {replay.stand_in(i): i for i in range(len(stand_ins) + len(recorder.regions))}
    launches = replay.recorded_launches(recorder.launches, lambda config: _FAKE_KERNEL, sources)
    return launches, recorder


CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim), causal, features
    ((2, 300, 300, 8, 8, 64), False, PLAIN),
    ((2, 512, 512, 16, 16, 128), True, PLAIN),
    ((1, 200, 333, 8, 2, 128), True, PLAIN),  # GQA, seqlen_q != seqlen_k
    ((2, 256, 256, 4, 4, 256), False, PLAIN),
    ((2, 256, 256, 4, 4, 96), True, PLAIN),
    ((2, 384, 384, 8, 8, 128), False, Features(window_left=64, window_right=16)),
    ((2, 384, 384, 8, 8, 64), True, Features(softcap=30.0)),
]


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("dims, causal, features", CASES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_replayed_launches_equal_the_full_path(h200, monkeypatch, kind, dims, causal, features, deterministic):
    if kind == "fwd" and deterministic:
        pytest.skip("the forward has no deterministic flag")
    shape = AttentionShape(*dims, "bfloat16", dims[-1] ** -0.5)
    infos = _buffers(kind, shape)
    launches, recorder = _recorded_plan(kind, infos, shape, causal, features, deterministic)
    assert launches and not launcher.is_recording()
    addresses = [0x7F00_0000_0000 + 0x1000_0000 * i for i in range(len(infos))]
    real = [dataclasses.replace(info, data_ptr=a) for info, a in zip(infos, addresses)]
    sent, scratch = _full_path_launches(monkeypatch, kind, real, shape, causal, features, deterministic)
    assert len(scratch) == len(recorder.regions)
    pointers = addresses + scratch
    assert len(launches) == len(sent)
    for step, (config, grid, args) in zip(launches, sent):
        assert (step.threads, step.smem_bytes) == (config.threads, config.smem_bytes)
        assert step.grid == tuple(grid) + (1,) * (3 - len(grid))
        assert replay.fill_arguments(step, pointers) == [a.item() for a in args]
        assert step.packer.size == 8 * len(args)


def test_backward_scratch_regions_say_which_start_at_zero(h200):
    """The fused backward accumulates dQ in fp32 scratch that starts at zero; D does not need it."""
    shape = AttentionShape(2, 512, 512, 16, 16, 128, "bfloat16", 128 ** -0.5)
    _, recorder = _recorded_plan("bwd", _buffers("bwd", shape), shape, True, PLAIN)
    (delta_bytes, delta_zero), *rest = recorder.regions
    assert delta_bytes == 2 * 16 * 512 * 4 and not delta_zero
    assert all(zero for _, zero in rest)


def test_record_leaves_the_recorder_off_after_an_error(h200):
    def failing():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        launcher.recording(replay.Recorder(0), failing)
    assert not launcher.is_recording()


def test_a_feature_tensor_address_makes_the_call_unplannable(h200):
    """ALiBi slopes are an address the stand-ins do not cover: such calls keep the full path."""
    shape = AttentionShape(2, 256, 256, 8, 8, 64, "bfloat16", 0.125)
    slopes = TensorInfo((8,), (1,), "float32", "cuda:0", 0x7E00_0000_0000, 4)
    launches, _ = _recorded_plan("fwd", _buffers("fwd", shape), shape, False, Features(alibi=slopes))
    assert launches is None
    assert not Features(alibi=slopes).replayable
    assert not Features(dropout_p=0.1, dropout_seed=3).replayable
    assert Features(window_left=8, softcap=5.0).replayable


def test_scratch_regions_start_at_multiples_of_256_bytes():
    assert replay.scratch_layout([4, 0, 1000, 256]) == ([0, 256, 256, 1280], 1536)
    assert replay.scratch_layout([]) == ([], 0)


def _options(causal=False, window=(-1, -1), softcap=0.0, scale=None, deterministic=False, dropout_p=0.0):
    from cuflash2.dropout import DropoutSpec

    return AttentionOptions(scale, causal, window, softcap, deterministic, DropoutSpec(dropout_p, 3))


def test_calls_with_alibi_dropout_or_numpy_arrays_have_no_key():
    pytest.importorskip("torch")
    from cuflash2.frameworks.torch_adapter import ADAPTER

    q = np.zeros((1, 8, 2, 64), np.float16)
    assert ADAPTER.forward_key(q, q, q, _options(), None) is None  # NumPy: not a torch call
    torch = pytest.importorskip("torch")
    t = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    assert ADAPTER.forward_key(t, t, t, _options(), object()) is None
    assert ADAPTER.forward_key(t, t, t, _options(dropout_p=0.1), None) is None
    lse = torch.zeros(1, 2, 8)
    assert ADAPTER.backward_key(t, t, t, t, t, lse, _options(dropout_p=0.1), None) is None


def test_keys_hold_the_layout_and_options_of_the_call():
    torch = pytest.importorskip("torch")
    from cuflash2.frameworks.torch_adapter import ADAPTER

    q = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    key = ADAPTER.forward_key(q, q, q, _options(True), None)
    assert key is not None and key == ADAPTER.forward_key(q, q, q, _options(True), None)
    assert key != ADAPTER.forward_key(q, q, q, _options(False), None)
    assert key != ADAPTER.forward_key(q, q, q, _options(True, scale=0.5), None)
    assert key != ADAPTER.forward_key(q.transpose(1, 2).contiguous().transpose(1, 2), q, q, _options(True),
                                      None)  # other strides
    assert ADAPTER.forward_key(q, q, q, _options(True, window=[-1, -1]), None) is None  # a list: not a key
    lse = torch.zeros(1, 2, 8)
    bwd = ADAPTER.backward_key(q, q, q, q, q, lse, _options(True), None)
    assert bwd is not None and bwd != key
    assert bwd != ADAPTER.backward_key(q, q, q, q, q, lse, _options(True, deterministic=True), None)
    assert bwd != ADAPTER.backward_key(q, q, q, q, q, lse, _options(True, window=(8, 0)), None)
    assert bwd != ADAPTER.backward_key(q, q, q, q, q, lse, _options(True, softcap=5.0), None)
    assert bwd != ADAPTER.backward_key(q.to(torch.bfloat16), q, q, q, q, lse, _options(True), None)  # dout's dtype
    for module, flag in ((replay, "FAST_CALLS"), (launcher, "PACKED_LAUNCH")):  # either turns replays off
        setattr(module, flag, False)
        try:
            assert ADAPTER.forward_key(q, q, q, _options(True), None) is None
            assert ADAPTER.backward_key(q, q, q, q, q, lse, _options(True), None) is None
        finally:
            setattr(module, flag, True)


class _Array(int):
    """A fake device array: its address, with strides and a dtype."""

    dtype = "bf16"

    def __new__(cls, address, strides=()):
        array = super().__new__(cls, address)
        array.strides = strides
        return array


class _FakeOps:
    """A framework for Replay without a GPU: arrays are their own addresses, allocations hand out
    fresh ones, and every operation is logged."""

    float32 = "fp32"

    def __init__(self):
        self.next_address = 0x6000_0000_0000
        self.allocations = []

    def current_device(self):
        return 0

    @staticmethod
    def pointer(x):
        return int(x)

    @staticmethod
    def strides_in_elements(x):
        return x.strides

    def _allocate(self, what):
        address, self.next_address = self.next_address, self.next_address + 0x1000_0000
        self.allocations.append((what, address))
        return address

    def allocator(self, shape, dtype, device_id):
        return lambda: self._allocate(("empty", shape, dtype))

    def scratch_allocator(self, nbytes, device_id):
        return lambda: self._allocate(("scratch", nbytes))

    def stream_getter(self, device_id):
        return lambda: 77


@pytest.fixture
def fake_gpu(h200, monkeypatch):
    """Replays run on _FakeOps; their launches and memsets are logged instead of sent."""
    fake_ops, sent, memsets = _FakeOps(), [], []
    monkeypatch.setattr(replay, "get_kernel", lambda config, device_id: _FAKE_KERNEL)
    monkeypatch.setattr(launcher, "memset_async", lambda address, nbytes, stream: memsets.append((address, nbytes,
                                                                                                    stream)))
    monkeypatch.setattr(launcher, "launch_packed",
                        lambda function, grid, threads, smem, stream, packer, args: sent.append((grid, stream, args)))
    return fake_ops, sent, memsets


@pytest.mark.parametrize("dims, causal", [((2, 512, 512, 16, 16, 128), True), ((1, 200, 333, 8, 2, 64), False),
                                          ((2, 256, 256, 4, 4, 256), True)])
def test_a_replayed_backward_zeroes_its_accumulators_and_launches_what_the_full_path_does(fake_gpu, monkeypatch,
                                                                                          dims, causal):
    """The default (non-deterministic) sm_90 backward accumulates dQ (and, with GQA, dK/dV) in fp32
    scratch that must start at zero: the replay memsets exactly those regions, on the call's
    stream, before launching the full path's launches with the same addresses."""
    fake_ops, sent, memsets = fake_gpu
    shape = AttentionShape(*dims, "bfloat16", dims[-1] ** -0.5)
    infos = _buffers("bwd", shape)
    recording = replay.record(lambda *i: _run("bwd", i, shape, causal, PLAIN), infos, 0)
    plan = replay.Replay(recording, fake_ops, 0, [(tuple(info.shape), "bf16") for info in infos[6:]], aligned_inputs=6)
    inputs = [0x7F00_0000_0000 + 0x1000_0000 * i for i in range(6)]
    grads = list(plan(tuple(inputs)))
    (_, scratch_base), = [a for a in fake_ops.allocations if a[0][0] == "scratch"]
    assert [what for what, _ in fake_ops.allocations[:3]] == [("empty", tuple(info.shape), "bf16")
                                                              for info in infos[6:]]
    regions = [scratch_base + offset for offset in recording.offsets]
    full_infos = [dataclasses.replace(info, data_ptr=a) for info, a in zip(infos, inputs + grads)]
    taken, zeroed = iter(regions), []

    def full_path_scratch(shape_, dtype=np.float32, zero=False):
        info = contiguous_info(shape_, np.dtype(dtype).name, np.dtype(dtype).itemsize, "", next(taken))
        if zero:
            zeroed.append((info.data_ptr, math.prod(shape_) * info.itemsize, 77))
        return None, info

    monkeypatch.setattr(launcher, "scratch", full_path_scratch)
    full = []
    monkeypatch.setattr(launcher, "launch_kernel", lambda config, device_id, stream, grid, args:
                        full.append((tuple(grid) + (1,) * (3 - len(grid)), 77, [a.item() for a in args])))
    _run("bwd", full_infos, shape, causal, PLAIN)
    assert sent == full and plan.calls == 1
    assert memsets == zeroed  # the regions the full path allocates with cp.zeros
    if dims[3] == dims[4]:  # MHA on sm_90: the fused kernel accumulates dQ in zeroed fp32 scratch
        assert memsets


def _forward_registration(out_strides=None, copied=False, features=PLAIN, seqlen_k=128,
                          key=("fwd", "fake", "signature")):
    shape = AttentionShape(1, 128, seqlen_k, 4, 4, 64, "bfloat16", 0.125)
    infos = [dataclasses.replace(info, data_ptr=0x7F00_0000_0000 + 0x1000_0000 * i)
             for i, info in enumerate(_buffers("fwd", shape))]
    if out_strides:
        infos[3] = dataclasses.replace(infos[3], strides=out_strides)
    arrays = [_Array(info.data_ptr + (32 if copied and i == 1 else 0), info.strides)
              for i, info in enumerate(infos[:3])]
    ops.keep_forward_replay(key, _OPS, arrays, tuple(infos[:3]), tuple(infos[3:]), AttentionProblem(shape, False,
                                                                                                    features), 0)
    return replay.CALLS.lookup(key)


_OPS = _FakeOps()


def test_registration_keeps_plans_only_for_calls_it_can_replay(fake_gpu, monkeypatch):
    assert isinstance(_forward_registration(), replay.Replay)
    replay.clear()
    assert _forward_registration(out_strides=(128 * 8 * 64, 8 * 64, 64, 1)) is None  # a wider out
    assert _forward_registration(copied=True) is None  # an input the full path copied
    assert _forward_registration(seqlen_k=0) is None  # filled, no kernels
    slopes = TensorInfo((4,), (1,), "float32", "cuda:0", 0x7E00_0000_0000, 4)
    assert _forward_registration(features=Features(alibi=slopes)) is None
    assert not replay.CALLS.entries


def test_a_failed_recording_warns_once_and_leaves_the_full_path(fake_gpu, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(replay, "get_kernel", broken)
    with pytest.warns(RuntimeWarning, match="could not record a call plan.*no such kernel"):
        assert _forward_registration() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _forward_registration() is None  # marked: not recorded (nor warned) again
    assert not launcher.is_recording()


def test_the_oldest_plan_makes_room_for_a_new_one(fake_gpu, monkeypatch):
    """Past _MAX_REPLAYS signatures the first one kept goes (not all of them: a training loop with a
    new length now and then keeps its other replays)."""
    monkeypatch.setattr(replay, "_MAX_REPLAYS", 3)
    for i in range(4):
        assert _forward_registration(key=("fwd", "fake", i)) is not None
    assert list(replay.CALLS.entries) == [("fwd", "fake", i) for i in (1, 2, 3)]
