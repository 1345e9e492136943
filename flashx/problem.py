"""The immutable description of one attention call that backends receive.

The core validates every argument once (``flashx.validation``) and hands backends a
``Problem``: they never re-parse keywords, and ``supports()`` can answer from it alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

#: The optional features a problem may use; a backend declares the ones it implements.
FEATURES = {
    "causal": "causal masking",
    "window": "sliding windows",
    "mask": "boolean masks",
    "block_mask": "block masks",
    "seqlens": "seqlens_q/seqlens_k",
    "varlen": "packed varlen (cu_seqlens)",
    "dropout": "dropout",
    "dropout_offsets": "dropout drawn at offset positions (dropout_offsets, as ring attention uses)",
    "gqa": "grouped-query attention (Hq != Hk)",
    "dv_ne_d": "a value head dim different from the query head dim",
    "softcap": "softcap",
    "alibi": "ALiBi slopes",
}


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Tile-level mask: element (i, j) may attend iff ``blocks[..., i // bq, j // bk]``.

    ``blocks`` is a boolean array broadcastable to (B, Hq, ceil(Nq / bq), ceil(Nk / bk)).
    """

    blocks: Any
    block_size: tuple[int, int]

    def __post_init__(self):
        from flashx.errors import ShapeError

        from flashx.errors import DTypeError
        from flashx.options import python_scalar

        size = python_scalar(self.block_size)
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size, size)
        expected = "a positive int or a pair of positive ints (bq, bk)"
        if not isinstance(size, (tuple, list)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in size):
            raise DTypeError(f"block_size: expected {expected}, got {self.block_size!r}")
        if len(size) != 2 or not all(s > 0 for s in size):
            raise ShapeError(f"block_size: expected {expected}, got {self.block_size!r}")
        object.__setattr__(self, "block_size", tuple(size))


class HeadsAndBand:
    """What a validated call derives alike, for attention (``Problem``) and decoding
    (``flashx.kvcache.DecodeProblem``): from heads_q, heads_k, dtype, causal and window."""

    @property
    def group(self) -> int:
        """Query heads per key/value head: query head h reads kv head h // group."""
        return self.heads_q // self.heads_k

    @property
    def lse_dtype(self) -> str:
        return "float64" if self.dtype == "float64" else "float32"

    @functools.cached_property
    def band(self) -> tuple[int, int] | None:
        """The diagonal band with causal folded in, or None when neither is set.

        Key j is allowed for query i iff ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``,
        a side of -1 being unbounded (Lq, Lk: the lengths of that sequence).
        """
        if not self.causal:
            return self.window
        left, right = self.window or (-1, -1)
        return left, 0 if right == -1 else min(right, 0)

    def with_arrays(self, convert: Callable[[str, Any], Any]):
        """A copy whose auxiliary arrays (``ARRAYS``) went through ``convert(name, array)``;
        itself when none changed."""
        changes = {}
        for name in self.ARRAYS:
            value = getattr(self, name)
            array = value.blocks if isinstance(value, BlockMask) else value
            if array is None:
                continue
            converted = convert(name, array)
            if converted is not array:
                changes[name] = BlockMask(converted, value.block_size) if isinstance(value, BlockMask) else converted
        return dataclasses.replace(self, **changes) if changes else self


