"""Cases and the backend under test: build inputs, call flashx, compare with the oracle.

Inputs are drawn in float64 (seeded normal, never zeros), rounded to the case's dtype, and
handed to ``flashx.attention_forward`` / ``attention_backward`` with ``backend=NAME`` as
arrays of the backend's kind on the chosen device. The oracle sees the very same rounded
values (a case's real auxiliary arrays, slopes and sinks, hold float32 values: what the core
hands backends). A problem the backend declares unsupported is skipped with the backend's reasons.

An FP8 case (the contract's FP8 section) holds its inputs in the quantized domain, its descales
among the keywords: the backend receives the inputs rounded to the FP8 dtype, the oracle the real
values they stand for. It runs the forward alone and is judged on o and lse.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

import flashx
from flashx.problem import FP8_DTYPES, FP8_OUT_DTYPES
from flashx_conformance import oracle
from flashx_conformance.tolerance import AXES, SMALLEST_NORMAL, judge, judge_exact, reference_precision, round_to

DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Marks a parameter too big for the small tier (interpreters, simulators): it is skipped there.
full_only = pytest.mark.flashx_full


def diagonal(rows: list, columns: list) -> list:
    """Every (row, column) pair, as parameters: the full tier runs the whole product, the small
    tier one column per row, in turn, so that it still meets every row and every column."""
    return [
        pytest.param(row, column, marks=() if r % len(columns) == c else full_only)
        for r, row in enumerate(rows)
        for c, column in enumerate(columns)
    ]
TENSORS = ("q", "k", "v", "do")
OUTPUTS = ("o", "lse", "dq", "dk", "dv")


def outputs_of(case) -> tuple[str, ...]:
    """The outputs a case has: OUTPUTS, and dsinks when it passes sinks; o and lse for FP8 (forward only)."""
    if case.fp8:
        return OUTPUTS[:2]
    return OUTPUTS + (("dsinks",) if case.options.get("sinks") is not None else ())

#: How an input is laid out in memory; every layout shows the values of the contiguous one.
#: Gaps and neighbours hold NaN, so a kernel that misreads strides returns NaN.
LAYOUTS = {
    "contiguous": None,
    "transposed": "stored (B, H, N, D) and seen through a transposed view",
    "packed": "a slice [..., 1, :, :] of a packed qkv tensor (..., 3, H, D)",
    "strided": "every other element of a last dim twice as long",
    "offset": "starting one element into its buffer (a base address not 16-byte aligned)",
    # Aliased layouts: several elements share memory, so only values they can show are drawn
    # (Case.with_layout); a kernel must read them and write its outputs densely all the same.
    "tied": "rows overlapping in memory: the row and last-dim strides are both 1",
    "broadcast": "one head's memory seen by every head (stride 0 on the head axis)",
    "negated": "torch's lazy negation of a buffer holding -x (Tensor.is_neg)",
}
#: Layouts only torch can express: the suite passes torch tensors for them, whatever the backend's kind.
TORCH_LAYOUTS = frozenset({"negated"})


@dataclass
class Case:
    """One attention problem: clean float64 inputs, the dtype, and flashx.attention's keywords."""

    inputs: dict[str, np.ndarray]  # q, k, v, do in float64; never rounded here
    dtype: str
    options: dict = field(default_factory=dict)  # auxiliary arrays as NumPy arrays
    poison: dict[str, tuple[np.ndarray, float]] = field(default_factory=dict)  # name -> (where, value)
    layouts: dict[str, str] = field(default_factory=dict)  # name -> a key of LAYOUTS

    @property
    def varlen(self) -> bool:
        return self.options.get("cu_seqlens_q") is not None

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def output_dtype(self) -> str:
        """o's dtype: the inputs', or for FP8 ``out_dtype`` (a name here)."""
        return (self.options.get("out_dtype") or FP8_OUT_DTYPES[0]) if self.fp8 else self.dtype

    def real(self, poisoned: bool = True) -> dict[str, np.ndarray]:
        """The values the oracle computes with: ``rounded``, and for FP8 times their descales."""
        rounded = self.rounded(poisoned)
        if not self.fp8:
            return rounded
        group = rounded["q"].shape[-2] // rounded["k"].shape[-2]
        cu = {"q": self.options.get("cu_seqlens_q"), "k": self.options.get("cu_seqlens_k")}
        return {**rounded, **{name: oracle.dequantize(rounded[name], self.options.get(f"{name}_descale"),
                                                      group if name == "q" else 1, cu["q" if name == "q" else "k"])
                              for name in ("q", "k", "v")}}

    @property
    def oracle_options(self) -> dict:
        """The keywords of the oracle's functions, which take real values: without FP8's."""
        return {name: value for name, value in self.options.items() if name not in oracle.FP8_OPTIONS}

    def with_poison(self, name: str, where, value: float = math.nan) -> "Case":
        """The case with ``value`` written into input ``name`` where ``where`` (broadcast) holds."""
        where = np.broadcast_to(where, self.inputs[name].shape)
        if name in self.poison:
            old, old_value = self.poison[name]
            if old_value != value and not (math.isnan(old_value) and math.isnan(value)):
                raise ValueError(f"{name} is already poisoned with {old_value}")
            where = where | old
        return dataclasses.replace(self, poison={**self.poison, name: (where, value)})

    def rounded(self, poisoned: bool = True) -> dict[str, np.ndarray]:
        """The inputs as the backend receives them: rounded to the dtype, poison written."""
        out = {}
        for name, x in self.inputs.items():
            x = round_to(x, self.dtype)
            if poisoned and name in self.poison:
                where, value = self.poison[name]
                x = np.where(where, value, x)
            out[name] = x
        return out

    @property
    def needs_torch(self) -> bool:
        """Whether a layout only torch can express is used: then every array is a torch tensor."""
        return not TORCH_LAYOUTS.isdisjoint(self.layouts.values())

    def with_layout(self, name: str, layout: str) -> "Case":
        """The case with input ``name`` stored in ``layout``, its values made ones the layout can show."""
        x = _aliased_values(self.inputs[name], layout)
        return dataclasses.replace(self, inputs={**self.inputs, name: x}, layouts={**self.layouts, name: layout})

    def describe(self) -> str:
        shapes = " ".join(f"{name}{x.shape}" for name, x in self.inputs.items())
        options = ", ".join(f"{name}={_short(value)}" for name, value in self.options.items())
        parts = [f"{shapes} {self.dtype}", options]
        parts += [f"{name}: {int(np.sum(where))} elements set to {value}" for name, (where, value) in self.poison.items()]
        parts += [f"{name} {LAYOUTS[layout]}" for name, layout in self.layouts.items()]
        return "case: " + "; ".join(part for part in parts if part)


