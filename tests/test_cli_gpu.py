"""The `cuflash2` CLI on a GPU: the quick correctness sweep and a small benchmark."""

import json

import pytest
from click.testing import CliRunner

from cuflash2.cli.main import main

pytestmark = pytest.mark.gpu


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2: keep stderr (progress, context) out of stdout
    except TypeError:
        return CliRunner()  # click >= 8.2 keeps them apart already


def test_info_on_gpu():
    result = _runner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "compute capability" in result.stdout and "none:" not in result.stdout


def test_check_quick_passes():
    result = _runner().invoke(main, ["check", "--quick"])
    assert result.exit_code == 0, result.stdout
    assert "GPU checks on" in result.stdout and " 0 failed" in result.stdout


def test_bench_json_against_torch_flash():
    pytest.importorskip("torch")
    args = ["bench", "--seqlen", "1024", "--head-dim", "64", "--compare", "torch-flash", "--format", "json",
            "--warmup", "2", "--repeats", "5"]
    result = _runner().invoke(main, args)
    assert result.exit_code == 0, result.stdout + str(result.exception)
    payload = json.loads(result.stdout)
    rows = payload["results"]
    assert {r["impl"] for r in rows} == {"cuflash2", "torch-flash"}
    assert len(rows) == 4  # causal both ways x 2 implementations
    for row in rows:
        assert row["tflops"] > 0, row
    env = payload["environment"]
    assert env["gpu"] and env["peak_tflops"] > 0 and env["cuflash2"]
