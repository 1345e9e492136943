"""What the forward and the backward kernels share.

Device side: where a sequence lives, which tiles a band of rows meets, which (query, key)
pairs are allowed, and the dropout draw of the contract's Dropout section (docs/contract.md).
Host side: a ``Problem`` packed into the keyword arguments every kernel takes.

Masking happens only in "masked" tiles (the band's edges, sequence ends, bool/block masks);
the tiles fully inside the band run without a single compare.
"""

from __future__ import annotations

import os
import threading

import torch
import triton
import triton.language as tl

from flashx_triton import tuning



@triton.jit
def sequence_bounds(b, CU, SEQLENS, padded_length, IS_VARLEN: tl.constexpr, HAS_SEQLENS: tl.constexpr):
    """(first row in the tensor, length) of sequence b."""
    if IS_VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
    elif HAS_SEQLENS:
        start = 0
        length = tl.load(SEQLENS + b).to(tl.int32)
    else:
        start = 0
        length = padded_length
    return start, length


@triton.jit
def query_tile(pid, CU_Q, CU_K, SEQLENS_Q, SEQLENS_K, padded_q, padded_k, heads_q, BLOCK_M: tl.constexpr,
               IS_VARLEN: tl.constexpr, HAS_SEQLENS_Q: tl.constexpr, HAS_SEQLENS_K: tl.constexpr):
    """(m0, b, h, q_start, q_len, k_start, k_len) of program ``pid``'s query tile.

    One axis (no 65535 limit); a head's tiles are adjacent so they share K/V in L2, and the
    last query tiles, which see the most keys under a causal band, start first. (Interleaving
    the tiles of several heads, so that no heavy tile starts last, measured no faster:
    docs/triton-design.md, "The forward".)
    """
    num_tiles = tl.cdiv(padded_q, BLOCK_M)
    head = pid // num_tiles
    m0 = (num_tiles - 1 - pid % num_tiles) * BLOCK_M
    b = head // heads_q
    h = head % heads_q
    q_start, q_len = sequence_bounds(b, CU_Q, SEQLENS_Q, padded_q, IS_VARLEN, HAS_SEQLENS_Q)
    k_start, k_len = sequence_bounds(b, CU_K, SEQLENS_K, padded_k, IS_VARLEN, HAS_SEQLENS_K)
    return m0, b, h, q_start, q_len, k_start, k_len