def make_case(
    rng: np.random.Generator,
    *,
    batch: int = 2,
    seqlen_q: int = 64,
    seqlen_k: int | None = None,
    heads_q: int = 2,
    heads_k: int | None = None,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    dtype: str = "float32",
    **options,
) -> Case:
    """A padded-layout case with standard normal inputs."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    heads_k = heads_q if heads_k is None else heads_k
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    shapes = {
        "q": (batch, seqlen_q, heads_q, head_dim),
        "k": (batch, seqlen_k, heads_k, head_dim),
        "v": (batch, seqlen_k, heads_k, head_dim_v),
        "do": (batch, seqlen_q, heads_q, head_dim_v),
    }
    return Case({name: rng.standard_normal(shape) for name, shape in shapes.items()}, dtype, options)


def make_varlen_case(
    rng: np.random.Generator,
    *,
    lengths_q: list[int],
    lengths_k: list[int],
    spare_rows: int = 0,
    heads_q: int = 2,
    heads_k: int | None = None,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    dtype: str = "float32",
    **options,
) -> Case:
    """A packed (cu_seqlens) case; ``spare_rows`` rows past the last sequence belong to none."""
    heads_k = heads_q if heads_k is None else heads_k
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32) for lengths in (lengths_q, lengths_k))
    rows_q, rows_k = int(cu_q[-1]) + spare_rows, int(cu_k[-1]) + spare_rows
    shapes = {
        "q": (rows_q, heads_q, head_dim),
        "k": (rows_k, heads_k, head_dim),
        "v": (rows_k, heads_k, head_dim_v),
        "do": (rows_q, heads_q, head_dim_v),
    }
    inputs = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    return Case(inputs, dtype, {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, **options})


class Target:
    """The backend under test, on one device, called with the array kind it declares or ``arrays``."""

    def __init__(self, name: str, device: str, tier: str, arrays: str | None = None):
        self.name, self.device, self.tier = name, device, tier
        self.backend = flashx.registry.get(name)
        self.kind = arrays or self.backend.array_kind

    @property
    def full(self) -> bool:
        return self.tier == "full"

    @property
    def dtype(self) -> str:
        """The dtype of the feature cases: float32 where supported, the tightest bound of the
        contract's Numerics section."""
        declared = getattr(self.backend, "dtypes", DTYPES)
        return next((t for t in ("float32", "float16", "bfloat16", "float64") if t in declared), "float32")

    # -- arrays --------------------------------------------------------------------------
    def caller_kind(self, dtype: str) -> str:
        """The kind of array the suite passes: the backend's, or torch where that kind lacks the dtype."""
        lacking = dtype == "bfloat16" or dtype in FP8_DTYPES
        return "torch" if lacking and self.kind in ("numpy", "cupy") else self.kind

    def array(self, x: np.ndarray, dtype: str, layout: str = "contiguous", element: str | None = None, torch: bool = False):
        """``x`` as an array of the caller kind for ``dtype`` (torch if ``torch``), on the device.

        Floating inputs become ``dtype`` (they must be representable in it); other arrays keep
        their element type unless ``element`` names one.
        """
        x = np.asarray(x)
        element = element or (dtype if x.dtype.kind == "f" else str(x.dtype))
        base, view = _layout(x, layout)
        kind = "torch" if torch else self.caller_kind(dtype)
        if kind == "torch":
            import torch

            return view(torch.from_numpy(base).to(device=self.device, dtype=getattr(torch, element)))
        if kind == "cupy":
            import cupy

            with cupy.cuda.Device(_index(self.device)):
                return view(cupy.asarray(base.astype(element)))
        return view(base.astype(element))

    def auxiliary(self, options: dict, dtype: str, torch: bool = False) -> dict:
        """The case's keywords with NumPy arrays turned into arrays like q's (ALiBi slopes in float32)."""

        def convert(value):
            if isinstance(value, flashx.BlockMask):
                return flashx.BlockMask(self.array(value.blocks, dtype, torch=torch), value.block_size)
            if isinstance(value, np.ndarray):
                return self.array(value, dtype, element="float32" if value.dtype.kind == "f" else None, torch=torch)
            return value

        return {name: convert(value) for name, value in options.items()}

    @staticmethod
    def numpy(x) -> np.ndarray:
        """Any output as a float64 NumPy array (exact for every dtype of the contract)."""
        module = type(x).__module__.partition(".")[0]
        if module == "torch":
            return x.detach().cpu().double().numpy()
        if module == "cupy":
            return x.get().astype(np.float64)
        return np.asarray(x, dtype=np.float64)

    # -- calls -----------------------------------------------------------------------------
    def call(self, case: Case, **extra):
        """Forward and backward through the public API: (o, res, dq, dk, dv) as the backend's arrays.

        A problem the backend does not support skips the test with the backend's own reasons.
        """
        return self.run(case, self.inputs(case), **extra)

    def inputs(self, case: Case) -> dict:
        """The case's q, k, v, do as the arrays the backend receives, each in its layout."""
        return {name: self.array(x, case.dtype, case.layouts.get(name, "contiguous"), torch=case.needs_torch)
                for name, x in case.rounded().items()}

    def run(self, case: Case, inputs: dict, **extra):
        """``call`` on these arrays (``inputs``), which must hold the case's values: (o, res, dq,
        dk, dv), and dsinks after dv when the case has sinks."""
        options = {**self.auxiliary(case.options, case.dtype, torch=case.needs_torch), **extra}
        q, k, v, do = (inputs[name] for name in TENSORS)
        self.skip_unless_supported(q, k, v, **options)
        _poison_free_memory(inputs.values())
        if case.fp8:  # o has another dtype than the inputs: its blocks too
            _poison_free_memory([self.array(np.zeros(q.shape[:-1] + v.shape[-1:]), case.output_dtype)])
        o, res = flashx.attention_forward(q, k, v, backend=self.name, **options)
        grads = () if case.fp8 else flashx.attention_backward(do, q, k, v, o, res, backend=self.name, **options)
        self.check_kinds(case, q, dict(zip(outputs_of(case), (o, res.lse, *grads))))
        return (o, res, *grads)

    def skip_unless_supported(self, q, k, v, **options):
        explanation = flashx.explain(q, k, v, **options)
        for row in explanation.rows:
            if row.name == self.name and row.reasons:
                pytest.skip(f"{self.name}: " + "; ".join(row.reasons))

    def check_kinds(self, case: Case, q, outputs: dict):
        """Outputs are arrays like q (kind, device), o in ``case.output_dtype``, gradients in q's dtype,
        lse in float32/float64."""
        problems = []
        for name, x in outputs.items():
            expected = (("float64" if case.dtype == "float64" else "float32") if name in ("lse", "dsinks")
                        else case.output_dtype if name == "o" else case.dtype)
            got = flashx.arrays.dtype_name(x)
            if type(x) is not type(q) or flashx.arrays.device_of(x) != flashx.arrays.device_of(q) or got != expected:
                problems.append(f"{name}: {type(x).__name__} {got} on {flashx.arrays.device_of(x)}, expected {type(q).__name__} {expected} on {flashx.arrays.device_of(q)}")
        assert not problems, case.describe() + "\n" + "\n".join(problems)

    def outputs(self, case: Case, **extra) -> dict[str, np.ndarray]:
        """The backend's o, lse, dq, dk, dv (and dsinks) as float64 NumPy arrays."""
        o, res, *grads = self.call(case, **extra)
        return dict(zip(outputs_of(case), (self.numpy(x) for x in (o, res.lse, *grads))))

    def check(self, case: Case, relative_norm: bool = True) -> dict[str, np.ndarray]:
        """Run the case and hold every output to the oracle; returns the backend's outputs."""
        got = self.outputs(case)
        failures = conformance_failures(case, got, relative_norm)
        assert not failures, case.describe() + "\n" + "\n".join(failures)
        return got

    def require_free_memory(self, nbytes: int):
        """Skip unless the device has ``nbytes`` free (GPU tier), counting what torch's caching
        allocator holds unused (an earlier large case's blocks stay reserved)."""
        import torch

        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(torch.device(self.device))
        if free < nbytes:
            pytest.skip(f"needs {nbytes / 2**30:.1f} GiB free on {self.device}, has {free / 2**30:.1f} GiB")


