"""The dense reference: the contract (docs/contract.md) from Shapes to Dropout in float64, for small shapes.

Every (b, h, i, j) score is materialised, so there is no tiling, no online softmax and
nothing in common with any backend. It computes in the precision of its inputs promoted
to float64 at least: ``np.longdouble`` inputs give an extended-precision reference, which
the tolerance rule uses to judge float64 backends.

The score modifications (softcap, ALiBi, sinks) are the contract's steps in its order: scale,
softcap, ALiBi, masks, the softmax with the sink's column in each denominator, dropout. With
``sinks`` every function that returns gradients returns dsinks after dv, as
``flashx.attention_backward`` does.

Garbage in positions no allowed pair reads (padding, masked keys, rows past the last
sequence) never reaches an output, and NaN or inf that an allowed pair reads propagates
exactly as plain IEEE arithmetic over the allowed pairs would: see ``_masked_matmul``.

``naive`` is the other half of the tolerance rule: plain attention computed by torch on
CPU in the input dtype itself (scores, softmax and products all rounded to that dtype).

FP8 inputs (the contract's FP8 section) stand for real values: ``dequantize`` gives them in
float64, exactly, for every function above; ``naive_fp8`` is their baseline, plain attention in FP8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashx_conformance import philox

#: The keywords of ``flashx.attention`` that determine the values (all are accepted here).
OPTIONS = (
    "causal",
    "window",
    "softmax_scale",
    "softcap",
    "alibi_slopes",
    "sinks",
    "mask",
    "block_mask",
    "seqlens_q",
    "seqlens_k",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "dropout_p",
    "seed",
    "rng_offset",
    "dropout_offsets",
)
#: Keywords accepted for call compatibility with flashx.attention; they change no value.
HINTS = ("max_seqlen_q", "max_seqlen_k", "deterministic", "validate")
#: The keywords of FP8 inputs: ``naive_fp8`` takes them; the other functions see dequantized inputs.
FP8_OPTIONS = ("q_descale", "k_descale", "v_descale", "out_dtype")


def forward(q, k, v, **options):
    """(o, lse) in the layouts of the contract's Shapes section: padded o (B, Nq, Hq, Dv), lse (B, Hq, Nq)."""
    dense = _prepare(q, k, v, None, options)
    result = _attend(dense, gradients=False)
    return dense.rows_q(result["o"], 0.0), dense.lse(result["lse"])


def backward(do, q, k, v, **options):
    """(dq, dk, dv) for the upstream gradient ``do``, shaped like q, k, v; and dsinks (Hq,) with sinks."""
    return forward_backward(do, q, k, v, **options)[2:]


def forward_backward(do, q, k, v, **options):
    """(o, lse, dq, dk, dv) from one evaluation; (o, lse, dq, dk, dv, dsinks) with sinks."""
    dense = _prepare(q, k, v, do, options)
    return dense.outputs(_attend(dense, gradients=True))


def term_magnitudes(do, q, k, v, **options):
    """For each of (o, lse, dq, dk, dv) (and dsinks with sinks): the sum of the absolute values of
    the terms summed into it.

    The size of rounding noise: a gradient that cancels to 0 (dS = P (dP - delta) with one
    key per row) still carries noise at the magnitude of P |dP| and P |delta|.
    """
    dense = _prepare(q, k, v, do, options)
    result = _attend(dense, gradients=True, magnitudes=True)
    return dense.outputs({**result, "lse": np.abs(result["lse"])})


