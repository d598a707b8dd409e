"""Every python block of the README runs as written, each on its own (a fresh namespace): what a
newcomer pastes must work."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.gpu

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S) if README.is_file() else []


def test_readme_has_python_examples():
    assert BLOCKS, f"no python blocks found in {README}"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    source = BLOCKS[index]
    if "import jax" in source:
        pytest.importorskip("jax")
    if "import torch" in source:
        pytest.importorskip("torch")
    exec(compile(source, f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
