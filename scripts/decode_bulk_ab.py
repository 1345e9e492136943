"""CuPy's decoder with its K and V rows copied in bulk (``variants.decode_bulk``: 1-D bulk copies on
mbarriers, the default on compute capability 9.0) against the same kernel with each thread's
16-byte cp.async (``FLASHX_CUPY_DECODE_BULK=0``), and Triton's decoder beside, on a GPU of compute
capability 9.0 (an H200 or H100).

    python3 scripts/decode_bulk_ab.py
    python3 scripts/decode_bulk_ab.py --cases b16-l8k b16-l8k-page16

Each case is one decoding step of ``flashx bench decode``'s shape (bf16 queries, Hq 32 over Hk 8,
d128, one query row a sequence, cache_seqlens = L): contiguous caches at (B, L) = (1, 64k), (1, 8k),
(16, 8k), (64, 4k), pages of 16 at (16, 8k) and of 256 at (1, 64k) handed out in a random order,
and an FP8 (float8_e4m3fn) contiguous cache at (16, 8k). Each implementation's step is captured in a
CUDA graph and timed as the bench times it (``flashx_bench.decode``: the median of many replays,
each after an L2 flush by reading). The table gives µs, TB/s of K/V read, bulk over cp.async and
each CuPy path over Triton (time ratios: below 1 is faster).

Checks, on each captured graph, its output poisoned with NaN before each replay: with the lengths
as timed, and again with ragged lengths (random in [1, L], most not a multiple of a 64-key tile) and
every cache slot past a sequence's length set to NaN (stale slots hold anything). Both CuPy paths
must give the same bits (they compute on the same tiles), and each must match Triton within the
contract's tolerance of relative error (``flashx_bench.implementations``: 1e-2 for a bf16 cache,
FP8_CHECK_TOLERANCE for an FP8 one). A failed check is printed and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "backends"), str(ROOT / "benchmarks")]

#: name -> (B, L, page size or None, the cache's dtype)
CASES = {
    "b1-l64k": (1, 65536, None, "bfloat16"),
    "b1-l8k": (1, 8192, None, "bfloat16"),
    "b16-l8k": (16, 8192, None, "bfloat16"),
    "b64-l4k": (64, 4096, None, "bfloat16"),
    "b16-l8k-page16": (16, 8192, 16, "bfloat16"),
    "b1-l64k-page256": (1, 65536, 256, "bfloat16"),
    "b16-l8k-fp8": (16, 8192, None, "float8_e4m3fn"),
}
#: implementation -> (flashx backend, FLASHX_CUPY_DECODE_BULK during its calls and capture)
IMPLEMENTATIONS = {"bulk": ("cupy", "1"), "cp.async": ("cupy", "0"), "triton": ("triton", None)}


class Case:
    """A case's tensors: queries, caches (contiguous, or pages in a random order with their table)
    and lengths, all on the GPU; ``ragged()`` shortens the lengths and poisons the slots past them."""

    def __init__(self, batch: int, cache: int, page_size: int | None, dtype: str):
        import torch

        from flashx_bench import decode as bench

        heads_q, heads_k, dim = bench.SHAPE["heads_q"], bench.SHAPE["heads_k"], bench.SHAPE["head_dim"]
        self.batch, self.cache, self.page_size, self.dtype = batch, cache, page_size, dtype
        self.bytes = bench._kv_bytes(batch, cache, dtype)
        device = torch.device("cuda")
        self.q = torch.randn(batch, 1, heads_q, dim, device=device, dtype=torch.bfloat16)
        keys, values = (torch.randn(batch, cache, heads_k, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
        self.lengths = torch.full((batch,), cache, dtype=torch.int32, device=device)
        self.table = None
        if page_size is not None:
            pages = batch * cache // page_size
            order = torch.randperm(pages, device=device)
            self.table = order.view(batch, cache // page_size).to(torch.int32)
            k_pages, v_pages = (torch.empty(pages, page_size, heads_k, dim, device=device, dtype=torch.bfloat16)
                                for _ in range(2))
            k_pages[order] = keys.view(pages, page_size, heads_k, dim)
            v_pages[order] = values.view(pages, page_size, heads_k, dim)
            keys, values = k_pages, v_pages
        self.k, self.v = (x.to(getattr(torch, dtype)) for x in (keys, values))

    def step(self, backend: str):
        """The call of ``backend``, or flashx.UnsupportedError with its reasons where it declines the case."""
        import flashx
        from flashx_bench.implementations import refuse_unchosen

        paging = {} if self.table is None else {"block_table": self.table}
        refuse_unchosen(flashx.kvcache.explain(self.q, self.k, self.v, cache_seqlens=self.lengths, validate=False,
                                               backend=backend, **paging), backend)
        return lambda: flashx.attention_with_kvcache(self.q, self.k, self.v, cache_seqlens=self.lengths,
                                                     validate=False, backend=backend, **paging)

    def ragged(self) -> None:
        """Lengths random in [1, L], in place (the graphs read them on the device), and every slot
        past a sequence's length NaN (an FP8 cache's NaN byte, 0x7f, written through a byte view)."""
        import torch

        self.lengths.copy_(torch.randint(1, self.cache + 1, (self.batch,), device=self.lengths.device))
        positions = torch.arange(self.cache, device=self.lengths.device)
        stale = positions[None, :] >= self.lengths[:, None].long()  # (B, L)
        fp8 = self.dtype == "float8_e4m3fn"
        for cache in (self.k, self.v):
            target, nan = (cache.view(torch.uint8), 0x7F) if fp8 else (cache, float("nan"))
            if self.table is None:
                target[stale] = nan
            else:  # slot s of sequence b lies in page table[b, s // page_size] at s % page_size
                pages = self.table.long()[:, positions // self.page_size][stale]
                target[pages, positions.expand_as(stale)[stale] % self.page_size] = nan


def captured(step):
    """(a CUDA graph of ``step``, the output tensor its replays write)."""
    import torch

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = step()
    return graph, o


def replayed(graph, o):
    """``o`` after one replay of ``graph``, poisoned with NaN before it."""
    import torch

    o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return o.float()


def with_bulk(switch: str | None, call):
    """``call()`` with FLASHX_CUPY_DECODE_BULK set to ``switch`` (None: left as it is)."""
    from flashx_cupy import variants

    before = os.environ.get(variants.DECODE_BULK_ENV)
    if switch is not None:
        os.environ[variants.DECODE_BULK_ENV] = switch
    try:
        return call()
    finally:
        if before is None:
            os.environ.pop(variants.DECODE_BULK_ENV, None)
        else:
            os.environ[variants.DECODE_BULK_ENV] = before


def check(name: str, outputs: dict, tolerance: float) -> list[str]:
    """The failures of one set of outputs: bulk and cp.async bit for bit, each within ``tolerance``
    of Triton's relative error (where Triton ran); any NaN."""
    failures = []
    for impl, o in outputs.items():
        if o.isnan().any():
            failures.append(f"{name}: {impl} left NaN in o")
    if not outputs["bulk"].equal(outputs["cp.async"]):
        diff = (outputs["bulk"] - outputs["cp.async"]).abs().max().item()
        failures.append(f"{name}: bulk and cp.async differ (max |difference| {diff:.3g})")
    reference = outputs.get("triton")
    for impl in ("bulk", "cp.async") if reference is not None else ():
        error = ((outputs[impl] - reference).norm() / reference.norm()).item()
        if not error <= tolerance:
            failures.append(f"{name}: {impl} is {error:.3g} off Triton's (relative), above {tolerance}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    import torch

    import flashx
    from flashx_bench import decode as bench
    from flashx_bench.implementations import CHECK_TOLERANCE, FP8_CHECK_TOLERANCE

    if torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("decode_bulk_ab: bulk copies are compute capability 9.0's; this GPU is "
                         + ".".join(map(str, torch.cuda.get_device_capability())))
    torch.manual_seed(0)
    timer = bench.Sweep.__new__(bench.Sweep)  # the bench's replay timing alone: it needs only its flush buffer
    timer.flush = torch.ones(bench.FLUSH_BYTES // 4, device="cuda")
    print(f"{torch.cuda.get_device_name()}: bf16 queries, Hq 32, Hk 8, d128, one query row; µs (TB/s of K/V read)")
    print(f"{'case':18} {'bulk':>16} {'cp.async':>16} {'triton':>16} {'bulk/cp.async':>14} {'bulk/triton':>12} "
          f"{'cp.async/triton':>16}")
    failures = []
    for name in args.cases:
        case = Case(*CASES[name])
        tolerance = FP8_CHECK_TOLERANCE if case.dtype == "float8_e4m3fn" else CHECK_TOLERANCE
        times, graphs = {}, {}
        for impl, (backend, switch) in IMPLEMENTATIONS.items():
            try:
                step = case.step(backend)
            except flashx.UnsupportedError as error:  # Triton's decoder without this cache: the CuPy paths alone
                print(f"{name}: {impl} declines: {error}")
                continue
            times[impl] = with_bulk(switch, lambda: timer._time(step)[0]) * 1e3
            graphs[impl] = with_bulk(switch, lambda: captured(step))
        cells = [f"{times[impl]:8.1f} ({case.bytes / times[impl] / 1e6:4.2f})" if impl in times else "declined"
                 for impl in IMPLEMENTATIONS]
        ratios = [f"{times[a] / times[b]:.3f}" if a in times and b in times else "-"
                  for a, b in (("bulk", "cp.async"), ("bulk", "triton"), ("cp.async", "triton"))]
        print(f"{name:18} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} {ratios[0]:>14} {ratios[1]:>12} {ratios[2]:>16}",
              flush=True)
        failures += check(name, {impl: replayed(*graph) for impl, graph in graphs.items()}, tolerance)
        case.ragged()
        failures += check(f"{name} ragged", {impl: replayed(*graph) for impl, graph in graphs.items()}, tolerance)
        del graphs, case
        torch.cuda.empty_cache()
    for failure in failures:
        print(f"FAILED {failure}")
    print("checks: " + ("all passed" if not failures else f"{len(failures)} failed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
