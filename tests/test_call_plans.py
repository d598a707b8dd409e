"""Call plans (cuflash2.call_plans) without a GPU: a recorded call, replayed with new addresses,
makes exactly the launches the full path makes with those addresses."""

import dataclasses
import math
import types
import warnings

import numpy as np
import pytest

from cuflash2 import api, backward, call_plans, launch
from cuflash2.features import PLAIN, Features
from cuflash2.validate import AttentionShape, TensorInfo, contiguous_info

_FAKE_KERNEL = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xABC))


def _info(shape, dtype="bfloat16", itemsize=2, address=0):
    return contiguous_info(shape, dtype, itemsize, "cuda:0", address)


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(launch, "device_arch", lambda device_id: 90)
    monkeypatch.setattr(launch, "_slots", lambda config, device_id: 264)


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

    def fake_scratch(cp, shape_, dtype=np.float32, zero=False):
        dtype = np.dtype(dtype)
        address = 0x7A00_0000_0000 + 0x100_0000 * len(scratch)
        scratch.append(address)
        return None, contiguous_info(shape_, dtype.name, dtype.itemsize, "", address)

    monkeypatch.setattr(launch, "_scratch", fake_scratch)
    monkeypatch.setattr(launch, "launch_kernel", lambda config, device_id, stream, grid, args:
                        sent.append((config, grid, args)))
    _run(kind, infos, shape, causal, features, deterministic)
    monkeypatch.undo()
    return sent, scratch


def _recorded_plan(kind, infos, shape, causal, features, deterministic=False):
    stand_ins = [dataclasses.replace(info, data_ptr=call_plans.stand_in(i)) for i, info in enumerate(infos)]
    recorder = call_plans.Recorder(len(stand_ins))
    launch.record(recorder, lambda: _run(kind, stand_ins, shape, causal, features, deterministic))
    launches = call_plans.plan_launches(recorder.launches, lambda config: _FAKE_KERNEL,
                                        len(stand_ins) + len(recorder.regions))
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
    assert launches and launch._recording.recorder is None
    addresses = [0x7F00_0000_0000 + 0x1000_0000 * i for i in range(len(infos))]
    real = [dataclasses.replace(info, data_ptr=a) for info, a in zip(infos, addresses)]
    sent, scratch = _full_path_launches(monkeypatch, kind, real, shape, causal, features, deterministic)
    assert len(scratch) == len(recorder.regions)
    pointers = addresses + scratch
    assert len(launches) == len(sent)
    for step, (config, grid, args) in zip(launches, sent):
        assert (step.threads, step.smem_bytes) == (config.threads, config.smem_bytes)
        assert step.grid == tuple(grid) + (1,) * (3 - len(grid))
        assert call_plans.fill_arguments(step, pointers) == [a.item() for a in args]
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
        launch.record(call_plans.Recorder(0), failing)
    assert launch._recording.recorder is None


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
    assert call_plans.scratch_layout([4, 0, 1000, 256]) == ([0, 256, 256, 1280], 1536)
    assert call_plans.scratch_layout([]) == ([], 0)


def test_calls_with_alibi_dropout_or_numpy_arrays_have_no_key():
    q = np.zeros((1, 8, 2, 64), np.float16)
    assert api.forward_plan_key(q, q, q, None, False, (-1, -1), 0.0, None, 0.0) is None  # NumPy: CPU path
    assert api.forward_plan_key(q, q, q, None, False, (-1, -1), 0.0, object(), 0.0) is None
    assert api.forward_plan_key(q, q, q, None, False, (-1, -1), 0.0, None, 0.1) is None
    lse = np.zeros((1, 2, 8), np.float32)
    assert backward.backward_plan_key(q, q, q, q, q, lse, None, False, (-1, -1), 0.0, None, False, 0.0) is None


