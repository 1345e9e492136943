"""Which compiled variant serves a problem, and its build: source, NVRTC options, cache key.

A variant is one kernel file compiled with -D macros (``Variant.macros``): the dtype, the
head-dim classes of Q/K and of V (64, 128, 256: head dims are zero-padded up to their class in
shared memory), the tile shape, and the features the problem uses, so that a plain causal call
carries no mask code. Nothing here imports CuPy; ``module()`` does, on first use.

The files under ``kernels/`` include ``common.cuh``. ``source()`` inlines those includes, so
the text handed to NVRTC is every line the variant is built from. CuPy's on-disk kernel cache
keys a build by that text, the options, the GPU architecture and the NVRTC and CuPy versions;
left to NVRTC's ``-I``, an edit of an included header would reuse a stale binary from that
cache. ``cache_key()`` hashes the same things, for the modules kept in this process.

CuPy adds ``-ftz=true`` to every NVRTC build: float32 denormals in the softmax and the FMA
products flush to zero, an absolute change below 1.2e-38, far inside the contract's float32
floor. Nothing adds ``--use_fast_math``: exp2f and log2f are the only approximate functions,
as in every FlashAttention kernel, and the products use fma without TF32.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
from pathlib import Path

from flashx.problem import head_dim_class

KERNELS = Path(__file__).parent / "kernels"
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)

DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}
ELEMENT_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4}
HEAD_DIM_CLASSES = (64, 128, 256)

#: (kernel, 16-bit or float32, head-dim class) -> (BLOCK_M, BLOCK_N, WARPS). BLOCK_M rows are
#: owned by the warps (16 * WARPS * atoms), BLOCK_N rows stream through shared memory. Sized
#: so that the accumulators fit 255 registers and shared memory the H100's 227 KiB per CTA.
TILES = {
    ("forward", "16", 64): (128, 64, 4),
    ("forward", "16", 128): (128, 64, 4),
    ("forward", "16", 256): (64, 32, 4),
    ("forward", "32", 64): (64, 32, 4),
    ("forward", "32", 128): (64, 32, 4),
    ("forward", "32", 256): (32, 16, 2),
    ("dq", "16", 64): (64, 64, 4),
    ("dq", "16", 128): (64, 64, 4),
    ("dq", "16", 256): (64, 32, 4),
    ("dq", "32", 64): (64, 32, 4),
    ("dq", "32", 128): (64, 32, 4),
    ("dq", "32", 256): (32, 16, 2),
    ("dkdv", "16", 64): (64, 64, 4),
    ("dkdv", "16", 128): (64, 64, 4),
    ("dkdv", "16", 256): (64, 32, 4),
    ("dkdv", "32", 64): (64, 32, 4),
    ("dkdv", "32", 128): (64, 32, 4),
    ("dkdv", "32", 256): (32, 16, 2),
    # The dK/dV kernel that also adds dQ (``fused_dq``): 128 keys a CTA halve the dQ reductions
    # of 64, and timed 11.7 ms against 12.4 on the H100 (bf16, N=8k, d128; dQ not yet one step late).
    ("dkdv_dq", "16", 64): (128, 64, 8),
    ("dkdv_dq", "16", 128): (128, 64, 8),
    # A forward that reads a bool mask byte a pair: 64 query rows a CTA timed 99 TFLOP/s against
    # 80 for 128 on the H100 (bf16, N=8k, d128; mask and dropout 56.5 against 49.5).
    ("forward_mask", "16", 128): (64, 64, 4),
    # The wgmma backward: two warpgroups of 64 keys (dK/dV) or query rows (dQ), 64 of the other
    # a step (the scores and dP beside the sums in registers). At d256 a step takes 32, so that the
    # resident tiles (128 rows of 512 bytes, 128 KiB) leave room for a ring of streamed ones, and
    # dK and dV take a launch each (``dkdv_parts``).
    ("dkdv_sm90", "16", 64): (128, 64, 8),
    ("dkdv_sm90", "16", 128): (128, 64, 8),
    ("dkdv_sm90", "16", 256): (128, 32, 8),
    ("dq_sm90", "16", 64): (128, 64, 8),
    ("dq_sm90", "16", 128): (128, 64, 8),
    ("dq_sm90", "16", 256): (128, 32, 8),
}
#: The 16-bit wgmma forward ("forward_sm90"): (head-dim class, banded, TMA) -> (BLOCK_M, BLOCK_N,
#: WARPS, V buffers), computing warpgroups of 64 query rows and BLOCK_N keys a tile (S's N), FA3's
#: shapes. Banded is ``problem.band is not None`` (causal, window); TMA is ``tma.usable``. Where
#: both head dims are of class 64 and no band, three warpgroups of 64 rows (under a band two: on the
#: H200, bf16, B*N = 16k, H = 32, causal TFLOP/s with three against two, N 8k 350/358, 4k 294/329,
#: 1k 149/205). At d128 without a band, 176 keys a
#: tile, where Q, two K and three V tiles and the first tile's zeros (kernels/forward_sm90.cuh) would
#: exceed 227 KB: V takes two buffers and the zeros lie in one of them, which only TMA's producer
#: serves (its tiles announce themselves); a band keeps 128 keys (fewer masked keys at its edges).
#: At d256 (both head dims of class 256), 80 keys a tile with or without a band, by TMA only: Q (64
#: KB), two K and two V tiles (40 KB each) with the zeros in V's ring take 224 KB; without TMA the
#: problem takes the mma.sync forward (``forward_kernel``). Every other problem takes two warpgroups
#: and 128 keys, as all did before: setting every entry of d64 and d128 to (128, 128, 8, 3) restores that.
FORWARD_SM90_TILES = {
    (64, False, False): (192, 128, 12, 3),
    (64, False, True): (192, 128, 12, 3),
    (64, True, False): (128, 128, 8, 3),
    (64, True, True): (128, 128, 8, 3),
    (128, False, False): (128, 128, 8, 3),
    (128, False, True): (128, 176, 8, 2),
    (128, True, False): (128, 128, 8, 3),
    (128, True, True): (128, 128, 8, 3),
    (256, False, True): (128, 80, 8, 2),
    (256, True, True): (128, 80, 8, 2),
}
#: Problems of at most SHORT_KEYS keys (seqlen_k: a CTA's loop over key tiles) take SHORT_TILE at
#: head dims up to 128, whatever the table says: where a CTA's loop is a few tiles long, two
#: warpgroups and 128 keys beat the larger tiles. On the H200 (bf16, B*N = 16k, H*D = 2048, fwd
#: TFLOP/s, the table's tile against SHORT_TILE): d64 without a band N 512 216/257, 1k 286/322, 2k
#: 354/351, 4k 388/370; d128 without a band (176 keys) 512 291/376, 1k 413/469, 2k 495/517, 4k
#: 581/532.
SHORT_KEYS = 2048
SHORT_TILE = (128, 128, 8, 3)
#: The wgmma forward on float8_e4m3fn inputs: (head-dim class, banded) -> (BLOCK_M, BLOCK_N, WARPS).
#: At d64 without a band, three warpgroups of 64 rows timed 462-471 TFLOP/s against 416-424 for two
#: on the H200 (B=2, N=8k, H=32), and with a band 348-352 against 358-359; at d128 three warpgroups
#: spill. At d128 a tile of 192 keys cuts the fixed costs a key of a tile by a third: 703-711
#: TFLOP/s against 680 (B=2, N=8k, H=16), causal 574 against 562; 224 keys timed 710-712 and
#: 560-569. A bool mask keeps 128 keys (FP8_MASKED_KEYS): at 192 its pair tests spill 352 B.
FORWARD_FP8_TILES = {
    (64, False): (192, 128, 12),
    (64, True): (128, 128, 8),
    (128, False): (128, 192, 8),
    (128, True): (128, 192, 8),
}
FP8_MASKED_KEYS = 128
#: The 16-bit wgmma forward under a bool mask, or a block mask with dropout, by head-dim class: keys
#: a tile of two warpgroups. At d128 the pair tests spill beside S of 128 keys (a bool mask 92 B, with
#: dropout 192 B; a block mask with dropout 212 B), 0-24 B beside 64.
SM90_MASKED_KEYS = {64: 128, 128: 64}
#: Decoding (``kernels/decode.cu``): (cache element width "16", "32", or "8" for an FP8 cache under
#: 16-bit queries; head-dim class) -> (BLOCK_N, WARPS, STAGES): BLOCK_N keys a tile, WARPS warps
#: taking 16 of them each, STAGES tiles in flight. The rows a CTA holds (BLOCK_M) follow the problem
#: (``decode_block_m``). Sized so that a 16-bit CTA of 16 rows and head dims up to 128 leaves room
#: for two per H100 SM (two tiles in flight each). An FP8 cache keeps the 16-bit tiles, so that a
#: thread's copies stay 16 bytes (now 16 values) and its products the same, and spends the shared
#: memory its bytes save (its stages are half as large, beside one widened 16-bit tile) on a stage
#: more: as many bytes in flight per SM as the 16-bit cache has at d64 and d256, three quarters
#: at d128, where a fifth stage would leave one CTA per SM.
DECODE_TILES = {
    ("16", 64): (64, 4, 3),
    ("16", 128): (64, 4, 3),
    ("16", 256): (64, 4, 2),
    ("32", 64): (64, 4, 3),
    ("32", 128): (64, 4, 2),
    ("32", 256): (32, 2, 2),
    ("8", 64): (64, 4, 4),
    ("8", 128): (64, 4, 4),
    ("8", 256): (64, 4, 3),
}
#: BLOCK_M x the wider head-dim class of a decoding CTA: every warp holds the output rows of all
#: of the CTA's rows (BLOCK_M * DIM_V / 32 float32 registers a thread).
DECODE_ROW_ELEMENTS = 4096
#: The most rows of a decoding CTA over an FP8 cache. A 64-row CTA (d64) sits at 255 registers with
#: a 16-bit cache; the FP8 tile's widening in the loop makes ptxas spill it (4 to 92 bytes with
#: ALiBi, a mask or unaligned operands: flashx_cupy.resources). A group of more rows takes two CTAs,
#: each reading the (byte-wide) cache.
DECODE_FP8_ROWS = 32
DECODE_KERNELS = ("decode", "decode_merge", "decode_append")
#: Set to "0", decoding loads K and V by cp.async where it would take bulk copies (``decode_bulk``).
DECODE_BULK_ENV = "FLASHX_CUPY_DECODE_BULK"
BULK_ROW_BYTES = 256  # the shortest cache row decoding copies in bulk (``decode_bulk``)
FILES = {"forward": "forward.cu", "forward_sm90": "forward_sm90.cu", "forward_fp8_sm90": "forward_fp8_sm90.cu",
         "dq": "dq.cu", "dkdv": "dkdv.cu", "dkdv_sm90": "dkdv_sm90.cu", "dq_sm90": "dq_sm90.cu", "delta": "dq.cu",
         "dq_round": "dq.cu",
         **{kernel: "decode.cu" for kernel in DECODE_KERNELS}}
ENTRY_POINTS = {"forward": "flashx_forward", "forward_sm90": "flashx_forward_sm90",
                "forward_fp8_sm90": "flashx_forward_fp8_sm90", "dq": "flashx_dq", "dkdv": "flashx_dkdv",
                "dkdv_sm90": "flashx_dkdv_sm90", "dq_sm90": "flashx_dq_sm90", "delta": "flashx_delta",
                "dq_round": "flashx_dq_round",
                "decode": "flashx_decode", "decode_merge": "flashx_decode_merge", "decode_append": "flashx_decode_append"}
#: Kernels built for one architecture: wgmma exists only in sm_90a code. CuPy appends its own
#: ``-arch=sm_XX`` after these options; NVRTC keeps the architecture-specific target.
ARCHITECTURES = {"forward_sm90": "sm_90a", "forward_fp8_sm90": "sm_90a", "dq_sm90": "sm_90a", "dkdv_sm90": "sm_90a"}
#: Set to "0", the backward keeps flashx_dq and flashx_dkdv (mma.sync, with the fused dQ where
#: ``fused_dq`` says) where it would take the wgmma kernels: the switch that compares the two on
#: one GPU.
SM90_BACKWARD_ENV = "FLASHX_CUPY_SM90_BACKWARD"
#: The warps of the wgmma forwards and backward kernels beside their WARPS: one warpgroup that only
#: copies (``PRODUCER_THREADS`` in forward_sm90.cu, forward_fp8_sm90.cu, dkdv_sm90.cu and dq_sm90.cu).
PRODUCER_WARPS = 4
PRODUCER_KERNELS = ("forward_sm90", "forward_fp8_sm90", "dkdv_sm90", "dq_sm90")
#: The wgmma forwards, whose row max is over the dot products unless ``negative_scale`` (forward.cuh).
SM90_FORWARDS = ("forward_sm90", "forward_fp8_sm90")
SM90_BACKWARDS = ("dkdv_sm90", "dq_sm90")
#: The buffers of the wgmma backward's rings, the streamed tiles in flight (``RING_STAGES`` in
#: kernels/ring.cuh), unless fewer must fit shared memory (``Variant.ring_stages``).
RING_STAGES = 3
#: Shared memory a CTA may take on compute capability 9.0.
SM90_SHARED_BYTES = 227 * 1024
#: The kernels that live in the dQ kernel's module (same macros, one build) beside it, by
#: threads alone: delta and the fused backward's rounding of its dQ sums; DELTA_WARPS warps a CTA.
DQ_MODULE_EXTRAS = ("delta", "dq_round")
DELTA_WARPS = 8


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel specialised for a problem's dtype, head dims, tiles and features."""

    kernel: str  # "forward" | "forward_sm90" | "forward_fp8_sm90" | "dq" | "dkdv" | "dq_sm90" | "dkdv_sm90" | one of DQ_MODULE_EXTRAS or DECODE_KERNELS
    dtype: str  # the data's; "forward_fp8_sm90": o's (out_dtype), its inputs being float8_e4m3fn
    dim_qk: int  # head-dim classes
    dim_v: int
    block_m: int
    block_n: int
    warps: int
    varlen: bool = False
    seqlens_q: bool = False
    seqlens_k: bool = False
    mask: bool = False
    block_mask: bool = False
    dropout: bool = False
    softcap: bool = False  # the score modifications (kernels/score_mods.cuh)
    alibi: bool = False
    sinks: bool = False
    aligned: bool = True
    dkdv_parts: int = 3  # dK/dV kernel: bit 0 dK, bit 1 dV
    dq_atomic: bool = False  # dK/dV kernel: also adds dQ to float32 sums (see ``fused_dq``)
    stages: int = 0  # decoding: key tiles in flight
    paged: bool = False  # decoding: the cache is paged (block_table)
    fp8_cache: bool = False  # decoding: the cache is float8_e4m3fn (kernels/fp8.cuh), ``dtype`` the queries'
    decode_bulk: bool = False  # decoding: K and V rows by bulk copies on mbarriers, not cp.async (``decode_bulk``)
    tma: bool = False  # forward_sm90: K and V tiles by TMA, from Params' tensor maps (flashx_cupy.tma)
    v_buffers: int = 3  # forward_sm90: V's ring; with 2 the first tile's zeros lie in it (FORWARD_SM90_TILES)
    negative_scale: bool = False  # SM90_FORWARDS: softmax_scale < 0, whose row max is that of the scaled scores

    @property
    def threads(self) -> int:
        producer = PRODUCER_WARPS if self.kernel in PRODUCER_KERNELS else 0
        return 32 * (DELTA_WARPS if self.kernel in DQ_MODULE_EXTRAS else self.warps + producer)

    @property
    def entry_point(self) -> str:
        return ENTRY_POINTS[self.kernel]

    @property
    def macros(self) -> dict[str, int]:
        return {
            "DTYPE": DTYPE_CODES[self.dtype],
            "DIM_QK": self.dim_qk,
            "DIM_V": self.dim_v,
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "WARPS": self.warps,
            "VARLEN": int(self.varlen),
            "SEQLENS_Q": int(self.seqlens_q),
            "SEQLENS_K": int(self.seqlens_k),
            "MASK": int(self.mask),
            "BLOCK_MASK": int(self.block_mask),
            "DROPOUT": int(self.dropout),
            "SOFTCAP": int(self.softcap),
            "ALIBI": int(self.alibi),
            "SINKS": int(self.sinks),
            "ALIGNED": int(self.aligned),
            "DKDV_PARTS": self.dkdv_parts,
            "DQ_ATOMIC": int(self.dq_atomic),
            **({"STAGES": self.stages, "PAGED": int(self.paged), "FP8_CACHE": int(self.fp8_cache),
                "BULK": int(self.decode_bulk)} if self.kernel in DECODE_KERNELS else {}),
            **({"TMA": int(self.tma), "V_BUFFERS": self.v_buffers} if self.kernel == "forward_sm90" else {}),
            **({"NEGATIVE_SCALE": int(self.negative_scale)} if self.kernel in SM90_FORWARDS else {}),
            **({"RING_STAGES": self.ring_stages} if self.kernel in SM90_BACKWARDS else {}),
        }

    def sm90_backward_shared_memory(self, stages: int) -> int:
        """The wgmma backward kernels' carve with a ring of ``stages``: swizzled, unpadded, the
        resident tiles (K and V, or Q and dO), the ring's streamed ones, the fused dQ's two dS^T tiles
        and each warpgroup's float32 staging of its 64 columns of dQ, then dK/dV's LSE and D a stage
        or dQ's allowed pairs of a tile; each stage's two barriers, item and cover (ring.cuh)."""
        size = ELEMENT_SIZES[self.dtype]
        extra = stages * 2 * self.block_n * 4 if self.kernel == "dkdv_sm90" else self.block_m * self.block_n
        fused = (2 * self.block_m * self.block_n * size + self.warps // 4 * self.block_n * 64 * 4
                 if self.dq_atomic else 0)
        return (size * (self.block_m + stages * self.block_n) * (self.dim_qk + self.dim_v) + fused + extra
                + stages * (2 * 8 + 2 * 4))

    @property
    def ring_stages(self) -> int:
        """The wgmma backward's ring: RING_STAGES, or two where three would pass SM90_SHARED_BYTES
        (dQ's kernel at d256)."""
        return RING_STAGES if self.sm90_backward_shared_memory(RING_STAGES) <= SM90_SHARED_BYTES else 2

    @property
    def options(self) -> tuple[str, ...]:
        arch = ARCHITECTURES.get(self.kernel)
        return ("--std=c++17", *((f"--gpu-architecture={arch}",) if arch else ()),
                *(f"-D{name}={value}" for name, value in self.macros.items()))

    @property
    def shared_memory(self) -> int:
        """Dynamic shared memory of one CTA in bytes: the carving at the top of each kernel."""
        if self.kernel in (*DQ_MODULE_EXTRAS, "decode_merge", "decode_append"):
            return 0
        size = ELEMENT_SIZES[self.dtype]
        if self.kernel == "decode":
            # Q, K/V tiles and stages, two tiles' (page, slot), the stages' barriers (reserved with or
            # without bulk copies, so that both load paths hold as many CTAs an SM and take as many
            # splits), the float32 products' staging
            pad = 16 // size
            tiles = 1 if self.fp8_cache else self.stages  # an FP8 cache's stages are bytes, widened into one tile
            keys = tiles * self.block_n * (self.dim_qk + self.dim_v + 2 * pad) * size
            fp8_stages = self.stages * self.block_n * (self.dim_qk + self.dim_v) if self.fp8_cache else 0
            pages = 2 * self.block_n * 8 if self.paged else 0
            barriers = 8 * self.stages
            stage = self.block_m * self.block_n * 4 if self.dtype == "float32" else 0
            return self.block_m * (self.dim_qk + pad) * size + keys + fp8_stages + pages + barriers + stage
        if self.kernel == "forward_sm90":  # swizzled, unpadded: Q, two K tiles, the V tiles, zeros past two of them; barriers
            v_tiles = self.v_buffers + (self.v_buffers != 2)
            return size * (self.block_m * self.dim_qk + self.block_n * (2 * self.dim_qk + v_tiles * self.dim_v)) + 128
        if self.kernel == "forward_fp8_sm90":  # bytes: Q and two K tiles of 128-byte rows, three V^T tiles, zeros; barriers
            vt_keys = -(-self.block_n // 128) * 128  # V^T's rows: whole panels of 128 keys
            return 128 * (self.block_m + 2 * self.block_n) + 4 * self.dim_v * vt_keys + 128
        if self.kernel in SM90_BACKWARDS:
            return self.sm90_backward_shared_memory(self.ring_stages)
        pad = 16 // size
        ld_qk, ld_v = self.dim_qk + pad, self.dim_v + pad
        m, n = self.block_m, self.block_n
        streamed = 2 * n * (ld_qk + ld_v) * size
        resident = m * ld_qk * size if self.kernel == "forward" else m * (ld_qk + ld_v) * size
        row_stats = 4 * n * 4 if self.kernel == "dkdv" else 0
        pairs = m * n if self.kernel == "dq" else 0  # the dQ kernel's record of the allowed pairs of a tile
        stage = 4 * m * n if self.dtype == "float32" else 0
        scores = 2 * m * (n + pad) * size if self.dq_atomic else 0  # dS^T, the fused dQ's operand, two steps
        return resident + streamed + row_stats + pairs + stage + scores


def choose(kernel: str, problem, aligned: bool, dkdv_parts: int = 3, dq_atomic: bool = False,
           tma: bool = False) -> Variant:
    """The variant of ``kernel`` for ``problem``; ``tma``: forward_sm90 loads K and V by TMA
    (``flashx_cupy.tma.usable``)."""
    dim_qk, dim_v = head_dim_class(problem.head_dim), head_dim_class(problem.head_dim_v)
    width = "8" if problem.fp8 else "32" if problem.dtype == "float32" else "16"
    table = "dq" if kernel in DQ_MODULE_EXTRAS else "dkdv_dq" if dq_atomic and kernel == "dkdv" else kernel
    if kernel == "forward" and problem.mask is not None and ("forward_mask", width, max(dim_qk, dim_v)) in TILES:
        table = "forward_mask"
    v_buffers = 3
    if kernel == "forward_sm90":
        block_m, block_n, warps, v_buffers = FORWARD_SM90_TILES[max(dim_qk, dim_v), problem.band is not None, tma]
        if problem.seqlen_k <= SHORT_KEYS and max(dim_qk, dim_v) <= 128:
            block_m, block_n, warps, v_buffers = SHORT_TILE
        if problem.dropout_p > 0 or problem.mask is not None or problem.block_mask is not None:
            # Philox's registers, or a mask's tests, spill beside S of 176 keys or in a third warpgroup
            block_m, block_n, warps, v_buffers = 128, 128, 8, 3
        if problem.mask is not None or (problem.block_mask is not None and problem.dropout_p > 0):
            block_n = SM90_MASKED_KEYS[max(dim_qk, dim_v)]
    elif kernel == "forward_fp8_sm90":
        block_m, block_n, warps = FORWARD_FP8_TILES[max(dim_qk, dim_v), problem.band is not None]
        if problem.mask is not None:
            block_n = min(block_n, FP8_MASKED_KEYS)
        if problem.block_mask is not None:  # its tile votes spill in a third warpgroup or beside 192 keys
            block_m, block_n, warps = 128, FP8_MASKED_KEYS, 8
    else:
        block_m, block_n, warps = TILES[table, width, max(dim_qk, dim_v)]
    return Variant(
        kernel=kernel,
        dtype=problem.out_dtype,  # the inputs' but for FP8 inputs
        dim_qk=dim_qk,
        dim_v=dim_v,
        block_m=block_m,
        block_n=block_n,
        warps=warps,
        varlen=problem.varlen,
        seqlens_q=problem.seqlens_q is not None,
        seqlens_k=problem.seqlens_k is not None,
        mask=problem.mask is not None,
        block_mask=problem.block_mask is not None,
        dropout=problem.dropout_p > 0,
        softcap=problem.softcap is not None,
        alibi=problem.alibi_slopes is not None,
        # dK, dV and (where no delta kernel shares the build) dQ see the sink only through the LSE
        sinks=problem.sinks is not None and kernel not in ("dkdv", "dkdv_sm90", "dq_sm90"),
        aligned=aligned,
        dkdv_parts=dkdv_parts,
        dq_atomic=dq_atomic,
        tma=tma,
        v_buffers=v_buffers,
        negative_scale=kernel in SM90_FORWARDS and problem.softmax_scale < 0,
    )


def choose_decode(kernel: str, problem, aligned: bool, bulk: bool = False) -> Variant:
    """The variant of decoding kernel ``kernel`` (one of DECODE_KERNELS) for the DecodeProblem
    ``problem``, its K and V by bulk copies where ``bulk`` (``decode_bulk``); the three of one
    problem have one set of macros, so one build."""
    dim_qk, dim_v = head_dim_class(problem.head_dim), head_dim_class(problem.head_dim_v)
    widest = max(dim_qk, dim_v)
    width = "8" if problem.fp8 else "32" if problem.dtype == "float32" else "16"
    block_n, warps, stages = DECODE_TILES[width, widest]
    return Variant(
        kernel=kernel,
        dtype=problem.dtype,
        dim_qk=dim_qk,
        dim_v=dim_v,
        block_m=decode_block_m(problem.seqlen_q * problem.group, widest, problem.fp8),
        block_n=block_n,
        warps=warps,
        mask=problem.mask is not None,
        softcap=problem.softcap is not None,
        alibi=problem.alibi_slopes is not None,
        sinks=problem.sinks is not None,
        aligned=aligned,
        stages=stages,
        paged=problem.paged,
        fp8_cache=problem.fp8,
        decode_bulk=bulk,
    )


def decode_bulk(aligned: bool, compute_capability: str, row_bytes: int) -> bool:
    """Whether the decoding kernel loads its K and V tiles by 1-D bulk copies completing on
    mbarriers (one per cache row; sm_90's copy engine) rather than by each thread's 16-byte
    cp.async: on compute capability 9.0 (CuPy's "90" form), for ``aligned`` operands (a row's
    copy is 16-byte aligned and a whole number of 16 bytes) whose K rows hold at least
    ``BULK_ROW_BYTES`` bytes, unless the environment sets ``DECODE_BULK_ENV`` to "0", the switch
    that compares the two on one GPU. Either way the kernel computes on the same tiles, so the
    outputs agree bit for bit. Shorter rows take as many instructions a tile by bulk copies as by
    cp.async, and an FP8 cache's rows of 128 bytes ran slower by bulk copies (H200: 212 us
    against 164 at B=16, L=8k; benchmarks/results/decode-h200.md)."""
    return (compute_capability == "90" and aligned and row_bytes >= BULK_ROW_BYTES
            and os.environ.get(DECODE_BULK_ENV, "1") != "0")


def decode_block_m(rows: int, widest: int, fp8_cache: bool = False) -> int:
    """The rows of a decoding CTA for a GQA group of ``rows`` query rows (Nq x group): 16, 32 or
    64, the fewest that hold them, at most ``decode_rows_most`` (more take several CTAs)."""
    wanted = 16
    while wanted < rows:
        wanted *= 2
    return min(wanted, decode_rows_most(widest, fp8_cache))


def decode_rows_most(widest: int, fp8_cache: bool) -> int:
    """The most rows of a decoding CTA: DECODE_ROW_ELEMENTS / widest, and DECODE_FP8_ROWS over an
    FP8 cache."""
    most = DECODE_ROW_ELEMENTS // widest
    return min(most, DECODE_FP8_ROWS) if fp8_cache else most


def forward_kernel(problem, aligned: bool, compute_capability: str, tma: bool = False) -> str:
    """The forward kernel for ``problem`` on a GPU of ``compute_capability`` (CuPy's "90" form);
    ``tma``: K and V can come by TMA (``flashx_cupy.tma.usable``).

    "forward_sm90" (wgmma, sm_90a code) runs on compute capability 9.0 for 16-bit problems whose
    operands are all ``aligned``, with head dims up to 128 or both of class 256 by ``tma`` (the
    two V buffers of its d256 tiles need TMA's producer, FORWARD_SM90_TILES); it takes a band
    (causal, window), seqlens, varlen (which takes no TMA), the score modifications, dropout, a bool
    mask and a block mask (its softmax, schedule and epilogue are forward.cuh's), the last three at
    head dims up to 128 (at d256 Philox's registers or the pair tests spill beside O's 128 floats a
    thread).
    "forward" (mma.sync) serves every other problem, and every GPU. FP8 problems take
    "forward_fp8_sm90" (``fp8_forward_reasons`` says where it cannot).
    """
    if problem.fp8:
        return "forward_fp8_sm90"
    dims = head_dim_class(problem.head_dim), head_dim_class(problem.head_dim_v)
    plain = problem.dropout_p == 0 and problem.mask is None and problem.block_mask is None
    tiled = max(dims) <= 128 or (dims == (256, 256) and tma and plain)
    if compute_capability == "90" and problem.dtype != "float32" and aligned and tiled:
        return "forward_sm90"
    return "forward"


def fp8_forward_reasons(problem, compute_capability: int | None) -> list[str]:
    """Why "forward_fp8_sm90" cannot take the float8_e4m3fn problem ``problem`` on a GPU of
    ``compute_capability`` (90 for 9.0; None where CuPy cannot tell), or nothing. Its e4m3
    products are sm_90a code; it copies Q and K in 16-byte chunks. There is no other FP8 forward here."""
    reasons = []
    if compute_capability is not None and compute_capability != 90:
        reasons.append(f"runs FP8 attention on compute capability 9.0 only (wgmma's e4m3 products), "
                       f"not {compute_capability // 10}.{compute_capability % 10}")
    widest = max(problem.head_dim, problem.head_dim_v)
    if widest > 128:
        reasons.append(f"takes FP8 head dims up to 128, not {widest}")
    if problem.head_dim % 16 or problem.head_dim_v % 16:
        reasons.append(f"takes FP8 head dims that are multiples of 16 (16-byte copies), not "
                       f"{problem.head_dim}/{problem.head_dim_v}")
    return reasons


def sm90_backward(problem, aligned: bool, compute_capability: str) -> bool:
    """Whether the backward takes the wgmma kernels (sm_90a code) for ``problem`` on a GPU of
    ``compute_capability`` (CuPy's "90" form): flashx_dkdv_sm90 adding dQ where ``fused_dq`` holds,
    else flashx_dq_sm90 and flashx_dkdv_sm90, which add no atomics and so serve deterministic calls.

    They run on compute capability 9.0 for 16-bit problems whose operands are all ``aligned``, at
    every head dim (d256 in steps of 32 rows, dK and dV in a launch each: TILES), and take every
    feature of the pair rule, dropout and the score modifications (dq.cuh's and dkdv.cuh's, shared
    with the mma.sync kernels). flashx_dq and flashx_dkdv (mma.sync) serve every other problem,
    every GPU, and all problems where the environment sets ``SM90_BACKWARD_ENV`` to "0".
    """
    return (compute_capability == "90" and problem.dtype != "float32" and aligned
            and os.environ.get(SM90_BACKWARD_ENV, "1") != "0")


def fused_dq(problem, sm90: bool, whole_sums: bool) -> bool:
    """Whether the backward adds dQ in the dK/dV kernel (five products, not seven; flashx_dkdv or,
    where ``sm90``, flashx_dkdv_sm90), by float32 reductions whose order varies from run to run: on
    tensor cores, where one dK/dV launch holds both accumulators, unless the call asks for a
    deterministic backward.

    Under a band (causal, window) only the wgmma kernel, and only with the sums of every kv head in
    one launch (``whole_sums``, launch.DQ_SUMS_WHOLE_BYTES): on the H200 it then ran causal steps
    1.05-1.17x faster than the split kernels, and in launches of 32 MiB of sums 0.58-1.06x. The
    mma.sync split kernels were faster under a band on the H100 (6.8 ms against 7.7 for the fused
    kernel, bf16, N=8k, d128, causal)."""
    dims = head_dim_class(problem.head_dim), head_dim_class(problem.head_dim_v)
    return (not problem.deterministic and (problem.band is None or (sm90 and whole_sums))
            and problem.dtype != "float32" and dkdv_parts(*dims) == (3,))


#: The forward takes a sequence's heads innermost (``heads_inner``) while its grid holds at most this
#: many CTAs an SM: with more, its tail is short beside the whole, and a head at a time keeps the
#: running CTAs' K and V in L2.
FORWARD_INNER_CTAS_PER_SM = 8
BACKWARD_KERNELS = ("dq", "dkdv", *SM90_BACKWARDS)


def heads_inner(problem, kernel: str, ctas: int, sm_count: int) -> bool:
    """Whether ``kernel``'s grid of ``ctas`` CTAs on a GPU of ``sm_count`` SMs takes the heaviest tile
    of each head of a sequence first (kernels/scheduling.cuh), rather than a head at a time: under a
    causal band (the left side unbounded), where a tile's work grows across the sequence, in the
    backward's kernels, and in the forward where its grid is short (FORWARD_INNER_CTAS_PER_SM).

    On the H200 (bf16, TFLOP/s, heads innermost against a head at a time, same process): fwd+bwd
    causal d128 B=2 N=8k 412 against 400, d64 278 against 272, GQA 32/8 B=4 N=4k 388-395 against
    357, d256 B=2 N=4k H=8 267 against 221; the forward at d256 of that shape 552-557 against 488
    (512 CTAs), at d128 N=8k even (2048), at B=1 N=32k 539-542 against 560 (4096). Without a band,
    heads innermost ran 3% slower fwd+bwd and 6% slower forward at d128 N=8k."""
    return problem.triangular_band and (kernel in BACKWARD_KERNELS or ctas <= FORWARD_INNER_CTAS_PER_SM * sm_count)


def dkdv_parts(dim_qk: int, dim_v: int) -> tuple[int, ...]:
    """The dK/dV launches: one for both, or dK and dV apart where two 256-wide accumulators
    would not fit the registers."""
    return (1, 2) if max(dim_qk, dim_v) > 128 else (3,)


def source(name: str, kernels: Path = KERNELS) -> str:
    """The text of kernel file ``name`` with its quoted includes inlined (each file once)."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        text = (kernels / file).read_text()
        return _INCLUDE.sub(lambda match: expand(match.group(1)), text)

    return expand(name)


def cache_key(text: str, options: tuple[str, ...], versions: tuple) -> str:
    """sha256 of what a build depends on: the full source, the options and the compiler versions."""
    digest = hashlib.sha256()
    for part in (text, "\0".join(options), repr(versions)):
        digest.update(part.encode())
        digest.update(b"\1")
    return digest.hexdigest()


def versions(device) -> tuple:
    """CuPy's and NVRTC's versions and the device's compute capability."""
    import cupy

    return cupy.__version__, cupy.cuda.nvrtc.getVersion(), device.compute_capability


_modules: dict[str, object] = {}
_kernels: dict[tuple[Variant, int], object] = {}


def kernel(variant: Variant, device):
    """The compiled kernel of ``variant`` for ``device`` (a cupy.cuda.Device), built once a process.

    The lookup is by variant: reading and hashing the source costs a few hundred microseconds, more
    than a launch. Variants whose text and options agree (the delta and dQ kernels) share a module.
    """
    found = _kernels.get((variant, device.id))
    if found is None:
        import cupy

        text = source(FILES[variant.kernel])
        key = cache_key(text, variant.options, versions(device))
        module = _modules.get(key)
        if module is None:
            module = _modules[key] = cupy.RawModule(code=text, options=variant.options)
        found = module.get_function(variant.entry_point)
        if variant.shared_memory > 48 * 1024:
            found.max_dynamic_shared_size_bytes = variant.shared_memory
        _kernels[variant, device.id] = found
    return found


@functools.cache
def shared_memory_limit(device_id: int) -> int:
    import cupy

    return cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]
