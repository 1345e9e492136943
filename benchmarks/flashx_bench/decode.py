"""flashx bench decode: ``flashx.attention_with_kvcache`` on each GPU backend against SDPA's cuDNN and FA2 kernels.

    flashx bench decode [--out DIR | --record] [--backends triton cupy numba] [--batches 1 4 16 64]
                        [--caches 1024 ... 131072] [--max-tokens N] [--numba-max-tokens N]
                        [--scan-splits | --scan-grid] [--time-limit S]
    flashx bench decode report FILE.json     # FILE.md and FILE.png again, from the JSON

One decoding step per point: B sequences with L cached tokens each, one query row per sequence,
bf16, Hq = 32 query heads over Hk = 8 kv heads, d = 128. Points with B * L above ``--max-tokens``
are left out (their caches would not fit beside the peers' copies).

- **What is reported.** TB/s of K/V read, B * L * Hk * (D + Dv) * 2 bytes (1 for an FP8 cache)
  over the time of one step, and that as a fraction of the device-to-device copy bandwidth
  measured at the start of the run ((bytes read + bytes written) / time of copying 2 GiB, as the
  main sweep counts it).
- **Implementations.** Each flashx backend of ``--backends`` (by default every one of triton,
  cupy and numba that runs on CUDA here; ``validate=False``), named after it: on a contiguous
  cache (B, L, Hk, D), ``triton``, and on paged caches of 256, 16 and 1 slots per page,
  ``triton-page256`` ..., the same tokens in pages handed out in a random order. Numba gets the
  contiguous cache alone, at points of at most ``--numba-max-tokens`` tokens (``NUMBA_MAX_TOKENS``
  says why). The backends of FP8_BACKENDS (issue 43) are also timed on FP8 caches, ``triton-fp8``,
  ``triton-fp8-page256`` ...: the same tokens cast to float8_e4m3fn, descales of 1 (None), as the
  main sweep's FP8 inputs; a backend that takes no FP8 cache is recorded as declined, with
  flashx's reasons. SDPA forced to its cuDNN or FlashAttention-2 kernel (``enable_gqa=True``),
  which need the cache materialised as contiguous (B, Hk, L, D) tensors of exactly L keys (done
  once per point, not timed).
- **Timing.** Each implementation's step is captured once in a CUDA graph and its replays are
  timed with CUDA events, the median of REP_MS of replays after WARMUP_MS of them, after a first
  call and REST_S of idle GPU: the way a serving engine runs decoding, and no implementation is
  charged its host work. A step that cannot be captured is timed as an eager call, and the row
  says so. Before each replay the L2 cache is flushed by reading FLUSH_BYTES, not by writing them
  as ``triton.testing.do_bench`` does: a flush by writing leaves the L2 full of dirty lines, which
  the timed step then writes back as it reads (on the H100, about 17 µs at every point past 50 MB
  of K/V, for every implementation alike: B = 1 at 16k tokens read at 1.5 TB/s instead of 2.2).
  The copy bandwidth is timed the same way, as an eager ``copy_`` (in a graph it becomes a copy
  engine's memcpy node, which ran at 2.4 TB/s against 3.0 for the copy kernel).
- **Checks.** Each flashx output against SDPA FlashAttention-2's on the bf16 cache and against
  the same backend's on the contiguous cache of the same dtype (max |difference|: 0 where the
  paged kernel tiles the keys as the contiguous one). The relative error against FA2's,
  ||o - o_FA2|| / ||o_FA2||, grades the row: above the main sweep's tolerance (1e-2 for a bf16
  cache, 0.1 for an FP8 one: ``implementations.FP8_CHECK_TOLERANCE``; a correct FP8 cache is about
  0.04 off, from rounding K and V to e4m3) the row is WRONG, its rate shown but never a target's.
  Rows of the backends that report their split count (``SPLIT_REPORTERS``) carry the
  ``num_splits`` they ran.
- **Targets** (``targets``): issue 42's, on an H100. Triton and CuPy on the contiguous cache at
  least 0.95x the faster of cuDNN and FA2 at every B in 1..64 and L in 4k..128k, and at least 90%
  of the copy rate at B = 1 from L = 32k; their pages of 16 and 256 within 5% of their contiguous
  rate from B * L = 64k tokens; Numba at least half Triton's rate at B = 16, L = 8k. Issue 43's:
  Triton and CuPy on an FP8 contiguous cache at least 1.8x the tokens/s (B / step time) of the
  same backend on the bf16 cache at B = 16, L = 8k. A target whose rows are missing is reported as
  not measured; one whose row is WRONG is not met.
- ``--scan-splits``: at a few points (SCAN_POINTS), each backend that reports its split count on
  the contiguous cache at every power-of-two ``num_splits`` beside its own choice
  (``num_splits=0``, the core's rule: ``flashx.splits``), the table behind that choice, with the
  choice's rate over the best one's. ``--scan-grid``: the same at every point of the sweep's grid
  (``--batches`` x ``--caches``). The rule of one commit against another's is their two runs'
  tables, each choice's rate read beside the faster peer's and the powers of two of its own run.

The run is the device's decode record (``flashx_bench.records``): ``decode-<device>.partial.json``
saved after every row, then ``decode-<device>.json``, ``.md`` and ``.png`` replaced and its numbers
appended to ``history.csv`` (metric ``tbps``, and the run's ``copy_tbps``), in ``--out`` (default
./flashx-bench-results) or, with ``--record``, the source checkout's benchmarks/results (the full
sweep only). A JSON's ``notes`` (a list of sentences) are printed under the markdown's header.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import platform
import time
from pathlib import Path

from flashx_bench import records

SHAPE = dict(heads_q=32, heads_k=8, head_dim=128)
BATCHES = (1, 4, 16, 64)
CACHES = (1024, 4096, 8192, 16384, 32768, 65536, 131072)  # 8k and 32k: where targets start or sit
MAX_TOKENS = 2**21  # B * L: the caches of one point then take 4 GiB per copy
BACKENDS = ("triton", "cupy", "numba")  # the flashx backends the sweep can time, in the order it times them
#: The library each backend's kernels are written with, whose version the record keeps.
KERNEL_LIBRARIES = {"triton": "triton", "cupy": "cupy", "numba": "numba_cuda"}
PAGE_SIZES = (256, 16, 1)
#: Numba's decode is the slow one (untuned float32 FMA tiles, no tensor cores or cp.async:
#: flashx_numba.decode) and one target reads it, at B = 16, L = 8k (2**17 tokens): it gets the
#: contiguous cache alone, at points of B * L up to this, which keeps its share of the run small.
NUMBA_MAX_TOKENS = 2**17
#: The backends whose plugin reports the split count it runs (``decode_splits``); numba's does not.
SPLIT_REPORTERS = ("triton", "cupy")
BF16, FP8 = "bfloat16", "float8_e4m3fn"  # the caches' dtypes (the contract's FP8 caches are e4m3)
BYTES_PER_ELEMENT = {BF16: 2, FP8: 1}
#: Issue 43's FP8-cache decoders: each is timed on FP8 caches too, declined or not.
FP8_BACKENDS = ("triton", "cupy")
PEERS = ("sdpa-cudnn", "sdpa-flash")
SCAN_POINTS = ((1, 1024), (1, 4096), (1, 16384), (1, 131072), (4, 1024), (4, 16384), (16, 8192), (64, 4096))
COPY_BYTES = 2**31
FLUSH_BYTES = 2**28
WARMUP_MS, REP_MS, REST_S = 25, 100, 0.25
#: Issue 42's targets, on an H100. For each backend of TARGET_BACKENDS, on the contiguous cache: at
#: least TARGET_PEER_RATIO times the faster peer's rate at every B and L in these ranges, and at
#: least TARGET_COPY_FRACTION of the copy rate at B = 1 from L = TARGET_COPY_CACHE; its pages of
#: TARGET_PAGE_SIZES at least TARGET_PAGED_RATIO of its contiguous rate from B * L = TARGET_PAGED_TOKENS.
#: Numba at least TARGET_NUMBA_RATIO of Triton's rate at TARGET_NUMBA_POINT (B, L), contiguous.
TARGET_BACKENDS = ("triton", "cupy")
TARGET_PEER_RATIO, TARGET_PEER_BATCHES, TARGET_PEER_CACHES = 0.95, (1, 64), (4096, 131072)
TARGET_COPY_FRACTION, TARGET_COPY_CACHE = 0.90, 32768
TARGET_PAGE_SIZES, TARGET_PAGED_RATIO, TARGET_PAGED_TOKENS = (256, 16), 0.95, 65536
TARGET_NUMBA_RATIO, TARGET_NUMBA_POINT = 0.50, (16, 8192)
#: Issue 43's: each backend of FP8_BACKENDS on an FP8 contiguous cache at least TARGET_FP8_RATIO times
#: the tokens/s of its bf16 contiguous cache at TARGET_FP8_POINT (B, L).
TARGET_FP8_RATIO, TARGET_FP8_POINT = 1.8, (16, 8192)


def implementation_name(backend: str, page_size: int | None, dtype: str) -> str:
    """``triton``, ``triton-page16``, ``triton-fp8``, ``triton-fp8-page16``."""
    return backend + ("-fp8" if dtype == FP8 else "") + ("" if page_size is None else f"-page{page_size}")


def layouts(backend: str) -> dict[str, tuple[int | None, str]]:
    """The implementations of one flashx backend: name -> (page size, None for the contiguous cache;
    the cache's dtype)."""
    pages = () if backend == "numba" else PAGE_SIZES  # NUMBA_MAX_TOKENS says why
    dtypes = (BF16, FP8) if backend in FP8_BACKENDS else (BF16,)
    return {implementation_name(backend, page, dtype): (page, dtype) for dtype in dtypes for page in (None, *pages)}


#: flashx implementation -> (its backend, its page size or None, its cache's dtype)
FLASHX = {name: (backend, *layout) for backend in BACKENDS for name, layout in layouts(backend).items()}
LABELS = {
    **{name: f"flashx {backend}, " + ("FP8 " if dtype == FP8 else "")
       + ("contiguous cache" if page is None else f"pages of {page}")
       for name, (backend, page, dtype) in FLASHX.items()},
    "sdpa-cudnn": "SDPA cuDNN",
    "sdpa-flash": "SDPA FlashAttention-2",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The sweep's options; ``args.out`` is where the record goes (``--record``: the checkout's);
    for a run, ``args.backends`` is the backends to time, in BACKENDS' order."""
    parser = argparse.ArgumentParser(prog="flashx bench decode", description=__doc__.split("\n")[0])
    records.add_sweep_arguments(parser)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS,
                        help="flashx backends to time (default: each of them that runs on CUDA here)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--caches", type=int, nargs="+", default=list(CACHES))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--numba-max-tokens", type=int, default=NUMBA_MAX_TOKENS,
                        help=f"numba runs at points of B * L up to this (default {NUMBA_MAX_TOKENS})")
    parser.add_argument("--scan-splits", action="store_true",
                        help="also time every power-of-two num_splits at a few points")
    parser.add_argument("--scan-grid", action="store_true",
                        help="also time every power-of-two num_splits at every point of the sweep")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds; what is left is marked skipped")
    args = parser.parse_args(argv)
    partial = []
    if args.command == "run":
        runnable = cuda_backends()
        args.backends = runnable if args.backends is None else [name for name in BACKENDS if name in args.backends]
        refused = [name for name in args.backends if name not in runnable]
        if refused:
            parser.error(f"--backends: {', '.join(refused)} cannot run on CUDA here (`flashx info` says why)")
        partial = ["--backends"] if args.backends != runnable else []
    partial += [flag for flag, used in (("--batches", args.batches != list(BATCHES)),
                                        ("--caches", args.caches != list(CACHES)),
                                        ("--max-tokens", args.max_tokens != MAX_TOKENS),
                                        ("--numba-max-tokens", args.numba_max_tokens != NUMBA_MAX_TOKENS)) if used]
    return records.resolve_sweep_arguments(parser, args, partial, "decode")


