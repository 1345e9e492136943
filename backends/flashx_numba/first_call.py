"""Time to the first fwd+bwd of a process with the Numba backend, its kernel cache cold, then warm
(B=2, N=1024, H=16, d=128, bfloat16, causal; needs a CUDA GPU):

    python -m flashx_numba.first_call [--budget SECONDS]   # the driver: every case, then a table
    python -m flashx_numba.first_call --case CASE           # one case, printed as one JSON line

Each case runs in a fresh process with FLASHX_CACHE_DIR set to one new directory: ``cold``
compiles every kernel and keeps it there, ``warm`` loads them, and ``sdpa`` runs torch's own
attention instead: the part of a first call that is no backend's (CUDA libraries loaded, the
modules autograd imports on its first backward). A first call is timed from the inputs on the
GPU (the CUDA context made, flashx imported, the backend's modules not) to the gradients there.
The driver exits with status 1 if the warm first call takes ``--budget`` seconds (default 1) or
more, or if a warm kernel was compiled rather than loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

B, N, H, D = 2, 1024, 16, 128
CASES = ("cold", "warm", "sdpa")


def case(label: str) -> dict:
    """The first and later calls of one process, and, with the Numba backend, the error against
    SDPA and the kernels' disk-cache hits and misses."""
    import torch

    import flashx

    generator = torch.Generator("cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, N, H, D, generator=generator, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                                is_causal=True).transpose(1, 2)

    def numba(q, k, v):
        return flashx.attention(q, k, v, causal=True, backend="numba")

    step = sdpa if label == "sdpa" else numba
    seconds = []
    for _ in range(3):
        for x in (q, k, v):
            x.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        o = step(q, k, v)
        o.backward(do)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    row = {"first_s": seconds[0], "later_ms": min(seconds[1:]) * 1e3}
    if step is numba:
        got = [o.detach(), *(x.grad for x in (q, k, v))]
        for x in (q, k, v):
            x.grad = None
        want = sdpa(q, k, v)
        want.backward(do)
        stats = [kernel.stats for kernel in _kernels()]
        row.update(cache_hits=sum(sum(s.cache_hits.values()) for s in stats),
                   cache_misses=sum(sum(s.cache_misses.values()) for s in stats),
                   max_err_vs_sdpa=max((a - b).abs().max().item()
                                       for a, b in zip(got, [want.detach(), *(x.grad for x in (q, k, v))])))
    return row


def _kernels():
    """The four kernels the timed call launched (the factories return the ones they built)."""
    from flashx_numba import attention, kernels

    problem = SimpleNamespace(head_dim=D, head_dim_v=D, head_dim_class=D, dtype="bfloat16")
    forward = attention.tiles("forward", problem), "bfloat16", attention.tensor_cores("forward", problem), False
    backward = attention.tiles("backward", problem), "bfloat16", attention.tensor_cores("backward", problem), False
    return (kernels.forward_kernel(*forward), kernels.delta_kernel("bfloat16"), kernels.dkdv_kernel(*backward),
            kernels.dq_kernel(*backward, False))


def main(budget: float) -> int:
    cache = tempfile.mkdtemp(prefix="flashx-numba-first-call-")
    environment = dict(os.environ, FLASHX_CACHE_DIR=cache)
    rows = []
    for label in CASES:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "flashx_numba.first_call", "--case", label], env=environment,
                              capture_output=True, text=True)
        if done.returncode:
            print(f"{label}: failed\n{done.stderr[-3000:]}", flush=True)
            return 1
        row = {"case": label, **json.loads(done.stdout.splitlines()[-1]), "process_s": time.perf_counter() - started}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\nB={B} N={N} H={H} d={D} bf16 causal, fwd+bwd, numba kernels cached in {cache}")
    print(f"{'case':<6} {'first call s':>12} {'later ms':>9} {'process s':>9} {'hits':>5} {'misses':>6} "
          f"{'err vs SDPA':>11}")
    for row in rows:
        print(f"{row['case']:<6} {row['first_s']:>12.2f} {row['later_ms']:>9.2f} {row['process_s']:>9.1f} "
              f"{row.get('cache_hits', ''):>5} {row.get('cache_misses', ''):>6} "
              f"{row.get('max_err_vs_sdpa', float('nan')):>11.2e}")
    warm = rows[CASES.index("warm")]
    passed = warm["first_s"] < budget and warm["cache_misses"] == 0
    print(f"\nwarm first call {warm['first_s']:.2f} s with {warm['cache_hits']} kernels loaded and "
          f"{warm['cache_misses']} compiled: {'within' if passed else 'NOT within'} {budget:g} s")
    return 0 if passed else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, help="run one case in this process (the driver's child)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds the warm first call must stay under")
    arguments = parser.parse_args()
    if arguments.case:
        print(json.dumps(case(arguments.case)))
    else:
        sys.exit(main(arguments.budget))
