"""The attention implementations under test: every flashx backend available on the device,
FlashAttention-4 where it imports, and the peers PyTorch ships (SDPA's kernels, FlexAttention).

A flashx backend runs through the public API with an explicit ``backend=``; a shape it cannot
run (a dtype or head dim it does not declare) raises UnsupportedError with its reasons, which
the sweep records as "declined" on that row. Each implementation runs in its native layout: flashx takes BSHD (B, N, H, D), as its contract says;
the peers take BHSD, SDPA's layout. The harness makes the inputs contiguous in that layout
before timing, so that no implementation is charged a transpose.

An implementation also takes the score modifications it has (``features``: softcap, ALiBi, sinks),
as flashx's keywords (``softcap``, ``alibi_slopes``, ``sinks``), passed to ``build``; the feature
sweep (``flashx_bench.features``) times each beside the same implementation without it.

FP8 (issue 43, the contract's FP8 section): ``flashx-<backend>-fp8`` runs a flashx backend on
float8_e4m3fn copies of the run's inputs (``Implementation.fp8``), made by a cast, with descales of
1 (None) and o in bfloat16; it is forward only. The descales stay None because flashx checks given
descales on the host, one synchronising copy per call, which under ``do_bench`` would leave the GPU
idle between the start event and the kernel and charge the forward a host round trip; randn inputs
(|x| < 6) need no scaling to fit e4m3's range (448). Every flashx backend that names an FP8 dtype
gets such a sibling, and so do the backends issue 43 measures (``FP8_BACKENDS``), so that one that
declines FP8 is recorded with flashx's reasons.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashx


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: The score modifications, by flashx's feature names, and the keyword that carries each.
MODIFICATIONS = {"softcap": "softcap", "alibi": "alibi_slopes", "sinks": "sinks"}
#: The FP8 format the FP8 implementations cast their inputs to.
FP8_DTYPE = "float8_e4m3fn"
#: Issue 43's FP8 backends: each gets an FP8 sibling wherever it runs, declined or not.
FP8_BACKENDS = ("triton", "cupy")
CHECK_TOLERANCE = 1e-2  # the contract's Numerics section: relative error allowed to bf16 outputs and gradients
#: o's relative error allowed to an FP8 implementation, against the float32 reference of the 16-bit
#: inputs before their cast. Plain attention in FP8 (the contract's FP8 baseline) has 0.047-0.053 at
#: the main sweep's check shapes (randn, N = 1k, d 64 and 128): about 0.045 from rounding the inputs
#: to e4m3, 0.025 from rounding the weights; the contract lets a kernel's error reach twice the
#: baseline's, and a broken kernel (a wrong tile, a lost descale or normaliser) is off by 0.3 or more.
FP8_CHECK_TOLERANCE = 0.1


@dataclass(frozen=True)
class Implementation:
    name: str
    label: str
    layout: str  # "BSHD" or "BHSD"
    # Once per shape, before its first call: build(shape, device, **modifications), the keywords of
    # MODIFICATIONS for the features it has.
    build: Callable[..., Attend]
    # Entered once around a whole timing loop, so that selecting an SDPA kernel is not timed.
    context: Callable[[], ContextManager] = contextlib.nullcontext
    dense_scores: bool = False  # materialises B*H*N*N float32 scores (SDPA math)
    compiled: bool = False  # every new shape costs a compile, charged to --compile-budget
    features: frozenset[str] = frozenset()  # of MODIFICATIONS
    backend: str | None = None  # the flashx backend it runs
    fp8: str | None = None  # the FP8 dtype its inputs are cast to (forward only); None: the run's dtype

    @property
    def is_flashx(self) -> bool:
        return self.backend is not None

    @property
    def check_tolerance(self) -> float:
        """The largest relative error its checked outputs may have."""
        return FP8_CHECK_TOLERANCE if self.fp8 else CHECK_TOLERANCE

    def describe(self) -> dict:
        """Its entry in a record; an FP8 one names its dtype (the report sets it against the bf16
        implementation of the same backend)."""
        fp8 = {"dtype": self.fp8} if self.fp8 else {}
        return {"name": self.name, "label": self.label, "flashx": self.is_flashx, "layout": self.layout,
                "backend": self.backend, **fp8}


def settle_flashx() -> None:
    """Wait for what flashx's backends left running after a shape's first call (``Backend.settle``:
    the Triton backend's exact kernels compiling in another process, until which a masked call
    synchronises on its flags), so that a timing sees the steady state; the first call's own cost
    is timed apart (``scripts/first_call.py``)."""
    for backend in flashx.registry.backends().values():
        backend.settle()


def to_layout(bshd: torch.Tensor, layout: str) -> torch.Tensor:
    """A contiguous copy of a BSHD tensor in ``layout``: a fresh leaf of its own."""
    tensor = bshd if layout == "BSHD" else bshd.transpose(1, 2)
    return tensor.clone(memory_format=torch.contiguous_format)


def to_bhsd(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    return tensor if layout == "BHSD" else tensor.transpose(1, 2)


def flashx_backend(name: str) -> Implementation:
    def build(shape: Shape, device: torch.device, **modifications) -> Attend:
        return functools.partial(flashx.attention, causal=shape.causal, backend=name, **modifications)

    # Every feature is flashx's to run or decline: ``refuse_unsupported`` says which and why.
    return Implementation(f"flashx-{name}", f"flashx {name}", "BSHD", build, features=frozenset(MODIFICATIONS),
                          backend=name)


def flashx_fp8(name: str) -> Implementation:
    """flashx backend ``name`` on FP8_DTYPE copies of the inputs (descales of 1, o in bfloat16): forward only."""
    plain = flashx_backend(name)
    return dataclasses.replace(plain, name=f"{plain.name}-fp8", label=f"{plain.label} FP8", features=frozenset(),
                               fp8=FP8_DTYPE)


def takes_fp8(backend: str) -> bool:
    """Whether the flashx backend names an FP8 dtype among those it takes."""
    return bool(flashx.registry.get(backend).dtypes & flashx.problem.FP8_DTYPES)


def refuse_unsupported(impl: Implementation, q, k, v, **options) -> None:
    """Raise flashx.UnsupportedError with the reasons ``flashx.explain`` gives when the flashx backend
    of ``impl`` cannot run these arguments (the sweeps record it as "declined: " and the reasons)."""
    if impl.is_flashx:
        refuse_unchosen(flashx.explain(q, k, v, backend=impl.backend, **options), impl.backend)


def refuse_unchosen(explanation, backend: str) -> None:
    """Raise flashx.UnsupportedError with the reasons ``explanation`` (of ``flashx.explain`` or
    ``flashx.kvcache.explain``, asked for ``backend``) gives why ``backend`` cannot run its call."""
    if explanation.chosen is None:
        row = next(row for row in explanation.rows if row.name == backend)
        raise flashx.UnsupportedError("; ".join(row.reasons))


def failure_status(error: Exception) -> str:
    """How a row records ``error``: "declined: " and flashx's reasons, "OOM", or "error: " and its
    type and first line."""
    if isinstance(error, flashx.UnsupportedError):  # a flashx backend that cannot run this problem says why
        return "declined: " + " ".join(str(error).split())[:300]
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
        return "OOM"
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"error: {type(error).__name__}: {first_line[:200]}"


def sdpa(name: str, label: str, backend: SDPBackend, dense_scores: bool = False) -> Implementation:
    def build(shape: Shape, device: torch.device) -> Attend:
        # Equal query and key lengths: SDPA's top-left causal is the contract's bottom-right.
        return functools.partial(F.scaled_dot_product_attention, is_causal=shape.causal)

    return Implementation(name, label, "BHSD", build, functools.partial(sdpa_kernel, backend), dense_scores)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


MASK_BLOCK = 128  # FlexAttention's default sparse block size


def causal_block_mask(seqlen: int, device: torch.device):
    """FlexAttention's causal BlockMask for N a multiple of 128, built from block indices.

    The same mask as ``create_block_mask(causal)``, which evaluates every one of the N x N
    positions first: 16 GiB of booleans at N = 128k.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if seqlen % MASK_BLOCK:
        raise ValueError(f"causal_block_mask needs N a multiple of {MASK_BLOCK}, not {seqlen}")
    blocks = seqlen // MASK_BLOCK
    rows = torch.arange(blocks, device=device, dtype=torch.int32)
    # Query block i: the diagonal block i is partial, blocks 0..i-1 are full. Each index row
    # lists every block (those past the count are ignored), starting with the ones that count.
    return BlockMask.from_kv_blocks(
        kv_num_blocks=torch.ones(1, 1, blocks, device=device, dtype=torch.int32),
        kv_indices=((rows[:, None] + rows[None, :]) % blocks)[None, None],
        full_kv_num_blocks=rows[None, None],
        full_kv_indices=rows.expand(blocks, blocks).contiguous()[None, None],
        BLOCK_SIZE=MASK_BLOCK,
        mask_mod=_causal,
        seq_lengths=(seqlen, seqlen),
    )


