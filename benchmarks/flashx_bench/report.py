"""What a run's JSON becomes: markdown tables (flashx/peer ratios), the README headline, a plot.

Everything here reads the JSON alone, so tables and plots can be redrawn on any machine.
"""

from __future__ import annotations

import copy
from pathlib import Path

MODES = ("fwd", "fwd+bwd")
SECTIONS = ("check", "memory", "speed", "host")  # a GPU run's, in the order they run, after the ceilings
HEADLINE_SEQLEN = 8192
NOT_APPLICABLE = "not applicable: FP8 attention is forward only"  # an FP8 implementation's fwd+bwd rows
#: Issue 43's targets for the FP8 forward, at the speed section's point (head dim, N) = FP8_TARGET_POINT
#: (B·N = 16k, H·D = 2048), causal and not: per backend, its FP8 forward at least FP8_TARGET_SPEEDUPS
#: times the speed of its own bf16 forward, or at least FP8_TARGET_TFLOPS.
FP8_TARGET_POINT = (128, 8192)
FP8_TARGET_SPEEDUPS = {"triton": 1.4}
FP8_TARGET_TFLOPS = {"cupy": 1000.0}


def merge(base: dict, extra: dict) -> dict:
    """``base`` with the rows of ``extra`` (a later run of some implementations on the same device)
    in place of its rows for the same implementation and configuration."""
    if extra["device"] != base["device"]:
        raise ValueError(f"results from {extra['device']} do not merge into results from {base['device']}")
    merged = copy.deepcopy(base)
    known = {impl["name"] for impl in merged["implementations"]}
    merged["implementations"] += [impl for impl in extra["implementations"] if impl["name"] not in known]
    sections = [section for section in ("checks", "memory", "speed", "host") if extra.get(section)]
    for section in sections:
        rows = {_row_key(row): row for row in merged.get(section, [])}
        rows.update({_row_key(row): row for row in extra[section]})
        merged[section] = list(rows.values())
    merged.setdefault("merged", []).append({"date": extra["date"], "sections": sections, "versions": extra["versions"],
                                            "ceilings": extra["ceilings"]})
    return merged


def _row_key(row: dict) -> tuple:
    return tuple(row.get(field) for field in ("impl", "mode", "batch", "seqlen", "heads", "head_dim", "causal"))


# Reading the results -------------------------------------------------------------------------


def _labels(results: dict) -> dict[str, str]:
    return {impl["name"]: impl["label"] for impl in results["implementations"]}


def _split(results: dict) -> tuple[list[str], list[str]]:
    """(flashx implementations, peers), in the run's order."""
    impls = results["implementations"]
    return [i["name"] for i in impls if i["flashx"]], [i["name"] for i in impls if not i["flashx"]]


def _fp8_baselines(results: dict) -> dict[str, str | None]:
    """Each FP8 implementation, and the bf16 implementation of its backend in the run (None where absent)."""
    impls = results["implementations"]
    # .get: the records made before FP8 name no backend, and have no FP8 implementation to look one up
    plain = {i.get("backend"): i["name"] for i in impls if i["flashx"] and not i.get("dtype")}
    return {i["name"]: plain.get(i["backend"]) for i in impls if i.get("dtype")}


def _marks(results: dict) -> dict[tuple[str, int, bool], str]:
    """(implementation, head_dim, causal) whose check failed or could not run: their numbers
    are marked, never hidden."""
    return {
        (c["impl"], c["head_dim"], c["causal"]): "WRONG" if c["status"] == "wrong" else "unchecked"
        for c in results["checks"]
        if c["status"] != "ok"
    }


def _speed_index(results: dict) -> dict[tuple, dict]:
    return {(r["impl"], r["mode"], r["head_dim"], r["causal"], r["seqlen"]): r for r in results["speed"]}


def _configurations(results: dict) -> list[tuple[int, bool, int]]:
    """(head_dim, causal, seqlen) present in the speed rows, sorted."""
    return sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in results["speed"]})


