"""Framework adapters: the only code that knows torch tensors, JAX arrays, CuPy arrays or DLPack
producers. Each adapter describes the caller's arrays for the core, allocates the outputs in the
caller's framework, picks the caller's stream and provides the differentiable entry points (torch
custom ops and autograd, JAX custom_vjp); NumPy arrays run the CPU reference.

`adapter_for(q)` returns the adapter of q's framework; the torch and JAX adapters are imported only
when such an array is passed in.
"""

from __future__ import annotations

from .arrays import framework_of

_adapters: dict = {}


def adapter_for(x, name: str = "q"):
    """The adapter of x's framework (a TypeError names `name` for anything else)."""
    framework = framework_of(x, name)
    adapter = _adapters.get(framework)
    if adapter is None:
        if framework == "numpy":
            from .numpy_adapter import NumpyAdapter

            adapter = NumpyAdapter()
        elif framework == "torch":
            from .torch_adapter import ADAPTER as adapter
        elif framework == "jax":
            from .jax_adapter import ADAPTER as adapter
        else:
            from .gpu import GpuAdapter

            adapter = GpuAdapter(framework)
        _adapters[framework] = adapter
    return adapter


__all__ = ["adapter_for", "framework_of"]