@triton.jit
def band_tiles(first_row, length, other_length, left, right, ROWS: tl.constexpr, TILE: tl.constexpr,
               ALL_MASKED: tl.constexpr):
    """The tiles of the other axis that rows [first_row, first_row + ROWS) meet.

    Row r may use columns r + diag - left ..= r + diag + right (diag = other_length - length;
    for keys looking at queries, pass left and right swapped). Returns (first, full_lo, full_hi,
    end): columns [first, end) are used by some row; tiles in [full_lo, full_hi) are used by
    every valid row and lie inside the other sequence, so they need no mask.
    """
    diag = other_length - length
    last_row = tl.minimum(first_row + ROWS, length) - 1
    first = tl.maximum(first_row + diag - left, 0)
    end = tl.minimum(last_row + diag + right + 1, other_length)
    # No row, or no column any row may use: every range is empty.
    empty = (last_row < first_row) | (end <= first)
    first = tl.where(empty, 0, first)
    end = tl.where(empty, 0, end)
    if ALL_MASKED:
        full_lo = end
        full_hi = end
    else:
        full_lo = tl.cdiv(tl.maximum(last_row + diag - left, 0), TILE) * TILE
        full_lo = tl.minimum(tl.maximum(full_lo, first // TILE * TILE), end)
        full_hi = tl.maximum(tl.minimum(first_row + diag + right + 1, other_length), 0) // TILE * TILE
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return first, full_lo, full_hi, end


@triton.jit
def band_part(part: tl.constexpr, first_tile, full_lo, full_hi, end):
    """Tiles [lo, hi) of part 0 (the masked tiles before the full ones), 1 (the full tiles, which
    need no mask) or 2 (the masked tiles after them) of band_tiles' range."""
    if part == 0:
        return first_tile, full_lo
    elif part == 1:
        return full_lo, full_hi
    else:
        return full_hi, end


@triton.jit
def pair_rule(b, h, q_len, k_len, band, MASK, BLOCKS, masks, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr):
    """What decides which pairs of sequence b, query head h are allowed, packed for allowed_pairs
    (an absent mask is 0: Triton 3.6 takes no None into a tuple). ``band`` is (left, right),
    ``masks`` the strides of MASK and BLOCKS and the block mask's block sizes (``mask_layout``)."""
    left, right = band
    stride_mb, stride_mh, stride_mi, stride_mj, stride_bb, stride_bh, stride_bi, stride_bj, block_q, block_k = masks
    mask_base = MASK + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh if HAS_MASK else 0
    blocks_base = BLOCKS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh if HAS_BLOCK_MASK else 0
    return (q_len, k_len, left, right, mask_base, stride_mi, stride_mj, blocks_base, stride_bi, stride_bj, block_q,
            block_k)


@triton.jit
def allowed_pairs(i, j, pairs, HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr):
    """The contract's "Scores and masking" rules for query rows i and key columns j
    (broadcastable index tensors) of the sequence and head that ``pairs`` (``pair_rule``) describes."""
    q_len, k_len, left, right, mask_base, stride_mi, stride_mj, blocks_base, stride_bi, stride_bj, block_q, block_k = (
        pairs)
    diag = k_len - q_len
    ok = (i < q_len) & (j < k_len) & (j >= i + diag - left) & (j <= i + diag + right)
    if HAS_MASK:
        ok &= tl.load(mask_base + i.to(tl.int64) * stride_mi + j.to(tl.int64) * stride_mj, mask=ok, other=0) != 0
    if HAS_BLOCK_MASK:
        ok &= tl.load(blocks_base + (i // block_q) * stride_bi + (j // block_k) * stride_bj, mask=ok, other=0) != 0
    return ok


@triton.jit
def load_rows(desc, base, seq, seq_start, head, start, stride, used, WIDTH: tl.constexpr, ROWS: tl.constexpr,
              COLS: tl.constexpr, USE_TMA: tl.constexpr, MASKED: tl.constexpr, ZERO_UNUSED: tl.constexpr = True,
              HOST_DESCRIPTORS: tl.constexpr = True):
    """Rows [start, start + ROWS) of one head's (length, WIDTH) matrix, zero past WIDTH and, in
    masked tiles, in rows not ``used``.

    ``base`` points at the head's first row of the sequence. Through TMA, ``desc`` reads the
    same rows, zero past WIDTH: a host descriptor (``row_descriptor``) at (seq, seq_start +
    start, head), zero past the tensor's rows; one built in the kernel (``head_descriptors``) at
    row ``start``, zero past the sequence. With ZERO_UNUSED False unused rows stay as they are
    (the backward, whose masked_dot sees any non-finite value in them through the score
    products)."""
    if USE_TMA:
        if HOST_DESCRIPTORS:
            tile = desc.load([seq, seq_start + start, head, 0]).reshape(ROWS, COLS)
        else:
            tile = desc.load([start, 0])
        if MASKED and ZERO_UNUSED:
            tile = tl.where(used[:, None], tile, 0.0)
    else:
        rows = tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        ptrs = base + tl.cast(start, tl.int64) * stride + rows[:, None] * stride + cols[None, :]
        if MASKED:
            tile = tl.load(ptrs, mask=used[:, None] & (cols[None, :] < WIDTH), other=0.0)
        else:
            tile = tl.load(ptrs, mask=cols[None, :] < WIDTH, other=0.0)
    return tile


@triton.jit
def head_descriptors(host_a, host_b, base_a, base_b, length, stride_a, stride_b, WIDTH_A: tl.constexpr,
                     WIDTH_B: tl.constexpr, ROWS: tl.constexpr, COLS_A: tl.constexpr, COLS_B: tl.constexpr,
                     USE_TMA: tl.constexpr, HOST_DESCRIPTORS: tl.constexpr):
    """The descriptors of two streamed operands: the host's (``row_descriptor``), or built here
    over one head's ``length`` rows from ``base_a`` and ``base_b``."""
    if USE_TMA and not HOST_DESCRIPTORS:
        return (tl.make_tensor_descriptor(base_a, [length, WIDTH_A], [stride_a, 1], [ROWS, COLS_A]),
                tl.make_tensor_descriptor(base_b, [length, WIDTH_B], [stride_b, 1], [ROWS, COLS_B]))
    else:
        return host_a, host_b


def row_descriptors(x: torch.Tensor, varlen: bool, rows: int, cols: int, use_tma: bool):
    """The host-side TMA descriptor, one head's (rows, cols) tile at a time, of a (B, N, H, D) or
    varlen (T, H, D) tensor laid out as ``x``, as a function of the tensor; without TMA, the
    tensor itself (the kernels then read through pointers and never touch this argument).

    Built on the host, a descriptor reaches every program as a kernel parameter, where one
    built in the kernel costs each program a global write and a fence. Its per-head axes make
    TMA zero-fill past D and past the padded length; rows past a shorter sequence inside the
    tensor (seqlens, varlen) are read and then masked, as ``load_rows`` says.

    The descriptor is checked once, on ``x``; each call's copy only takes the new tensor as its
    base, which Triton reads for its address and dtype (a check costs microseconds of host time,
    and a forward and backward pass six descriptors). A tensor of the same layout (``layout``)
    passes the same checks.
    """
    if not use_tma:
        return _same
    from triton.tools.tensor_descriptor import TensorDescriptor

    view = x.unsqueeze(0) if varlen else x
    checked = TensorDescriptor(view, list(view.shape), [*view.stride()[:-1], 1], [1, rows, 1, cols])
    fields = {**vars(checked), "base": None}  # no tensor kept alive by the cache

    def descriptor(y: torch.Tensor):
        make_context_current(y)
        copy = TensorDescriptor.__new__(TensorDescriptor)
        vars(copy).update(fields, base=y)
        return copy

    return descriptor


def _same(x):
    return x


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in fp32 (acc None: a fresh product). Accumulating inside tl.dot keeps one
    register accumulator instead of a product plus a sum. PRECISION "upcast" multiplies bf16
    tiles as fp32 (exact: bf16 products fit fp32) for Triton's CPU interpreter, whose bf16
    tl.dot is wrong (3.9)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def masked_dot(a, b, allowed, acc, b_suspect, PRECISION: tl.constexpr):
    """acc + the sum over allowed j of a[i, j] * b[j, :], for masked tiles; ``a`` must already
    be 0 at every disallowed pair (P is: exp2(-inf) = 0).

    A plain dot adds 0 * NaN = NaN where a disallowed pair meets a NaN or inf in b, so NaN
    would reach outputs that never read it. Unless b is known finite (``b_suspect`` False),
    the finite part of b goes through the dot; an output whose allowed terms meet a non-finite
    entry of b becomes NaN (the contract's "Real NaN" rule), found by one 0/1 indicator product that
    runs only in tiles holding non-finite data. Unmasked tiles need none of this: every pair
    there is allowed.
    """
    if b_suspect:
        finite = tl.abs(b) < float("inf")  # False for NaN too
        out = dot(a, tl.where(finite, b, 0.0), acc, PRECISION)
        if tl.min(finite.to(tl.int32)) == 0:
            # 0/1 in b's dtype are exact and their counts accumulate exactly in fp32. Built from
            # floats: the interpreter turns a bool into bf16 as raw bits (a denormal).
            ones = tl.where(allowed, 1.0, 0.0).to(b.dtype)
            hits = dot(ones, tl.where(finite, 0.0, 1.0).to(b.dtype), None, PRECISION)
            out = tl.where(hits > 0, float("nan"), out)
    else:
        out = dot(a, b, acc, PRECISION)
    return out


@triton.jit
def any_nonfinite(x):
    """Whether a tile holds a NaN or an infinity (a scalar).

    The backward asks it of its score products: a non-finite row of Q, K, V or dO makes a whole
    row or column of them non-finite, so finite products clear the tile's operands for
    masked_dot's fast path without loading the operands into registers.
    """
    return tl.min((tl.abs(x) < float("inf")).to(tl.int32)) == 0


@triton.jit
def dropout_keep(i, j, stream, dropout):
    """Z[i, j] of the contract's Dropout section, row i and key j at positions row0 + i and key0 + j
    (the ``dropout_offsets`` option): with y = key0 + j, word y % 4 of
    Philox4x32-10((y // 4, row0 + i, stream, offset), seed) >= threshold. ``dropout`` is
    (seed, rng_offset, threshold, row0, key0, scale) (``_dropout_args``)."""
    seed, rng_offset, threshold, row0, key0, _ = dropout
    zero = i * 0 + j * 0
    j = j + key0
    c0 = (zero + j // 4).to(tl.uint32)
    c1 = (zero + i + row0).to(tl.uint32)
    c2 = (zero + stream).to(tl.uint32)
    c3 = (zero + rng_offset).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    word = zero + j % 4
    r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
    return r.to(tl.int64) >= threshold


def tma_ready(problem, *tensors: torch.Tensor) -> bool:
    """Whether the streamed operands load through TMA descriptors.

    TMA needs 16-byte aligned bases and leading strides. The K and V (Q and dO) tiles must be
    equally wide as well, a precaution: unequal tiles through TMA passed where checked (64/128,
    128/64), but not every unequal class (D = 192, Dv = 128 among them) has run so on a GPU.
    """
    widths = _tile_widths(problem.head_dim, problem.head_dim_v)
    return widths["BLOCK_D"] == widths["BLOCK_DV"] and all(
        x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1]) for x in tensors
    )


def allow_kernel_descriptors(x: torch.Tensor) -> None:
    """Give Triton the scratch memory that descriptors built in a kernel (``head_descriptors``)
    are written to. Per call, not once: Triton keeps the allocator per thread, and autograd runs
    the backward on a thread of its own. The interpreter needs none."""
    if x.is_cuda:
        triton.set_allocator(_descriptor_scratch)


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


_thread = threading.local()


def make_context_current(x: torch.Tensor) -> None:
    """Bind x's device's CUDA context to this thread before a host TMA descriptor of x is launched.

    Triton encodes a host descriptor (``row_descriptors``) before its launcher makes a context
    current, and the encoding fails ("invalid device context") on a thread that has made
    no CUDA runtime call yet: a fresh worker thread whose tensors all come from torch's cache, or
    autograd's backward thread. Any runtime call binds the primary context; a stream query is a
    cheap one, and once per thread is enough.
    """
    if x.is_cuda and not getattr(_thread, "has_context", False):
        torch.cuda.current_stream(x.device).query()
        _thread.has_context = True


def band_parts(problem, keys: bool, tile: int) -> int:
    """Which of ``band_part``'s three parts can hold tiles, bit ``1 << part`` each, for programs
    that hold query rows (``keys`` False) or keys and stream the other axis ``tile`` rows at a time.

    The kernels compile only these parts' loops: a masked loop holds registers and shared memory
    even where it never runs (masked_dot's NaN path above all), and makes the full tiles' loop
    spill (docs/triton-design.md, "Tiles of a band"). By ``band_tiles``, masked tiles come before the
    full ones only under a mask (then every used tile is masked) or where the near edge of the
    band is bounded, and after them only where its far edge is, or where the other axis can end
    inside a tile.
    """
    if problem.mask is not None or problem.block_mask is not None:
        return 0b001
    near, far = problem.band or (-1, -1)
    if keys:  # seen from the keys, the band is mirrored
        near, far = far, near
    other_length = problem.seqlen_q if keys else problem.seqlen_k
    ragged = (problem.varlen or (problem.seqlens_q if keys else problem.seqlens_k) is not None
              or other_length % tile != 0)
    return 0b010 | (near != -1) | (far != -1 or ragged) << 2


MASKED_PARTS = 0b101  # band_parts' bits for the masked tiles


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def row_strides(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """The (batch, row, head) strides of a (B, N, H, D) or varlen (T, H, D) tensor."""
    return (0, *x.stride()[:2]) if varlen else tuple(x.stride()[:3])


def lse_strides(x: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """The (batch, head) strides of an lse-shaped (B, H, N) or (H, T) tensor, rows contiguous."""
    return (0, x.stride(0)) if varlen else (x.stride(0), x.stride(1))


def layout(*tensors: torch.Tensor) -> tuple:
    """What a launch depends on in tensors of a given problem (whose shapes and dtype are fixed):
    their strides, and whether each is 16-byte aligned (TMA needs it; Triton specialises on it)."""
    return tuple((x.stride(), x.data_ptr() % 16 == 0) for x in tensors)


#: What was built for a static problem (``Problem.static_key``: what runs, not what it runs on)
#: and a caller's key (the kernel, the layout of its tensors and of ``call_args``): a call of the
#: same shapes and options skips everything built, whether or not it is the same Problem (calls
#: with masks, lengths or a drawn seed are new Problems every time). Nothing built holds a Problem
#: or a call's own values: those reach the kernels through ``call_args`` on every call.
_built: dict[tuple, object] = {}
_BUILT_LIMIT = 256  # past it the memory starts again empty


def per_problem(problem, key, build):
    """``build()``, made once per static problem and ``key``."""
    full_key = (problem.static_key(), key)
    found = _built.get(full_key)
    if found is None:
        if len(_built) >= _BUILT_LIMIT:
            _built.clear()
        found = _built[full_key] = build()
    return found


def call_args(problem) -> tuple:
    """The kernel arguments that change from call to call of one static problem, which kernels
    take right after their own tensors: the optional tensors CU_Q, CU_K, SEQLENS_Q, SEQLENS_K,
    MASK and BLOCKS (None where absent; masks broadcast to (B, Hq, ., .)) and ``dropout``
    (``_dropout_args``)."""
    mask, blocks = _mask_tensors(problem)
    return (problem.cu_seqlens_q, problem.cu_seqlens_k, problem.seqlens_q, problem.seqlens_k, mask, blocks,
            _dropout_args(problem))


def call_layout(values: tuple) -> tuple:
    """What Triton specialises a kernel on in ``call_args``' values: a tensor's strides and
    16-byte alignment, an int's type (i32, i64 or u64) and whether it is 1 or a multiple of 16.
    A launch compiled for one call's values serves another call's only where these agree."""
    return tuple(_specialisation(x) for x in values)


def _specialisation(x):
    if x is None or isinstance(x, float):
        return x is None
    if isinstance(x, torch.Tensor):
        return x.stride(), x.data_ptr() % 16 == 0
    if isinstance(x, tuple):
        return tuple(_specialisation(item) for item in x)
    width = "i32" if -2**31 <= x < 2**31 else "u64" if x >= 2**63 else "i64"
    return width, x == 1, x % 16 == 0


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
    """

    def __init__(self, kernel, programs: int, options: dict, masked: bool, **bound):
        self.programs, self.masked = programs, masked
        shares = triton.cdiv(programs, FLAGS_PER_PROGRAM.value)
        self.launches = [Launch(kernel, (shares if exact and masked else programs,), options, **bound,
                                programs=programs, EXACT=exact) for exact in ((False, True) if masked else (True,))]

    def __call__(self, *tensors) -> torch.Tensor | None:
        """Both launches; returns the flags (None: one launch).

        A candidate under trial (``tuning.trying_candidates``) compiles its exact kernel only
        when a program is flagged: so a choice compiles each candidate once, not twice (compiling
        is most of what tuning costs)."""
        redo = torch.empty(self.programs, dtype=torch.int8, device=tensors[0].device) if self.masked else None
        plain, *exact = self.launches
        plain(*tensors, redo)
        for launch in exact:
            if launch.compiled is None and tuning.trying_candidates() and not redo.any():
                continue
            launch(*tensors, redo)
        return redo


FLAGS_PER_PROGRAM = tl.constexpr(32)


@triton.jit
def flag_nonfinite(REDO, total):
    """Flag this program for the exact launch (``Passes``) unless ``total``, a sum of its outputs,
    is finite. A sum is non-finite where a term is (or, harmlessly, where it overflows), and costs
    fewer registers than testing every element (forward, d128: 151 against 167)."""
    tl.store(REDO + tl.program_id(0), (tl.abs(total) < float("inf")).to(tl.int8) ^ 1)


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


def problem_args(problem) -> dict:
    """The kernel arguments that describe the static problem rather than one tensor or one call:
    the groups ``shape`` (padded_q, padded_k, heads_q, group), ``band`` (left, right) and ``masks``
    (``_mask_layout``), and the constexprs."""
    varlen = problem.varlen
    left, right = problem.band_reach
    args = dict(
        shape=(problem.seqlen_q, problem.seqlen_k, problem.heads_q, problem.group),
        band=(left, right),
        IS_VARLEN=varlen,
        HAS_SEQLENS_Q=problem.seqlens_q is not None,
        HAS_SEQLENS_K=problem.seqlens_k is not None,
        HEAD_DIM=problem.head_dim,
        HEAD_DIM_V=problem.head_dim_v,
        **_tile_widths(problem.head_dim, problem.head_dim_v),
        DOT_PRECISION=_dot_precision(problem.dtype),
    )
    args.update(_mask_layout(problem), DROPOUT=problem.dropout_p > 0)
    return args


def _tile_widths(head_dim: int, head_dim_v: int) -> dict:
    """BLOCK_D and BLOCK_DV: the head dims padded to powers of two, at least 16 (tl.dot's minimum).

    Triton 3.6 miscompiles a 16- or 32-wide tile beside a wider one for sm_90: wrong dk and
    illegal accesses in the dK/dV kernel, out-of-bounds TMA reads in the forward
    (docs/triton-design.md, "Loads: TMA descriptors"). Equal widths, and unequal ones of 64 and
    more, compile right; so unequal widths are padded to 64 at least.
    """
    block_d, block_dv = (max(16, triton.next_power_of_2(d)) for d in (head_dim, head_dim_v))
    if block_d != block_dv:
        block_d, block_dv = max(64, block_d), max(64, block_dv)
    return dict(BLOCK_D=block_d, BLOCK_DV=block_dv)


def _dot_precision(dtype: str) -> str:
    if dtype == "float32":
        return "ieee"  # the contract's Numerics section: no TF32 unless asked
    if dtype == "bfloat16" and os.environ.get("TRITON_INTERPRET") == "1":
        return "upcast"
    return "tf32"  # ignored for 16-bit inputs


def _mask_tensors(problem) -> tuple:
    """MASK and BLOCKS, broadcast to (B, Hq, Nq, Nk) and (B, Hq, Nq / bq, Nk / bk) (None where absent)."""
    shape = (problem.batch, problem.heads_q)
    mask = blocks = None
    if problem.mask is not None:
        mask = problem.mask.expand(*shape, problem.seqlen_q, problem.seqlen_k)
    if problem.block_mask is not None:
        bq, bk = problem.block_mask.block_size
        blocks = problem.block_mask.blocks.expand(*shape, -(-problem.seqlen_q // bq), -(-problem.seqlen_k // bk))
    return mask, blocks


def _mask_layout(problem) -> dict:
    """``masks``: the (batch, head, row, column) strides of MASK and BLOCKS (``_mask_tensors``),
    then the block mask's (block_q, block_k); and whether each is there. The strides are the same
    for every call of one ``call_layout``."""
    mask, blocks = _mask_tensors(problem)
    block_size = problem.block_mask.block_size if blocks is not None else (1, 1)
    strides = tuple(x.stride() if x is not None else (0, 0, 0, 0) for x in (mask, blocks))
    return dict(masks=(*strides[0], *strides[1], *block_size), HAS_MASK=mask is not None,
                HAS_BLOCK_MASK=blocks is not None)


def _dropout_args(problem) -> tuple:
    """(seed, rng_offset, threshold, row0, key0, scale): what ``dropout_keep`` draws from and the
    kept values' scale."""
    seed = problem.seed
    # The seed is passed as a signed 64-bit value with the same bits; tl.philox reads it as uint64.
    return (seed - (1 << 64) if seed >= 1 << 63 else seed, problem.rng_offset_words[0], problem.dropout_threshold,
            *problem.dropout_offsets, problem.dropout_scale)
