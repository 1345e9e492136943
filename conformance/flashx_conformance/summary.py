"""Merge the JSON reports of conformance runs (``--flashx-report``) into one case x backend table.

    python -m flashx_conformance.summary REPORT.json... [--markdown PATH] [--json PATH]

A cell is pass, FAIL, or skip with a numbered reason listed under the table, so that every
skip is visible with its cause. The table goes to stdout and, as asked, to markdown and JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

CELL = {"passed": "pass", "failed": "FAIL", "skipped": "skip", "xfailed": "xfail"}


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JSON files written by --flashx-report")
    parser.add_argument("--markdown", type=Path, help="write the table as markdown here")
    parser.add_argument("--json", type=Path, help="write the merged table as JSON here")
    args = parser.parse_args(argv)
    merged = merge(load(args.reports))
    text = markdown(merged)
    print(text)
    for path, content in ((args.markdown, text), (args.json, json.dumps(merged, indent=1))):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            print(f"written: {path}")
    failed = sum(header["counts"].get("failed", 0) for header in merged["backends"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
