"""flashx bench decode: ``flashx.attention_with_kvcache`` against SDPA's cuDNN and FlashAttention-2 kernels.

    flashx bench decode [--out DIR | --record] [--batches 1 4 16 64] [--caches 1024 ... 131072]
                        [--max-tokens N] [--scan-splits] [--time-limit S]
    flashx bench decode report FILE.json     # FILE.md and FILE.png again, from the JSON

One decoding step per point: B sequences with L cached tokens each, one query row per sequence,
bf16, Hq = 32 query heads over Hk = 8 kv heads, d = 128. Points with B * L above ``--max-tokens``
are left out (their caches would not fit beside the peers' copies).

- **What is reported.** TB/s of K/V read, B * L * Hk * (D + Dv) * 2 bytes over the time of one
  step, and that as a fraction of the device-to-device copy bandwidth measured at the start of
  the run ((bytes read + bytes written) / time of copying 2 GiB, as the main sweep counts it).
- **Implementations.** flashx (its Triton backend, ``validate=False``) on a contiguous cache
  (B, L, Hk, D) and on paged caches of 256, 16 and 1 slots per page, the same tokens in pages
  handed out in a random order; SDPA forced to its cuDNN or FlashAttention-2 kernel
  (``enable_gqa=True``), which need the cache materialised as contiguous (B, Hk, L, D) tensors of
  exactly L keys (done once per point, not timed).
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
- **Checks.** Each flashx output against SDPA FlashAttention-2's and against flashx's on the
  contiguous cache (max |difference|: 0 where the paged kernel tiles the keys as the contiguous one).
- ``--scan-splits``: at a few points, flashx on the contiguous cache at every power-of-two
  ``num_splits`` beside its own choice (``num_splits=0``), the table behind that choice.

The run is the device's decode record (``flashx_bench.records``): ``decode-<device>.partial.json``
saved after every row, then ``decode-<device>.json``, ``.md`` and ``.png`` replaced and its numbers
appended to ``history.csv`` (metric ``tbps``, and the run's ``copy_tbps``), in ``--out`` (default
./flashx-bench-results) or, with ``--record``, the source checkout's benchmarks/results (the full
sweep only). A JSON's ``notes`` (a list of sentences) are printed under the markdown's header.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

from flashx_bench import records

SHAPE = dict(heads_q=32, heads_k=8, head_dim=128)
BATCHES = (1, 4, 16, 64)
CACHES = (1024, 4096, 16384, 65536, 131072)
MAX_TOKENS = 2**21  # B * L: the caches of one point then take 4 GiB per copy
FLASHX = ("flashx", "flashx-page256", "flashx-page16", "flashx-page1")
PEERS = ("sdpa-cudnn", "sdpa-flash")
LABELS = {
    "flashx": "flashx, contiguous cache",
    "flashx-page256": "flashx, pages of 256",
    "flashx-page16": "flashx, pages of 16",
    "flashx-page1": "flashx, pages of 1",
    "sdpa-cudnn": "SDPA cuDNN",
    "sdpa-flash": "SDPA FlashAttention-2",
}
SCAN_POINTS = ((1, 1024), (1, 4096), (1, 16384), (1, 131072), (4, 1024), (4, 16384), (16, 8192), (64, 4096))
COPY_BYTES = 2**31
FLUSH_BYTES = 2**28
WARMUP_MS, REP_MS, REST_S = 25, 100, 0.25
#: The issue's targets: B = 1 at these caches reaches this fraction of the copy bandwidth; flashx's
#: time at most the faster peer's everywhere; paged at most these times the contiguous time.
TARGET_FRACTION, TARGET_CACHES = 0.85, (16384, 65536, 131072)
TARGET_PAGED = {"flashx-page256": 1.10, "flashx-page16": 1.10, "flashx-page1": 1.25}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The sweep's options; ``args.out`` is where the record goes (``--record``: the checkout's)."""
    parser = argparse.ArgumentParser(prog="flashx bench decode", description=__doc__.split("\n")[0])
    records.add_sweep_arguments(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--caches", type=int, nargs="+", default=list(CACHES))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--scan-splits", action="store_true", help="also time every power-of-two num_splits")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds; what is left is marked skipped")
    args = parser.parse_args(argv)
    partial = [flag for flag, used in (("--batches", args.batches != list(BATCHES)),
                                       ("--caches", args.caches != list(CACHES)),
                                       ("--max-tokens", args.max_tokens != MAX_TOKENS)) if used]
    return records.resolve_sweep_arguments(parser, args, partial, "decode")

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "report":
        written = records.redraw(records.load_json(args.results), args.results, markdown, plot)
    else:
        try:
            import torch
            import triton  # noqa: F401  (flashx's decode kernels)
        except ImportError as error:
            raise SystemExit(f"flashx bench decode: needs {error.name}: pip install 'flashx-attention[bench]'")
        if not torch.cuda.is_available():
            raise SystemExit("flashx bench decode: no CUDA device here")
        sweep = Sweep(args)
        print(f"the record goes to {args.out}: {sweep.path.name.replace('.partial', '')}, .md, .png replaced; "
              f"{records.HISTORY} appended")
        written = records.publish(sweep.run(), args.out, markdown, plot)
    for path in written:
        print(f"wrote {path}")
    return 0


