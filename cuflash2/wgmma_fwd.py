"""The Hopper forward (kernels_cu/wgmma/flash_fwd_sm90.cu): tile choice, support check, launch.

The kernel is compiled for sm_90a (wgmma and setmaxnreg exist only there) and takes one by-value
parameter struct holding three TMA tensor maps and the scalars.
"""

from __future__ import annotations

import functools
import math
import struct
import threading

import numpy as np

from . import tensor_maps
from .compiler import kernel_source

SOURCE = "wgmma/flash_fwd_sm90.cu"
BLOCK_M = 128
THREADS = 384
STAGES = 2
MAX_HEAD_DIM = 256
L2_SECTION_BYTES = 32 << 20  # causal tile order: K and V of one section of heads fit in L2
# FwdParams (flash_fwd_sm90.cu): 3 maps, o, lse, 5 strides, 9 ints, scale_log2, padding to 512.
_PARAMS = struct.Struct("<128s128s128sQQqqqqqiiiiiiiiif32x")
assert _PARAMS.size == 512


@functools.cache
def tile(head_dim: int, causal: bool) -> tuple[int, int]:
    """(head dim the kernel is built for (a multiple of 16), key block rows)."""
    padded = -(-head_dim // 16) * 16
    if padded <= 64:
        block_n = 128
    elif padded <= 128:
        block_n = 128
    elif padded <= 192:
        block_n = 96
    else:
        block_n = 80
    return padded, block_n


def smem_bytes(head_dim: int, block_n: int) -> int:
    panels = -(-head_dim // 64)
    return BLOCK_M * 128 * panels + 2 * STAGES * block_n * 128 * panels + 128 + 1024


def template_name(head_dim: int, block_n: int, causal: bool, dtype: str) -> str:
    return f"flash_fwd_sm90<{head_dim}, {block_n}, {'true' if causal else 'false'}, " \
           f"{'true' if dtype == 'bfloat16' else 'false'}>"


_loaded: dict = {}
_lock = threading.Lock()


def get_kernel(head_dim: int, block_n: int, causal: bool, dtype: str, device_id: int, hang_check: bool = False):
    key = (head_dim, block_n, causal, dtype, device_id, hang_check)
    kernel = _loaded.get(key)
    if kernel is None:
        import cupy

        with _lock, cupy.cuda.Device(device_id):
            options = ("-std=c++17", "-ftz=true", "-arch=sm_90a") + (("-DCF_HANG_CHECK",) if hang_check else ())
            name = template_name(head_dim, block_n, causal, dtype)
            module = cupy.RawModule(code=kernel_source(SOURCE), options=options, name_expressions=[name])
            kernel = module.get_function(name)
            kernel.max_dynamic_shared_size_bytes = smem_bytes(head_dim, block_n)
            _loaded[key] = kernel
    return kernel


def _map(t, rows: int, dims: tuple[int, int, int, int], strides) -> bytes:
    """Map of a (batch, seqlen, heads, head_dim) tensor with boxes of {64 columns, rows}."""
    b, s, h, d = dims
    return tensor_maps.encode_tiled(t.dtype, t.data_ptr, (d, s, h, b),
                                    (strides[1] * 2, strides[2] * 2, strides[0] * 2), (64, rows, 1, 1))


@functools.cache
def _sm_count(device_id: int) -> int:
    import cupy as cp

    return cp.cuda.Device(device_id).attributes["MultiProcessorCount"]


class _Slots(threading.local):
    def __init__(self):
        self.values = np.zeros(_PARAMS.size, dtype=np.uint8)
        self.address = np.array([self.values.ctypes.data], dtype=np.uint64)


_slots = _Slots()


def forward(q, k, v, out, lse, shape, causal: bool, device_id: int, stream, hang_check: bool = False,
            block_n: int | None = None) -> None:
    """out, lse <- attention(q, k, v) on the wgmma kernel (q, k, v, out, lse: TensorInfo)."""
    from cupy_backends.cuda.api import driver

    head_dim, default_n = tile(shape.head_dim, causal)
    block_n = block_n or default_n
    kernel = get_kernel(head_dim, block_n, causal, shape.dtype, device_id, hang_check)
    b, sq, sk, h, hk, d = shape.batch, shape.seqlen_q, shape.seqlen_k, shape.nheads, shape.nheads_kv, shape.head_dim
    m_blocks = math.ceil(sq / BLOCK_M)
    tiles = m_blocks * h * b
    kv_bytes_per_head = sk * d * 2 * 2
    section = max(1, min(h * b, L2_SECTION_BYTES // max(1, kv_bytes_per_head)))
    _PARAMS.pack_into(
        _slots.values, 0,
        _map(q, BLOCK_M, (b, sq, h, d), q.strides), _map(k, block_n, (b, sk, hk, d), k.strides),
        _map(v, block_n, (b, sk, hk, d), v.strides), out.data_ptr, lse.data_ptr,
        out.strides[0], out.strides[1], out.strides[2], lse.strides[0], lse.strides[1],
        sq, sk, d, h, shape.kv_group, b, m_blocks, tiles, section, shape.softmax_scale * math.log2(math.e))
    if tiles == 0:
        return
    grid = min(tiles, _sm_count(device_id))
    driver.launchKernel(kernel.kernel.ptr, grid, 1, 1, THREADS, 1, 1, smem_bytes(head_dim, block_n), stream.ptr,
                        int(_slots.address.ctypes.data), 0)