def subnormal_magnitudes(do, q, k, v, smallest_normal: float, **options):
    """For each of (o, lse, dq, dk, dv) (and dsinks with sinks): U_X, the sum over the terms of X
    of the factors that multiply a value of the input dtype t lying below ``smallest_normal``
    (t's). Times half t's subnormal spacing it bounds what rounding those values moves X by:
    below the normal range rounding is absolute, so T_X does not hold it (``tolerance.py``).

    The values are those a flash kernel keeps in t between two products:
    - o, which the contract stores in t and the backward reads back for delta_i =
      dot(o_i, do_i): a subnormal o_ie moves delta_i by up to half a spacing times |do_ie|, and
      every dS_ij = P_ij (dP_ij - delta_i) of the row by P_ij times that (times softcap's slope);
    - P (in o's product with V, and, kept and scaled by dropout, in dv's with dO) and dS (in dq's
      product with K and dk's with Q), which a kernel on 16-bit tensor cores rounds to t.
    Each counts only where the oracle's value is below ``smallest_normal``: above it rounding
    is relative, and the floor's eps_t / 2 * T_X holds it.
    """
    dense = _prepare(q, k, v, do, options)
    result = _attend(dense, gradients=True)
    tiny = smallest_normal
    p, p_dropped, ds, slope, attended, k_heads, v_heads = (
        result["intermediates"][name] for name in ("p", "p_dropped", "ds", "slope", "attended", "k", "v"))
    allowed, keep, heads_k = dense.allowed, (1.0 if dense.keep is None else dense.keep), dense.k.shape[1]
    q_abs, k_abs, v_abs, do_abs = (np.abs(x) for x in (dense.q, k_heads, v_heads, dense.do))  # k, v per query head
    with np.errstate(invalid="ignore"):  # NaN inputs: NaN magnitudes, which the tolerance leaves out
        # o = sum_j (P Z / (1 - p))_ij v_j: a forward rounds exp(S - m) >= P (m, its running
        # maximum, is at most the row's lse), then divides by the row's sum (>= 1) and by 1 - p
        o = np.where(attended & (p < tiny), keep, 0.0) @ v_abs
        # dv_j = sum_i (P Z / (1 - p))_ij do_i: the kernel rounds the scaled, kept P
        dv = _group_sum(np.where(attended & (p_dropped < tiny), 1.0, 0.0).swapaxes(-1, -2) @ do_abs, heads_k)
        # delta_i's error per unit of spacing: the |do_ie| of o's elements below the normal range
        delta = np.where(np.abs(result["o"]) < tiny, do_abs, 0.0).sum(axis=-1, keepdims=True)
        ds_terms = np.where(allowed, p * delta * slope + (np.abs(ds) < tiny), 0.0)
        scale = abs(dense.scale)
        magnitudes = {
            "o": o,
            "lse": np.zeros(result["lse"].shape),
            "dq": scale * (ds_terms @ k_abs),
            "dk": _group_sum(scale * (ds_terms.swapaxes(-1, -2) @ q_abs), heads_k),
            "dv": dv,
        }
        if dense.sinks is not None:  # dsinks = -sum_i P_sink_i delta_i over rows with a key
            p_sink = np.exp(dense.sinks.reshape(1, -1, 1, 1) - result["lse"][..., None])
            terms = np.where(allowed.any(axis=-1, keepdims=True), p_sink * delta, 0.0)
            magnitudes["dsinks"] = terms.sum(axis=(0, 2, 3))
    return dense.outputs(magnitudes)


def empty_rows(q, k, v, **options) -> np.ndarray:
    """True where a query row has no allowed key (o = 0, lse = -inf, dq = 0), in lse's layout."""
    dense = _prepare(q, k, v, None, options)
    rows = ~dense.allowed.any(axis=-1)
    return dense.lse(np.where(rows, -np.inf, 0.0)) == -np.inf


