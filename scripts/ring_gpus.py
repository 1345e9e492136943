"""Ring attention on the GPUs of one host, through NCCL: correctness, scaling, overlap, longest context.

    python3 scripts/ring_gpus.py [--out DIR] [--parts check,packed] [--check-layouts document_zigzag]
                                 [--head-groups G]                  # the driver: 1, 2, 4 (8) GPUs, then a table
    torchrun --nproc-per-node W scripts/ring_gpus.py PART ARGS...   # one part on W GPUs (the driver's child)

Parts (each rank prints one JSON line per result; rank 0's lines are the part's results):
  check        bf16, fwd+bwd, zigzag and contiguous, causal or not, a window, dropout, and packed documents
               in zigzag and document_zigzag: graded by the
               contract's rule against the float64 oracle on the gathered sequence (N = 2048, each rank
               grading its share of the cases), and compared with single-GPU flashx.attention on a
               sequence of 32k (every rank computes the whole of it on its own GPU).
  time N R     causal fwd+bwd, B=1, H=16, D=128, bf16, zigzag, N tokens in all: the median of R steps
               after one warm-up, the slowest rank's; TFLOP/s per GPU; peak memory per rank, beside the
               count of flashx.distributed.peak_bytes_per_token in the backward's head groups. With one
               rank it times flashx.attention itself, the single-GPU baseline.
  trace N F    one profiled fwd+bwd on rank 0: its Chrome trace, gzipped to F, and the share of the ring's
               transfer time (NCCL SendRecv kernels) during which a compute kernel ran: the overlap of
               communication with computation.
  packed T R   causal fwd+bwd on documents of mixed lengths (1k to 64k, multiples of 16, drawn once with a
               fixed seed) packed into T tokens, bf16, H=16, D=128, Hk = 16 and 4, each layout (zigzag,
               which cuts the packed axis as one sequence, and document_zigzag, which zigzags every
               document and so balances the causal work) and each exchange (ring and all_gather): the
               median of R steps, TFLOP/s per GPU, the balance of the causal work over the ranks, per-GPU
               efficiency against one GPU's flashx.attention on the same documents, peak memory per token
               per GPU measured beside the count of flashx.distributed.peak_bytes_per_token (in the
               backward's head groups, recorded), and the longest context it predicts.
               With one rank it times flashx.attention, the baseline.
  trace-packed T F
               one profiled step of the packed part's documents in T tokens, Hk = H/4: document_zigzag over
               the ring (flashx.attention with one rank), after a warm-up, on rank 0: its Chrome trace,
               gzipped to F; the step's time; the GPU's time in flashx's attention kernels (by name), in
               NCCL's and in other kernels, with their launches; the time no kernel ran and no compute
               kernel ran within the step; the overlap, as the trace part's. On the CPU (RING_SMOKE) the
               host's operators stand in for kernels, so labelled.

The check part grades packed documents too (documents spanning ranks, both exchanges, both layouts). The driver
writes ring-<device>.json and .md under --out (default $OUT, else /tmp/flashx-out), keeping what it has
after each part, so a run cut short still reports, and appends the steps' rows to history.csv there:
copy the record into benchmarks/results and append the rows to its history.csv. RING_SMOKE=1 runs
every part on tiny float32 shapes on the CPU (gloo, the numpy backend), to check the script itself.
The ring's backward runs in the head groups of ring_attention's default (the fewest whose counted
peak is below twice one GPU's), or in G with --head-groups G (RING_HEAD_GROUPS in the parts'
environment), in the time, trace and packed parts; the check part grades the default.
FLOPs count as flash-attn's: a causal forward is 2·B·H·N²·D, the backward 2.5 times that. The
Triton backend runs its shipped choices, untimed (the default): the ring's calls and the single-GPU
baseline run the same configurations.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gzip
import importlib.metadata
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SMOKE = os.environ.get("RING_SMOKE") == "1"
SIZES = (256, 512) if SMOKE else (131072, 524288)  # tokens in all, for the scaling table
HEADS, HEAD_DIM = (4, 16) if SMOKE else (16, 128)
CHECK_SEQLENS = (64, 128) if SMOKE else (2048, 32768)  # graded by the oracle; compared with single-GPU flashx
DEVICE, DTYPE, BACKEND = ("cpu", "float32", "numpy") if SMOKE else ("cuda", "bfloat16", "auto")
#: (layout, exchange, keywords, packed documents): documents of 1/64 to 1/2 of the sequence when packed
CHECK_CASES = [
    ("zigzag", "ring", {"causal": True}, False),
    ("zigzag", "ring", {}, False),
    ("zigzag", "ring", {"window": (300, 0)}, False),
    ("zigzag", "ring", {"causal": True, "dropout_p": 0.1, "seed": 1234}, False),
    ("contiguous", "ring", {"causal": True}, False),
    ("contiguous", "ring", {}, False),
    ("contiguous", "ring", {"causal": True, "dropout_p": 0.1, "seed": 1234}, False),
    ("zigzag", "ring", {"causal": True}, True),
    ("zigzag", "ring", {"causal": True, "window": (300, 0), "dropout_p": 0.1, "seed": 1234}, True),
    ("zigzag", "all_gather", {"causal": True}, True),
    ("document_zigzag", "ring", {"causal": True}, True),
    ("document_zigzag", "ring", {"causal": True, "window": (300, 0), "dropout_p": 0.1, "seed": 1234}, True),
    ("document_zigzag", "all_gather", {"causal": True}, True),
]
PACKED_LENGTHS = (8, 64) if SMOKE else (1024, 65536)  # the shortest and longest documents timed
PACKED_TOKENS = 512 if SMOKE else 262144
PACKED_HEADS_K = (HEADS, HEADS // 4)  # without and with grouped-query attention
PACKED_LAYOUTS = ("zigzag", "document_zigzag")
#: every document's length is a multiple of this, so that "document_zigzag" cuts it on 2, 4 and 8 GPUs
DOCUMENT_MULTIPLE = 16
#: the head groups of the ring's backward in the timed parts (--head-groups); None: ring_attention's default
HEAD_GROUPS = int(os.environ["RING_HEAD_GROUPS"]) if os.environ.get("RING_HEAD_GROUPS") else None
PARTS = ("check", "packed", "trace-packed", "trace", "time")
#: A rank still running after this many seconds prints its threads' stacks, and again as often: a
#: part the driver's time box cuts short leaves in the log where each rank stood.
STACKS_EVERY = 120
#: the name of a timed step's span in a profiled run's trace (``torch.profiler.record_function``)
STEP_LABEL = "ring_gpus step"
#: the Triton backend's attention kernels, the ones "auto" runs on a GPU
ATTENTION_KERNELS = ("_forward_kernel", "_prepare_kernel", "_gradients_kernel")
#: the trace's categories of GPU work: kernels, and the copies and fills that are not kernels
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def flops(seqlen: int, causal: bool = True) -> float:
    forward = 4 * HEADS * seqlen * seqlen * HEAD_DIM / (2 if causal else 1)
    return forward * 3.5


def document_lengths(tokens: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """Documents of log-uniform lengths in [shortest, longest] (one of each bound first), each rounded
    down to a multiple of ``DOCUMENT_MULTIPLE`` (and at least that), packed into ``tokens`` (a multiple
    of it), the last cut to fit: the same list on every rank and every run."""
    draw = random.Random(seed)

    def rounded(length: float) -> int:
        return max(DOCUMENT_MULTIPLE, int(length) // DOCUMENT_MULTIPLE * DOCUMENT_MULTIPLE)

    lengths = [rounded(longest), rounded(shortest)]
    while sum(lengths) < tokens:
        lengths.append(rounded(shortest * (longest / shortest) ** draw.random()))
    lengths[-1] -= sum(lengths) - tokens
    return [length for length in lengths if length]


def offsets(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


# ---------------------------------------------------------------- the parts, one process per GPU


def _start():
    import torch
    import torch.distributed as dist

    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()),
                                timeout=datetime.timedelta(minutes=10))
    else:
        dist.init_process_group("gloo")
    faulthandler.dump_traceback_later(STACKS_EVERY, repeat=True)
    return torch, dist, dist.get_rank(), dist.get_world_size()


def _emit(rank: int, **result) -> None:
    if rank == 0:
        print(json.dumps(result), flush=True)


def _synchronize(torch) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def part_check(layouts: list[str]) -> None:
    """The check part's cases of ``layouts`` (all of them where empty); a case's seed is its place in
    CHECK_CASES whichever are run."""
    import numpy as np
    from flashx_conformance.harness import OUTPUTS, conformance_failures, make_case, make_varlen_case

    import flashx
    import flashx.distributed as fxd

    torch, dist, rank, world = _start()
    dtype = getattr(torch, DTYPE)

    def gathered(shards: dict, layout: str, axis: int, cu_seqlens) -> dict:
        out = {}
        for name, x in shards.items():
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous())
            out[name] = fxd.unshard(parts, layout, dim=axis + (name == "lse"), cu_seqlens=cu_seqlens)
        return out

    def run(call, x: dict, options: dict) -> dict:
        inputs = {name: value.detach().requires_grad_(name != "do") for name, value in x.items()}
        o, lse = call(inputs["q"], inputs["k"], inputs["v"], return_lse=True, backend=BACKEND, **options)
        grads = torch.autograd.grad(o, (inputs["q"], inputs["k"], inputs["v"]), inputs["do"])
        return dict(zip(OUTPUTS, (o.detach(), lse, *grads)))

    def ring(x: dict, layout: str, exchange: str, options: dict) -> dict:
        axis = 0 if "cu_seqlens_q" in options else 1
        mine = {name: fxd.shard(value, world, rank, layout, dim=axis, cu_seqlens=options.get("cu_seqlens_q"))
                for name, value in x.items()}
        ring_options = {name: value for name, value in options.items() if name != "cu_seqlens_k"}
        if axis == 0:
            ring_options["cu_seqlens"] = ring_options.pop("cu_seqlens_q")
        return run(lambda *qkv, **kw: fxd.ring_attention(*qkv, layout=layout, exchange=exchange, **kw), mine,
                   ring_options)

    def packed(lengths: list[int]) -> dict:
        cu = torch.tensor(offsets(lengths), dtype=torch.int32, device=DEVICE)
        return {"cu_seqlens_q": cu, "cu_seqlens_k": cu}

    graded, compared = CHECK_SEQLENS
    for index, (layout, exchange, options, documents) in enumerate(CHECK_CASES):
        if layouts and layout not in layouts:
            continue
        # the oracle's grade, on a sequence the float64 oracle computes in seconds
        rng = np.random.default_rng(index)
        shapes = dict(heads_q=4, heads_k=2, head_dim=HEAD_DIM, dtype=DTYPE, **options)
        if documents:
            lengths = document_lengths(graded, graded // 64, graded // 2, seed=index)
            case = make_varlen_case(rng, lengths_q=lengths, lengths_k=lengths, **shapes)
        else:
            case = make_case(rng, batch=1, seqlen_q=graded, **shapes)
        x = {name: torch.from_numpy(np.ascontiguousarray(value)).to(DEVICE, dtype)
             for name, value in case.rounded().items()}
        lengths_given = packed(lengths) if documents else {}
        axis = 0 if documents else 1
        got = gathered(ring(x, layout, exchange, {**options, **lengths_given}), layout, axis,
                       lengths_given.get("cu_seqlens_q"))
        failures = []
        if index % world == rank:
            failures = conformance_failures(case, {n: t.double().cpu().numpy() for n, t in got.items()})
        # single-GPU flashx on a longer sequence, the same inputs on every rank
        generator = torch.Generator(DEVICE).manual_seed(index)
        heads = {"q": HEADS, "k": HEADS // 4, "v": HEADS // 4, "do": HEADS}
        batch = () if documents else (1,)
        x = {name: torch.randn((*batch, compared, h, HEAD_DIM), generator=generator, device=DEVICE, dtype=dtype)
             for name, h in heads.items()}
        if documents:
            options = {**options, **packed(document_lengths(compared, compared // 64, compared // 2, seed=index))}
        reference, mine = run(flashx.attention, x, options), ring(x, layout, exchange, options)
        difference = {}
        for name in OUTPUTS:
            expected = fxd.shard(reference[name], world, rank, layout, dim=axis + (name == "lse"),
                                 cu_seqlens=options.get("cu_seqlens_q")).float()
            scale = reference[name].float().abs().max().item()
            difference[name] = (mine[name].float() - expected).abs().max().item() / scale
        everything = [None] * world  # every rank's failures and differences, on rank 0
        dist.all_gather_object(everything, (failures, difference))
        failures = [failure for theirs, _ in everything for failure in theirs]
        difference = {name: max(theirs[name] for _, theirs in everything) for name in OUTPUTS}
        bound = 2.0**-7  # one bfloat16 step at the output's largest magnitude
        failures += [f"{name}: {value:.3g} of its largest magnitude from single-GPU flashx at N={compared}"
                     for name, value in difference.items() if value > bound]
        options = {name: value for name, value in options.items() if not name.startswith("cu_seqlens")}
        _emit(rank, part="check", world=world, layout=layout, exchange=exchange, documents=documents,
              options=_describe(options), relative_difference=difference, failures=failures)
    dist.destroy_process_group()


def _describe(options: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in options.items()) or "full"


def _inputs(torch, rank: int, rows: tuple, heads_k: int = HEADS):
    """This rank's q, k, v (requiring grad) and do of ``rows`` (the shape's leading axes), made on
    its GPU without the whole sequence."""
    generator = torch.Generator(DEVICE).manual_seed(rank)
    q, k, v, do = (torch.randn((*rows, heads, HEAD_DIM), generator=generator, device=DEVICE,
                               dtype=getattr(torch, DTYPE)) for heads in (HEADS, heads_k, heads_k, HEADS))
    for x in (q, k, v):
        x.requires_grad_()
    return q, k, v, do


def _step(torch, seqlen: int, world: int, rank: int):
    """A causal fwd+bwd on this rank's shards of a whole sequence of ``seqlen`` tokens: a function
    returning its seconds, the slowest rank's."""
    import flashx
    import flashx.distributed as fxd

    q, k, v, do = _inputs(torch, rank, (1, seqlen // world))
    if world == 1:
        def forward():
            return flashx.attention(q, k, v, causal=True, backend=BACKEND)
    else:
        def forward():
            return fxd.ring_attention(q, k, v, layout="zigzag", causal=True, head_groups=HEAD_GROUPS, backend=BACKEND)
    return _timer(torch, (q, k, v), do, forward)


def counted(torch, world: int, heads_k: int, layout: str = "zigzag", exchange: str = "ring") -> dict:
    """The memory per token of a GPU's shard that flashx.distributed.peak_bytes_per_token counts for
    the timed steps: {"kib_per_token": one GPU's with one rank, else the ring's, "head_groups": the
    ring backward's groups (None with one rank)}."""
    import flashx.distributed as fxd

    # Triton's kernels add their parts as they write (backward_into); numpy's return them
    count = fxd.peak_bytes_per_token(HEADS, heads_k, HEAD_DIM, getattr(torch, DTYPE), world_size=world,
                                     layout=layout, exchange=exchange, head_groups=HEAD_GROUPS,
                                     backward_into=not SMOKE)
    return dict(kib_per_token=(count["single"] if world == 1 else count["ring"]) / 1024,
                head_groups=None if world == 1 else count["head_groups"])


def _timer(torch, inputs: tuple, do, forward):
    """A function that runs ``forward().backward(do)`` once and returns its seconds."""
    import torch.distributed as dist

    def step() -> float:
        for x in inputs:
            x.grad = None
        _synchronize(torch)
        dist.barrier()
        start = time.perf_counter()  # steps of seconds: the host's clock after a synchronisation is exact enough
        with torch.profiler.record_function(STEP_LABEL):
            forward().backward(do)
        _synchronize(torch)
        return time.perf_counter() - start

    return step


def _settle() -> None:
    """Wait for what flashx's backends left running after the first step (``Backend.settle``: the
    Triton backend's exact kernels compiling in another process, until which each masked call
    reads its flags on the host), so that the steps timed after it are the steady state's."""
    import flashx

    for backend in flashx.registry.backends().values():
        backend.settle()


def _measure(torch, dist, step, repeats: int) -> dict:
    """One warm-up step, then the median of ``repeats`` (or the warm-up's time alone, where 0), and the
    peak memory from before the warm-up: the slowest rank's, the fullest GPU's."""
    cuda = DEVICE == "cuda"
    inputs = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first = step()
    _settle()
    seconds = statistics.median(step() for _ in range(repeats)) if repeats else first
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    slowest = torch.tensor([seconds, first, peak / 2**20], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds, first, peak = slowest.tolist()
    return dict(repeats=repeats, seconds=seconds, first_seconds=first, peak_mib=peak, inputs_mib=inputs / 2**20,
                capacity_mib=torch.cuda.mem_get_info()[1] / 2**20 if cuda else 0)


def part_time(seqlen: int, repeats: int) -> None:
    torch, dist, rank, world = _start()
    measured = _measure(torch, dist, _step(torch, seqlen, world, rank), repeats)
    count = counted(torch, world, HEADS)
    _emit(rank, part="time", world=world, seqlen=seqlen, tflops_per_gpu=flops(seqlen) / world / measured["seconds"]
          / 1e12, counted_kib_per_token=count["kib_per_token"], head_groups=count["head_groups"], **measured)
    dist.destroy_process_group()


def part_packed(tokens: int, repeats: int) -> None:
    """Packed documents: one GPU's flashx.attention, or the ring in each layout and exchange, at each Hk."""
    torch, dist, rank, world = _start()
    lengths = document_lengths(tokens, *PACKED_LENGTHS)
    cu = torch.tensor(offsets(lengths), dtype=torch.int32, device=DEVICE)
    work = 3.5 * sum(2 * HEADS * length * length * HEAD_DIM for length in lengths)  # causal, as ``flops``
    rings = itertools.product(PACKED_LAYOUTS, ("ring", "all_gather")) if world > 1 else [("", "one GPU")]
    for heads_k, (layout, exchange) in itertools.product(PACKED_HEADS_K, rings):
        step = _packed_step(torch, rank, world, tokens, heads_k, cu, layout, exchange)
        measured = _measure(torch, dist, step, repeats)
        count = counted(torch, world, heads_k, *((layout, exchange) if world > 1 else ()))
        shares = causal_work(lengths, world, layout) if world > 1 else [1]
        _emit(rank, part="packed", world=world, layout=layout, exchange=exchange, heads_k=heads_k, tokens=tokens,
              documents=len(lengths), shortest=min(lengths), longest=max(lengths),
              balance=statistics.mean(shares) / max(shares),
              tflops_per_gpu=work / world / measured["seconds"] / 1e12,
              counted_kib_per_token=count["kib_per_token"], head_groups=count["head_groups"], **measured)
    dist.destroy_process_group()


def causal_work(lengths: list[int], world: int, layout: str) -> list[int]:
    """Each rank's share of the causal work on documents of ``lengths`` packed in ``layout``: over the
    rank's rows, the keys each row attends (its position in its document, plus one)."""
    import torch

    import flashx.distributed as fxd

    keys = torch.cat([torch.arange(1, length + 1) for length in lengths])
    return [int(fxd.shard(keys, world, rank, layout, dim=0, cu_seqlens=offsets(lengths)).sum())
            for rank in range(world)]


def _packed_step(torch, rank: int, world: int, tokens: int, heads_k: int, cu, layout: str, exchange: str):
    """A causal fwd+bwd on this rank's shard of ``tokens`` packed rows of documents ``cu``: flashx.attention
    on one GPU, else ring attention in ``layout`` with ``exchange``; its inputs live as long as the function
    returned."""
    import flashx
    import flashx.distributed as fxd

    q, k, v, do = _inputs(torch, rank, (tokens // world,), heads_k)
    if world == 1:
        def forward():
            return flashx.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, backend=BACKEND)
    else:
        def forward():
            return fxd.ring_attention(q, k, v, causal=True, cu_seqlens=cu, layout=layout, exchange=exchange,
                                      head_groups=HEAD_GROUPS, backend=BACKEND)
    return _timer(torch, (q, k, v), do, forward)


def part_trace(seqlen: int, trace: str) -> None:
    torch, dist, rank, world = _start()
    _, events = _profiled(torch, rank, _step(torch, seqlen, world, rank), trace)
    if rank == 0:
        _emit(rank, part="trace", world=world, seqlen=seqlen, trace=Path(trace).name, **_overlap(events))
    dist.destroy_process_group()


def part_trace_packed(tokens: int, trace: str) -> None:
    """One step of the packed part at the smaller Hk, document_zigzag over the ring (flashx.attention
    with one rank), profiled: where rank 0's GPU spent it."""
    torch, dist, rank, world = _start()
    lengths, heads_k, layout = document_lengths(tokens, *PACKED_LENGTHS), PACKED_HEADS_K[-1], "document_zigzag"
    cu = torch.tensor(offsets(lengths), dtype=torch.int32, device=DEVICE)
    seconds, events = _profiled(torch, rank, _packed_step(torch, rank, world, tokens, heads_k, cu, layout, "ring"),
                                trace)
    if rank == 0:
        _emit(rank, part="trace-packed", world=world, layout=layout if world > 1 else "",
              exchange="ring" if world > 1 else "one GPU", heads_k=heads_k, tokens=tokens, documents=len(lengths),
              seconds=seconds, trace=Path(trace).name, **_kernel_time(events), **_overlap(events))
    dist.destroy_process_group()


def _profiled(torch, rank: int, step, trace: str) -> tuple[float, list[dict] | None]:
    """The seconds of one profiled ``step`` after a warm-up one, and on rank 0 its trace's events,
    the Chrome trace gzipped to ``trace``. The host's operators are recorded beside the kernels: they
    show whether the host kept the GPU waiting."""
    step()  # compiled and warm
    _settle()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if DEVICE == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        seconds = step()
    if rank != 0:
        return seconds, None
    path = Path(trace).with_suffix("")  # the .json beside the .json.gz
    profile.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    with open(path, "rb") as source, gzip.open(trace, "wb") as packed:
        shutil.copyfileobj(source, packed)
    path.unlink()
    return seconds, events


def _union(intervals) -> list[list[float]]:
    """The union of (start, end) intervals, as disjoint [start, end] in order."""
    union = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    return union


def _kernel_time(events: list[dict], top: int = 4) -> dict:
    """Where the GPU's time went in a trace's timed step (``STEP_LABEL``), from the host's start of the
    step to its last kernel's end: for each kind of kernel (attention: ``ATTENTION_KERNELS``; nccl;
    other, copies and fills included) the launches, their milliseconds and the ``top`` kernels by
    time; the time no kernel ran (idle), and no compute kernel (idle, or NCCL's alone: waiting for a
    peer or for the host); the host's time issuing the step, near the span where the host keeps the
    GPU waiting. Without CUDA kernels (the CPU) the host's operators stand in, nested ones each
    counted, so that the script can be checked there."""
    step = next(e for e in events if e.get("cat") == "user_annotation" and e["name"] == STEP_LABEL)
    start = step["ts"]
    kernels = [e for e in events if e.get("cat") in GPU_WORK and e.get("ph") == "X"]
    timeline = "CUDA kernels" if kernels else "CPU operators (no CUDA kernel in the trace)"
    kernels = kernels or [e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    kernels = [(max(e["ts"], start), e["ts"] + e["dur"], e["name"], _kernel_kind(e["name"]))
               for e in kernels if e["ts"] + e["dur"] > start]  # not the barrier before the step
    end = max([start + step["dur"], *(stop for _, stop, _, _ in kernels)])

    def uncovered(kinds: tuple) -> float:
        return (end - start - sum(b - a for a, b in _union((a, b) for a, b, _, kind in kernels if kind in kinds))) / 1e3

    summary = dict(timeline=timeline, span_ms=(end - start) / 1e3, host_ms=step["dur"] / 1e3,
                   idle_ms=uncovered(("attention", "nccl", "other")), no_compute_ms=uncovered(("attention", "other")))
    for kind in ("attention", "nccl", "other"):
        names = {}  # name: (launches, microseconds)
        for begin, stop, name, _ in (x for x in kernels if x[3] == kind):
            count, microseconds = names.get(name, (0, 0.0))
            names[name] = (count + 1, microseconds + stop - begin)
        ranked = sorted(names.items(), key=lambda item: -item[1][1])
        summary[kind] = dict(launches=sum(count for count, _ in names.values()),
                             ms=sum(us for _, us in names.values()) / 1e3,
                             top=[[name, count, us / 1e3] for name, (count, us) in ranked[:top]])
    return summary


def _kernel_kind(kernel: str) -> str:
    return "attention" if kernel in ATTENTION_KERNELS else "nccl" if "nccl" in kernel.lower() else "other"


def _overlap(events: list[dict]) -> dict:
    """The ring's point-to-point kernel time (NCCL SendRecv), and the part of it during which a compute
    kernel ran, from a Chrome trace. Collectives are left out: the step's barrier is an all-reduce
    that waits for the slowest rank."""
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"].lower()) for e in events
               if e.get("cat") == "kernel" and e.get("ph") == "X"]
    compute = _union((start, end) for start, end, name in kernels if "nccl" not in name)
    transfers = [(start, end) for start, end, name in kernels if "sendrecv" in name]
    transfer_us = sum(end - start for start, end in transfers)
    overlapped_us = sum(max(0.0, min(end, b) - max(start, a)) for start, end in transfers for a, b in compute)
    return dict(transfers=len(transfers), transfer_ms=transfer_us / 1e3, overlapped_ms=overlapped_us / 1e3,
                compute_ms=sum(b - a for a, b in compute) / 1e3,
                overlap=overlapped_us / transfer_us if transfer_us else None)


# ---------------------------------------------------------------- the driver


def _run_part(world: int, args: list[str], log, timeout: float) -> list[dict]:
    """One part on ``world`` processes; its results, and an "error" row if it failed or ran out of time."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               __file__, *args]
    print(f"$ W={world} {' '.join(args)}", file=log, flush=True)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        output, failed = done.stdout + done.stderr, done.returncode != 0
    except subprocess.TimeoutExpired as stopped:
        output = "".join(x.decode() if isinstance(x, bytes) else x or "" for x in (stopped.stdout, stopped.stderr))
        output, failed = output + f"\n(time box of {timeout:.0f} s closed)\n", True
    log.write(output)
    log.flush()
    results = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    # A part whose processes abort in their teardown (NCCL, the profiler) once rank 0 has written
    # its results has those results: they stand, and the failure is said as coming after them.
    failure = {"part": "error", "world": world, "args": args, "after_results": bool(results)}
    return results + ([failure] if failed else [])


def _longest(times: list[dict], world: int) -> dict | None:
    """The longest sequence whose fwd+bwd fits each rank's memory: peak memory is linear in the
    tokens per rank (O(N/W)), fitted through the shortest and longest runs, with 2 GiB of each GPU
    left to the CUDA context and the allocator."""
    runs = sorted((r["seqlen"] // world, r["peak_mib"], r["capacity_mib"]) for r in times if r["world"] == world)
    if len(runs) < 2 or runs[-1][1] <= runs[0][1]:  # one length, or no memory measured (the CPU)
        return None
    (n0, m0, capacity), (n1, m1, _) = runs[0], runs[-1]
    per_token = (m1 - m0) / (n1 - n0)
    tokens = int((capacity - 2048 - (m0 - per_token * n0)) / per_token) * world
    verified = max(r["seqlen"] for r in times if r["world"] == world)
    return dict(world=world, mib_per_token_per_rank=per_token, longest_tokens=tokens, verified_tokens=verified)


def _plan(worlds: list[int], traces: str, parts: set[str], check_layouts: list[str]) -> list[tuple[int, list[str]]]:
    """(ranks, part arguments) in the order run: correctness (of ``check_layouts``' cases; empty:
    all), packed documents with their single-GPU baseline, the profile of a packed step on the most
    GPUs and on one, the overlap trace, the scaling table with its single-GPU baselines, then one
    longer step per group size toward the longest context; only ``parts``. Traces are written to
    ``traces`` + ".json.gz" (the overlap's) and + "-packed-wW.json.gz"."""
    widest = worlds[-1]
    plan = [(w, ["check", *check_layouts]) for w in reversed(worlds)]
    plan += [(w, ["packed", str(PACKED_TOKENS), "3"]) for w in [1, *reversed(worlds)]]
    plan += [(w, ["trace-packed", str(PACKED_TOKENS), f"{traces}-packed-w{w}.json.gz"]) for w in (widest, 1)]
    plan.append((widest, ["trace", str(SIZES[0]), f"{traces}.json.gz"]))
    for seqlen in SIZES:
        plan += [(w, ["time", str(seqlen), "3"]) for w in reversed(worlds)]
    singles = sorted({seqlen // w for seqlen in SIZES for w in [1, *worlds]})
    plan += [(1, ["time", str(n), "3"]) for n in singles]
    plan.append((widest, ["time", str(SIZES[-1] * widest), "0"]))  # as many tokens per GPU as SIZES[-1] on one
    return [(w, args) for w, args in plan if args[0] in parts]


def history_rows(results: dict) -> list[dict]:
    """The timed steps as rows of benchmarks/results/history.csv: the ring's as flashx-ring-zigzag-wW
    (packed documents: flashx-ring-LAYOUT-EXCHANGE-wW, mode "fwd+bwd packed Hk=N"; a backward in
    G > 1 head groups adds " head_groups=G" to the mode), the single-GPU baseline's as
    flashx-triton; device "Wx <GPU>"."""
    rows = []
    for r in (r for r in results["rows"] if r["part"] in ("time", "packed")):
        packed = r["part"] == "packed"
        ring = f"flashx-ring-{r.get('layout', 'zigzag')}-{r['exchange']}-w{r['world']}" if packed else \
            f"flashx-ring-zigzag-w{r['world']}"
        grouped = f" head_groups={r['head_groups']}" if r.get("head_groups") not in (None, 1) else ""
        common = dict(date=results["date"], device=f"{r['world']}x {results['device']}",
                      mode=(f"fwd+bwd packed Hk={r['heads_k']}" if packed else "fwd+bwd") + grouped,
                      impl="flashx-triton" if r["world"] == 1 else ring, dtype=DTYPE, batch=1,
                      seqlen=r["tokens"] if packed else r["seqlen"], heads=HEADS, head_dim=HEAD_DIM, causal=True,
                      torch=results["torch"], triton=results["triton"], flashx=results["flashx"])
        rows += [dict(common, metric=metric, value=f"{r[key]:.6g}")
                 for metric, key in (("s", "seconds"), ("tflops_per_gpu", "tflops_per_gpu"), ("peak_mib", "peak_mib"))]
    return rows


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def driver(out: Path, budget: float, parts: set[str], check_layouts: list[str]) -> None:
    import torch
    from flashx_bench.records import append_rows, device_slug

    import flashx

    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if DEVICE == "cuda" else 4
    worlds = [w for w in (2, 4, 8) if w <= gpus]
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    results = dict(device=device, gpus=gpus, date=datetime.date.today().isoformat(), torch=torch.__version__,
                   triton=_version("triton"), flashx=flashx.__version__,
                   nccl=".".join(map(str, torch.cuda.nccl.version())) if DEVICE == "cuda" else "none (gloo)",
                   rows=[], longest=[])
    slug = "ring-" + (device_slug(device) if DEVICE == "cuda" else "cpu")
    deadline = time.monotonic() + budget
    with open(out / f"{slug}.log", "w") as log:
        for world, args in _plan(worlds, str(out / f"{slug}-trace"), parts, check_layouts):
            left = deadline - time.monotonic()
            if left < 30:
                results["rows"].append({"part": "error", "world": world, "args": args + ["(not run: time box)"]})
                continue
            results["rows"] += _run_part(world, args, log, left)
            times = [r for r in results["rows"] if r["part"] == "time"]
            results["longest"] = [x for x in (_longest(times, w) for w in [1, *worlds]) if x]
            (out / f"{slug}.json").write_text(json.dumps(results, indent=1))
            (out / f"{slug}.md").write_text(render(results))
    append_rows(history_rows(results), out / "history.csv")
    print(render(results))


def render(results: dict) -> str:
    rows = results["rows"]
    graded, compared = CHECK_SEQLENS
    lines = [f"# Ring attention on {results['gpus']}x {results['device']}", "",
             f"{results['date']}; flashx {results['flashx']}, torch {results['torch']}, Triton {results['triton']}, "
             f"NCCL {results['nccl']}; {DTYPE}, B=1, H={HEADS}, D={HEAD_DIM}; Triton's shipped choices, "
             f"untimed; `python3 scripts/ring_gpus.py`.", ""]
    checks = [r for r in rows if r["part"] == "check"]
    if checks:
        lines += ["## Correctness", "",
                  f"Each case, forward and backward: graded by the contract's rule against the float64 oracle on the "
                  f"gathered sequence (N = {graded}, Hq = 4, Hk = 2), and the largest difference from single-GPU "
                  f"flashx at N = {compared} (Hq = {HEADS}, Hk = {HEADS // 4}), relative to the output's largest "
                  f"magnitude (bound: 2^-7, one bfloat16 step). Packed: documents of N/64 to N/2 tokens.", "",
                  "| W | layout | exchange | packed | options | o | lse | dq | dk | dv | result |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in checks:
            difference = " | ".join(f"{r['relative_difference'][n]:.2g}" for n in ("o", "lse", "dq", "dk", "dv"))
            verdict = "FAIL: " + "; ".join(r["failures"]) if r["failures"] else "pass"
            lines.append(f"| {r['world']} | {r['layout']} | {r['exchange']} | {'yes' if r['documents'] else ''} | "
                         f"{r['options']} | {difference} | {verdict} |")
        lines.append("")
    lines += render_packed([r for r in rows if r["part"] == "packed"])
    lines += render_packed_profile([r for r in rows if r["part"] == "trace-packed"])
    times = [r for r in rows if r["part"] == "time"]
    single = {r["seqlen"]: r for r in times if r["world"] == 1}
    if times:
        lines += ["## Scaling: causal fwd+bwd, zigzag", "",
                  "Efficiency: the ring's TFLOP/s per GPU over single-GPU flashx's at the same tokens per GPU. "
                  "Speed-up: single-GPU time at the same N over the ring's. Steps: the median of 3 after a warm-up, "
                  "the slowest rank's (one step, no warm-up, where repeats is 0). Counted: peak_bytes_per_token "
                  "per token of a GPU's shard, in the head groups the ring's backward ran.", "",
                  "| N | W | tokens/GPU | repeats | step (s) | TFLOP/s per GPU | efficiency | speed-up "
                  "| peak MiB/GPU | head groups | counted KiB/token |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted(times, key=lambda r: (r["seqlen"], r["world"])):
            same_tokens, same_n, ring = single.get(r["seqlen"] // r["world"]), single.get(r["seqlen"]), r["world"] > 1
            efficiency = f"{r['tflops_per_gpu'] / same_tokens['tflops_per_gpu']:.2f}" if ring and same_tokens else ""
            speedup = f"{same_n['seconds'] / r['seconds']:.2f}" if ring and same_n else ""
            lines.append(f"| {r['seqlen']} | {r['world']} | {r['seqlen'] // r['world']} | {r['repeats']} | "
                         f"{r['seconds']:.3f} | {r['tflops_per_gpu']:.0f} | {efficiency} | {speedup} | "
                         f"{r['peak_mib']:.0f} | {_groups(r)} | {_counted_kib(r)} |")
        lines.append("")
    for r in (r for r in rows if r["part"] == "trace"):
        share = f" ({100 * r['overlap']:.0f}%)" if r["overlap"] is not None else ""
        lines += [f"## Overlap (W={r['world']}, N={r['seqlen']}, one fwd+bwd, rank 0's GPU)", "",
                  f"The ring's {r['transfers']} point-to-point transfers (NCCL SendRecv kernels) ran "
                  f"{r['transfer_ms']:.1f} ms, {r['overlapped_ms']:.1f} ms of it{share} while a compute kernel ran; "
                  f"compute kernels {r['compute_ms']:.1f} ms. Trace: `{r['trace']}`.", ""]
    if results["longest"]:
        lines += ["## Longest causal context (fwd+bwd)", "",
                  "Predicted from the peak memory per GPU, linear in its tokens (fitted through the shortest and "
                  "longest steps run), with 2 GiB of each GPU left to the CUDA context; verified: the longest "
                  "step run.", "",
                  "| W | peak memory per token per GPU | longest N (predicted) | verified N |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {r['world']} | {r['mib_per_token_per_rank'] * 1024:.1f} KiB | {r['longest_tokens']:,} | "
                  f"{r['verified_tokens']:,} |" for r in results["longest"]]
        lines.append("")
    failures = [r for r in rows if r["part"] == "error"]
    for after, say in ((False, "Parts that did not finish"),
                       (True, "Parts that ended abnormally after writing their results (which stand)")):
        named = ["W={} {}".format(r["world"], " ".join(r["args"])) for r in failures
                 if r.get("after_results", False) == after]
        lines += [f"{say}: {'; '.join(named)}.", ""] if named else []
    return "\n".join(lines)


def render_packed(rows: list[dict]) -> list[str]:
    """The packed documents' table: efficiency against one GPU on the same documents and Hk, peak
    memory per token per GPU measured and counted, and the longest context that peak predicts."""
    if not rows:
        return []
    one = {r["heads_k"]: r for r in rows if r["world"] == 1}
    first = rows[0]
    lines = ["## Packed documents: causal fwd+bwd", "",
             f"{first['tokens']:,} tokens in {first['documents']} documents of {first['shortest']:,} to "
             f"{first['longest']:,} tokens (log-uniform, fixed seed). Layouts: zigzag cuts the packed axis as one "
             f"sequence, document_zigzag zigzags every document. Balance: the mean over the ranks of the causal "
             f"work each holds (over its rows, the keys each attends) over the largest, the efficiency that "
             f"imbalance leaves. Efficiency: one GPU's time on the same "
             f"documents over W times the ring's. Memory: the peak per token of a GPU's shard, measured "
             f"(inputs and gradients included) and counted by peak_bytes_per_token (the contract's table) in "
             f"the head groups the ring's backward ran; "
             f"x one GPU: measured over one GPU's measured. Longest context: the GPU's memory less 2 GiB over "
             f"the measured peak per token, times W.", "",
             "| W | layout | exchange | Hk | head groups | step (s) | TFLOP/s per GPU | balance | efficiency "
             "| KiB/token/GPU | counted | x one GPU | longest context |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["heads_k"], r["world"], r["layout"], r["exchange"])):
        base, per_token = one.get(r["heads_k"]), packed_kib_per_token(r)
        efficiency = f"{base['seconds'] / (r['world'] * r['seconds']):.2f}" if base and r["world"] > 1 else ""
        ratio = f"{per_token / packed_kib_per_token(base):.2f}" if base and per_token else ""
        longest = f"{longest_packed(r):,}" if per_token else ""
        lines.append(f"| {r['world']} | {r['layout']} | {r['exchange']} | {r['heads_k']} | {_groups(r)} | "
                     f"{r['seconds']:.3f} | "
                     f"{r['tflops_per_gpu']:.0f} | {r['balance']:.2f} | {efficiency} | {per_token:.1f} | "
                     f"{r['counted_kib_per_token']:.1f} | {ratio} | {longest} |")
    return lines + [""]


def render_packed_profile(rows: list[dict]) -> list[str]:
    """The profiled packed steps: where rank 0's GPU spent its step, the ring's beside one GPU's."""
    if not rows:
        return []
    first = rows[0]
    lines = [f"## Profile of one packed step: causal fwd+bwd, Hk = {first['heads_k']}, rank 0's GPU", "",
             f"The packed part's {first['tokens']:,} tokens in {first['documents']} documents, document_zigzag over "
             f"the ring, or flashx.attention on one GPU; one step after a warm-up, profiled (host operators "
             f"recorded too, so the host runs slower than in the timed parts). Timeline: {first['timeline']}. "
             f"Time in kernels: the sum of their durations, launches in brackets; attention: flashx's Triton "
             f"kernels; other: the rest, copies and fills included. Per token: the attention kernels' time over "
             f"the GPU's tokens (T/W), equal where the ring's calls compute as fast as one GPU's. Idle: the step "
             f"(the host's start to the last kernel's end) less the union of kernels; no compute: less the union "
             f"of all but NCCL's. Host: the host's time issuing the step. Overlap: the trace part's.", "",
             "| W | step (ms) | host (ms) | attention (ms) | ns/token | NCCL (ms) | other (ms) | idle (ms) "
             "| no compute (ms) | overlap |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = sorted(rows, key=lambda r: r["world"])
    for r in rows:
        attention, nccl, other = (f"{r[kind]['ms']:.1f} ({r[kind]['launches']})" for kind in ("attention", "nccl",
                                                                                                "other"))
        per_token = r["attention"]["ms"] * 1e6 / (r["tokens"] / r["world"])
        overlap = f"{r['overlap']:.2f}" if r["overlap"] is not None else ""
        lines.append(f"| {r['world']} | {r['seconds'] * 1e3:.1f} | {r['host_ms']:.1f} | {attention} | {per_token:.0f} "
                     f"| {nccl} | {other} | {r['idle_ms']:.1f} | {r['no_compute_ms']:.1f} | {overlap} |")
    lines.append("")
    for r in rows:
        longest = "; ".join(f"{kind}: " + ", ".join(f"`{name[:60]}` {ms:.1f} ms ({count})"  # PyTorch's names run long
                                                    for name, count, ms in r[kind]["top"])
                            for kind in ("attention", "other") if r[kind]["top"])
        lines.append(f"W={r['world']}, the longest kernels by name: {longest or 'none'}. Trace: `{r['trace']}`.")
    return lines + [""]


def _groups(row: dict) -> str:
    """The head groups a row's ring ran its backward in (empty for one GPU, and rows recorded before
    they were)."""
    return "" if row.get("head_groups") is None else str(row["head_groups"])


def _counted_kib(row: dict) -> str:
    return "" if row.get("counted_kib_per_token") is None else f"{row['counted_kib_per_token']:.1f}"


def packed_kib_per_token(row: dict) -> float:
    return row["peak_mib"] * 1024 / (row["tokens"] / row["world"])


def longest_packed(row: dict) -> int:
    """The tokens whose peak fills each GPU but 2 GiB, at the measured peak per token."""
    return int((row["capacity_mib"] - 2048) * 1024 / packed_kib_per_token(row)) * row["world"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=PARTS)
    parser.add_argument("args", nargs="*")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/flashx-out")))
    parser.add_argument("--budget", type=float, default=500, help="seconds for the whole driver run")
    parser.add_argument("--parts", default=",".join(PARTS), help="the driver's parts, comma-separated")
    parser.add_argument("--check-layouts", default="", help="the check part's layouts, comma-separated (default: all)")
    parser.add_argument("--head-groups", type=int, help="the ring backward's head groups in the time, trace and "
                        "packed parts (default: ring_attention's)")
    options = parser.parse_args()
    if options.head_groups is not None:  # the parts, child processes, read it from their environment
        os.environ["RING_HEAD_GROUPS"] = str(options.head_groups)
    if options.part == "check":
        part_check(options.args)
    elif options.part == "time":
        part_time(int(options.args[0]), int(options.args[1]))
    elif options.part == "trace":
        part_trace(int(options.args[0]), options.args[1])
    elif options.part == "trace-packed":
        part_trace_packed(int(options.args[0]), options.args[1])
    elif options.part == "packed":
        part_packed(int(options.args[0]), int(options.args[1]))
    else:
        driver(options.out, options.budget, set(options.parts.split(",")), [x for x in options.check_layouts.split(",") if x])


if __name__ == "__main__":
    main()