def cuda_backends() -> list[str]:
    """The backends of BACKENDS that flashx can run on CUDA here, in that order."""
    import flashx

    runnable = {info.name for info in flashx.backends() if info.available and "cuda" in info.devices}
    return [name for name in BACKENDS if name in runnable]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "report":
        written = records.redraw(records.load_json(args.results), args.results, markdown, plot)
    else:
        try:
            import torch
        except ImportError as error:
            raise SystemExit(f"flashx bench decode: needs {error.name}: pip install 'flashx-attention[bench]'")
        if not torch.cuda.is_available():
            raise SystemExit("flashx bench decode: no CUDA device here")
        if not args.backends:
            raise SystemExit("flashx bench decode: no flashx backend runs on CUDA here (`flashx info` says why)")
        sweep = Sweep(args)
        print(f"the record goes to {args.out}: {sweep.path.name.replace('.partial', '')}, .md, .png replaced; "
              f"{records.HISTORY} appended; backends {', '.join(args.backends)}")
        written = records.publish(sweep.run(), args.out, markdown, plot)
    for path in written:
        print(f"wrote {path}")
    return 0


class Sweep:
    def __init__(self, args):
        import torch

        import flashx
        from flashx_bench.implementations import CHECK_TOLERANCE, FP8_CHECK_TOLERANCE

        self.args = args
        self.device = torch.device("cuda")
        self.deadline = None if args.time_limit is None else time.perf_counter() + args.time_limit
        name = torch.cuda.get_device_name(self.device)
        today = datetime.date.today().isoformat()
        libraries = {KERNEL_LIBRARIES[backend]: importlib.import_module(KERNEL_LIBRARIES[backend]).__version__
                     for backend in args.backends}
        self.results = {
            "kind": "decode",
            "device": name,
            "sm_count": torch.cuda.get_device_properties(self.device).multi_processor_count,
            "date": today,
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                         **libraries, "flashx": flashx.__version__},
            "shape": {**SHAPE, "dtype": "bfloat16", "seqlen_q": 1},
            "timing": {"warmup_ms": WARMUP_MS, "rep_ms": REP_MS, "rest_s": REST_S, "statistic": "median",
                       "l2_flush": f"read {FLUSH_BYTES} bytes before each step"},
            "labels": LABELS,
            "check_tolerance": {BF16: CHECK_TOLERANCE, FP8: FP8_CHECK_TOLERANCE},  # by the cache's dtype
            "copy_tbps": None,
            "rows": [],
            "splits_scan": [],
        }
        self.path = records.partial_path(args.out, records.stem(self.results))

    def run(self) -> dict:
        import torch

        torch.manual_seed(0)
        self.flush = torch.ones(FLUSH_BYTES // 4, device=self.device)
        source = torch.randn(COPY_BYTES // 4, device=self.device)
        target = torch.empty_like(source)
        ms, _ = self._time(lambda: target.copy_(source), graph=False)
        self.results["copy_tbps"] = 2 * COPY_BYTES / ms / 1e9
        del source, target
        print(f"{self.results['device']}: device copy {self.results['copy_tbps']:.2f} TB/s (bytes read + written)",
              flush=True)
        points = [(b, n) for b in self.args.batches for n in self.args.caches if b * n <= self.args.max_tokens]
        for batch, cache in points:
            self._point(batch, cache)
        if self.args.scan_splits or self.args.scan_grid:
            for batch, cache in points if self.args.scan_grid else SCAN_POINTS:
                if batch * cache <= self.args.max_tokens:
                    self._scan(batch, cache)
        self._save()
        return self.results

    # -- one point ------------------------------------------------------------------------------

    def _point(self, batch: int, cache: int) -> None:
        import torch

        from flashx_bench.implementations import failure_status

        steps = self._steps(batch, cache)
        outputs = {}
        for name, make in steps.items():
            dtype = FLASHX[name][2] if name in FLASHX else BF16  # the peers read the bf16 cache
            row = {"impl": name, "batch": batch, "cache": cache, "cache_dtype": dtype,
                   "bytes": _kv_bytes(batch, cache, dtype)}
            if self._out_of_time():
                row["status"] = "skipped: time limit"
            else:
                try:
                    step, extra = make()
                    row.update(extra)
                    ms, mode = self._time(step)
                    outputs[name] = step().float()
                    tbps = row["bytes"] / ms / 1e9
                    row.update(status="ok", ms=ms, timing=mode, tbps=tbps, copy_fraction=tbps / self.results["copy_tbps"])
                except Exception as error:  # noqa: BLE001 - recorded in the row, shown in the tables
                    row["status"] = failure_status(error)
                step = steps[name] = None  # this implementation's caches are freed before the next one's are built
                torch.cuda.empty_cache()
            self.results["rows"].append(row)
        point_rows = self.results["rows"][-len(steps):]
        for row in point_rows:
            got = outputs.get(row["impl"])
            if got is None or row["impl"] not in FLASHX:
                continue
            backend, _, dtype = FLASHX[row["impl"]]
            contiguous = implementation_name(backend, None, dtype)
            for field, reference in (("max_diff_vs_fa2", "sdpa-flash"), ("max_diff_vs_contiguous", contiguous)):
                if reference in outputs and reference != row["impl"]:
                    row[field] = float((got - outputs[reference]).abs().max())
            if "sdpa-flash" in outputs:
                fa2 = outputs["sdpa-flash"]
                row["rel_error_vs_fa2"] = float((got - fa2).norm() / fa2.norm())
                if not row["rel_error_vs_fa2"] <= self.results["check_tolerance"][dtype]:  # NaN included
                    row["status"] = "wrong"
        shown = "  ".join(f"{row['impl']} " + (f"{row['tbps']:.2f}" + (" WRONG" if row["status"] == "wrong" else "")
                                                 if row["status"] in ("ok", "wrong") else row["status"])
                          for row in point_rows)
        print(f"B={batch:<3} L={cache:<7} TB/s: {shown}", flush=True)
        self._save()

    def _steps(self, batch: int, cache: int) -> dict:
        """name -> a function building (the step to time, the row's extra fields); built one at a time."""
        import torch

        import flashx
        from flashx_bench.implementations import refuse_unchosen

        heads_q, heads_k, dim = SHAPE["heads_q"], SHAPE["heads_k"], SHAPE["head_dim"]
        bf16 = torch.bfloat16
        q = torch.randn(batch, 1, heads_q, dim, device=self.device, dtype=bf16)
        keys = torch.randn(batch, cache, heads_k, dim, device=self.device, dtype=bf16)
        values = torch.randn(batch, cache, heads_k, dim, device=self.device, dtype=bf16)
        lengths = torch.full((batch,), cache, dtype=torch.int32, device=self.device)

        def on(backend, k, v, **paging):
            # A backend that cannot run the call (an FP8 cache it does not take) is declined with
            # flashx's reasons before it is asked for its split count.
            refuse_unchosen(flashx.kvcache.explain(q, k, v, cache_seqlens=lengths, validate=False, backend=backend,
                                                   **paging), backend)

            def step():
                return flashx.attention_with_kvcache(q, k, v, cache_seqlens=lengths, validate=False, backend=backend,
                                                     **paging)
            splits = ({"num_splits": _chosen_splits(backend, q, k, v, lengths, **paging)}
                      if backend in SPLIT_REPORTERS else {})
            return step, splits

        def stored(x, dtype):
            """``x`` as a cache of ``dtype`` holds it: an FP8 cache the cast of the same tokens (descales of 1)."""
            return x if dtype == BF16 else x.to(getattr(torch, dtype))

        def contiguous(backend, dtype):
            return lambda: on(backend, stored(keys, dtype), stored(values, dtype))

        def paged(backend, page_size, dtype):
            def make():
                pages = batch * cache // page_size
                order = torch.randperm(pages, device=self.device)
                table = order.view(batch, cache // page_size).to(torch.int32)
                k_pages, v_pages = (torch.empty(pages, page_size, heads_k, dim, device=self.device, dtype=bf16)
                                    for _ in range(2))
                k_pages[order] = keys.view(pages, page_size, heads_k, dim)
                v_pages[order] = values.view(pages, page_size, heads_k, dim)
                step, splits = on(backend, stored(k_pages, dtype), stored(v_pages, dtype), block_table=table)
                return step, {"page_size": page_size, **splits}
            return make

        def sdpa(kernel):
            def make():
                from torch.nn.attention import SDPBackend, sdpa_kernel
                from torch.nn.functional import scaled_dot_product_attention

                backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[kernel]
                q_bhsd = q.transpose(1, 2).contiguous()
                k_bhsd, v_bhsd = (x.transpose(1, 2).contiguous() for x in (keys, values))

                def step():
                    with sdpa_kernel([backend]):
                        o = scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, enable_gqa=True)
                    return o.transpose(1, 2)
                return step, {}
            return make

        steps = {}
        for backend in self.args.backends:
            if backend == "numba" and batch * cache > self.args.numba_max_tokens:
                continue
            for name, (page_size, dtype) in layouts(backend).items():
                if page_size is None:
                    steps[name] = contiguous(backend, dtype)
                elif cache % page_size == 0:
                    steps[name] = paged(backend, page_size, dtype)
        steps.update({name: sdpa(name) for name in PEERS})
        return steps

    def _scan(self, batch: int, cache: int) -> None:
        """Each backend of SPLIT_REPORTERS timed at every power-of-two ``num_splits`` (0: its own choice)."""
        import torch

        import flashx

        heads_q, heads_k, dim = SHAPE["heads_q"], SHAPE["heads_k"], SHAPE["head_dim"]
        q = torch.randn(batch, 1, heads_q, dim, device=self.device, dtype=torch.bfloat16)
        keys, values = (torch.randn(batch, cache, heads_k, dim, device=self.device, dtype=torch.bfloat16)
                        for _ in range(2))
        lengths = torch.full((batch,), cache, dtype=torch.int32, device=self.device)
        for backend in (name for name in self.args.backends if name in SPLIT_REPORTERS):
            times = {}
            for splits in (0, 1, 2, 4, 8, 16, 32, 64, 128):
                if self._out_of_time():
                    break
                step = functools.partial(flashx.attention_with_kvcache, q, keys, values, cache_seqlens=lengths,
                                         num_splits=splits, validate=False, backend=backend)
                times[splits], _ = self._time(step)
            row = {"backend": backend, "batch": batch, "cache": cache,
                   "chosen": _chosen_splits(backend, q, keys, values, lengths),
                   "tbps": {str(n): _kv_bytes(batch, cache) / ms / 1e9 for n, ms in times.items()}}
            self.results["splits_scan"].append(row)
            shown = "  ".join(f"{n}: {t:.2f}" for n, t in row["tbps"].items())
            print(f"splits {backend} B={batch} L={cache}: {shown}", flush=True)
            self._save()
        del q, keys, values
        torch.cuda.empty_cache()

    # -- helpers --------------------------------------------------------------------------------

    def _time(self, step, graph: bool = True) -> tuple[float, str]:
        """(median ms of a replay of ``step`` captured in a CUDA graph, "graph"), or of eager calls."""
        import statistics

        import torch

        step()  # compiles, and allocates what the graph then reuses
        torch.cuda.synchronize()
        run, mode = step, "eager"
        if graph:
            try:
                captured = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured):
                    step()
                run, mode = captured.replay, "graph"
            except Exception:  # noqa: BLE001 - not capturable: timed eagerly, and the row says so
                torch.cuda.synchronize()
        run()
        torch.cuda.synchronize()
        time.sleep(REST_S)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
        self._replay(run, events)
        each = statistics.median(start.elapsed_time(end) for start, end in events)
        flush = self._flush_ms()
        warmup, repeats = (max(1, int(ms / (each + flush))) for ms in (WARMUP_MS, REP_MS))
        self._replay(run, [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(warmup)])
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        self._replay(run, events)
        return statistics.median(start.elapsed_time(end) for start, end in events), mode

    def _replay(self, run, events) -> None:
        """``run`` once per pair of events, between them, each time after an L2 flush by reading."""
        import torch

        for start, end in events:
            self.flush.sum()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()

    def _flush_ms(self) -> float:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.flush.sum()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def _out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def _save(self) -> None:
        records.save_json(self.results, self.path)


def _kv_bytes(batch: int, cache: int, dtype: str = BF16) -> int:
    """The bytes of K and V a step reads from a cache of ``dtype``."""
    return batch * cache * SHAPE["heads_k"] * 2 * SHAPE["head_dim"] * BYTES_PER_ELEMENT[dtype]


def _chosen_splits(backend: str, q, keys, values, lengths, **keywords) -> int:
    """The split count ``backend`` (one of SPLIT_REPORTERS) runs for this call (``num_splits=0``), as it reports it."""
    import flashx

    problem = flashx.kvcache.explain(q, keys, values, cache_seqlens=lengths, validate=False, **keywords).problem
    return flashx.registry.get(backend).decode_splits(problem)


# -- the report (from the JSON alone) ------------------------------------------------------------


def _rows(results: dict) -> dict[tuple, dict]:
    return {(row["impl"], row["batch"], row["cache"]): row for row in results["rows"]}


def _points(results: dict) -> list[tuple[int, int]]:
    return sorted({(row["batch"], row["cache"]) for row in results["rows"]})


def _cache(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _at_least(target: str, limit: float, values: dict[tuple[int, int], float | None], shown) -> dict:
    """A target met where every point's value (None: its rows are missing) is at least ``limit``: met
    (True), not (False), or not measured (None) when no point has its rows, or when the points that
    have them meet it and others have none."""
    measured = {point: value for point, value in values.items() if value is not None}
    if not measured:
        return {"target": target, "measured": "no rows", "met": None}
    (batch, cache), lowest = min(measured.items(), key=lambda item: item[1])
    text = f"{shown(lowest)} at B={batch}, L={_cache(cache)}"
    missing = len(values) - len(measured)
    if missing:
        text = f"lowest {text} ({len(measured)} of {len(values)} points measured)"
    elif len(values) > 1:
        text = f"lowest {text} (of {len(values)} points)"
    return {"target": target, "measured": text, "met": False if lowest < limit else None if missing else True}


def targets(results: dict) -> list[dict]:
    """Each target of issues 42 and 43: what was asked, what was measured, and met (True, False, or
    None: not measured)."""
    rows, points, copy = _rows(results), _points(results), results["copy_tbps"]

    def ok(impl, b, n):
        row = rows.get((impl, b, n))
        return row if row and row.get("status") == "ok" else None

    def rate_ratio(impl, reference, b, n):
        """``reference``'s step time over ``impl``'s at (b, n): the ratio of their tokens/s, and of their
        TB/s where both read the same bytes; None where either has no row."""
        mine, theirs = ok(impl, b, n), ok(reference, b, n)
        return theirs["ms"] / mine["ms"] if mine and theirs else None

    def fp8_over_bf16(backend):
        batch, cache = TARGET_FP8_POINT
        fp8 = implementation_name(backend, None, FP8)
        target = (f"flashx {backend}, FP8 contiguous cache: >= {TARGET_FP8_RATIO:.1f}x the tokens/s of its bf16 "
                  f"cache at B={batch}, L={_cache(cache)}")
        row = rows.get((fp8, batch, cache))
        if row is None or row["status"] == "ok":
            return _at_least(target, TARGET_FP8_RATIO, {TARGET_FP8_POINT: rate_ratio(fp8, backend, batch, cache)},
                             lambda ratio: f"{ratio:.2f}x")
        if row["status"] == "wrong":
            return {"target": target, "met": False,
                    "measured": f"WRONG: relative error {row['rel_error_vs_fa2']:.2g} against FA2"}
        return {"target": target, "measured": row["status"].split(":")[0], "met": None}

    def over_faster_peer(impl, b, n):
        mine, peers = ok(impl, b, n), [ok(p, b, n) for p in PEERS]
        peers = [p for p in peers if p]
        return min(p["ms"] for p in peers) / mine["ms"] if mine and peers else None

    (low_b, high_b), (low_n, high_n) = TARGET_PEER_BATCHES, TARGET_PEER_CACHES
    peer_points = [(b, n) for b, n in points if low_b <= b <= high_b and low_n <= n <= high_n]
    found = []
    for backend in TARGET_BACKENDS:
        contiguous = f"flashx {backend}, contiguous"
        found.append(_at_least(
            f"{contiguous}: >= {TARGET_PEER_RATIO:.2f}x the faster of cuDNN and FA2, every B in {low_b}..{high_b} "
            f"and L in {_cache(low_n)}..{_cache(high_n)}", TARGET_PEER_RATIO,
            {(b, n): over_faster_peer(backend, b, n) for b, n in peer_points},
            lambda ratio: f"{ratio:.2f}x"))
        found.append(_at_least(
            f"{contiguous}: >= {TARGET_COPY_FRACTION:.0%} of the copy rate ({copy:.2f} TB/s) at B=1, "
            f"L >= {_cache(TARGET_COPY_CACHE)}", TARGET_COPY_FRACTION,
            {(b, n): (ok(backend, b, n) or {}).get("copy_fraction") for b, n in points
             if b == 1 and n >= TARGET_COPY_CACHE},
            lambda fraction: f"{fraction:.1%}"))
        for size in TARGET_PAGE_SIZES:
            found.append(_at_least(
                f"flashx {backend}, pages of {size}: >= {TARGET_PAGED_RATIO:.0%} of its contiguous rate from "
                f"B·L >= {_cache(TARGET_PAGED_TOKENS)} tokens", TARGET_PAGED_RATIO,
                {(b, n): rate_ratio(f"{backend}-page{size}", backend, b, n) for b, n in points
                 if b * n >= TARGET_PAGED_TOKENS},
                lambda ratio: f"{ratio:.1%}"))
    batch, cache = TARGET_NUMBA_POINT
    found.append(_at_least(
        f"flashx numba, contiguous: >= {TARGET_NUMBA_RATIO:.0%} of triton's rate at B={batch}, L={_cache(cache)}",
        TARGET_NUMBA_RATIO, {TARGET_NUMBA_POINT: rate_ratio("numba", "triton", batch, cache)},
        lambda ratio: f"{ratio:.0%}"))
    return found + [fp8_over_bf16(backend) for backend in FP8_BACKENDS]


def _rate_cell(row: dict | None) -> str:
    """A row's TB/s and fraction of the copy rate; a WRONG row's too, marked."""
    if row is None:
        return ""
    if row["status"] not in ("ok", "wrong"):
        return row["status"].split(":")[0]
    marks = ("" if row.get("timing") == "graph" else " (eager)") + (" **WRONG**" if row["status"] == "wrong" else "")
    return f"{row['tbps']:.2f} ({row['copy_fraction']:.0%}){marks}"


def markdown(results: dict) -> str:
    rows, impls = _rows(results), [name for name in LABELS if any(r["impl"] == name for r in results["rows"])]
    backends = [name for name in BACKENDS if name in impls]
    fp8_backends = [name for name in BACKENDS if implementation_name(name, None, FP8) in impls]
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    shape = results["shape"]
    met = {True: "yes", False: "**no**", None: "not measured"}
    lines = [
        f"# Decoding with a KV cache: {results['device']}, {results['date']}",
        "",
        f"One step: B sequences of L cached tokens, one query row each; {shape['dtype']}, Hq={shape['heads_q']}, "
        f"Hk={shape['heads_k']}, d={shape['head_dim']}. TB/s of K/V read (B·L·Hk·2d·2 bytes / time; ·1 byte for an "
        "FP8 cache, the same tokens cast to float8_e4m3fn, descales of 1); in brackets, "
        f"the fraction of the device-to-device copy bandwidth measured in the same run: "
        f"**{results['copy_tbps']:.2f} TB/s** (bytes read + written). CUDA-graph replays, medians, the L2 "
        f"flushed before each by reading {FLUSH_BYTES >> 20} MiB (`flashx bench decode`; its docstring says "
        f"why not by writing). {versions}; {results['sm_count']} SMs.",
        "",
        *(f"**Note.** {note}\n" for note in results.get("notes", ())),
        "## Targets",
        "",
        "| target | measured | met |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {t['target']} | {t['measured']} | {met[t['met']]} |" for t in targets(results)]
    lines += ["", "## TB/s of K/V read (fraction of copy bandwidth)", "",
              "| B | L | " + " | ".join(LABELS[i] for i in impls)
              + "".join(f" | {backend} / faster peer" for backend in backends)
              + "".join(f" | {backend} FP8 / bf16 cache, tokens/s" for backend in fp8_backends) + " |",
              "| --- | --- | " + " | ".join("---" for _ in impls + backends + fp8_backends) + " |"]

    def speedup(mine, theirs):
        ok = mine and theirs and mine.get("status") == theirs.get("status") == "ok"
        return f"{theirs['ms'] / mine['ms']:.2f}x" if ok else ""

    for b, n in _points(results):
        cells = [_rate_cell(rows.get((impl, b, n))) for impl in impls]
        peers = [rows.get((p, b, n)) for p in PEERS if rows.get((p, b, n), {}).get("status") == "ok"]
        faster = min(peers, key=lambda p: p["ms"], default=None)
        cells += [speedup(rows.get((backend, b, n)), faster) for backend in backends]
        cells += [speedup(rows.get((implementation_name(backend, None, FP8), b, n)), rows.get((backend, b, n)))
                  for backend in fp8_backends]
        lines.append(f"| {b} | {_cache(n)} | " + " | ".join(cells) + " |")
    tolerance = results.get("check_tolerance")
    lines += ["", "## Checks (max |difference| of o; relative error ||o - o_FA2|| / ||o_FA2||"
              + (f", WRONG above {tolerance[BF16]:g} for a bf16 cache and {tolerance[FP8]:g} for an FP8 one"
                 if tolerance else "") + ")", "",
              "| B | L | impl | splits | vs FA2 | vs its contiguous cache | relative error vs FA2 |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in results["rows"]:
        if row["impl"] in FLASHX and row.get("status") in ("ok", "wrong"):
            diffs = [f"{row[f]:.2e}" if f in row else "" for f in ("max_diff_vs_fa2", "max_diff_vs_contiguous",
                                                                    "rel_error_vs_fa2")]
            wrong = " **WRONG**" if row["status"] == "wrong" else ""
            lines.append(f"| {row['batch']} | {_cache(row['cache'])} | {row['impl']} | {row.get('num_splits', '')} | "
                         + " | ".join(diffs) + f"{wrong} |")
    errors = sorted({(r["impl"], r["status"]) for r in results["rows"] if r.get("status", "ok") not in ("ok", "wrong")})
    if errors:
        lines += ["", "Not measured:", ""] + [f"- {impl}: {status}" for impl, status in errors]
    if results.get("splits_scan"):
        counts = list(results["splits_scan"][0]["tbps"])
        lines += ["", "## TB/s by num_splits (contiguous cache; 0 = the backend's own choice)", "",
                  "| backend | B | L | chosen | " + " | ".join(counts) + " | chosen / best |",
                  "| --- | --- | --- | --- | " + " | ".join("---" for _ in counts) + " | --- |"]
        for row in results["splits_scan"]:
            rates = row["tbps"]
            ratio = f"{rates['0'] / max(rates.values()):.2f}" if "0" in rates else ""
            lines.append(f"| {row['backend']} | {row['batch']} | {_cache(row['cache'])} | {row['chosen']} | "
                         + " | ".join(f"{rates[c]:.2f}" if c in rates else "" for c in counts) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


#: The plot's line colour per backend (the peers are grey), and its style per page size (None: contiguous).
COLOURS = {"triton": "tab:blue", "cupy": "tab:orange", "numba": "tab:green"}
STYLES = {None: "-o", 256: "--s", 16: "--^", 1: "--v"}
PEER_STYLES = {"sdpa-cudnn": ("-x", "black"), "sdpa-flash": ("-+", "tab:gray")}


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({row["batch"] for row in results["rows"]})
    caches = sorted({row["cache"] for row in results["rows"]})
    # An FP8 cache: its backend's colour and its page size's marker, dotted.
    styles = {**{name: (STYLES[page] if dtype == BF16 else ":" + STYLES[page][-1], COLOURS[backend])
                 for name, (backend, page, dtype) in FLASHX.items()}, **PEER_STYLES}
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 4.2), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for impl, (style, colour) in styles.items():
            points = sorted((r["cache"], r["tbps"]) for r in results["rows"]
                            if r["impl"] == impl and r["batch"] == batch and r.get("status") == "ok")
            if points:
                ax.plot(*zip(*points), style, color=colour, label=LABELS[impl], markersize=4)
        ax.axhline(results["copy_tbps"], color="gray", linestyle="--", linewidth=1, label="device copy")
        ax.axhline(TARGET_COPY_FRACTION * results["copy_tbps"], color="gray", linestyle=":", linewidth=1,
                   label=f"{TARGET_COPY_FRACTION:.0%} of copy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(caches, [_cache(n) for n in caches], fontsize=7)
        ax.set_title(f"B = {batch}")
        ax.set_xlabel("cached tokens per sequence")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("TB/s of K/V read")
    legend = {}  # label -> line, from every panel: a backend may run at some batches only (NUMBA_MAX_TOKENS)
    for ax in axes[0]:
        for line, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, line)
    columns = 5
    fig.legend(legend.values(), legend.keys(), fontsize=7, loc="lower center", ncol=min(len(legend), columns))
    fig.suptitle(f"Decoding, {results['device']} ({results['date']}): bf16 queries, Hq=32, Hk=8, d=128, one query row",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06 * -(-len(legend) // columns), 1, 1))  # room for the legend's rows
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
