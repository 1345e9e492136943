"""flashx bench (also python -m flashx_bench): the GPU sweep (default), the CPU comparison (--cpu),
and redrawing a record's tables and plot from its JSON (table, plot, headline, merge).
`flashx bench decode [ARGS]` runs the KV-cache decode sweep instead (`flashx bench decode --help`);
`flashx bench features [ARGS]` the cost of softcap, ALiBi and sinks beside FA4 and Flex
(`flashx bench features --help`); `flashx bench model [ARGS]` the training step of GPT-2 and a
Llama-shaped model through transformers' attention implementations (`flashx bench model --help`).
FlashAttention-4 (`fa4`) is timed where `flash_attn.cute` imports. FP8 (issue 43):
`flashx-<backend>-fp8` runs a backend on float8_e4m3fn casts of the same inputs, forward only,
set against its own bf16 forward in the record's FP8 section, with issue 43's targets.

A run replaces its device's record (<device>.json, .md, .png) in the output directory and
appends its numbers to history.csv there: --out DIR (default ./flashx-bench-results), or
--record for benchmarks/results of the source checkout (full sweeps only).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
from pathlib import Path

from flashx_bench import records, report

INSTALL = "pip install 'flashx-attention[triton,plot]'"
#: `flashx bench NAME ARGS`: the module flashx_bench.NAME, whose main(ARGS) parses its own options.
SUB_SWEEPS = ("decode", "features", "model")


def main(argv: list[str] | None = None, prog: str = "flashx bench") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SUB_SWEEPS:
        return importlib.import_module(f"flashx_bench.{argv[0]}").main(argv[1:])
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the NumPy backend against torch's CPU SDPA instead")
    parser.add_argument("--quick", action="store_true", help="N in {2k, 8k}, d128 only (host time at 1k, memory up to 16k)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=records.DEFAULT_OUT,
                       help=f"directory of the records and history (default ./{records.DEFAULT_OUT})")
    where.add_argument("--record", action="store_true",
                       help="update the source checkout's benchmarks/results instead (the full sweep only)")
    parser.add_argument("--impl", nargs="+", metavar="NAME",
                        help="time only these (flashx-triton, flashx-triton-fp8, fa4, sdpa-cudnn, flex, ...)")
    parser.add_argument("--seqlens", type=int, nargs="+", metavar="N", help="the speed section's N (default 512 to 16k)")
    parser.add_argument("--sections", nargs="+", choices=report.SECTIONS, default=report.SECTIONS, metavar="NAME",
                        help=f"run only these of {', '.join(report.SECTIONS)} (the ceilings always run)")
    parser.add_argument("--time-limit", type=float, metavar="S",
                        help="after S seconds, skip what is left (marked in the results) and write the record")
    parser.add_argument("--compile-budget", type=float, metavar="S",
                        help="after S seconds spent on FlexAttention (compiles included), skip its remaining shapes")
    commands = parser.add_subparsers(dest="command", metavar="{table,plot,headline,merge}")
    for name, help_text in (("table", "rewrite FILE.md from FILE.json and print it"),
                            ("plot", "draw FILE.png from FILE.json"),
                            ("headline", "print the README's table (one N) from FILE.json"),
                            ("merge", "put the rows of the runs EXTRA (say, --impl flex alone, run with another "
                                      "--out) into FILE.json, redraw its table and plot, add them to its history")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("file", type=Path)
        if name == "headline":
            command.add_argument("--seqlen", type=int, default=report.HEADLINE_SEQLEN)
        if name == "merge":
            command.add_argument("extra", type=Path, nargs="+")
    args = parser.parse_args(argv)

    if args.command is None:
        out = _out_dir(parser, args)
        return run_cpu(out) if args.cpu else run_gpu(args, out)
    results = records.load_json(args.file)
    if args.command == "table":
        print(_render(results)(results), end="")
        for path in records.redraw(results, args.file, _render(results)):
            print(f"wrote {path}")
    elif args.command == "plot":
        try:
            print(f"wrote {report.plot(results, args.file.with_suffix('.png'))}")
        except ModuleNotFoundError as error:
            sys.exit(f"flashx bench plot: needs {error.name}: pip install 'flashx-attention[plot]'")
    elif args.command == "merge":
        extras = [records.load_json(extra) for extra in args.extra]
        for extra in extras:
            results = report.merge(results, extra)
        records.save_json(results, args.file)
        for path in records.redraw(results, args.file, report.markdown, report.plot):
            print(f"wrote {path}")
        added = sum(len(records.append_history(extra, args.file.parent)) for extra in extras)
        print(f"{added} rows added to {args.file.parent / records.HISTORY}")
    else:
        print(report.headline(results, args.seqlen), end="")
    return 0


def _out_dir(parser: argparse.ArgumentParser, args) -> Path:
    """Where the run's record goes, after refusing options that would not do what they say."""
    partial = [flag for flag, used in (("--quick", args.quick), ("--impl", args.impl), ("--seqlens", args.seqlens),
                                       ("--sections", set(args.sections) != set(report.SECTIONS))) if used]
    budgets = [flag for flag, used in (("--time-limit", args.time_limit), ("--compile-budget", args.compile_budget))
               if used is not None]
    if args.cpu and partial + budgets:
        parser.error(f"--cpu runs one fixed comparison; {', '.join(partial + budgets)}: options of the GPU sweep")
    if not args.record:
        return args.out.resolve()
    if partial and not args.cpu:
        parser.error(f"--record keeps the full sweep as the device's record, and {', '.join(partial)} runs part of it: "
                     "run it with --out DIR, then `flashx bench merge benchmarks/results/<device>.json DIR/<device>.json`")
    return records.checkout_results()