class Sweep:
    def __init__(self, args):
        import torch
        import triton

        import flashx

        self.args = args
        self.device = torch.device("cuda")
        self.deadline = None if args.time_limit is None else time.perf_counter() + args.time_limit
        name = torch.cuda.get_device_name(self.device)
        today = datetime.date.today().isoformat()
        self.results = {
            "kind": "decode",
            "device": name,
            "sm_count": torch.cuda.get_device_properties(self.device).multi_processor_count,
            "date": today,
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                         "triton": triton.__version__, "flashx": flashx.__version__},
            "shape": {**SHAPE, "dtype": "bfloat16", "seqlen_q": 1},
            "timing": {"warmup_ms": WARMUP_MS, "rep_ms": REP_MS, "rest_s": REST_S, "statistic": "median",
                       "l2_flush": f"read {FLUSH_BYTES} bytes before each step"},
            "labels": LABELS,
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
        if self.args.scan_splits:
            for batch, cache in SCAN_POINTS:
                if batch * cache <= self.args.max_tokens:
                    self._scan(batch, cache)
        self._save()
        return self.results

    # -- one point ------------------------------------------------------------------------------

    def _point(self, batch: int, cache: int) -> None:
        import torch

        steps = self._steps(batch, cache)
        outputs = {}
        for name, make in steps.items():
            row = {"impl": name, "batch": batch, "cache": cache, "bytes": _kv_bytes(batch, cache)}
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
                    row["status"] = f"error: {type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
                step = steps[name] = None  # this implementation's caches are freed before the next one's are built
                torch.cuda.empty_cache()
            self.results["rows"].append(row)
        for row in self.results["rows"][-len(steps):]:
            got = outputs.get(row["impl"])
            for field, reference in (("max_diff_vs_fa2", "sdpa-flash"), ("max_diff_vs_contiguous", "flashx")):
                if got is not None and reference in outputs and row["impl"] != reference and row["impl"] in FLASHX:
                    row[field] = float((got - outputs[reference]).abs().max())
        shown = "  ".join(f"{row['impl']} {row['tbps']:.2f}" if row.get("status") == "ok" else f"{row['impl']} {row['status']}"
                          for row in self.results["rows"][-len(steps):])
        print(f"B={batch:<3} L={cache:<7} TB/s: {shown}", flush=True)
        self._save()

    def _steps(self, batch: int, cache: int) -> dict:
        """name -> a function building (the step to time, the row's extra fields); built one at a time."""
        import torch

        import flashx

        heads_q, heads_k, dim = SHAPE["heads_q"], SHAPE["heads_k"], SHAPE["head_dim"]
        bf16 = torch.bfloat16
        q = torch.randn(batch, 1, heads_q, dim, device=self.device, dtype=bf16)
        keys = torch.randn(batch, cache, heads_k, dim, device=self.device, dtype=bf16)
        values = torch.randn(batch, cache, heads_k, dim, device=self.device, dtype=bf16)
        lengths = torch.full((batch,), cache, dtype=torch.int32, device=self.device)

        def contiguous():
            def step():
                return flashx.attention_with_kvcache(q, keys, values, cache_seqlens=lengths, validate=False,
                                                     backend="triton")
            return step, {"num_splits": _chosen_splits(q, keys, values, lengths)}

        def paged(page_size):
            def make():
                pages = batch * cache // page_size
                order = torch.randperm(pages, device=self.device)
                table = order.view(batch, cache // page_size).to(torch.int32)
                k_pages, v_pages = (torch.empty(pages, page_size, heads_k, dim, device=self.device, dtype=bf16)
                                    for _ in range(2))
                k_pages[order] = keys.view(pages, page_size, heads_k, dim)
                v_pages[order] = values.view(pages, page_size, heads_k, dim)

                def step():
                    return flashx.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table,
                                                         validate=False, backend="triton")
                return step, {"page_size": page_size,
                              "num_splits": _chosen_splits(q, k_pages, v_pages, lengths, block_table=table)}
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

        steps = {"flashx": contiguous}
        steps.update({f"flashx-page{p}": paged(p) for p in (256, 16, 1) if cache % p == 0})
        steps.update({name: sdpa(name) for name in PEERS})
        return steps

    def _scan(self, batch: int, cache: int) -> None:
        import torch

        import flashx

        heads_q, heads_k, dim = SHAPE["heads_q"], SHAPE["heads_k"], SHAPE["head_dim"]
        q = torch.randn(batch, 1, heads_q, dim, device=self.device, dtype=torch.bfloat16)
        keys, values = (torch.randn(batch, cache, heads_k, dim, device=self.device, dtype=torch.bfloat16)
                        for _ in range(2))
        lengths = torch.full((batch,), cache, dtype=torch.int32, device=self.device)
        times = {}
        for splits in (0, 1, 2, 4, 8, 16, 32, 64, 128):
            if self._out_of_time():
                break
            ms, _ = self._time(lambda: flashx.attention_with_kvcache(q, keys, values, cache_seqlens=lengths,
                                                                     num_splits=splits, validate=False,
                                                                     backend="triton"))
            times[splits] = ms
        row = {"batch": batch, "cache": cache, "chosen": _chosen_splits(q, keys, values, lengths),
               "tbps": {str(n): _kv_bytes(batch, cache) / ms / 1e9 for n, ms in times.items()}}
        self.results["splits_scan"].append(row)
        print(f"splits B={batch} L={cache}: " + "  ".join(f"{n}: {t:.2f}" for n, t in row["tbps"].items()), flush=True)
        del q, keys, values
        torch.cuda.empty_cache()
        self._save()

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


