"""NVRTC compiles every kernel instantiation (no GPU needed), plus source handling.

Archs: sm_80 and sm_90 (the first-class targets, large shared-memory tile tables) and sm_86 (stands
for every 99 KB part, sm_86/sm_89/sm_12x, which get the small shared-memory tile tables).
A kernel that spills, or keeps a register array in local memory (a stack frame with zero spills),
runs several times slower: both fail here, on any CPU machine, before anyone reaches a GPU.
"""

import re
import shutil

import pytest

from cuflash2.families import mma_sync as cfg
from cuflash2.runtime import compiler
from cuflash2.families.mma_sync import all_forward_configs

COMPILE_ARCHS = (80, 90, 86)


def _cases(list_configs):
    """One param per (arch, config); a plan that cannot even be listed becomes one failing param."""
    cases = []
    for arch in COMPILE_ARCHS:
        try:
            configs = list_configs(arch)
        except Exception as exc:  # noqa: BLE001 - reported by the test, not at collection
            cases.append(pytest.param(arch, exc, id=f"sm_{arch}-listing-configs-failed"))
            continue
        cases += [pytest.param(arch, c, id=f"sm_{arch}-{c.short_id()}") for c in configs]
    return cases


def _check_compiles(arch, config):
    if isinstance(config, Exception):
        pytest.fail(f"listing the kernel configs for sm_{arch} raised {type(config).__name__}: {config}")
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy (pip install '.[cuda12]')")
    report = compiler.compile_offline(config, f"sm_{arch}")
    assert not report.error, f"{config.template_name()} failed to compile for sm_{arch}:\n{report.error}"
    assert report.registers > 0, f"no ptxas resource report for {report.line()}"
    assert report.registers <= 255, report.line()
    assert report.stack_frame_bytes == 0, f"stack frame (local memory): {report.line()}"
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, f"spills: {report.line()}"
    assert report.ok, report.line()
    assert "regs=" in report.line() and config.short_id() in report.line()


def _compiles_with_asserts(source_file, asserts):
    """Whether a kernel source with extra static_asserts appended compiles (NVRTC, sm_90), and its log."""
    from cupy_backends.cuda.libs import nvrtc

    source = compiler.kernel_source(source_file) + "\n" + "\n".join(asserts) + "\n"
    program = nvrtc.createProgram(source, "smem_contract.cu", [], [])
    try:
        nvrtc.compileProgram(program, ["-arch=sm_90", *compiler._NVRTC_OPTIONS])
        return True, ""
    except nvrtc.NVRTCError:
        return False, nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def test_forward_shared_memory_matches_the_kernel_traits():
    """The host reserves KernelConfig.smem_bytes of dynamic shared memory; the forward kernel lays
    out FwdTraits::kSmemBytes (row sums included for tight tiles). One NVRTC compile of static_asserts
    over every forward and KV-cache tile shows the two rules agree, and that a wrong value fails."""
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy (pip install '.[cuda12]')")
    tiles = {}
    for arch in COMPILE_ARCHS:
        for c in all_forward_configs(arch) + [c for c in cfg.all_kvcache_configs(arch) if c.kernel == cfg.FWD_KVCACHE]:
            traits = f"FwdTraits<Bf16, {c.head_dim}, {c.block_m}, {c.block_n}, {c.warps}, {c.stages}, {str(c.causal).lower()}>"
            tiles[traits] = (c.smem_bytes, c.forward_row_sums_bytes, c.short_id())

    asserts = [f'static_assert({t}::kSmemBytes == {smem} && {t}::kSumsBytes == {sums}, "{name}");'
               for t, (smem, sums, name) in tiles.items()]
    ok, log = _compiles_with_asserts("flash_fwd.cu", asserts)
    assert ok, f"host and kernel disagree on forward shared memory:\n{log[:2000]}"
    assert len(tiles) > 20 and any(sums for _, sums, _ in tiles.values())
    some_tile = next(iter(tiles))
    wrong = f'static_assert({some_tile}::kSmemBytes == {tiles[some_tile][0] + 16}, "off by 16");'
    assert not _compiles_with_asserts("flash_fwd.cu", [wrong])[0]


