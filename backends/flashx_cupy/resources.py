"""Registers, spills, shared memory and instruction counts of the CuPy backend's kernels, built
on a machine without a GPU: NVRTC compiles each variant's source with its options (and CuPy's
``-ftz=true``) to PTX, ptxas to sm_90 code, and nvdisasm lists the SASS, of which the basic blocks
holding tensor-core products (the tile loops) are counted by opcode.

    pip install "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-nvcc==13.0.*" nvidia-cuda-nvdisasm
    python -m flashx_cupy.resources                     # shipped tiles, bf16, every kernel and head dim
    python -m flashx_cupy.resources --kernel dkdv --dim 128 --tile 64x64x4 --blocks
    python -m flashx_cupy.resources --kernel forward --features mask=1,dropout=1
    python -m flashx_cupy.resources --kernel forward_sm90 dq dkdv --features softcap=1,alibi=1,sinks=1
    python -m flashx_cupy.resources --kernel forward_sm90 --dim 128 --features tma=1 --tile 128x128x8x3
    python -m flashx_cupy.resources --kernel forward_fp8_sm90 --dtype bfloat16 float16   # FP8 inputs, o's dtype
    python -m flashx_cupy.resources --kernel dq_sm90 dkdv_sm90 --dtype bfloat16 float16 --dim 64 128 --features mask=1,dropout=1
    python -m flashx_cupy.resources --kernel decode decode_merge decode_append --features paged=1,mask=1
    python -m flashx_cupy.resources --kernel decode decode_append --dtype bfloat16 float16 --features fp8_cache=1
    python -m flashx_cupy.resources --kernel decode --dim 128 --rows 16 --features decode_bulk=0 --blocks

NVRTC 13.0 is the one CuPy 14.2 uses on the lent GPUs; cuda-bindings (numba-cuda's dependency)
finds the wheel's library. A spill or a register count here is what the GPU will run; a block's
opcode counts are the static instructions of one tile, a proxy for its issue cost. Decoding builds
its K and V copies the way the host does on ``--arch`` (``variants.decode_bulk``: bulk copies on
90) unless the features say ``decode_bulk``; with ``--blocks`` a kernel's copy instructions into
shared memory are counted too (LDGSTS: cp.async's 16 bytes a thread; UBLKCP: a bulk copy, in
ptxas's loop over the lanes that issue one).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from flashx_cupy import variants

_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.MULTILINE)


def tool(name: str) -> str:
    """A CUDA binary on PATH, else from the nvidia-cuda-* wheels."""
    found = shutil.which(name)
    if found:
        return found
    import nvidia

    for root in nvidia.__path__:
        for candidate in Path(root).glob(f"cu*/bin/{name}"):
            return str(candidate)
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm")


def ptx(variant: variants.Variant, arch: str) -> str:
    from cuda.bindings import nvrtc

    def check(result):
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise SystemExit(f"NVRTC: {result[0]}")
        return result[1:]

    text = variants.source(variants.FILES[variant.kernel]).encode()
    (program,) = check(nvrtc.nvrtcCreateProgram(text, b"kernel.cu", 0, [], []))
    # PTX for the virtual architecture of the variant's target (sm_90a -> compute_90a), else of ``arch``.
    target = variants.ARCHITECTURES.get(variant.kernel, f"sm_{arch}").replace("sm_", "compute_")
    options = [option.encode() for option in (*variant.options, "-ftz=true") if not option.startswith("--gpu-architecture")]
    options.append(f"--gpu-architecture={target}".encode())
    compiled = nvrtc.nvrtcCompileProgram(program, len(options), options)
    if compiled[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        (size,) = check(nvrtc.nvrtcGetProgramLogSize(program))
        log = b" " * size
        check(nvrtc.nvrtcGetProgramLog(program, log))
        raise SystemExit(f"NVRTC failed for {variant}:\n{log.decode(errors='replace')}")
    (size,) = check(nvrtc.nvrtcGetPTXSize(program))
    text = b" " * size
    check(nvrtc.nvrtcGetPTX(program, text))
    return text.rstrip(b"\0 ").decode()


def report(variant: variants.Variant, arch: str, blocks: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder, "kernel.ptx"), Path(folder, "kernel.cubin")
        source.write_text(ptx(variant, arch))
        target = variants.ARCHITECTURES.get(variant.kernel, f"sm_{arch}")
        built = subprocess.run([tool("ptxas"), "-v", f"-arch={target}", str(source), "-o", str(binary)],
                               capture_output=True, text=True, check=True).stderr
        # ptxas reports every entry of the module (dq.cu holds two): keep this variant's
        entry = built.split(f"Compiling entry function '{variant.entry_point}'")[1].split("Compiling entry")[0]
        registers = re.search(r"Used (\d+) registers", entry).group(1)
        stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", entry).groups()
        print(f"{variant.kernel:8} {variant.dtype:9} d{variant.dim_qk}/{variant.dim_v} "
              f"{variant.block_m}x{variant.block_n}x{variant.warps}: {registers} registers, spills {stores}/{loads} B "
              f"(stores/loads), shared {variant.shared_memory} B"
              + (", TMA" * variant.tma + f", {variant.v_buffers} V buffers" if variant.kernel == "forward_sm90" else "")
              + (f", {variant.stages} stages" + ", paged" * variant.paged + ", fp8 cache" * variant.fp8_cache
                 + ", bulk" * variant.decode_bulk
                 if variant.stages else ""))
        for line in built.splitlines():  # e.g. wgmma serialized by ptxas (info C7510, C7512), which costs the overlap
            if "warning" in line.lower() or "Performance Loss" in line:
                print(f"    {line}")
        if blocks:
            sass = subprocess.run([tool("nvdisasm"), "-c", str(binary)], capture_output=True, text=True,
                                  check=True).stdout
            code = sass.split(f".text.{variant.entry_point}:")[1].split(".section")[0]
            copies = collections.Counter(op for op in _SASS_LINE.findall(code) if op in ("LDGSTS", "UBLKCP"))
            print(f"    copies: LDGSTS={copies['LDGSTS']} UBLKCP={copies['UBLKCP']}")
            for block in re.split(r"^\.L_x_\d+:", code, flags=re.MULTILINE):
                counts = collections.Counter(_SASS_LINE.findall(block))
                if counts["HMMA"] + counts["HGMMA"] >= 16:
                    top = " ".join(f"{op}={n}" for op, n in counts.most_common(12))
                    print(f"    block of {sum(counts.values())}: {top}")


def decode_variants(kernel: str, dtype: str, dim: int, rows: list[int], features: dict,
                    arch: str) -> list[variants.Variant]:
    """The shipped decoding variants of ``kernel`` at head dim ``dim``, one per CTA row count (an FP8
    cache's tiles with ``fp8_cache``), loading K and V as the host would on ``arch`` unless
    ``features`` says ``decode_bulk``."""
    width = "8" if features.get("fp8_cache") else "32" if dtype == "float32" else "16"
    features = {"decode_bulk": variants.decode_bulk(features.get("aligned", True), arch, dim * int(width) // 8), **features}
    block_n, warps, stages = variants.DECODE_TILES[width, dim]
    return [variants.Variant(kernel, dtype, dim, dim, block_m, block_n, warps, stages=stages, **features)
            for block_m in rows if block_m <= variants.decode_rows_most(dim, bool(features.get("fp8_cache")))]


def forward_sm90_variants(dtype: str, dim: int, tile: str | None, features: dict) -> list[variants.Variant]:
    """The wgmma forward's shipped variants at head dim ``dim``, each tile of FORWARD_SM90_TILES
    with the loads it takes (TMA or not, unless ``features`` says), or ``tile``
    (BLOCK_MxBLOCK_NxWARPSxV_BUFFERS)."""
    if tile:
        shapes = {(tuple(map(int, tile.split("x"))), features.get("tma", False))}
    else:
        shapes = {(shape, tma) for (widest, _, tma), shape in variants.FORWARD_SM90_TILES.items()
                  if widest == dim and features.get("tma", tma) == tma}
    others = {name: value for name, value in features.items() if name != "tma"}
    return [variants.Variant("forward_sm90", dtype, dim, dim, block_m, block_n, warps, tma=tma, v_buffers=v_buffers,
                             **others)
            for (block_m, block_n, warps, v_buffers), tma in sorted(shapes)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m flashx_cupy.resources", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", nargs="+", default=["forward", "dq", "dkdv"],
                        choices=["forward", "forward_sm90", "forward_fp8_sm90", "dq", "dkdv", "dq_sm90", "dkdv_sm90",
                                 *variants.DQ_MODULE_EXTRAS, *variants.DECODE_KERNELS])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=list(variants.DTYPE_CODES))
    parser.add_argument("--dim", nargs="+", type=int, default=list(variants.HEAD_DIM_CLASSES))
    parser.add_argument("--tile", help="BLOCK_MxBLOCK_NxWARPS instead of the shipped tiles (forward_sm90: xV_BUFFERS too)")
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 32, 64],
                        help="decoding: each CTA row count (BLOCK_M) to build, up to the head dim's most")
    parser.add_argument("--features", default="", help="Variant fields, e.g. mask=1,dropout=1,aligned=0")
    parser.add_argument("--arch", default="90")
    parser.add_argument("--blocks", action="store_true", help="opcode counts of the tile loops' basic blocks")
    args = parser.parse_args()
    features = {name: bool(int(value)) for name, value in (part.split("=") for part in args.features.split(",") if part)}
    for kernel in args.kernel:
        for dtype in args.dtype:
            for dim in args.dim:
                if kernel in variants.DECODE_KERNELS:
                    for variant in decode_variants(kernel, dtype, dim, args.rows, features, args.arch):
                        report(variant, args.arch, args.blocks)
                    continue
                if kernel == "forward_sm90":
                    for variant in forward_sm90_variants(dtype, dim, args.tile, features):
                        report(variant, args.arch, args.blocks)
                    continue
                if kernel == "forward_fp8_sm90":
                    tiles = {tiles for (served, _), tiles in variants.FORWARD_FP8_TILES.items() if served == dim}
                else:
                    width = "32" if dtype == "float32" else "16"
                    table = ("dq" if kernel in variants.DQ_MODULE_EXTRAS
                             else "dkdv_dq" if features.get("dq_atomic") and kernel == "dkdv" else kernel)
                    tiles = {variants.TILES[table, width, dim]} if (table, width, dim) in variants.TILES else set()
                if args.tile:
                    tiles = {tuple(map(int, args.tile.split("x")))}
                for tile in sorted(tiles):  # none: a head dim this kernel does not serve
                    for parts in variants.dkdv_parts(dim, dim) if kernel in ("dkdv", "dkdv_sm90") else (3,):
                        variant = variants.Variant(kernel, dtype, dim, dim, *tile, dkdv_parts=parts, **features)
                        report(variant, args.arch, args.blocks)


if __name__ == "__main__":
    main()
