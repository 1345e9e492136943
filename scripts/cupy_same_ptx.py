"""Whether a change to the CuPy backend's CUDA sources leaves its kernels' PTX as it was, on a
machine without a GPU: a refactor of the kernels (``#if`` into ``if constexpr``, a function moved
or split) is graded by it before any GPU time is spent on it.

    python scripts/cupy_same_ptx.py dump BEFORE [--kernel forward decode ...] [--arch 90]
    (edit the sources)
    python scripts/cupy_same_ptx.py dump AFTER ...
    python scripts/cupy_same_ptx.py compare BEFORE AFTER

``dump`` writes the PTX of each kernel's variants at head dims 64 and 128, in bf16 and fp16 (and
float32 for decoding with ``--float32``), under a set of feature combinations, one file per variant
named by its fields; NVRTC compiles them as ``flashx_cupy.resources`` does (``pip install
"nvidia-cuda-nvrtc==13.0.*"``). ``compare`` renames each file's registers and labels in order of
first use and drops their declarations, so that two builds which differ only in how NVVM numbered
them compare equal; it lists the variants that differ beyond that, and marks those whose
instructions agree once register numbers are dropped.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from flashx_cupy import variants  # noqa: E402
from flashx_cupy.resources import decode_variants, ptx  # noqa: E402

FEATURES = [{}, {"dropout": True}, {"sinks": True}, {"mask": True}, {"block_mask": True}, {"aligned": False},
            {"softcap": True, "alibi": True, "sinks": True}, {"varlen": True, "seqlens_k": True},
            {"mask": True, "dropout": True, "block_mask": True, "varlen": True}]
BACKWARD = ("dq", "dkdv", "dq_sm90", "dkdv_sm90")


def built(kernel: str, dtype: str, dim: int, features: dict, arch: str) -> list[variants.Variant]:
    """The variants of ``kernel`` this script builds for one dtype, head dim and feature set."""
    if kernel == "forward":
        return [variants.Variant("forward", dtype, dim, dim, *variants.TILES["forward", "16", dim], **features)]
    if kernel == "forward_sm90" and not features.get("dropout"):
        return [variants.Variant("forward_sm90", dtype, dim, dim, m, n, warps, tma=tma, v_buffers=buffers, **features)
                for (widest, _, tma), (m, n, warps, buffers) in variants.FORWARD_SM90_TILES.items() if widest == dim]
    if kernel == "forward_fp8_sm90" and not (features.get("dropout") or features.get("block_mask")):
        return [variants.Variant("forward_fp8_sm90", dtype, dim, dim, *tiles, **features)
                for (widest, _), tiles in variants.FORWARD_FP8_TILES.items() if widest == dim]
    if kernel in BACKWARD and (kernel, "16", dim) in variants.TILES:
        tiles = variants.TILES[kernel, "16", dim]
        builds = [{}]
        if kernel.startswith("dkdv"):  # dK/dV with the fused dQ, and (mma.sync) each sum alone
            builds += [{"dq_atomic": True}] + ([{"dkdv_parts": 1}, {"dkdv_parts": 2}] if kernel == "dkdv" else [])
        return [variants.Variant(kernel, dtype, dim, dim, *tiles, **features, **build) for build in builds]
    if kernel in variants.DECODE_KERNELS and not any(features.get(name) for name in ("dropout", "block_mask", "varlen")):
        caches = [{}, {"paged": True}] + ([] if dtype == "float32" else [{"fp8_cache": True}])
        return [v for cache in caches for v in decode_variants(kernel, dtype, dim, [16, 32], {**features, **cache}, arch)]
    return []


def _write(job: tuple) -> None:
    variant, arch, folder = job
    name = hashlib.sha1(repr(variant).encode()).hexdigest()[:12]
    Path(folder, f"{variant.kernel}-{name}.ptx").write_text(ptx(variant, arch))


def dump(folder: str, kernels: list[str], arch: str, float32: bool) -> None:
    os.makedirs(folder, exist_ok=True)
    dtypes = ["bfloat16", "float16"] + (["float32"] if float32 else [])
    jobs = list(dict.fromkeys((v, arch, folder) for kernel in kernels for dtype in dtypes for dim in (64, 128)
                              for features in FEATURES for v in built(kernel, dtype, dim, features, arch)))
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(_write, jobs))
    print(f"{len(jobs)} variants -> {folder}")


_REGISTER = re.compile(r"%(rd|r|f|fd|p|rs|h|hh)(\d+)")


def normalized(path: Path) -> list[str]:
    """The PTX's lines with registers renamed in order of first use, labels unnumbered and the
    register declarations dropped."""
    names, counts = {}, collections.Counter()

    def rename(match):
        kind = match.group(1)
        if match.group(0) not in names:
            names[match.group(0)] = f"%{kind}#{counts[kind]}"
            counts[kind] += 1
        return names[match.group(0)]

    return [re.sub(r"\$L__BB\d+_\d+", "$L", _REGISTER.sub(rename, line))
            for line in path.read_text().splitlines() if not line.strip().startswith(".reg")]


def compare(before: str, after: str) -> None:
    names = sorted(path.name for path in Path(before).glob("*.ptx"))
    differ = [name for name in names if normalized(Path(before, name)) != normalized(Path(after, name))]
    for name in differ:
        same_text = _unnumbered(Path(before, name)) == _unnumbered(Path(after, name))
        print(f"differs: {name}" + (" (the same instructions with registers assigned otherwise: read the diff)"
                                    if same_text else ""))
    print(f"{len(names) - len(differ)} of {len(names)} variants the same")
    raise SystemExit(1 if differ else 0)


def _unnumbered(path: Path) -> list[str]:
    """The normalized PTX with every register's number dropped. Equal texts that ``normalized``
    tells apart hold the same instructions on registers assigned otherwise: NVVM choosing which of
    several registers set to one value (zeros, say) an accumulator starts from, which only a read
    of the diff tells from a changed dataflow."""
    return [re.sub(r"(%[a-z]+)#\d+", r"\1", line) for line in normalized(path)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dumping = commands.add_parser("dump")
    dumping.add_argument("folder")
    dumping.add_argument("--kernel", nargs="+", default=["forward", "forward_sm90", "forward_fp8_sm90", *BACKWARD,
                                                         *variants.DECODE_KERNELS])
    dumping.add_argument("--arch", default="90")
    dumping.add_argument("--float32", action="store_true", help="decoding's float32 builds too")
    comparing = commands.add_parser("compare")
    comparing.add_argument("before")
    comparing.add_argument("after")
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.folder, args.kernel, args.arch, args.float32)
    else:
        compare(args.before, args.after)


if __name__ == "__main__":
    main()
