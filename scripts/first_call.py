"""Time to the first result of a new shape, fwd+bwd (B=2, N=6000, H=16, d=128, bf16, causal):
flashx's backends and FlexAttention, each case in a fresh process, side by side in one run.

    python3 scripts/first_call.py [OUT.json]   # the driver: every case below, then a table
    python3 scripts/first_call.py --case CASE  # one case, printed as one JSON line (the driver's child)

Cases, in this order (each directory is fresh unless reused as named):
  triton cold           new TRITON_CACHE_DIR and FLASHX_CACHE_DIR: the shipped choices, compiled
  triton warm           the same two directories again: Triton's cache warm
  triton tuned cold     FLASHX_TRITON_AUTOTUNE=1, new directories: every candidate compiled and timed
                        (only with FIRST_CALL_TUNED=1)
  cupy cold, warm       new CUPY_CACHE_DIR (NVRTC's builds), then the same one again
  numba cold, warm      new FLASHX_CACHE_DIR (its numba-kernels folder), then the same one again
  flex cold             new TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR: torch.compile from scratch
  flex warm             the same two directories again
FIRST_CALL_BACKENDS (default "triton") names the flashx backends to run, comma-separated.
The first call is timed from the inputs on the GPU (CUDA context made, autograd's own first
backward done) to the gradients there;
"kernels" counts the kernels a triton case found compiled in its Triton cache afterwards.
FIRST_CALL_SMOKE=1 runs the flashx cases on a tiny float32 shape under TRITON_INTERPRET=1 (CPU).
FIRST_CALL_PROFILE=DIR profiles each case's first call (cProfile) into DIR/<case>.prof and prints
its 15 costliest functions by cumulative time (where a warm cache's first call goes).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

SMOKE = os.environ.get("FIRST_CALL_SMOKE") == "1"
B, N, H, D = (1, 64, 2, 16) if SMOKE else (2, 6000, 16, 128)


def child(case: str) -> None:
    import torch

    device, dtype = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)
    generator = torch.Generator(device).manual_seed(0)
    q, k, v, do = (torch.randn(B, N, H, D, generator=generator, device=device, dtype=dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    if case != "flex":
        import flashx

        def step():
            return flashx.attention(q, k, v, causal=True, backend=case)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)

        def step():
            mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, N, N, device=device)
            return compiled(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=mask).transpose(1, 2)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    # Autograd's first backward given an explicit gradient, as backward(do) below, imports sympy
    # (torch.fx.experimental.symbolic_shapes, 1.5-2 s from source where no bytecode is cached): a
    # cost of this harness that a training loop's loss.backward() does not pay, and one that flex's
    # torch.compile pays before its timed step. Every case pays it here, untimed.
    warm = torch.ones(2, device=device, requires_grad=True)
    (2 * warm).backward(torch.ones_like(warm))

    def timed_step() -> float:
        for x in (q, k, v):
            x.grad = None
        sync()
        start = time.perf_counter()
        step().backward(do)
        sync()
        return time.perf_counter() - start

    profile = os.environ.get("FIRST_CALL_PROFILE")
    if profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        seconds = [profiler.runcall(timed_step)]
        os.makedirs(profile, exist_ok=True)
        profiler.dump_stats(os.path.join(profile, f"{os.environ['FIRST_CALL_LABEL'].replace(' ', '-')}.prof"))
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(15)
    else:
        seconds = [timed_step()]
    seconds += [timed_step() for _ in range(2)]
    o = step()
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    want.backward(do.transpose(1, 2))
    errors = [(o.detach() - want.detach().transpose(1, 2)).abs().max().item()]
    errors += [(x.grad - y.grad.transpose(1, 2)).abs().max().item() for x, y in ((q, qt), (k, kt), (v, vt))]
    row = {"first_s": seconds[0], "later_ms": min(seconds[1:]) * 1e3, "max_err_vs_sdpa": max(errors)}
    if case == "triton":
        from pathlib import Path

        row["kernels"] = len(list(Path(os.environ["TRITON_CACHE_DIR"]).glob("*/*.cubin")))
    print(json.dumps(row))


def child_row(command: list[str], env: dict, label: str) -> dict | None:
    """The last line a child case printed, read as JSON; None, its error printed, where it failed.
    A profiled child's profile (on its stderr) is printed too."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        print(f"{label}: failed\n{done.stderr[-3000:]}", flush=True)
        return None
    if env.get("FIRST_CALL_PROFILE"):
        print(f"{label}, first call:\n{done.stderr[-4000:]}", flush=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    root = tempfile.mkdtemp(prefix="first-call-")
    fresh = iter(range(100))

    def new(name):
        return os.path.join(root, f"{name}-{next(fresh)}")

    caches = {"triton": ("TRITON_CACHE_DIR", "FLASHX_CACHE_DIR"), "cupy": ("CUPY_CACHE_DIR",),
              "numba": ("FLASHX_CACHE_DIR",)}
    flex_dirs = {"TRITON_CACHE_DIR": new("triton"), "TORCHINDUCTOR_CACHE_DIR": new("inductor")}
    tuned_dirs = {"TRITON_CACHE_DIR": new("triton"), "FLASHX_CACHE_DIR": new("flashx"), "FLASHX_TRITON_AUTOTUNE": "1"}
    cases = []
    backends = os.environ.get("FIRST_CALL_BACKENDS", "triton").split(",")
    unknown = sorted(set(backends) - set(caches))
    if unknown:
        sys.exit(f"FIRST_CALL_BACKENDS names flashx backends ({', '.join(caches)}), not {', '.join(unknown)}: "
                 "FlexAttention runs in every full run")
    for backend in backends:
        dirs = {name: new(name.lower()) for name in caches[backend]}
        cases += [(f"{backend} cold", backend, dirs), (f"{backend} warm", backend, dirs)]
    if os.environ.get("FIRST_CALL_TUNED") == "1":
        cases.append(("triton tuned cold", "triton", tuned_dirs))
    if not SMOKE:
        cases += [("flex cold", "flex", flex_dirs), ("flex warm", "flex", flex_dirs)]
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if SMOKE else {}))
    env.pop("FLASHX_TRITON_AUTOTUNE", None)
    rows = []
    for label, case, dirs in cases:
        started = time.perf_counter()
        found = child_row([sys.executable, __file__, "--case", case], {**env, **dirs, "FIRST_CALL_LABEL": label},
                          label)
        if found is None:
            continue
        row = {"case": label, **found, "process_s": time.perf_counter() - started}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\nB={B} N={N} H={H} d={D} {'float32 (smoke, CPU)' if SMOKE else 'bf16'} causal, fwd+bwd")
    print(f"{'case':<18} {'first call s':>12} {'later ms':>9} {'process s':>9} {'kernels':>7} {'err vs SDPA':>11}")
    for row in rows:
        print(f"{row['case']:<18} {row['first_s']:>12.2f} {row['later_ms']:>9.2f} {row['process_s']:>9.1f} "
              f"{row.get('kernels', ''):>7} {row['max_err_vs_sdpa']:>11.2e}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    child(sys.argv[2]) if sys.argv[1:2] == ["--case"] else main()
