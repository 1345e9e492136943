"""flashx's benchmarks: ``flashx bench`` or ``python -m flashx_bench`` (benchmarks/README.md says how).

The GPU sweep times every flashx backend available on the device beside PyTorch's attention
kernels; the CPU comparison times the NumPy backend against torch's CPU SDPA. Each run keeps one
current record per device and appends its numbers to a history table (``records``).

This module is a flashx plugin (the ``flashx.plugins`` entry point ``bench``): it adds ``flashx
bench``, whose arguments ``flashx_bench.cli`` parses, loaded only when the command runs.
"""

from flashx.hookspecs import Command, hookimpl


def _bench(argv: list[str]) -> int:
    from flashx_bench.cli import main

    return main(argv)


@hookimpl
def flashx_commands():
    return [Command("bench", "time the backends beside PyTorch's kernels (GPU, or --cpu)", run=_bench,
                    own_arguments=True)]