def unread_keys(q, k, v, **options) -> np.ndarray:
    """True where no allowed pair reads key j of kv head h (dk = dv = 0): (B, Nk, Hk) or (Tk, Hk)."""
    dense = _prepare(q, k, v, None, options)
    batch, heads_q, seqlen_q, seqlen_k = dense.allowed.shape
    heads_k = dense.k.shape[1]
    read = dense.allowed.reshape(batch, heads_k, heads_q // heads_k * seqlen_q, seqlen_k).any(axis=2)
    # as a (B, Hk, Nk, 1) "gradient", so that the layout code of dk applies
    return dense.rows_k(np.where(read, 0.0, 1.0)[..., None], fill=1.0)[..., 0] == 1.0


def allowed(q, k, v, **options) -> np.ndarray:
    """Which (b, h, i, j) pairs may attend, on the padded score grid (B, Hq, Nq, Nk); varlen: per sequence."""
    return _prepare(q, k, v, None, options).allowed


def keep_mask(q, k, v, **options) -> np.ndarray:
    """Z of the contract's Dropout section on the padded score grid (B, Hq, Nq, Nk); varlen: per sequence, padded."""
    dense = _prepare(q, k, v, None, options)
    return dense.keep != 0 if dense.keep is not None else np.ones(dense.allowed.shape, dtype=bool)


def naive(do, q, k, v, dtype: str, *, backward: str = "autograd", **options):
    """(o, lse, dq, dk, dv) of plain attention computed by torch on CPU in ``dtype``.

    The inputs must already be representable in ``dtype``. 16-bit dtypes are emulated: each
    operation runs in float32 and its result is rounded to ``dtype`` (what a 16-bit matmul
    with float32 accumulation gives, without torch's slow 16-bit CPU kernels); autograd
    rounds each gradient the same way. Rows without an allowed key give 0 (not NaN), so
    the naive error is measured on what a backend is judged on.

    ``backward`` picks one of two plain formulations of the gradients, both in ``dtype``:
    "autograd" (torch differentiates the forward) or "rowsum" (explicit formulas with
    delta = rowsum(dO * O), as FlashAttention's backward computes it). Where a gradient
    vanishes by cancellation (one key per row: dS = P (dP - delta) = 0), autograd is exact
    by accident while every flash kernel leaves rounding noise; "rowsum" measures that noise.
    Sinks are one more column of the softmax, in float32 as the contract hands them to backends.
    """
    import torch

    dense = _prepare(q, k, v, do, options)
    rounded = getattr(torch, dtype)
    work = torch.float32 if dtype in ("float16", "bfloat16") else rounded

    def r(x):
        return x.to(rounded).to(work)

    def tensor(x):
        return torch.from_numpy(np.array(x, dtype=np.float64)).to(work)

    q_, k_, v_ = (tensor(x).requires_grad_(backward == "autograd") for x in (dense.q, dense.k, dense.v))
    sinks = None if dense.sinks is None else tensor(dense.sinks).requires_grad_(backward == "autograd")
    group = q_.shape[1] // k_.shape[1]
    k_all, v_all = k_.repeat_interleave(group, 1), v_.repeat_interleave(group, 1)
    allowed = torch.from_numpy(np.array(dense.allowed))
    raw = r(r(q_ * dense.scale) @ k_all.transpose(-1, -2))
    scores = raw if dense.softcap is None else r(dense.softcap * r(torch.tanh(r(raw / dense.softcap))))
    if dense.bias is not None:
        scores = r(scores + r(tensor(dense.bias)))
    scores = scores.masked_fill(~allowed, -math.inf)
    empty = ~allowed.any(dim=-1, keepdim=True)
    if sinks is None:
        lse = r(torch.logsumexp(scores, dim=-1))
        p = r(torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)).masked_fill(~allowed, 0.0)
    else:
        column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        lse = r(torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1))
        p_all = r(torch.softmax(torch.cat([scores.masked_fill(empty, 0.0), column], dim=-1), dim=-1))
        p, p_sink = p_all[..., :-1].masked_fill(~allowed, 0.0), p_all[..., -1:]
    keep = None if dense.keep is None else r(tensor(dense.keep))
    p_dropped = p if keep is None else r(p * keep)
    o = r(p_dropped @ v_all)
    do_ = tensor(dense.do)
    dsinks = None
    if backward == "autograd":
        leaves = (q_, k_, v_) if sinks is None else (q_, k_, v_, sinks)
        dq, dk, dv, *dsinks = (r(g) for g in torch.autograd.grad(o, leaves, do_))
        dsinks = dsinks[0] if dsinks else None
    else:
        dp = r(do_ @ v_all.transpose(-1, -2)).masked_fill(~allowed, 0.0)
        if keep is not None:
            dp = r(dp * keep)
        delta = r((do_ * o).sum(dim=-1, keepdim=True))
        ds = r(p * r(dp - delta))
        if sinks is not None:
            dsinks = r(-r(p_sink * delta).masked_fill(empty, 0.0).sum(dim=(0, 2, 3)))
        if dense.softcap is not None:
            ds = r(ds * r(1 - r(torch.tanh(raw / dense.softcap)) ** 2))
        batch, heads_k = k_.shape[:2]
        dq = r(dense.scale * r(ds @ k_all))
        dk = r(dense.scale * r(ds.transpose(-1, -2) @ q_)).reshape(batch, heads_k, group, *k_.shape[2:]).sum(2)
        dv = r(p_dropped.transpose(-1, -2) @ do_).reshape(batch, heads_k, group, *v_.shape[2:]).sum(2)
        dk, dv = r(dk), r(dv)

    def numpy(x):
        return None if x is None else x.detach().double().numpy()

    return dense.outputs({"o": numpy(o), "lse": numpy(lse), "dq": numpy(dq), "dk": numpy(dk), "dv": numpy(dv),
                          "dsinks": numpy(dsinks)})


