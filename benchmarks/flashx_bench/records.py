"""Where results go: one current record per device and one history table, never a file per run.

In the output directory (``--out``, by default ``./flashx-bench-results``; ``--record``: the
source checkout's ``benchmarks/results``):

- ``<device>.json``: every measurement of the device's latest run, replaced by the next run;
- ``<device>.md``: its tables; ``<device>.png``: its plot (GPU runs);
- ``history.csv``: one row per number measured, for every run, appended (rows already there are
  not written twice): date, device, implementation, shape, metric, value, versions;
- ``<device>.partial.json``: the run in progress, saved after each row so that a run stopped
  early keeps what it measured; it becomes ``<device>.json`` when the run ends.

``<device>`` is ``cpu``, the GPU's model (``device_slug``: h100, h200, rtx4090), or for the decode,
feature and model sweeps ``decode-``, ``features-`` or ``model-`` and the GPU's model.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from pathlib import Path
from typing import Callable

DEFAULT_OUT = Path("flashx-bench-results")


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """A sub-sweep's ``run | report FILE.json`` and where its record goes: ``--out DIR`` or ``--record``."""
    parser.add_argument("command", nargs="?", choices=("run", "report"), default="run",
                        help="run the sweep (default), or report: rewrite a record's markdown from its JSON")
    parser.add_argument("results", nargs="?", type=Path, help="report: the record's JSON")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=DEFAULT_OUT,
                       help=f"directory of the record and history (default ./{DEFAULT_OUT})")
    where.add_argument("--record", action="store_true",
                       help="update the source checkout's benchmarks/results instead (the full sweep only)")


def resolve_sweep_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, partial: list[str],
                            record: str) -> argparse.Namespace:
    """``args`` with ``out`` resolved, after refusing a report without its JSON and a ``--record``
    of a partial run (``partial``: the flags that made it one) as the device's ``record``."""
    if args.command == "report" and args.results is None:
        parser.error("report needs the record's JSON")
    if args.record:
        if partial:
            parser.error(f"--record keeps the full sweep as the device's {record} record, and {', '.join(partial)} "
                         "runs part of it: pass --out DIR instead")
        args.out = checkout_results()
    args.out = args.out.resolve()
    return args
#: benchmarks/results of a source checkout (this package is benchmarks/flashx_bench there)
CHECKOUT_RESULTS = Path(__file__).resolve().parent.parent / "results"
HISTORY = "history.csv"
HISTORY_FIELDS = ("date", "device", "impl", "mode", "dtype", "batch", "seqlen", "heads", "head_dim", "causal",
                  "metric", "value", "torch", "triton", "flashx")
SHAPE_FIELDS = ("batch", "seqlen", "heads", "head_dim", "causal")
#: The record name's prefix for the sweeps other than the main one (kind "gpu") and the CPU's.
PREFIXES = {"decode": "decode-", "features": "features-", "model": "model-"}


def checkout_results() -> Path:
    """The source checkout's benchmarks/results, which ``--record`` updates."""
    if not CHECKOUT_RESULTS.is_dir():
        raise SystemExit(f"--record updates benchmarks/results of a source checkout, and flashx_bench runs from "
                         f"{CHECKOUT_RESULTS.parent.parent} (an installed copy): pass --out DIR instead")
    return CHECKOUT_RESULTS


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA GeForce RTX 4090' -> 'rtx4090'."""
    words = [w for w in name.split() if w.lower() not in {"nvidia", "geforce", "tesla"}]
    slug = []
    for word in words:
        slug.append(word.lower())
        if any(c.isdigit() for c in word):
            break
    return "".join(slug) or "gpu"


def stem(results: dict) -> str:
    """The record's name: ``cpu``, the GPU's model, or its prefix (``PREFIXES``) and the model."""
    if results["kind"] == "cpu":
        return "cpu"
    return PREFIXES.get(results["kind"], "") + device_slug(results["device"])


def partial_path(out_dir: Path, slug: str) -> Path:
    return Path(out_dir) / f"{slug}.partial.json"


def save_json(results: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(results, indent=1))
    os.replace(temporary, path)  # a run killed while writing keeps the previous file


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def publish(results: dict, out_dir: Path, render: Callable[[dict], str],
            draw: Callable[[dict, Path], Path] | None = None) -> list[Path]:
    """Replace the device's record in ``out_dir`` by ``results`` (JSON, ``render``'s markdown,
    ``draw``'s plot), append its rows to the history, and drop the run's partial file."""
    out_dir = Path(out_dir)
    slug = stem(results)
    json_path = out_dir / f"{slug}.json"
    save_json(results, json_path)
    partial_path(out_dir, slug).unlink(missing_ok=True)
    written = [json_path, *redraw(results, json_path, render, draw)]
    added = append_history(results, out_dir)
    written.append(out_dir / HISTORY)
    print(f"{len(added)} rows added to {out_dir / HISTORY}")
    return written


def redraw(results: dict, json_path: Path, render: Callable[[dict], str],
           draw: Callable[[dict, Path], Path] | None = None) -> list[Path]:
    """The markdown (and plot) beside ``json_path``, from ``results``."""
    md_path = Path(json_path).with_suffix(".md")
    md_path.write_text(render(results))
    written = [md_path]
    if draw is not None:
        try:
            written.append(draw(results, Path(json_path).with_suffix(".png")))
        except ModuleNotFoundError as error:
            print(f"no plot: {error.name} is not installed here; draw it elsewhere with "
                  f"`flashx bench plot {json_path}`")
    return written