def flex_score_mod(softcap: float | None = None, alibi_slopes: torch.Tensor | None = None):
    """FlexAttention's score_mod for the contract's softcap, then ALiBi (slopes (H,)), on the scaled
    scores; None without either. Query and key lengths are equal in every shape of the harness, so
    the contract's distance i + Lk - Lq - j is i - j."""
    if softcap is None and alibi_slopes is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if alibi_slopes is not None:
            score = score - alibi_slopes[h] * (q_idx - kv_idx).abs()
        return score

    return score_mod


def _build_flex(shape: Shape, device: torch.device, softcap=None, alibi_slopes=None) -> Attend:
    from torch.nn.attention.flex_attention import flex_attention

    # One compile per shape from an empty cache: static shapes, as a model would run them, and
    # dynamo's recompile limit can never send a later shape back to eager.
    torch._dynamo.reset()
    block_mask = causal_block_mask(shape.seqlen, device) if shape.causal else None
    score_mod = flex_score_mod(softcap, alibi_slopes)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


FLEX = Implementation("flex", "FlexAttention (compiled)", "BHSD", _build_flex, compiled=True,
                      features=frozenset({"softcap", "alibi"}))


def _build_fa4(shape: Shape, device: torch.device, softcap=None, sinks=None) -> Attend:
    from flash_attn.cute import flash_attn_func

    def attend(q, k, v):
        result = flash_attn_func(q, k, v, causal=shape.causal, softcap=0.0 if softcap is None else softcap,
                                 learnable_sink=sinks)
        # (out, lse) in the releases read; a tuple test keeps a release that returns out alone working
        return result[0] if isinstance(result, tuple) else result

    return attend