def conformance_failures(case: Case, got: dict[str, np.ndarray], relative_norm: bool = True) -> list[str]:
    """Everything in ``got`` (float64 outputs) that breaks the contract for ``case``."""
    precision = reference_precision(case.dtype)
    poisoned, clean = case.real(poisoned=True), case.real(poisoned=False)
    options = case.oracle_options
    expected = oracle.forward_backward(*(poisoned[name].astype(precision) for name in ("do", "q", "k", "v")), **options)
    if case.fp8:  # plain attention in FP8, on the quantized values; judged in the output's dtype
        rounded = case.rounded(poisoned=False)
        naive = [oracle.naive_fp8(*(rounded[name] for name in ("q", "k", "v")), **case.options)]
        relative_norm = False
    else:
        naive = [oracle.naive(*(clean[name] for name in ("do", "q", "k", "v")), case.dtype, backward=backward, **options)
                 for backward in ("autograd", "rowsum")]
    terms = oracle.term_magnitudes(*(clean[name] for name in ("do", "q", "k", "v")), **options)
    subnormal = subnormal_terms(case.dtype, len(terms), *(clean[name] for name in ("do", "q", "k", "v")), **options)
    axes = AXES["varlen" if case.varlen else "padded"]
    lse = np.asarray(expected[OUTPUTS.index("lse")], dtype=np.float64)
    lse_magnitude = float(np.abs(lse[np.isfinite(lse)]).max(initial=0.0))
    failures = [
        judge(name, got[name], expected[n], [baseline[n] for baseline in naive], terms[n], case.output_dtype, axes[name],
              relative_norm, lse_magnitude, subnormal[n])
        for n, name in enumerate(outputs_of(case))
    ]
    shapes = {name: poisoned[name] for name in ("q", "k", "v")}
    empty = oracle.empty_rows(**shapes, **options)  # lse layout
    rows = empty.T if case.varlen else empty.swapaxes(1, 2)  # (Tq, Hq) or (B, Nq, Hq)
    unread = oracle.unread_keys(**shapes, **options)[..., None]
    why_row, why_key = "rows with no allowed key", "keys no allowed pair reads"
    sinks = case.options.get("sinks")
    # with sinks, such a row's lse is its head's sink: heads are the second-to-last axis of
    # (B, Hq, Nq) and the first of (Hq, Tq)
    empty_lse = -math.inf if sinks is None else np.asarray(sinks, dtype=np.float64)[:, None]
    exact = {
        "o": (0.0, rows[..., None], why_row),
        "lse": (empty_lse, empty, why_row),
        "dq": (0.0, rows[..., None], why_row),
        "dk": (0.0, unread, why_key),
        "dv": (0.0, unread, why_key),
    }
    failures += [judge_exact(name, got[name], value, selected, axes[name], why)
                 for name, (value, selected, why) in exact.items() if name in got]
    return [failure for failure in failures if failure]