def ratios(results: dict) -> list[dict]:
    """Speed-up of each flashx implementation over each peer (peer time / flashx time), per
    configuration; an FP8 one is set against its own backend's bf16 forward instead (``fp8_ratios``)."""
    index = _speed_index(results)
    flashx_impls, peers = _split(results)
    fp8 = _fp8_baselines(results)
    rows = []
    for mode in MODES:
        for head_dim, causal, seqlen in _configurations(results):
            for ours in (name for name in flashx_impls if name not in fp8):
                mine = index.get((ours, mode, head_dim, causal, seqlen))
                for peer in peers:
                    theirs = index.get((peer, mode, head_dim, causal, seqlen))
                    if mine and theirs and mine["status"] == theirs["status"] == "ok":
                        rows.append(
                            {"mode": mode, "head_dim": head_dim, "causal": causal, "seqlen": seqlen,
                             "flashx": ours, "peer": peer, "ratio": theirs["ms"] / mine["ms"]}
                        )
    return rows


def fp8_ratios(results: dict) -> list[dict]:
    """Each FP8 implementation's forward speed over its backend's bf16 forward (bf16 time / FP8 time),
    per configuration where both were measured."""
    index = _speed_index(results)
    found = []
    for fp8, plain in _fp8_baselines(results).items():
        for head_dim, causal, seqlen in _configurations(results):
            mine, theirs = (index.get((name, "fwd", head_dim, causal, seqlen)) for name in (fp8, plain))
            if mine and theirs and mine["status"] == theirs["status"] == "ok":
                found.append({"impl": fp8, "head_dim": head_dim, "causal": causal, "seqlen": seqlen,
                              "ratio": theirs["ms"] / mine["ms"]})
    return found


def fp8_targets(results: dict) -> list[dict]:
    """Issue 43's targets for the FP8 forward (FP8_TARGET_SPEEDUPS, FP8_TARGET_TFLOPS), causal and not:
    what was asked, what was measured at each point, and met (True; False where a point falls short
    or its check failed; None, not measured, where a point has no number and none falls short)."""
    index, marks = _speed_index(results), _marks(results)
    head_dim, seqlen = FP8_TARGET_POINT
    speedups = {(r["impl"], r["causal"]): r["ratio"] for r in fp8_ratios(results)
                if (r["head_dim"], r["seqlen"]) == FP8_TARGET_POINT}
    fp8_of = {i["backend"]: i["name"] for i in results["implementations"] if i.get("dtype")}
    where = f"d{head_dim}, N={_seqlen(seqlen)}, B·N={results['plan']['tokens']}, H·D={results['plan']['model_dim']}"
    asked = [(backend, f"flashx {backend} FP8 forward >= {limit:.1f}x its own bf16 forward ({where})", limit, True)
             for backend, limit in FP8_TARGET_SPEEDUPS.items()]
    asked += [(backend, f"flashx {backend} FP8 forward >= {limit:.0f} TFLOP/s ({where})", limit, False)
              for backend, limit in FP8_TARGET_TFLOPS.items()]
    found = []
    for backend, target, limit, relative in asked:
        fp8 = fp8_of.get(backend)
        if fp8 is None:
            found.append({"target": target, "measured": "not in this run", "met": None})
            continue
        parts, values, wrong = [], [], False
        for causal in (False, True):
            row = index.get((fp8, "fwd", head_dim, causal, seqlen))
            if relative:
                value = speedups.get((fp8, causal))
            else:
                value = row["tflops"] if row is not None and row["status"] == "ok" else None
            label = "causal" if causal else "not causal"
            if value is None:
                why = "no row" if row is None else _short(row["status"]) if row["status"] != "ok" else "no bf16 forward"
                parts.append(f"{label}: {why}")
                continue
            values.append(value)
            checked = marks.get((fp8, head_dim, causal))
            wrong |= checked == "WRONG"
            parts.append(f"{label}: " + (f"{value:.2f}x" if relative else f"{value:.0f} TFLOP/s")
                         + (f" {checked}" if checked else ""))
        short = wrong or any(value < limit for value in values)
        found.append({"target": target, "measured": "; ".join(parts),
                      "met": False if short else True if len(values) == 2 else None})
    return found


# Markdown ------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _short(status: str) -> str:
    return status.split(":")[0]


