"""torch.nn.functional.scaled_dot_product_attention as a flashx backend, for grading a peer.

The adapter uses SDPA's own features where they mean what the contract means, and says
where it adds something:
- layout: flashx hands BSHD, SDPA takes BHSD; both sides work on transposed views.
- masks: SDPA's ``is_causal`` is top-left aligned, the contract's causal is bottom-right, so
  every flashx mask (causal, windows, seqlens, bool and block masks) becomes one boolean
  ``attn_mask``; ``is_causal`` is used only where the alignments agree (Nq == Nk, nothing else).
- GQA: ``enable_gqa``. Scale: ``scale``. Backward: torch autograd through SDPA.
- SDPA returns no log-sum-exp: the adapter computes it from the scores (O(N^2) memory).
- dropout: SDPA draws from torch's generator, seeded here from (seed, rng_offset) so that the
  backward replays the forward's mask; it is not the contract's Philox mask.
"""

from __future__ import annotations

import functools
import operator
from importlib import metadata

import flashx
from flashx.hookspecs import hookimpl

_MASKING = frozenset({"causal", "window", "mask", "block_mask", "seqlens"})


class SdpaBackend(flashx.Backend):
    name = "sdpa"
    array_kind = "torch"
    devices = frozenset({"cpu", "cuda"})
    # No varlen (SDPA has no cu_seqlens), no softcap; ALiBi would need a float mask.
    features = _MASKING | {"dropout", "gqa", "dv_ne_d"}

    @property
    def version(self) -> str:
        return metadata.version("torch")  # the peer graded is torch's SDPA

    def priority(self, problem) -> int:
        return -1  # a peer for comparison: flashx's own kernels, which meet the contract, come first

    def extra_reasons(self, problem) -> list[str]:
        if problem.deterministic and problem.device == "cuda":
            return ["SDPA's CUDA backward kernels accumulate with atomics: not deterministic"]
        return []

    def forward(self, problem, q, k, v):
        allowed = _allowed(problem, q.device)
        return _attend(problem, q, k, v, allowed), _lse(problem, q, k, allowed)

    def backward(self, problem, q, k, v, o, lse, do):
        import torch

        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            o = _attend(problem, *inputs, _allowed(problem, q.device))
            return torch.autograd.grad(o, inputs, do)


def _attend(problem, q, k, v, allowed):
    """SDPA on BSHD tensors; returns o in BSHD."""
    import torch

    if not problem.dropout_p:
        return _sdpa(problem, q, k, v, allowed)
    with torch.random.fork_rng(devices=[q.device] if q.device.type == "cuda" else []):
        # Each rng_offset (taken modulo 2**32, as the contract's counter does) must draw another
        # mask, and the backward the forward's one.
        torch.manual_seed((problem.seed + problem.rng_offset % 2**32 * 0x9E3779B97F4A7C15) % 2**64)
        return _sdpa(problem, q, k, v, allowed)


def _sdpa(problem, q, k, v, allowed):
    import torch.nn.functional as F

    top_left_agrees = problem.features & _MASKING == {"causal"} and problem.seqlen_q == problem.seqlen_k
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=None if top_left_agrees else allowed,
        is_causal=top_left_agrees,
        dropout_p=problem.dropout_p,
        scale=problem.softmax_scale,
        enable_gqa=problem.heads_q != problem.heads_k,
    )
    return o.transpose(1, 2)


def _lse(problem, q, k, allowed):
    """Natural log-sum-exp of the allowed scaled scores, (B, Hq, Nq); -inf for empty rows."""
    import torch

    accumulate = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k.repeat_interleave(problem.group, dim=2)
    scores = problem.softmax_scale * torch.einsum("bihd,bjhd->bhij", q.to(accumulate), k.to(accumulate))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def _allowed(problem, device):
    """Every flashx mask as one boolean tensor broadcastable to (B, Hq, Nq, Nk); None if all allowed."""
    import torch

    n_q, n_k = problem.seqlen_q, problem.seqlen_k
    i = torch.arange(n_q, device=device).view(n_q, 1)
    j = torch.arange(n_k, device=device).view(1, n_k)
    len_q, len_k = (
        n if lengths is None else lengths.to(device).view(-1, 1, 1, 1)
        for lengths, n in ((problem.seqlens_q, n_q), (problem.seqlens_k, n_k))
    )
    parts = []
    if problem.seqlens_q is not None:
        parts.append(i < len_q)
    if problem.seqlens_k is not None:
        parts.append(j < len_k)
    if problem.band is not None:
        left, right = problem.band
        diagonal = i + len_k - len_q  # bottom-right alignment, per sequence
        if left != -1:
            parts.append(j >= diagonal - left)
        if right != -1:
            parts.append(j <= diagonal + right)
    if problem.mask is not None:
        parts.append(problem.mask.to(device))
    if problem.block_mask is not None:
        (bq, bk), blocks = problem.block_mask.block_size, problem.block_mask.blocks.to(device)
        blocks = torch.broadcast_to(blocks, (*blocks.shape[:-2], -(-n_q // bq), -(-n_k // bk)))
        parts.append(blocks.repeat_interleave(bq, -2)[..., :n_q, :].repeat_interleave(bk, -1)[..., :n_k])
    return functools.reduce(operator.and_, parts) if parts else None


@hookimpl
def flashx_backends():
    return [SdpaBackend()]
