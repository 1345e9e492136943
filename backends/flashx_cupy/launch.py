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

from flashx.problem import head_dim_class
from flashx_cupy import tma, variants

_POINTERS = ("q", "k", "v", "o", "lse", "cu_q", "cu_k", "seqlens_q", "seqlens_k", "mask", "blocks", "alibi_slopes",
             "sinks", "k_descale", "v_descale")
_STRIDES = ("q_b", "q_n", "q_h", "q_d", "k_b", "k_n", "k_h", "k_d", "v_b", "v_n", "v_h", "v_d", "o_b", "o_n", "o_h", "o_d",
            "lse_b", "lse_h", "mask_b", "mask_h", "mask_i", "mask_j", "blocks_b", "blocks_h", "blocks_i", "blocks_j",
            "alibi_b")
_INTS = ("batch", "heads_q", "heads_k", "group", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
         "left", "right", "block_q", "block_k", "rng_offset", "drop_threshold", "tiles_m", "drop_row0", "drop_col0")
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
#: How a record travels to CuPy: as one opaque element of its size (by size: each layout's differs).
#: CuPy finds a NumPy argument's address through ``__array_interface__``, which describes a
#: structured dtype field by field, at a cost (tens of microseconds a launch) that an opaque
#: element does not have.
OPAQUE = {layout.itemsize: np.dtype((np.void, layout.itemsize)) for layout in (PARAMS, BACKWARD_PARAMS, DECODE_PARAMS)}


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
        rng_offset=np.uint32(problem.rng_offset_words[0]).view(np.int32),
        drop_threshold=np.uint32(problem.dropout_threshold).view(np.int32),
        seed=problem.seed,
        drop_row0=problem.dropout_offsets[0],
        drop_col0=problem.dropout_offsets[1],
        drop_scale=problem.dropout_scale,
    ) | fields)


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
    """The addresses of cu_seqlens and seqlens, ALiBi's slopes and the sinks (``score_mod_fields``),
    the mask and the block mask, broadcast to (B, Hq, ., .). The core hands the lengths over as
    int32 and the slopes and sinks in the lse's dtype (float32 here), each contiguous: the kernels
    read them where they are, so a call converts and copies none of them."""
    fields = score_mod_fields(problem)
    for name, array in (("cu_q", problem.cu_seqlens_q), ("cu_k", problem.cu_seqlens_k),
                        ("seqlens_q", problem.seqlens_q), ("seqlens_k", problem.seqlens_k)):
        if array is not None:
            fields[name] = array.data_ptr()
    shape = (problem.batch, problem.heads_q)
    if problem.mask is not None:
        mask = problem.mask.expand(*shape, problem.seqlen_q, problem.seqlen_k)
        fields.update(mask=mask.data_ptr(), **dict(zip(("mask_b", "mask_h", "mask_i", "mask_j"), mask.stride())))
    if problem.block_mask is not None:
        bq, bk = problem.block_mask.block_size
        blocks = problem.block_mask.blocks.expand(*shape, -(-problem.seqlen_q // bq), -(-problem.seqlen_k // bk))
        fields.update(blocks=blocks.data_ptr(),
                      **dict(zip(("blocks_b", "blocks_h", "blocks_i", "blocks_j"), blocks.stride())))
    return fields


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
    """Run on the caller's current stream, torch's allocations included (the contract's
    "Backend plugins" section): torch's stream for torch callers, CuPy's for CuPy callers.
    Address 0 is the legacy default stream in both libraries."""
    import cupy
    import torch

    index = x.device.index
    with cupy.cuda.Device(index) as device:
        if problem.array_kind == "cupy":
            pointer = cupy.cuda.get_current_stream().ptr
            ours = torch.cuda.ExternalStream(pointer, device=x.device) if pointer else torch.cuda.default_stream(x.device)
            with torch.cuda.stream(ours):
                yield device
        else:
            pointer = torch.cuda.current_stream(x.device).cuda_stream
            with cupy.cuda.ExternalStream(pointer, index) if pointer else cupy.cuda.Stream.null:
                yield device


def launch(variant: variants.Variant, device, grid: int, params: np.ndarray, *extra) -> None:
    if grid == 0:
        return
    limit = variants.shared_memory_limit(device.id)
    if variant.shared_memory > limit:
        from flashx.errors import UnsupportedError

        raise UnsupportedError(f"cupy: {variant.kernel} needs {variant.shared_memory} bytes of shared memory per block, "
                               f"this GPU allows {limit}")
    kernel = variants.kernel(variant, device)
    kernel((grid,), (variant.threads,), (params.view(OPAQUE[params.itemsize]), *extra), shared_mem=variant.shared_memory)


def tiles(rows: int, block: int) -> int:
    return -(-rows // block)


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
    with caller_stream(problem, q) as device:
        out_dtype = getattr(torch, problem.out_dtype)
        if varlen and problem.rows_past_sequences:  # rows of no sequence read as empty rows
            o = torch.zeros(problem.o_shape, dtype=out_dtype, device=q.device)
            lse = empty_row_lse(problem, q.device)
        else:
            o = torch.empty(problem.o_shape, dtype=out_dtype, device=q.device)
            lse = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
        if problem.fp8:
            q, k = (x if aligned(problem, x) else x.clone(memory_format=torch.contiguous_format) for x in (q, k))
            v_fields, made = fp8_fields(problem, v)  # ``made`` lives until the launch is queued
            is_aligned = True
        else:
            v_fields, made = tensor_fields("v", v, varlen), ()
            is_aligned = aligned(problem, q, k, v)
        by_tma = tma.usable(problem, k, v)
        kernel = variants.forward_kernel(problem, is_aligned, device.compute_capability, by_tma)
        variant = variants.choose(kernel, problem, is_aligned, tma=kernel == "forward_sm90" and by_tma)
        tiles_m = tiles(problem.seqlen_q, variant.block_m)
        params = pack(problem, tiles_m=tiles_m, **auxiliary_fields(problem), **tensor_fields("q", q, varlen),
                      **tensor_fields("k", k, varlen), **v_fields, **tensor_fields("o", o, varlen),
                      **row_stat_fields("lse", lse, varlen))
        maps = (tma.kernel_argument(variant, k, v),) if kernel in ("forward_sm90", "forward_fp8_sm90") else ()
        launch(variant, device, tiles_m * problem.heads_q * problem.batch, params, *maps)
        del made
    return o, lse


def fp8_fields(problem, v) -> tuple[dict, tuple]:
    """The FP8 forward's V (``keys_in_fp8_order``: v_n its feature rows' stride) and descales:
    the scores' factor q_descale * k_descale, multiplied here (one (B, Hk) product), as
    ``k_descale``, and ``v_descale``; null for 1. Also the tensors made here, which the launch reads
    (the caching allocator reuses their memory in the stream's order, after the launch)."""
    vt = keys_in_fp8_order(problem, v)
    fields = {"v": vt.data_ptr(), "v_b": vt.stride(0), "v_h": vt.stride(1), "v_n": vt.stride(2), "v_d": 1}
    present = [x for x in (problem.q_descale, problem.k_descale) if x is not None]
    scores = None
    if present:
        scores = present[0] * present[1] if len(present) == 2 else present[0]
        fields["k_descale"] = scores.data_ptr()
    if problem.v_descale is not None:
        fields["v_descale"] = problem.v_descale.data_ptr()
    return fields, (vt, scores)


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
    with caller_stream(problem, q) as device:
        # varlen: rows past cu_seqlens[-1], of no sequence, stay 0
        zeros_or_empty = torch.zeros if varlen and problem.rows_past_sequences else torch.empty
        dq = zeros_or_empty(q.shape, dtype=q.dtype, device=q.device)
        dk = zeros_or_empty(k.shape, dtype=k.dtype, device=k.device)
        dv = zeros_or_empty(v.shape, dtype=v.dtype, device=v.device)
        delta = torch.empty(problem.lse_shape, dtype=torch.float32, device=q.device)
        # the delta kernel's term of each row in dsinks, summed here in a fixed order (deterministic)
        dsinks_rows = torch.empty_like(delta) if problem.sinks is not None else None
        is_aligned = aligned(problem, q, k, v, o, do)
        fields = dict(**auxiliary_fields(problem), **tensor_fields("q", q, varlen), **tensor_fields("k", k, varlen),
                      **tensor_fields("v", v, varlen), **tensor_fields("o", o, varlen),
                      **tensor_fields("do", do, varlen), **tensor_fields("dq", dq, varlen, 3),
                      **tensor_fields("dk", dk, varlen, 3), **tensor_fields("dv", dv, varlen, 3),
                      **row_stat_fields("lse", lse, varlen), **row_stat_fields("delta", delta, varlen),
                      kv_head0=0, kv_heads=problem.heads_k,
                      **({} if dsinks_rows is None else {"dsinks_rows": dsinks_rows.data_ptr()}))

        variant = variants.choose("delta", problem, is_aligned)
        rows = problem.total_q if varlen else problem.batch * problem.seqlen_q
        launch(variant, device, tiles(rows * problem.heads_q, variants.DELTA_WARPS), pack(problem, BACKWARD_PARAMS, **fields),
               np.int32(rows))

        sm90 = variants.sm90_backward(problem, is_aligned, device.compute_capability)
        if variants.fused_dq(problem, sm90, dq_sums_whole(problem)):
            variant = variants.choose("dkdv_sm90" if sm90 else "dkdv", problem, is_aligned, dq_atomic=True)
            _dkdv_adding_dq(problem, device, variant, fields, dq)
        else:
            variant = variants.choose("dq_sm90" if sm90 else "dq", problem, is_aligned)
            tiles_m = tiles(problem.seqlen_q, variant.block_m)
            launch(variant, device, tiles_m * problem.heads_q * problem.batch,
                   pack(problem, BACKWARD_PARAMS, tiles_m=tiles_m, **fields))
            for parts in variants.dkdv_parts(head_dim_class(problem.head_dim),
                                             head_dim_class(problem.head_dim_v)):
                variant = variants.choose("dkdv_sm90" if sm90 else "dkdv", problem, is_aligned, parts)
                tiles_m = tiles(problem.seqlen_k, variant.block_m)
                launch(variant, device, tiles_m * problem.heads_k * problem.batch,
                       pack(problem, BACKWARD_PARAMS, tiles_m=tiles_m, **fields))
        grads = (dq, dk, dv) if dsinks_rows is None else (dq, dk, dv, sum_over_rows(problem, dsinks_rows))
    return grads


def _dkdv_adding_dq(problem, device, variant, fields: dict, dq) -> None:
    """The fused dK/dV launches, a chunk of kv heads each: dQ of the chunk's query heads is summed
    in float32 (scaled, the head dim padded to its class) and then rounded into ``dq``.

    The sums of a query head lie in panels of ``DQ_PANEL`` columns, each panel's rows contiguous:
    (B, heads, panels, Nq, DQ_PANEL), or (heads, panels, Tq, DQ_PANEL) packed, so that a query
    tile's rows of a panel are one range, which flashx_dkdv_sm90 adds by one bulk reduction. The
    kernels see a panel as a head of DQ_PANEL columns: head h's panel i is head h * panels + i."""
    import torch

    tiles_m = tiles(problem.seqlen_k, variant.block_m)
    group, chunks = problem.group, kv_head_chunks(problem)
    batch, rows = dq.shape[:-3], dq.shape[-3]
    buffer = torch.empty((*batch, chunks[0][1] * group, variant.dim_qk // DQ_PANEL, rows, DQ_PANEL),
                         dtype=torch.float32, device=dq.device)
    for first, heads in chunks:
        sums = buffer.narrow(-4, 0, heads * group).zero_()
        as_heads = sums.flatten(-4, -3).transpose(-3, -2)  # (B, Nq, heads * panels, DQ_PANEL), a view
        params = pack(problem, BACKWARD_PARAMS, tiles_m=tiles_m,
                      **(fields | dict(kv_head0=first, kv_heads=heads) | tensor_fields("dq", as_heads, problem.varlen, 3)))
        launch(variant, device, tiles_m * heads * problem.batch, params)
        _round_sums(sums, dq[..., first * group:(first + heads) * group, :], problem.head_dim)


def _round_sums(sums, dq, head_dim: int) -> None:
    """``dq`` (B, Nq, heads, head_dim) or packed from the panels of ``sums``
    (_dkdv_adding_dq's layout): whole panels, then the columns of a last partial one."""
    panels = sums.movedim(-2, -4)  # (B, Nq, heads, panels, DQ_PANEL)
    whole = head_dim // DQ_PANEL
    if whole:
        dq[..., :whole * DQ_PANEL].unflatten(-1, (whole, DQ_PANEL)).copy_(panels[..., :whole, :])
    if head_dim % DQ_PANEL:
        dq[..., whole * DQ_PANEL:].copy_(panels[..., whole, :head_dim % DQ_PANEL])


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