def test_decode_shared_memory_matches_the_kernel_traits():
    """The same contract for the decoding kernel (DecodeTraits::kSmemBytes: Q, then the K/V ring or
    the merge buffers of the warps, whichever is larger), over every decoding tile of every arch."""
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy (pip install '.[cuda12]')")
    tiles = {}
    for arch in COMPILE_ARCHS:
        for c in cfg.all_kvcache_configs(arch):
            if c.kernel == cfg.FWD_DECODE:
                traits = f"DecodeTraits<Bf16, {c.head_dim}, {c.block_n}, {c.warps}, {c.stages}>"
                tiles[traits] = (c.smem_bytes, c.short_id())
    asserts = [f'static_assert({t}::kSmemBytes == {smem}, "{name}");' for t, (smem, name) in tiles.items()]
    ok, log = _compiles_with_asserts("flash_fwd.cu", asserts)
    assert ok, f"host and kernel disagree on decoding shared memory:\n{log[:2000]}"
    assert len(tiles) >= 3
    some_tile = next(iter(tiles))
    wrong = f'static_assert({some_tile}::kSmemBytes == {tiles[some_tile][0] + 16}, "off by 16");'
    assert not _compiles_with_asserts("flash_fwd.cu", [wrong])[0]


def test_fused_backward_shared_memory_matches_the_kernel_traits():
    """The same contract for the fused backward (FusedBwdTraits::kSmemBytes: dQ staged in buffers of
    its own at head dims 96 and 128, one at 64 and 192, over a consumed Q/dO stage at 256;
    kDqPadBytes: the padding of the staged and accumulated dQ rows, which the host allocates;
    kDqRowInterleave: the row permutation the convert kernel undoes)."""
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy (pip install '.[cuda12]')")
    tiles = {f"FusedBwdTraits<{c.head_dim}, {c.block_m}, {c.block_n}, {c.warps}>":
             (c.smem_bytes, c.dq_row_pad_floats * 4, c.dq_row_interleave, c.short_id())
             for c in cfg.all_backward_configs(90) if c.kernel == cfg.BWD_FUSED}
    for c in cfg.all_backward_configs(90):  # padded rows: the kernel's width (kDqRowBytes) plus the pad
        if c.kernel == cfg.BWD_FUSED:
            assert c.dq_row_pitch(c.head_dim - 8) * 4 == c.head_dim * 4 + c.dq_row_pad_floats * 4
    # also the 64-row tile at head dim 64 (tuning: backward_plan(tile=...)), whose dQ has two buffers
    # of its own (the default 128-row tile has room for one)
    c = cfg.backward_plan(64, "bf16", True, 90, tile=(64, 8, 2), fused=True).main[0]
    tiles[f"FusedBwdTraits<{c.head_dim}, {c.block_m}, {c.block_n}, {c.warps}>"] = (
        c.smem_bytes, c.dq_row_pad_floats * 4, c.dq_row_interleave, c.short_id())
    asserts = [f'static_assert({t}::kSmemBytes == {smem} && {t}::kDqPadBytes == {pad} && '
               f'{t}::kDqRowBytes == {t.split("<")[1].split(",")[0]} * 4 + {pad} && '
               f'{t}::kDqRowInterleave == {str(interleave).lower()}, "{name}");'
               for t, (smem, pad, interleave, name) in tiles.items()]
    ok, log = _compiles_with_asserts("flash_bwd_fused.cu", asserts)
    assert ok, f"host and kernel disagree on fused backward shared memory:\n{log[:2000]}"
    assert len(tiles) == 6  # widths 64 (two block heights), 96, 128, 192, 256
    some_tile = next(iter(tiles))
    for wrong in (f'static_assert({some_tile}::kSmemBytes == {tiles[some_tile][0] + 16}, "off by 16");',
                  f'static_assert({some_tile}::kDqPadBytes == {tiles[some_tile][1] + 16}, "off by 16");',
                  f'static_assert({some_tile}::kDqRowInterleave == {str(not tiles[some_tile][2]).lower()}, "flipped");'):
        assert not _compiles_with_asserts("flash_bwd_fused.cu", [wrong])[0]