@dataclass(frozen=True, eq=False)
class Problem(HeadsAndBand):
    """One attention call, validated. Arrays in it are of the backend's array kind.

    Shapes (the contract's Shapes section): padded q (B, Nq, Hq, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv);
    varlen q (Tq, Hq, D), k (Tk, Hk, D), v (Tk, Hk, Dv) with cu_seqlens of shape (B + 1,).
    """

    array_kind: str  # "numpy" | "torch" | "cupy": the kind of the caller's arrays
    device: str  # "cpu" | "cuda"
    device_index: int | None
    dtype: str  # "float16" | "bfloat16" | "float32" | "float64"

    batch: int  # B: sequences (varlen: len(cu_seqlens) - 1)
    seqlen_q: int  # padded: Nq; varlen: the longest query sequence (max_seqlen_q)
    seqlen_k: int  # padded: Nk; varlen: the longest key sequence (max_seqlen_k)
    total_q: int | None  # varlen: Tq rows of q; padded: None
    total_k: int | None
    heads_q: int
    heads_k: int
    head_dim: int
    head_dim_v: int

    softmax_scale: float
    causal: bool = False
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded; causal not folded in
    softcap: float | None = None
    alibi_slopes: Any = None
    mask: Any = None
    block_mask: BlockMask | None = None
    seqlens_q: Any = None
    seqlens_k: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    dropout_p: float = 0.0
    seed: int = 0
    rng_offset: int = 0
    dropout_offsets: tuple[int, int] = (0, 0)  # dropout counter positions of query row 0 and key 0
    deterministic: bool = False

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @functools.cached_property
    def band_reach(self) -> tuple[int, int]:
        """``band`` with an unbounded side (-1, or no band at all) as a reach no pair exceeds, so
        that a kernel tests each side with one compare."""
        reach = (self.total_q + self.total_k) if self.varlen else (self.seqlen_q + self.seqlen_k)
        left, right = self.band or (-1, -1)
        return (reach if left == -1 else left), (reach if right == -1 else right)

    @functools.cached_property
    def features(self) -> frozenset[str]:
        """The optional features (keys of ``FEATURES``) this problem uses."""
        used = {
            "causal": self.causal,
            "window": self.window is not None,
            "mask": self.mask is not None,
            "block_mask": self.block_mask is not None,
            "seqlens": self.seqlens_q is not None or self.seqlens_k is not None,
            "varlen": self.varlen,
            "dropout": self.dropout_p > 0,
            "dropout_offsets": self.dropout_p > 0 and self.dropout_offsets != (0, 0),
            "gqa": self.heads_q != self.heads_k,
            "dv_ne_d": self.head_dim_v != self.head_dim,
            "softcap": self.softcap is not None,
            "alibi": self.alibi_slopes is not None,
        }
        return frozenset(name for name, on in used.items() if on)

    @property
    def q_shape(self) -> tuple[int, ...]:
        return self._rows_shape(self.total_q, self.seqlen_q, self.heads_q, self.head_dim)

    @property
    def k_shape(self) -> tuple[int, ...]:
        return self._rows_shape(self.total_k, self.seqlen_k, self.heads_k, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, ...]:
        return self._rows_shape(self.total_k, self.seqlen_k, self.heads_k, self.head_dim_v)

    @functools.cached_property
    def o_shape(self) -> tuple[int, ...]:
        return self._rows_shape(self.total_q, self.seqlen_q, self.heads_q, self.head_dim_v)

    @functools.cached_property
    def lse_shape(self) -> tuple[int, ...]:
        if self.varlen:
            return (self.heads_q, self.total_q)
        return (self.batch, self.heads_q, self.seqlen_q)

    def _rows_shape(self, total, seqlen, heads, dim):
        return (total, heads, dim) if self.varlen else (self.batch, seqlen, heads, dim)

    @functools.cached_property
    def is_empty(self) -> bool:
        """No output element reads any key: the core answers without a kernel."""
        rows = self.total_q if self.varlen else self.batch * self.seqlen_q
        keys = self.total_k if self.varlen else self.seqlen_k
        return rows * self.heads_q == 0 or keys == 0

    #: The auxiliary arrays a call may hold (``block_mask`` standing for its blocks).
    ARRAYS = ("alibi_slopes", "mask", "block_mask", "seqlens_q", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")

    def describe(self) -> str:
        """One line for error messages and tables."""
        where = self.device if self.device_index is None else f"{self.device}:{self.device_index}"
        layout = f"varlen B={self.batch}" if self.varlen else "padded"
        parts = [
            f"q{self.q_shape} k{self.k_shape} v{self.v_shape} {self.dtype} {self.array_kind}@{where} {layout}",
            f"scale={self.softmax_scale:.4g}",
        ]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        parts += [name for name in ("mask", "block_mask", "seqlens", "softcap", "alibi") if name in self.features]
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        if "dropout_offsets" in self.features:
            parts.append(f"dropout_offsets={self.dropout_offsets}")
        if self.deterministic:
            parts.append("deterministic")
        return ", ".join(parts)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
