"""The package as distributed: the tests run against the installed package, its metadata (license,
classifiers, URLs, extras), the wheel's contents and the typed public API. CPU only."""

import ast
import email
import importlib.metadata
import inspect
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

import cuflash2
from cuflash2.runtime import compiler

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent
PYTHONS = ("3.10", "3.11", "3.12", "3.13")


# ---------------------------------------------------------------------------- the installed package

@pytest.mark.skipif(os.environ.get("CUFLASH2_EXPECT_INSTALLED") != "1",
                    reason="set CUFLASH2_EXPECT_INSTALLED=1 where the package is installed (not editable)")
def test_tests_import_the_installed_package():
    """CI installs the wheel and sets CUFLASH2_EXPECT_INSTALLED=1: the tests must not see the checkout."""
    import cuflash2.cli.main

    for module in (cuflash2, cuflash2.cli.main):
        path = pathlib.Path(module.__file__).resolve()
        assert "site-packages" in path.parts, path
        assert CHECKOUT not in path.parents, f"{module.__name__} imported from the checkout: {path}"
    kernels = compiler.kernel_dir().resolve()
    assert "site-packages" in kernels.parts and CHECKOUT not in kernels.parents, kernels
    assert str(CHECKOUT) not in sys.path and "" not in sys.path[:1], sys.path[:3]


def test_py_typed_and_stub_are_installed():
    folder = pathlib.Path(cuflash2.__file__).parent
    assert (folder / "py.typed").is_file()
    assert (folder / "__init__.pyi").is_file()


# ---------------------------------------------------------------------------- type hints (the stub)

def _stub_functions() -> dict[str, ast.FunctionDef]:
    tree = ast.parse((pathlib.Path(cuflash2.__file__).parent / "__init__.pyi").read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _stub_parameters(node: ast.FunctionDef):
    """(name, kind, default) per parameter, as inspect.Parameter would give them."""
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + \
        [ast.literal_eval(d) for d in args.defaults]
    out = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, d) for a, d in zip(positional, defaults)]
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty if d is None else ast.literal_eval(d)))
    return out


@pytest.mark.parametrize("name", cuflash2.__all__)
def test_stub_matches_the_implementation(name):
    """cuflash2/__init__.pyi types the public API: its parameters must be the implementation's
    (names, order, kinds, defaults). Changed a public signature? Update the stub too."""
    stub = _stub_functions()
    assert name in stub, f"{name} missing from cuflash2/__init__.pyi"
    actual = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cuflash2, name)).parameters.values()]
    assert _stub_parameters(stub[name]) == actual, f"cuflash2/__init__.pyi disagrees with {name}'s signature"
    node = stub[name]
    assert node.returns is not None
    assert all(a.annotation is not None for a in node.args.args + node.args.kwonlyargs), name


def test_stub_has_only_public_names():
    assert set(_stub_functions()) == set(cuflash2.__all__)


# ---------------------------------------------------------------------------- metadata

def _check_metadata(meta) -> None:
    assert meta["Name"] == "cuflash2"
    assert meta["Version"] == cuflash2.__version__
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    classifiers = meta.get_all("Classifier") or []
    assert not [c for c in classifiers if c.startswith("License ::")]  # SPDX expression instead
    for python in PYTHONS:
        assert f"Programming Language :: Python :: {python}" in classifiers
    for classifier in ("Operating System :: POSIX :: Linux", "Development Status :: 4 - Beta",
                       "Topic :: Scientific/Engineering :: Artificial Intelligence", "Typing :: Typed"):
        assert classifier in classifiers
    assert meta["Author"] == "the cuflash2 authors" or "the cuflash2 authors" in (meta["Author-email"] or "")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    for label in ("Homepage", "Repository", "Issues"):
        assert urls[label].startswith("https://github.com/cuflash2/cuflash2"), urls
    requires = meta.get_all("Requires-Dist") or []

    def extra(name):
        return [r for r in requires if re.search(rf"extra == ['\"]{name}['\"]", r)]

    assert any(r.startswith("cupy-cuda12x") for r in extra("cuda12"))
    assert any(r.startswith("nvidia-cuda-nvrtc-cu12") for r in extra("cuda12"))
    assert any(r.startswith("cupy-cuda13x") for r in extra("cuda13"))
    nvrtc13 = [r for r in extra("cuda13") if r.startswith("nvidia-cuda-nvrtc")]
    assert nvrtc13 and all(re.match(r"nvidia-cuda-nvrtc\s*[<>=]", r) for r in nvrtc13), nvrtc13
    assert any(">=13" in r for r in nvrtc13) and any("<14" in r for r in nvrtc13), nvrtc13
    assert meta["Requires-Python"] == ">=3.10"


def test_installed_metadata():
    _check_metadata(importlib.metadata.metadata("cuflash2"))


