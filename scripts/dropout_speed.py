"""Dropout's cost on a GPU: each backend's forward and fwd+bwd with dropout beside the same calls
without it, at the benchmark's shape (B=2, N=8192, H=16, bf16; d128 and d64, causal or not).

    python3 scripts/dropout_speed.py                       # cupy and triton, dropout 0.1 and none
    python3 scripts/dropout_speed.py --backend cupy --dim 128 --label after --json out.json

TFLOP/s as flash-attn counts them (forward 4 B H N^2 D, halved when causal; fwd+bwd 3.5x), each the
median of ``triton.testing.do_bench``. The inputs come from a fixed seed and each line ends
with the sum of |o|, so that two trees run one after the other (an A/B of a kernel change, each in
its own process) show whether they computed the same outputs. Calls with dropout run first: a
backend that keeps choices by shape meets the dropout call without one made for the plain call.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import flashx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", nargs="+", default=["cupy", "triton"])
    parser.add_argument("--dim", nargs="+", type=int, default=[128, 64])
    parser.add_argument("--dropout", nargs="+", type=float, default=[0.1, 0.0])
    parser.add_argument("--label", default="", help="a tag for each line (the tree timed)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    batch, seqlen, heads = 2, 8192, 16
    rows = []
    for backend in args.backend:
        for dim in args.dim:
            generator = torch.Generator("cuda").manual_seed(dim)
            q, k, v = (torch.randn(batch, seqlen, heads, dim, generator=generator, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            do = torch.randn(batch, seqlen, heads, dim, generator=generator, device="cuda", dtype=torch.bfloat16)
            for causal in (False, True):
                flops = 4 * batch * heads * seqlen * seqlen * dim / (2 if causal else 1)
                for p in args.dropout:
                    options = dict(causal=causal, dropout_p=p, seed=1234) if p else dict(causal=causal)
                    with torch.no_grad():
                        forward = do_bench(lambda: flashx.attention(q, k, v, backend=backend, **options),
                                           return_mode="median")
                    step = do_bench(lambda: flashx.attention(q, k, v, backend=backend, **options).backward(do),
                                    grad_to_none=[q, k, v], return_mode="median")
                    with torch.no_grad():
                        checksum = float(flashx.attention(q, k, v, backend=backend, **options).float().abs().sum())
                    rows.append(dict(label=args.label, backend=backend, dim=dim, causal=causal, dropout_p=p,
                                     fwd_tflops=flops / forward / 1e9, step_tflops=3.5 * flops / step / 1e9,
                                     checksum=checksum))
                    row = rows[-1]
                    print(f"{args.label:6} {backend:6} d{dim} causal={int(causal)} p={p}: fwd {row['fwd_tflops']:.0f} "
                          f"fwd+bwd {row['step_tflops']:.0f} TFLOP/s  sum|o| {checksum:.6g}", flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
