"""Tile shapes, warps and pipeline depth for each kernel: the fastest of a few candidates, timed once per machine.

Each kernel has a short list of candidate configurations per head-dim class and dtype
(docs/triton-design.md, "Tuning"). A choice is kept under its kernel key (``kernel_key``: the
kernel, head dims, dtype, band or none, and size class) and looked for in turn in this
process's table, then in the table on disk for this GPU, Triton and flashx (``tuning_cache``);
only where both lack it is it made (``_fastest``): every candidate runs on the call's own
inputs, one that needs more shared memory than the GPU has, fails to compile, or whose outputs
disagree with the first candidate's is dropped, and the fastest of the rest is kept in both
tables. With FLASHX_TRITON_AUTOTUNE=0 the first candidate that fits is taken untimed, and the
table on disk is neither read nor written: that mode runs the shipped defaults, whatever was
tuned. Under TRITON_INTERPRET=1 (CI, CPU) one small fixed configuration runs.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from flashx_triton import tuning_cache


@dataclass(frozen=True)
class Config:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int
    #: Backward only: TMA descriptors built on the host (one per tensor) or in the kernel (one per
    #: program and head). Neither wins everywhere (docs/triton-design.md, "Loads: TMA
    #: descriptors"), so the placement is tuned with the tiles.
    host_descriptors: bool = True

    def tiles(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n)

    def options(self) -> dict:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


# Interpreting is slow per program and per tile; 32 rows still give several tiles on test shapes.
INTERPRETED = Config(32, 32, 1, 1)

C = Config
# The H100's winners at N = 8k, causal or not, come first (docs/triton-design.md, "Tuning"):
# FLASHX_TRITON_AUTOTUNE=0 runs the first.
FORWARD = {
    64: [C(64, 64, 4, 3), C(128, 64, 4, 3), C(128, 128, 4, 3), C(64, 128, 4, 3)],
    128: [C(64, 64, 4, 3), C(128, 128, 8, 3), C(128, 64, 8, 3)],
    256: [C(64, 64, 4, 2), C(128, 64, 8, 2), C(64, 32, 4, 2)],
}
FORWARD_FP32 = [C(64, 32, 4, 2), C(64, 64, 4, 2), C(32, 32, 4, 2), C(32, 32, 4, 1)]
# dK/dV: block_n keys stay resident while block_m query rows stream.
DKDV = {
    64: [C(64, 64, 4, 3), C(32, 128, 4, 3), C(64, 128, 4, 3), C(32, 64, 4, 3)],
    128: [C(64, 128, 8, 3, False), C(64, 128, 8, 3), C(32, 128, 8, 3), C(64, 64, 4, 2), C(64, 128, 8, 4)],
    256: [C(32, 64, 4, 2), C(64, 64, 8, 2), C(32, 32, 4, 2)],
}
DKDV_FP32 = [C(32, 64, 4, 2), C(32, 32, 4, 2), C(16, 32, 4, 1)]
DQ = {
    64: [C(128, 64, 4, 3), C(64, 64, 4, 3), C(128, 64, 8, 3)],
    128: [C(128, 64, 8, 3, False), C(128, 64, 8, 3), C(64, 32, 4, 3), C(64, 64, 4, 2)],
    256: [C(64, 32, 4, 2), C(64, 64, 8, 2), C(32, 32, 4, 2)],
}
DQ_FP32 = [C(64, 32, 4, 2), C(32, 32, 4, 2), C(32, 16, 4, 1)]
# dK/dV and dQ in one launch: block_n keys resident while block_m query rows stream, and block_n
# query rows resident while block_m keys stream (the H100's winners at N = 512 to 4k first).
FUSED = {
    64: [C(64, 64, 4, 2), C(64, 64, 4, 3), C(32, 128, 4, 3)],
    128: [C(64, 64, 4, 2), C(32, 64, 4, 3), C(64, 64, 4, 2, False), C(32, 64, 4, 3, False), C(64, 128, 8, 3, False)],
    256: [C(32, 64, 4, 2), C(32, 32, 4, 2), C(64, 64, 8, 2)],
}
FUSED_FP32 = [C(32, 64, 4, 2), C(32, 32, 4, 2), C(16, 32, 4, 1)]

# How the backward launches its dK/dV and dQ programs: "fused", one launch (FUSED), or "split",
# DKDV's launch then DQ's. One launch wins short sequences at d128, two win long ones and d64
# (docs/triton-design.md, "The backward"), so both are candidates; under the interpreter the
# fused kernel runs both parts.
GRADIENTS = {64: ["split", "fused"], 128: ["fused", "split"], 256: ["split", "fused"]}
GRADIENTS_FP32 = ["split", "fused"]
INTERPRETED_GRADIENTS = ["fused"]

#: This process's choices, by (kernel key, tuning_cache.Environment, whether timed).
_chosen: dict[tuple, Config | str] = {}
#: By the same keys, every candidate this process ran and its median milliseconds (``_fastest``;
#: None: dropped). A choice found on disk has none.
measured: dict[tuple, list[tuple[Config | str, float | None]]] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def autotuning() -> bool:
    return os.environ.get("FLASHX_TRITON_AUTOTUNE") != "0"


_trying = threading.local()


def trying_candidates() -> bool:
    """Whether this thread is running the candidates of a choice (``_fastest``)."""
    return getattr(_trying, "active", False)


def candidates(kernel: str, problem) -> list:
    """The configurations of ``kernel`` to try on ``problem``; of "gradients", the backward's plans."""
    if interpreting():
        return INTERPRETED_GRADIENTS if kernel == "gradients" else [INTERPRETED]
    if problem.dtype == "float32":
        return {"forward": FORWARD_FP32, "dkdv": DKDV_FP32, "dq": DQ_FP32, "fused": FUSED_FP32,
                "gradients": GRADIENTS_FP32}[kernel]
    table = {"forward": FORWARD, "dkdv": DKDV, "dq": DQ, "fused": FUSED, "gradients": GRADIENTS}[kernel]
    wide = max(problem.head_dim, problem.head_dim_v)
    return table[64 if wide <= 64 else 128 if wide <= 128 else 256]


