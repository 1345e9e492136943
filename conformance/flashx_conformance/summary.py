"""Merge the JSON reports of conformance runs (``--flashx-report``) into one case x backend table.

    python -m flashx_conformance.summary REPORT.json... [--markdown PATH] [--json PATH]

A cell is pass, FAIL, or skip with a numbered reason listed under the table, so that every
skip is visible with its cause. The table (a line per case, hundreds) goes to markdown and
JSON as asked; stdout gets a few lines per backend: its counts and its failed cases by name.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import Counter
from pathlib import Path

CELL = {"passed": "pass", "failed": "FAIL", "skipped": "skip", "xfailed": "xfail"}
#: Failed cases named per backend in the short summary; the table has the rest.
NAMED_FAILURES = 10


def _label(report: dict) -> str:
    """The report's column: its backend, and the kind of arrays where the run named one."""
    return report.get("label", report["backend"])


def load(paths: list[Path]) -> list[dict]:
    """One report per column: reports of one backend and kind of arrays (parts of a run, say the
    slow tier run apart) are joined."""
    by_label: dict[str, dict] = {}
    for path in paths:
        report = json.loads(path.read_text())
        if _label(report) in by_label:
            by_label[_label(report)]["results"] += report["results"]
        else:
            by_label[_label(report)] = report
    return sorted(by_label.values(), key=_label)


def merge(reports: list[dict]) -> dict:
    """{"backends": {name: header and counts}, "cases": {case: {backend: {outcome, reason}}}}."""
    backends, cases = {}, {}
    for report in reports:
        header = {key: value for key, value in report.items() if key != "results"}
        header["counts"] = dict(Counter(result["outcome"] for result in report["results"]))
        header["seconds"] = round(sum(result["duration"] for result in report["results"]), 1)
        backends[_label(report)] = header
        for result in report["results"]:
            cases.setdefault(result["case"], {})[_label(report)] = {"outcome": result["outcome"], "reason": result["reason"]}
    return {"backends": backends, "cases": dict(sorted(cases.items()))}


def markdown(merged: dict) -> str:
    names = list(merged["backends"])
    reasons: dict[str, int] = {}

    def cell(result):
        if result is None:
            return "-"
        text = CELL.get(result["outcome"], result["outcome"])
        if result["reason"]:
            number = reasons.setdefault(result["reason"], len(reasons) + 1)
            text += f" [{number}]"
        return text

    lines = ["| backend | version | device | tier | pass | fail | skip | seconds |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, header in merged["backends"].items():
        counts = header["counts"]
        lines.append(
            f"| {name} | {header['version']} | {header['device']} | {header['tier']} | {counts.get('passed', 0)} "
            f"| {counts.get('failed', 0)} | {counts.get('skipped', 0)} | {header['seconds']} |"
        )
    lines += ["", "| case | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for case, results in merged["cases"].items():
        lines.append(f"| `{case}` | " + " | ".join(cell(results.get(name)) for name in names) + " |")
    if reasons:
        lines += ["", "Skip reasons:", ""]
        lines += [f"{number}. {reason}" for reason, number in reasons.items()]
    return "\n".join(lines) + "\n"


def brief(merged: dict) -> str:
    """A few lines per backend: where and how it ran, its counts, its failed cases by name."""
    width = max(map(len, merged["backends"]), default=0)
    lines = []
    for name, header in merged["backends"].items():
        counts = header["counts"]
        simulated = "".join(f" under {variable}=1" for variable in header.get("simulators", []))
        tally = ", ".join(f"{counts.get(outcome, 0)} {outcome}" for outcome in ("passed", "failed", "skipped"))
        if counts.get("xfailed"):
            tally += f", {counts['xfailed']} xfailed"
        lines.append(f"{name:<{width}}  {tally}  ({header['device']}{simulated}, tier {header['tier']})")
        indent = " " * (width + 2)
        if not header.get("available", True):
            lines.append(f"{indent}not available here: {header['reason']}")
        failed = [case for case, results in merged["cases"].items() if results.get(name, {}).get("outcome") == "failed"]
        lines += [f"{indent}FAILED {case}" for case in failed[:NAMED_FAILURES]]
        if len(failed) > NAMED_FAILURES:
            lines.append(f"{indent}... and {len(failed) - NAMED_FAILURES} more failed")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JSON files written by --flashx-report")
    parser.add_argument("--markdown", type=Path, help="write the table as markdown here")
    parser.add_argument("--json", type=Path, help="write the merged table as JSON here")
    args = parser.parse_args(argv)
    merged = merge(load(args.reports))
    print(brief(merged), end="")
    outputs = [
        ("the case x backend table", args.markdown, markdown),
        ("the table as JSON", args.json, functools.partial(json.dumps, indent=1)),
    ]
    for what, path, render in outputs:
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(render(merged))
            print(f"{what}: {path}")
    failed = sum(header["counts"].get("failed", 0) for header in merged["backends"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
