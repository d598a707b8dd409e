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


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_call_plans():
    """Each test starts without recorded call plans (cuflash2.call_plans): a test that patches the
    launch choices (say launch._slots) must not replay a plan recorded by an earlier test."""
    from cuflash2 import call_plans

    call_plans.clear()
    yield
    call_plans.clear()