def choose(kernel: str, problem, run: Callable[[Config], Sequence]) -> Config | str:
    """The configuration for ``kernel`` on ``problem``; ``run(config)`` launches it and returns its
    outputs. Looked for in this process's table, then (timed only) on disk; made by ``_fastest``
    where neither has it, and kept in both."""
    options = candidates(kernel, problem)
    if len(options) == 1:
        return options[0]
    timed = autotuning()
    key = kernel_key(kernel, problem)
    where = tuning_cache.environment(problem.device_index)
    slot = (key, where, timed)
    if slot not in _chosen:
        choice = _stored(where, key, options) if timed else None
        if choice is None:
            log = measured.setdefault(slot, [])
            choice = _fastest(options, run, log, timed)
            if timed:
                tuning_cache.store(where, key, _encoded(choice), dict(log).get(choice))
        _chosen[slot] = choice
    return _chosen[slot]


def kernel_key(kernel: str, problem) -> str:
    """What a choice is kept under besides its environment: the kernel, head dims, dtype, whether a
    band bounds the problem, and its size class, e.g. "forward-d128x128-bfloat16-band-n13-r17"."""
    length, rows = size_class(problem)
    band = "band" if problem.band is not None else "full"
    return f"{kernel}-d{problem.head_dim}x{problem.head_dim_v}-{problem.dtype}-{band}-n{length}-r{rows}"


def choices() -> list[tuple[str, dict | str, list | None]]:
    """This process's timed choices: (kernel key, choice as the table on disk holds it, the
    timings that made it; None where the choice came from disk)."""
    return [(key, _encoded(choice), measured.get((key, where, timed)))
            for (key, where, timed), choice in _chosen.items() if timed]


def _stored(where, key: str, options: list) -> Config | str | None:
    """The candidate that the table on disk holds for ``key``, if it still is one."""
    stored = tuning_cache.load(where, key)
    return next((option for option in options if _encoded(option) == stored), None)


def _encoded(choice: Config | str):
    """``choice`` as JSON holds it: a Config's fields, or a plan's name."""
    return asdict(choice) if isinstance(choice, Config) else choice


class Tuned:
    """One kernel for one problem and tensor layout, under the configuration ``choose`` picks on
    the first call's tensors (again once FLASHX_TRITON_AUTOTUNE changes): ``make(problem, config,
    *tensors)`` builds the launch of a configuration for tensors laid out as these, which then
    runs as ``launch(*tensors)`` and returns the outputs. Cached per problem
    (``common.per_problem``), so it keeps no Problem."""

    def __init__(self, kernel: str, make: Callable):
        self.kernel, self.make = kernel, make
        self.launches = {}  # by whether the choice was timed

    def __call__(self, problem, *tensors):
        timed = autotuning()
        launch = self.launches.get(timed)
        if launch is None:
            launch = self.launches[timed] = tuned_launch(self.kernel, problem, self.make, *tensors)
        return launch(*tensors)