def _speed_cell(row: dict | None, mark: str | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return _short(row["status"])
    return f"{row['tflops']:.0f} ({row['fraction']:.0%})" + (f" {mark}" if mark else "")


def _seqlen(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _title(results: dict) -> str:
    v = results["versions"]
    return (
        f"# flashx benchmarks: {results['device']}, {results['date']}\n\n"
        f"torch {v['torch']} (CUDA {v['cuda']}), triton {v['triton']}, flashx {v['flashx']}, "
        + (f"flash-attn-4 {v['flash-attn-4']}, " if "flash-attn-4" in v else "")
        + f"Python {v['python']}."
    )


def markdown(results: dict) -> str:
    plan, timing, ceilings = results["plan"], results["timing"], results["ceilings"]
    lines = [
        _title(results),
        "",
        f"Ceilings measured in this run: {plan['dtype']} {plan['matmul_size']}^3 matmul "
        f"**{ceilings.get('matmul_tflops', float('nan')):.0f} TFLOP/s**; device copy "
        f"**{ceilings.get('copy_tbps', float('nan')):.2f} TB/s** (bytes read + written).",
        "",
        f"{plan['dtype']}, B*N = {plan['tokens']} tokens, H*D = {plan['model_dim']}. Times are medians of "
        f"`triton.testing.do_bench` (CUDA events, {timing['warmup_ms']} ms warm-up, {timing['rep_ms']} ms of "
        "repeats, L2 flushed before each"
        + (f"; each timing after a first call and {timing['rest_s']:g} s of idle GPU" if "rest_s" in timing else "")
        + "). TFLOP/s as flash-attn counts: forward 4*B*H*N*N*D, halved when "
        "causal; forward+backward 3.5x the forward. In parentheses: the fraction of the matmul ceiling. "
        "flashx runs on BSHD inputs, the peers on BHSD, each contiguous in its own layout.",
    ]
    if results.get("merged"):
        runs = "; ".join(f"{run['date']}: {', '.join(run.get('sections', [])) or 'rows'}" for run in results["merged"])
        lines += ["", f"Rows of other runs on this device merged in (`flashx bench merge`), each with its own "
                      f"ceilings: {runs}."]
    if any(r["seqlen"] == HEADLINE_SEQLEN for r in results["speed"]):
        lines += ["", f"## Headline: TFLOP/s at N={_seqlen(HEADLINE_SEQLEN)}", "", headline(results).rstrip()]
    lines += _fp8_section(results)
    lines += _check_section(results) + _speed_sections(results) + _clock_section(results) + _host_section(results)
    lines += _memory_section(results)
    lines += _not_measured(results)
    if results.get("sections_s"):
        lines += ["", "Seconds per section: " + ", ".join(f"{k} {v:.0f}" for k, v in results["sections_s"].items()) + "."]
    return "\n".join(lines) + "\n"


def _fp8_section(results: dict) -> list[str]:
    """Issue 43's targets, then each FP8 implementation's forward TFLOP/s and its speed over its
    backend's bf16 forward; nothing for a run without FP8 implementations."""
    baselines = _fp8_baselines(results)
    if not baselines:
        return []
    labels, marks, index = _labels(results), _marks(results), _speed_index(results)
    speedups = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["ratio"] for r in fp8_ratios(results)}
    met = {True: "yes", False: "**no**", None: "not measured"}
    tolerance = results["timing"].get("fp8_check_tolerance")
    lines = [
        "",
        "## FP8 (issue 43)",
        "",
        "`flashx-<backend>-fp8`: the backend on the same inputs cast to float8_e4m3fn, descales of 1 (None), "
        "o in bfloat16; forward only, so its forward+backward, memory and forward+backward host time are not "
        "applicable. Its check compares o with the same float32 reference as the bf16 implementations'"
        + (f", WRONG above a relative error of {tolerance:g}" if tolerance else "") + ". Its fractions in the "
        "speed tables are of the bf16 matmul ceiling, which FP8 tensor cores double.",
        "",
        *_table(["target", "measured", "met"],
                [[t["target"], t["measured"], met[t["met"]]] for t in fp8_targets(results)]),
    ]

    def cell(name, key):
        row = index.get((name, "fwd", *key))
        if row is None or row["status"] != "ok":
            return "-" if row is None else _short(row["status"])
        mark = marks.get((name, key[0], key[1]))
        speedup = speedups.get((name, *key))
        return (f"{row['tflops']:.0f}" + (f" ({speedup:.2f}x)" if speedup is not None else "")
                + (f" {mark}" if mark else ""))

    configs = [c for c in _configurations(results) if any((name, "fwd", *c) in index for name in baselines)]
    rows = [[str(d), "yes" if c else "no", _seqlen(n)] + [cell(name, (d, c, n)) for name in baselines]
            for d, c, n in configs]
    lines += ["", "### FP8 forward: TFLOP/s (in parentheses: speed over the same backend's bf16 forward)", ""]
    return lines + _table(["d", "causal", "N"] + [labels[name] for name in baselines], rows)


def _check_section(results: dict) -> list[str]:
    if not results["checks"]:
        return []
    labels = _labels(results)
    checks = sorted({(c["head_dim"], c["causal"]) for c in results["checks"]})
    found = {(c["impl"], c["head_dim"], c["causal"]): c for c in results["checks"]}
    first = results["checks"][0]
    fp8_tolerance = results["timing"].get("fp8_check_tolerance") if _fp8_baselines(results) else None
    rows = []
    for name in sum(_split(results), []):
        cells = []
        for head_dim, causal in checks:
            check = found.get((name, head_dim, causal))
            if check is None:
                cells.append("-")
            elif check["errors"]:
                worst = max(check["errors"].values(), key=lambda e: e if e == e else float("inf"))  # NaN is worst
                cells.append(("WRONG " if check["status"] != "ok" else "") + f"{worst:.1e}")
            else:
                cells.append(_short(check["status"]))
        rows.append([labels[name]] + cells)
    return [
        "",
        f"## Check: largest relative error of o, dq, dk, dv against SDPA math in float32 "
        f"(B={first['batch']}, N={first['seqlen']}, H={first['heads']}; WRONG above "
        f"{results['timing']['check_tolerance']:g}"
        + (f"; FP8: o alone, WRONG above {fp8_tolerance:g}" if fp8_tolerance else "") + ")",
        "",
        *_table(["implementation"] + [f"d{d}{' causal' if c else ''}" for d, c in checks], rows),
    ]


def _speed_sections(results: dict) -> list[str]:
    """Per mode: TFLOP/s of every implementation, then the speed-up of each flashx backend over each peer."""
    labels, marks, index = _labels(results), _marks(results), _speed_index(results)
    flashx_impls, peers = _split(results)
    names = flashx_impls + peers
    fp8 = _fp8_baselines(results)  # set against their own backend's bf16 forward in the FP8 section instead
    pairs = [(ours, peer) for ours in flashx_impls if ours not in fp8 for peer in peers]
    speedups = {(r["mode"], r["head_dim"], r["causal"], r["seqlen"], r["flashx"], r["peer"]): r["ratio"]
                for r in ratios(results)}
    lines = []
    for mode in MODES:
        configs = [c for c in _configurations(results) if any((n, mode, *c) in index for n in names)]
        if not configs:
            continue
        title = "forward" if mode == "fwd" else "forward+backward"
        rows = [
            [str(d), "yes" if c else "no", _seqlen(n)]
            + [_speed_cell(index.get((name, mode, d, c, n)), marks.get((name, d, c))) for name in names]
            for d, c, n in configs
        ]
        lines += ["", f"## Speed, {title}: TFLOP/s (fraction of the matmul ceiling)", ""]
        lines += _table(["d", "causal", "N"] + [labels[n] for n in names], rows)
        if not pairs:
            continue
        rows = [
            [str(d), "yes" if c else "no", _seqlen(n)]
            + [f"{speedups[key]:.2f}" if (key := (mode, d, c, n, ours, peer)) in speedups else "-" for ours, peer in pairs]
            for d, c, n in configs
        ]
        lines += ["", f"## Speed-up of flashx over each peer, {title} (peer time / flashx time)", ""]
        lines += _table(["d", "causal", "N"] + [f"{labels[o]} / {labels[p]}" for o, p in pairs], rows)
    return lines


def _clock_section(results: dict) -> list[str]:
    """Per mode: the SM clock while each point was timed (``gpu.SmClock``)."""
    if not any(r.get("sm_mhz") for r in results["speed"]):
        return []
    labels, index = _labels(results), _speed_index(results)
    names = [impl["name"] for impl in results["implementations"]]
    lines = []
    for mode in MODES:
        configs = [c for c in _configurations(results) if any((n, mode, *c) in index for n in names)]
        rows = [
            [str(d), "yes" if c else "no", _seqlen(n)]
            + [f"{row['sm_mhz']:.0f}" if (row := index.get((name, mode, d, c, n))) and row.get("sm_mhz") else "-"
               for name in names]
            for d, c, n in configs
        ]
        title = "forward" if mode == "fwd" else "forward+backward"
        lines += ["", f"## SM clock while timed (MHz), {title}", ""]
        if mode == MODES[0]:
            lines += ["Medians over each point's repeats. At its power cap a GPU lowers the clock, so there the "
                      "speed-ups compare the energy each call takes as much as its speed; a point timed after "
                      "idle seconds (a compile) starts below the cap.", ""]
        lines += _table(["d", "causal", "N"] + [labels[n] for n in names], rows)
    return lines


def _host_section(results: dict) -> list[str]:
    """Per mode: the host's time per call (``gpu.Sweep.host``) beside the GPU's (the speed rows)."""
    host = [row for row in results.get("host", []) if row["status"] == "ok"]
    if not host:
        return []
    labels, speed = _labels(results), _speed_index(results)
    names = [impl["name"] for impl in results["implementations"]]
    index = {(r["impl"], r["mode"], r["head_dim"], r["causal"], r["seqlen"]): r for r in host}
    lines = []
    for mode in MODES:
        configs = sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in host if r["mode"] == mode})
        rows = []
        for d, c, n in configs:
            cells = []
            for name in names:
                row, timed = index.get((name, mode, d, c, n)), speed.get((name, mode, d, c, n))
                gpu = f" / {timed['ms'] * 1e3:.0f}" if timed and timed["status"] == "ok" else ""
                cells.append(f"{row['host_us']:.0f}{gpu}" if row else "-")
            rows.append([str(d), "yes" if c else "no", _seqlen(n)] + cells)
        title = "forward" if mode == "fwd" else "forward+backward"
        lines += ["", f"## Host time per call (µs), {title}: host / GPU", ""]
        if mode == MODES[0]:
            lines += ["Host: wall time per call, calls back to back behind queued GPU work, so that none waits on "
                      "the GPU (median of rounds). GPU: the speed section's median. Where the host's time "
                      "approaches the GPU's, a step without do_bench's head start waits on the host.", ""]
        lines += _table(["d", "causal", "N"] + [labels[n] for n in names], rows)
    return lines


