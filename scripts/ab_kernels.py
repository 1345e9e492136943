"""A/B two versions of a Triton backend module in one process on the GPU:

    python scripts/ab_kernels.py forward|backward BASE.py VARIANT.py [causal=1] [n=1k,2k,...] [d=64,128]

Each file is a whole ``flashx_triton/forward.py`` or ``backward.py`` (say ``git show main:backends/
flashx_triton/forward.py > .gpu/base.py``), loaded as a module of its own beside the installed
backend's common.py. Each version times its own Problem (the launch caches are per Problem), with
the first candidate configuration (FLASHX_TRITON_AUTOTUNE=0), by ``do_bench`` medians, bf16,
B*N = 16384 and H*D = 2048 as in the sweep (``device=cpu`` under TRITON_INTERPRET=1 checks the
script itself: tiny shapes, wall-clock times). The backward is timed alone, from the installed
forward's o and lse. Then the two versions must agree: bitwise on random inputs, and with a NaN
and an inf planted in V (forward) or in K and Q (backward), with NaN in the same rows.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

os.environ["FLASHX_TRITON_AUTOTUNE"] = "0"

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from flashx.validation import build_problem  # noqa: E402
from flashx_triton import forward as installed_forward  # noqa: E402


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"flashx_triton.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plant(x: torch.Tensor, row: int) -> torch.Tensor:
    x = x.clone()
    x[0, row, 0, 5], x[0, row + 7, 0, 7] = float("nan"), float("inf")
    return x


def outputs(module, kernel: str, causal: bool, q, k, v, do):
    """A call of ``kernel`` (forward: o; backward: dq, dk, dv) on its own Problem, and the call itself."""
    problem = build_problem(q, k, v, causal=causal)
    if kernel == "forward":
        return lambda: module.forward(problem, q, k, v)[:1]
    o, lse = installed_forward.forward(build_problem(q, k, v, causal=causal), q, k, v)
    return lambda: module.backward(problem, q, k, v, o, lse, do)


def median_ms(call, device: str) -> float:
    if device == "cuda":
        return do_bench(call, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str]) -> None:
    kernel = argv[0]
    versions = {"base": load(argv[1], f"{kernel}_base"), "variant": load(argv[2], f"{kernel}_variant")}
    opts = dict(a.split("=") for a in argv[3:])
    causal, device = opts.get("causal", "1") == "1", opts.get("device", "cuda")
    tokens, model = (16384, 2048) if device == "cuda" else (128, 64)
    for d in map(int, opts.get("d", "64,128").split(",")):
        for n in (int(x.replace("k", "")) * (1024 if "k" in x else 1) for x in opts.get("n", "1k,2k,4k,8k").split(",")):
            batch, heads = tokens // n, model // d
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(batch, n, heads, d, device=device, dtype=torch.bfloat16) for _ in range(4))
            if kernel == "forward":
                poisoned = (q, k, plant(v, n // 2), do)
            else:
                poisoned = (plant(q, n // 3), plant(k, n // 2), v, do)
            flops = 4 * batch * heads * n * n * d / (2 if causal else 1) * (1 if kernel == "forward" else 2.5)
            line, results = [f"{kernel} d{d} {'causal ' if causal else ''}N={n}:"], {}
            for name, module in versions.items():
                call = outputs(module, kernel, causal, q, k, v, do)
                results[name] = (call(), outputs(module, kernel, causal, *poisoned)())
                ms = median_ms(call, device)
                line.append(f"{name} {ms * 1e3:.0f} us {flops / ms / 1e9:.0f} TFLOP/s")
            (clean_base, nan_base), (clean_variant, nan_variant) = results["base"], results["variant"]
            equal = all(torch.equal(a, b) for a, b in zip(clean_base, clean_variant))
            alike = all(torch.equal(a.isnan().any(-1), b.isnan().any(-1)) for a, b in zip(nan_base, nan_variant))
            line.append(f"equal {equal}, NaN rows alike {alike}")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