def dequantize(x8, descale, group: int = 1, cu_seqlens=None) -> np.ndarray:
    """The real values FP8 data stands for, in float64 (exact): x8 (B, N, H, D), or (T, H, D)
    packed with ``cu_seqlens``, each element times ``descale[b, h // group]`` of its sequence b and
    head h (``descale`` (B, Hk); None: 1). Rows past the last packed sequence keep their values."""
    x = np.array(x8, dtype=np.float64)
    if descale is None:
        return x
    factors = np.repeat(np.asarray(descale, dtype=np.float64), group, axis=1)
    if cu_seqlens is None:
        return x * factors[:, None, :, None]
    for b, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        x[start:end] *= factors[b][None, :, None]
    return x


def naive_fp8(q8, k8, v8, *, q_descale=None, k_descale=None, v_descale=None, out_dtype=None, **options):
    """(o, lse) of plain attention in FP8 (the contract's FP8 section), by torch on CPU.

    q8, k8, v8 hold FP8 values (in any dtype that holds them exactly); descales (B, Hk) as the
    call's, None meaning 1. Every score is materialised: fl32(q8 . k8) times
    fl32(scale * q_descale * k_descale), then softcap, ALiBi and masks in float32; the weights
    exp(S - the row's maximum) in float32 are rounded to e4m3 for their product with v8 (summed
    in float32), which is scaled by v_descale, divided by the sum of the unrounded weights and
    rounded to ``out_dtype`` (bfloat16 for None). Rows without an allowed key give o = 0.
    """
    import torch

    dense = _prepare(q8, k8, v8, None, options)
    batch, heads_q = dense.allowed.shape[:2]
    heads_k = dense.k.shape[1]
    group = heads_q // heads_k
    f32 = torch.float32

    def tensor(x):
        return torch.from_numpy(np.array(x, dtype=np.float64)).to(f32)

    def per_query_head(descale):  # (B, Hk) -> (B, Hq, 1, 1): query head h reads descale[:, h // group]
        factors = np.ones((batch, heads_k)) if descale is None else np.asarray(descale, dtype=np.float32)
        return tensor(np.repeat(factors, group, axis=1)).reshape(batch, heads_q, 1, 1)

    q, k, v = tensor(dense.q), tensor(dense.k).repeat_interleave(group, 1), tensor(dense.v).repeat_interleave(group, 1)
    factor = torch.tensor(dense.scale, dtype=f32) * per_query_head(q_descale) * per_query_head(k_descale)
    scores = (q @ k.transpose(-1, -2)) * factor
    if dense.softcap is not None:
        scores = dense.softcap * torch.tanh(scores / dense.softcap)
    if dense.bias is not None:
        scores = scores + tensor(dense.bias)
    allowed = torch.from_numpy(np.array(dense.allowed))
    scores = scores.masked_fill(~allowed, -math.inf)
    empty = ~allowed.any(dim=-1, keepdim=True)
    columns = [scores]
    if dense.sinks is not None:
        columns.append(tensor(dense.sinks).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1))
    every = torch.cat(columns, dim=-1)
    top = every.amax(dim=-1, keepdim=True)
    top = top.masked_fill(top == -math.inf, 0.0)  # a row without keys nor sink: exp(-inf - 0) = 0
    weights = torch.exp(every - top)
    total = weights.sum(dim=-1, keepdim=True)
    lse = (top + torch.log(total))[..., 0]
    p8 = weights[..., : scores.shape[-1]].to(torch.float8_e4m3fn).to(f32)
    o = ((p8 @ v) * per_query_head(v_descale) / total).masked_fill(empty, 0.0)
    o = o.to(getattr(torch, out_dtype or "bfloat16")).double().numpy()
    return dense.rows_q(o, 0.0), dense.lse(lse.double().numpy())