def _kv_bytes(batch: int, cache: int) -> int:
    return batch * cache * SHAPE["heads_k"] * 2 * SHAPE["head_dim"] * 2


def _chosen_splits(q, keys, values, lengths, **keywords) -> int:
    """The split count the Triton backend runs for this call (``num_splits=0``), as the backend reports it."""
    import flashx

    problem = flashx.kvcache.explain(q, keys, values, cache_seqlens=lengths, validate=False, **keywords).problem
    return flashx.registry.get("triton").decode_splits(problem)


# -- the report (from the JSON alone) ------------------------------------------------------------


def _rows(results: dict) -> dict[tuple, dict]:
    return {(row["impl"], row["batch"], row["cache"]): row for row in results["rows"]}


def _points(results: dict) -> list[tuple[int, int]]:
    return sorted({(row["batch"], row["cache"]) for row in results["rows"]})


def _cache(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def targets(results: dict) -> list[dict]:
    """Each target of the decode issue: what was asked, what was measured, met or not."""
    rows, copy = _rows(results), results["copy_tbps"]

    def ok(impl, b, n):
        row = rows.get((impl, b, n))
        return row if row and row.get("status") == "ok" else None

    found = []
    for n in TARGET_CACHES:
        row = ok("flashx", 1, n)
        if row:
            found.append({"target": f"B=1, L={_cache(n)}: >= {TARGET_FRACTION:.0%} of copy bandwidth",
                          "measured": f"{row['copy_fraction']:.1%} ({row['tbps']:.2f} of {copy:.2f} TB/s)",
                          "met": row["copy_fraction"] >= TARGET_FRACTION})
    worst = None
    for b, n in _points(results):
        mine, peers = ok("flashx", b, n), [ok(p, b, n) for p in PEERS]
        peers = [p for p in peers if p]
        if mine and peers:
            ratio = min(p["ms"] for p in peers) / mine["ms"]
            if worst is None or ratio < worst[0]:
                worst = (ratio, b, n)
    if worst:
        found.append({"target": ">= 1.0x the faster of cuDNN and FA2 at every point",
                      "measured": f"lowest {worst[0]:.2f}x (B={worst[1]}, L={_cache(worst[2])})", "met": worst[0] >= 1.0})
    for impl, limit in TARGET_PAGED.items():
        ratios = [(ok(impl, b, n)["ms"] / ok("flashx", b, n)["ms"], b, n) for b, n in _points(results)
                  if ok(impl, b, n) and ok("flashx", b, n)]
        if ratios:
            ratio, b, n = max(ratios)
            found.append({"target": f"{LABELS[impl]}: time <= {limit:.2f}x contiguous at every point",
                          "measured": f"worst {ratio:.2f}x (B={b}, L={_cache(n)})", "met": ratio <= limit})
    return found


def markdown(results: dict) -> str:
    rows, impls = _rows(results), [name for name in LABELS if any(r["impl"] == name for r in results["rows"])]
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    shape = results["shape"]
    lines = [
        f"# Decoding with a KV cache: {results['device']}, {results['date']}",
        "",
        f"One step: B sequences of L cached tokens, one query row each; {shape['dtype']}, Hq={shape['heads_q']}, "
        f"Hk={shape['heads_k']}, d={shape['head_dim']}. TB/s of K/V read (B·L·Hk·2d·2 bytes / time); in brackets, "
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
    lines += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |" for t in targets(results)]
    lines += ["", "## TB/s of K/V read (fraction of copy bandwidth)", "",
              "| B | L | " + " | ".join(LABELS[i] for i in impls) + " | flashx / faster peer |",
              "| --- | --- | " + " | ".join("---" for _ in impls) + " | --- |"]
    for b, n in _points(results):
        cells = []
        for impl in impls:
            row = rows.get((impl, b, n))
            if row is None:
                cells.append("")
            elif row.get("status") != "ok":
                cells.append(row["status"].split(":")[0])
            else:
                mark = "" if row.get("timing") == "graph" else " (eager)"
                cells.append(f"{row['tbps']:.2f} ({row['copy_fraction']:.0%}){mark}")
        mine = rows.get(("flashx", b, n))
        peers = [rows.get((p, b, n)) for p in PEERS]
        peers = [p for p in peers if p and p.get("status") == "ok"]
        ratio = (f"{min(p['ms'] for p in peers) / mine['ms']:.2f}x" if mine and mine.get("status") == "ok" and peers
                 else "")
        lines.append(f"| {b} | {_cache(n)} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "## Checks (max |difference| of o)", "",
              "| B | L | impl | splits | vs FA2 | vs flashx contiguous |", "| --- | --- | --- | --- | --- | --- |"]
    for row in results["rows"]:
        if row["impl"] in FLASHX and row.get("status") == "ok":
            diffs = [f"{row[f]:.2e}" if f in row else "" for f in ("max_diff_vs_fa2", "max_diff_vs_contiguous")]
            lines.append(f"| {row['batch']} | {_cache(row['cache'])} | {row['impl']} | {row.get('num_splits', '')} | "
                         + " | ".join(diffs) + " |")
    errors = sorted({(r["impl"], r["status"]) for r in results["rows"] if r.get("status", "ok") != "ok"})
    if errors:
        lines += ["", "Not measured:", ""] + [f"- {impl}: {status}" for impl, status in errors]
    if results.get("splits_scan"):
        counts = list(results["splits_scan"][0]["tbps"])
        lines += ["", "## flashx TB/s by num_splits (contiguous cache; 0 = its own choice)", "",
                  "| B | L | chosen | " + " | ".join(counts) + " |", "| --- | --- | --- | " + " | ".join("---" for _ in counts) + " |"]
        for row in results["splits_scan"]:
            lines.append(f"| {row['batch']} | {_cache(row['cache'])} | {row['chosen']} | "
                         + " | ".join(f"{row['tbps'][c]:.2f}" if c in row["tbps"] else "" for c in counts) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({row["batch"] for row in results["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), sharey=True, squeeze=False)
    styles = {"flashx": "-o", "flashx-page256": "--s", "flashx-page16": "--^", "flashx-page1": ":v",
              "sdpa-cudnn": "-x", "sdpa-flash": "-+"}
    for ax, batch in zip(axes[0], batches):
        for impl, style in styles.items():
            points = sorted((r["cache"], r["tbps"]) for r in results["rows"]
                            if r["impl"] == impl and r["batch"] == batch and r.get("status") == "ok")
            if points:
                ax.plot(*zip(*points), style, label=LABELS[impl], markersize=4)
        ax.axhline(results["copy_tbps"], color="gray", linestyle="--", linewidth=1, label="device copy")
        ax.axhline(TARGET_FRACTION * results["copy_tbps"], color="gray", linestyle=":", linewidth=1,
                   label=f"{TARGET_FRACTION:.0%} of copy")
        ax.set_xscale("log", base=2)
        caches = sorted({r["cache"] for r in results["rows"]})
        ax.set_xticks(caches, [_cache(n) for n in caches])
        ax.set_title(f"B = {batch}")
        ax.set_xlabel("cached tokens per sequence")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("TB/s of K/V read")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Decoding, {results['device']} ({results['date']}): bf16, Hq=32, Hk=8, d=128, one query row", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