def _render(results: dict):
    return report.cpu_markdown if results["kind"] == "cpu" else report.markdown


def run_gpu(args, out: Path) -> int:
    try:
        import torch
        import triton  # noqa: F401  (triton.testing times every implementation)
    except ImportError as error:
        sys.exit(f"flashx bench: the GPU sweep needs {error.name}: {INSTALL}")
    if not torch.cuda.is_available():
        sys.exit("flashx bench: no CUDA device here; `flashx bench --cpu` runs the CPU comparison")
    from flashx_bench import gpu
    from flashx_bench.implementations import implementations, say_what_is_not_timed

    started = time.perf_counter()
    device = torch.device("cuda")
    say_what_is_not_timed(device)
    plan = gpu.QUICK if args.quick else gpu.FULL
    if args.seqlens:
        plan = dataclasses.replace(plan, seqlens=tuple(args.seqlens))
    sweep = gpu.Sweep(plan, implementations(device, args.impl), device, out, time_limit_s=args.time_limit,
                      compile_budget_s=args.compile_budget)
    print(f"the record goes to {out}: {sweep.path.name.replace('.partial', '')}, .md, .png replaced; "
          f"{records.HISTORY} appended")
    results = sweep.run(args.sections)
    for path in records.publish(results, out, report.markdown, report.plot):
        print(f"wrote {path}")
    print()
    seqlens = {r["seqlen"] for r in results["speed"]}
    if seqlens:
        print(report.headline(results, report.HEADLINE_SEQLEN if report.HEADLINE_SEQLEN in seqlens else max(seqlens)))
    print("seconds per section:", results["sections_s"], f"total {time.perf_counter() - started:.0f} s")
    return 0


def run_cpu(out: Path, **shape) -> int:
    """``cpu.run(**shape)`` (NumPy backend vs torch CPU SDPA, forward, fp32), published as the cpu record in ``out``."""
    try:
        import torch  # noqa: F401  (the comparison's other side)
    except ImportError:
        sys.exit("flashx bench --cpu compares with torch's CPU SDPA, and torch is not installed: "
                 "pip install 'flashx-attention[torch]'")
    from flashx_bench import cpu

    print(f"the record goes to {out}: cpu.json and cpu.md replaced, {records.HISTORY} appended")
    results = cpu.run(**shape)
    written = records.publish(results, out, report.cpu_markdown)
    print(report.cpu_markdown(results), end="")
    for path in written:
        print(f"wrote {path}")
    return 0