@dataclass
class _Dense:
    """One call on the padded score grid: q (B, Hq, Nq, D), k, v (B, Hk, Nk, D|Dv)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray | None  # (B, Hq, Nq, Dv)
    allowed: np.ndarray  # (B, Hq, Nq, Nk) bool
    keep: np.ndarray | None  # Z / (1 - p), (B, Hq, Nq, Nk), None without dropout
    bias: np.ndarray | None  # ALiBi, broadcastable to (B, Hq, Nq, Nk)
    sinks: np.ndarray | None  # (Hq,)
    scale: float
    softcap: float | None
    cu_seqlens_q: np.ndarray | None  # varlen: the outputs are packed back with these
    cu_seqlens_k: np.ndarray | None
    total_q: int
    total_k: int

    def outputs(self, result: dict) -> tuple:
        """(o, lse, dq, dk, dv), and dsinks with sinks, in the caller's layouts."""
        outputs = (
            self.rows_q(result["o"], 0.0),
            self.lse(result["lse"]),
            self.rows_q(result["dq"], 0.0),
            self.rows_k(result["dk"]),
            self.rows_k(result["dv"]),
        )
        return outputs if self.sinks is None else (*outputs, result["dsinks"])

    def rows_q(self, x, fill):
        """(B, Hq, Nq, Dv) -> the caller's layout of o / dq."""
        return self._rows(x, self.cu_seqlens_q, self.total_q, fill)

    def rows_k(self, x, fill=0.0):
        """(B, Hk, Nk, D) -> the caller's layout of dk / dv."""
        return self._rows(x, self.cu_seqlens_k, self.total_k, fill)

    def lse(self, x):
        """(B, Hq, Nq) -> (B, Hq, Nq), or (Hq, Tq) packed (rows past the last sequence: -inf, or the sink)."""
        if self.cu_seqlens_q is None:
            return x
        fill = -np.inf if self.sinks is None else self.sinks[:, None]
        return self._rows(x[..., None], self.cu_seqlens_q, self.total_q, fill)[..., 0].T

    @staticmethod
    def _rows(x, cu, total, fill):
        x = x.swapaxes(1, 2)
        if cu is None:
            return x
        packed = np.full((total,) + x.shape[2:], fill, dtype=x.dtype)
        for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
            packed[start:end] = x[b, : end - start]
        return packed


