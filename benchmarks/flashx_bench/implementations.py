"""The attention implementations under test: every flashx backend available on the device, and
the peers PyTorch ships (SDPA's kernels, FlexAttention).

A flashx backend runs through the public API with an explicit ``backend=``; a shape it cannot
run (a dtype or head dim it does not declare) raises UnsupportedError with its reasons, which
the sweep records as "declined" on that row. Each implementation runs in its native layout: flashx takes BSHD (B, N, H, D), as its contract says;
the peers take BHSD, SDPA's layout. The harness makes the inputs contiguous in that layout
before timing, so that no implementation is charged a transpose.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Implementation:
    name: str
    label: str
    is_flashx: bool
    layout: str  # "BSHD" or "BHSD"
    build: Callable[[Shape, torch.device], Attend]  # once per shape, before its first call
    # Entered once around a whole timing loop, so that selecting an SDPA kernel is not timed.
    context: Callable[[], ContextManager] = contextlib.nullcontext
    dense_scores: bool = False  # materialises B*H*N*N float32 scores (SDPA math)
    compiled: bool = False  # every new shape costs a compile, charged to --compile-budget

    def describe(self) -> dict:
        return {"name": self.name, "label": self.label, "flashx": self.is_flashx, "layout": self.layout}


def to_layout(bshd: torch.Tensor, layout: str) -> torch.Tensor:
    """A contiguous copy of a BSHD tensor in ``layout``: a fresh leaf of its own."""
    tensor = bshd if layout == "BSHD" else bshd.transpose(1, 2)
    return tensor.clone(memory_format=torch.contiguous_format)


def to_bhsd(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    return tensor if layout == "BHSD" else tensor.transpose(1, 2)


def flashx_backend(name: str) -> Implementation:
    def build(shape: Shape, device: torch.device) -> Attend:
        return functools.partial(flashx.attention, causal=shape.causal, backend=name)

    return Implementation(f"flashx-{name}", f"flashx {name}", True, "BSHD", build)


def sdpa(name: str, label: str, backend: SDPBackend, dense_scores: bool = False) -> Implementation:
    def build(shape: Shape, device: torch.device) -> Attend:
        # Equal query and key lengths: SDPA's top-left causal is the contract's bottom-right.
        return functools.partial(F.scaled_dot_product_attention, is_causal=shape.causal)

    return Implementation(
        name, label, False, "BHSD", build, functools.partial(sdpa_kernel, backend), dense_scores
    )


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


def _build_flex(shape: Shape, device: torch.device) -> Attend:
    from torch.nn.attention.flex_attention import flex_attention

    # One compile per shape from an empty cache: static shapes, as a model would run them, and
    # dynamo's recompile limit can never send a later shape back to eager.
    torch._dynamo.reset()
    block_mask = causal_block_mask(shape.seqlen, device) if shape.causal else None
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


FLEX = Implementation("flex", "FlexAttention (compiled)", False, "BHSD", _build_flex, compiled=True)

PEERS = (
    sdpa("sdpa-cudnn", "SDPA cuDNN", SDPBackend.CUDNN_ATTENTION),
    FLEX,
    sdpa("sdpa-flash", "SDPA flash", SDPBackend.FLASH_ATTENTION),
    sdpa("sdpa-efficient", "SDPA efficient", SDPBackend.EFFICIENT_ATTENTION),
    sdpa("sdpa-math", "SDPA math", SDPBackend.MATH, dense_scores=True),
)


def implementations(device: torch.device, names: list[str] | None = None) -> list[Implementation]:
    """Every registered flashx backend available on ``device``, then every peer; ``names`` keeps only those."""
    found = [
        flashx_backend(info.name) for info in flashx.backends() if info.available and device.type in info.devices
    ]
    found += PEERS
    if names:
        unknown = set(names) - {impl.name for impl in found}
        if unknown:
            raise SystemExit(f"unknown or unavailable implementations: {sorted(unknown)}; have {[i.name for i in found]}")
        found = [impl for impl in found if impl.name in names]
    return found
