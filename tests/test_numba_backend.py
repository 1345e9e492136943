"""The Numba backend on the CPU, in numba-cuda's simulator: its declarations, its Philox device
function and bfloat16 rounding, and its kernels on problems that cross several tiles.

numba chooses the simulator when it is first imported: this module sets NUMBA_ENABLE_CUDASIM
for that import only (no other test module imports numba), so the rest of the run sees the
environment it had. The conformance suite grades the whole contract; the problems here are the
few whose parts it does not isolate, kept tiny (the simulator runs every CUDA thread as a
Python thread).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba_cuda", reason="the Numba backend needs numba-cuda (pip install 'flashx-attention[numba]')")

_environment = os.environ.get("NUMBA_ENABLE_CUDASIM")
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
try:
    from numba.cuda.core import config
finally:
    if _environment is None:
        del os.environ["NUMBA_ENABLE_CUDASIM"]
    else:
        os.environ["NUMBA_ENABLE_CUDASIM"] = _environment

from flashx_conformance import oracle, philox  # noqa: E402

import flashx  # noqa: E402
import flashx_numba  # noqa: E402

if not config.ENABLE_CUDASIM:  # numba came in before this module: its kernels would need a GPU
    pytest.skip("numba was imported before NUMBA_ENABLE_CUDASIM=1 was set", allow_module_level=True)

from flashx_numba import attention, disk_cache, fragments, mma  # noqa: E402
from flashx_numba.philox import dropout_word  # noqa: E402
from flashx_numba.primitives import bits_to_float, float_to_bits  # noqa: E402


def test_declarations():
    backend = flashx.registry.get("numba")
    assert isinstance(backend, flashx_numba.NumbaBackend)
    assert backend.array_kind == "torch" and backend.devices == {"cuda", "cpu"}
    assert backend.features == {"causal", "window", "mask", "block_mask", "seqlens", "varlen", "dropout",
                                "dropout_offsets", "gqa", "dv_ne_d", "softcap", "alibi", "sinks"}
    assert backend.operations == {"attention", "decode"}
    assert backend.available() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_the_simulator_it_needs_a_gpu():
    assert "no CUDA device" in flashx_numba._unavailable(simulating=False)


def _gpu_micro_tiles():
    for kind, classes in attention.GPU_TILES.items():
        for width, (rows, cols, row_groups, lanes) in classes.items():
            yield kind, width, fragments.micro_tile_form(rows, cols, row_groups, lanes, width, False)


def test_tiles_fit_shared_memory_on_a_gpu():
    """float32 tiles within the 48 KiB a block holds statically, for every kernel and head-dim class."""
    def size(shape):
        return 4 * shape[0] * shape[1]

    for kind, width, form in _gpu_micro_tiles():
        if kind == "forward":  # Q, K, V, P
            total = size(form.q_shape) + size(form.k_shape) + size(form.v_shape) + size(form.p_shape)
        else:  # dK/dV: K, V, Q, dO, P^T, dS^T (dQ: Q, dO, K, V, dS)
            total = 4 * size(form.k_shape) + 2 * size(form.p_shape)
        assert total <= 48 * 1024, (kind, width)
        assert form.threads % 32 == 0
    for width, (rows, cols) in attention.TENSOR_CORE_TILES["forward"].items():  # packed words (fragments)
        assert 4 * 2 * cols * (max(width // 2, cols) + 4) <= 48 * 1024, width  # K, V
    for width, (rows, cols) in attention.TENSOR_CORE_TILES["backward"].items():
        # dK/dV: K, V, Q, dO and the exact products' scratch, rows of pairs
        assert rows <= cols and 4 * 5 * cols * (max(width // 2, cols) + 4) <= 48 * 1024, width


def _gpu_decode_shapes():
    from flashx_numba import decode

    for width in (64, 128, 256):
        for rows in decode.ROW_CHOICES:
            yield decode.Shape(rows, width // decode.FEATURES, decode.KEYS_HELD, decode.SPLIT_THREADS, width)


def test_decode_split_shapes_on_a_gpu():
    """The decoding split kernel's GPU shapes: a key's lanes in one warp, each lane one 16-byte run
    of a 16-bit key (two of a float32 one), whole warps, a key tile no longer than a block's
    threads, and the groups' states joined in the 48 KiB a block holds statically."""
    from flashx_numba import decode

    for shape in _gpu_decode_shapes():
        assert 32 % shape.key_lanes == 0 and shape.threads % 32 == 0 and shape.features == decode.FEATURES
        assert shape.features * shape.key_lanes == shape.width and shape.cols <= shape.threads
        assert 4 * shape.groups * shape.rows * (shape.width + 2) <= 48 * 1024, shape