def subnormal_terms(dtype: str, count: int, do, q, k, v, **options) -> list:
    """U_X of each of the ``count`` outputs (``oracle.subnormal_magnitudes``) where a 16-bit value
    a kernel keeps can fall below its dtype's normal range: float16 inputs. Elsewhere the term is
    nil (bfloat16 has float32's range; FP8 is judged against plain attention in FP8, which rounds
    its weights as a kernel does), and None each spares the oracle a pass."""
    if dtype != "float16":
        return [None] * count
    return oracle.subnormal_magnitudes(do, q, k, v, SMALLEST_NORMAL["float16"], **options)


def merged_failures(case: Case, o: np.ndarray, lse: np.ndarray) -> list[str]:
    """What breaks the contract in (o, lse) of a padded ``case`` (float64 arrays) that were joined
    from parts by ``flashx.merge_states``: graded as the forward's outputs are."""
    rounded = case.rounded()
    inputs = [rounded[name] for name in ("do", "q", "k", "v")]
    expected = oracle.forward_backward(*inputs, **case.options)
    naive = [oracle.naive(*inputs, case.dtype, backward=backward, **case.options) for backward in ("autograd", "rowsum")]
    terms = oracle.term_magnitudes(*inputs, **case.options)
    subnormal = subnormal_terms(case.dtype, len(terms), *inputs, **case.options)
    failures = [judge(name, x, expected[n], [baseline[n] for baseline in naive], terms[n], case.dtype,
                      AXES["padded"][name], subnormal=subnormal[n])
                for n, (name, x) in enumerate((("o", o), ("lse", lse)))]
    return [failure for failure in failures if failure]


