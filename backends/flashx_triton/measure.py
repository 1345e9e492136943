"""GPU check and timing of the Triton backend: ``python -m flashx_triton.measure [--quick]``.

1. Correctness on the GPU: a few shapes per dtype against float64 attention on the same GPU.
2. Speed at the target setting (bf16, 16k tokens per batch, H * D = 2048): forward and
   forward+backward TFLOP/s of flashx against SDPA (flash, cuDNN) and compiled FlexAttention,
   all timed in this process with triton.testing.do_bench (CUDA events, medians).
3. Peak memory of forward+backward beyond q, k, v, dO at B=1, H=16, D=128, N=65536, causal.
The autotuner's timings of every candidate configuration are printed too.
"""

from __future__ import annotations

import argparse
import json
import cProfile
import io
import math
import os
import pstats
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import flashx
from flashx_triton import tuning


def dense(q, k, v, causal):
    """float64 attention with bottom-right causal masking; (B, N, H, D) layout, GQA by repetition."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.double().transpose(1, 2) for x in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril(nk - nq)
        s = s.masked_fill(~keep, -math.inf)
    return (s.softmax(-1).nan_to_num() @ v).transpose(1, 2)


def check_correctness(report):
    torch.manual_seed(0)
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 3e-3), (torch.float32, 1e-5)):
        for d, dv, hq, hk, nq, nk, causal in ((64, 64, 4, 4, 1000, 1000, True), (128, 128, 4, 2, 777, 1500, True),
                                             (96, 96, 2, 2, 513, 400, False), (256, 256, 2, 1, 300, 700, True),
                                             (128, 64, 3, 3, 1200, 1200, False)):
            q = torch.randn(2, nq, hq, d, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(2, nk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
            v = torch.randn(2, nk, hk, dv, device="cuda", dtype=dtype, requires_grad=True)
            do = torch.randn(2, nq, hq, dv, device="cuda", dtype=dtype)
            o = flashx.attention(q, k, v, causal=causal, backend="triton")
            grads = torch.autograd.grad(o, (q, k, v), do)
            ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
            ref = dense(*ref_inputs, causal)
            ref_grads = torch.autograd.grad(ref, ref_inputs, do.double())
            errors = {}
            for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref, *ref_grads)):
                errors[name] = ((got.double() - want).norm() / want.norm()).item()
            ok = all(e < tol for e in errors.values())
            line = f"{str(dtype)[6:]:9} d={d:3} dv={dv:3} hq={hq} hk={hk} nq={nq:4} nk={nk:4} causal={causal!s:5} " + \
                " ".join(f"{n}={e:.1e}" for n, e in errors.items()) + ("  ok" if ok else "  FAIL")
            print(line, flush=True)
            report["correctness"].append(line)


def tflops(ms, b, h, n, d, causal, passes):
    return passes * 4 * b * h * n * n * d / (2 if causal else 1) / (ms * 1e-3) / 1e12


def time_speed(report, lengths, head_dims, with_peers):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    printed = set()
    for d in head_dims:
        for n in lengths:
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                torch.manual_seed(0)
                q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                row = {"d": d, "n": n, "causal": causal}

                def flashx_fwd():
                    return flashx.attention(q, k, v, causal=causal, backend="triton")

                def flashx_fwd_bwd():
                    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                    flashx.attention(qg, kg, vg, causal=causal, backend="triton").backward(do)

                impls = {"flashx": (flashx_fwd, flashx_fwd_bwd)}
                if with_peers:
                    qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
                    mask = create_block_mask(lambda b_, h_, i, j: j <= i, None, None, n, n) if causal else None

                    def sdpa(backend):
                        def fwd():
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

                        def fwd_bwd():
                            qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
                            with sdpa_kernel(backend):
                                F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(dot)
                        return fwd, fwd_bwd

                    def flex_fwd():
                        return flex(qt, kt, vt, block_mask=mask)

                    def flex_fwd_bwd():
                        qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
                        flex(qg, kg, vg, block_mask=mask).backward(dot)

                    impls.update({"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "fa2": sdpa(SDPBackend.FLASH_ATTENTION),
                                  "flex": (flex_fwd, flex_fwd_bwd)})
                for name, (fwd, fwd_bwd) in impls.items():
                    try:
                        ms_f = do_bench(fwd, warmup=25, rep=100, return_mode="median")
                        ms_fb = do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
                        row[name] = (round(tflops(ms_f, b, h, n, d, causal, 1), 1),
                                     round(tflops(ms_fb, b, h, n, d, causal, 3.5), 1))
                    except Exception as error:  # a peer that cannot run this shape is reported, not fatal
                        row[name] = repr(error)[:80]
                print(json.dumps(row), flush=True)
                report["speed"].append(row)
                print_new_tunings(printed)


def print_new_tunings(printed: set):
    """The autotuner's timing of every candidate, for each key not printed before (ms; None: dropped)."""
    for key, runs in tuning.measured.items():
        if runs and key not in printed:
            printed.add(key)
            print(key, *(f"{config}: {ms if ms is None else round(ms, 3)}" for config, ms in runs), sep="\n  ",
                  flush=True)