@pytest.mark.parametrize("arch,config", _cases(all_forward_configs))
def test_compile_forward(arch, config):
    _check_compiles(arch, config)


@pytest.mark.parametrize("arch,config", _cases(cfg.all_kvcache_configs))
def test_compile_kvcache(arch, config):
    _check_compiles(arch, config)


@pytest.mark.parametrize("arch,config", _cases(cfg.all_narrow_configs))
def test_compile_narrow(arch, config):
    """The narrow vector widths (8/4/2-byte global accesses) on the sampled buckets: config.NARROW_SAMPLES.
    Width-2 kernels above head dim 192 keep a stack frame that no tile removes
    (config.narrow_spill_expected, documented): they must compile, with the frame bounded."""
    if not cfg.narrow_spill_expected(config):
        _check_compiles(arch, config)
        return
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy (pip install '.[cuda12]')")
    report = compiler.compile_offline(config, f"sm_{arch}")
    assert not report.error, f"{config.template_name()} failed to compile for sm_{arch}:\n{report.error}"
    assert 0 < report.registers <= 255, report.line()
    assert report.stack_frame_bytes <= 256 and report.spill_store_bytes <= 256, report.line()


# Backward kernels, where the library has them (every instantiation of every backward plan).
@pytest.mark.parametrize("arch,config", _cases(getattr(cfg, "all_backward_configs", lambda arch: [])))
def test_compile_backward(arch, config):
    _check_compiles(arch, config)


def test_parse_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_Z3fooILi64EEvv' for 'sm_80'\n"
           "ptxas info    : Function properties for _Z3fooILi64EEvv\n"
           "    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 168 registers, 464 bytes cmem[0]\n")
    assert compiler._parse_ptxas_log(log) == {"registers": 168, "stack_frame_bytes": 24,
                                              "spill_store_bytes": 8, "spill_load_bytes": 12}
    assert compiler._parse_ptxas_log("")["registers"] == 0


@pytest.fixture
def broken_kernels(monkeypatch, tmp_path):
    """The kernel sources with a C++ error appended to flash_fwd.cu, in use while the test runs."""
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy")
    broken = tmp_path / "kernels_cu"
    shutil.copytree(compiler.kernel_dir(), broken)
    source = broken / compiler.source_path("flash_fwd.cu")
    source.write_text(source.read_text() + "\nthis is not C++;\n")
    with _kernel_dir(monkeypatch, broken):
        yield


def test_compile_error_is_reported_not_raised(broken_kernels):
    config = all_forward_configs(80)[0]
    report = compiler.compile_offline(config, "sm_80")
    assert report.error and not report.ok
    assert report.line().startswith("ERROR")


@pytest.mark.compile
def test_compile_cubin_is_a_whole_elf_image():
    """The cubin of a kernel (for a disassembler) reaches the end of its ELF tables: CuPy's getCUBIN
    drops the last byte, which compile_cubin restores."""
    pytest.importorskip("cupy_backends", reason="offline compilation needs CuPy")
    config = all_forward_configs(80)[0]
    image = compiler.compile_cubin(config, "sm_80")
    fields = compiler._ELF64_HEADER.unpack_from(image)
    assert fields[0][:4] == b"\x7fELF" and fields[2] == 190  # EM_CUDA
    phoff, shoff, phentsize, phnum, shentsize, shnum = fields[5], fields[6], *fields[9:13]
    assert phnum > 0 and shnum > 0
    assert len(image) == max(phoff + phnum * phentsize, shoff + shnum * shentsize)


def test_whole_elf_pads_a_truncated_image_only():
    header = compiler._ELF64_HEADER.pack(b"\x7fELF" + bytes(12), 2, 190, 1, 0, 100, 64, 0, 64, 56, 1, 0, 0, 0)
    image = header + bytes(100 + 56 - len(header) - 1)  # the program header table ends at 156
    assert len(compiler._whole_elf(image)) == 156
    assert compiler._whole_elf(image + b"\0") == image + b"\0"
    assert compiler._whole_elf(image + b"\0\0") == image + b"\0\0"  # nothing cut, nothing added


