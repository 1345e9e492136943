"""Host time of a call, per kind of call: what flashx's Python costs around the kernels.

At a tiny shape (B=1, N=128, H=1, d64, bf16, causal) a call's kernels take microseconds, so back
to back calls are bound by the host: the wall time of a round of calls, divided by the calls, is
the host time of one. Calls with lengths (seqlens, cu_seqlens) or a mask read those on the host
as the contract says, which synchronizes: their rounds include that wait, as a user's loop would;
with validate=False they read nothing. Public API only, so that the same script times any version
of flashx (a kind whose keywords a version lacks is left out).

    python scripts/host_time.py [--backends triton cupy] [--out host_time.json]

Prints a table of median microseconds per call (forward, and forward+backward), and each kind's
ratio to the plain call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import flashx

CALLS = 50


def kinds(q):
    """Each kind of call: its keywords (arrays built once, as a loop reuses them)."""
    n, device = q.shape[1], q.device
    return {
        "plain": {},
        "mask": {"mask": torch.rand(1, 1, n, n, device=device) < 0.9},
        "varlen": {"cu_seqlens_q": torch.tensor([0, n // 2, n], device=device, dtype=torch.int32),
                   "cu_seqlens_k": torch.tensor([0, n // 2, n], device=device, dtype=torch.int32)},
        "seqlens": {"seqlens_k": torch.tensor([n - 28], device=device, dtype=torch.int32)},
        "dropout (drawn seed)": {"dropout_p": 0.1},
        # the caller's promise (validate=False): nothing read on the host, no wait for the GPU
        "varlen, validate=False": {"cu_seqlens_q": torch.tensor([0, n // 2, n], device=device, dtype=torch.int32),
                                   "cu_seqlens_k": torch.tensor([0, n // 2, n], device=device, dtype=torch.int32),
                                   "max_seqlen_q": n // 2, "max_seqlen_k": n // 2, "validate": False},
        "seqlens, validate=False": {"seqlens_k": torch.tensor([n - 28], device=device, dtype=torch.int32),
                                    "validate": False},
    }


def per_call_us(call, rounds: int) -> float:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(times)


def measure(backend: str, rounds: int) -> dict:
    generator = torch.Generator("cuda").manual_seed(0)

    def tensor(*shape, grad=False):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16, requires_grad=grad)

    results = {}
    for grad in (False, True):
        q, k, v = (tensor(1, 128, 1, 64, grad=grad) for _ in range(3))
        do = tensor(1, 128, 1, 64)
        for name, options in kinds(q).items():
            if name.startswith("varlen"):
                q_, k_, v_ = (x.detach()[0].requires_grad_(grad) for x in (q, k, v))
                do_ = do[0]
            else:
                q_, k_, v_, do_ = q, k, v, do

            def call():
                o = flashx.attention(q_, k_, v_, causal=True, backend=backend, **options)
                if grad:
                    o.backward(do_)

            try:
                results[f"{'fwd+bwd' if grad else 'fwd'} {name}"] = per_call_us(call, rounds)
            except TypeError as error:  # a version of flashx without one of this kind's keywords
                print(f"  {backend} {name}: not timed ({error})"[:160])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["triton", "cupy"])
    parser.add_argument("--rounds", type=int, default=9, help="rounds of %d calls; the median is shown" % CALLS)
    parser.add_argument("--out")
    args = parser.parse_args()
    table = {backend: measure(backend, args.rounds) for backend in args.backends}
    device = torch.cuda.get_device_name()
    print(f"host us per call, {device}, flashx at {flashx.__file__}")
    for backend, results in table.items():
        plain = {mode: results[f"{mode} plain"] for mode in ("fwd", "fwd+bwd")}
        for key, us in results.items():
            mode = key.split()[0]
            print(f"  {backend:<7} {key:<30} {us:8.1f} us  {us / plain[mode]:5.2f}x plain")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "results": table}, f, indent=1)


if __name__ == "__main__":
    main()
