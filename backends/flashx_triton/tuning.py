"""Tile shapes, warps and pipeline depth for each kernel: shipped per GPU, timed only when asked.

Each kernel has a short list of candidate configurations per head-dim class and dtype
(docs/triton-design.md, "Tuning"). A choice is kept under its kernel key (``kernel_key``: the
kernel, head dims, dtype, band or none, and size class). A call takes, in this order:

1. the choice in this process's table;
2. the choice in the table on disk for this GPU, Triton and flashx (``tuning_cache``), which
   ``flashx tune`` fills;
3. only with FLASHX_TRITON_AUTOTUNE=1: the fastest candidate, timed on the call's inputs
   (``_fastest``), which then goes into the table on disk;
4. otherwise the shipped choice, untimed (``untimed_order``): the entry of ``shipped.json`` for
   this GPU's capability at the nearest length class, or for a GPU without a table, sm_90's
   entry and then the candidates whose shared memory fits the GPU.

Under TRITON_INTERPRET=1 (CI, CPU) one small fixed configuration runs.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from flashx.problem import FP8_DTYPES
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
# Where shipped.json has no entry, the first of a list whose shared memory fits the GPU runs.
FORWARD = {
    64: [C(64, 64, 4, 3), C(128, 64, 4, 3), C(128, 128, 4, 3), C(64, 128, 4, 3)],
    128: [C(64, 64, 4, 3), C(128, 128, 8, 3), C(128, 64, 8, 3)],
    256: [C(64, 64, 4, 2), C(128, 64, 8, 2), C(64, 32, 4, 2), C(64, 64, 4, 3)],
}
FORWARD_FP32 = [C(64, 32, 4, 2), C(64, 64, 4, 2), C(32, 32, 4, 2), C(32, 32, 4, 1)]
# FP8 inputs (flashx_triton.fp8): K and V tiles take half the bytes, and the FP8 tensor-core
# product reduces 32 at a time, so the tiles are wider and the pipeline deeper than bf16's. The
# first is the untimed choice where shipped.json has none; each compiles for sm_90 without spilling
# but 128 x 256 at d128 (52 B at 2 stages, which the tuner may still find faster).
FORWARD_FP8 = {
    64: [C(128, 128, 8, 3), C(128, 64, 4, 3), C(64, 64, 4, 3), C(128, 128, 8, 4), C(128, 256, 8, 3), C(64, 128, 4, 4)],
    128: [C(128, 128, 8, 3), C(128, 128, 8, 4), C(128, 64, 8, 4), C(64, 64, 4, 3), C(64, 128, 4, 3), C(128, 128, 8, 2),
          C(128, 256, 8, 2)],
    256: [C(128, 64, 8, 3), C(128, 64, 8, 2), C(64, 64, 4, 2)],
}
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
#: By the same keys, where each choice came from: "timed", "disk" or "shipped".
_sources: dict[tuple, str] = {}
#: By the same keys, every candidate this process timed and its median milliseconds (``_fastest``;
#: None: dropped).
measured: dict[tuple, list[tuple[Config | str, float | None]]] = {}

SHIPPED = Path(__file__).with_name("shipped.json")
#: The capability whose table stands in for a GPU without one (``untimed_order``).
REFERENCE_CAPABILITY = "sm_90"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def autotuning() -> bool:
    """Whether a choice missing from the tables is timed (FLASHX_TRITON_AUTOTUNE=1) rather than shipped."""
    return os.environ.get("FLASHX_TRITON_AUTOTUNE") == "1"


_trying = threading.local()


def trying_candidates() -> bool:
    """Whether this thread is running the candidates of a choice (``_fastest``)."""
    return getattr(_trying, "active", False)


def candidates(kernel: str, problem) -> list:
    """The configurations of ``kernel`` to try on ``problem``; of "gradients", the backward's plans."""
    if interpreting():
        return INTERPRETED_GRADIENTS if kernel == "gradients" else [INTERPRETED]
    if problem.dtype in FP8_DTYPES:  # forward only
        return FORWARD_FP8[problem.head_dim_class]
    if problem.dtype == "float32":
        return {"forward": FORWARD_FP32, "dkdv": DKDV_FP32, "dq": DQ_FP32, "fused": FUSED_FP32,
                "gradients": GRADIENTS_FP32}[kernel]
    table = {"forward": FORWARD, "dkdv": DKDV, "dq": DQ, "fused": FUSED, "gradients": GRADIENTS}[kernel]
    return table[problem.head_dim_class]