#: FlashAttention-4 (the flash-attn-4 package, CuTe DSL): BSHD like flashx; softcap and learnable
#: sinks (float32, with their gradient), no ALiBi. Its first call of a configuration (head dim,
#: causal, softcap, sinks) JIT-compiles for seconds: the first call before each timing absorbs it.
FA4 = Implementation("fa4", "FlashAttention-4", "BSHD", _build_fa4, features=frozenset({"softcap", "sinks"}))


@functools.cache
def fa4_missing() -> str | None:
    """Why FA4 cannot run here, None when ``from flash_attn.cute import flash_attn_func`` works."""
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except Exception as error:  # noqa: BLE001 - a broken install (cutlass, CUDA bindings) is absent too
        return (f"`from flash_attn.cute import flash_attn_func` failed ({type(error).__name__}: {error}); "
                "pip install flash-attn-4")
    return None


def fa4_version() -> str | None:
    if fa4_missing() is not None:
        return None
    try:
        return metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:  # run from a source tree: the module's own version
        import flash_attn

        return getattr(flash_attn, "__version__", "unknown")


def absent(device: torch.device) -> dict[str, str]:
    """The peers that cannot run on ``device`` here, and why: FA4 on a CUDA device where it does not import."""
    missing = fa4_missing() if device.type == "cuda" else None
    return {"fa4": missing} if missing else {}


def say_what_is_not_timed(device: torch.device) -> None:
    """One line for each flashx backend and each peer that cannot run here, with its reason."""
    for info in flashx.backends():
        if not info.available:
            print(f"flashx backend {info.name} is not timed: {info.reason}")
    for name, reason in absent(device).items():
        print(f"{name} is not timed: {reason}")


PEERS = (
    sdpa("sdpa-cudnn", "SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
    FLEX,
    sdpa("sdpa-flash", "SDPA flash", SDPBackend.FLASH_ATTENTION),
    sdpa("sdpa-efficient", "SDPA efficient", SDPBackend.EFFICIENT_ATTENTION),
    sdpa("sdpa-math", "SDPA math", SDPBackend.MATH, dense_scores=True),
)


def implementations(device: torch.device, names: list[str] | None = None) -> list[Implementation]:
    """Every registered flashx backend available on ``device``, then the FP8 siblings of those that
    take FP8 or that issue 43 measures in FP8, then FA4 (on CUDA, where it imports) and every other
    peer; ``names`` keeps only those."""
    backends = [info.name for info in flashx.backends() if info.available and device.type in info.devices]
    found = [flashx_backend(name) for name in backends]
    found += [flashx_fp8(name) for name in backends if name in FP8_BACKENDS or takes_fp8(name)]
    found += ([FA4] if device.type == "cuda" and fa4_missing() is None else []) + list(PEERS)
    if names:
        unknown = set(names) - {impl.name for impl in found}
        if unknown:
            raise SystemExit(f"unknown or unavailable implementations: {sorted(unknown)}; have {[i.name for i in found]}")
        found = [impl for impl in found if impl.name in names]
    return found
