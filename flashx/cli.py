"""The ``flashx`` command: ``flashx info`` and ``flashx demo``."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
import time

import flashx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashx", description="Exact FlashAttention, one contract, many kernels.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, devices, and every backend with its status")
    demo_parser = commands.add_parser("demo", help="a realistic causal GQA call on the best device here, checked")
    demo_parser.add_argument("--seqlen", type=int, default=None, help="sequence length (default: 4096 on CPU, 8192 on GPU)")
    demo_parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)
    return info() if args.command == "info" else demo(args.seqlen, args.device)


def info() -> int:
    print(f"flashx {flashx.__version__}  (python {platform.python_version()}, {platform.machine()})")
    for library in ("numpy", "pluggy", "torch", "triton", "cupy", "numba", "numba-cuda"):
        try:
            print(f"  {library:<11} {importlib.metadata.version(library)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    print("devices:")
    for device in _devices():
        print(f"  {device}")
    print("backends:")
    rows = flashx.backends()
    width = max((len(row.name) for row in rows), default=0)
    for row in rows:
        status = f"available on {', '.join(row.devices)}" if row.available else f"not available: {row.reason}"
        print(f"  {row.name:<{width}}  {row.version:<8} {status}  [{row.plugin}]")
    for row in rows:
        if row.load_error:
            print(f"\nplugin {row.plugin} failed to load:\n{row.load_error}")
    return 0


def _devices() -> list[str]:
    devices = [f"cpu: {platform.processor() or platform.machine()}"]
    try:
        import torch
    except ImportError:
        return devices
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(f"cuda:{index}: {props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}")
    return devices


def demo(seqlen: int | None, device: str) -> int:
    """Causal GQA (32 query heads over 8 kv heads on GPU, 8 over 2 on CPU) through backend="auto"."""
    import numpy as np

    use_cuda = device == "cuda" or (device == "auto" and _cuda_available())
    rng = np.random.default_rng(0)
    if use_cuda:
        import torch

        batch, heads_q, heads_k, dim, seqlen = 1, 32, 8, 128, seqlen or 8192
        dtype, tolerance = torch.bfloat16, 2e-2

        def make(heads, seed):
            return torch.randn(batch, seqlen, heads, dim, generator=torch.Generator("cuda").manual_seed(seed), device="cuda", dtype=dtype)

        q, k, v = make(heads_q, 1), make(heads_k, 2), make(heads_k, 3)
    else:
        batch, heads_q, heads_k, dim, seqlen = 1, 8, 2, 64, seqlen or 4096
        tolerance = 1e-4

        def make(heads, _seed):
            return rng.standard_normal((batch, seqlen, heads, dim), dtype=np.float32)

        q, k, v = make(heads_q, 1), make(heads_k, 2), make(heads_k, 3)

    chosen = flashx.explain(q, k, v, causal=True).chosen
    flashx.attention(q, k, v, causal=True)  # warm-up: kernel compilation, autotuning
    seconds, peak, (o, lse) = _measure(lambda: flashx.attention(q, k, v, causal=True, return_lse=True), use_cuda)
    error = _check_slice(q, k, v, o, lse, rows=64)

    naive = batch * heads_q * seqlen * seqlen * 4
    flops = 4.0 * batch * heads_q * seqlen * seqlen * dim / 2
    where = "cuda: " + _devices()[1] if use_cuda else "cpu"
    print(f"flashx demo: causal GQA attention, B={batch} N={seqlen} Hq={heads_q} Hk={heads_k} D={dim} {_dtype(q)} on {where}")
    print(f"  backend (auto)       {chosen}")
    rate = flops / seconds
    shown = f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"
    print(f"  time                 {seconds * 1e3:.2f} ms  ({shown}, one call, launch included)")
    print(f"  peak extra memory    {peak / 2**20:.1f} MiB  (the naive N x N float32 scores alone: {naive / 2**20:.0f} MiB)")
    print(f"  check vs float64     max |o - o_ref| = {error:.2e} over the last 64 query rows of the first and last head")
    if not error <= tolerance:
        print(f"  FAILED: error above {tolerance:g}", file=sys.stderr)
        return 1
    print("  OK")
    return 0


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _measure(call, use_cuda):
    if use_cuda:
        import torch

        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = call()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return seconds, torch.cuda.max_memory_allocated() - base, result
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak, result


def _check_slice(q, k, v, o, lse, rows):
    """Dense float64 attention for the last ``rows`` queries of the first and last head."""
    import numpy as np

    def host(x):
        return np.asarray(x.float().cpu() if hasattr(x, "cpu") else x, dtype=np.float64)

    q, k, v, o, lse = map(host, (q, k, v, o, lse))
    seqlen, heads_q, dim = q.shape[1], q.shape[2], q.shape[3]
    group = heads_q // k.shape[2]
    worst = 0.0
    for head in (0, heads_q - 1):
        queries = np.arange(seqlen - rows, seqlen)
        scores = q[0, queries, head] @ k[0, :, head // group].T / np.sqrt(dim)
        scores[np.arange(seqlen)[None, :] > queries[:, None]] = -np.inf
        ref_lse = np.logaddexp.reduce(scores, axis=1)
        ref_o = np.exp(scores - ref_lse[:, None]) @ v[0, :, head // group]
        worst = max(worst, np.abs(o[0, queries, head] - ref_o).max(), np.abs(lse[0, head, queries] - ref_lse).max())
    return worst


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("torch.")


if __name__ == "__main__":
    raise SystemExit(main())