def choose(kernel: str, problem, run: Callable[[Config], Sequence]) -> Config | str:
    """The configuration for ``kernel`` on ``problem``; ``run(config)`` launches it and returns its
    outputs. Looked for in this process's table, then on disk; timed by ``_fastest`` (and kept on
    disk) only under FLASHX_TRITON_AUTOTUNE=1, otherwise the shipped choice, untimed."""
    options = candidates(kernel, problem)
    if len(options) == 1:
        return options[0]
    slot = _slot(kernel, problem)
    key, where, timed = slot
    if slot not in _chosen:
        choice, source = _stored(where, key, options), "disk"
        if choice is None and timed:
            choice, source = _fastest(options, run, measured.setdefault(slot, [])), "timed"
            tuning_cache.store(where, key, _encoded(choice), dict(measured[slot]).get(choice))
        elif choice is None:
            order = untimed_order(kernel, problem, options, where.capability, lambda: _shared_memory(problem))
            choice, source = _first_that_runs(order, run), "shipped"
        _chosen[slot], _sources[slot] = choice, source
    return _chosen[slot]


def settled(kernel: str, problem, settle: Callable[[], object]) -> Config | str:
    """The configuration ``choose`` picks for ``kernel`` on ``problem``, for a launch that must run
    once a call: where none is chosen yet, ``settle()`` chooses it, by a call of the kernel's
    plain form on outputs of its own. ``choose`` runs its candidates again and again (timed, each
    on outputs poisoned with NaN; untimed, the winner once more for the call), which outputs that
    accumulate running sums (``forward_into``, ``backward_into``) cannot take."""
    options = candidates(kernel, problem)
    if len(options) == 1:
        return options[0]
    slot = _slot(kernel, problem)
    if slot not in _chosen:
        settle()
    return _chosen[slot]


def _slot(kernel: str, problem) -> tuple:
    """Where this process keeps the choice for ``kernel`` on ``problem``: its kernel key, its
    environment, and whether it is timed."""
    return kernel_key(kernel, problem), tuning_cache.environment(problem.device_index), autotuning()


def kernel_key(kernel: str, problem) -> str:
    """What a choice is kept under besides its environment: the kernel, head dims, dtype, whether a
    band bounds the problem, its size class, and dropout, e.g. "forward-d128x128-bfloat16-band-n13-r17".
    Dropout compiles kernels of their own, whose draws take registers and shared memory that the
    same configuration without them does not: a choice made for one may not launch for the other."""
    length, rows = size_class(problem)
    band = "band" if problem.band is not None else "full"
    dropout = "-dropout" if problem.dropout_p > 0 else ""
    return f"{kernel}-d{problem.head_dim}x{problem.head_dim_v}-{problem.dtype}-{band}-n{length}-r{rows}{dropout}"


class Choice(NamedTuple):
    key: str  # kernel_key
    choice: dict | str  # as the table on disk holds it
    source: str  # "timed", "disk" or "shipped"
    timings: list | None  # of "timed": every candidate and its median ms (None: dropped)


def choices() -> list[Choice]:
    """Every choice this process made, in the order made."""
    return [Choice(key, _encoded(choice), _sources[slot], measured.get(slot) if _sources[slot] == "timed" else None)
            for slot, choice in _chosen.items() for key in slot[:1]]


def shipped_table(capability: str) -> dict:
    """shipped.json's choices for GPUs of ``capability`` ("sm_90"), by "kernel dD dtype band" and
    then by the shortest length each entry holds from; empty where none are shipped."""
    return _shipped().get(capability, {}).get("choices", {})


@functools.cache
def _shipped() -> dict:
    return json.loads(SHIPPED.read_text())