def tuned_launch(kernel: str, problem, make: Callable, *tensors) -> Callable:
    """``make``'s launch for these tensors under the configuration ``choose`` picks for ``kernel``."""
    tried = {}

    def run(config):
        if config not in tried:
            tried[config] = make(problem, config, *tensors)
        return tried[config](*tensors)

    config = choose(kernel, problem, run)
    return tried.get(config) or make(problem, config, *tensors)


def size_class(problem) -> tuple[int, int]:
    """The size bucket a choice is kept under: the bit lengths of the sequence length and of the
    query rows of all sequences and heads (capped where the GPU is full either way).

    The length sets each program's loop, the rows how many programs there are to fill the GPU:
    keyed by length alone, a few heads would choose the tiles that a full GPU then runs with at
    the same length (docs/triton-design.md, "Tuning").
    """
    rows = problem.batch * problem.heads_q * problem.seqlen_q
    return min(problem.seqlen_q, 8192).bit_length(), min(rows, 1 << 18).bit_length()


def _fastest(options: list[Config], run: Callable[[Config], Sequence], log: list, timed: bool) -> Config:
    """The fastest candidate that compiles, fits the GPU and agrees with the first; untimed: the first such.

    Every candidate runs and is checked first, then each of those left is timed once by
    ``triton.testing.do_bench`` (its median over ~100 ms of calls, after a warm-up) and the
    smallest median wins. The call path times nothing more: the methodology that makes timings
    comparable across implementations (equal power states, host time) is the benchmarks'.

    The outputs are poisoned with NaN before each candidate runs: they are the same buffers every
    time, so a candidate that leaves elements unwritten would otherwise show the values that the
    one before it wrote there (kernels under Triton's Hopper warp specialization did).
    The buffers are restored afterwards to what the first run left, which keeps the elements no
    kernel writes (varlen rows past the last sequence) as the caller initialised them.
    """
    from triton.runtime.errors import OutOfResources, PTXASError
    from triton.testing import do_bench

    buffers = first = reference = None
    usable = []
    outer, _trying.active = trying_candidates(), True  # a plan's choice holds its launches' choices
    try:
        for config in options:
            try:
                if buffers is None:
                    buffers = run(config)
                    first = [x.clone() for x in buffers]
                for x in buffers:
                    x.fill_(math.nan)
                outputs = [x.clone() for x in run(config)]  # copies: the next run overwrites the buffers
            except (OutOfResources, PTXASError, RuntimeError):
                # Too much shared memory for this GPU, a compiler pass failing on this shape (Triton
                # raises a bare RuntimeError then), or ptxas running out of registers: not a
                # candidate here, unless none is left.
                if reference is None and config is options[-1]:
                    raise
                log.append((config, None))
                continue
            if reference is None:
                reference = outputs
            elif not all(_agree(a, b) for a, b in zip(outputs, reference)):
                log.append((config, None))
                continue
            if not timed:
                return config
            usable.append(config)
        costs = {}
        for config in usable:
            def launch(config=config) -> None:
                run(config)

            costs[config] = do_bench(launch, return_mode="median")
        log.extend(costs.items())
        return min(usable, key=costs.get)
    finally:
        _trying.active = outer
        for x, saved in zip(buffers or (), first or ()):
            x.copy_(saved)


def _agree(x, reference) -> bool:
    """NaN in the same places, and within rounding of the reference elsewhere (tile order
    changes the summation order, never the result by more than a few units in the last place)."""
    import torch

    if not torch.equal(x.isnan(), reference.isnan()):
        return False
    # Elementwise, never by boolean indexing: its index tensor, 8 bytes an element, took 64 GiB
    # for the 2**31-element outputs of conformance's test_int32_offsets.
    finite = reference.isfinite()
    if not torch.equal(torch.where(finite, 0, x).nan_to_num(), torch.where(finite, 0, reference).nan_to_num()):
        return False
    scale = torch.where(finite, reference, 0).abs().amax()
    return bool((torch.where(finite, x - reference, 0).abs() <= 1e-2 * scale + 1e-6).all())
