"""Problems and tensors packed into the kernels' argument structs, and the launches.

Each kernel takes one by-value struct: ``Params`` (``kernels/common.cuh``) for the forwards, or one
derived from it for the backward's and decoding's kernels (``BackwardParams``, ``DecodeParams``),
passed to CuPy as a NumPy structured array of the same layout (``PARAMS``, ``BACKWARD_PARAMS``,
``DECODE_PARAMS``: 8-byte fields first, so no padding can differ).
Tensors arrive as torch CUDA tensors (the backend's array kind: CuPy has no bfloat16) and are
read through their addresses and strides; outputs are allocated by torch. Every launch runs on
the caller's current stream: torch's for torch callers, CuPy's for CuPy callers.
"""

from __future__ import annotations

import contextlib
import functools
import math
import struct

import numpy as np

from flashx.backend import per_static_problem, tensor_layout, weightless_rows_as_plus_inf
from flashx.problem import head_dim_class
from flashx_cupy import tma, variants

_POINTERS = ("q", "k", "v", "o", "lse", "cu_q", "cu_k", "seqlens_q", "seqlens_k", "mask", "blocks", "alibi_slopes",
             "sinks", "k_descale", "v_descale")
_STRIDES = ("q_b", "q_n", "q_h", "q_d", "k_b", "k_n", "k_h", "k_d", "v_b", "v_n", "v_h", "v_d", "o_b", "o_n", "o_h", "o_d",
            "lse_b", "lse_h", "mask_b", "mask_h", "mask_i", "mask_j", "blocks_b", "blocks_h", "blocks_i", "blocks_j",
            "alibi_b")
_INTS = ("batch", "heads_q", "heads_k", "group", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
         "left", "right", "block_q", "block_k", "rng_offset", "drop_threshold", "tiles_m", "drop_row0", "drop_col0",
         "heads_inner")
_FLOATS = ("scale", "scale_log2", "drop_scale", "softcap_scale", "softcap_log2")

#: The layout of ``struct Params`` (kernels/common.cuh): the forward kernels' arguments, and the
#: first fields of every other kernel's.
PARAMS = np.dtype(
    [(name, np.uint64) for name in _POINTERS]
    + [(name, np.int64) for name in _STRIDES]
    + [("seed", np.uint64)]
    + [(name, np.int32) for name in _INTS]
    + [(name, np.float32) for name in _FLOATS],
    align=True,
)


def _derived(pointers: tuple, strides: tuple, ints: tuple) -> np.dtype:
    """The layout of a struct derived from ``Params``: its fields, then these (8-byte ones first)
    from the end of ``Params``, as C++ lays out a class with a base of plain data."""
    own = np.dtype([(name, np.uint64) for name in pointers] + [(name, np.int64) for name in strides]
                   + [(name, np.int32) for name in ints], align=True)
    names = PARAMS.names + own.names
    return np.dtype({"names": names,
                     "formats": [PARAMS.fields[name][0] for name in PARAMS.names] + [own.fields[name][0] for name in own.names],
                     "offsets": [PARAMS.fields[name][1] for name in PARAMS.names]
                     + [PARAMS.itemsize + own.fields[name][1] for name in own.names],
                     "itemsize": PARAMS.itemsize + own.itemsize})


#: The layout of ``struct BackwardParams`` (kernels/backward.cuh).
BACKWARD_PARAMS = _derived(
    ("dout", "dq", "dk", "dv", "delta", "dsinks_rows"),
    ("do_b", "do_n", "do_h", "do_d", "dq_b", "dq_n", "dq_h", "dk_b", "dk_n", "dk_h", "dv_b", "dv_n", "dv_h",
     "delta_b", "delta_h"),
    ("kv_head0", "kv_heads"))
#: The layout of ``struct DecodeParams`` (kernels/decode.cu).
DECODE_PARAMS = _derived(
    ("cache_seqlens", "block_table", "k_new", "v_new", "o_part", "lse_part"),
    ("table_b", "kn_b", "kn_n", "kn_h", "kn_d", "vn_b", "vn_n", "vn_h", "vn_d"),
    ("new_tokens", "page_size", "splits"))