def shipped(kernel: str, problem, capability: str) -> Config | str | None:
    """The shipped choice for ``kernel`` on ``problem`` on a GPU of ``capability``: the entry of the
    longest length class at or below the problem's (or the shortest entry); None where none is
    shipped. With dropout, its group's entries where the table has them, else those without."""
    table = shipped_table(capability)
    group = f"{kernel} d{problem.head_dim_class} {problem.dtype} {'band' if problem.band is not None else 'full'}"
    entries = (problem.dropout_p > 0 and table.get(f"{group} dropout")) or table.get(group)
    if not entries:
        return None
    length, _ = size_class(problem)
    by_class = sorted((int(n).bit_length(), text) for n, text in entries.items())
    return parse(next((text for n, text in reversed(by_class) if n <= length), by_class[0][1]))


def parse(text: str) -> Config | str:
    """A choice as shipped.json writes it: "64x128 w8 s3", with " in-kernel" where the backward
    builds its descriptors in the kernel, or a plan's name ("fused", "split")."""
    found = re.fullmatch(r"(\d+)x(\d+) w(\d+) s(\d+)( in-kernel)?", text)
    if found is None:
        return text
    *numbers, in_kernel = found.groups()
    return Config(*map(int, numbers), host_descriptors=not in_kernel)


def text(choice: Config | dict | str) -> str:
    """``choice`` (or its JSON form, ``_encoded``) as shipped.json writes it: ``parse`` undone."""
    if isinstance(choice, str):
        return choice
    choice = Config(**choice) if isinstance(choice, dict) else choice
    return f"{choice.block_m}x{choice.block_n} w{choice.num_warps} s{choice.num_stages}" + (
        "" if choice.host_descriptors else " in-kernel")


def untimed_order(kernel: str, problem, options: list, capability: str, shared_memory: Callable[[], int]) -> list:
    """``options`` in the order an untimed choice tries them (the first that compiles and fits wins).

    With a table for ``capability``: its entry first, then the list's order. For any other GPU the
    reference (sm_90) table's entry comes first, since what it encodes (tile shapes against 255
    registers a thread, warps against tile size) holds on every NVIDIA GPU; what differs is shared
    memory, so candidates whose pipelined tiles (``shared_memory_needed``) exceed the GPU's are
    left out, unless none fits.
    """
    table = capability if shipped_table(capability) else REFERENCE_CAPABILITY
    preferred = shipped(kernel, problem, table)
    order = ([preferred] if preferred in options else []) + [option for option in options if option != preferred]
    if table == capability:
        return order
    limit = shared_memory()
    fitting = [option for option in order
               if not isinstance(option, Config) or shared_memory_needed(kernel, option, problem) <= limit]
    return fitting or order


def shared_memory_needed(kernel: str, config: Config, problem) -> int:
    """A lower bound on the shared memory ``config`` takes: its pipeline's stages of streamed rows
    (K and V in the forward and dQ, Q and dO in dK/dV), both head dims padded as the kernels pad them."""
    width = sum(max(16, 1 << (d - 1).bit_length()) for d in (problem.head_dim, problem.head_dim_v))
    rows = config.block_n if kernel in ("forward", "dq") else config.block_m
    size = 4 if problem.dtype == "float32" else 1 if problem.dtype in FP8_DTYPES else 2
    return config.num_stages * rows * width * size


def _shared_memory(problem) -> float:
    """The shared memory a block of ``problem``'s GPU may take (bytes; the interpreter has no limit)."""
    import torch
    import triton

    if interpreting():
        return math.inf
    device = problem.device_index if problem.device_index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


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
    runs as ``launch(*tensors)`` and returns the outputs. Cached per static problem
    (``common.per_problem``), so it keeps no Problem: each call's own values are among its tensors."""

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


def _first_that_runs(options: list, run: Callable[[Config], Sequence]) -> Config | str:
    """The first of ``options`` that compiles and fits the GPU, untimed (its run is the call's own)."""
    from triton.runtime.errors import OutOfResources, PTXASError

    for config in options:
        try:
            run(config)
            return config
        except (OutOfResources, PTXASError, RuntimeError):  # as in _fastest
            if config is options[-1]:
                raise
    raise ValueError("no options")


def _fastest(options: list[Config], run: Callable[[Config], Sequence], log: list) -> Config:
    """The fastest candidate that compiles, fits the GPU and agrees with the first.

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