def _memory_section(results: dict) -> list[str]:
    if not results["memory"]:
        return []
    labels = _labels(results)
    names = sum(_split(results), [])
    memory = {(m["impl"], m["seqlen"]): m for m in results["memory"]}
    rows = []
    for n in sorted({m["seqlen"] for m in results["memory"]}):
        cells = []
        for name in names:
            m = memory.get((name, n))
            cells.append("-" if m is None else f"{m['mib']:.0f}" if m["status"] == "ok" else _short(m["status"]))
        rows.append([_seqlen(n)] + cells)
    first = results["memory"][0]
    return [
        "",
        f"## Memory: peak MiB allocated beyond q, k, v, do by forward+backward "
        f"(B={first['batch']}, H={first['heads']}, D={first['head_dim']}, causal; gradients included)",
        "",
        *_table(["N"] + [labels[n] for n in names], rows),
    ]


def _not_measured(results: dict) -> list[str]:
    """Every status other than ok, with the configurations it struck: nothing is dropped silently.
    (NOT_APPLICABLE is no failure: the tables show it, and the FP8 section says why.)"""
    labels = _labels(results)
    struck: dict[tuple[str, str], list[str]] = {}
    for row in results["speed"]:
        if row["status"] not in ("ok", NOT_APPLICABLE):
            where = f"{row['mode']} d{row['head_dim']}{' causal' if row['causal'] else ''} N={row['seqlen']}"
            struck.setdefault((row["impl"], row["status"]), []).append(where)
    for row in results.get("host", []):
        if row["status"] not in ("ok", NOT_APPLICABLE):
            where = f"host {row['mode']} d{row['head_dim']} N={row['seqlen']}"
            struck.setdefault((row["impl"], row["status"]), []).append(where)
    for row in results["memory"]:
        if row["status"] not in ("ok", NOT_APPLICABLE):
            struck.setdefault((row["impl"], row["status"]), []).append(f"memory N={row['seqlen']}")
    for row in results["checks"]:
        if row["status"] not in ("ok", "wrong"):
            where = f"check d{row['head_dim']}{' causal' if row['causal'] else ''}"
            struck.setdefault((row["impl"], row["status"]), []).append(where)
    absent = results.get("absent", {})
    if not struck and not absent:
        return []
    runs = {}
    for row in results["speed"] + results.get("host", []) + results["memory"] + results["checks"]:
        if row["status"] != NOT_APPLICABLE:
            runs[row["impl"]] = runs.get(row["impl"], 0) + 1
    lines = ["", "## Not measured", ""] + [f"- {name}: absent: {reason}" for name, reason in absent.items()]
    for (name, status), where in struck.items():
        shown = "everywhere" if len(where) == runs[name] else "; ".join(where)
        lines.append(f"- {labels.get(name, name)}: {status} ({shown})")
    return lines