def _poison_free_memory(like):
    """On a GPU, leave NaN in the allocator's free blocks of the outputs' sizes: an output
    element a kernel never writes then reads NaN instead of stale, plausible values."""
    for x in like:
        module = type(x).__module__.partition(".")[0]
        if module == "torch" and x.is_cuda and x.is_floating_point():
            x.new_full(x.shape, math.nan)  # freed at once, back to torch's caching allocator
        elif module == "cupy" and x.dtype.kind == "f":
            import cupy

            cupy.full_like(x, math.nan)  # freed at once, back to CuPy's memory pool


def _layout(x: np.ndarray, layout: str):
    """(contiguous base array, the view of it that shows x) for a key of LAYOUTS."""
    if layout == "contiguous":
        return np.ascontiguousarray(x), lambda a: a
    if layout == "transposed":
        return np.ascontiguousarray(x.swapaxes(-3, -2)), lambda a: a.swapaxes(-3, -2)
    if layout == "packed":
        base = np.full(x.shape[:-2] + (3,) + x.shape[-2:], np.nan, dtype=x.dtype)
        base[..., 1, :, :] = x
        return base, lambda a: a[..., 1, :, :]
    if layout == "strided":
        base = np.full(x.shape[:-1] + (2 * x.shape[-1],), np.nan, dtype=x.dtype)
        base[..., ::2] = x
        return base, lambda a: a[..., ::2]
    if layout == "offset":
        base = np.concatenate([[np.nan], x.ravel()]).astype(x.dtype)
        return base, lambda a: a[1:].reshape(x.shape)
    if layout == "tied":
        *outer, rows, heads, dim = x.shape
        span = rows + dim - 1  # x[..., n, h, d] lives at base[..., h, n + d]
        base = np.empty((*outer, heads, span), dtype=x.dtype)
        base[..., :dim] = x[..., 0, :, :]
        base[..., dim:] = x[..., 1:, :, -1].swapaxes(-1, -2)
        strides = (*(heads * span * np.prod(outer[i + 1:], dtype=int) for i in range(len(outer))), 1, span, 1)
        return base, lambda a: _as_strided(a, x.shape, strides)
    if layout == "broadcast":
        return np.ascontiguousarray(x[..., :1, :]), lambda a: _broadcast(a, x.shape)
    if layout == "negated":
        return -x, _negated_view
    raise ValueError(f"unknown layout {layout!r}; known: {sorted(LAYOUTS)}")


