"""The immutable descriptions of the calls that backends receive: one per operation.

Prefill attention (``Problem``) and decoding with a KV cache (``DecodeProblem``) are two
operations of one kind: the core validates every argument once (``flashx.validation``), plans
the call (``flashx.plan``), and hands the backend a problem whose ``operation`` names the
backend method that runs it. Backends never re-parse keywords; ``supports()`` answers from the
problem alone; what every kernel derives from the call (the scale in base 2, the dropout
threshold, the seed's words, the head-dim class) is derived here, once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from flashx import arrays
from flashx.arrays import FP8_DTYPES

LOG2E = math.log2(math.e)
WORD = 0xFFFFFFFF
#: What o may be rounded to for FP8 inputs (``FP8_DTYPES``); the first is the default. Decoding's
#: FP8 cache takes queries of these dtypes too.
FP8_OUT_DTYPES = ("bfloat16", "float16")
#: The dtype of a decoding cache quantized to FP8 (the contract's FP8 section).
FP8_CACHE_DTYPE = "float8_e4m3fn"

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
    "sinks": "attention sinks",
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


@dataclass(frozen=True, eq=False, kw_only=True)
class BaseProblem:
    """What every operation's problem holds and derives: the arrays' kind, device and dtype,
    the heads and head dims, the scale, the band. Arrays in a problem are of the backend's kind."""

    #: "attention" or "decode": what a backend declares per operation (``Backend.operations``).
    operation: ClassVar[str]
    #: The auxiliary arrays a call may hold (``block_mask`` standing for its blocks).
    ARRAYS: ClassVar[tuple[str, ...]]
    #: Fields that change from call to call without changing what runs (dropout's RNG state; for
    #: packed sequences, whether rows lie past them, which changes what is allocated, not launched).
    PER_CALL: ClassVar[tuple[str, ...]] = ()

    array_kind: str  # "numpy" | "torch" | "cupy": the kind of the caller's arrays
    device: str  # "cpu" | "cuda"
    device_index: int | None
    dtype: str  # "float16" | "bfloat16" | "float32" | "float64", or one of FP8_DTYPES
    batch: int  # B: sequences
    heads_q: int
    heads_k: int
    head_dim: int
    head_dim_v: int
    softmax_scale: float
    causal: bool = False
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded; causal not folded in
    # the contract's "Score modifications", the same in both operations
    softcap: float | None = None
    alibi_slopes: Any = None  # (Hq,) or (B, Hq), in lse_dtype
    sinks: Any = None  # (Hq,), in lse_dtype: one logit per query head in every row's softmax denominator
    deterministic: bool = False  # a backward whose bits do not depend on scheduling
    out_dtype: str | None = None  # o's dtype: q's (None is read as q's), or one of FP8_OUT_DTYPES for FP8 inputs

    def __post_init__(self):
        if self.out_dtype is None:
            object.__setattr__(self, "out_dtype", self.dtype)

    @property
    def fp8_dtype(self) -> str | None:
        """The FP8 dtype of the call's data (the contract's FP8 section), or None: attention's inputs."""
        return self.dtype if self.dtype in FP8_DTYPES else None

    @property
    def fp8(self) -> bool:
        """Data in FP8, dequantized by descales: forward only."""
        return self.fp8_dtype is not None

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

    @property
    def triangular_band(self) -> bool:
        """Whether the band is bounded on the right only (causal, with or without a right reach): a
        query tile's allowed keys then grow with its index and a key tile's queries shrink, so a
        backend that schedules tiles by their work has a heaviest end."""
        band = self.band
        return band is not None and band[0] == -1 and band[1] != -1

    @functools.cached_property
    def scale_log2(self) -> float:
        """softmax_scale * log2(e): scores scaled in one multiply for an online softmax in base 2."""
        return self.softmax_scale * LOG2E

    @functools.cached_property
    def head_dim_class(self) -> int:
        """The class of the wider head dim (``head_dim_class``), which picks tiles and tables."""
        return head_dim_class(max(self.head_dim, self.head_dim_v))

    @functools.cached_property
    def features(self) -> frozenset[str]:
        """The optional features (keys of ``FEATURES``) this call uses."""
        return frozenset(name for name, on in self._uses().items() if on)

    def _uses(self) -> dict[str, bool]:
        return {
            "causal": self.causal,
            "window": self.window is not None,
            "gqa": self.heads_q != self.heads_k,
            "dv_ne_d": self.head_dim_v != self.head_dim,
            "softcap": self.softcap is not None,
            "alibi": self.alibi_slopes is not None,
            "sinks": self.sinks is not None,
        }

    def holding(self, **fields):
        """A copy holding other values of the fields a call brings of its own (auxiliary arrays
        ``ARRAYS``, per-call fields ``PER_CALL``), checked by the caller; what the original cached
        of its fields (``static_key``, ``features``) is copied, so arrays given must have the
        signatures (type, shape, dtype, device) it saw, and any other field its value."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__, **fields)  # as object.__setattr__ would, field by field
        return clone

    def with_derived_values(self):
        """Itself, every derived value (each ``functools.cached_property``) worked out: a problem
        kept for repeated calls hands them to each copy ``holding`` makes, which would otherwise
        work them out again on every call (under the lock Python 3.11 takes for each)."""
        for name in _derived_values(type(self)):
            getattr(self, name)
        return self

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

    @functools.cached_property
    def static_key(self) -> tuple:
        """What runs, not what it runs on: every field but the per-call ones, arrays by their
        type, shape, dtype and device. Equal keys: equal dispatch, equal launch preparation.
        Kept on the problem: a repeated call (``flashx.plan``) reads it without walking the fields."""
        key = [self.operation]
        for name, is_array in _key_fields(type(self)):
            value = getattr(self, name)
            if is_array and value is not None:
                blocks = value.blocks if isinstance(value, BlockMask) else value
                value = arrays.signature(blocks), getattr(value, "block_size", None)
            key.append(value)
        return tuple(key)

    @property
    def where(self) -> str:
        return self.device if self.device_index is None else f"{self.device}:{self.device_index}"

    def describe(self) -> str:
        """One line for error messages and tables."""
        parts = [self._shapes(), f"scale={self.softmax_scale:.4g}"]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        parts += [name for name in ("softcap", "alibi", "sinks") if name in self.features]
        return ", ".join(parts + self._details())

    def _shapes(self) -> str:
        raise NotImplementedError

    def _details(self) -> list[str]:
        return []


@dataclass(frozen=True, eq=False, kw_only=True)
class Problem(BaseProblem):
    """One attention call (forward and backward), validated.

    Shapes (the contract's Shapes section): padded q (B, Nq, Hq, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv);
    varlen q (Tq, Hq, D), k (Tk, Hk, D), v (Tk, Hk, Dv) with cu_seqlens of shape (B + 1,).
    """

    operation: ClassVar[str] = "attention"
    ARRAYS: ClassVar[tuple[str, ...]] = ("alibi_slopes", "sinks", "mask", "block_mask", "seqlens_q", "seqlens_k",
                                         "cu_seqlens_q", "cu_seqlens_k", "q_descale", "k_descale", "v_descale")
    PER_CALL: ClassVar[tuple[str, ...]] = ("seed", "rng_offset", "rows_past_sequences")

    seqlen_q: int  # padded: Nq; varlen: the longest query sequence (max_seqlen_q)
    seqlen_k: int  # padded: Nk; varlen: the longest key sequence (max_seqlen_k)
    total_q: int | None = None  # varlen: Tq rows of q; padded: None
    total_k: int | None = None
    # varlen: whether rows of q or k lie past cu_seqlens[-1]. No kernel program writes them, so
    # their outputs must start as the contract's (o = 0, lse = -inf, dq = dk = dv = 0); without
    # them, every output element is written. True unless the core read the offsets.
    rows_past_sequences: bool = True
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
    # FP8 inputs: (B, Hk) float32 dequantization factors, None meaning 1; query head h uses q_descale[b, h // group]
    q_descale: Any = None
    k_descale: Any = None
    v_descale: Any = None

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

    def as_decode(self) -> DecodeProblem | None:
        """This call as decoding over a full contiguous cache (the contract's "Attention as
        decoding"): k and v as the cache, every sequence holding all Nk keys and no new ones, query
        i at key position Nk - Nq + i as here. None where attention has what decoding lacks:
        packed or per-sequence lengths, masks, dropout, FP8 inputs. A method, not a derived
        value: the problem it returns holds this call's arrays (slopes, sinks)."""
        if (self.varlen or self.fp8 or self.dropout_p > 0 or self.seqlens_q is not None
                or self.seqlens_k is not None or self.mask is not None or self.block_mask is not None):
            return None
        return DecodeProblem(
            array_kind=self.array_kind, device=self.device, device_index=self.device_index, dtype=self.dtype,
            batch=self.batch, heads_q=self.heads_q, heads_k=self.heads_k, head_dim=self.head_dim,
            head_dim_v=self.head_dim_v, softmax_scale=self.softmax_scale, causal=self.causal, window=self.window,
            softcap=self.softcap, alibi_slopes=self.alibi_slopes, sinks=self.sinks, deterministic=self.deterministic,
            seqlen_q=self.seqlen_q, new_tokens=0, page_size=None, num_pages=self.batch, capacity=self.seqlen_k,
            cache_seqlens=None)

    def _uses(self) -> dict[str, bool]:
        return {
            **super()._uses(),
            "mask": self.mask is not None,
            "block_mask": self.block_mask is not None,
            "seqlens": self.seqlens_q is not None or self.seqlens_k is not None,
            "varlen": self.varlen,
            "dropout": self.dropout_p > 0,
            "dropout_offsets": self.dropout_p > 0 and self.dropout_offsets != (0, 0),
        }

    # -- dropout (the contract's Dropout section), as every kernel takes it -------------------
    @functools.cached_property
    def dropout_threshold(self) -> int:
        """A pair is dropped iff its 32-bit Philox draw is below floor(p * 2^32)."""
        return math.floor(self.dropout_p * 2**32)

    @functools.cached_property
    def dropout_scale(self) -> float:
        """1 / (1 - p): what a kept probability is multiplied by."""
        return 1.0 / (1.0 - self.dropout_p)

    @property
    def seed_words(self) -> tuple[int, int]:
        """The Philox key: the seed's low and high 32 bits."""
        return self.seed & WORD, self.seed >> 32 & WORD

    @property
    def rng_offset_words(self) -> tuple[int, int]:
        """The Philox counter's offset: rng_offset's low and high 32 bits."""
        return self.rng_offset & WORD, self.rng_offset >> 32 & WORD

    # -- shapes --------------------------------------------------------------------------------
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

    def _shapes(self) -> str:
        layout = f"varlen B={self.batch}" if self.varlen else "padded"
        return f"q{self.q_shape} k{self.k_shape} v{self.v_shape} {self.dtype} {self.array_kind}@{self.where} {layout}"

    def _details(self) -> list[str]:
        parts = [name for name in ("mask", "block_mask", "seqlens") if name in self.features]
        if self.fp8:
            parts.append(f"out {self.out_dtype}, forward only (FP8)")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        if "dropout_offsets" in self.features:
            parts.append(f"dropout_offsets={self.dropout_offsets}")
        if self.deterministic:
            parts.append("deterministic")
        return parts


@dataclass(frozen=True, eq=False, kw_only=True)
class DecodeProblem(BaseProblem):
    """One ``attention_with_kvcache`` call, validated (the contract's "Decoding with a KV cache").

    q (B, Nq, Hq, D); a contiguous cache (B, S, Hk, D) or a paged one (P, page_size, Hk, D);
    ``cache_seqlens`` (B,) and ``block_table`` (B, max_pages) as int32. Sequence b attends to
    Lk[b] = cache_seqlens[b] + new_tokens keys, its query i sitting at position Lk[b] - Nq + i:
    the position of causal, window and ALiBi's distance alike.
    """

    operation: ClassVar[str] = "decode"
    ARRAYS: ClassVar[tuple[str, ...]] = ("cache_seqlens", "block_table", "mask", "alibi_slopes", "sinks", "k_descale",
                                         "v_descale")

    seqlen_q: int  # Nq
    new_tokens: int  # Nn: rows of k_new and v_new (0 without them)
    page_size: int | None  # None: a contiguous cache
    num_pages: int  # P of a paged cache; B of a contiguous one (one run of S slots per sequence)
    capacity: int  # the most keys a sequence can hold: S, or max_pages * page_size
    cache_seqlens: Any  # (B,) int32; None: every sequence holds all ``capacity`` keys (``Problem.as_decode``)
    block_table: Any = None  # (B, max_pages) int32, paged caches only
    causal: bool = True
    mask: Any = None  # bool, broadcastable to (B, Hq, Nq, Nq): the last Nq keys
    num_splits: int = 0  # 0: the backend chooses
    validated: bool = True  # cache_seqlens, block_table and the descales were checked on the host
    cache_dtype: str | None = None  # the caches' dtype: q's (None is read as q's), or FP8_CACHE_DTYPE
    # an FP8 cache: (B, Hk) float32 dequantization factors, None meaning 1; new tokens are quantized by them
    k_descale: Any = None
    v_descale: Any = None

    def __post_init__(self):
        super().__post_init__()
        if self.cache_dtype is None:
            object.__setattr__(self, "cache_dtype", self.dtype)

    @property
    def fp8_dtype(self) -> str | None:
        """The FP8 dtype of the caches, or None."""
        return self.cache_dtype if self.cache_dtype in FP8_DTYPES else None

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def o_shape(self) -> tuple[int, ...]:
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.batch, self.heads_q, self.seqlen_q)

    def _uses(self) -> dict[str, bool]:
        return {**super()._uses(), "mask": self.mask is not None}

    @property
    def is_empty(self) -> bool:
        """No output element and nothing to write: the core answers without a backend."""
        return self.batch * self.seqlen_q * self.heads_q == 0 and (self.batch == 0 or self.new_tokens == 0)

    def _shapes(self) -> str:
        cache = (f"paged cache of {self.num_pages} pages x {self.page_size}" if self.paged
                 else f"contiguous cache of {self.capacity}")
        return (f"decode q{(self.batch, self.seqlen_q, self.heads_q, self.head_dim)} with a {cache} slots, "
                f"Hk={self.heads_k}, Dv={self.head_dim_v}, {self.new_tokens} new, {self.dtype} {self.array_kind}@{self.where}")

    def _details(self) -> list[str]:
        parts = ["mask"] if self.mask is not None else []
        if self.fp8:
            parts.append(f"{self.cache_dtype} cache (FP8)")
        return parts + ([f"num_splits={self.num_splits}"] if self.num_splits else [])


@functools.cache
def _key_fields(cls) -> tuple[tuple[str, bool], ...]:
    """(name, is an auxiliary array) of each field of a problem class that ``static_key`` holds."""
    return tuple((field.name, field.name in cls.ARRAYS) for field in dataclasses.fields(cls)
                 if field.name not in cls.PER_CALL)


@functools.cache
def _derived_values(cls) -> tuple[str, ...]:
    """The names of a problem class's derived values (``with_derived_values``)."""
    return tuple(name for klass in cls.__mro__ for name, value in vars(klass).items()
                 if isinstance(value, functools.cached_property))


def head_dim_class(dim: int) -> int:
    """64, 128 or 256: the smallest of the head dims kernels are built for that holds ``dim``."""
    return 64 if dim <= 64 else 128 if dim <= 128 else 256


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
