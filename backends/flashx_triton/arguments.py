"""The kernel arguments that describe a static problem: shapes, band, mask layout, tile widths,
and the constexprs the kernels are specialised on.
"""

from __future__ import annotations

import os

import triton

from flashx.problem import FP8_DTYPES

#: The kernels' scalar arguments that Triton must not specialise (on == 1 and on divisibility by
#: 16): the lengths, the band's reaches (an unbounded one is the lengths' sum) and the LSE's
#: strides (its rows are the queries). They change from call to call of one model, a ring's chunks
#: alone giving many classes, and each class would compile every kernel anew; a known multiple of
#: 16 buys little there (row masks and LSE rows taken 16 at a time). The heads stay specialised:
#: they are the model's, one class each, and a group of 1 drops the grouping's divisions. Separate
#: scalars, not tuples: Triton 3.6 specialises a tuple's elements whatever ``do_not_specialize``
#: says. A kernel without one of these arguments ignores its name.
LENGTHS = ("padded_q", "padded_k", "left", "right", "stride_lb", "stride_lh")


def problem_args(problem) -> dict:
    """The kernel arguments that describe the static problem rather than one tensor or one call:
    the scalars padded_q, padded_k, heads_q, group, left and right (``LENGTHS`` but the heads,
    which are the model's), the groups ``masks`` (``mask_layout``) and ``dropout_rate`` (the draw
    below which a pair is dropped, and 1 / (1 - p): ``dropout.dropout_state``), and the constexprs."""
    varlen = problem.varlen
    left, right = problem.band_reach
    args = dict(
        padded_q=problem.seqlen_q, padded_k=problem.seqlen_k, heads_q=problem.heads_q, group=problem.group,
        left=left, right=right,
        IS_VARLEN=varlen,
        HAS_SEQLENS_Q=problem.seqlens_q is not None,
        HAS_SEQLENS_K=problem.seqlens_k is not None,
        HEAD_DIM=problem.head_dim,
        HEAD_DIM_V=problem.head_dim_v,
        **tile_widths(problem.head_dim, problem.head_dim_v),
        DOT_PRECISION=dot_precision(problem.dtype),
    )
    args.update(mask_layout(problem), DROPOUT=problem.dropout_p > 0,
                dropout_rate=(problem.dropout_threshold, problem.dropout_scale))
    return args


def tile_widths(head_dim: int, head_dim_v: int) -> dict:
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


def dot_precision(dtype: str) -> str:
    if dtype == "float32":
        return "ieee"  # the contract's Numerics section: no TF32 unless asked
    if dtype in FP8_DTYPES and os.environ.get("TRITON_INTERPRET") == "1":
        return "ieee"  # FP8 tiles are widened to float32 under the interpreter (flashx_triton.fp8)
    if dtype == "bfloat16" and os.environ.get("TRITON_INTERPRET") == "1":
        return "upcast"
    return "tf32"  # ignored for 16-bit inputs


def mask_layout(problem) -> dict:
    """``masks``: the (batch, head, row, column) strides of MASK and BLOCKS broadcast to
    (B, Hq, Nq, Nk) and (B, Hq, Nq / bq, Nk / bk), then the block mask's (block_q, block_k); and
    whether each is there. The kernels read the tensors as given (``call_args``) through these
    strides, which the given tensors' shapes (the static problem's) and strides (``layout``)
    fix."""
    shape = (problem.batch, problem.heads_q)
    mask_strides = block_strides = (0, 0, 0, 0)
    block_size = (1, 1)
    if problem.mask is not None:
        mask_strides = problem.mask.expand(*shape, problem.seqlen_q, problem.seqlen_k).stride()
    if problem.block_mask is not None:
        block_size = bq, bk = problem.block_mask.block_size
        grid = (*shape, -(-problem.seqlen_q // bq), -(-problem.seqlen_k // bk))
        block_strides = problem.block_mask.blocks.expand(*grid).stride()
    return dict(masks=(*mask_strides, *block_strides, *block_size), HAS_MASK=problem.mask is not None,
                HAS_BLOCK_MASK=problem.block_mask is not None)
