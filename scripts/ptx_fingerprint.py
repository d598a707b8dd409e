"""Normalised PTX and ptxas resource report of every kernel instantiation, to show that a change of
the kernel sources leaves the generated code alone (no GPU needed: NVRTC only).

    python scripts/ptx_fingerprint.py save DIR [--archs 80 90] [--jobs N] [--match REGEX] [--every K]
    python scripts/ptx_fingerprint.py compare BEFORE AFTER

`save` compiles each instantiation of config.all_configs(arch) on its own, with the options the
package uses (compiler.compile_offline: -arch, --ptxas-options=-v, the common NVRTC options, the
config's own), and writes DIR/sm_<arch>/<short id>.ptx (the PTX without comments, .file/.loc lines
and the version/target header) and DIR/sm_<arch>/<short id>.ptxas (the ptxas report: registers,
stack frame, spills, constant banks). --match keeps the instantiations whose short id matches,
--every K every K-th of them (quick checks while editing). `compare` lists the instantiations whose files differ and
exits non-zero if any do (or if one side lacks some). Run it from a checkout with PYTHONPATH set to
it, so that the checkout's kernels_cu/ is compiled.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import sys

_HEADER = (".version", ".target", ".address_size")


# Internal-linkage names carry a hash of the source text (namespace-scope constants, say): any edit of
# the file changes it, not the code.
_INTERNAL_NAME = re.compile(r"_INTERNAL_[0-9a-f]+_\d+_cuflash2_cu_[0-9a-f]+_\d+")


def normalise_ptx(ptx: str) -> str:
    """PTX without comments, debug-location lines, the header, blank lines and source hashes."""
    ptx = _INTERNAL_NAME.sub("_INTERNAL_", ptx)
    lines = []
    for line in ptx.splitlines():
        code = line.split("//", 1)[0].rstrip()
        stripped = code.strip()
        if not stripped or stripped.startswith((".file", ".loc", *_HEADER)):
            continue
        lines.append(code)
    return "\n".join(lines) + "\n"


def normalise_ptxas_log(log: str) -> str:
    """The ptxas lines of NVRTC's log that describe the code (no timings, no paths)."""
    keep = []
    for line in log.splitlines():
        line = line.strip()
        if "Compile time" in line:
            continue
        if line.startswith("ptxas"):  # info lines, and the stack frame / spill line
            keep.append(re.sub(r"\s+", " ", line))
    return "\n".join(keep) + "\n"


def _compile(item):
    from cupy_backends.cuda.libs import nvrtc

    from cuflash2.runtime import compiler

    config, arch = item
    program = nvrtc.createProgram(compiler.kernel_source(config.source_file), "cuflash2.cu", [], [])
    try:
        nvrtc.addNameExpression(program, config.template_name())
        try:
            nvrtc.compileProgram(program, [f"-arch=sm_{arch}", "--ptxas-options=-v", *compiler._NVRTC_OPTIONS,
                                           *config.compile_options()])
        except nvrtc.NVRTCError:
            return config.short_id(), arch, None, nvrtc.getProgramLog(program)
        ptx = nvrtc.getPTX(program)
        log = nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    return config.short_id(), arch, normalise_ptx(ptx.rstrip("\0")), normalise_ptxas_log(log)


def save(out: pathlib.Path, archs: list[int], jobs: int, match: str = "", every: int = 1) -> int:
    from cuflash2.families import FAMILIES
    from cuflash2.runtime import compiler

    print(f"kernel sources: {compiler.kernel_dir()}", flush=True)
    items = []
    for arch in archs:
        (out / f"sm_{arch}").mkdir(parents=True, exist_ok=True)
        configs = list(dict.fromkeys(c for family in FAMILIES for c in family.all_configs(arch)))
        ids = [c.short_id() for c in configs]
        assert len(set(ids)) == len(ids), "short ids are not unique"
        configs = [c for c in configs if re.search(match, c.short_id())][::every]
        items += [(c, arch) for c in configs]
    failed = 0
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        for done, (name, arch, ptx, log) in enumerate(pool.map(_compile, items, chunksize=4), 1):
            folder = out / f"sm_{arch}"
            if ptx is None:
                failed += 1
                print(f"ERROR sm_{arch} {name}:\n{log}", file=sys.stderr)
                continue
            (folder / f"{name}.ptx").write_text(ptx)
            (folder / f"{name}.ptxas").write_text(log)
            if done % 100 == 0:
                print(f"{done}/{len(items)}", flush=True)
    print(f"saved {len(items) - failed} instantiations to {out} ({failed} failed)")
    return 1 if failed else 0


def compare(before: pathlib.Path, after: pathlib.Path, common_only: bool = False) -> int:
    def files(root):
        return {p.relative_to(root) for p in root.rglob("*") if p.is_file()}

    old, new = files(before), files(after)
    if common_only:  # a quick run (--match / --every) against a full one
        old = new = old & new
    same, differ = 0, []
    def text(path):
        return normalise_ptxas_log(path.read_text()) if path.suffix == ".ptxas" else normalise_ptx(path.read_text())

    for rel in sorted(old & new):
        if text(before / rel) == text(after / rel):
            same += 1
        else:
            differ.append(rel)
    for rel in differ:
        print(f"differs: {rel}")
    for rel in sorted(old - new):
        print(f"only in {before}: {rel}")
    for rel in sorted(new - old):
        print(f"only in {after}: {rel}")
    ptx = sum(1 for rel in old & new if rel.suffix == ".ptx")
    print(f"{same} identical files, {len(differ)} differ, {len(old - new)} + {len(new - old)} unmatched "
          f"({ptx} instantiations compared)")
    return 1 if differ or old != new else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_save = sub.add_parser("save")
    p_save.add_argument("out", type=pathlib.Path)
    p_save.add_argument("--archs", type=int, nargs="+", default=[80, 90])
    p_save.add_argument("--jobs", type=int, default=os.cpu_count())
    p_save.add_argument("--match", default="", help="regular expression on the short ids")
    p_save.add_argument("--every", type=int, default=1, help="keep every K-th instantiation")
    p_cmp = sub.add_parser("compare")
    p_cmp.add_argument("before", type=pathlib.Path)
    p_cmp.add_argument("after", type=pathlib.Path)
    p_cmp.add_argument("--common-only", action="store_true", help="compare only what both sides hold")
    args = parser.parse_args()
    if args.command == "save":
        return save(args.out, args.archs, args.jobs, args.match, args.every)
    return compare(args.before, args.after, args.common_only)


if __name__ == "__main__":
    sys.exit(main())
