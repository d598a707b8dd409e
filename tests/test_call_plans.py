"""Call plans (cuflash2.call_plans) without a GPU: a recorded call, replayed with new addresses,
makes exactly the launches the full path makes with those addresses."""

import dataclasses
import types

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
    monkeypatch.setattr(launch, "_launch", lambda config, device_id, stream, grid, args:
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
    call_plans.FAST_CALLS = False
    try:
        assert api.forward_plan_key(q, q, q, None, True, (-1, -1), 0.0, None, 0.0) is None
    finally:
        call_plans.FAST_CALLS = True
