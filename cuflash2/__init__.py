"""cuflash2: FlashAttention-2 as CUDA C++ kernels compiled at run time by NVRTC (through CuPy).

Works with CuPy arrays, any CUDA tensor that speaks DLPack (PyTorch, JAX: results come back in the
same framework), and NumPy arrays (computed on the CPU by the reference implementation).
"""

import pathlib as _pathlib

# In a source checkout, cli/ and kernels_cu/ sit beside this package; an installed wheel maps them
# inside it (cuflash2.cli, cuflash2/kernels_cu). Extending __path__ makes `cuflash2.cli` importable
# the same way in both cases.
_checkout = _pathlib.Path(__file__).resolve().parent.parent
if (_checkout / "cli").is_dir() and not (_pathlib.Path(__file__).parent / "cli").is_dir():
    __path__.append(str(_checkout))

from .api import (
    attention_probs,
    flash_attn_backward,
    flash_attn_forward,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache
from .varlen import (
    flash_attn_varlen_backward,
    flash_attn_varlen_forward,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    varlen_attention_probs,
)

__version__ = "0.1.0"

__all__ = [
    "attention_probs",
    "flash_attn_backward",
    "flash_attn_forward",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_backward",
    "flash_attn_varlen_forward",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "varlen_attention_probs",
]