def _wheel() -> pathlib.Path:
    """CUFLASH2_WHEEL (CI builds the wheel it installs), else a wheel built here if setuptools can."""
    given = os.environ.get("CUFLASH2_WHEEL")
    if given:
        return pathlib.Path(given)
    if not (CHECKOUT / "pyproject.toml").is_file():
        pytest.skip("no checkout to build a wheel from")
    try:
        import setuptools
        from packaging.version import Version
    except ImportError:
        pytest.skip("building the wheel needs setuptools and packaging")
    if Version(setuptools.__version__) < Version("77"):
        pytest.skip(f"building the wheel needs setuptools >= 77 (have {setuptools.__version__})")
    out = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"cuflash2-wheel-{os.getpid()}"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(CHECKOUT)], check=True, capture_output=True)
    return next(out.glob("cuflash2-*.whl"))


def test_wheel_contents_and_metadata():
    wheel = _wheel()
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(f"{dist_info}/METADATA"))
        record = zf.read(f"{dist_info}/RECORD").decode()
        license_text = zf.read(f"{dist_info}/licenses/LICENSE").decode()
    assert license_text.startswith("BSD 3-Clause License") and "the cuflash2 authors" in license_text
    _check_metadata(meta)
    assert f"{dist_info}/licenses/LICENSE" in names
    for path in ("cuflash2/__init__.py", "cuflash2/__init__.pyi", "cuflash2/py.typed", "cuflash2/cli/main.py",
                 "cuflash2/kernels_cu/mma_sync/flash_fwd.cu", "cuflash2/kernels_cu/common/ptx.cuh"):
        assert path in names and path in record, path
    # every kernel source of the checkout, subfolders included, ships in the wheel
    kernels = CHECKOUT / "kernels_cu"
    sources = {f"cuflash2/kernels_cu/{p.relative_to(kernels).as_posix()}" for p in kernels.rglob("*")
               if p.suffix in (".cu", ".cuh")}
    assert sources and sources <= names, sorted(sources - names)
    for source in (CHECKOUT / "cuflash2").rglob("*.py"):  # every module, subpackages included
        path = "cuflash2/" + source.relative_to(CHECKOUT / "cuflash2").as_posix()
        assert path in names, f"{path} is missing from the wheel (pyproject.toml's packages)"
    top = {n.split("/")[0] for n in names}
    assert top == {"cuflash2", dist_info}, top  # no generic top-level cli/, kernels_cu/ or tests/


# ---------------------------------------------------------------------------- user-facing documents

def _doc(name: str) -> str:
    path = CHECKOUT / name
    if not path.is_file():
        pytest.skip(f"{name} is not in this checkout")
    return path.read_text()


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_readme_python_blocks_are_complete_programs():
    """Each block runs as written on its own (a GPU test executes them): it parses and imports
    what it uses. The NumPy one runs here."""
    blocks = _python_blocks(_doc("README.md"))
    assert len(blocks) >= 8
    for block in blocks:
        tree = ast.parse(block)
        imported = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        used = {node.value.id for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)}
        modules = {"cuflash2", "np", "cp", "torch", "jax", "jnp", "logging", "ml_dtypes"}
        assert used & modules <= imported, (used & modules - imported, block)
        assert ".square()" not in block or "torch" in imported, "JAX arrays have no .square(): use jnp.square"
    numpy_only = [b for b in blocks if "np.random.randn(1, 64" in b]
    assert len(numpy_only) == 1
    exec(compile(numpy_only[0], "README.md", "exec"), {})


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "BENCHMARKS.md",
                                  "docs/design-notes.md", "docs/performance.md", "docs/guide.md"])
def test_user_documents_describe_the_product(name):
    text = _doc(name)
    for word in (r"\bsession\b", r"\bsessions\b", r"\blog item\b", r"\bissue #?\d+", r"\bitem \d+"):
        assert not re.search(word, text, flags=re.IGNORECASE), (name, word)


def test_readme_links_work_on_a_package_index():
    text = _doc("README.md")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    for target in targets:
        assert target.startswith(("https://", "#")), f"relative link {target!r}: use an absolute URL"
    for target in [t for t in targets if "github.com/cuflash2/cuflash2/blob/main/" in t]:
        assert (CHECKOUT / target.split("/blob/main/", 1)[1].split("#")[0]).exists(), target
    for target in [t for t in targets if "raw.githubusercontent.com/cuflash2/cuflash2/main/" in t]:
        assert (CHECKOUT / target.split("/cuflash2/main/", 1)[1]).exists(), target
    assert 150 <= text.count("\n") <= 280


def test_changelog_names_the_version():
    assert f"## {cuflash2.__version__}" in _doc("CHANGELOG.md")
    assert "semantic versioning" in _doc("CHANGELOG.md").lower()