def history_rows(results: dict) -> list[dict]:
    """The numbers of one run as history rows: speed (tflops), host time (host_us), memory
    (peak_mib), checks (rel_error, the largest of o, dq, dk, dv), ceilings; failed rows are left out.
    An FP8 implementation's rows name its inputs' dtype (float8_e4m3fn), its check the mode fwd.
    The feature sweep's rows name their feature in the mode, after it ("fwd+bwd softcap"); its rows
    without one are plain "fwd" and "fwd+bwd", the main sweep's quantity. The model sweep's name
    their model ("train gpt2-small"): tokens_per_s and peak_mib, and max_seqlen (B = 1, no N)."""
    versions = results.get("versions", {})
    common = {"date": results["date"], "device": results["device"], "dtype": results.get("plan", {}).get("dtype", ""),
              **{name: versions.get(name, "") for name in ("torch", "triton", "flashx")}}

    def row(source: dict, metric: str, value: float, **fields) -> dict:
        shape = {name: source.get(name, "") for name in SHAPE_FIELDS}
        return {**common, "impl": source.get("impl", ""), "mode": source.get("mode", ""), **shape, **fields,
                "metric": metric, "value": f"{value:.6g}"}

    if results["kind"] == "cpu":
        shape = results["shape"]
        source = {"batch": shape["batch"], "seqlen": shape["seqlen"], "heads": shape["heads"],
                  "head_dim": shape["head_dim"], "causal": shape["causal"], "mode": "fwd"}
        rows = [row({**source, "impl": name}, "ms", timing["median_s"] * 1e3, dtype=shape["dtype"])
                for name, timing in results["forward"].items()]
        memory = results["memory"]
        rows.append(row({**source, "impl": "flashx-numpy", "seqlen": memory["seqlen"]}, "peak_mib",
                        memory["peak_extra_bytes"] / 2**20, dtype=shape["dtype"]))
        return rows
    if results["kind"] == "decode":  # one query row per sequence over a cache of L keys
        shape = results["shape"]
        decode = {"mode": "decode", "heads": shape["heads_q"], "head_dim": shape["head_dim"]}
        rows = [row({}, "copy_tbps", results["copy_tbps"])] if results.get("copy_tbps") else []
        return rows + [row({**r, **decode, "seqlen": r["cache"]}, "tbps", r["tbps"],
                           dtype=r.get("cache_dtype", shape["dtype"]))  # an FP8 cache's rows: float8_e4m3fn
                       for r in results["rows"] if r["status"] == "ok"]
    if results["kind"] == "features":
        dtype = results["shape"]["dtype"]

        def featured(source: dict, mode: str) -> dict:
            return {**source, "mode": mode if source["feature"] == "none" else f"{mode} {source['feature']}"}

        return ([row(featured(r, r["mode"]), "tflops", r["tflops"], dtype=dtype)
                 for r in results["speed"] if r["status"] == "ok"]
                + [row(featured(r, "fwd+bwd"), "rel_error", max(r["errors"].values()), dtype=dtype)
                   for r in results["checks"] if r["status"] in ("ok", "wrong")])
    if results["kind"] == "model":
        dtype = results["plan"]["precision"]
        models = {m["name"]: {"mode": f"train {m['name']}", "heads": m["heads"], "head_dim": m["head_dim"],
                              "causal": True} for m in results["models"]}
        return ([row({**r, **models[r["model"]]}, metric, r[metric], dtype=dtype)
                 for r in results["rows"] if r["status"] == "ok" for metric in ("tokens_per_s", "peak_mib")
                 if r[metric] is not None]
                + [row({**s, **models[s["model"]], "batch": 1}, "max_seqlen", s["longest"], dtype=dtype)
                   for s in results["searches"] if s["longest"] is not None])
    fp8 = {impl["name"]: impl["dtype"] for impl in results.get("implementations", []) if impl.get("dtype")}

    def measured(source: dict, metric: str, value: float, **fields) -> dict:
        """A row of the main sweep; an FP8 implementation's in its inputs' dtype, its check of o alone (fwd)."""
        if source["impl"] in fp8:
            fields.update(dtype=fp8[source["impl"]], **({"mode": "fwd"} if "mode" in fields else {}))
        return row(source, metric, value, **fields)

    rows = [row({}, metric, value) for metric, value in results.get("ceilings", {}).items()]
    rows += [measured(r, "tflops", r["tflops"]) for r in results.get("speed", []) if r["status"] == "ok"]
    rows += [measured(r, "host_us", r["host_us"]) for r in results.get("host", []) if r["status"] == "ok"]
    rows += [row(r, "peak_mib", r["mib"], mode="fwd+bwd") for r in results.get("memory", []) if r["status"] == "ok"]
    rows += [measured(r, "rel_error", max(r["errors"].values()), mode="fwd+bwd")
             for r in results.get("checks", []) if r["status"] in ("ok", "wrong")]
    return rows


def append_history(results: dict, out_dir: Path) -> list[dict]:
    """Append ``results``' history rows to ``out_dir``/history.csv, except those already there."""
    return append_rows(history_rows(results), Path(out_dir) / HISTORY)


def append_rows(rows: list[dict], path: Path) -> list[dict]:
    path = Path(path)
    seen = set()
    if path.exists():
        with path.open(newline="") as file:
            seen = {tuple(row[name] for name in HISTORY_FIELDS) for row in csv.DictReader(file)}
    added = []
    for row in rows:
        key = tuple(str(row[name]) for name in HISTORY_FIELDS)
        if key not in seen:
            seen.add(key)
            added.append(row)
    if added:
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        with path.open("a", newline="") as file:
            writer = csv.DictWriter(file, HISTORY_FIELDS, lineterminator="\n")
            if new:
                writer.writeheader()
            writer.writerows(added)
    return added