#: The layout of ``struct DqRound`` (kernels/dq.cu): flashx_dq_round's second parameter.
DQ_ROUND = np.dtype([("sums", np.uint64), ("rows", np.int32), ("head0", np.int32), ("heads", np.int32)], align=True)
#: How a record travels to CuPy: as one opaque element of its size (by size: each layout's differs).
#: CuPy finds a NumPy argument's address through ``__array_interface__``, which describes a
#: structured dtype field by field, at a cost (tens of microseconds a launch) that an opaque
#: element does not have.
OPAQUE = {layout.itemsize: np.dtype((np.void, layout.itemsize))
          for layout in (PARAMS, BACKWARD_PARAMS, DECODE_PARAMS, DQ_ROUND)}


def pack(problem, layout: np.dtype = PARAMS, **fields) -> np.ndarray:
    """A one-element array of ``layout`` (PARAMS or BACKWARD_PARAMS) for the attention ``problem``;
    ``fields`` give the tensors' addresses and strides (names of the layout). Unnamed pointers are
    null, unnamed strides 0."""
    left, right = problem.band_reach
    return record(problem, layout, dict(
        seqlen_k=problem.seqlen_k,
        left=left,
        right=right,
        block_q=problem.block_mask.block_size[0] if problem.block_mask is not None else 1,
        block_k=problem.block_mask.block_size[1] if problem.block_mask is not None else 1,
        drop_threshold=np.uint32(problem.dropout_threshold).view(np.int32),
        drop_row0=problem.dropout_offsets[0],
        drop_col0=problem.dropout_offsets[1],
        drop_scale=problem.dropout_scale,
    ) | dropout_draw(problem) | fields)


def dropout_draw(problem) -> dict:
    """The struct's fields that a call draws: dropout's seed and the low word of its RNG offset."""
    return dict(seed=problem.seed, rng_offset=np.uint32(problem.rng_offset_words[0]).view(np.int32))


def record(problem, layout: np.dtype, values: dict) -> np.ndarray:
    """A one-element array of ``layout`` holding what every operation's problem derives (heads,
    head dims, the scale, softcap's factors), then ``values``; fields named nowhere are 0."""
    shared = dict(
        batch=problem.batch,
        heads_q=problem.heads_q,
        heads_k=problem.heads_k,
        group=problem.group,
        seqlen_q=problem.seqlen_q,
        head_dim=problem.head_dim,
        head_dim_v=problem.head_dim_v,
        scale=problem.softmax_scale,
        scale_log2=problem.scale_log2,
    )
    if problem.softcap is not None:  # the kernels' tanh argument and base-2 factor (score_mods.cuh)
        shared.update(softcap_scale=problem.softmax_scale / problem.softcap, softcap_log2=problem.softcap * math.log2(math.e))
    return _packer(layout)(shared | values)


#: struct's code of each field type of the layouts: standard sizes, little-endian as the GPU reads.
_CODES = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i", np.dtype(np.float32): "f"}


@functools.cache
def _packer(layout: np.dtype):
    """A function packing a dict of ``layout``'s fields (the rest 0) into a one-element array of it.

    One ``struct.pack`` of the fields in order: setting a structured array's fields one by one
    costs about a microsecond each, and a backward's struct has a hundred."""
    names = sorted(layout.names, key=lambda name: layout.fields[name][1])
    codes, end = ["<"], 0
    for name in names:
        field, offset = layout.fields[name][:2]
        codes += ["x" * (offset - end), _CODES[field]]
        end = offset + field.itemsize
    packer = struct.Struct("".join(codes) + "x" * (layout.itemsize - end))
    known = frozenset(names)

    def pack(values: dict) -> np.ndarray:
        if not values.keys() <= known:
            raise KeyError(f"cupy: no field {sorted(values.keys() - known)} in the kernels' struct")
        return np.frombuffer(bytearray(packer.pack(*[values.get(name, 0) for name in names])), dtype=layout)

    return pack


def tensor_fields(name: str, x, varlen: bool, dims: int = 4) -> dict:
    """The address and (batch, row, head[, dim]) strides of a (B, N, H, D) or varlen (T, H, D) tensor."""
    strides = (0, *x.stride()) if varlen else tuple(x.stride())
    fields = {name if name != "do" else "dout": x.data_ptr()}
    for axis, stride in zip("bnhd"[:dims], strides):
        fields[f"{name}_{axis}"] = stride
    return fields


