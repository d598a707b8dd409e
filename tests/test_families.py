"""Kernel families without a GPU: which family runs a call (families.family_for), the
CUFLASH2_FAMILY override, the core's forward going through the chosen family's entry point, and
what `cuflash2 info` says about it."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from cuflash2 import families
from cuflash2.cli.main import main
from cuflash2.core import ops
from cuflash2.families import mma_sync, wgmma
from cuflash2.problem.features import AttentionProblem, Features
from cuflash2.problem.tensors import AttentionShape, contiguous_info

SHAPE = AttentionShape(2, 512, 512, 8, 8, 128, "bfloat16", 128 ** -0.5)
PROBLEM = AttentionProblem(SHAPE, True)


class ForwardOnlyFamily:
    """A family like the Hopper one: the plain forward on sm_90 only."""

    name = "forward_only"

    def __init__(self):
        self.calls = []

    def unsupported_reason(self, arch, problem, direction, tensors=(), deterministic=False):
        return "" if arch == 90 and direction == "forward" and problem.plain else "not a plain sm_90 forward"

    def supports(self, arch, problem, direction, tensors=(), deterministic=False):
        return not self.unsupported_reason(arch, problem, direction, tensors, deterministic)

    def describe(self, problem, direction, sm_count):
        return f"one tile per SM ({sm_count})"

    def forward(self, problem, q, k, v, out, lse, device_id, stream):
        self.calls.append((problem, q, out, device_id, stream))


@pytest.fixture
def two_families(monkeypatch):
    family = ForwardOnlyFamily()
    monkeypatch.setattr(families, "FAMILIES", (family, mma_sync.FAMILY))
    monkeypatch.delenv(families.FAMILY_VARIABLE, raising=False)
    return family


def test_mma_sync_runs_every_direction_by_default_but_the_sm90_forward_and_backward(monkeypatch):
    monkeypatch.delenv(families.FAMILY_VARIABLE, raising=False)
    for arch in (80, 86, 89, 90, 100, 120):
        for direction in families.DIRECTIONS:
            hopper = arch == 90 and direction in ("forward", "backward")
            expected = wgmma.FAMILY if hopper else mma_sync.FAMILY
            assert families.family_for(arch, PROBLEM, direction) is expected


def test_the_hopper_backward_runs_head_dims_32_to_128_and_192_to_256(monkeypatch):
    """Backwards at head dims 32-128 and 192-256 (multiples of 8) on sm_90, deterministic ones too
    (their dQ sums in a fixed order); head dims between on mma_sync."""
    monkeypatch.delenv(families.FAMILY_VARIABLE, raising=False)
    assert families.family_for(90, PROBLEM, "backward") is wgmma.FAMILY
    assert families.family_for(80, PROBLEM, "backward") is mma_sync.FAMILY
    assert families.family_for(90, PROBLEM, "backward", deterministic=True) is wgmma.FAMILY
    d64 = AttentionProblem(AttentionShape(2, 512, 512, 8, 8, 64, "bfloat16", 0.125), True)
    assert families.family_for(90, d64, "backward") is wgmma.FAMILY
    d256 = AttentionProblem(AttentionShape(2, 512, 512, 8, 8, 256, "bfloat16", 0.0625), True)
    assert families.family_for(90, d256, "backward") is wgmma.FAMILY
    d192 = AttentionProblem(AttentionShape(2, 512, 512, 8, 8, 192, "bfloat16", 0.07), True)
    assert families.family_for(90, d192, "backward") is wgmma.FAMILY
    d160 = AttentionProblem(AttentionShape(2, 512, 512, 8, 8, 160, "bfloat16", 0.08), True)
    assert families.family_for(90, d160, "backward") is mma_sync.FAMILY


def test_the_first_family_that_supports_a_call_runs_it(two_families):
    assert families.family_for(90, PROBLEM, "forward") is two_families
    assert families.family_for(90, PROBLEM, "backward") is mma_sync.FAMILY
    assert families.family_for(80, PROBLEM, "forward") is mma_sync.FAMILY
    windowed = AttentionProblem(SHAPE, True, Features(window_left=64))
    assert families.family_for(90, windowed, "forward") is mma_sync.FAMILY


def test_the_variable_forces_a_family_where_it_supports_the_call(two_families, monkeypatch):
    monkeypatch.setenv(families.FAMILY_VARIABLE, "mma_sync")
    assert families.family_for(90, PROBLEM, "forward") is mma_sync.FAMILY
    monkeypatch.setenv(families.FAMILY_VARIABLE, "forward_only")
    assert families.family_for(90, PROBLEM, "forward") is two_families
    assert families.family_for(90, PROBLEM, "backward") is mma_sync.FAMILY  # it has no backward
    monkeypatch.setenv(families.FAMILY_VARIABLE, "auto")
    assert families.family_for(90, PROBLEM, "forward") is two_families


@pytest.mark.parametrize("value", ["tma", "MMA_SYNC", "mma-sync"])
def test_an_unknown_family_name_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv(families.FAMILY_VARIABLE, value)
    with pytest.raises(ValueError, match=rf"^CUFLASH2_FAMILY: expected one of auto, wgmma, mma_sync, got '{value}'$"):
        families.family_for(90, PROBLEM, "forward")


def test_an_unknown_direction_is_refused():
    with pytest.raises(ValueError, match="direction: expected one of forward, backward, kvcache, got 'sideways'"):
        families.family_for(90, PROBLEM, "sideways")


def test_the_core_forward_calls_the_chosen_family(two_families, monkeypatch):
    monkeypatch.setattr(ops, "device_arch", lambda device_id: 90)
    q = contiguous_info((2, 512, 8, 128), "bfloat16", 2, "cuda:0", 1 << 40)
    lse = contiguous_info((2, 8, 512), "float32", 4, "cuda:0", 1 << 41)
    ops.forward(PROBLEM, q, q, q, q, lse, 0, "stream")
    assert two_families.calls == [(PROBLEM, q, q, 0, "stream")]


def test_every_family_has_what_the_core_and_the_cli_call():
    for family in families.FAMILIES:
        assert isinstance(family.name, str) and family.name != "auto"
        assert callable(family.supports) and callable(family.all_configs) and callable(family.compile_configs)
        for direction, entry in (("forward", "forward"), ("backward", "backward"), ("kvcache", "kvcache")):
            reason = family.unsupported_reason(90, PROBLEM, direction)
            assert family.supports(90, PROBLEM, direction) == (reason == "") and isinstance(reason, str)
            assert isinstance(family.describe(PROBLEM, direction, 132), str)
            if family.supports(90, PROBLEM, direction):
                assert callable(getattr(family, entry)), (family.name, entry)
    assert len(set(families.family_names())) == len(families.FAMILIES)


def test_info_names_the_family_of_each_direction(monkeypatch):
    monkeypatch.delenv(families.FAMILY_VARIABLE, raising=False)
    result = CliRunner().invoke(main, ["info", "--arch", "sm_80"])
    assert result.exit_code == 0, result.output
    section = result.output.split("Kernel families")[1]
    assert "on sm_80 (--arch)" in section and "CUFLASH2_FAMILY      auto" in section
    for direction in families.DIRECTIONS:
        assert f"{direction:20s} mma_sync" in section
    facts = json.loads(CliRunner().invoke(main, ["info", "--json", "--arch", "sm_90a"]).output)["families"]
    assert facts["arch"] == 90 and facts["forward"] == facts["backward"] == "wgmma" and facts["kvcache"] == "mma_sync"


def test_info_reports_a_bad_family_variable_without_failing(monkeypatch):
    monkeypatch.setenv(families.FAMILY_VARIABLE, "bogus")
    result = CliRunner().invoke(main, ["info", "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)["families"]
    assert facts["variable"] == "bogus" and "expected one of auto, wgmma, mma_sync" in facts["forward"]


def test_info_refuses_a_bad_arch():
    result = CliRunner().invoke(main, ["info", "--arch", "sm_75"])
    assert result.exit_code == 2 and "expected an arch like sm_80" in result.output


def test_numpy_calls_need_no_family():
    q = np.zeros((1, 4, 2, 32), np.float16)
    assert np.all(__import__("cuflash2").flash_attn_func(q, q, q) == 0)


def test_passed_over_says_why_each_family_before_the_chosen_one_does_not_run_a_call(two_families, monkeypatch):
    windowed = AttentionProblem(SHAPE, True, Features(window_left=64))
    assert families.passed_over(90, PROBLEM, "forward") == []
    assert families.passed_over(90, windowed, "forward") == [("forward_only", "not a plain sm_90 forward")]
    monkeypatch.setenv(families.FAMILY_VARIABLE, "mma_sync")
    assert families.passed_over(90, PROBLEM, "forward") == []


def test_the_real_families_give_reasons(monkeypatch):
    monkeypatch.delenv(families.FAMILY_VARIABLE, raising=False)
    d160 = AttentionProblem(AttentionShape(2, 512, 512, 8, 8, 160, "bfloat16", 0.08), False)
    assert families.passed_over(90, d160, "backward") == [
        ("wgmma", "runs head dims that are multiples of 8 in 32-128 and 192-256, got 160")]
    assert families.passed_over(80, PROBLEM, "forward") == [
        ("wgmma", "needs compute capability 9.0 (sm_90a), got 8.0")]
    assert "KV-cache" in families.passed_over(90, PROBLEM, "kvcache")[0][1]
    assert "8.0 or newer, got 7.5" in mma_sync.FAMILY.unsupported_reason(75, PROBLEM, "forward")


def test_info_describes_the_problem_its_options_give():
    """The problem options of `cuflash2 info`: the family of each direction, the reasons of the
    families passed over, and the Hopper forward's tile and walk."""
    result = CliRunner().invoke(main, ["info", "--arch", "sm_90", "--head-dim", "96", "--seqlen", "4096",
                                       "--no-causal", "--window", "256,0", "--dtype", "fp16"])
    assert result.exit_code == 0, result.output
    section = result.output.split("Kernel families")[1]
    assert "batch 2, seqlen 4096, 8 heads, head dim 96, not causal, window (256, 0), fp16 on sm_90" in section
    assert "forward              mma_sync (wgmma: runs plain and causal attention only" in section
    assert "forward plan" not in section
    facts = json.loads(CliRunner().invoke(main, ["info", "--json", "--arch", "sm_90", "--head-dim", "128",
                                                 "--seqlen", "2048", "--batch", "8", "--heads", "16",
                                                 "--heads-kv", "4", "--no-causal"]).output)["families"]
    assert facts["problem"] == "batch 8, seqlen 2048, 16 / 4 heads, head dim 128, not causal, bf16"
    assert facts["forward"] == facts["backward"] == "wgmma" and facts["passed_over"]["forward"] == []
    assert facts["passed_over"]["kvcache"][0]["family"] == "wgmma"
    assert "160-key blocks" in facts["forward_plan"] and "CTA pairs" in facts["forward_plan"]
    assert facts["forward_plan"].endswith("2048 tiles on 132 CTAs, whole tiles")


@pytest.mark.parametrize("args, message", [
    (["--heads", "8", "--heads-kv", "3"], "--heads-kv: expected a divisor of --heads (8), got 3"),
    (["--window", "12"], "--window: expected LEFT,RIGHT"),
    (["--window", "-2,0"], "--window: expected entries >= -1"),
    (["--head-dim", "300"], "--head-dim"),
    (["--dropout", "1.0"], "--dropout"),
])
def test_info_refuses_a_problem_it_cannot_describe(args, message):
    result = CliRunner().invoke(main, ["info", *args])
    assert result.exit_code == 2 and message in result.output, result.output