def _aliased_values(x: np.ndarray, layout: str) -> np.ndarray:
    """``x`` changed as little as needed for ``layout`` to show it (see LAYOUTS)."""
    if layout == "tied":
        base, view = _layout(x, layout)
        return view(base).copy()
    if layout == "broadcast":
        return np.broadcast_to(x[..., :1, :], x.shape).copy()
    return x


def _as_strided(a, shape, strides):
    """A view of contiguous ``a`` with element ``strides``, for NumPy, torch and CuPy arrays."""
    module = type(a).__module__.partition(".")[0]
    if module == "torch":
        return a.as_strided(shape, strides)
    library = __import__(module)
    return library.lib.stride_tricks.as_strided(a, shape, [s * a.itemsize for s in strides])


def _broadcast(a, shape):
    return a.expand(shape) if type(a).__module__.startswith("torch") else __import__(type(a).__module__.partition(".")[0]).broadcast_to(a, shape)


def _negated_view(a):
    """-a, dense, with torch's negation bit set (is_neg): a's memory seen as complex numbers, the
    lazy conjugate's imaginary part (which carries the bit), re-strided onto every element of a.
    ``a`` is contiguous with an even number of elements (a head dim of at least 2)."""
    import torch

    negated = torch.view_as_complex(a.reshape(-1, 2)).conj().imag
    return negated.as_strided(a.shape, a.stride(), a.storage_offset())


def _index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def _short(value) -> str:
    if isinstance(value, flashx.BlockMask):
        return f"BlockMask(blocks{np.shape(value.blocks)}, block_size={value.block_size})"
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{value.shape}" if value.size > 8 else repr(value.tolist())
    return repr(value)


def spans_no_block_reads(rng, batch: int, heads: int, seqlen_q: int, seqlen_k: int, size: int = 64):
    """A block mask of (size, size) blocks over seqlen_k keys (7 * size or more), random where it allows, with
    keys [2, 4) and [6, 7) blocks wide that no query block may read: whole key tiles of 128 and of
    64 are skipped, tiles of other widths partly; and the (B, Nk, 1, 1) positions of those keys."""
    blocks = rng.random((batch, heads, -(-seqlen_q // size), seqlen_k // size)) < 0.7
    unread = np.zeros((batch, seqlen_k, 1, 1), bool)
    for lo, hi in ((2, 4), (6, 7)):
        blocks[..., lo:hi] = False
        unread[:, lo * size:hi * size] = True
    return flashx.BlockMask(blocks, size), unread
