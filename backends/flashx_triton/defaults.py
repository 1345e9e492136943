"""Where the Triton backend's shipped configurations come from, and how close they come to tuned.

    python3 -m flashx_triton.defaults sweep OUT.json      # tune at every sweep point; write every
                                                          # candidate's median and the choices
    python3 -m flashx_triton.defaults encode SWEEP.json   # SWEEP.json -> flashx_triton/shipped.json
    python3 -m flashx_triton.defaults compare OUT.json    # shipped (untimed) vs tuned, same process

``sweep`` runs the tuner (FLASHX_TRITON_AUTOTUNE=1) at the benchmark's points: bf16 and fp16
fwd+bwd, fp32 forwards and FP8 (e4m3, no descales) forwards, d 64/128/256, causal or not, N
512..16k, B = 16384 / N and H = 2048 / d, bf16 fwd+bwd with dropout 0.1 at N = 8k (whose kernels
are tuned apart: ``tuning.kernel_key``), plus the off-sweep shapes of issue 26; ``POINTS`` (labels,
comma-separated: "sweep", "dropout", "first-call", ...) and ``DTYPES`` (comma-separated) sweep some
of them. Compiling every
candidate is most of a cold tuning's time, so worker processes first compile them all (one shape
per class, timings stubbed) into the shared Triton cache, in parallel; the tuner then runs
serially on a quiet GPU.
``encode`` turns its output into the shipped table (``encode``'s docstring says how).

``compare`` times each shape's fwd+bwd (do_bench median) under the shipped choice, untimed, then
tunes it in a fresh table and times it again, in one process.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (128, 64, 256)
# (label, B, N, Hq, Hk, d, causal, dtype, backward): the first-call shape and the Llama-like GQA
# step of issue 26, and float32 forwards at d 256
OFF_SWEEP = [("first-call", 2, 6000, 16, 16, 128, True, "bfloat16", True),
             ("gqa", 4, 4096, 32, 8, 128, True, "bfloat16", True),
             ("gqa-full", 4, 4096, 32, 8, 128, False, "bfloat16", True),
             ("fp32-d256", 8, 2048, 8, 8, 256, True, "float32", False),
             ("fp32-d256", 2, 8192, 8, 8, 256, False, "float32", False)]
# dropout 0.1 (``_step``) at one length of the sweep's shapes: its tables hold one entry each
DROPOUT = [("dropout", 2, 8192, 2048 // d, 2048 // d, d, causal, "bfloat16", True) for d in (128, 64) for causal in (True, False)]


def sweep_points():
    """(label, B, N, Hq, Hk, d, causal, dtype, backward) of every point, the most used first."""
    points = []
    for dtype, backward in (("bfloat16", True), ("float16", True), ("float32", False), ("float8_e4m3fn", False)):
        for d in HEAD_DIMS:
            for causal in (True, False):
                for n in SEQLENS:
                    points.append(("sweep", 16384 // n, n, 2048 // d, 2048 // d, d, causal, dtype, backward))
        if dtype == "bfloat16":
            points += DROPOUT
        if dtype == "float16":
            points += OFF_SWEEP
    wanted, dtypes = os.environ.get("POINTS"), os.environ.get("DTYPES")
    return [point for point in points if (wanted is None or point[0] in wanted.split(","))
            and (dtypes is None or point[7] in dtypes.split(","))]


def _inputs(point):
    import torch

    _, b, n, hq, hk, d, _, dtype, backward = point
    generator = torch.Generator("cuda").manual_seed(n * d)
    drawn = torch.float32 if dtype.startswith("float8") else getattr(torch, dtype)  # torch draws no FP8

    def make(h, requires_grad=False):
        x = torch.randn(b, n, h, d, generator=generator, device="cuda", dtype=drawn).to(getattr(torch, dtype))
        return x.requires_grad_(requires_grad)

    return make(hq, backward), make(hk, backward), make(hk, backward), make(hq)


def _step(point, q, k, v, do):
    import flashx

    dropout = {"dropout_p": 0.1, "seed": 0} if point[0] == "dropout" else {}
    o = flashx.attention(q, k, v, causal=point[6], backend="triton", **dropout)
    if point[8]:
        o.backward(do)
    return o


def _compile_class(point) -> str:
    """Compile every candidate of one class (dtype, d, causal, group) by one tuning with do_bench stubbed."""
    import torch
    import triton.testing

    os.environ.update(FLASHX_CACHE_DIR=tempfile.mkdtemp(), FLASHX_TRITON_AUTOTUNE="1")
    triton.testing.do_bench = lambda fn, **kwargs: (fn(), 1.0)[1]
    started = time.perf_counter()
    try:
        _step(point, *_inputs(point))
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the serial tuning meets it again and records it
        return f"{point}: {error!r}"[:300]
    return f"{point}: compiled in {time.perf_counter() - started:.0f} s"


def _compile_candidates(points) -> None:
    """Every candidate of every class of ``points`` compiled into the Triton cache, in parallel."""
    classes = {}
    for point in points:  # one shape per class: the sweep's lengths (powers of two) compile alike
        classes.setdefault((point[0], *point[5:]), (point[0], 16, 1024, *point[3:]) if point[0] == "sweep" else point)
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_compile_class, classes.values()):
            print(line, flush=True)
    print(f"compiled {len(classes)} classes in {time.perf_counter() - started:.0f} s", flush=True)


def sweep(out: str) -> None:
    os.environ["FLASHX_TRITON_AUTOTUNE"] = "1"
    points = sweep_points()
    started = time.perf_counter()
    _compile_candidates(points)

    import torch

    from flashx_triton import tuning

    os.environ["FLASHX_CACHE_DIR"] = tempfile.mkdtemp()
    import datetime

    import triton

    record = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
              "triton": triton.__version__, "date": datetime.date.today().isoformat(),
              "labels": sorted({point[0] for point in points}), "points": [], "keys": {}}
    for point in points:
        if time.perf_counter() - started > float(os.environ.get("DEADLINE_S", "inf")):
            print("deadline: the points left are not tuned", flush=True)
            break
        inputs = _inputs(point)
        start = time.perf_counter()
        try:
            _step(point, *inputs)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
            record["points"].append({"point": point, "error": repr(error)[:300]})
            print(f"{point}: {error!r}"[:300], flush=True)
            continue
        keys = []
        for key, choice, _, timings in tuning.choices():
            if key not in record["keys"] and timings is not None:
                record["keys"][key] = {"choice": choice, "medians": [[tuning._encoded(c), ms] for c, ms in timings]}
                keys.append(key)
        record["points"].append({"point": point, "seconds": time.perf_counter() - start, "keys": keys})
        print(f"{point}: {time.perf_counter() - start:.1f} s " + "; ".join(
            f"{key} -> {tuning.text(record['keys'][key]['choice'])}" for key in keys), flush=True)
        with open(out, "w") as file:
            json.dump(record, file, indent=1)
        del inputs


TOLERANCE = 1.03  # a choice is kept for the next length class while within 3% of that class's fastest


def encode(sweep_json: str) -> None:
    """The shipped table from a ``sweep``: per kernel, head-dim class, dtype, band and dropout, the
    tuner's choice at each length class of the sweep, kept for longer classes while it stays within
    TOLERANCE of their fastest candidate (so run-to-run ties do not flip the table). The groups a
    sweep of some ``POINTS`` did not reach keep their entries."""
    import re

    from flashx_triton import tuning

    record = json.load(open(sweep_json))
    rows = 16384 * 2048 // 128  # the sweep's query rows at d <= 128 (d 256: half), one size class each
    groups = {}
    for key, found in record["keys"].items():
        kernel, d, dtype, band, length, row_class, dropout = re.fullmatch(
            r"(\w+)-d(\d+)x\d+-(\w+)-(band|full)-n(\d+)-r(\d+)(-dropout)?", key).groups()
        if int(row_class) != min(rows * 128 // max(int(d), 128), 1 << 18).bit_length():
            continue  # an off-sweep shape
        groups.setdefault(f"{kernel} d{d} {dtype} {band}{' dropout' if dropout else ''}", {})[int(length)] = found
    shipped = tuning.SHIPPED
    document = json.loads(shipped.read_text()) if shipped.exists() else {}
    capability = f"sm_{''.join(map(str, record['capability']))}"
    table = dict(document.get(capability, {}).get("choices", {}))
    for group, by_length in sorted(groups.items()):
        entries, kept = {}, None
        for length in sorted(by_length):
            medians = {json.dumps(choice): ms for choice, ms in by_length[length]["medians"] if ms is not None}
            if kept is None or medians.get(json.dumps(kept), float("inf")) > TOLERANCE * min(medians.values()):
                kept = by_length[length]["choice"]
                entries[str(1 << (length - 1))] = tuning.text(kept)
        table[group] = entries
    labels = f" ({', '.join(record['labels'])} points)" if "labels" in record else ""
    measured = (f"{record['device']}, Triton {record.get('triton', '3.6')}, {record.get('date', '2026-11-26')}: "
                f"python -m flashx_triton.defaults sweep, then encode{labels}")
    earlier = document.get(capability, {}).get("measured")
    document[capability] = {"measured": f"{earlier}; {measured}" if earlier else measured,
                            "choices": dict(sorted(table.items()))}
    shipped.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{shipped}: {len(table)} groups, {sum(map(len, table.values()))} entries from {record['device']}")


def _time_step(point, inputs) -> float:
    from triton.testing import do_bench

    q, k, v, do = inputs

    def step():
        _step(point, q, k, v, do)

    return do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v] if point[8] else None, return_mode="median")


def _tflops(point, ms: float) -> float:
    _, b, n, hq, _, d, causal, _, backward = point
    flops = 4 * b * hq * n * n * d / (2 if causal else 1) * (3.5 if backward else 1)
    return flops / ms / 1e9


def compare(out: str) -> None:
    """Shipped (untimed) against tuned in one process, at the points COMPARE names: "off-sweep"
    (default), "sweep-bf16" (the sweep's bf16 points), or both, comma-separated; cuDNN beside them."""
    import torch

    from flashx_triton import tuning

    wanted = os.environ.get("COMPARE", "off-sweep").split(",")
    points = [p for p in sweep_points() if ("off-sweep" in wanted and p[0] != "sweep")
              or ("sweep-bf16" in wanted and p[0] == "sweep" and p[7] == "bfloat16")]
    if len(points) > len(OFF_SWEEP):
        _compile_candidates(points)
    rows = []
    for point in points:
        inputs = _inputs(point)
        os.environ.pop("FLASHX_TRITON_AUTOTUNE", None)
        os.environ["FLASHX_CACHE_DIR"] = tempfile.mkdtemp()  # no choice on disk: the shipped one runs
        shipped = _time_step(point, inputs)
        os.environ["FLASHX_TRITON_AUTOTUNE"] = "1"
        os.environ["FLASHX_CACHE_DIR"] = tempfile.mkdtemp()
        start = time.perf_counter()
        _step(point, *inputs)
        torch.cuda.synchronize()
        tuning_s = time.perf_counter() - start
        tuned = _time_step(point, inputs)
        os.environ.pop("FLASHX_TRITON_AUTOTUNE")
        rows.append({"point": point, "shipped_tflops": _tflops(point, shipped), "tuned_tflops": _tflops(point, tuned),
                     "cudnn_tflops": _tflops(point, _cudnn_ms(point, inputs)), "tuning_s": tuning_s,
                     "tuned": [made[:3] for made in tuning.choices() if made.source == "timed"]})
        print(json.dumps(rows[-1]), flush=True)
        del inputs
    with open(out, "w") as file:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, file, indent=1)
    print(f"\n{'shape':<50} {'shipped':>8} {'tuned':>8} {'ratio':>6} {'cuDNN':>6}  TFLOP/s")
    for row in rows:
        label, b, n, hq, hk, d, causal, dtype, backward = row["point"]
        shape = (f"{label} B={b} N={n} H={hq}/{hk} d{d} {dtype}{' causal' if causal else ''}"
                 f"{' fwd+bwd' if backward else ' fwd'}")
        print(f"{shape:<50} {row['shipped_tflops']:>8.0f} {row['tuned_tflops']:>8.0f} "
              f"{row['shipped_tflops'] / row['tuned_tflops']:>6.2f} {row['cudnn_tflops']:>6.0f}")


def _cudnn_ms(point, inputs) -> float:
    """SDPA's cuDNN kernel on the same inputs, heads first, K and V repeated to every query head."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    q, k, v, do = (x.detach().transpose(1, 2).contiguous() for x in inputs)
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    for x in (q, k, v):
        x.requires_grad_(point[8])

    def step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=point[6])
        if point[8]:
            o.backward(do)

    try:
        step()
        return do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v] if point[8] else None,
                        return_mode="median")
    except RuntimeError:
        return float("nan")


if __name__ == "__main__":
    {"sweep": sweep, "encode": encode, "compare": compare}[sys.argv[1]](sys.argv[2])