def row_stat_fields(name: str, x, varlen: bool) -> dict:
    """The address and (batch, head) strides of an lse-shaped (B, H, N) or (H, T) tensor; rows contiguous."""
    b, h = (0, x.stride(0)) if varlen else (x.stride(0), x.stride(1))
    return {name: x.data_ptr(), f"{name}_b": b, f"{name}_h": h}


def auxiliary_fields(problem) -> dict:
    """The addresses of the auxiliary arrays (``auxiliary_arrays``), ALiBi's batch stride
    (``score_mod_fields``), and the strides of the mask and the block mask, broadcast to
    (B, Hq, ., .). The core hands the lengths over as int32 and the slopes and sinks in the lse's
    dtype (float32 here), each contiguous: the kernels read them where they are, so a call converts
    and copies none of them."""
    fields = score_mod_fields(problem)
    fields.update((name, array.data_ptr()) for name, array in auxiliary_arrays(problem) if array is not None)
    shape = (problem.batch, problem.heads_q)
    if problem.mask is not None:
        mask = problem.mask.expand(*shape, problem.seqlen_q, problem.seqlen_k)
        fields.update(zip(("mask_b", "mask_h", "mask_i", "mask_j"), mask.stride()))
    if problem.block_mask is not None:
        bq, bk = problem.block_mask.block_size
        blocks = problem.block_mask.blocks.expand(*shape, -(-problem.seqlen_q // bq), -(-problem.seqlen_k // bk))
        fields.update(zip(("blocks_b", "blocks_h", "blocks_i", "blocks_j"), blocks.stride()))
    return fields


def auxiliary_arrays(problem) -> tuple:
    """(struct field, array or None) of each array of the problem's that the kernels read where it lies."""
    blocks = problem.block_mask.blocks if problem.block_mask is not None else None
    return (("cu_q", problem.cu_seqlens_q), ("cu_k", problem.cu_seqlens_k), ("seqlens_q", problem.seqlens_q),
            ("seqlens_k", problem.seqlens_k), ("mask", problem.mask), ("blocks", blocks),
            ("alibi_slopes", problem.alibi_slopes), ("sinks", problem.sinks))


def score_mod_fields(problem) -> dict:
    """The addresses of ALiBi's slopes and the sinks, float32 and contiguous from the core."""
    fields = {}
    for name, array in (("alibi_slopes", problem.alibi_slopes), ("sinks", problem.sinks)):
        if array is not None:
            fields[name] = array.data_ptr()
    if problem.alibi_slopes is not None:  # (Hq,) slopes serve every sequence
        fields["alibi_b"] = problem.heads_q if problem.alibi_slopes.dim() == 2 else 0
    return fields


def aligned(problem, *tensors) -> bool:
    """Whether every operand can be read in 16-byte chunks: unit last stride, 16-byte aligned
    base and row strides, head dims a whole number of chunks of each operand's elements (16 of an
    FP8 cache's, 8 of a 16-bit tensor's)."""
    for x in tensors:
        size = x.element_size()
        if problem.head_dim % (16 // size) or problem.head_dim_v % (16 // size):
            return False
        if x.data_ptr() % 16 or (x.shape[-1] > 1 and x.stride(-1) != 1):
            return False
        if any(n > 1 and s * size % 16 for n, s in zip(x.shape[:-1], x.stride()[:-1])):
            return False
    return True


@contextlib.contextmanager
def caller_stream(problem, x):
    """The device (a cupy.cuda.Device, made current) and the caller's current stream, as CuPy's
    launches take it (``launch``, ``KernelLaunch``): torch's stream for torch callers, CuPy's for
    CuPy callers (the contract's "Backend plugins" section), torch's allocations included.
    Address 0 is the legacy default stream in both libraries."""
    import cupy
    import torch

    index = x.device.index
    with cupy.cuda.Device(index) as device:
        if problem.array_kind == "cupy":
            stream = cupy.cuda.get_current_stream()
            ours = torch.cuda.ExternalStream(stream.ptr, device=x.device) if stream.ptr else torch.cuda.default_stream(x.device)
            with torch.cuda.stream(ours):
                yield device, stream
        else:
            yield device, _cupy_stream(torch.cuda.current_stream(x.device).cuda_stream, index)


@functools.lru_cache(maxsize=64)
def _cupy_stream(pointer: int, device_index: int):
    """CuPy's handle of torch's stream ``pointer``: made once, as making one costs a short call
    microseconds it does not have."""
    import cupy

    return cupy.cuda.ExternalStream(pointer, device_index) if pointer else cupy.cuda.Stream.null


def launch(variant: variants.Variant, device, stream, grid: int, params: np.ndarray, *extra) -> None:
    """One launch of ``variant`` on ``stream``, with ``params`` packed whole for this call."""
    if grid:
        _kernel(variant, device)((grid,), (variant.threads,), (params.view(OPAQUE[params.itemsize]), *extra),
                                 shared_mem=variant.shared_memory, stream=stream)


def _kernel(variant: variants.Variant, device):
    """The compiled kernel of ``variant``, once its shared memory is known to fit ``device``."""
    limit = variants.shared_memory_limit(device.id)
    if variant.shared_memory > limit:
        from flashx.errors import UnsupportedError

        raise UnsupportedError(f"cupy: {variant.kernel} needs {variant.shared_memory} bytes of shared memory per block, "
                               f"this GPU allows {limit}")
    return variants.kernel(variant, device)


class KernelLaunch:
    """A launch of one kernel for a static problem and layout (``flashx.backend.tensor_layout``):
    the compiled kernel, its grid, and its struct packed but for the fields each call brings
    (``call_fields``: its arrays' addresses, dropout's seed and RNG offset), which ``__call__``
    writes in.

    Built once per static problem and layout (``per_problem``), so that a call packs no more than
    those: a short training step (B=32, N=512) spent more host time packing structs and choosing
    variants than its kernels ran. The per-call fields are null in the kept struct, so a call that
    leaves out one it needs faults rather than reading another call's address."""

    def __init__(self, variant: variants.Variant, device, grid: int, params: np.ndarray):
        self.kernel = _kernel(variant, device)
        self.grid, self.block, self.shared_memory = (grid,), (variant.threads,), variant.shared_memory
        self.writers = _per_call_writers(params.dtype)
        template = bytearray(params.tobytes())
        for writer, offset in self.writers.values():
            writer.pack_into(template, offset, 0)
        self.template, self.opaque = bytes(template), OPAQUE[params.itemsize]

    def __call__(self, stream, fields: dict, *extra) -> None:
        """Launch on ``stream`` with ``fields`` written into the struct."""
        if self.grid[0] == 0:
            return
        params = bytearray(self.template)
        for name, value in fields.items():
            writer, offset = self.writers[name]
            writer.pack_into(params, offset, value)
        self.kernel(self.grid, self.block, (np.frombuffer(params, self.opaque), *extra),
                    shared_mem=self.shared_memory, stream=stream)


@functools.cache
def _per_call_writers(layout: np.dtype) -> dict:
    """field -> (struct.Struct, offset) of ``layout``'s per-call fields: every 8-byte unsigned one
    (the addresses and dropout's seed) and dropout's RNG offset."""
    return {name: (struct.Struct("<" + _CODES[layout.fields[name][0]]), layout.fields[name][1])
            for name in layout.names if layout.fields[name][0] == np.uint64 or name == "rng_offset"}


def call_fields(problem, **tensors) -> dict:
    """What a call brings to its ``KernelLaunch``: the addresses of ``tensors`` (named as the
    struct names them) and of the problem's auxiliary arrays, and dropout's seed and RNG offset."""
    fields = {name: x.data_ptr() for name, x in tensors.items() if x is not None}
    for name, array in auxiliary_arrays(problem):
        if array is not None:
            fields[name] = array.data_ptr()
    if problem.dropout_p > 0:
        fields.update(dropout_draw(problem))
    return fields


#: What was built per static problem and layout: ``per_problem``.
_built: dict[tuple, object] = {}


def per_problem(problem, key, build):
    """``build()``, made once per static problem and ``key`` (``flashx.backend.per_static_problem``)."""
    return per_static_problem(_built, problem, key, build)


def strided_layout(problem, *tensors) -> tuple:
    """``tensor_layout`` of ``tensors`` and of the arrays read through their strides (the masks)."""
    blocks = problem.block_mask.blocks if problem.block_mask is not None else None
    return tensor_layout(*tensors, problem.mask, blocks)


def tiles(rows: int, block: int) -> int:
    return -(-rows // block)


@functools.cache
def device_size(device_id: int) -> tuple[int, int]:
    """(SMs, shared memory per SM in bytes) of a GPU."""
    import cupy

    attributes = cupy.cuda.Device(device_id).attributes
    return attributes["MultiProcessorCount"], attributes["MaxSharedMemoryPerMultiprocessor"]


def tile_grid(problem, variant: variants.Variant, device, rows: int, heads: int) -> tuple[int, dict]:
    """The grid of a kernel whose CTAs take tiles of ``variant.block_m`` of ``rows`` rows a head, of
    ``heads`` heads a sequence, and the fields that say how to read it (kernels/scheduling.cuh):
    tiles_m and heads_inner."""
    tiles_m = tiles(rows, variant.block_m)
    ctas = tiles_m * heads * problem.batch
    inner = variants.heads_inner(problem, variant.kernel, ctas, device_size(device.id)[0])
    return ctas, dict(tiles_m=tiles_m, heads_inner=int(inner))


#: The fused backward's float32 dQ sums (four bytes an element of dQ, its head dim padded to its
#: class) take one launch where they fit this much memory, as FA3's dQ accumulator holds them all:
#: launches of a few kv heads each pay their own causal tail and the clearing and rounding of their
#: sums, which cost a causal step more than the split kernels' two extra products.
DQ_SUMS_WHOLE_BYTES = 256 * 2**20
#: Larger sums take launches of kv heads whose sums fit this much at a time, so that the peak stays
#: near the split kernels' (and the sums stay in the L2 cache that their reductions hit).
DQ_SUMS_BYTES = 32 * 2**20
#: The fused backward's float32 dQ sums lie in panels of this many columns (``DQ_PANEL`` in
#: kernels/backward.cuh): an m16n8 atom's, so that a warp's store of one atom is 256 contiguous bytes.
DQ_PANEL = 8


def dq_sums_per_kv_head(problem) -> int:
    """The bytes of the fused backward's float32 dQ sums of one kv head's query heads."""
    rows = problem.total_q if problem.varlen else problem.batch * problem.seqlen_q
    return rows * problem.group * head_dim_class(problem.head_dim) * 4


def dq_sums_whole(problem) -> bool:
    """Whether the fused backward adds the dQ of every kv head in one launch (DQ_SUMS_WHOLE_BYTES)."""
    return dq_sums_per_kv_head(problem) * problem.heads_k <= DQ_SUMS_WHOLE_BYTES


def kv_head_chunks(problem) -> list[tuple[int, int]]:
    """(first kv head, kv heads) of each fused dK/dV launch."""
    if dq_sums_whole(problem):
        return [(0, problem.heads_k)]
    heads = max(1, min(problem.heads_k, DQ_SUMS_BYTES // dq_sums_per_kv_head(problem)))
    return [(first, min(heads, problem.heads_k - first)) for first in range(0, problem.heads_k, heads)]


def forward(problem, q, k, v):
    import torch

    varlen = problem.varlen
    with caller_stream(problem, q) as (device, stream):
        out_dtype = getattr(torch, problem.out_dtype)
        if varlen and problem.rows_past_sequences:  # rows of no sequence read as empty rows
            o = torch.zeros(problem.o_shape, dtype=out_dtype, device=q.device)
            lse = empty_row_lse(problem, q.device)
        else:
            o = torch.empty(problem.o_shape, dtype=out_dtype, device=q.device)
            lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
        descales = {}
        if problem.fp8:  # ``v`` becomes the copy the FP8 forward reads, alive until the launch is queued
            q, k = (x if aligned(problem, x) else x.clone(memory_format=torch.contiguous_format) for x in (q, k))
            v, descales = keys_in_fp8_order(problem, v), fp8_descales(problem)
        run = per_problem(problem, ("forward", strided_layout(problem, q, k, v, o, lse)),
                          lambda: _forward_launch(problem, device, q, k, v, o, lse))
        run(stream, call_fields(problem, q=q, k=k, v=v, o=o, lse=lse, **descales), k, v)
    return o, lse


def _forward_launch(problem, device, q, k, v, o, lse):
    """The forward's launch for the static problem and layout of these tensors (FP8: ``v`` in
    ``keys_in_fp8_order``), as a function of a call's (stream, ``call_fields``, k, v). The wgmma
    forwards' tensor maps of K and V are kept per pair of addresses (a model's steps reuse
    theirs), as encoding them costs a short call microseconds."""
    varlen = problem.varlen
    is_aligned = problem.fp8 or aligned(problem, q, k, v)
    by_tma = tma.usable(problem, k, v)
    kernel = variants.forward_kernel(problem, is_aligned, device.compute_capability, by_tma)
    variant = variants.choose(kernel, problem, is_aligned, tma=kernel == "forward_sm90" and by_tma)
    ctas, grid_fields = tile_grid(problem, variant, device, problem.seqlen_q, problem.heads_q)
    v_fields = ({"v_b": v.stride(0), "v_h": v.stride(1), "v_n": v.stride(2), "v_d": 1} if problem.fp8
                else tensor_fields("v", v, varlen))  # FP8: (B, Hk, Dv, Nk'), keys contiguous
    params = pack(problem, **grid_fields, **auxiliary_fields(problem), **tensor_fields("q", q, varlen),
                  **tensor_fields("k", k, varlen), **v_fields, **tensor_fields("o", o, varlen),
                  **row_stat_fields("lse", lse, varlen))
    run = KernelLaunch(variant, device, ctas, params)
    if kernel not in variants.SM90_FORWARDS:
        return lambda stream, fields, k, v: run(stream, fields)
    maps = {}

    def run_with_maps(stream, fields, k, v):
        key = k.data_ptr(), v.data_ptr()
        found = maps.get(key)
        if found is None:
            if len(maps) >= MAPS_KEPT:
                maps.clear()
            found = maps[key] = tma.kernel_argument(variant, k, v)
        run(stream, fields, found)

    return run_with_maps


#: Pairs of K and V addresses whose tensor maps a forward launch keeps.
MAPS_KEPT = 64


def fp8_descales(problem) -> dict:
    """The FP8 forward's descales by struct field: the scores' factor q_descale * k_descale,
    multiplied here (one (B, Hk) product), as ``k_descale``, and ``v_descale``; absent for 1."""
    descales = {}
    present = [x for x in (problem.q_descale, problem.k_descale) if x is not None]
    if present:
        descales["k_descale"] = present[0] * present[1] if len(present) == 2 else present[0]
    if problem.v_descale is not None:
        descales["v_descale"] = problem.v_descale
    return descales


def keys_in_fp8_order(problem, v):
    """V, e4m3 (B, Nk, Hk, Dv) or packed (Tk, Hk, Dv), as the FP8 forward reads it: uint8
    (B, Hk, Dv, Nk') contiguous, Nk' = Nk rounded up to 16 (16 at least), each sequence's keys
    from column 0 (packed ones too), zeros past them, and within each 16 keys in the order of P's
    register operand: key 8a + 2t + c (a, c in {0, 1}) at column 4t + 2a + c (``e4m3_key_column``
    in kernels/wgmma_e4m3.cuh says why).

    wgmma's e4m3 product takes V K-major, keys contiguous; the copy is one pass over V (two with
    padding or packed sequences), against the forward's 2 * D multiply-adds per element of V."""
    import torch

    data = v.view(torch.uint8)
    keys = max(-(-problem.seqlen_k // 16) * 16, 16)
    if problem.varlen:  # each sequence's keys from 0: 16-byte aligned copies whatever cu_seqlens_k holds
        rows = torch.arange(data.shape[0], device=data.device)
        starts = problem.cu_seqlens_k.long()
        sequence = torch.searchsorted(starts[1:], rows, right=True)
        # rows past the last sequence (sequence B) land in a spare one, dropped: no mask, no host sync
        padded = data.new_zeros((problem.batch + 1, keys, *data.shape[1:]))
        padded[sequence, (rows - starts[sequence]).clamp(max=keys - 1)] = data
        padded = padded[:problem.batch]
    elif keys != data.shape[1]:
        padded = data.new_zeros((data.shape[0], keys, *data.shape[2:]))
        padded[:, :data.shape[1]] = data
    else:
        padded = data
    groups = padded.unflatten(1, (keys // 16, 2, 4, 2))  # (B, Nk' / 16, a, t, c, Hk, Dv)
    # (a, t, c) -> (t, a, c) behind (B, Hk, Dv, group): one strided copy
    return groups.permute(0, 5, 6, 1, 3, 2, 4).reshape(padded.shape[0], padded.shape[2], padded.shape[3], keys)


def backward(problem, q, k, v, o, lse, do):
    import torch

    varlen = problem.varlen
    with caller_stream(problem, q) as (device, stream):
        # varlen: rows past cu_seqlens[-1], of no sequence, stay 0
        zeros_or_empty = torch.zeros if varlen and problem.rows_past_sequences else torch.empty
        dq = zeros_or_empty(q.shape, dtype=q.dtype, device=q.device)
        dk = zeros_or_empty(k.shape, dtype=k.dtype, device=k.device)
        dv = zeros_or_empty(v.shape, dtype=v.dtype, device=v.device)
        lse = weightless_rows_as_plus_inf(lse)
        delta = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
        # the delta kernel's term of each row in dsinks, summed here in a fixed order (deterministic)
        dsinks_rows = torch.empty_like(delta) if problem.sinks is not None else None
        run = per_problem(problem, ("backward", strided_layout(problem, q, k, v, o, lse, do)),
                          lambda: _backward_launches(problem, device, q, k, v, o, lse, do, dq, dk, dv, delta))
        run(stream, call_fields(problem, q=q, k=k, v=v, o=o, lse=lse, dout=do, dq=dq, dk=dk, dv=dv, delta=delta,
                                dsinks_rows=dsinks_rows), dq)
        grads = (dq, dk, dv) if dsinks_rows is None else (dq, dk, dv, sum_over_rows(problem, dsinks_rows))
    return grads


def _backward_launches(problem, device, q, k, v, o, lse, do, dq, dk, dv, delta):
    """The backward's launches for the static problem and layout of these tensors, as a function
    of a call's (stream, ``call_fields``, dq): delta, then dQ, dK and dV, in one kernel adding dQ
    where ``fused_dq`` holds, else dQ's kernel and dK/dV's (two where ``dkdv_parts`` splits them)."""
    varlen = problem.varlen
    is_aligned = aligned(problem, q, k, v, o, do)
    fields = dict(**auxiliary_fields(problem), **tensor_fields("q", q, varlen), **tensor_fields("k", k, varlen),
                  **tensor_fields("v", v, varlen), **tensor_fields("o", o, varlen),
                  **tensor_fields("do", do, varlen), **tensor_fields("dq", dq, varlen, 3),
                  **tensor_fields("dk", dk, varlen, 3), **tensor_fields("dv", dv, varlen, 3),
                  **row_stat_fields("lse", lse, varlen), **row_stat_fields("delta", delta, varlen),
                  kv_head0=0, kv_heads=problem.heads_k)
    rows = problem.total_q if varlen else problem.batch * problem.seqlen_q
    params = pack(problem, BACKWARD_PARAMS, **fields)
    delta_launch = KernelLaunch(variants.choose("delta", problem, is_aligned), device,
                                tiles(rows * problem.heads_q, variants.DELTA_WARPS), params)
    sm90 = variants.sm90_backward(problem, is_aligned, device.compute_capability)
    if variants.fused_dq(problem, sm90, dq_sums_whole(problem)):
        variant = variants.choose("dkdv_sm90" if sm90 else "dkdv", problem, is_aligned, dq_atomic=True)
        rounding = variants.choose("dq_round", problem, is_aligned)
        gradients = _dkdv_adding_dq(problem, device, variant, fields, dq, rounding, params)
    else:
        variant = variants.choose("dq_sm90" if sm90 else "dq", problem, is_aligned)
        ctas, grid_fields = tile_grid(problem, variant, device, problem.seqlen_q, problem.heads_q)
        launches = [KernelLaunch(variant, device, ctas, pack(problem, BACKWARD_PARAMS, **grid_fields, **fields))]
        for parts in variants.dkdv_parts(head_dim_class(problem.head_dim), head_dim_class(problem.head_dim_v)):
            variant = variants.choose("dkdv_sm90" if sm90 else "dkdv", problem, is_aligned, parts)
            ctas, grid_fields = tile_grid(problem, variant, device, problem.seqlen_k, problem.heads_k)
            launches.append(KernelLaunch(variant, device, ctas, pack(problem, BACKWARD_PARAMS, **grid_fields, **fields)))

        def gradients(stream, call, dq):
            for launch in launches:
                launch(stream, call)

    def run(stream, call, dq):
        delta_launch(stream, call, np.int32(rows))
        gradients(stream, call, dq)

    return run


def _dkdv_adding_dq(problem, device, variant, fields: dict, dq, rounding, params):
    """The fused dK/dV launches, a chunk of kv heads each, as a function of a call's (stream,
    ``call_fields``, dq): dQ of the chunk's query heads is summed in float32 (scaled, the head
    dim padded to its class), and then ``rounding`` (flashx_dq_round, its struct ``params``)
    rounds the sums into ``dq``.

    The sums of a query head lie in panels of ``DQ_PANEL`` columns, each panel's rows contiguous:
    (B, heads, panels, Nq, DQ_PANEL), or (heads, panels, Tq, DQ_PANEL) packed, so that a query
    tile's rows of a panel are one range, which flashx_dkdv_sm90 adds by one bulk reduction. The
    kernels see a panel as a head of DQ_PANEL columns: head h's panel i is head h * panels + i."""
    import torch

    group, chunks = problem.group, kv_head_chunks(problem)
    batch, rows = dq.shape[:-3], dq.shape[-3]
    rows_q = rows * (batch[0] if batch else 1)
    panels = variant.dim_qk // DQ_PANEL
    shape = (*batch, chunks[0][1] * group, panels, rows, DQ_PANEL)
    layout = torch.empty(shape, dtype=torch.float32, device="meta")  # the sums' strides, no memory
    launches = []
    for first, heads in chunks:
        as_heads = layout.narrow(-4, 0, heads * group).flatten(-4, -3).transpose(-3, -2)  # (B, Nq, heads * panels, DQ_PANEL)
        ctas, grid_fields = tile_grid(problem, variant, device, problem.seqlen_k, heads)
        sums_params = pack(problem, BACKWARD_PARAMS, **grid_fields,
                           **(fields | dict(kv_head0=first, kv_heads=heads) | tensor_fields("dq", as_heads, problem.varlen, 3)))
        launches.append((KernelLaunch(variant, device, ctas, sums_params),
                         KernelLaunch(rounding, device, tiles(rows_q * heads * group * panels, rounding.threads), params),
                         dict(rows=rows_q, head0=first * group, heads=heads * group)))

    def run(stream, call, dq):
        buffer = torch.empty(shape, dtype=torch.float32, device=dq.device)
        sums = call | {"dq": buffer.data_ptr()}  # every chunk's sums start at the buffer's start
        for (first, heads), (adding, round_sums, chunk) in zip(chunks, launches):
            buffer.narrow(-4, 0, heads * group).zero_()
            adding(stream, sums)
            round_sums(stream, call, _packer(DQ_ROUND)(chunk | {"sums": buffer.data_ptr()}).view(OPAQUE[DQ_ROUND.itemsize]))

    return run


def sum_over_rows(problem, terms):
    """(Hq,): the sum of an lse-shaped array's rows of each head, (B, Hq, Nq) or (Hq, Tq), in torch's
    fixed reduction order (no atomics: the same sum every run)."""
    return terms.sum(dim=1 if problem.varlen else (0, 2))


def empty_row_lse(problem, device):
    """A varlen problem's lse (Hq, Tq) before the kernels write the rows of its sequences: rows past
    cu_seqlens[-1] have no key, so -inf, or their head's sink (the contract's "Score modifications")."""
    import torch

    if problem.sinks is None:
        return torch.full(problem.lse_shape, float("-inf"), dtype=torch.float32, device=device)
    return problem.sinks[:, None].expand(problem.lse_shape).contiguous()
