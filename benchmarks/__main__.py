"""python -m benchmarks: the GPU sweep (default), the CPU comparison (--cpu), and redrawing
tables and plots from a run's JSON (table, plot, headline)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from pathlib import Path

from benchmarks import report

RESULTS = Path(__file__).parent / "results"
SECTIONS = ("check", "memory", "speed")  # the GPU sweep's, after its ceilings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--cpu", action="store_true", help="the NumPy backend against torch's CPU SDPA instead")
    parser.add_argument("--quick", action="store_true", help="N in {2k, 8k}, d128 only (and memory up to 16k)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"directory for the results (default {RESULTS})")
    parser.add_argument("--impl", nargs="+", metavar="NAME", help="time only these (flashx-triton, sdpa-cudnn, flex, ...)")
    parser.add_argument("--seqlens", type=int, nargs="+", metavar="N",
                        help="the speed section's N (default 512 to 16k)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS, metavar="NAME",
                        help=f"run only these of {', '.join(SECTIONS)} (the ceilings always run)")
    parser.add_argument("--time-limit", type=float, metavar="S",
                        help="after S seconds, skip what is left (marked in the results) and write the outputs")
    parser.add_argument("--compile-budget", type=float, metavar="S",
                        help="after S seconds spent on FlexAttention (compiles included), skip its remaining shapes")
    commands = parser.add_subparsers(dest="command", metavar="{table,plot,headline,merge}")
    for name, help_text in (("table", "rewrite FILE.md from FILE.json and print it"),
                            ("plot", "draw FILE.png and FILE-memory.png from FILE.json"),
                            ("headline", "print the README's table (one N) from FILE.json"),
                            ("merge", "put the rows of the runs EXTRA (say, --impl flex alone) into FILE.json, "
                                      "then rewrite its tables and plots")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("file", type=Path)
        if name == "headline":
            command.add_argument("--seqlen", type=int, default=8192)
        if name == "merge":
            command.add_argument("extra", type=Path, nargs="+")
    args = parser.parse_args(argv)

    if args.command is None:
        run_cpu(args.out) if args.cpu else run_gpu(args)
        return
    results = report.load_json(args.file)
    if args.command == "table":
        print(write_markdown(results, args.file), end="")
    elif args.command == "plot":
        write_plots(results, args.file)
    elif args.command == "merge":
        for extra in args.extra:
            results = report.merge(results, report.load_json(extra))
        report.save_json(results, args.file)
        write_markdown(results, args.file)
        write_plots(results, args.file)
    else:
        print(report.headline(results, args.seqlen), end="")


def run_gpu(args) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA device here: `python -m benchmarks --cpu` runs the CPU comparison")
    from benchmarks import gpu
    from benchmarks.implementations import implementations

    import flashx

    started = time.perf_counter()
    for info in flashx.backends():
        if not info.available:
            print(f"flashx backend {info.name} is not timed: {info.reason}")
    device = torch.device("cuda")
    plan = gpu.QUICK if args.quick else gpu.FULL
    suffix = "-quick" if args.quick else ""
    if args.seqlens:
        plan = dataclasses.replace(plan, seqlens=tuple(args.seqlens))
        suffix += "-n" + "-".join(map(str, args.seqlens))
    sweep = gpu.Sweep(plan, implementations(device, args.impl), device, args.out, time_limit_s=args.time_limit,
                      compile_budget_s=args.compile_budget, suffix=suffix)
    results = sweep.run(args.sections)
    write_markdown(results, sweep.path)
    write_plots(results, sweep.path)
    print()
    print(report.headline(results, 8192 if 8192 in results["plan"]["seqlens"] else max(results["plan"]["seqlens"])))
    print("seconds per section:", results["sections_s"], f"total {time.perf_counter() - started:.0f} s")


def run_cpu(out_dir: Path, **shape) -> Path:
    """benchmarks.cpu.run (NumPy backend vs torch CPU SDPA, forward, fp32) to cpu-<date>.{json,md}."""
    from benchmarks import cpu

    results = cpu.run(**shape)
    path = Path(out_dir) / f"cpu-{datetime.date.today().isoformat()}.json"
    report.save_json(results, path)
    print(write_markdown(results, path, report.cpu_markdown), end="")
    return path


def write_markdown(results: dict, json_path: Path, render=report.markdown) -> str:
    """``render(results)`` written beside the JSON as .md."""
    text = render(results)
    path = Path(json_path).with_suffix(".md")
    path.write_text(text)
    print(f"wrote {path}")
    return text


def write_plots(results: dict, json_path: Path) -> None:
    try:
        paths = report.plot(results, Path(json_path).with_suffix(""))
    except ModuleNotFoundError as error:
        print(f"no plots: {error.name} is not installed here; draw them on another machine with "
              f"`python -m benchmarks plot {json_path}`")
        return
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
