"""Ahead-of-time build of the Triton kernels: cubins for sm_90a and sm_100a, checked and embedded.

    python -m peagle_trt.ops.triton_kernels.aot OUT_DIR [--arch 90 --arch 100] [--only PREFIX] [--jit-only]

compiles every variant of `variants.py` with `triton.compile(..., target=GPUTarget("cuda", cap, 32))`
(no GPU or driver needed), and writes into OUT_DIR:
  <variant>.sm<cap>a.cubin   the binaries;
  manifest.json              per cubin: kernel symbol, arguments, threads, shared memory, registers,
                             local memory (spills), from Triton's metadata and its bundled cuobjdump;
  tritonCubins.cpp           the cubins embedded with `.incbin` plus the table the C launcher
                             (plugins/src/launcher/tritonLauncher.cpp) looks variants up in.
The build FAILS (BuildError) on local memory or a stack frame over STACK_LIMIT bytes (spills), more
than 255 registers, more shared memory than the architecture has, or a kernel needing Triton's
global scratch buffer (the launcher passes none). A stack frame up to STACK_LIMIT is reported, not
refused: CUDA 13.0's ptxas (the one the H200 image's Triton 3.6 runs) spills 4 B in the d128 `.tree`
attention variants that Triton's bundled 12.x ptxas keeps in registers (seen 2026-11-27).
`--jit-only` compiles and checks the kernels only the JIT path launches so far (`variants.jit_variants()`:
split-KV attention, FP8 GEMM) instead, and embeds nothing. Called by plugins/CMakeLists.txt; tested by
tests/ops/test_triton_aot.py, tests/ops/test_kv_attention_split.py and tests/ops/test_fp8_linear.py.
The compiled kernel takes the non-constexpr arguments in order, then two pointers (Triton's global
and profile scratch), passed as NULL. fp32 scalars are 4-byte floats (Triton's own generated C
launcher passes them as double; it is not used).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from peagle_trt.errors import BuildError
from peagle_trt.ops.triton_kernels.common import interpreted
from peagle_trt.ops.triton_kernels.variants import Variant, all_variants, jit_variants

ARCHS = (90, 100)
SHARED_LIMIT = {90: 227 * 1024, 100: 227 * 1024}  # max dynamic shared memory per block (bytes)
MAX_REGS = 255
ALIGN = 16  # bytes every pointer argument is aligned to (the launcher checks)
STACK_LIMIT = 32  # bytes per thread: a spilled loop scalar or two, no spilled tile
RES_RE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def cuobjdump() -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.is_file():
        raise BuildError(f"Triton's bundled cuobjdump is missing at {path}; reinstall triton==3.9.0")
    return path


def resources(cubin: Path) -> dict:
    """{'registers', 'stack', 'static_shared', 'local'} of the one kernel in `cubin`."""
    text = subprocess.run([str(cuobjdump()), "-res-usage", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    match = RES_RE.search(text)
    if match is None:
        raise BuildError(f"cuobjdump -res-usage {cubin}: no resource line in:\n{text}")
    regs, stack, shared, local = (int(x) for x in match.groups())
    return {"registers": regs, "stack": stack, "static_shared": shared, "local": local}


def aligned_attrs(v: Variant) -> dict:
    """Every pointer argument compiled as ALIGN-byte aligned, as Triton's JIT specializes torch's
    allocations: without it the loads cannot be vectorized (one 2-byte load per element, registers
    doubled: seen in the attention's PTX). The launcher refuses a misaligned pointer."""
    return {(i,): [["tt.divisibility", ALIGN]] for i, (_, t) in enumerate(v.signature.items()) if t.startswith("*")}


def compile_variant(v: Variant, cap: int, out_dir: Path) -> dict:
    """Compile one variant for sm_<cap>a, write its cubin, return its manifest entry."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(v.kernel, v.signature, constexprs=v.constexprs, attrs=aligned_attrs(v))
    k = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                       options={"num_warps": v.num_warps, "num_stages": v.num_stages})
    path = out_dir / f"{v.name}.sm{cap}a.cubin"
    path.write_bytes(k.asm["cubin"])
    md = k.metadata
    entry = {"variant": v.name, "arch": cap, "file": path.name, "symbol": md.name,
             "threads": 32 * md.num_warps, "shared": md.shared,
             "global_scratch": getattr(md, "global_scratch_size", 0),  # older Tritons lack these fields
             "profile_scratch": getattr(md, "profile_scratch_size", 0), "args": [t for _, t in v.kernel_args],
             "aligned": sum(1 << i for i, (_, t) in enumerate(v.kernel_args) if t.startswith("*")),
             "arg_names": [n for n, _ in v.kernel_args]}
    entry.update(resources(path))
    return entry


def _compile_by_name(name: str, cap: int, out_dir: Path) -> dict:
    return compile_variant(next(v for v in all_variants() + jit_variants() if v.name == name), cap, out_dir)


def check(entry: dict) -> list[str]:
    """The limits one compiled kernel breaks (empty: none)."""
    name = f"{entry['variant']} sm_{entry['arch']}a"
    bad = []
    if entry["local"] or entry["stack"] > STACK_LIMIT:
        bad.append(f"{name}: spills ({entry['local']} B local memory, {entry['stack']} B stack)")
    if entry["registers"] > MAX_REGS or entry["registers"] * entry["threads"] > 65536:
        bad.append(f"{name}: {entry['registers']} registers x {entry['threads']} threads")
    if entry["shared"] > SHARED_LIMIT[entry["arch"]]:
        bad.append(f"{name}: {entry['shared']} B shared memory > {SHARED_LIMIT[entry['arch']]}")
    if entry["global_scratch"] or entry["profile_scratch"]:
        bad.append(f"{name}: needs Triton scratch memory, which the launcher does not provide")
    return bad


def embed_source(entries: list[dict], out_dir: Path) -> str:
    """C++ source embedding every cubin (.incbin) and the table of tritonCubins.h."""
    lines = ["// Generated by peagle_trt/ops/triton_kernels/aot.py; do not edit.",
             '#include "tritonCubins.h"', "", "namespace peagle", "{"]
    for i, e in enumerate(entries):
        path = (out_dir / e["file"]).resolve().as_posix()
        lines += [f'__asm__(".section .rodata\\n.balign 16\\n.hidden peagleCubin{i}\\n.global peagleCubin{i}\\n"',
                  f'        "peagleCubin{i}:\\n.incbin \\"{path}\\"\\n.byte 0\\n.previous\\n");',
                  f"extern \"C\" unsigned char const peagleCubin{i}[];"]
    lines += ["", "TritonCubin const kTritonCubins[] = {"]
    for i, e in enumerate(entries):
        size = (out_dir / e["file"]).stat().st_size
        lines.append(f'    {{"{e["variant"]}", {e["arch"]}, "{e["symbol"]}", peagleCubin{i}, {size}u, {e["threads"]}, '
                     f'{e["shared"]}, {len(e["args"])}, {e["aligned"]}u}},')
    lines += ["};", f"size_t const kNumTritonCubins = {len(entries)};", "", "} // namespace peagle", ""]
    return "\n".join(lines)


def build(out_dir: Path, archs=ARCHS, only: str = "", jobs: int = 2, jit_only: bool = False) -> list[dict]:
    """Compile, check and embed; returns the manifest entries. Raises BuildError on any limit.
    jit_only: `variants.jit_variants()` instead, compiled and checked, not embedded."""
    if interpreted():
        raise BuildError("TRITON_INTERPRET is set: the kernels were decorated for the interpreter and cannot "
                         "be compiled; run the ahead-of-time build with TRITON_INTERPRET=0")
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [(v, cap) for v in (jit_variants() if jit_only else all_variants()) if v.name.startswith(only)
            for cap in archs]
    if not todo:
        raise BuildError(f"no kernel variant starts with {only!r}")
    # processes, not threads: a compilation holds the GIL most of the time; children get names (picklable)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        entries = list(pool.map(_compile_by_name, [v.name for v, _ in todo], [cap for _, cap in todo],
                                [out_dir] * len(todo)))
    bad = [msg for e in entries for msg in check(e)]
    (out_dir / "manifest.json").write_text(json.dumps({"cubins": entries, "violations": bad}, indent=1))
    if bad:
        raise BuildError("Triton kernels over their limits (see manifest.json):\n" + "\n".join(bad))
    if not jit_only:
        (out_dir / "tritonCubins.cpp").write_text(embed_source(entries, out_dir))
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="where the cubins, manifest.json and tritonCubins.cpp go")
    parser.add_argument("--arch", type=int, action="append", help="compute capability (default: 90 and 100)")
    parser.add_argument("--only", default="", help="compile only the variants whose name starts with this")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compilations")
    parser.add_argument("--jit-only", action="store_true",
                        help="the kernels only the JIT path launches (split-KV, FP8 GEMM): compile and check, "
                             "embed nothing")
    args = parser.parse_args(argv)
    entries = build(args.out_dir, tuple(args.arch or ARCHS), args.only, args.jobs, args.jit_only)
    worst = max(entries, key=lambda e: e["registers"])
    stacked = [f"{e['variant']} sm_{e['arch']}a" for e in entries if e["stack"]]
    for name in stacked:  # within STACK_LIMIT (build() refuses more), said aloud
        print(f"aot: {name}: a small stack frame (spilled scalars), within {STACK_LIMIT} B", file=sys.stderr)
    print(json.dumps({"cubins": len(entries), "archs": sorted({e["arch"] for e in entries}),
                      "max_registers": worst["registers"], "max_registers_variant": worst["variant"],
                      "max_shared": max(e["shared"] for e in entries),
                      "max_stack": max(e["stack"] for e in entries), "stack_frames": stacked}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