def test_compile_cubin_reports_nvrtc_errors(broken_kernels):
    with pytest.raises(RuntimeError, match="does not compile for sm_80"):
        compiler.compile_cubin(all_forward_configs(80)[0], "sm_80")


# --------------------------------------------------------------------------------------- sources


class _kernel_dir:
    """Point compiler.kernel_dir at `folder` with fresh source caches (and clean them up after)."""

    def __init__(self, monkeypatch, folder):
        self.monkeypatch, self.folder = monkeypatch, folder

    def __enter__(self):
        self.monkeypatch.setattr(compiler, "kernel_dir", lambda: self.folder)
        _clear_caches()
        return self

    def __exit__(self, *exc):
        self.monkeypatch.undo()
        _clear_caches()


def _clear_caches():
    compiler.kernel_source.cache_clear()
    compiler.sources_hash.cache_clear()


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def test_kernel_dir_has_sources():
    folder = compiler.kernel_dir()
    for name in compiler.SOURCE_PATHS.values():
        assert (folder / name).is_file(), name
    for path in folder.rglob("*"):
        for name in _INCLUDE.findall(path.read_text()) if path.suffix in (".cu", ".cuh") else ():
            assert (folder / name).is_file(), f"{path.name} includes missing {name}"


def test_kernel_source_inlines_every_include():
    _clear_caches()
    folder = compiler.kernel_dir()
    source = compiler.kernel_source("flash_fwd.cu")
    assert '#include "' not in source
    assert not _INCLUDE.search(source)
    headers = set(_INCLUDE.findall((folder / compiler.source_path("flash_fwd.cu")).read_text()))
    assert headers, "flash_fwd.cu includes no header?"
    pending = list(headers)
    while pending:  # transitively included headers too
        for name in _INCLUDE.findall((folder / pending.pop()).read_text()):
            if name not in headers:
                headers.add(name)
                pending.append(name)
    for name in headers:
        body = [line for line in (folder / name).read_text().splitlines()
                if line.strip() and not line.lstrip().startswith(("#include", "#pragma once", "//"))]
        assert body and body[0] in source, f"{name} not inlined"
    assert "flash_fwd_kernel" in source


def test_kernel_source_inlines_each_header_once(monkeypatch, tmp_path):
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a_marker;\n')
    (tmp_path / "b.cuh").write_text("#pragma once\nint b_marker;\n")
    (tmp_path / "main.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n  #  include "a.cuh"\nint main_marker;\n')
    with _kernel_dir(monkeypatch, tmp_path):
        source = compiler.kernel_source("main.cu")
    assert "#include" not in source
    assert source.count("a_marker") == 1 and source.count("b_marker") == 1 and "main_marker" in source
    assert source.index("b_marker") < source.index("a_marker") < source.index("main_marker")


def test_sources_hash_tracks_every_file(monkeypatch, tmp_path):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(compiler.kernel_dir(), copy)
    with _kernel_dir(monkeypatch, copy):
        original = compiler.sources_hash()
        source = compiler.kernel_source("flash_fwd.cu")
        assert compiler.sources_hash() == original  # stable
        assert re.fullmatch(r"[0-9a-f]{16}", original)

        header = sorted(copy.rglob("*.cuh"))[0]
        header.write_text(header.read_text() + "\n// edited\n")
        _clear_caches()
        edited = compiler.sources_hash()
        assert edited != original, f"editing {header.name} did not change sources_hash"
        assert compiler.kernel_source("flash_fwd.cu") != source or header.name not in source

        (copy / "common" / "new_file.cuh").write_text("// new\n")
        _clear_caches()
        assert compiler.sources_hash() not in (original, edited)

    # the real folder is back once the patch is undone
    assert compiler.sources_hash() == original or compiler.kernel_dir() != copy
    assert compiler.kernel_dir() != copy