def _prepare(q, k, v, do, options) -> _Dense:
    unknown = set(options) - set(OPTIONS) - set(HINTS)
    if unknown:
        raise TypeError(f"oracle: unknown keywords {sorted(unknown)}; known: {OPTIONS + HINTS}")
    get = options.get
    precision = np.result_type(np.asarray(q).dtype, np.asarray(k).dtype, np.asarray(v).dtype, np.float64)
    q, k, v = (np.asarray(x, dtype=precision) for x in (q, k, v))
    do = None if do is None else np.asarray(do, dtype=precision)
    cu_q, cu_k = get("cu_seqlens_q"), get("cu_seqlens_k")
    total_q, total_k = q.shape[0], k.shape[0]
    if cu_q is not None:
        cu_q, cu_k = (np.asarray(cu, dtype=np.int64) for cu in (cu_q, cu_k))
        len_q, len_k = np.diff(cu_q), np.diff(cu_k)
        seqlen_q, seqlen_k = (int(lengths.max(initial=0)) for lengths in (len_q, len_k))
        q, do = (None if x is None else _padded(x, cu_q, seqlen_q) for x in (q, do))
        k, v = (_padded(x, cu_k, seqlen_k) for x in (k, v))
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1:3]
    if cu_q is None:
        len_q, len_k = (
            np.full(batch, n) if lengths is None else np.asarray(lengths, dtype=np.int64)
            for lengths, n in ((get("seqlens_q"), seqlen_q), (get("seqlens_k"), seqlen_k))
        )

    i = np.arange(seqlen_q).reshape(-1, 1)
    j = np.arange(seqlen_k).reshape(1, -1)
    len_q, len_k = (lengths.reshape(-1, 1, 1, 1) for lengths in (len_q, len_k))
    distance = j - (i + len_k - len_q)  # from the bottom-right aligned diagonal
    allowed = (i < len_q) & (j < len_k)
    if get("causal"):
        allowed &= distance <= 0
    if get("window") is not None:
        left, right = get("window")
        if left != -1:
            allowed &= distance >= -left
        if right != -1:
            allowed &= distance <= right
    grid = (batch, heads_q, seqlen_q, seqlen_k)
    if get("mask") is not None:
        allowed = allowed & np.asarray(get("mask"), dtype=bool)
    if get("block_mask") is not None:
        (bq, bk), blocks = get("block_mask").block_size, np.asarray(get("block_mask").blocks, dtype=bool)
        blocks = np.broadcast_to(blocks, (batch, heads_q, -(-seqlen_q // bq), -(-seqlen_k // bk)))
        allowed = allowed & blocks.repeat(bq, axis=-2)[..., :seqlen_q, :].repeat(bk, axis=-1)[..., :seqlen_k]
    allowed = np.broadcast_to(allowed, grid)

    bias = None
    if get("alibi_slopes") is not None:
        slopes = np.asarray(get("alibi_slopes"), dtype=precision)
        slopes = slopes.reshape((-1 if slopes.ndim == 2 else 1, heads_q, 1, 1))
        bias = -slopes * np.abs(distance)

    sinks = None if get("sinks") is None else np.asarray(get("sinks"), dtype=precision).reshape(heads_q)

    keep = None
    dropout_p = get("dropout_p") or 0.0
    if dropout_p > 0:
        if get("seed") is None:
            raise ValueError("oracle: dropout needs the seed the backend used (res.seed)")
        z = philox.keep_mask(get("seed"), get("rng_offset") or 0, dropout_p, *grid, get("dropout_offsets") or (0, 0))
        keep = z / np.asarray(1 - dropout_p, dtype=precision)

    scale = get("softmax_scale")
    return _Dense(
        q=q.swapaxes(1, 2),
        k=k.swapaxes(1, 2),
        v=v.swapaxes(1, 2),
        do=None if do is None else do.swapaxes(1, 2),
        allowed=allowed,
        keep=keep,
        bias=bias,
        sinks=sinks,
        scale=1 / math.sqrt(head_dim) if scale is None else scale,
        softcap=get("softcap"),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        total_q=total_q,
        total_k=total_k,
    )


def _padded(x, cu, seqlen):
    """Packed (T, H, D) -> (B, seqlen, H, D); rows past a sequence are zero (and never allowed)."""
    out = np.zeros((len(cu) - 1, seqlen) + x.shape[1:], dtype=x.dtype)
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        out[b, : end - start] = x[start:end]
    return out


def _attend(dense: _Dense, gradients: bool, magnitudes: bool = False) -> dict:
    """o, lse and (with ``gradients``) dq, dk, dv; ``magnitudes``: their term magnitudes instead."""
    allowed = dense.allowed
    heads_q, heads_k = dense.q.shape[1], dense.k.shape[1]
    group = heads_q // heads_k
    k, v = (np.repeat(x, group, axis=1) for x in (dense.k, dense.v))
    with np.errstate(all="ignore"):  # -inf - -inf, 0 * inf: the masking below decides
        scores = dense.scale * (dense.q @ k.swapaxes(-1, -2))
        if dense.softcap is not None:
            capped = np.tanh(scores / dense.softcap)
            scores = dense.softcap * capped
        if dense.bias is not None:
            scores = scores + dense.bias
        scores = np.where(allowed, scores, -np.inf)
        row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)
        if dense.sinks is None:
            # an empty row has max -inf: shift by 0 so that exp gives 0, not NaN; NaN and +inf stay
            row_max = np.where(row_max == -np.inf, 0.0, row_max)
            e = np.exp(scores - row_max)
            total = e.sum(axis=-1, keepdims=True)
            p = e / np.where(total > 0, total, 1.0)
            lse = row_max + np.log(total)
        else:
            # The sink is one more column of every denominator, never masked: a NaN or +inf sink
            # makes its rows' lse NaN (as such a score would), and P = exp(S - lse) carries it.
            sink = dense.sinks.reshape(1, -1, 1, 1)
            empty = ~allowed.any(axis=-1, keepdims=True)
            top = np.maximum(row_max, sink)
            top = np.where(top == -np.inf, 0.0, top)  # no key and a sink of -inf
            total = np.exp(scores - top).sum(axis=-1, keepdims=True) + np.exp(sink - top)
            lse = np.where(empty, sink, top + np.log(total))
            p = np.where(allowed, np.exp(scores - lse), 0.0)
        lse, lse_rows = lse[..., 0], lse
        p_dropped = p if dense.keep is None else p * dense.keep
        # A dropped pair contributes exactly 0, as a disallowed one does: never 0 * NaN.
        attended = allowed if dense.keep is None else allowed & (dense.keep != 0)
        if magnitudes:
            q, k, v, do = (np.abs(x) for x in (dense.q, k, v, dense.do))
            # lse is log(l) plus a P-weighted mean of the scores: it errs as they do, by the
            # rounding of their dot products at the magnitude of their terms, not of their sum
            score_terms = np.abs(dense.scale) * (q @ k.swapaxes(-1, -2))
            lse = np.abs(lse) + np.where(allowed, p * score_terms, 0.0).sum(axis=-1)
        else:
            q, do = dense.q, dense.do
        result = {"o": _masked_matmul(p_dropped, v, attended), "lse": lse}
        if not gradients:
            return result

        dp = np.where(attended, do @ v.swapaxes(-1, -2), 0.0)
        if dense.keep is not None:
            dp = dp * dense.keep
        delta = np.where(allowed, p * dp, 0.0).sum(axis=-1, keepdims=True)
        if magnitudes:  # dp and delta are sums of absolute values here
            ds, scale = np.where(allowed, p * (dp + delta), 0.0), abs(dense.scale)
        else:
            ds, scale = np.where(allowed, p * (dp - delta), 0.0), dense.scale
        slope = 1.0 if dense.softcap is None else 1 - capped * capped  # d S_capped / d S_scaled
        if dense.softcap is not None and not magnitudes:
            ds = ds * slope
        if dense.sinks is not None:
            # d lse / d sink = exp(sink - lse): each row with a key adds -P_sink * delta
            p_sink = np.exp(dense.sinks.reshape(1, -1, 1, 1) - lse_rows)
            terms = np.where(allowed.any(axis=-1, keepdims=True), p_sink * delta, 0.0)
            result["dsinks"] = (1 if magnitudes else -1) * terms.sum(axis=(0, 2, 3))
        allowed_t = allowed.swapaxes(-1, -2)
        result["dq"] = scale * _masked_matmul(ds, k, allowed)
        result["dk"] = _group_sum(scale * _masked_matmul(ds.swapaxes(-1, -2), q, allowed_t), heads_k)
        result["dv"] = _group_sum(_masked_matmul(p_dropped.swapaxes(-1, -2), do, attended.swapaxes(-1, -2)), heads_k)
        if not magnitudes:  # for subnormal_magnitudes: what a kernel may round, on the padded grid
            result["intermediates"] = {"p": p, "p_dropped": p_dropped, "ds": ds, "slope": slope,
                                       "attended": attended, "k": k, "v": v}
    return result


def _group_sum(x, heads_k):
    """(B, Hq, N, D) -> (B, Hk, N, D): kv head h collects the gradients of its query heads."""
    batch, heads_q = x.shape[:2]
    return x.reshape(batch, heads_k, heads_q // heads_k, *x.shape[2:]).sum(axis=2)


def _masked_matmul(a, b, allowed):
    """sum over allowed j of a[..., i, j] * b[..., j, d], in IEEE arithmetic; other j contribute 0.

    A dense ``a @ b`` would turn a NaN or inf in b at a disallowed pair into 0 * inf = NaN.
    Instead the finite part of b goes through one matmul, and the non-finite entries of b
    add what plain arithmetic over the allowed pairs gives: NaN, +inf or -inf.
    """
    a = np.where(allowed, a, 0.0)
    finite = np.isfinite(b)
    out = a @ np.where(finite, b, 0.0)
    if finite.all():
        return out
    allowed = allowed.astype(a.dtype)
    positive, negative = (np.where(a > 0, 1.0, 0.0), np.where(a < 0, 1.0, 0.0))
    zero = allowed - positive - negative  # allowed and 0 (or NaN, which is already in ``out``)
    plus_inf, minus_inf, nan = ((b == np.inf) * 1.0, (b == -np.inf) * 1.0, np.isnan(b) * 1.0)
    hits_nan = allowed @ nan + zero @ (plus_inf + minus_inf)
    hits_plus = positive @ plus_inf + negative @ minus_inf
    hits_minus = positive @ minus_inf + negative @ plus_inf
    return out + np.where(hits_plus > 0, np.inf, 0.0) + np.where(hits_minus > 0, -np.inf, 0.0) + np.where(hits_nan > 0, np.nan, 0.0)


def kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None, causal=True,
            window=None, softmax_scale=None, softcap=None, alibi_slopes=None, sinks=None, mask=None,
            cache_dtype=None, k_descale=None, v_descale=None):
    """``flashx.attention_with_kvcache`` as dense attention: (k_cache, v_cache after the append, k, v, options).

    The new tokens are written into copies of the caches (through ``block_table`` when paged);
    sequence b's Lk = cache_seqlens[b] + Nn keys are gathered in order into k, v (B, max Lk, Hk, D),
    zero past Lk. ``options`` (for ``forward``, ``naive``, ``term_magnitudes``, ``empty_rows``) hold
    seqlens_k = Lk and one bool mask that is the tree ``mask`` over each sequence's last Nq keys.
    Queries keep Lq = Nq, so the dense call puts query i at key Lk - Nq + i, as decoding does: its
    ALiBi distance, like its causal band, is decoding's. The score modifications pass through.

    An FP8 cache (``cache_dtype`` one of torch's float8 names; the contract's FP8 section) holds
    FP8 values: the new tokens go in as the float32 quotient by their descale, clamped to the
    format's largest finite value and converted by torch (round to nearest even), and k, v hold
    the values the cache stands for. The clamp is the contract's saturation: torch's own
    conversion saturates only from 2.12 on (pytorch#178817); before, a magnitude that rounds past
    448 became NaN. Clamping first is the same rule, as every magnitude in (448, 464] rounds to 448.
    """
    k_cache, v_cache = np.array(k_cache), np.array(v_cache)
    lengths = np.asarray(cache_seqlens, dtype=np.int64)
    new = 0 if k_new is None else np.shape(k_new)[1]
    batch, seqlen_q, heads_q = np.shape(q)[:3]

    def slots(b, positions):
        if block_table is None:
            return b, positions
        page_size = k_cache.shape[1]
        return np.asarray(block_table)[b, positions // page_size], positions % page_size

    def stored(x, descale, b):  # new tokens (Nn, Hk, D) as the cache holds them
        if cache_dtype is None:
            return x
        import torch

        dtype = getattr(torch, cache_dtype)
        quotient = torch.from_numpy(np.asarray(x, dtype=np.float32))
        if descale is not None:
            quotient = quotient / torch.from_numpy(np.asarray(descale[b], dtype=np.float32))[None, :, None]
        largest = torch.finfo(dtype).max  # clamp keeps NaN
        return quotient.clamp(-largest, largest).to(dtype).double().numpy()

    for b in range(batch if new else 0):
        where = slots(b, lengths[b] + np.arange(new))
        k_cache[where], v_cache[where] = stored(k_new[b], k_descale, b), stored(v_new[b], v_descale, b)
    total = lengths + new
    longest = int(total.max(initial=0))
    k = np.zeros((batch, longest) + k_cache.shape[2:], dtype=k_cache.dtype)
    v = np.zeros((batch, longest) + v_cache.shape[2:], dtype=v_cache.dtype)
    allowed = np.ones((batch, heads_q, seqlen_q, longest), dtype=bool)
    tree = None if mask is None else np.broadcast_to(np.asarray(mask, dtype=bool), (batch, heads_q, seqlen_q, seqlen_q))
    for b in range(batch):
        where = slots(b, np.arange(total[b]))
        k[b, : total[b]], v[b, : total[b]] = k_cache[where], v_cache[where]
        if tree is not None:
            first = total[b] - seqlen_q  # the key the tree mask's column 0 stands for
            columns = np.arange(max(first, 0), total[b])
            allowed[b][:, :, columns] = tree[b][:, :, columns - first]
    if cache_dtype is not None:
        k, v = dequantize(k, k_descale), dequantize(v, v_descale)
    options = dict(seqlens_k=total, causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, mask=allowed)
    return k_cache, v_cache, k, v, options
