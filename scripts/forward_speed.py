"""The CuPy backend's forward speed in bfloat16 and FP8, for A/B runs of one tree per process.

    python scripts/forward_speed.py TAG [--warm]

B=2, N=8192, d128 with H=16 and d64 with H=32 (FP8: float8_e4m3fn casts of the same normal values,
descales of 1, o in bfloat16), causal or not; TFLOP/s as flash-attn counts the forward (4 B H N^2 D,
halved when causal), the median of ``triton.testing.do_bench``. Each line also prints the
sum of |o|, so that two trees whose kernels should agree bit for bit can be compared by eye;
``$OUT/forward-TAG.json`` keeps the rows. ``--warm`` makes one call of each case and times nothing:
run it for every tree side by side first, so that NVRTC's compiles stay out of the timed runs,
which then go one after another (`scripts/gpu_branches.sh run TREE ...`).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from triton.testing import do_bench

import flashx

CASES = [("float8_e4m3fn", 128, 16), ("float8_e4m3fn", 64, 32), ("bfloat16", 128, 16), ("bfloat16", 64, 32)]
BATCH, SEQLEN = 2, 8192


def main() -> None:
    tag, warm = sys.argv[1], "--warm" in sys.argv[2:]
    rows = []
    for dtype, head_dim, heads in CASES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(BATCH, SEQLEN, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q, k, v = (x.to(getattr(torch, dtype)) for x in (q, k, v))
        for causal in (False, True):
            def call():
                return flashx.attention(q, k, v, backend="cupy", causal=causal)

            if warm:
                call()
                continue
            flops = 4 * BATCH * heads * SEQLEN**2 * head_dim / (2 if causal else 1)
            tflops = flops / do_bench(call, return_mode="median") / 1e9
            total = float(call().float().abs().sum())
            rows.append(dict(tag=tag, dtype=dtype, head_dim=head_dim, heads=heads, causal=causal, tflops=tflops,
                             abs_sum=total))
            print(f"{tag:8} {dtype:13} d{head_dim} causal={int(causal)}: {tflops:6.0f} TFLOP/s  sum|o| {total:.8g}",
                  flush=True)
    if rows:
        with open(os.path.join(os.environ.get("OUT", "."), f"forward-{tag}.json"), "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
