"""``flashx tune``: the Triton backend's command, added to ``flashx`` through the ``flashx_commands``
hook. It times the kernels' candidate configurations for the shapes named and keeps the fastest on
disk (``tuning_cache``), where every later process on this machine finds them.

Importing this module imports neither torch nor Triton: ``tune`` does, when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import flashx
from flashx.cli import INSTALL_TRITON, positive_int
from flashx.devices import cuda_refusal
from flashx.hookspecs import Command
from flashx.problem import FP8_DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Time the Triton backend's candidate configurations for the shapes named and keep the "
                          "fastest on disk, where every later process on this machine finds them "
                          "(docs/triton-design.md, Tuning).")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--seqlen", type=positive_int, nargs="+", metavar="N", help="sequence lengths to tune")
    what.add_argument("--list", action="store_true", help="show the choices kept on disk")
    what.add_argument("--clear", action="store_true", help="remove the choices kept on disk")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=positive_int, default=None, help="key and value heads (default: --heads)")
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32", *sorted(FP8_DTYPES)), default="bfloat16",
                        help="FP8: torch.randn's values cast, descales of 1, the forward only")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="tune the backward's kernels too")


def tune(args: argparse.Namespace) -> int:
    """Run one call (and its backward with --backward) per named length, so that every kernel it
    launches is tuned and its choice kept on disk (flashx_triton.tuning_cache); print the choices."""
    from flashx_triton import tuning, tuning_cache

    if args.list:
        return _list_tuned(tuning_cache)
    if args.clear:
        removed = tuning_cache.clear()
        print(f"flashx tune: removed {_choices(removed)} from {tuning_cache.table_directory()}")
        return 0
    if args.backward and args.dtype in FP8_DTYPES:
        print("flashx tune: FP8 attention is forward only; leave out --backward", file=sys.stderr)
        return 1
    refusal = None if tuning.interpreting() else _cuda_refusal()  # the interpreter: tests only
    if refusal:
        print(f"flashx tune: {refusal}", file=sys.stderr)
        return 1
    import torch

    os.environ["FLASHX_TRITON_AUTOTUNE"] = "1"  # time what the table on disk lacks
    device = "cpu" if tuning.interpreting() else "cuda"
    where = tuning_cache.environment(torch.cuda.current_device() if device == "cuda" else None)
    kv_heads = args.kv_heads or args.heads
    print(f"flashx tune: {where}")
    shown = {made.key for made in tuning.choices()}
    for seqlen in args.seqlen:
        generator = torch.Generator(device).manual_seed(seqlen)

        def normal(heads, grad=args.backward):
            x = torch.randn(args.batch, seqlen, heads, args.head_dim, generator=generator, device=device)
            return x.to(getattr(torch, args.dtype)).requires_grad_(grad)

        q, k, v = normal(args.heads), normal(kv_heads), normal(kv_heads)
        start = time.perf_counter()
        try:
            o = flashx.attention(q, k, v, causal=args.causal, backend="triton")
        except flashx.FlashXError as error:  # a shape the backend declines: the user's to change
            print(f"flashx tune: {error}", file=sys.stderr)
            return 1
        if args.backward:
            o.backward(normal(args.heads, grad=False))
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"  B={args.batch} N={seqlen} Hq={args.heads} Hk={kv_heads} D={args.head_dim} {args.dtype}"
              f"{' causal' if args.causal else ''}{', with the backward' if args.backward else ''}: "
              f"{time.perf_counter() - start:.1f} s")
        for made in tuning.choices():
            if made.key not in shown:
                shown.add(made.key)
                medians = [ms for _, ms in made.timings or () if ms is not None]
                how = f"fastest of {len(medians)} timed, {min(medians):.3f} ms" if medians else (
                    "found on disk" if made.source == "disk" else made.source)
                print(f"    {made.key:<44} {_choice_text(made.choice)}  ({how})")
    print(f"choices kept in {where.directory}")
    return 0


TUNE = Command("tune", "time the Triton kernels' configurations for the shapes you name, once per machine",
               run=tune, add_arguments=add_arguments)


def _list_tuned(tuning_cache) -> int:
    found = list(tuning_cache.records())
    print(f"flashx tune: {_choices(len(found))} in {tuning_cache.table_directory()}")
    environment = None
    for path, record in found:
        if path.parent.name != environment:
            environment = path.parent.name
            print(f"  {environment}")
        try:
            median = record["median_ms"]
            line = f"{record['key']:<44} {_choice_text(record['choice'])}" + (f"  {median:.3f} ms" if median else "")
        except (TypeError, KeyError, ValueError):
            line = f"{path.name}: unreadable (ignored)"
        print(f"    {line}")
    return 0


def _choices(count: int) -> str:
    return f"{count} tuned choice{'' if count == 1 else 's'}"


def _choice_text(choice) -> str:
    """A choice as the table on disk holds it (a configuration's fields, or a plan's name), on one line."""
    return " ".join(f"{name}={value}" for name, value in choice.items()) if isinstance(choice, dict) else str(choice)


def _cuda_refusal() -> str | None:
    """Why the kernels cannot be timed on CUDA here (torch, a device, the backend), or None."""
    return cuda_refusal(INSTALL_TRITON) or flashx.registry.get("triton").available()
