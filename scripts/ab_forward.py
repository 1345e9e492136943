"""A/B two versions of the Triton forward in one process on the GPU: ``python scripts/ab_forward.py
BASE.py VARIANT.py [causal=1] [n=1024,2048,4096,8192] [d=64,128]``.

Each file is a whole ``flashx_triton/forward.py`` (say ``git show main:backends/flashx_triton/
forward.py > /tmp/base.py``), loaded as a module of its own beside the installed backend's
common.py. Each version times its own Problem (the launch caches are per Problem), with the
first candidate configuration (FLASHX_TRITON_AUTOTUNE=0), by ``do_bench`` medians, bf16,
B*N = 16384 and H*D = 2048 as in the sweep. Then it checks that the two agree: bitwise on
random inputs, and with a NaN and an inf planted in V, NaN in the same rows.
"""

from __future__ import annotations

import importlib.util
import os
import sys

os.environ["FLASHX_TRITON_AUTOTUNE"] = "0"

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from flashx.validation import build_problem  # noqa: E402


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"flashx_triton.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> None:
    versions = {"base": load(argv[0], "forward_base"), "variant": load(argv[1], "forward_variant")}
    opts = dict(a.split("=") for a in argv[2:])
    causal = opts.get("causal", "1") == "1"
    for d in map(int, opts.get("d", "64,128").split(",")):
        for n in map(int, opts.get("n", "1024,2048,4096,8192").split(",")):
            batch, heads = 16384 // n, 2048 // d
            torch.manual_seed(0)
            q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            poisoned = v.clone()
            poisoned[0, n // 2 + 3, 0, 5], poisoned[0, n // 2 + 40, 0, 7] = float("nan"), float("inf")
            flops = 4 * batch * heads * n * n * d / (2 if causal else 1)
            line, outputs = [f"d{d} {'causal ' if causal else ''}N={n}:"], {}
            for name, module in versions.items():
                problem = build_problem(q, k, v, causal=causal)
                outputs[name] = (module.forward(problem, q, k, v)[0],
                                 module.forward(build_problem(q, k, poisoned, causal=causal), q, k, poisoned)[0])
                ms = do_bench(lambda: module.forward(problem, q, k, v), warmup=25, rep=100, return_mode="median")
                line.append(f"{name} {ms * 1e3:.0f} us {flops / ms / 1e9:.0f} TFLOP/s")
            (o_base, nan_base), (o_variant, nan_variant) = outputs["base"], outputs["variant"]
            line.append(f"equal {torch.equal(o_base, o_variant)}, "
                        f"NaN rows alike {torch.equal(nan_base.isnan().any(-1), nan_variant.isnan().any(-1))}")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
