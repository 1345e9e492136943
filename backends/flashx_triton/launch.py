"""Launches: what is built once per static problem and layout, and run on every call.

``per_problem`` keeps what a call builds (tuned configurations, launches with their bound
arguments) under the problem's static key; ``call_args`` are the values each call brings; a
``Launch`` hands them to the compiled kernel with the bound rest; ``Passes`` runs a kernel with
masked tiles twice, plain and then exactly where the first pass found non-finite data, the exact
kernel compiled only when needed (``ExactLaunch``).
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from flashx.backend import BUILT_LIMIT, per_static_problem
from flashx.backend import tensor_layout as layout
from flashx_triton import background, tuning
from flashx_triton.dropout import dropout_args


def aligned(x: torch.Tensor) -> bool:
    """Whether ``x``'s address is a multiple of 16 bytes: TMA needs it, and Triton specialises a
    pointer on it."""
    return x.data_ptr() % 16 == 0


#: What was built for a static problem and a caller's key (the kernel, ``tensor_layout`` of its
#: tensors and of ``call_args``' tensors): ``per_problem``.
_built: dict[tuple, object] = {}


def per_problem(problem, key, build):
    """``build()``, made once per static problem and ``key`` (``flashx.backend.per_static_problem``)."""
    return per_static_problem(_built, problem, key, build)


def call_args(problem) -> tuple[tuple, tuple]:
    """The kernel arguments that change from call to call of one static problem, in the order
    kernels take them, right after their own tensors: (the optional tensors CU_Q, CU_K, SEQLENS_Q,
    SEQLENS_K, MASK, BLOCKS, SLOPES and SINKS, None where absent, masks as given, read through the
    strides of their broadcast, ``mask_layout``; dropout's ``DROPOUT_DRAW``, ``dropout_args``).

    What Triton specialises a launch on in them is the tensors' ``layout`` alone: the draws are
    int32s whatever their values, which the kernels name in ``do_not_specialize``. So a launch
    compiled for one call's values serves another call's where the tensors' layouts agree."""
    blocks = problem.block_mask.blocks if problem.block_mask is not None else None
    return ((problem.cu_seqlens_q, problem.cu_seqlens_k, problem.seqlens_q, problem.seqlens_k, problem.mask, blocks,
             problem.alibi_slopes, problem.sinks), dropout_args(problem))


class Launch:
    """A kernel launch with every argument bound but the leading ones, which each call passes:
    one problem, tensor layout and configuration.

    The first call goes through Triton's JIT, which specialises every argument and compiles.
    Later calls hand the same argument list straight to the kernel it returned
    (``CompiledKernel[grid]``), skipping that specialisation: tens of microseconds of host time
    per launch, five launches in a short causal forward and backward. That is sound because
    nothing Triton specialises on can change between the calls of one Launch: the bound values
    are fixed, and the per-call tensors have the problem's dtype and the layout (``layout``:
    strides, alignment) the Launch is cached under. Under the interpreter every call goes
    through the JIT.
    """

    def __init__(self, kernel, grid: tuple[int], options: dict, **bound):
        names = kernel.arg_names
        leading = len(names) - len(bound)
        self.kernel, self.options = kernel, options
        self.grid = (*grid, 1, 1)[:3]  # a compiled kernel's launcher takes all three axes
        self.bound = tuple(bound[name] for name in names[leading:])  # a KeyError names a missing argument
        self.compiled = None

    def __call__(self, *tensors):
        if self.compiled is not None:
            self.compiled(*tensors, *self.bound)
            return
        from triton.compiler import CompiledKernel

        kernel = self.kernel[self.grid](*tensors, *self.bound, **self.options)
        if isinstance(kernel, CompiledKernel):
            self.compiled = kernel[self.grid]


class Passes:
    """A kernel with masked tiles, launched twice: first with plain products in its masked tiles,
    then exactly (``EXACT``), only for the programs the first one flagged (``REDO``).

    In a masked tile a plain product adds 0 * x for each disallowed pair, which is 0 unless x is
    a NaN or an infinity; then it is NaN, and that shows in the program's outputs. So a program
    whose outputs end finite has its exact result, and the others flag themselves
    (``flag_nonfinite``) for the second launch. The first kernel carries none of the exact path's
    code (``masked_dot``), whose registers would otherwise halve the programs that share an SM
    (docs/triton-design.md, "Two launches for problems with masked tiles"). Dropout makes every
    tile such a tile: a dropped pair must add 0 even where V or dO holds NaN. A kernel without
    masked tiles or dropout runs once, exactly; its REDO is None.

    The second launch has one program per FLAGS_PER_PROGRAM programs of the first, each running
    those of its share that were flagged (``program_share``): a program for every program of the
    first launch, nearly all returning at once, would cost a short launch a visible share of its
    time on clean data.

    In the backward's gradient kernel the plain masked tiles also keep their software pipelining,
    which the exact ones must go without (``_dq_tiles``): that is what pays for the second launch
    there.

    Programs that fit one wave of the GPU (no more than its multiprocessors) run in one exact
    launch: the plain kernel's occupancy buys nothing there, and a second launch costs a short
    call (a decoding step's one-row prefill) host time of the order of its GPU time.
    """

    def __init__(self, kernel, programs: int, options: dict, masked: bool, device: torch.device, **bound):
        masked = masked and not fits_one_wave(programs, device)
        self.programs, self.masked = programs, masked
        self.launches = [Launch(kernel, (programs,), options, **bound, programs=programs, EXACT=not masked)]
        if masked:
            self.launches.append(exact_relaunch(kernel, programs, options, **bound))

    def __call__(self, *tensors) -> torch.Tensor | None:
        """Both launches (the second as ``ExactLaunch`` decides); returns the flags (None: one launch)."""
        redo = flags(tensors[0].device, self.programs) if self.masked else None
        for launch in self.launches:
            launch(*tensors, redo)
        return redo


FLAGS_PER_PROGRAM = tl.constexpr(32)


def fits_one_wave(programs: int, device: torch.device) -> bool:
    """Whether ``programs`` programs run side by side on ``device``, one per multiprocessor at
    least (``Passes``). Never under the interpreter, which runs both launches of every masked
    problem as a GPU runs them for large ones."""
    return device.type == "cuda" and programs <= torch.cuda.get_device_properties(device).multi_processor_count


def exact_relaunch(kernel, programs: int, options: dict, **bound) -> ExactLaunch:
    """The exact launch that runs the flagged ones of ``programs`` programs (``Passes``), one
    program per FLAGS_PER_PROGRAM of them (``program_share``)."""
    return ExactLaunch(kernel, (triton.cdiv(programs, FLAGS_PER_PROGRAM.value),), options, **bound,
                       programs=programs, EXACT=True)


class ExactLaunch(Launch):
    """An exact launch, whose last argument is the flags (REDO) of the launch before it; its
    kernel is compiled only when a call needs it.

    Clean data never runs an exact launch past its flag check, yet its kernel takes as long to
    compile as the plain one, or longer: most of a new shape's first call (docs/triton-design.md,
    "What a new shape costs"). So until the kernel is at hand, a call reads the flags on the host
    (a synchronisation) and launches only if a program is flagged. The first call that finds none
    sends the kernel to be compiled in another process (``background.compile_elsewhere``), into
    Triton's cache on disk; once that compile has ended, calls launch as any Launch does, without
    reading the flags, and the first of them loads the kernel from the cache (or compiles it,
    should the other process have failed). A call that finds a flag while that compile runs
    waits for it. Where nothing can be sent (the kernel compiled here already, the interpreter),
    the calls after the first launch as any Launch does.

    Under CUDA graph capture the host may not read the flags (the graph replays long after):
    the launch is captured as any Launch's, its kernel compiled here if it is not at hand. A
    candidate under trial (``tuning.trying_candidates``) skips its clean calls too but sends
    nothing elsewhere: only the chosen candidate's kernel will be needed, and compiling every
    candidate's twice had doubled what tuning costs.
    """

    def __init__(self, kernel, grid: tuple[int], options: dict, **bound):
        super().__init__(kernel, grid, options, **bound)
        self.at_hand = False  # launched, or compiled elsewhere: the flags are no longer read
        self.compiling: background.Compiling | None = None

    def __call__(self, *tensors):
        if not self.at_hand:
            redo = tensors[-1]
            if self.compiling is not None and self.compiling.done():
                self.at_hand = True
            elif capturing(redo.device) or redo.any():
                if self.compiling is not None:
                    self.compiling.wait()
                self.at_hand = True
            else:
                if self.compiling is None and not tuning.trying_candidates():
                    self.compiling = background.compile_elsewhere(self.kernel, (*tensors, *self.bound), self.grid,
                                                                  self.options)
                    self.at_hand = self.compiling is None
                return
        super().__call__(*tensors)


def capturing(device: torch.device) -> bool:
    """Whether launches on ``device`` are being captured into a CUDA graph (and not run)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_flags = threading.local()  # this thread's buffers of ``flags``, by device, stream and size


def flags(device: torch.device, programs: int) -> torch.Tensor:
    """The REDO flags of a ``Passes`` call of ``programs`` programs: a buffer kept per thread,
    device, stream and size, since an allocation per call costs a short call a visible share of
    its host time.

    A buffer is shared only by launches that run in order. A call's plain launch writes the flags
    and its exact launch reads them, on the stream Triton launches on (the current one), and a
    later call of this thread on that stream queues its plain launch behind both. Calls on another
    stream would not wait for them, so each stream has buffers of its own; nor would another
    thread's, whose launches may fall between a call's two, so each thread has its own too. Under
    CUDA graph capture the flags are allocated afresh, in the graph's memory: a graph replays its
    launches with the addresses it captured, on whatever stream and long after this call.

    Flags left by an earlier call need no clearing: every program of the plain launch that has
    rows or keys to compute writes its flag, and one that has none does nothing in the exact
    launch either. A new buffer starts clear all the same: until its kernel is at hand, an
    ``ExactLaunch`` reads every flag on the host, and the garbage of a program that writes none
    would have that kernel compiled for nothing."""
    stream = None
    if capturing(device):
        return torch.empty(programs, dtype=torch.int8, device=device)
    if device.type == "cuda":
        stream = triton.runtime.driver.active.get_current_stream(device.index)
    buffers = getattr(_flags, "buffers", None)
    if buffers is None:
        buffers = _flags.buffers = {}
    key = (device, stream, programs)
    found = buffers.get(key)
    if found is None:
        if len(buffers) >= BUILT_LIMIT:
            buffers.clear()
        found = buffers[key] = torch.zeros((programs,), dtype=torch.int8, device=device)
    return found


@triton.jit
def flag_nonfinite(REDO, total):
    """Flag this program for the exact launch (``Passes``) unless ``total``, a sum of its outputs,
    is finite; returns whether it is. A sum is non-finite where a term is (or, harmlessly, where it
    overflows), and costs fewer registers than testing every element (forward, d128: 151 against
    167).

    A kernel that accumulates into running sums writes a flagged program's outputs in the exact
    launch only: that launch recomputes them from the same inputs and must find the sums as the
    plain launch found them, or they would be merged or added twice."""
    finite = tl.abs(total) < float("inf")
    tl.store(REDO + tl.program_id(0), finite.to(tl.int8) ^ 1)
    return finite


@triton.jit
def program_share(REDO, programs, EXACT: tl.constexpr):
    """The programs of the first launch that this one runs (``Passes``), as (ids, whether still to
    run, how many), to be taken in turn by ``next_program``: in the exact launch of a kernel with
    masked tiles, the flagged ones of its FLAGS_PER_PROGRAM consecutive ones; otherwise one,
    itself (a literal count, so that the compiler drops the loop around it)."""
    if EXACT and REDO is not None:
        ids = tl.program_id(0) * FLAGS_PER_PROGRAM + tl.arange(0, FLAGS_PER_PROGRAM)
        todo = tl.load(REDO + ids, mask=ids < programs, other=0) != 0
        return ids, todo, tl.sum(todo.to(tl.int32))
    else:
        return 0, 0, 1


@triton.jit
def next_program(ids, todo, REDO, EXACT: tl.constexpr):
    """The next program of ``program_share``'s share, and the share without it."""
    if EXACT and REDO is not None:
        pid = tl.min(tl.where(todo, ids, 2147483647))
        return pid, todo & (ids != pid)
    else:
        return tl.program_id(0), todo
