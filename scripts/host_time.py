"""Host time of flashx's short causal steps, launched through Triton's runner or directly
(``flashx_triton.launcher``), and the steps' do_bench times, on a GPU:

    python scripts/host_time.py [--n 512,1024] [--d 64,128] [--rounds 5] [--json PATH]

bf16, causal, B*N = 16384, H*D = 2048 as in the sweep, autotuned. Host µs: wall time per call over
20 calls queued behind ``torch.cuda._sleep``, so that no call waits on the GPU; median of the
rounds. Step µs: ``do_bench`` medians of ``attention(...).backward(do)``, L2 flushed, after 1 s of
idle GPU. The two ways alternate round by round, each on a Problem of its own (launches are cached
per Problem), with the configurations the first one's tuning chose. Prints a table; ``--json PATH``
writes every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from triton.testing import do_bench

import flashx
import flashx.plan
from flashx_triton import launcher

DIRECT = launcher.direct
WAYS = {"runner": launcher.through_runner, "direct": DIRECT}


def host_us(call, calls: int = 20) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU: every call below only queues
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", default="512,1024")
    parser.add_argument("--d", default="64,128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for d in map(int, args.d.split(",")):
        for n in map(int, args.n.split(",")):
            b, h = 16384 // n, 2048 // d
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            detached = [x.detach() for x in leaves]

            def step():
                flashx.attention(*leaves, causal=True, backend="triton").backward(do)
                for x in leaves:
                    x.grad = None

            def forward():
                flashx.attention(*detached, causal=True, backend="triton")

            results = {way: {"step_host_us": [], "forward_host_us": [], "step_us": []} for way in WAYS}
            for _ in range(args.rounds):
                for way, make in WAYS.items():
                    launcher.direct = make
                    flashx.plan._plans.clear()  # a new Problem: launches built afresh, this way
                    step(), forward()  # compiled (and, the first time, tuned) before anything is timed
                    torch.cuda.synchronize()
                    results[way]["step_host_us"].append(host_us(step))
                    results[way]["forward_host_us"].append(host_us(forward))
                    time.sleep(1.0)
                    results[way]["step_us"].append(do_bench(step, warmup=25, rep=100, return_mode="median") * 1e3)
            launcher.direct = DIRECT
            for way, measured in results.items():
                row = dict(d=d, n=n, way=way, **{k: statistics.median(v) for k, v in measured.items()}, rounds=measured)
                rows.append(row)
                print(f"d{d} N={n} {way:6s} step host {row['step_host_us']:7.1f} µs  forward host "
                      f"{row['forward_host_us']:6.1f} µs  step {row['step_us']:7.1f} µs  "
                      f"(step rounds {' '.join(f'{x:.0f}' for x in measured['step_us'])})", flush=True)
    print("\n| point | way | step host µs | forward host µs | step µs (do_bench) |\n| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| d{row['d']} N={row['n']} | {row['way']} | {row['step_host_us']:.0f} | {row['forward_host_us']:.0f} | "
              f"{row['step_us']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
