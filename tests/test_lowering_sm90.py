"""The Triton backend's kernels lower to sm_90 code on a machine without a GPU.

Under ``TRITON_INTERPRET=1`` a kernel body runs as Python: no code generator sees it, so a kernel
the interpreter grades can still be refused by Triton's compiler on the GPU (a ``tl.constexpr``
bound twice inside a ``tl.static_range`` was). Here each launch of a forward, a backward and a
decoding step becomes ``JITFunction.warmup`` for an sm_90 target behind a stand-in driver: the
kernels go through Triton's whole pipeline down to ptxas, and nothing runs. The configuration is the
one shipped for sm_90. This file runs without ``TRITON_INTERPRET`` (``noxfile`` runs the
``test_triton_*`` files under the interpreter, in their own process), since the interpreter is
chosen when a kernel is decorated.
"""

from __future__ import annotations

import itertools
import os

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.driver")

from flashx.validation import build_decode_problem, build_problem

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="kernels decorated under the interpreter are not compiled")


class Sm90Driver:
    """Triton's CUDA driver as a host without a GPU can stand in for it: an sm_90 target on device 0."""

    def __init__(self):
        from triton.backends.nvidia.driver import CudaDriver

        self.cuda = CudaDriver.__new__(CudaDriver)  # its methods that need no GPU

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        return None

    def __getattr__(self, name):
        return getattr(self.cuda, name)


@pytest.fixture
def lowered(monkeypatch):
    """Launches compile for sm_90 and run nothing, exact ones too (as under CUDA graph capture,
    where no flag is read first: ``launch.ExactLaunch``); returns the names of the kernels compiled."""
    from flashx_triton import launch, tuning
    from triton.runtime import driver

    names = []

    def compile_only(self, *tensors):
        self.kernel.warmup(*tensors, *self.bound, grid=self.grid, **self.options)
        names.append(self.kernel.fn.__name__)

    def shipped_choice(kernel, problem, run):
        options = tuning.candidates(kernel, problem)
        choice = tuning.untimed_order(kernel, problem, options, "sm_90", lambda: 227 * 1024)[0]
        run(choice)
        return choice

    stand_in = Sm90Driver()
    monkeypatch.setattr(launch.Launch, "__call__", compile_only)
    monkeypatch.setattr(launch, "capturing", lambda device: True)
    monkeypatch.setattr(tuning, "choose", shipped_choice)
    # the class's property, restored afterwards: a host without a GPU has no driver to reset to
    monkeypatch.setattr(type(driver), "active", property(lambda config: stand_in))
    return names


@pytest.fixture
def compiled(lowered, monkeypatch):
    """As ``lowered``, and returns the compiled kernels themselves (their PTX in ``.asm["ptx"]``)."""
    from flashx_triton import launch

    kernels = []

    def compile_only(self, *tensors):
        kernels.append(self.kernel.warmup(*tensors, *self.bound, grid=self.grid, **self.options))
        lowered.append(self.kernel.fn.__name__)

    monkeypatch.setattr(launch.Launch, "__call__", compile_only)
    return kernels


def _inputs(dtype=torch.bfloat16, heads=(4, 2), seqlen=256, head_dim=128):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, seqlen, heads[0], head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(1, seqlen, heads[1], head_dim, generator=generator).to(dtype) for _ in range(2))
    return q, k, v


SLOPES = [2.0 ** -(i + 1) for i in range(4)]
ATTENTION = {
    "causal": {"causal": True},
    "softcap, window": {"softcap": 30.0, "window": (64, 0)},
    "alibi, causal": {"causal": True, "alibi_slopes": SLOPES},
    "sinks, dropout": {"sinks": [0.5, -1.0, 0.0, 2.0], "dropout_p": 0.1, "seed": 7},
}


