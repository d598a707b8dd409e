import os

import pytest

# JAX preallocates 75% of GPU memory at its first use unless told not to; the scale tests need tens
# of GB after the JAX tests have run.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.is_available()
    except Exception:
        return False


HAS_GPU = _gpu_available()


# Test files whose every test compiles kernels with NVRTC: marked `compile` here, so that
# `-m "not compile"` is a quick run (the NVRTC compiles are most of the CPU suite's time).
COMPILE_MODULES = {"test_compile.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "compile: compiles kernels with NVRTC (no GPU needed)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in COMPILE_MODULES:
            item.add_marker(pytest.mark.compile)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_replays():
    """Each test starts without recorded launches (cuflash2.core.replay): a test that patches the
    launch choices (say launcher.resident_slots) must not replay launches recorded by an earlier test."""
    from cuflash2.core import replay

    replay.clear()
    yield
    replay.clear()