def headline(results: dict, seqlen: int = HEADLINE_SEQLEN) -> str:
    """The project README's table: TFLOP/s of every implementation at one N, one column per configuration."""
    labels = _labels(results)
    flashx_impls, peers = _split(results)
    index = _speed_index(results)
    marks = _marks(results)
    configs = [
        (mode, d, c)
        for d in sorted({r["head_dim"] for r in results["speed"]}, reverse=True)
        for c in (False, True)
        for mode in MODES
        if any(r["head_dim"] == d and r["causal"] == c and r["mode"] == mode and r["seqlen"] == seqlen
               for r in results["speed"])
    ]
    header = [f"N={_seqlen(seqlen)}"] + [f"{mode} d{d}{' causal' if c else ''}" for mode, d, c in configs]
    rows = []
    for name in flashx_impls + peers:
        cells = []
        for mode, d, c in configs:
            row = index.get((name, mode, d, c, seqlen))
            if row is None or row["status"] != "ok":
                cells.append("-" if row is None else _short(row["status"]))
            else:
                mark = marks.get((name, d, c))
                cells.append(f"{row['tflops']:.0f}" + (f" {mark}" if mark else ""))
        rows.append([labels[name]] + cells)
    ceilings = results["ceilings"]
    caption = (
        f"TFLOP/s on {results['device']} ({results['date']}), {results['plan']['dtype']}, "
        f"B*N = {results['plan']['tokens']}, H*D = {results['plan']['model_dim']}; "
        f"matmul ceiling {ceilings.get('matmul_tflops', float('nan')):.0f} TFLOP/s."
    )
    return "\n".join(_table(header, rows) + ["", caption]) + "\n"