def peak_memory(report):
    b, h, d, n = 1, 16, 128, 65536
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    flashx.attention(q, k, v, causal=True, backend="triton").backward(do)  # tunes first
    for x in (q, k, v):
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    flashx.attention(q, k, v, causal=True, backend="triton").backward(do)
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    print(f"peak memory beyond q, k, v, do (B=1 H=16 D=128 N=65536 causal): {extra:.0f} MiB", flush=True)
    report["peak_memory_mib"] = extra


def host_overhead(report):
    q, k, v, do = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    grads = [x.clone().requires_grad_() for x in (q, k, v)]
    problem = flashx.validation.build_problem(q, k, v)
    backend = flashx.registry.get("triton")
    calls = {
        "attention": lambda: flashx.attention(q, k, v, backend="triton"),
        "backend.forward": lambda: backend.forward(problem, q, k, v),
        "attention fwd+bwd": lambda: flashx.attention(*grads, backend="triton").backward(do),
        "sdpa (flash)": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
    }
    report["host_us"] = {}
    for name, call in calls.items():
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(1000):
            call()
        torch.cuda.synchronize()
        report["host_us"][name] = round((time.perf_counter() - start) * 1000, 1)  # s per 1000 calls -> us per call
        print(f"host time per call, {name}: {report['host_us'][name]} us", flush=True)
    profile = cProfile.Profile()
    profile.runcall(lambda: [calls["attention"]() for _ in range(1000)])
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    report["host_profile"] = text.getvalue()
    print(text.getvalue()[-3000:], flush=True)


def compiled_variants(report):
    """Registers, spills and shared memory of every kernel variant compiled in this process."""
    from flashx_triton import backward, forward

    report["compiled"] = []
    for kernel in (forward._forward_kernel, backward._gradients_kernel):
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                names = kernel.arg_names
                constants = {(key if isinstance(key, str) else names[key[0]]): value
                             for key, value in compiled.src.constants.items()}
                shown = {name: constants.get(name) for name in ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "TILE", "STREAM",
                                                                "PARTS", "KEY_PARTS", "QUERY_PARTS", "KEY_PROGRAMS",
                                                                "HAS_MASK")}
                row = dict(kernel=kernel.__name__, **shown, warps=compiled.metadata.num_warps,
                           stages=compiled.metadata.num_stages, shared=compiled.metadata.shared,
                           regs=compiled.n_regs, spills=compiled.n_spills)
                report["compiled"].append(row)
                print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="8192")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--skip", default="", help="comma list of: correctness, speed, memory, overhead")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "correctness": [], "speed": []}
    if "correctness" not in skip:
        os.environ["FLASHX_TRITON_AUTOTUNE"] = "0"  # first candidates only: many shapes, few compiles
        check_correctness(report)
        del os.environ["FLASHX_TRITON_AUTOTUNE"]
    if "speed" not in skip:
        time_speed(report, [int(x) for x in args.lengths.split(",")], [int(x) for x in args.head_dims.split(",")],
                   not args.no_peers)
    if "memory" not in skip:
        peak_memory(report)
    if "overhead" not in skip:
        host_overhead(report)
    compiled_variants(report)
    report["autotune"] = {str(key): [(str(c), ms) for c, ms in runs] for key, runs in tuning.measured.items()}
    with open(os.path.join(args.out, "triton-measure.json"), "w") as f:
        json.dump(report, f, indent=1)
    for row in report["speed"]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
