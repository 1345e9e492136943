"""Registers and spills of the Triton kernels on the H100, without a GPU.

Compiles flashx's kernels for sm_90a with a fake driver (no launch) and prints what ptxas
reports for each: registers per thread, bytes of spill stores, shared memory. Use the GPU's
Triton version, installed apart (the machines lent here run 3.6):

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36:backends python scripts/sm90_registers.py all d=128 causal=1
    PYTHONPATH=/tmp/triton36:backends python scripts/sm90_registers.py fwd d=64 causal=1 fwd=128,64,4,3

Options: ``fwd`` or ``all`` (with the backward), then d=, dv=, n=, causal=0/1, and a config per
kernel as block_m,block_n,warps,stages[,host_descriptors] (fwd=, dkdv=, dq=; default: the first
candidate; the backward runs as two launches, and fused= adds its one launch under that config).
TTGIR=folder also writes each kernel's TTGIR there; SPILLS=1 also counts the spill stores and
loads by the source line they belong to. Each kernel line ends with a digest of its machine code.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # compile afresh: the cache would skip ptxas's report

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver, jit  # noqa: E402


class _CompileOnlyDriver:
    """What JITFunction.run asks of a driver before it launches, for an H100."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def main(argv: list[str]) -> None:
    driver.set_active(_CompileOnlyDriver())
    compiled = []
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, {**dict(zip(self.arg_names, args)), **kwargs}, kernel))
        # None: flashx_triton's Launch then keeps going through this function, never launching

    jit.JITFunction.run = compile_only

    from flashx.problem import Problem
    from flashx_triton import backward, forward, tuning

    opts = dict(a.split("=") for a in argv[1:])
    d = int(opts.get("d", 128))
    dv = int(opts.get("dv", d))
    n, heads, batch = int(opts.get("n", 1024)), 2048 // d, 2
    chosen = {k: tuning.Config(*map(int, opts[k].split(","))) for k in ("fwd", "dkdv", "dq") if k in opts}
    tuning.choose = lambda kernel, problem, _: (chosen.get("fwd" if kernel == "forward" else kernel)
                                                or tuning.candidates(kernel, problem)[0])
    q, k, v, do = (torch.randn(batch, n, heads, x, dtype=torch.bfloat16) for x in (d, d, dv, dv))
    problem = Problem(array_kind="torch", device="cuda", device_index=0, dtype="bfloat16", batch=batch, seqlen_q=n,
                      seqlen_k=n, total_q=None, total_k=None, heads_q=heads, heads_k=heads, head_dim=d, head_dim_v=dv,
                      softmax_scale=d**-0.5, causal=opts.get("causal") == "1")
    o, lse = forward.forward(problem, q, k, v)
    if argv[0] == "all":
        backward.backward(problem, q, k, v, o, lse, do)
        if "fused" in opts:
            fused = tuning.Config(*map(int, opts["fused"].split(",")))
            dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
            lse2 = delta = torch.empty_like(lse)
            backward._gradients_launch(problem, fused, q, k, v, do, dq, dk, dv, lse2, delta, part="fused")(
                q, k, v, do, dq, dk, dv, lse2, delta)

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    for name, kw, kernel in compiled:
        if name == "_prepare_kernel":
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(kernel.asm["ptx"])
            ptx.flush()
            report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx.name, "-o", "/dev/null"],
                                    capture_output=True, text=True).stderr
        registers = re.search(r"Used (\d+) registers", report)
        spill = re.search(r"(\d+) bytes spill stores", report)
        band = ",".join(f"{f}={kw[f]:03b}" for f in ("PARTS", "KEY_PARTS", "QUERY_PARTS") if f in kw)
        flags = ",".join([band] + [f for f in ("USE_TMA", "HOST_DESCRIPTORS") if kw.get(f)])
        parts = "+".join(part for part, on in (("dkdv", kw.get("KEY_PROGRAMS")), ("dq", kw.get("QUERY_PROGRAMS")))
                         if on)
        tiles = (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}" if "BLOCK_M" in kw
                 else f"tile {kw['TILE']} stream {kw['STREAM']} {parts}")
        exact = "exact" if kw.get("EXACT") else "plain"
        print(f"{name:16s} {tiles} w{kw['num_warps']} s{kw['num_stages']} [{flags}] {exact} "
              f"warps {kernel.metadata.num_warps}, registers {registers and registers.group(1)}, "
              f"spill stores {spill and spill.group(1)} B, "
              f"shared {kernel.metadata.shared} B, SASS {sass_digest(kernel.asm['cubin'])}")
        if "SPILLS" in opts:
            print(spills_by_line(kernel.asm["cubin"]))
        if "TTGIR" in opts:
            with open(os.path.join(opts["TTGIR"], f"{name}-{band.replace('=', '')}-{exact}.ttgir"), "w") as f:
                f.write(kernel.asm["ttgir"])


def disassemble(cubin: bytes, *options: str) -> str:
    """The SASS of a cubin, by the nvdisasm that Triton ships."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, *options, "-c", f.name], capture_output=True, text=True, check=True).stdout


def sass_digest(cubin: bytes) -> str:
    """A short hash of the machine code without its line table: equal digests, the same kernel
    (a source change that should not alter the compiled code is checked this way)."""
    sass = disassemble(cubin)
    return hashlib.sha256(re.sub(r"/\*[0-9a-f]+\*/", "", sass).encode()).hexdigest()[:12]


def spills_by_line(cubin: bytes) -> str:
    """Where ptxas put its spill stores and loads (STL/LDL): counts by the source line that the
    line table gives the instruction, so that a spill in a rare branch can be told apart from one
    in the hot loop."""
    sass = disassemble(cubin, "-g")
    where, counts = "?", {}
    for line in sass.splitlines():
        source = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if source:
            where = f"{os.path.basename(source.group(1))}:{source.group(2)}"
        elif re.search(r"\b(STL|LDL)\b", line):
            op = "STL" if "STL" in line else "LDL"
            counts[(where, op)] = counts.get((where, op), 0) + 1
    return "\n".join(f"    {n:4d} {op} at {where}" for (where, op), n in sorted(counts.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