@pytest.mark.parametrize("options", ATTENTION.values(), ids=ATTENTION.keys())
def test_forward_and_backward_lower(lowered, options):
    from flashx_triton import TritonBackend

    options = {name: torch.tensor(value) if isinstance(value, list) else value for name, value in options.items()}
    q, k, v = _inputs()
    problem = build_problem(q, k, v, **options)
    backend = TritonBackend()
    o, lse = backend.forward(problem, q, k, v)
    backend.backward(problem, q, k, v, o, lse, torch.randn_like(o))
    assert "_forward_kernel" in lowered and len(lowered) > 2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_forward_lowers_to_fp8_tensor_cores_with_vector_copies(compiled, causal):
    """FP8 inputs (flashx_triton.fp8) reach sm_90's FP8 tensor-core product in both of its
    products, and every K and V tile, masked ones included, is copied 16 bytes at a time by
    cp.async: a masked tile's V loaded byte by byte (ld.global.b8) leaves the pipeline."""
    from flashx_triton import TritonBackend

    q, k, v = _inputs(torch.float8_e4m3fn)
    descales = {name: torch.rand(1, 2) + 0.5 for name in ("q_descale", "k_descale", "v_descale")}
    problem = build_problem(q, k, v, causal=causal, **descales)
    TritonBackend().forward(problem, q, k, v)
    assert compiled and all(kernel.name == "_forward_kernel" for kernel in compiled)
    for kernel in compiled:  # causal: the plain launch and its exact relaunch
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
        assert "cp.async.cg.shared.global" in ptx
        assert ptx.count("ld.global.b8") <= 1  # at most the relaunch's flag


def test_fp8_cache_decoding_with_new_tokens_lowers(compiled, lowered):
    """An e4m3 cache: the append quantizes by an explicit saturation and the saturating
    conversion, and the split kernel widens 128-key tiles that cp.async copies 16 bytes at a time,
    without Triton's one-per-element F2F to bfloat16; V's tile reaches its product with P as 16-bit
    values through ldmatrix.trans, never read from shared memory byte by byte. The three launches
    are programmatic dependent launches: each waits for the launch before it (griddepcontrol.wait)
    before it reads anything, and the append and the split let the next one launch early."""
    from flashx_triton import TritonBackend

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 128, generator=generator).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 512, 2, 128, generator=generator).to(torch.float8_e4m3fn) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 128, generator=generator).to(torch.bfloat16) for _ in range(2))
    descales = {name: torch.rand(2, 2) + 0.5 for name in ("k_descale", "v_descale")}
    problem = build_decode_problem(q, k_cache, v_cache, cache_seqlens=torch.tensor([300, 400], dtype=torch.int32),
                                   k_new=k_new, v_new=v_new, num_splits=2, **descales)
    TritonBackend().decode(problem, q, k_cache, v_cache, k_new, v_new)
    assert lowered == ["_append_kernel", "_split_kernel", "_merge_kernel"]
    append, split = (kernel.asm["ptx"] for kernel in compiled[:2])
    assert "cvt.rn.satfinite.e4m3x2.f32" in append and "0f43E00000" in append  # 448
    assert "cp.async.cg.shared.global" in split and "cvt.rn.f16x2.e4m3x2" in split
    assert "cvt.bf16.f16" not in split and "cvt.rn.bf16x2.f32" in split
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in split and "ld.shared.b8" not in split
    for kernel, early in zip(compiled, (True, True, False)):
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.launch_pdl and "griddepcontrol.wait" in ptx
        assert ("griddepcontrol.launch_dependents" in ptx) == early


def test_paged_decoding_with_new_tokens_lowers(compiled, lowered):
    """A 16-bit paged cache's launches are programmatic ones too (``flashx_triton.decode.programmatic``),
    each waiting for the launch before it; the append and the split let the next one launch early."""
    from flashx_triton import TritonBackend

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 128, generator=generator).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(8, 64, 2, 128, generator=generator).to(torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 128, generator=generator).to(torch.bfloat16) for _ in range(2))
    block_table = torch.arange(8, dtype=torch.int32).view(2, 4)
    cache_seqlens = torch.tensor([100, 200], dtype=torch.int32)  # two key tiles each: two splits
    problem = build_decode_problem(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new,
                                   block_table=block_table, num_splits=2)
    TritonBackend().decode(problem, q, k_cache, v_cache, k_new, v_new)
    assert lowered == ["_append_kernel", "_split_kernel", "_merge_kernel"]
    for kernel, early in zip(compiled, (True, True, False)):
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.launch_pdl and "griddepcontrol.wait" in ptx
        assert ("griddepcontrol.launch_dependents" in ptx) == early


