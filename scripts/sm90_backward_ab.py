"""The wgmma backward's kernels, flashx_dq_sm90 and flashx_dkdv_sm90, against a git ref's (main by
default) in one process, on a GPU of compute capability 9.0: each case's backward runs alternately
with this tree's kernels and the ref's, CUDA events around each kernel's launches alone, and the
two must give the same gradients bit for bit (same products in the same order; only who copies
and when differ). Where ``fused_dq`` holds (not deterministic; under a band, with every dQ sum in
one launch), this tree's backward is flashx_dkdv_sm90 adding dQ, which is timed alone (its sums'
order varies from run to run).

    python3 scripts/sm90_backward_ab.py                            # bf16, B=2, N=8192, H=16: d128, d64, each causal or not
    python3 scripts/sm90_backward_ab.py --ref main --dim 128 --causal 1 --repeats 30
    python3 scripts/sm90_backward_ab.py --heads 32 --kv-heads 4 --seqlen 4096 --causal 0   # GQA
    python3 scripts/sm90_backward_ab.py --dim 128 --causal 0 --no-fused-dq   # the two kernels where the fused one serves

The ref's kernels are built from its kernels/ folder (git show; or ``--ref`` names a folder of
kernels, another tree's backends/flashx_cupy/kernels where no git history travels) with this
tree's variant options and launched with main's shape of them: 32 * WARPS threads (no producer
warpgroup) and two buffers of each streamed tile; a ref of another launch shape needs
``ref_launch`` changed with it. Prints a line a kernel and case: the median ms of each, TFLOP/s
(dK/dV's four products, dQ's three), and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "backends")]
KERNELS = "backends/flashx_cupy/kernels"


def ref_kernels(ref: str) -> Path:
    """The ref's kernels/ folder, written out to a temporary one (a folder given as the ref: itself)."""
    if Path(ref).is_dir():
        return Path(ref)
    folder = Path(tempfile.mkdtemp(prefix="flashx-ref-kernels-"))
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{ref}:{KERNELS}"],
                           capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        (folder / name).write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{KERNELS}/{name}"],
                                                   capture_output=True, check=True).stdout)
    return folder


#: The kernels compared, and the products each runs.
PRODUCTS = {"dq_sm90": 3, "dkdv_sm90": 4}


def ref_launch(variant) -> tuple[int, int]:
    """(threads, dynamic shared memory) of main's kernel: the resident tiles, two of each streamed
    one, then dK/dV's two tiles' LSE and D or dQ's allowed pairs of a tile."""
    from flashx_cupy import variants

    size = variants.ELEMENT_SIZES[variant.dtype]
    extra = 4 * variant.block_n * 4 if variant.kernel == "dkdv_sm90" else variant.block_m * variant.block_n
    return 32 * variant.warps, size * (variant.block_m + 2 * variant.block_n) * (variant.dim_qk + variant.dim_v) + extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="main")
    parser.add_argument("--dim", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-fused-dq", action="store_true",
                        help="flashx_dq_sm90 and flashx_dkdv_sm90 where the fused dK/dV kernel would serve (no band)")
    args = parser.parse_args()

    import cupy
    from flashx_cupy import launch, variants

    folder = ref_kernels(args.ref)
    built: dict = {}
    state = {"ref": False, "events": {}}
    plain = launch._kernel

    def timed(variant, device):
        kernel = plain(variant, device)
        if variant.kernel not in PRODUCTS:
            return kernel

        def run(grid, block, args, shared_mem=0, stream=None):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            if state["ref"]:
                threads, shared = ref_launch(variant)
                function = built.get(variant)
                if function is None:
                    text = variants.source(variants.FILES[variant.kernel], folder)
                    function = built[variant] = cupy.RawModule(code=text, options=variant.options).get_function(variant.entry_point)
                    function.max_dynamic_shared_size_bytes = shared
                function(grid, (threads,), args, shared_mem=shared, stream=stream)
            else:
                kernel(grid, block, args, shared_mem=shared_mem, stream=stream)
            end.record(stream)
            state["events"].setdefault(variant.kernel, []).append((start, end))

        return run

    launch._kernel = timed
    if args.no_fused_dq:
        variants.fused_dq = lambda problem, sm90, whole_sums: False
    for dim in args.dim:
        for causal in args.causal:
            compare(args, dim, bool(causal), state)


def compare(args, dim: int, causal: bool, state: dict) -> None:
    """One case: both kernels' dK and dV, then their times, alternating."""
    import cupy
    import torch

    import flashx

    dtype = getattr(torch, args.dtype)
    kv_heads = args.kv_heads or args.heads
    generator = torch.Generator("cuda").manual_seed(0)
    shape_q, shape_k = (args.batch, args.seqlen, args.heads, dim), (args.batch, args.seqlen, kv_heads, dim)
    q, do = (torch.randn(shape_q, generator=generator, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(shape_k, generator=generator, device="cuda", dtype=dtype) for _ in range(2))
    o, res = flashx.attention_forward(q, k, v, causal=causal, backend="cupy")

    def backward(ref: bool):
        state["ref"], state["events"] = ref, {}
        grads = flashx.attention_backward(do, q, k, v, o, res, causal=causal, backend="cupy")
        torch.cuda.synchronize()
        return grads, {kernel: sum(cupy.cuda.get_elapsed_time(start, end) for start, end in events)
                       for kernel, events in state["events"].items()}

    label = f"{args.dtype} B={args.batch} N={args.seqlen} H={args.heads}/{kv_heads} d{dim}{' causal' if causal else ''}"
    grads, _ = backward(False)
    if "dq_sm90" not in state["events"]:  # the fused dQ, which the ref's kernel may lack: timed alone
        ms = statistics.median(backward(False)[1]["dkdv_sm90"] for _ in range(args.repeats))
        flops = 5 * 2 * args.batch * args.heads * args.seqlen ** 2 * dim / (2 if causal else 1)
        print(f"{label} dkdv_sm90 adding dQ: this tree {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s of five products; "
              f"--no-fused-dq compares the two kernels with {args.ref}'s)", flush=True)
        return
    grads_ref, _ = backward(True)
    same = all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    times = {False: [], True: []}
    for _ in range(args.repeats):
        for ref in (False, True):
            times[ref].append(backward(ref)[1])
    for kernel, products in PRODUCTS.items():
        ms = statistics.median(sample[kernel] for sample in times[False])
        ms_ref = statistics.median(sample[kernel] for sample in times[True])
        # products of 2 N^2 d flops per query head, about half of them with causal
        flops = products * 2 * args.batch * args.heads * args.seqlen ** 2 * dim / (2 if causal else 1)
        print(f"{label} {kernel}: this tree {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), {args.ref} {ms_ref:.3f} ms "
              f"({flops / ms_ref / 1e9:.0f} TFLOP/s), ratio {ms_ref / ms:.3f}", flush=True)
    print(f"{label}: dQ, dK and dV {'bitwise equal' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