def test_keys_hold_the_layout_and_options_of_the_call():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    key = api.forward_plan_key(q, q, q, None, True, (-1, -1), 0.0, None, 0.0)
    assert key is not None and key == api.forward_plan_key(q, q, q, None, True, (-1, -1), 0.0, None, 0)
    assert key != api.forward_plan_key(q, q, q, None, False, (-1, -1), 0.0, None, 0.0)
    assert key != api.forward_plan_key(q, q, q, 0.5, True, (-1, -1), 0.0, None, 0.0)
    assert key != api.forward_plan_key(q.transpose(1, 2).contiguous().transpose(1, 2), q, q, None, True, (-1, -1),
                                       0.0, None, 0.0)  # other strides
    assert api.forward_plan_key(q, q, q, None, True, [-1, -1], 0.0, None, 0.0) is None  # a list: not a key
    lse = torch.zeros(1, 2, 8)
    bwd = backward.backward_plan_key(q, q, q, q, q, lse, None, True, (-1, -1), 0.0, None, False, 0.0)
    assert bwd is not None and bwd != key
    assert bwd != backward.backward_plan_key(q, q, q, q, q, lse, None, True, (-1, -1), 0.0, None, True, 0.0)
    assert bwd != backward.backward_plan_key(q, q, q, q, q, lse, None, True, (8, 0), 0.0, None, False, 0.0)
    assert bwd != backward.backward_plan_key(q, q, q, q, q, lse, None, True, (-1, -1), 5.0, None, False, 0.0)
    assert bwd != backward.backward_plan_key(q.to(torch.bfloat16), q, q, q, q, lse, None, True, (-1, -1), 0.0, None,
                                             False, 0.0)  # dout's dtype
    for module, flag in ((call_plans, "FAST_CALLS"), (launch, "PACKED_LAUNCH")):  # either turns plans off
        setattr(module, flag, False)
        try:
            assert api.forward_plan_key(q, q, q, None, True, (-1, -1), 0.0, None, 0.0) is None
            assert backward.backward_plan_key(q, q, q, q, q, lse, None, True, (-1, -1), 0.0, None, False, 0.0) is None
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
    """A framework for CallPlan without a GPU: arrays are their own addresses, allocations hand out
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

    def empty(self, shape, dtype, device_id):
        return self._allocate(("empty", shape, dtype))

    def scratch(self, nbytes, device_id):
        return self._allocate(("scratch", nbytes))

    def stream(self, device_id):
        return 77


@pytest.fixture
def fake_gpu(h200, monkeypatch):
    """CallPlan runs on _FakeOps; its launches and memsets are logged instead of sent."""
    ops, sent, memsets = _FakeOps(), [], []
    monkeypatch.setattr(call_plans.kvcache_step, "framework_ops", lambda kind: ops)
    monkeypatch.setattr(call_plans, "get_kernel", lambda config, device_id: _FAKE_KERNEL)
    monkeypatch.setattr(call_plans, "_memset_async", lambda address, nbytes, stream: memsets.append((address, nbytes,
                                                                                                       stream)))
    monkeypatch.setattr(call_plans.packed_launch, "launch_packed",
                        lambda function, grid, threads, smem, stream, packer, args: sent.append((grid, stream, args)))
    return ops, sent, memsets


@pytest.mark.parametrize("dims, causal", [((2, 512, 512, 16, 16, 128), True), ((1, 200, 333, 8, 2, 64), False),
                                          ((2, 256, 256, 4, 4, 256), True)])
def test_a_replayed_backward_zeroes_its_accumulators_and_launches_what_the_full_path_does(fake_gpu, monkeypatch,
                                                                                          dims, causal):
    """The default (non-deterministic) sm_90 backward accumulates dQ (and, with GQA, dK/dV) in fp32
    scratch that must start at zero: the replay memsets exactly those regions, on the call's
    stream, before launching the full path's launches with the same addresses."""
    ops, sent, memsets = fake_gpu
    shape = AttentionShape(*dims, "bfloat16", dims[-1] ** -0.5)
    infos = _buffers("bwd", shape)
    plan = call_plans._record("fake", lambda *i: _run("bwd", i, shape, causal, PLAIN), tuple(infos),
                              ("bf16",) * 3, 0)
    inputs = [0x7F00_0000_0000 + 0x1000_0000 * i for i in range(6)]
    grads = plan(tuple(inputs))
    (_, scratch_base), = [a for a in ops.allocations if a[0][0] == "scratch"]
    assert [what for what, _ in ops.allocations[:3]] == [("empty", tuple(info.shape), "bf16") for info in infos[6:]]
    regions = [scratch_base + offset for offset in plan.offsets]
    full_infos = [dataclasses.replace(info, data_ptr=a) for info, a in zip(infos, inputs + grads)]
    taken, zeroed = iter(regions), []

    def full_path_scratch(cp, shape_, dtype=np.float32, zero=False):
        info = contiguous_info(shape_, np.dtype(dtype).name, np.dtype(dtype).itemsize, "", next(taken))
        if zero:
            zeroed.append((info.data_ptr, math.prod(shape_) * info.itemsize, 77))
        return None, info

    monkeypatch.setattr(launch, "_scratch", full_path_scratch)
    full = []
    monkeypatch.setattr(launch, "launch_kernel", lambda config, device_id, stream, grid, args:
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
    call_plans.register_forward(key, arrays, tuple(infos[:3]), tuple(infos[3:]), shape, False, features, 0)
    return call_plans.lookup(key)


def test_registration_keeps_plans_only_for_calls_it_can_replay(fake_gpu, monkeypatch):
    assert isinstance(_forward_registration(), call_plans.CallPlan)
    call_plans.clear()
    assert _forward_registration(out_strides=(128 * 8 * 64, 8 * 64, 64, 1)) is None  # a wider out
    assert _forward_registration(copied=True) is None  # an input the full path copied
    assert _forward_registration(seqlen_k=0) is None  # filled, no kernels
    slopes = TensorInfo((4,), (1,), "float32", "cuda:0", 0x7E00_0000_0000, 4)
    assert _forward_registration(features=Features(alibi=slopes)) is None
    assert not call_plans._plans


def test_a_failed_recording_warns_once_and_leaves_the_full_path(fake_gpu, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(call_plans, "get_kernel", broken)
    with pytest.warns(RuntimeWarning, match="could not record a call plan.*no such kernel"):
        assert _forward_registration() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _forward_registration() is None  # marked: not recorded (nor warned) again
    assert launch._recording.recorder is None


def test_the_oldest_plan_makes_room_for_a_new_one(fake_gpu, monkeypatch):
    """Past _MAX_PLANS signatures the first one kept goes (not all of them: a training loop with a
    new length now and then keeps its other plans)."""
    monkeypatch.setattr(call_plans, "_MAX_PLANS", 3)
    for i in range(4):
        assert _forward_registration(key=("fwd", "fake", i)) is not None
    assert list(call_plans._plans) == [("fwd", "fake", i) for i in (1, 2, 3)]