# Plots ---------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> Path:
    """One figure at ``path``: TFLOP/s vs N, a panel per head dim x causal x mode, and below them
    the peak memory vs N (log scale) when the run measured it.

    Raises ModuleNotFoundError without matplotlib; the caller says how to draw it later.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = _labels(results)
    marks = _marks(results)
    names = [i["name"] for i in results["implementations"]]
    colors = {name: f"C{i}" for i, name in enumerate(names)}  # the same in every panel
    speed = [r for r in results["speed"] if r["status"] == "ok"]
    memory = [m for m in results["memory"] if m["status"] == "ok"]
    head_dims = sorted({r["head_dim"] for r in speed})
    panels = [(c, mode) for c in (False, True) for mode in MODES if any(r["causal"] == c and r["mode"] == mode for r in speed)]
    columns = max(len(panels), 2)
    rows = len(head_dims) + bool(memory)
    fig = plt.figure(figsize=(4.2 * columns, 3.4 * rows))
    grid = fig.add_gridspec(rows, columns)

    seqlens = sorted({r["seqlen"] for r in speed})
    speed_axes = []
    for i, d in enumerate(head_dims):
        for j, (c, mode) in enumerate(panels):
            ax = fig.add_subplot(grid[i, j], sharey=speed_axes[0] if speed_axes else None)
            speed_axes.append(ax)
            for name in names:
                points = sorted((r["seqlen"], r["tflops"]) for r in speed
                                if r["impl"] == name and r["head_dim"] == d and r["causal"] == c and r["mode"] == mode)
                if points:
                    mark = marks.get((name, d, c))
                    label = labels[name] + (f" ({mark})" if mark else "")
                    ax.plot(*zip(*points), marker="o", markersize=3, label=label, color=colors[name])
            if "matmul_tflops" in results["ceilings"]:
                ax.axhline(results["ceilings"]["matmul_tflops"], color="gray", linestyle="--", linewidth=1,
                           label=f"{results['plan']['dtype']} matmul ceiling")
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [_seqlen(n) for n in seqlens])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{mode}, d{d}{', causal' if c else ''}", fontsize=10)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(head_dims) - 1:
                ax.set_xlabel("N")
    if memory:
        ax = fig.add_subplot(grid[-1, :2])
        for name in names:
            points = sorted((m["seqlen"], m["mib"]) for m in memory if m["impl"] == name)
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=labels[name], color=colors[name])
        memory_seqlens = sorted({m["seqlen"] for m in results["memory"]})
        first = results["memory"][0]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(memory_seqlens, [_seqlen(n) for n in memory_seqlens])
        ax.set_xlabel("N")
        ax.set_ylabel("MiB beyond q, k, v, do")
        ax.set_title(f"peak memory, fwd+bwd, B={first['batch']}, H={first['heads']}, d{first['head_dim']}, causal",
                     fontsize=10)
        ax.grid(alpha=0.3, which="both")
        speed_axes.append(ax)
    handles, legend = _legend(speed_axes)
    fig.legend(handles, legend, loc="lower center", ncol=min(len(legend), 4), fontsize=9)
    fig.suptitle(f"Attention throughput, {results['device']}, {results['date']}")
    fig.tight_layout(rect=(0, 0.04 + 0.03 * (len(legend) // 4), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _legend(axes):
    seen = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    return list(seen.values()), list(seen)


def cpu_markdown(results: dict) -> str:
    """The CPU comparison (``flashx_bench.cpu.run``): NumPy backend vs torch's CPU SDPA, forward, fp32."""
    from flashx_bench.cpu import IMPLEMENTATIONS

    shape, threads, forward, memory, v = (
        results[key] for key in ("shape", "threads", "forward", "memory", "versions")
    )
    rows = [[label, f"{forward[name]['median_s'] * 1e3:.1f}", f"{forward[name]['gflops']:.1f}"]
            for name, label in IMPLEMENTATIONS.items()]
    pairs = len(forward["flashx-numpy"]["times_s"])
    lines = [
        f"# flashx CPU benchmark: {results['device']}, {results['date']}",
        "",
        f"numpy {v['numpy']}, torch {v['torch']}, flashx {v['flashx']}, Python {v['python']}; "
        f"NumPy backend workers {threads['numpy_backend_workers']}, torch threads {threads['torch']}.",
        "",
        f"**flashx numpy runs at {results['speed_vs_torch_sdpa']:.2f}x the speed of torch SDPA** "
        f"(forward, {shape['dtype']}, B={shape['batch']}, H={shape['heads']}, N={shape['seqlen']}, "
        f"D={shape['head_dim']}, {'causal' if shape['causal'] else 'not causal'}): the median, over {pairs} "
        "pairs of back-to-back calls, of SDPA's time over flashx's, so that a change in machine load "
        "hits both sides of a ratio alike. Largest absolute difference between the two "
        f"{results['max_abs_difference_vs_torch']:.1e}; 1-minute load average "
        f"{results['load_average_1min']['before']:.1f} before, {results['load_average_1min']['after']:.1f} after.",
        "",
        *_table(["implementation", "median ms", "GFLOP/s (4*B*H*N*N*D)"], rows),
        "",
        f"Memory at N={memory['seqlen']}: the NumPy backend's forward allocates at most "
        f"{memory['peak_extra_bytes'] / 2**20:.1f} MiB beyond its inputs (tracemalloc, output included), "
        f"{memory['fraction_of_dense']:.1%} of the {memory['dense_scores_bytes'] / 2**20:.1f} MiB of dense "
        f"float32 scores it never materialises.",
    ]
    return "\n".join(lines) + "\n"