def test_lengths_band_reaches_and_dropout_draws_compile_no_variants_of_their_own(lowered, monkeypatch):
    """A ring calls the kernels on many chunk lengths and bands, and with dropout each of its
    steps draws at its own offsets (``flashx.ring``); a training loop draws a new seed every
    step. Each kernel compiles once per set of constexprs and options whatever its lengths, band
    reaches and dropout draw (``flashx_triton.arguments.LENGTHS``,
    ``flashx_triton.dropout.DROPOUT_DRAW``), where Triton would compile one per class of each (1,
    a multiple of 16, neither; i32 or i64). Each launch is keyed by Triton's JIT, which is then
    told not to compile (``jit_cache_hook``). A one-row query runs as decoding: its split kernel
    writes o itself with one split and float32 parts with more, two launches of one kernel."""
    from flashx_triton import TritonBackend, launch
    from triton import knobs

    variants, option_sets = set(), set()

    def declined(*, key, fn, **_):
        variants.add((fn.name, str(key)))
        return True

    def keyed_only(self, *tensors):
        values = dict(zip(self.kernel.arg_names, (*tensors, *self.bound)))
        constexprs = tuple(values[param.name] for param in self.kernel.params if param.is_constexpr)
        dtypes = tuple(getattr(x, "dtype", None) for x in tensors)  # a split kernel writes o, or float32 parts
        option_sets.add((self.kernel.fn.__name__, constexprs, dtypes, tuple(sorted(self.options.items()))))
        self.kernel.warmup(*tensors, *self.bound, grid=self.grid, **self.options)

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", declined)
    monkeypatch.setattr(launch.Launch, "__call__", keyed_only)
    backend = TritonBackend()
    generator = torch.Generator().manual_seed(0)
    for seqlen_q, seqlen_k in ((1000, 1024), (1, 4096), (4100, 300), (17, 1), (4096, 4100)):
        for window in (None, (-1, 0), (100, 0), (0, 37)):
            q = torch.randn(1, seqlen_q, 4, 64, generator=generator).to(torch.bfloat16)
            k, v = (torch.randn(1, seqlen_k, 2, 64, generator=generator).to(torch.bfloat16) for _ in range(2))
            problem = build_problem(q, k, v, window=window)
            o, lse = backend.forward(problem, q, k, v)
            backend.backward(problem, q, k, v, o, lse, torch.randn_like(o))
    q, k, v = _inputs(seqlen=1000, head_dim=64)
    draws = ((0, (0, 0)), (1, (1, 16)), (2**31 + 1, (17, 1000)))  # rng_offset, dropout_offsets
    for seed, (rng_offset, offsets) in itertools.product((1, 2**36 + 16, 2**64 - 1), draws):
        problem = build_problem(q, k, v, dropout_p=0.1, seed=seed, rng_offset=rng_offset, dropout_offsets=offsets)
        o, lse = backend.forward(problem, q, k, v)
        backend.backward(problem, q, k, v, o, lse, torch.randn_like(o))
    assert {name for name, _ in variants} == {"_forward_kernel", "_prepare_kernel", "_gradients_kernel",
                                              "_split_kernel", "_merge_kernel"}
    assert len(variants) == len(option_sets)


def test_an_exact_kernel_left_out_on_clean_data_compiles_in_another_process_and_later_loads(lowered, monkeypatch,
                                                                                            tmp_path):
    """A causal forward's first call on clean data compiles its plain kernel here and sends the
    exact one to the worker (flashx_triton.background), which compiles it into Triton's cache on
    disk; the call after that loads it from there: Triton builds no IR for it in this process."""
    from collections import defaultdict

    from flashx_triton import TritonBackend, forward, launch
    from triton.compiler import compiler

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel = forward._forward_kernel
    monkeypatch.setattr(kernel, "device_caches", defaultdict(kernel.create_binder))  # nothing compiled here yet
    monkeypatch.setattr(launch, "_built", {})
    monkeypatch.setattr(launch, "capturing", lambda device: False)
    built_here = []
    make_ir = compiler.ASTSource.make_ir
    monkeypatch.setattr(compiler.ASTSource, "make_ir", lambda self, *args, **kwargs: (
        built_here.append(self.constants), make_ir(self, *args, **kwargs))[1])

    def compile_only(self, *tensors):  # and the flags a plain launch leaves on clean data
        self.kernel.warmup(*tensors, *self.bound, grid=self.grid, **self.options)
        lowered.append(isinstance(self, launch.ExactLaunch))
        values = dict(zip(self.kernel.arg_names, (*tensors, *self.bound)))
        if values.get("EXACT") is False:
            values["REDO"].zero_()

    monkeypatch.setattr(launch.Launch, "__call__", compile_only)
    q, k, v = _inputs()
    problem = build_problem(q, k, v, causal=True)
    TritonBackend().forward(problem, q, k, v)
    assert True not in lowered and len(built_here) == 1  # the plain kernel (run by the choice, then the call)
    TritonBackend().settle()  # Backend.settle: the worker's compile ended
    assert list(tmp_path.glob("*/_forward_kernel.cubin"))
    del lowered[:]
    TritonBackend().forward(problem, q, k, v)
    assert lowered == [False, True] and len(built_here) == 1


