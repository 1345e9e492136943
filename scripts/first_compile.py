"""How long a new shape's first fwd+bwd waits on Triton's compiler, measured for sm_90 on a host
without a GPU (B=2, N=6000, H=16, d=128, bf16, shipped choices; causal and full).

    PYTHONPATH=<triton>:... python3 scripts/first_compile.py [--eager] [OUT.json]

The kernels go through the lowering tests' stand-in driver (tests/test_lowering_sm90.py): they
compile down to ptxas and nothing runs. A plain launch leaves its flags clear, as on clean data,
so an exact launch is compiled when ``launch.ExactLaunch`` would compile it. Per shape, in fresh
processes:

  cold    a new TRITON_CACHE_DIR: the first call (forward, then backward), then the wait until
          the compiles sent to another process have ended, then a second call
  warm    a new process on that cache: its first call

``--eager`` compiles every exact kernel in the call, as under CUDA graph capture (and as every
first call did before exact kernels were compiled elsewhere). "here" counts the kernels compiled
in the calling process (a load from Triton's cache is not one).
"""

import json
import os
import sys
import tempfile
import time

from first_call import child_row  # this script's folder: sys.path's first entry

B, N, H, D = 2, 6000, 16, 128


def child(causal: bool, eager: bool) -> None:
    import torch
    from triton.compiler import compiler
    from triton.runtime import driver

    from flashx.validation import build_problem
    from flashx_triton import TritonBackend, background, launch, tuning
    from tests.test_lowering_sm90 import Sm90Driver

    driver.set_active(Sm90Driver())
    compiled_here = []
    make_ir = compiler.ASTSource.make_ir

    def counted(self, *args, **kwargs):  # a cache hit never builds the IR
        compiled_here.append(self.name)
        return make_ir(self, *args, **kwargs)

    def compile_only(self, *tensors):
        self.kernel.warmup(*tensors, *self.bound, grid=self.grid, **self.options)
        values = dict(zip(self.kernel.arg_names, (*tensors, *self.bound)))
        if not values.get("EXACT", False) and isinstance(values.get("REDO"), torch.Tensor):
            values["REDO"].zero_()  # what a plain launch leaves on clean data

    def shipped_choice(kernel, problem, run):
        options = tuning.candidates(kernel, problem)
        choice = tuning.untimed_order(kernel, problem, options, "sm_90", lambda: 227 * 1024)[0]
        run(choice)
        return choice

    compiler.ASTSource.make_ir = counted
    launch.Launch.__call__ = compile_only
    tuning.choose = shipped_choice
    if eager:
        launch.capturing = lambda device: True

    generator = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, N, H, D, generator=generator).to(torch.bfloat16) for _ in range(4))
    backend = TritonBackend()

    def call() -> tuple[float, int]:
        compiled_here.clear()
        start = time.perf_counter()
        problem = build_problem(q, k, v, causal=causal)
        o, lse = backend.forward(problem, q, k, v)
        backend.backward(problem, q, k, v, o, lse, do)
        return time.perf_counter() - start, len(compiled_here)

    first_s, first_here = call()
    start = time.perf_counter()
    background.wait_for_all()
    row = dict(first_s=first_s, first_here=first_here, elsewhere_s=time.perf_counter() - start)
    row["second_s"], row["second_here"] = call()
    print(json.dumps(row))


def main() -> None:
    eager = "--eager" in sys.argv
    out = next((arg for arg in sys.argv[1:] if not arg.startswith("--")), None)
    root = tempfile.mkdtemp(prefix="first-compile-")
    rows = []
    for causal in (True, False):
        cache = os.path.join(root, f"triton-{'causal' if causal else 'full'}")
        for case in ("cold", "warm"):
            command = [sys.executable, __file__, "--case", str(int(causal)), str(int(eager))]
            found = child_row(command, dict(os.environ, TRITON_CACHE_DIR=cache), case)
            if found is None:
                continue
            row = {"shape": "causal" if causal else "full", "case": case, "eager": eager, **found}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\nB={B} N={N} H={H} d={D} bf16 fwd+bwd, sm_90 target{', exact kernels eager' if eager else ''}")
    print(f"{'shape':<7} {'case':<5} {'first s':>8} {'here':>5} {'elsewhere s':>11} {'second s':>9} {'here':>5}")
    for row in rows:
        print(f"{row['shape']:<7} {row['case']:<5} {row['first_s']:>8.2f} {row['first_here']:>5} "
              f"{row['elsewhere_s']:>11.2f} {row['second_s']:>9.2f} {row['second_here']:>5}")
    if out:
        with open(out, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        child(sys.argv[2] == "1", sys.argv[3] == "1")
    else:
        main()