def test_gpu_micro_tiles_hold_each_element_once():
    """The GPU tiles' thread layouts: every score element held by one thread, every feature by
    one thread of each row's group, a row's lanes in one warp, row tiles' rows 16 bytes past a
    multiple of 128 (16-byte reads of eight adjacent rows meet distinct banks), and P's rows of
    a warp's row groups read at one offset in distinct banks."""
    for kind, width, form in _gpu_micro_tiles():
        rows, cols = form.q_shape[0], form.k_shape[0]
        held = [(form.row_of(tid, i), form.col_of(tid, c)) for tid in range(form.threads)
                for i in range(form.held_rows) for c in range(form.held_cols)]
        assert sorted(held) == [(r, c) for r in range(rows) for c in range(cols)], (kind, width)
        for tid in range(0, form.threads, form.row_lanes):
            lanes = range(tid, tid + form.row_lanes)
            assert len({lane // 32 for lane in lanes}) == 1 and len({form.row_of(lane, 0) for lane in lanes}) == 1
            features = sorted(form.feature_of(lane, a) for lane in lanes for a in range(form.held_features))
            assert features == list(range(width)), (kind, width)
        for shape in (form.q_shape, form.k_shape):
            assert 4 * shape[1] % 128 == 16, (kind, width, shape)
        p_words = form.p_shape[1]
        assert p_words % 4 == 0 and len({g * p_words % 32 for g in range(32 // form.row_lanes)}) == 32 // form.row_lanes


# ---------------------------------------------------------------- Philox and bfloat16


RANDOM123 = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, words", RANDOM123)
def test_dropout_word_gives_the_known_answers(counter, key, words):
    c0, c1, c2, c3 = counter
    for w in range(4):  # word w of the call at key column 4 * c0 + w
        assert dropout_word(c1, 4 * c0 + w, c2, c3, *key) == words[w]


def test_dropout_word_matches_the_suites_philox():
    rng = np.random.default_rng(7)
    for _ in range(200):
        i, j, stream, offset, seed = (int(x) for x in rng.integers(0, 2**32 - 1, size=5, dtype=np.uint64))
        seed |= int(rng.integers(0, 2**32 - 1)) << 32
        key = (seed & 0xFFFFFFFF, seed >> 32)
        expected = philox.philox4x32((j // 4, i, stream, offset), key)[j % 4]
        assert dropout_word(i, j, stream, offset, *key) == expected


def test_bfloat16_rounding_matches_torch():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(3000) * 10.0 ** rng.integers(-42, 39, 3000)).astype(np.float32)
    ties = np.array([1.00390625, 1.01171875, -1.00390625, 3.3895314e38, 3.4e38, 1e-40, 0.0, -0.0, math.inf, -math.inf],
                    np.float32)  # halfway cases, the largest bfloat16 and past it, a denormal, zeros, infinities
    x = np.concatenate([x, ties])
    ours = np.array([float_to_bits(value) for value in x], np.int16)
    assert np.array_equal(ours, torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy())
    assert np.array_equal([bits_to_float(b) for b in ours], torch.from_numpy(ours).view(torch.bfloat16).float().numpy())
    assert math.isnan(bits_to_float(float_to_bits(np.float32(math.nan))))


# ---------------------------------------------------------------- kernels, tile by tile


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """torch.empty hands out NaN: an output element the kernels never write shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(math.nan) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)


def _check(dtype, tolerance, q, k, v, do, **options):
    o, res = flashx.attention_forward(q, k, v, backend="numba", **options)
    grads = flashx.attention_backward(do, q, k, v, o, res, backend="numba", **options)
    wide = [x.double().numpy() for x in (do, q, k, v)]
    options = {name: x.numpy() if isinstance(x, torch.Tensor) else x for name, x in options.items()}
    expected = (*oracle.forward(*wide[1:], **options), *oracle.backward(*wide, **options))
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), (o, res.lse, *grads), expected):
        assert got.dtype == (torch.float32 if name == "lse" else dtype), name
        got = got.double().numpy()
        assert np.array_equal(np.isnan(got), np.isnan(want)), name
        finite = np.isfinite(want)
        assert np.array_equal(got[~finite], want[~finite]), name  # -inf lse of empty rows
        scale = max(1.0, np.abs(want[finite]).max(initial=0))
        assert np.abs(got[finite] - want[finite]).max(initial=0) <= tolerance * scale, name


def test_causal_gqa_dropout_across_tiles(poisoned_allocations):
    """70 queries and 90 keys cross three 32-row tiles each way: skipped tiles above the causal
    diagonal, the masked diagonal and partial last tiles, two query heads per kv head, and
    dropout regenerated in both backward kernels."""
    gen = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 70, 4, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 90, 2, 16, generator=gen) for _ in range(2))
    _check(torch.float32, 2e-5, q, k, v, do, causal=True, dropout_p=0.3, seed=11, rng_offset=5)


def test_bfloat16_varlen_window(poisoned_allocations):
    gen = torch.Generator().manual_seed(1)
    rows_q, rows_k = 5 + 40 + 3, 7 + 50 + 3  # three rows past the last sequence
    q, do = (torch.randn(rows_q, 2, 8, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(rows_k, 2, 8, generator=gen).bfloat16() for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 5, 45], dtype=torch.int32), torch.tensor([0, 7, 57], dtype=torch.int32)
    _check(torch.bfloat16, 2e-2, q, k, v, do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window=(9, 3))


# ---------------------------------------------------------------- tensor cores


def _packed(x: torch.Tensor) -> np.ndarray:
    """Pairs of adjacent elements along the last axis of a float16 or bfloat16 tensor, as words."""
    return x.contiguous().view(torch.int32).numpy().view(np.uint32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_fragments_multiply_and_chain(dtype):
    """The fragment layout of m16n8k16 (mma.mma_lanes): D = A B + C, and the C fragments of two
    adjacent tiles, packed pairwise, are the A fragment of their union (P reused as an operand)."""
    half = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(5)
    a, c = torch.randn(16, 16, generator=gen).to(half), torch.randn(16, 8, generator=gen)
    b_t = torch.randn(8, 16, generator=gen).to(half)  # B column-major: its columns are b_t's rows
    a_words, b_words = _packed(a), _packed(b_t)
    lanes = range(32)
    a_frag = np.array([[a_words[mma.a_position(lane, i)[0], mma.a_position(lane, i)[1] // 2] for i in range(4)]
                       for lane in lanes])
    b_frag = np.array([[b_words[mma.b_position(lane, i)[1], mma.b_position(lane, i)[0] // 2] for i in range(2)]
                       for lane in lanes])
    c_frag = np.array([[c[mma.c_position(lane, i)] for i in range(4)] for lane in lanes], np.float32)
    d = mma.mma_lanes(a_frag, b_frag, c_frag, dtype)
    expected = (a.double() @ b_t.double().T + c.double()).numpy()
    got = np.zeros((16, 8))
    for lane in lanes:
        for i in range(4):
            got[mma.c_position(lane, i)] = d[lane, i]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)

    # two 16x8 results side by side, as the A operand of the next product
    left, right = (torch.randn(16, 8, generator=gen).to(half) for _ in range(2))
    union = _packed(torch.cat([left, right], dim=1))
    for lane in lanes:
        for i in range(4):
            tile = left if i // 2 == 0 else right
            row, col = mma.c_position(lane, 2 * (i % 2))  # elements 0, 1 (rows g) or 2, 3 (rows g + 8)
            pair = _packed(tile[row : row + 1, col : col + 2])[0, 0]
            assert pair == union[mma.a_position(lane, i)[0], mma.a_position(lane, i)[1] // 2]


@pytest.mark.parametrize("transposed", [False, True])
def test_ldmatrix_rows_give_the_mma_fragments(transposed):
    """The rows each lane names to ldmatrix (mma.a_rows, b_rows, b_rows_transposed) give the
    fragments of mma's layout: A of a row-major tile, B of two n tiles stored n-major (K) or
    k-major (V, read transposed), from a tile of words at any origin."""
    rng = np.random.default_rng(3)
    words = rng.integers(0, 2**32, size=(40, 24), dtype=np.uint64).astype(np.uint32)
    halves = words.view(np.uint16)  # half c of row r: halves[r, c]
    row0, word0 = 5, 8

    def pair(r, c):  # the word of halves c, c + 1 of tile row r (relative to the origin)
        return int(halves[row0 + r, 2 * word0 + c]) | int(halves[row0 + r, 2 * word0 + c + 1]) << 16

    def fragments(rows, transposed):
        return mma.ldmatrix_lanes(words, [(row0 + rows(lane)[0], word0 + rows(lane)[1]) for lane in range(32)],
                                  transposed)

    a = fragments(mma.a_rows, False)
    b = fragments(mma.b_rows_transposed if transposed else mma.b_rows, transposed)
    for lane in range(32):
        for i in range(4):
            assert a[lane, i] == pair(*mma.a_position(lane, i))
            k, n = mma.b_position(lane, i % 2)
            n += 8 * (i // 2)  # registers 2, 3: the second n tile
            if transposed:  # B[k, n] = tile[k, n]
                expected = int(halves[row0 + k, 2 * word0 + n]) | int(halves[row0 + k + 1, 2 * word0 + n]) << 16
            else:  # B[k, n] = tile[n, k]
                expected = pair(n, k)
            assert b[lane, i] == expected


_PTX_SCRIPT = """
from numba import cuda, types
from flashx_numba.mma import intrinsics, shared_memory_intrinsics
for dtype in ("float16", "bfloat16"):
    mma, pack, widen = intrinsics(dtype)
    def kernel(a, c):
        lane = cuda.threadIdx.x
        d = mma(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], a[lane, 4], a[lane, 5], c[lane, 0], c[lane, 1],
                c[lane, 2], c[lane, 3])
        a[lane, 0] = pack(d[0], d[1])
        c[lane, 0] = widen(a[lane, 1])
    ptx, _ = cuda.compile_ptx(kernel, (types.uint32[:, ::1], types.float32[:, ::1]), cc=(8, 0))
    print(ptx)
(shared_address, global_address, shared_word, store_shared_pair, ldmatrix, ldmatrix_transposed, copy_async,
 wait_copies) = shared_memory_intrinsics()
def kernel(x, out):
    lane = cuda.threadIdx.x
    tile = cuda.shared.array((16, 8), types.uint32, alignment=16)
    copy_async(shared_address(tile, lane // 2, 0), 16, global_address(x, 0, lane // 2, 0, lane % 2 * 4), lane < 30)
    wait_copies()
    cuda.syncthreads()
    a = ldmatrix(shared_address(tile, lane % 16, lane // 16 * 4), 0)
    b = ldmatrix_transposed(shared_address(tile, lane % 16, 0), 16)
    store_shared_pair(shared_address(tile, lane // 2, 0), 8, a[1], b[2])
    out[lane, 0], out[lane, 1], out[lane, 2] = a[0], b[3], shared_word(shared_address(tile, lane // 2, 0), 12)
ptx, _ = cuda.compile_ptx(kernel, (types.int32[:, :, :, ::1], types.uint32[:, ::1]), cc=(8, 0))
print(ptx)
"""


def test_mma_compiles_to_tensor_core_ptx():
    """The intrinsics lower to mma.sync, cvt, cp.async and ldmatrix (numba-cuda's compiler, outside the simulator:
    it needs NVVM and NVRTC, not a GPU; skipped where they are missing)."""
    environment = {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], capture_output=True, text=True, env=environment,
                          timeout=120)
    if done.returncode and ("DynamicLibNotFoundError" in done.stderr or "NvvmSupportError" in done.stderr):
        pytest.skip("no NVVM or NVRTC here")
    assert done.returncode == 0, done.stderr[-2000:]
    for half in ("f16", "bf16"):
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{half}.{half}.f32" in done.stdout
        assert f"cvt.rn.{half}x2.f32" in done.stdout
    assert "cvt.f32.f16" in done.stdout
    assert "cp.async.cg.shared.global" in done.stdout and "cp.async.wait_all" in done.stdout
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in done.stdout
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in done.stdout
    assert "st.shared.v2.b32" in done.stdout and "ld.shared.b32" in done.stdout
    assert "+16]" in done.stdout  # immediate offsets stay in the instructions


# ---------------------------------------------------------------- kernels kept on disk


def test_the_source_digest_changes_with_every_source_of_the_package(tmp_path):
    """A kernel is made of every module of the package: an edit to any of them, or a module
    added, stamps the cache anew (the digest reads contents, not places)."""
    for path in Path(disk_cache.__file__).parent.glob("*.py"):
        shutil.copy(path, tmp_path)
    assert disk_cache.sources_digest(tmp_path) == disk_cache.package_digest()
    sources = sorted(tmp_path.glob("*.py"))
    assert {"kernels.py", "fragments.py", "primitives.py", "mma.py", "philox.py"} <= {path.name for path in sources}
    digests = {disk_cache.package_digest()}
    for path in sources:
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        digests.add(disk_cache.sources_digest(tmp_path))
        path.write_bytes(original)
    assert disk_cache.sources_digest(tmp_path) == disk_cache.package_digest()
    (tmp_path / "added.py").write_text("")
    digests.add(disk_cache.sources_digest(tmp_path))
    assert len(digests) == len(sources) + 2


def test_the_kernel_cache_lives_in_flashx_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHX_CACHE_DIR", str(tmp_path / "mine"))
    assert disk_cache.table_directory() == tmp_path / "mine" / disk_cache.TABLE


def _outside_the_simulator(script: str, cache: Path) -> dict:
    """The JSON that ``script`` prints last, run where numba compiles for a GPU (none is needed:
    the scripts stop short of compiling) with FLASHX_CACHE_DIR=cache."""
    environment = {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**environment, "FLASHX_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _launches(module: str, calls: str) -> str:
    """A script that runs ``calls`` with the launches of ``flashx_numba.<module>`` recorded (the
    kernels built, not run) and prints each launch's kernel and the cache its compile consults."""
    return f"""
import contextlib, json
import torch
from numba.cuda.dispatcher import CUDADispatcher
from flashx_numba import {module} as launcher

caches = {{}}
def compile_here(self, argtypes):  # no GPU: the cache a compile would consult is what matters
    caches[id(self)] = self._cache
CUDADispatcher.compile = compile_here
CUDADispatcher.disable_compile = lambda self, val=True: None
launched = []
launcher._launch = lambda kernel, *arguments: launched.append(kernel)
launcher._launching = lambda x: contextlib.nullcontext(0)
launcher._device_array = lambda x: x
{calls}
print(json.dumps({{"launches": [
    {{"kernel": kernel.py_func.__qualname__.split(".")[0], "dispatcher": id(kernel), "specialized": kernel.specialized,
     "cache": type(caches[id(kernel)]).__name__, "path": caches[id(kernel)].cache_path,
     "specialization": repr(getattr(caches[id(kernel)], "_specialization", None))}} for kernel in launched]}}))
"""


DTYPES = ["float16", "bfloat16", "float32"]
_LAUNCHES = _launches("attention", """
from flashx.validation import build_problem
for mods in ({}, {"softcap": 2.0, "sinks": torch.zeros(2)}):
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for dim in (64, 128, 256):
            q, k, v = (torch.zeros(1, 8, 2, dim, dtype=dtype) for _ in range(3))
            problem = build_problem(q, k, v, causal=True, **mods)
            o, lse = launcher.forward(problem, q, k, v)
            launcher.backward(problem, q, k, v, o, lse, o)
""")


def test_every_kernel_launched_is_compiled_through_the_disk_cache(tmp_path):
    """Each launch of a forward and a backward, for every dtype and head-dim class, plain and with
    a softcap and sinks, goes to a kernel whose compile consults a ``KernelCache`` in
    FLASHX_CACHE_DIR, specialized as ``cuda.jit(signature)`` leaves a kernel, and keyed by its
    factory's arguments: one key, one compiled kernel."""
    launches = _outside_the_simulator(_LAUNCHES, tmp_path)["launches"]
    assert len(launches) == 2 * 4 * 3 * 3  # forward, delta, dK/dV, dQ for 3 dtypes x 3 head-dim classes, twice
    assert [launch["kernel"] for launch in launches[:4]] == ["forward_kernel", "delta_kernel", "dkdv_kernel",
                                                            "dq_kernel"]
    for number, launch in enumerate(launches):
        assert launch["cache"] == "KernelCache" and launch["specialized"], launch
        assert launch["path"] == str(tmp_path / "numba-kernels")
        assert repr(DTYPES[number % 36 // 12]) in launch["specialization"], launch
    assert launches[1]["specialization"] == "('float16',)"
    # score modifications: forward and dK/dV compiled with them, dQ with them and the terms of dsinks
    assert [launch["specialization"].endswith(", False)") for launch in launches[:4]] == [True, False, True, True]
    assert launches[3]["specialization"].endswith(", False, False)")
    assert launches[36]["specialization"].endswith(", True)") and launches[38]["specialization"].endswith(", True)")
    assert launches[39]["specialization"].endswith(", True, True)")
    keys = {(launch["kernel"], launch["specialization"]): launch["dispatcher"] for launch in launches}
    assert len(keys) == len({launch["dispatcher"] for launch in launches}) == 30 + 27  # the delta kernels shared
    assert all(keys[launch["kernel"], launch["specialization"]] == launch["dispatcher"] for launch in launches)


_DECODE_LAUNCHES = _launches("decode", """
from flashx.validation import build_decode_problem
launcher._sm_count = lambda index: 132
for mods in ({}, {"softcap": 2.0, "sinks": torch.zeros(4)}):
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for dim in (64, 128, 256):
            q = torch.zeros(2, 1, 4, dim, dtype=dtype)
            k_cache, v_cache, k_new, v_new = (torch.zeros(2, n, 2, dim, dtype=dtype) for n in (16, 16, 1, 1))
            problem = build_decode_problem(q, k_cache, v_cache, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32),
                                           k_new=k_new, v_new=v_new, **mods)
            launcher.decode(problem, q, k_cache, v_cache, k_new, v_new)
""")


def test_every_decoding_kernel_is_compiled_through_the_disk_cache(tmp_path):
    """Each launch of a decoding call (append, split, merge), for every dtype and head-dim class,
    plain and with a softcap and sinks, goes to a specialized kernel whose compile consults a
    ``KernelCache`` in FLASHX_CACHE_DIR, keyed by its factory's arguments: the append and merge
    kernels by dtype, the split kernel by its shape, dtype, whether the scores are modified and
    whether the caches take 16-byte loads."""
    launches = _outside_the_simulator(_DECODE_LAUNCHES, tmp_path)["launches"]
    assert len(launches) == 2 * 3 * 3 * 3
    assert [launch["kernel"] for launch in launches[:3]] == ["append_kernel", "split_kernel", "merge_kernel"]
    for launch in launches:
        assert launch["cache"] == "KernelCache" and launch["specialized"], launch
        assert launch["path"] == str(tmp_path / "numba-kernels")
    assert launches[0]["specialization"] == launches[2]["specialization"] == "('float16',)"
    assert launches[1]["specialization"].startswith("(Shape(rows=4, key_lanes=8, keys_held=4, threads=128, width=64)")
    assert launches[1]["specialization"].endswith("'float16', False, True)")  # no score modifications, 16-byte loads
    assert launches[28]["specialization"].endswith("'float16', True, True)")  # the second pass: softcap
    keys = {(launch["kernel"], launch["specialization"]): launch["dispatcher"] for launch in launches}
    assert len(keys) == len({launch["dispatcher"] for launch in launches}) == 3 + 3 + 3 * 3 * 2
    assert all(keys[launch["kernel"], launch["specialization"]] == launch["dispatcher"] for launch in launches)


_CACHE_STAND_INS = """
import json, os, shutil, uuid, warnings
from pathlib import Path
from types import SimpleNamespace
from numba import types
from flashx_numba import disk_cache

warnings.simplefilter("always")
SIG = (types.float32[::1],)
DIRECTORY = Path(os.environ["FLASHX_CACHE_DIR"]) / "numba-kernels"

class Library:  # a CUDACodeLibrary as a load binds it: a cubin the driver loads, or rejects
    def __init__(self, cubin):
        self.cubin = cubin
    def get_cufunc(self):
        if self.cubin == "rejected":
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
        return SimpleNamespace(module=SimpleNamespace(initialized=True))

def codegen(capability):
    return SimpleNamespace(magic_tuple=lambda: ((13, 0), capability))

def compiled(cubin, capability=(9, 0)):
    # a compiled kernel as a cache saves it: its codegen, and the states it pickles
    states = dict(cooperative=False, name="kernel", signature=SIG, codelibrary=Library(cubin), debug=False,
                  lineinfo=False, call_helper=None, extensions=[], shared_memory_carveout=None,
                  launch_config_sensitive=False)
    return SimpleNamespace(codegen=codegen(capability), _reduce_states=lambda: states)

def load(cache, capability=(9, 0)):
    kernel = cache.load_overload(SIG, SimpleNamespace(codegen=lambda: codegen(capability)))
    return None if kernel is None else kernel._codelibrary.cubin

def factory(token):
    def kernel(x):
        x[0] = token
    return kernel

# two processes' kernels of one specialization: closures alike but for the intrinsics' uuids
first, second = factory(uuid.uuid4()), factory(uuid.uuid4())
"""

_ENTRIES = _CACHE_STAND_INS + """
disk_cache.KernelCache(first, ("float32", 4)).save_overload(SIG, compiled("cubin of 4"))
disk_cache.KernelCache(first, ("float32", 8)).save_overload(SIG, compiled("cubin of 8"))
found = {
    "same specialization, another closure": load(disk_cache.KernelCache(second, ("float32", 4))),
    "the other specialization": load(disk_cache.KernelCache(second, ("float32", 8))),
    "a third specialization": load(disk_cache.KernelCache(second, ("float32", 16))),
    "another compute capability": load(disk_cache.KernelCache(second, ("float32", 4)), (10, 0)),
    "files": sorted(path.name.split("-")[0] + path.suffix for path in DIRECTORY.iterdir()),
}
disk_cache.package_digest = lambda: "an edited source"
found["after an edit"] = load(disk_cache.KernelCache(second, ("float32", 4)))
print(json.dumps(found))
"""


def test_an_entry_is_found_by_specialization_whatever_the_closure_holds(tmp_path):
    """The key of an entry is the signature, the GPU, numba-cuda's version and the factory's
    arguments: another closure over other objects finds it (numba-cuda's own key would hash the
    closure's pickle, different in every process); another specialization, compute capability
    or package source does not."""
    found = _outside_the_simulator(_ENTRIES, tmp_path)
    assert found == {"same specialization, another closure": "cubin of 4", "the other specialization": "cubin of 8",
                     "a third specialization": None, "another compute capability": None, "after an edit": None,
                     "files": ["string.factory.locals.kernel.nbc", "string.factory.locals.kernel.nbc",
                               "string.factory.locals.kernel.nbi"]}


_FAILURES = _CACHE_STAND_INS + """
def attempt(action):
    with warnings.catch_warnings(record=True) as caught:
        outcome = action()
    return [outcome, [str(warning.message) for warning in caught]]

cache = disk_cache.KernelCache(first, ("float32", 4))
found = {}
for damaged, name in (("index", ".nbi"), ("data", ".1.nbc")):
    cache.save_overload(SIG, compiled("cubin"))
    next(DIRECTORY.glob("*" + name)).write_bytes(b"damaged")
    found["damaged " + damaged] = attempt(lambda: load(cache))
    cache.save_overload(SIG, compiled("cubin"))
    found["saved again after damaged " + damaged] = attempt(lambda: load(cache))
cache.save_overload(SIG, compiled("rejected"))
found["rejected cubin"] = attempt(lambda: load(cache))
shutil.rmtree(DIRECTORY)
DIRECTORY.write_text("")  # a file where the directory was
found["unwritable"] = attempt(lambda: cache.save_overload(SIG, compiled("cubin")))
found["no directory"] = attempt(lambda: type(disk_cache._kernel_cache(first, ("float32", 4))).__name__)
print(json.dumps(found))
"""


def test_a_damaged_or_unwritable_cache_warns_and_compiles(tmp_path):
    """An entry that cannot be read (a damaged index or data file, a cubin the driver rejects)
    reads as missing, with a warning, and the next entry saved is found again; one that cannot
    be written, or a directory that cannot be made, warns and leaves the kernel to this process."""
    found = _outside_the_simulator(_FAILURES, tmp_path)
    name, directory = "the compiled kernel factory.<locals>.kernel ('float32', 4)", tmp_path / "numba-kernels"
    for damaged in ("index", "data"):
        outcome, [warning] = found[f"damaged {damaged}"]
        assert outcome is None and warning.startswith(f"flashx: cannot load {name} from {directory} (UnpicklingError(")
        assert warning.endswith("); it is compiled again")
        assert found[f"saved again after damaged {damaged}"] == ["cubin", []]
    assert found["rejected cubin"] == [None, [f"flashx: cannot load {name} from {directory} "
                                              "(RuntimeError('CUDA_ERROR_INVALID_IMAGE')); it is compiled again"]]
    outcome, [warning] = found["unwritable"]
    assert outcome is None and warning.startswith(f"flashx: could not keep {name} in {directory} (")
    assert warning.endswith("); it is compiled again in the next process")
    assert found["no directory"] == ["NullCache", [f"flashx: cannot keep compiled kernels in {directory} ([Errno 17] "
                                                   f"File exists: '{directory}'); they are compiled in every process"]]