def test_a_kernel_the_worker_cannot_compile_or_never_compiles_is_answered():
    """A launch waits on the worker only until it answers; one that failed answers all the same
    (the launch then compiles here, where the compiler's error is raised), and one that died
    answers everything sent to it. A dead worker is replaced by the next kernel sent."""
    from flashx_triton import background
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    worker = background._worker(target)
    failing = worker.send("flashx_triton.no_such_module", "_kernel", "{}")
    failing.wait()
    assert failing.done() and worker.alive()
    worker.process.kill()
    worker.process.wait()
    with pytest.raises(OSError):
        worker.send("flashx_triton.forward", "_forward_kernel", "{}")
    assert all(compiling.done() for compiling in worker.waiting)
    assert background._worker(target) is not worker


@pytest.mark.parametrize("options", [ATTENTION["causal"], ATTENTION["sinks, dropout"]], ids=["causal", "sinks, dropout"])
def test_accumulating_kernels_lower(compiled, monkeypatch, options):
    """forward_into's and backward_into's kernels (``ACCUMULATE``) compile for sm_90, under the
    shipped choices their plain kernels take."""
    from flashx_triton import TritonBackend, tuning

    monkeypatch.setattr(tuning, "settled", lambda kernel, problem, settle: tuning.choose(kernel, problem, lambda _: None))
    options = {name: torch.tensor(value) if isinstance(value, list) else value for name, value in options.items()}
    q, k, v = _inputs()
    problem = build_problem(q, k, v, **options)
    o_sums = torch.zeros(problem.o_shape)
    lse_sums = torch.full(problem.lse_shape, -float("inf"))
    backend = TritonBackend()
    backend.forward_into(problem, q, k, v, o_sums, lse_sums)
    backend.backward_into(problem, q, k, v, o_sums.to(q.dtype), lse_sums, torch.randn_like(q),
                          *(torch.zeros(x.shape) for x in (q, k, v)))
    assert {kernel.name for kernel in compiled} >= {"_forward_kernel", "_gradients_kernel"}


SPLIT_KERNELS = {  # (Hq, Hk, head dim, dtype, cache dtype, paged)
    "contiguous": (32, 8, 128, torch.bfloat16, torch.bfloat16, False),
    "paged": (32, 8, 128, torch.bfloat16, torch.bfloat16, True),
    "fp8": (32, 8, 128, torch.bfloat16, torch.float8_e4m3fn, False),
    "fp8, paged": (32, 8, 128, torch.bfloat16, torch.float8_e4m3fn, True),
    "64 rows": (64, 1, 128, torch.bfloat16, torch.bfloat16, False),
    "d256": (32, 8, 256, torch.bfloat16, torch.bfloat16, False),
    "float32": (32, 8, 128, torch.float32, torch.float32, False),
}


@pytest.mark.parametrize("shape", SPLIT_KERNELS.values(), ids=SPLIT_KERNELS.keys())
def test_split_programs_an_sm_holds_are_never_overcounted(compiled, shape):
    """``programs_per_sm``, estimated before the split kernel compiles, is at most what the
    compiled kernel's own shared memory lets an H100 SM (227 KB a program) hold."""
    from flashx_triton import TritonBackend
    from flashx_triton.decode import PROGRAMS_PER_SM, RESERVED_SHARED, config, programs_per_sm

    heads_q, heads_k, dim, dtype, cache_dtype, paged = shape
    q = torch.zeros(2, 1, heads_q, dim, dtype=dtype)
    cache = torch.zeros(8 if paged else 2, 256 if paged else 1024, heads_k, dim, dtype=dtype).to(cache_dtype)
    table = torch.arange(8, dtype=torch.int32).view(2, 4) if paged else None
    problem = build_decode_problem(q, cache, cache, cache_seqlens=torch.tensor([300, 400], dtype=torch.int32),
                                   block_table=table, num_splits=2)
    TritonBackend().decode(problem, q, cache, cache, None, None)
    shared = 227 * 1024
    held = max(1, min(PROGRAMS_PER_SM, shared // (compiled[0].metadata.shared + RESERVED_SHARED)))
    assert programs_per_sm(problem, config(problem), shared) <= held
