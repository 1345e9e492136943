"""The benchmark harness on the CPU: FLOP counting, tables, plots, the records and the sweep's
plumbing. No timing assertions."""

import csv
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

import flashx
from flashx_bench import cli, decode, features, gpu, records, report
from flashx_bench.implementations import Shape, causal_block_mask, implementations


def test_flops_as_flash_attn_counts():
    shape = Shape(batch=2, seqlen=1024, heads=16, head_dim=128, causal=False)
    forward = 4 * 2 * 16 * 1024 * 1024 * 128
    assert gpu.attention_flops(shape, "fwd") == forward
    assert gpu.attention_flops(shape, "fwd+bwd") == 3.5 * forward
    causal = Shape(2, 1024, 16, 128, causal=True)
    assert gpu.attention_flops(causal, "fwd") == forward / 2
    assert gpu.attention_flops(causal, "fwd+bwd") == 3.5 * forward / 2


def test_speed_shapes_keep_tokens_and_model_dim():
    for shape in gpu.FULL.speed_shapes():
        assert shape.batch * shape.seqlen == 16384
        assert shape.heads * shape.head_dim == 2048
    assert len(gpu.FULL.speed_shapes()) == 6 * 2 * 2


@pytest.mark.parametrize(
    "name, slug",
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 4090", "rtx4090")],
)
def test_device_slug(name, slug):
    assert records.device_slug(name) == slug


def test_causal_block_mask_is_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    for seqlen in (128, 1024):
        ours = causal_block_mask(seqlen, torch.device("cpu"))
        theirs = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seqlen, seqlen, device="cpu")
        assert torch.equal(ours.to_dense(), theirs.to_dense())
        assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
        assert torch.equal(ours.q_num_blocks, theirs.q_num_blocks)


def _row(impl, mode, d, causal, n, ms):
    shape = Shape(16384 // n, n, 2048 // d, d, causal)
    tflops = gpu.attention_flops(shape, mode) / ms / 1e9
    return {"impl": impl, "mode": mode, "batch": shape.batch, "seqlen": n, "heads": shape.heads, "head_dim": d,
            "causal": causal, "status": "ok", "ms": ms, "tflops": tflops, "fraction": tflops / 800, "wall_s": 0.1}


@pytest.fixture
def results():
    """A small run as the sweep writes it: flashx twice as fast as cuDNN, one wrong check, an OOM."""
    speed = []
    for mode in gpu.MODES:
        for d in (64, 128):
            for causal in (False, True):
                for n in (4096, 8192):
                    speed.append({**_row("flashx-triton", mode, d, causal, n, 1.0), "sm_mhz": 1800.0})
                    speed.append({**_row("sdpa-cudnn", mode, d, causal, n, 2.0), "sm_mhz": 1980.0})
                    speed.append({**_row("sdpa-math", mode, d, causal, n, 1.0), "status": "OOM", "ms": None})
    return {
        "kind": "gpu",
        "device": "NVIDIA H100 80GB HBM3",
        "device_memory_gib": 79.2,
        "date": "2026-11-21",
        "versions": {"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "flashx": "0.1.0"},
        "plan": {**gpu.asdict(gpu.FULL), "seqlens": [4096, 8192]},
        "timing": {"warmup_ms": 25, "rep_ms": 100, "statistic": "median", "check_tolerance": 1e-2},
        "implementations": [
            {"name": "flashx-triton", "label": "flashx triton", "flashx": True, "layout": "BSHD"},
            {"name": "sdpa-cudnn", "label": "SDPA cuDNN", "flashx": False, "layout": "BHSD"},
            {"name": "sdpa-math", "label": "SDPA math", "flashx": False, "layout": "BHSD"},
        ],
        "ceilings": {"matmul_tflops": 800.0, "copy_tbps": 3.0},
        "checks": [
            {"impl": impl, "batch": 2, "seqlen": 1024, "heads": 4, "head_dim": d, "causal": causal,
             "status": "wrong" if (impl, d, causal) == ("sdpa-cudnn", 64, True) else "ok",
             "errors": {"o": 0.5 if (impl, d, causal) == ("sdpa-cudnn", 64, True) else 3e-3, "dq": 4e-3}}
            for impl in ("flashx-triton", "sdpa-cudnn", "sdpa-math")
            for d in (64, 128)
            for causal in (False, True)
        ],
        "memory": [
            {"impl": "flashx-triton", "batch": 1, "seqlen": 4096, "heads": 16, "head_dim": 128, "causal": True,
             "status": "ok", "mib": 100.0},
            {"impl": "sdpa-math", "batch": 1, "seqlen": 4096, "heads": 16, "head_dim": 128, "causal": True,
             "status": "ok", "mib": 4000.0},
            {"impl": "flashx-triton", "batch": 1, "seqlen": 65536, "heads": 16, "head_dim": 128, "causal": True,
             "status": "ok", "mib": 1600.0},
            {"impl": "sdpa-math", "batch": 1, "seqlen": 65536, "heads": 16, "head_dim": 128, "causal": True,
             "status": "OOM", "mib": None},
        ],
        "speed": speed,
        "host": [{"impl": "flashx-triton", "mode": mode, "batch": 4, "seqlen": 4096, "heads": 16, "head_dim": 128,
                  "causal": True, "status": "ok", "host_us": us, "wall_s": 0.1}
                 for mode, us in (("fwd", 95.0), ("fwd+bwd", 480.0))],
        "sections_s": {"ceilings": 2.0, "check": 10.0, "memory": 30.0, "speed": 300.0, "host": 5.0},
    }


def test_ratios_are_peer_time_over_flashx_time(results):
    rows = report.ratios(results)
    assert rows and {r["peer"] for r in rows} == {"sdpa-cudnn"}  # an OOM peer has no ratio
    assert all(r["flashx"] == "flashx-triton" and r["ratio"] == pytest.approx(2.0) for r in rows)
    assert len(rows) == 2 * 2 * 2 * 2


def test_markdown_tables(results):
    text = report.markdown(results)
    assert "flashx triton / SDPA cuDNN" in text and "| 2.00 |" in text
    assert "OOM" in text and "Not measured" in text
    assert "WRONG 5.0e-01" in text  # the failed check, in the check table
    assert "WRONG" in text.split("## Speed, forward:")[1]  # and on that peer's speed numbers
    memory = text.split("## Memory")[1]
    assert "| 64k | 1600 | - | OOM |" in memory
    for line in text.splitlines():
        if line.startswith("|"):
            assert line.endswith("|")
    assert "idle GPU" not in text  # this run did not rest before its timings: the header says nothing
    rested = {**results, "timing": {**results["timing"], "rest_s": 1.0}}
    assert "each timing after a first call and 1 s of idle GPU" in report.markdown(rested)


def test_the_record_names_fa4s_version_or_why_it_is_absent(results):
    with_fa4 = {**results, "versions": {**results["versions"], "flash-attn-4": "4.0.0b36"}}
    assert "flashx 0.1.0, flash-attn-4 4.0.0b36, Python 3.12.3." in report.markdown(with_fa4)
    assert "flash-attn-4" not in report.markdown(results)
    absent = {**results, "absent": {"fa4": "`from flash_attn.cute import flash_attn_func` failed"}}
    assert "## Not measured\n\n- fa4: absent: `from flash_attn.cute import flash_attn_func` failed\n" in report.markdown(absent)


def test_host_table_puts_the_gpu_time_beside(results):
    table = report.markdown(results).split("## Host time per call (µs), forward+backward: host / GPU\n")[1]
    assert "| 128 | yes | 4k | 480 / 1000 | - | - |" in table  # 1.0 ms on the GPU; cuDNN's host not measured


def test_clock_tables(results):
    text = report.markdown(results)
    for title in ("forward", "forward+backward"):
        table = text.split(f"## SM clock while timed (MHz), {title}\n")[1].split("\n\n##")[0]
        assert "| 128 | no | 8k | 1800 | 1980 | - |" in table  # OOM math: no reading
    for row in results["speed"]:
        row["sm_mhz"] = None  # no NVML where the sweep ran
    assert "SM clock" not in report.markdown(results)


def test_sm_clock_keeps_the_repeats_only():
    clock = gpu.SmClock(torch.device("cpu"))
    with clock:
        pass
    assert clock.median_mhz() is None  # nothing sampled off an NVIDIA GPU
    clock.end = 10.0
    repeats = 10.0 - gpu.REP_MS / 1e3
    clock.samples = [(repeats - 5.0, 345.0)]  # an idle compile before the repeats
    clock.samples += [(repeats + i / 100, mhz) for i, mhz in enumerate((1800.0, 1830.0, 1815.0))]
    assert clock.median_mhz() == 1815.0


def test_headline_is_one_seqlen(results):
    text = report.headline(results, 8192)
    header = text.splitlines()[0]
    assert header.startswith("| N=8k | fwd d128 | fwd+bwd d128 | fwd d128 causal |")
    flashx_row = next(line for line in text.splitlines() if line.startswith("| flashx triton"))
    assert flashx_row.split(" | ")[1] == f"{gpu.attention_flops(Shape(2, 8192, 16, 128, False), 'fwd') / 1e9:.0f}"
    assert "OOM" in text


@pytest.fixture
def fp8_results(results):
    """The small run with FP8 siblings: triton's FP8 forward at 0.7 ms against its bf16 forward's 1.0
    (1.43x) at d128 not causal, 0.75 ms (1.33x) causal, 0.5 ms at d64; cupy's FP8 declined."""
    cupy_declines = "declined: backend 'cupy' cannot run this call: supports dtypes bfloat16, float16, float32"
    fp8 = {(128, False): 0.7, (128, True): 0.75, (64, False): 0.5, (64, True): 0.5}
    speed = []
    for mode in gpu.MODES:
        for (d, causal), ms in fp8.items():
            for n in (4096, 8192):
                ours = _row("flashx-triton-fp8", mode, d, causal, n, ms)
                cupy = {**_row("flashx-cupy-fp8", mode, d, causal, n, 1.0), "status": cupy_declines, "ms": None}
                if mode == "fwd+bwd":
                    ours = cupy = {**ours, "status": report.NOT_APPLICABLE, "ms": None}
                speed += [ours, {**cupy, "impl": "flashx-cupy-fp8"}]
    checks = [{"impl": impl, "batch": 2, "seqlen": 1024, "heads": 4, "head_dim": d, "causal": causal,
               "status": "ok" if impl == "flashx-triton-fp8" else cupy_declines,
               "errors": {"o": 0.05} if impl == "flashx-triton-fp8" else None}
              for impl in ("flashx-triton-fp8", "flashx-cupy-fp8") for d, causal in fp8]
    fp8_impls = [{"name": f"flashx-{backend}-fp8", "label": f"flashx {backend} FP8", "flashx": True, "layout": "BSHD",
                  "backend": backend, "dtype": "float8_e4m3fn"} for backend in ("triton", "cupy")]
    plain = [{**impl, "backend": "triton"} if impl["name"] == "flashx-triton" else impl
             for impl in results["implementations"]]
    return {**results, "implementations": plain[:1] + fp8_impls + plain[1:], "speed": results["speed"] + speed,
            "checks": results["checks"] + checks, "timing": {**results["timing"], "fp8_check_tolerance": 0.1}}


def test_fp8_forward_is_set_against_its_own_bf16_forward(fp8_results):
    found = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["ratio"] for r in report.fp8_ratios(fp8_results)}
    assert found["flashx-triton-fp8", 128, False, 8192] == pytest.approx(1 / 0.7)
    assert found["flashx-triton-fp8", 128, True, 4096] == pytest.approx(1 / 0.75)
    assert len(found) == 8 and not any(key[0] == "flashx-cupy-fp8" for key in found)  # declined: nothing to set
    # the speed-ups over the peers are the bf16 implementations' alone
    assert {r["flashx"] for r in report.ratios(fp8_results)} == {"flashx-triton"}


def test_fp8_targets(fp8_results):
    """Issue 43's: triton's FP8 forward >= 1.4x its bf16 forward, cupy's >= 1000 TFLOP/s, at d128, N=8k,
    causal and not: met, not met, or not measured."""
    where = "(d128, N=8k, B·N=16384, H·D=2048)"
    found = {t["target"]: (t["measured"], t["met"]) for t in report.fp8_targets(fp8_results)}
    assert found == {
        f"flashx triton FP8 forward >= 1.4x its own bf16 forward {where}":
            ("not causal: 1.43x; causal: 1.33x", False),
        f"flashx cupy FP8 forward >= 1000 TFLOP/s {where}": ("not causal: declined; causal: declined", None),
    }
    flops = {causal: gpu.attention_flops(Shape(2, 8192, 16, 128, causal), "fwd") for causal in (False, True)}
    fast = [{**row, "ms": 0.6, "status": "ok", "tflops": flops[row["causal"]] / 0.6e9}
            if row["impl"].endswith("-fp8") and row["mode"] == "fwd" else row for row in fp8_results["speed"]]
    checked = [{**c, "status": "ok", "errors": {"o": 0.05}} if c["impl"].endswith("-fp8") else c
               for c in fp8_results["checks"]]
    fast_run = {**fp8_results, "speed": fast, "checks": checked}
    triton, cupy = report.fp8_targets(fast_run)
    assert (triton["measured"], triton["met"]) == ("not causal: 1.67x; causal: 1.67x", True)
    assert cupy["met"] is (flops[True] / 0.6e9 >= 1000)  # half the FLOPs when causal, in the same time
    assert cupy["measured"] == f"not causal: {flops[False] / 0.6e9:.0f} TFLOP/s; causal: {flops[True] / 0.6e9:.0f} TFLOP/s"
    wrong = {**fast_run, "checks": [{**c, "status": "wrong", "errors": {"o": 0.4}} if c["impl"] == "flashx-triton-fp8"
                                    and c["causal"] else c for c in checked]}
    triton = report.fp8_targets(wrong)[0]
    assert (triton["measured"], triton["met"]) == ("not causal: 1.67x; causal: 1.67x WRONG", False)
    cut = {**fast_run, "speed": [r for r in fast if not (r["impl"] == "flashx-triton" and r["causal"])]}
    triton = report.fp8_targets(cut)[0]  # its bf16 forward unmeasured where causal
    assert (triton["measured"], triton["met"]) == ("not causal: 1.67x; causal: no bf16 forward", None)


def test_a_run_without_fp8_has_no_fp8_section(results):
    assert "## FP8" not in report.markdown(results)
    assert {t["measured"] for t in report.fp8_targets(results)} == {"not in this run"}


def test_fp8_markdown(fp8_results):
    text = report.markdown(fp8_results)
    section = text.split("## FP8 (issue 43)\n")[1].split("\n## ")[0]
    assert "float8_e4m3fn, descales of 1 (None), o in bfloat16; forward only" in section
    assert "WRONG above a relative error of 0.1" in section
    assert ("| flashx triton FP8 forward >= 1.4x its own bf16 forward (d128, N=8k, B·N=16384, H·D=2048) "
            "| not causal: 1.43x; causal: 1.33x | **no** |") in section
    assert "| not causal: declined; causal: declined | not measured |" in section
    table = section.split("### FP8 forward")[1]
    assert "| d | causal | N | flashx triton FP8 | flashx cupy FP8 |" in table
    plain = gpu.attention_flops(Shape(2, 8192, 16, 128, False), "fwd") / 1e9
    assert f"| 128 | no | 8k | {plain / 0.7:.0f} (1.43x) | declined |" in table
    both = text.split("## Speed, forward+backward: ")[1].split("\n## ")[0]
    assert "| flashx triton | flashx triton FP8 | flashx cupy FP8 | SDPA cuDNN | SDPA math |" in both
    assert "| not applicable | not applicable |" in both
    assert all("FP8 /" not in line for line in text.splitlines() if line.startswith("| d | causal | N | flashx triton /"))
    assert "WRONG above 0.01; FP8: o alone, WRONG above 0.1)" in text
    assert "| flashx triton FP8 | 5.0e-02 | 5.0e-02 | 5.0e-02 | 5.0e-02 |" in text
    missing = text.split("## Not measured")[1]
    assert "- flashx cupy FP8: declined: backend 'cupy' cannot run this call" in missing and "(everywhere)" in missing
    assert "not applicable" not in missing  # forward only by design: the tables say so


def test_fp8_history_rows_name_their_dtype(fp8_results, tmp_path):
    records.publish(fp8_results, tmp_path, report.markdown)
    rows = [r for r in _history(tmp_path) if r["impl"].endswith("-fp8")]
    assert {(r["impl"], r["mode"], r["dtype"], r["metric"]) for r in rows} == {
        ("flashx-triton-fp8", "fwd", "float8_e4m3fn", "tflops"), ("flashx-triton-fp8", "fwd", "float8_e4m3fn", "rel_error")}
    assert len(rows) == 8 + 4  # the forward at 8 points, the check at 4; nothing declined or not applicable
    assert {r["dtype"] for r in _history(tmp_path) if r["impl"] == "flashx-triton"} == {"bfloat16"}


def _history(directory):
    with (directory / records.HISTORY).open(newline="") as file:
        return list(csv.DictReader(file))


def test_publish_replaces_the_record_and_appends_the_history(results, tmp_path):
    """One record per device, replaced by each run; one history table that grows by rows, never a
    file per run; a row already in the history is not written twice."""
    records.partial_path(tmp_path, "h100").write_text("{}")  # what the run saved as it went
    records.publish(results, tmp_path, report.markdown)
    first = _history(tmp_path)
    ok_speed = sum(r["status"] == "ok" for r in results["speed"])
    assert sum(r["metric"] == "tflops" for r in first) == ok_speed
    assert {r["metric"] for r in first} == {"tflops", "host_us", "peak_mib", "rel_error", "matmul_tflops", "copy_tbps"}
    row = next(r for r in first if r["metric"] == "tflops" and r["impl"] == "sdpa-cudnn" and r["seqlen"] == "8192"
               and r["head_dim"] == "128" and r["causal"] == "False" and r["mode"] == "fwd")
    assert float(row["value"]) == pytest.approx(gpu.attention_flops(Shape(2, 8192, 16, 128, False), "fwd") / 2e9, rel=1e-5)
    assert (row["date"], row["device"], row["dtype"], row["torch"]) == ("2026-11-21", results["device"], "bfloat16", "2.11.0")

    records.publish(results, tmp_path, report.markdown)  # the same run again: nothing new
    assert len(_history(tmp_path)) == len(first)
    later = {**results, "date": "2026-11-22", "speed": results["speed"][:3]}
    records.publish(later, tmp_path, report.markdown)
    assert len(_history(tmp_path)) == len(first) + sum(r["status"] == "ok" for r in later["speed"]) + 2 + 2 + 3 + 12
    record = records.load_json(tmp_path / "h100.json")
    assert (record["date"], record["speed"]) == ("2026-11-22", later["speed"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["h100.json", "h100.md", "history.csv"]


def test_the_decode_sweep_keeps_a_record_of_its_own(tmp_path):
    decode = {"kind": "decode", "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26", "versions": {"torch": "2.11.0"},
              "shape": {"heads_q": 32, "heads_k": 8, "head_dim": 128, "dtype": "bfloat16", "seqlen_q": 1},
              "copy_tbps": 3.0, "rows": [{"impl": "triton", "batch": 1, "cache": 16384, "status": "ok", "tbps": 2.7},
                                         {"impl": "sdpa-flash", "batch": 1, "cache": 16384, "status": "OOM"}]}
    records.publish(decode, tmp_path, lambda results: "decode table\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["decode-h100.json", "decode-h100.md", "history.csv"]
    rows = [(r["impl"], r["mode"], r["batch"], r["seqlen"], r["heads"], r["head_dim"], r["metric"], r["value"])
            for r in _history(tmp_path)]
    assert rows == [("", "", "", "", "", "", "copy_tbps", "3"), ("triton", "decode", "1", "16384", "32", "128", "tbps", "2.7")]


def _decode_row(impl, batch, cache, tbps):
    dtype = decode.FLASHX[impl][2] if impl in decode.FLASHX else decode.BF16
    size = decode._kv_bytes(batch, cache, dtype)
    return {"impl": impl, "batch": batch, "cache": cache, "cache_dtype": dtype, "bytes": size, "status": "ok",
            "ms": size / tbps / 1e9, "timing": "graph", "tbps": tbps, "copy_fraction": tbps / 3.0}


CUPY_DECLINES_FP8 = "declined: backend 'cupy' cannot run this call: supports dtypes bfloat16, float16, float32"


@pytest.fixture
def decode_results():
    """Two points of the decode sweep, every backend, on a 3.0 TB/s device: triton ahead of the peers
    but its pages of 16 slow at B=1; cupy behind the peers, its pages of 16 out of memory at B=1;
    numba at B=16, L=8k only, at 60% of triton's rate. FP8 caches: triton's at 2.85 TB/s of its
    single bytes at B=16, L=8k (1.90x the tokens/s of its bf16 cache), its pages of 16 there too;
    cupy declines them."""
    speeds = {(1, 65536): {"triton": 2.8, "triton-page256": 2.7, "triton-page16": 2.6, "triton-page1": 2.5,
                           "triton-fp8": 2.6, "cupy": 2.6, "cupy-page256": 2.5, "cupy-page16": None,
                           "cupy-page1": 2.4, "cupy-fp8": CUPY_DECLINES_FP8, "sdpa-cudnn": 2.9, "sdpa-flash": 2.5},
              (16, 8192): {"triton": 3.0, "triton-page256": 2.9, "triton-page16": 2.88, "triton-page1": 2.7,
                           "triton-fp8": 2.85, "triton-fp8-page16": 2.7, "cupy": 2.9, "cupy-page256": 2.8,
                           "cupy-page16": 2.8, "cupy-page1": 2.7, "cupy-fp8": CUPY_DECLINES_FP8, "numba": 1.8,
                           "sdpa-cudnn": 2.9, "sdpa-flash": 2.8}}
    rows = [_decode_row(impl, batch, cache, tbps) if isinstance(tbps, float) else
            {"impl": impl, "batch": batch, "cache": cache,
             "status": tbps or "error: OutOfMemoryError: CUDA out of memory"}
            for (batch, cache), point in speeds.items() for impl, tbps in point.items()]
    return {"kind": "decode", "device": "NVIDIA H100 80GB HBM3", "sm_count": 132, "date": "2026-11-25",
            "versions": {"torch": "2.11.0", "triton": "3.6.0", "flashx": "0.1.0"},
            "shape": {**decode.SHAPE, "dtype": "bfloat16", "seqlen_q": 1}, "labels": decode.LABELS, "copy_tbps": 3.0,
            "rows": rows, "notes": ["Measured with tiles since replaced."],
            "splits_scan": [{"backend": "triton", "batch": 1, "cache": 16384, "chosen": 16,
                             "tbps": {"0": 2.7, "1": 0.2, "16": 2.7}}]}


def test_decode_options(monkeypatch):
    monkeypatch.setattr(decode, "cuda_backends", lambda: ["triton", "cupy", "numba"])
    args = decode.parse_args([])
    assert (args.command, args.out, args.backends, args.batches, args.caches, args.numba_max_tokens,
            args.scan_splits, args.scan_grid, args.time_limit) == (
        "run", records.DEFAULT_OUT.resolve(), ["triton", "cupy", "numba"], list(decode.BATCHES), list(decode.CACHES),
        2**17, False, False, None)
    assert decode.parse_args(["--scan-grid", "--batches", "2"]).scan_grid
    args = decode.parse_args(["--scan-splits", "--batches", "1", "4", "--caches", "1024", "--max-tokens", "4096",
                              "--time-limit", "60", "--out", "elsewhere", "--backends", "numba", "triton",
                              "--numba-max-tokens", "1024"])
    assert (args.out.name, args.backends, args.batches, args.caches, args.max_tokens, args.numba_max_tokens,
            args.scan_splits, args.time_limit) == ("elsewhere", ["triton", "numba"], [1, 4], [1024], 4096, 1024, True, 60.0)
    assert decode.parse_args(["--record", "--scan-splits"]).out == records.CHECKOUT_RESULTS
    assert decode.parse_args(["--record", "--backends", "cupy", "numba", "triton"]).backends == ["triton", "cupy", "numba"]
    for refused in (["--record", "--caches", "1024"], ["--record", "--out", "elsewhere"], ["report"],
                    ["--record", "--backends", "triton"], ["--record", "--numba-max-tokens", "4096"],
                    ["--backends", "numpy"]):
        with pytest.raises(SystemExit):
            decode.parse_args(refused)
    monkeypatch.setattr(decode, "cuda_backends", lambda: ["triton"])
    assert decode.parse_args([]).backends == ["triton"]
    with pytest.raises(SystemExit):  # cupy does not run on CUDA here
        decode.parse_args(["--backends", "triton", "cupy"])


def test_decode_backends_are_those_flashx_runs_on_cuda(monkeypatch):
    from types import SimpleNamespace

    def info(name, available, devices):
        return SimpleNamespace(name=name, available=available, devices=devices)

    monkeypatch.setattr(flashx, "backends", lambda: [
        info("cupy", True, ("cuda",)), info("numba", False, ("cuda",)), info("numpy", True, ("cpu",)),
        info("triton", True, ("cpu", "cuda"))])
    assert decode.cuda_backends() == ["triton", "cupy"]


def test_decode_implementations_per_backend():
    bf16, fp8 = "bfloat16", "float8_e4m3fn"
    assert list(decode.layouts("triton").items()) == [
        ("triton", (None, bf16)), ("triton-page256", (256, bf16)), ("triton-page16", (16, bf16)),
        ("triton-page1", (1, bf16)), ("triton-fp8", (None, fp8)), ("triton-fp8-page256", (256, fp8)),
        ("triton-fp8-page16", (16, fp8)), ("triton-fp8-page1", (1, fp8))]
    assert decode.layouts("numba") == {"numba": (None, bf16)}  # issue 43 asks triton and cupy for FP8 caches
    assert decode.FLASHX["cupy-page16"] == ("cupy", 16, bf16) and decode.FLASHX["cupy-fp8"] == ("cupy", None, fp8)
    assert (decode.LABELS["triton"], decode.LABELS["cupy-page16"], decode.LABELS["numba"]) == (
        "flashx triton, contiguous cache", "flashx cupy, pages of 16", "flashx numba, contiguous cache")
    assert (decode.LABELS["triton-fp8"], decode.LABELS["cupy-fp8-page256"]) == (
        "flashx triton, FP8 contiguous cache", "flashx cupy, FP8 pages of 256")


def test_decode_counts_the_bytes_each_cache_holds():
    """TB/s of K/V read: two bytes an element in bf16, one in FP8."""
    assert decode._kv_bytes(16, 8192) == 16 * 8192 * 8 * (128 + 128) * 2
    assert decode._kv_bytes(16, 8192, "float8_e4m3fn") == 16 * 8192 * 8 * (128 + 128)


def test_decode_rows_name_the_split_count_the_backend_reports():
    q = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16)
    keys, values = (torch.zeros(2, 1024, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((2,), 1000, dtype=torch.int32)
    assert decode._chosen_splits("triton", q, keys, values, lengths, num_splits=3) == 3
    table = torch.arange(2 * 64, dtype=torch.int32).view(2, 64)
    k_pages, v_pages = (torch.zeros(2 * 64, 16, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    assert decode._chosen_splits("triton", q, k_pages, v_pages, lengths, block_table=table, num_splits=5) == 5


def test_decode_record_is_the_device_record(decode_results, tmp_path, monkeypatch):
    """The sweep saves decode-<device>.partial.json as it goes; publishing replaces decode-<device>.*
    and appends one history row per number."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: decode_results["device"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(multi_processor_count=132))
    sweep = decode.Sweep(decode.parse_args(["--out", str(tmp_path)]))
    assert sweep.path == records.partial_path(tmp_path, "decode-h100")
    sweep.results["rows"] = decode_results["rows"][:1]
    sweep._save()
    assert records.load_json(sweep.path)["rows"] == decode_results["rows"][:1]

    records.publish(decode_results, tmp_path, decode.markdown)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["decode-h100.json", "decode-h100.md", "history.csv"]
    assert records.load_json(tmp_path / "decode-h100.json") == decode_results
    history = _history(tmp_path)
    assert len(history) == 1 + 23  # the copy bandwidth, and every row but the out-of-memory and declined ones
    assert [(r["impl"], r["batch"], r["seqlen"], r["dtype"], r["metric"], r["value"]) for r in history[:2]] == [
        ("", "", "", "", "copy_tbps", "3"), ("triton", "1", "65536", "bfloat16", "tbps", "2.8")]
    fp8 = [(r["impl"], r["batch"], r["dtype"], r["value"]) for r in history if "fp8" in r["impl"]]
    assert fp8 == [("triton-fp8", "1", "float8_e4m3fn", "2.6"), ("triton-fp8", "16", "float8_e4m3fn", "2.85"),
                   ("triton-fp8-page16", "16", "float8_e4m3fn", "2.7")]


def test_decode_targets(decode_results):
    """Issue 42's and 43's targets, each met, not met, or not measured."""
    found = {t["target"]: (t["measured"], t["met"]) for t in decode.targets(decode_results)}
    peers = "the faster of cuDNN and FA2, every B in 1..64 and L in 4k..128k"
    copy = "90% of the copy rate (3.00 TB/s) at B=1, L >= 32k"
    paged = "of its contiguous rate from B·L >= 64k tokens"
    fp8 = "FP8 contiguous cache: >= 1.8x the tokens/s of its bf16 cache at B=16, L=8k"
    assert found == {
        f"flashx triton, contiguous: >= 0.95x {peers}": ("lowest 0.97x at B=1, L=64k (of 2 points)", True),
        f"flashx triton, contiguous: >= {copy}": ("93.3% at B=1, L=64k", True),
        f"flashx triton, pages of 256: >= 95% {paged}": ("lowest 96.4% at B=1, L=64k (of 2 points)", True),
        f"flashx triton, pages of 16: >= 95% {paged}": ("lowest 92.9% at B=1, L=64k (of 2 points)", False),
        f"flashx cupy, contiguous: >= 0.95x {peers}": ("lowest 0.90x at B=1, L=64k (of 2 points)", False),
        f"flashx cupy, contiguous: >= {copy}": ("86.7% at B=1, L=64k", False),
        f"flashx cupy, pages of 256: >= 95% {paged}": ("lowest 96.2% at B=1, L=64k (of 2 points)", True),
        # out of memory at B=1: the point that ran meets it, which does not make the target met
        f"flashx cupy, pages of 16: >= 95% {paged}": ("lowest 96.6% at B=16, L=8k (1 of 2 points measured)", None),
        "flashx numba, contiguous: >= 50% of triton's rate at B=16, L=8k": ("60% at B=16, L=8k", True),
        # issue 43: tokens/s, B over the step time (2.85 TB/s of single bytes against 3.0 of pairs)
        f"flashx triton, {fp8}": ("1.90x at B=16, L=8k", True),
        f"flashx cupy, {fp8}": ("declined", None),
    }
    triton_only = {**decode_results, "rows": [r for r in decode_results["rows"] if not r["impl"].startswith(("cupy", "numba"))]}
    unmeasured = [t["target"] for t in decode.targets(triton_only) if t["met"] is None]
    assert len(unmeasured) == 6 and all(t.startswith(("flashx cupy", "flashx numba")) for t in unmeasured)
    assert {t["measured"] for t in decode.targets(triton_only) if t["met"] is None} == {"no rows"}


def test_decode_markdown(decode_results):
    checks = {("cupy-page16", 16): {"num_splits": 4, "max_diff_vs_fa2": 2**-10, "max_diff_vs_contiguous": 0.0},
              ("numba", 16): {"max_diff_vs_fa2": 2**-10}}  # numba reports no split count
    for row in decode_results["rows"]:
        row.update(checks.get((row["impl"], row["batch"]), {}))
    text = decode.markdown(decode_results)
    assert "**Note.** Measured with tiles since replaced.\n" in text
    assert ("| flashx triton, contiguous: >= 0.95x the faster of cuDNN and FA2, every B in 1..64 and L in 4k..128k "
            "| lowest 0.97x at B=1, L=64k (of 2 points) | yes |") in text
    assert ("| flashx cupy, contiguous: >= 90% of the copy rate (3.00 TB/s) at B=1, L >= 32k | 86.7% at B=1, L=64k "
            "| **no** |") in text
    assert "(1 of 2 points measured) | not measured |" in text
    header = next(line for line in text.splitlines() if line.startswith("| B | L | flashx triton"))
    assert "| flashx triton, pages of 1 | flashx triton, FP8 contiguous cache | flashx triton, FP8 pages of 16 |" in header
    assert header.endswith("| SDPA cuDNN | SDPA FlashAttention-2 | triton / faster peer | cupy / faster peer "
                           "| numba / faster peer | triton FP8 / bf16 cache, tokens/s | cupy FP8 / bf16 cache, tokens/s |")
    assert ("| 1 | 64k | 2.80 (93%) | 2.70 (90%) | 2.60 (87%) | 2.50 (83%) | 2.60 (87%) |  | 2.60 (87%) | 2.50 (83%) "
            "| error | 2.40 (80%) | declined |  | 2.90 (97%) | 2.50 (83%) | 0.97x | 0.90x |  | 1.86x |  |") in text
    assert "| 1.03x | 1.00x | 0.62x | 1.90x |  |" in text.split("| 16 | 8k | 3.00 (100%) |")[1].splitlines()[0]
    assert "| 16 | 8k | cupy-page16 | 4 | 9.77e-04 | 0.00e+00 |" in text
    assert "| 16 | 8k | numba |  | 9.77e-04 |  |" in text
    assert "- cupy-page16: error: OutOfMemoryError: CUDA out of memory" in text
    assert "| triton | 1 | 16k | 16 | 2.70 | 0.20 | 2.70 | 1.00 |" in text  # the num_splits scan
    for line in text.splitlines():
        if line.startswith("|"):
            assert line.endswith("|")


def test_a_wrong_fp8_cache_shows_wrong_and_misses_its_target(decode_results):
    """An FP8 row whose output is off FA2's by more than the FP8 tolerance keeps its rate, marked WRONG,
    and its target is not met (not merely unmeasured)."""
    for row in decode_results["rows"]:
        if (row["impl"], row["batch"]) == ("triton-fp8", 16):
            row.update(status="wrong", rel_error_vs_fa2=0.5, max_diff_vs_fa2=0.25)
    decode_results["check_tolerance"] = {"bfloat16": 1e-2, "float8_e4m3fn": 0.1}
    (target,) = [t for t in decode.targets(decode_results) if t["target"].startswith("flashx triton, FP8")]
    assert (target["measured"], target["met"]) == ("WRONG: relative error 0.5 against FA2", False)
    text = decode.markdown(decode_results)
    assert "| 2.85 (95%) **WRONG** |" in text  # shown, marked
    assert "| 16 | 8k | triton-fp8 |  | 2.50e-01 |  | 5.00e-01 **WRONG** |" in text
    assert "WRONG above 0.01 for a bf16 cache and 0.1 for an FP8 one" in text
    assert "- triton-fp8: wrong" not in text  # measured, so not under "Not measured"
    assert "1.90x" not in text  # no ratio from a wrong row


def test_decode_sweep_times_fp8_caches_on_cpu(tmp_path, monkeypatch):
    """One point of the decode sweep on the CPU, flashx's NumPy backend standing in for triton's
    kernels and every timing 1 ms: the FP8 caches are the bf16 tokens cast (half the bytes, so half
    the TB/s at the same time), checked against FA2 on the bf16 cache (about 0.04 off: ok); an FP8
    kernel that doubles o is WRONG; cupy, not installed here, is declined with flashx's reason."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(decode, "cuda_backends", lambda: ["triton"])
    monkeypatch.setattr(decode, "SPLIT_REPORTERS", ())  # triton's split count needs its GPU

    def one_ms(self, step, graph=True):
        step()
        return 1.0, "graph"

    monkeypatch.setattr(decode.Sweep, "_time", one_ms)
    call, explain = flashx.attention_with_kvcache, flashx.kvcache.explain

    def numpy_for_triton(backend):
        return "numpy" if backend == "triton" else backend

    def attention_with_kvcache(q, k_cache, v_cache, *, backend, **keywords):
        o = call(q, k_cache, v_cache, backend=numpy_for_triton(backend), **keywords)
        broken = k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[1] == 1  # FP8 pages of 1
        return 2 * o if broken else o

    monkeypatch.setattr(flashx, "attention_with_kvcache", attention_with_kvcache)
    monkeypatch.setattr(flashx.kvcache, "explain", lambda *arrays, backend="auto", **keywords: explain(
        *arrays, backend=numpy_for_triton(backend), **keywords))
    sweep = decode.Sweep(decode.parse_args(["--out", str(tmp_path)]))
    sweep.args.backends = ["triton", "cupy"]
    sweep.device, sweep.results["copy_tbps"] = torch.device("cpu"), 3.0
    sweep._point(2, 256)

    rows = {row["impl"]: row for row in sweep.results["rows"]}
    assert list(rows) == [*decode.layouts("triton"), *decode.layouts("cupy"), *decode.PEERS]
    bf16, fp8 = rows["triton"], rows["triton-fp8"]
    assert (bf16["cache_dtype"], fp8["cache_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert bf16["bytes"] == 2 * fp8["bytes"] == 2 * 256 * 8 * 256 * 2
    assert fp8["tbps"] == pytest.approx(bf16["tbps"] / 2)
    assert bf16["rel_error_vs_fa2"] < 1e-2 and 1e-2 < fp8["rel_error_vs_fa2"] < 0.1
    assert all(rows[name]["status"] == "ok" for name in ("triton", "triton-page16", "triton-fp8", "triton-fp8-page16"))
    assert rows["triton-fp8-page16"]["max_diff_vs_contiguous"] == 0.0  # against the FP8 contiguous cache
    assert rows["triton-fp8-page1"]["status"] == "wrong" and rows["triton-fp8-page1"]["rel_error_vs_fa2"] > 0.5
    assert rows["cupy-fp8"]["status"].startswith("declined: ") and "cupy" in rows["cupy-fp8"]["status"]
    text = decode.markdown(sweep.results)
    assert "| 2 | 256 | triton-fp8-page1 |" in text and "**WRONG** |" in text


def test_decode_scans_splits_at_a_few_points_or_the_whole_grid(tmp_path, monkeypatch):
    """--scan-splits scans SCAN_POINTS within --max-tokens; --scan-grid every point of the sweep."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(decode, "cuda_backends", lambda: ["triton"])
    monkeypatch.setattr(decode, "COPY_BYTES", 1024)
    monkeypatch.setattr(decode, "FLUSH_BYTES", 1024)
    monkeypatch.setattr(decode.Sweep, "_time", lambda self, step, graph=True: (1.0, "eager"))
    monkeypatch.setattr(decode.Sweep, "_point", lambda self, batch, cache: None)
    scanned = []
    monkeypatch.setattr(decode.Sweep, "_scan", lambda self, batch, cache: scanned.append((batch, cache)))
    grid = ["--batches", "1", "4", "--caches", "1024", "16384", "--max-tokens", "16384", "--out", str(tmp_path)]
    for flag, expected in (("--scan-splits", [(1, 1024), (1, 4096), (1, 16384), (4, 1024)]),
                           ("--scan-grid", [(1, 1024), (1, 16384), (4, 1024)])):
        scanned.clear()
        sweep = decode.Sweep(decode.parse_args([flag, *grid]))
        sweep.device = torch.device("cpu")
        sweep.run()
        assert scanned == expected, flag


def test_decode_plot_draws_every_backend(decode_results, tmp_path):
    pytest.importorskip("matplotlib")
    path = decode.plot(decode_results, tmp_path / "decode-h100.png")
    assert path.stat().st_size > 10_000


def test_flashx_bench_decode_runs_the_decode_sweep(decode_results, tmp_path):
    """`flashx bench decode ARGS` is the decode sweep's command line; its report redraws a record."""
    from flashx import cli as flashx_cli

    path = tmp_path / "decode-h100.json"
    records.save_json(decode_results, path)
    assert flashx_cli.main(["bench", "decode", "report", str(path)]) == 0
    assert path.with_suffix(".md").read_text() == decode.markdown(decode_results)
    path.with_suffix(".md").unlink()
    assert cli.main(["decode", "report", str(path)]) == 0
    assert path.with_suffix(".md").read_text() == decode.markdown(decode_results)
    with pytest.raises(SystemExit):
        cli.main(["decode", "--batches", "x"])


def test_commands_redraw_from_json(results, tmp_path, capsys):
    path = tmp_path / "h100.json"
    records.save_json(results, path)
    cli.main(["table", str(path)])
    assert path.with_suffix(".md").read_text() == report.markdown(results)
    cli.main(["headline", str(path), "--seqlen", "4096"])
    assert "| N=4k |" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    cli.main(["plot", str(path)])
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h100.json", "h100.md", "h100.png"]


def test_flashx_bench_is_the_same_command(results, tmp_path, capsys):
    from flashx import cli as flashx_cli

    path = tmp_path / "h100.json"
    records.save_json(results, path)
    assert flashx_cli.main(["bench", "headline", str(path)]) == 0
    assert "| N=8k |" in capsys.readouterr().out


def test_flashx_bench_is_a_plugin_whose_help_is_its_own(capsys):
    """flashx_bench adds `flashx bench` through its entry point; its arguments, --help included, are its own."""
    from importlib.metadata import entry_points

    from flashx import cli as flashx_cli

    (plugin,) = entry_points(group="flashx.plugins", name="bench")
    assert plugin.value == "flashx_bench"
    with pytest.raises(SystemExit) as exit:
        flashx_cli.main(["bench", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashx bench [-h] [--cpu] [--quick]")
    assert "{table,plot,headline,merge}" in out


def test_options_that_would_not_do_what_they_say_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--record", "--quick"])
    assert "--record keeps the full sweep" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--record", "--out", "somewhere"])  # one place or the other
    with pytest.raises(SystemExit):
        cli.main(["--cpu", "--impl", "flex"])
    assert "--impl: options of the GPU sweep" in capsys.readouterr().err


def test_merge_replaces_rows_of_a_rerun(results, tmp_path):
    rerun = {**results, "date": "2026-11-22", "checks": [], "memory": [], "host": [],
             "implementations": results["implementations"][:1] + [
                 {"name": "flex", "label": "FlexAttention (compiled)", "flashx": False, "layout": "BHSD"}],
             "speed": [_row("flashx-triton", "fwd", 128, True, 8192, 0.5), _row("flex", "fwd", 128, True, 8192, 1.0)]}
    merged = report.merge(results, rerun)
    assert [i["name"] for i in merged["implementations"]] == ["flashx-triton", "sdpa-cudnn", "sdpa-math", "flex"]
    assert len(merged["speed"]) == len(results["speed"]) + 1
    ours = [r for r in merged["speed"] if r["impl"] == "flashx-triton" and r["mode"] == "fwd" and r["causal"]
            and r["head_dim"] == 128 and r["seqlen"] == 8192]
    assert [r["ms"] for r in ours] == [0.5]
    assert merged["checks"] == results["checks"] and merged["host"] == results["host"]
    assert merged["merged"][0]["date"] == "2026-11-22" and merged["merged"][0]["sections"] == ["speed"]
    assert "merged in (`flashx bench merge`), each with its own ceilings: 2026-11-22: speed." in report.markdown(merged)
    with pytest.raises(ValueError):
        report.merge(results, {**rerun, "device": "NVIDIA H200"})

    base, extra = tmp_path / "record" / "h100.json", tmp_path / "rerun" / "h100.json"
    records.save_json(results, base)
    records.save_json(rerun, extra)
    pytest.importorskip("matplotlib")
    cli.main(["merge", str(base), str(extra)])
    assert records.load_json(base)["speed"] == merged["speed"]
    history = [(r["impl"], r["metric"], r["date"]) for r in _history(base.parent)]
    assert history == [("", "matmul_tflops", "2026-11-22"), ("", "copy_tbps", "2026-11-22"),
                       ("flashx-triton", "tflops", "2026-11-22"), ("flex", "tflops", "2026-11-22")]


def _host_median_ms(fn, grad_to_none=None):
    """do_bench's protocol with a host clock: the CPU has no CUDA events."""
    fn()
    times = []
    for _ in range(3):
        for x in grad_to_none or ():
            x.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def test_sweep_plumbing_on_cpu(tmp_path, monkeypatch):
    """The whole sweep on tiny CPU shapes: checks, timing rows, host time, failures recorded, the record."""
    monkeypatch.setattr(gpu, "median_ms", _host_median_ms)
    monkeypatch.setattr(gpu, "HOST_CALLS", 2)
    device = torch.device("cpu")
    plan = gpu.Plan(seqlens=(64,), head_dims=(16,), tokens=128, model_dim=32, check_seqlen=64, memory_seqlens=(),
                    host_seqlens=(64,), matmul_size=64, copy_bytes=2**16)
    impls = implementations(device, ["sdpa-math", "sdpa-flash", "sdpa-cudnn"])
    sweep = gpu.Sweep(plan, impls, device, tmp_path)
    results = sweep.run()

    slug = records.stem(results)  # the CPU's model here: this sweep's product is a GPU's record
    assert sweep.path == tmp_path / f"{slug}.partial.json"
    assert records.load_json(sweep.path)["speed"] == results["speed"]  # saved as it went
    checks = {c["impl"]: c for c in results["checks"]}
    assert checks["sdpa-math"]["status"] == "ok" and checks["sdpa-flash"]["status"] == "ok"
    assert checks["sdpa-cudnn"]["status"].startswith("error")  # no cuDNN on the CPU: recorded, not raised
    rows = [r for r in results["speed"] if r["impl"] == "sdpa-flash"]
    assert len(rows) == 2 * 2 and all(r["status"] == "ok" and r["tflops"] > 0 for r in rows)
    host = [r for r in results["host"] if r["impl"] == "sdpa-flash"]
    assert [r["mode"] for r in host] == list(gpu.MODES) and all(r["status"] == "ok" and r["host_us"] > 0 for r in host)
    assert "SDPA flash" in report.markdown(results)
    records.publish(results, tmp_path, report.markdown)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([f"{slug}.json", f"{slug}.md", "history.csv"])


class OneDtype(flashx.Backend):
    """A CPU backend of one dtype and causal attention, chosen last: one that declines a shape, or
    takes no FP8 (its FP8 sibling is declined with flashx's reasons)."""

    version, array_kind = "0", "numpy"
    devices, features = frozenset({"cpu"}), frozenset({"causal"})

    def __init__(self, name: str, dtype: str):
        self.name, self.dtypes = name, frozenset({dtype})

    def available(self):
        return None

    def priority(self, problem):
        return -1


def test_a_backend_that_declines_a_shape_is_recorded_not_raised(tmp_path, monkeypatch):
    """Every flashx backend available on the device runs beside the peers; one that cannot run a
    shape says why on its row, and the sweep goes on."""
    monkeypatch.setattr(gpu, "median_ms", _host_median_ms)
    flashx.registry.register(OneDtype("float16-only", "float16"))
    try:
        device = torch.device("cpu")
        impls = implementations(device)
        assert "flashx-float16-only" in [impl.name for impl in impls]
        plan = gpu.Plan(seqlens=(64,), head_dims=(16,), causals=(True,), tokens=64, model_dim=16)
        sweep = gpu.Sweep(plan, [impl for impl in impls if impl.name == "flashx-float16-only"], device, tmp_path)
        sweep.results["ceilings"] = {"matmul_tflops": 1.0}
        sweep.progress = gpu.Progress(2)
        sweep.speed()
    finally:
        flashx.registry.unregister("float16-only")
    statuses = [row["status"] for row in sweep.results["speed"]]
    assert len(statuses) == 2 and all(s.startswith("declined: backend 'float16-only' cannot run") for s in statuses)
    assert "float16" in statuses[0]


def test_fp8_siblings_are_those_of_backends_that_take_fp8_or_that_issue_43_measures(monkeypatch):
    from flashx_bench import implementations as impls

    flashx.registry.register(OneDtype("bf16-only", "bfloat16"))
    try:
        names = [impl.name for impl in implementations(torch.device("cpu"))]
        ours = [name for name in names if name.startswith("flashx-")]  # the simulators may add numba, triton
        assert names[:len(ours)] == ours  # before the peers
        bf16 = [name for name in ours if not name.endswith("-fp8")]
        assert ours == bf16 + [name for name in ours if name.endswith("-fp8")]  # FP8 after the bf16 ones
        assert {"flashx-numpy", "flashx-bf16-only"} <= set(bf16)
        assert "flashx-numpy-fp8" in ours and "flashx-bf16-only-fp8" not in ours  # numpy takes FP8
        monkeypatch.setattr(impls, "FP8_BACKENDS", ("bf16-only",))
        assert "flashx-bf16-only-fp8" in [impl.name for impl in implementations(torch.device("cpu"))]
    finally:
        flashx.registry.unregister("bf16-only")
    fp8 = impls.flashx_fp8("triton")
    assert (fp8.name, fp8.label, fp8.backend, fp8.fp8, fp8.features) == (
        "flashx-triton-fp8", "flashx triton FP8", "triton", "float8_e4m3fn", frozenset())
    assert (fp8.check_tolerance, impls.flashx_backend("triton").check_tolerance) == (0.1, 1e-2)
    assert fp8.describe() == {"name": "flashx-triton-fp8", "label": "flashx triton FP8", "flashx": True,
                              "layout": "BSHD", "backend": "triton", "dtype": "float8_e4m3fn"}


def test_fp8_implementations_in_the_sweep_on_cpu(tmp_path, monkeypatch):
    """FP8 siblings on tiny CPU shapes: flashx's NumPy backend on e4m3 casts of the inputs (o checked
    under the FP8 tolerance, the forward timed, the rest not applicable), a backend that takes no
    FP8 (declined, with flashx's reasons), and an FP8 kernel that doubles o (WRONG)."""
    import dataclasses

    from flashx_bench.implementations import flashx_backend, flashx_fp8

    monkeypatch.setattr(gpu, "median_ms", _host_median_ms)
    monkeypatch.setattr(gpu, "HOST_CALLS", 2)
    numpy_fp8 = flashx_fp8("numpy")
    doubled = dataclasses.replace(numpy_fp8, name="doubled-fp8", label="doubled FP8",
                                  build=lambda shape, device: lambda q, k, v: 2 * numpy_fp8.build(shape, device)(q, k, v))
    plan = gpu.Plan(seqlens=(64,), head_dims=(16,), tokens=128, model_dim=32, check_seqlen=64, memory_seqlens=(64,),
                    host_seqlens=(64,), matmul_size=64, copy_bytes=2**16)
    flashx.registry.register(OneDtype("bf16-only", "bfloat16"))
    try:
        impls = [flashx_backend("numpy"), numpy_fp8, flashx_fp8("bf16-only"), doubled]
        results = gpu.Sweep(plan, impls, torch.device("cpu"), tmp_path).run()
    finally:
        flashx.registry.unregister("bf16-only")

    checks = {(c["impl"], c["causal"]): c for c in results["checks"]}
    for causal in (False, True):
        ours = checks["flashx-numpy-fp8", causal]
        assert ours["status"] == "ok" and set(ours["errors"]) == {"o"} and 1e-2 < ours["errors"]["o"] < 0.1
        assert checks["doubled-fp8", causal]["status"] == "wrong"
        declined = checks["flashx-bf16-only-fp8", causal]["status"]
        assert declined.startswith("declined: ") and "float8_e4m3fn" in declined
    speed = {(r["impl"], r["mode"], r["causal"]): r["status"] for r in results["speed"]}
    assert speed["flashx-numpy-fp8", "fwd", True] == "ok"
    assert speed["flashx-numpy-fp8", "fwd+bwd", True] == speed["doubled-fp8", "fwd+bwd", False] == report.NOT_APPLICABLE
    assert speed["flashx-bf16-only-fp8", "fwd", False].startswith("declined: ")
    memory = {r["impl"]: r["status"] for r in results["memory"]}
    assert memory["flashx-numpy-fp8"] == report.NOT_APPLICABLE
    host = {(r["impl"], r["mode"]): r for r in results["host"]}
    assert host["flashx-numpy-fp8", "fwd"]["host_us"] > 0
    assert host["flashx-numpy-fp8", "fwd+bwd"]["status"] == report.NOT_APPLICABLE
    assert results["timing"]["fp8_check_tolerance"] == 0.1
    assert {r["impl"] for r in report.fp8_ratios(results)} == {"flashx-numpy-fp8", "doubled-fp8"}
    text = report.markdown(results)
    assert "| 16 | no | 64 |" in text.split("### FP8 forward")[1] and "WRONG" in text.split("### FP8 forward")[1]


def test_dense_scores_are_skipped_where_they_cannot_fit(tmp_path):
    device = torch.device("cpu")
    sweep = gpu.Sweep(gpu.QUICK, implementations(device, ["sdpa-math"]), device, tmp_path)
    math = sweep.impls[0]
    huge = Shape(1, 2**22, 16, 128, True)
    assert sweep.skip_reason(math, huge, "fwd+bwd").startswith("skipped: N*N float32 scores")
    assert sweep.skip_reason(math, Shape(1, 1024, 16, 128, True), "fwd+bwd") is None


def test_cpu_mode_writes_one_record_and_one_honest_number(tmp_path, capsys):
    peaks = []
    for _ in range(2):
        assert cli.run_cpu(tmp_path, batch=1, heads=2, seqlen=128, head_dim=16, memory_seqlen=128, repeats=3) == 0
        peaks.append(records.load_json(tmp_path / "cpu.json")["memory"]["peak_extra_bytes"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cpu.json", "cpu.md", "history.csv"]
    results = records.load_json(tmp_path / "cpu.json")
    assert results["threads"]["numpy_backend_workers"] == results["threads"]["torch"] >= 1  # the same threads
    times = results["forward"]
    assert results["speed_vs_torch_sdpa"] == statistics.median(
        t / n for t, n in zip(times["sdpa"]["times_s"], times["flashx-numpy"]["times_s"]))
    text = (tmp_path / "cpu.md").read_text()
    assert text.count("x the speed of torch SDPA") == 1 and "paired" not in text
    assert f"{results['speed_vs_torch_sdpa']:.2f}x the speed" in capsys.readouterr().out
    history = _history(tmp_path)
    assert [(r["impl"], r["metric"]) for r in history[:3]] == [("flashx-numpy", "ms"), ("sdpa", "ms"),
                                                               ("flashx-numpy", "peak_mib")]
    # two runs, three numbers each; a peak equal to the first run's is already in the history
    assert len(history) == (5 if peaks[0] == peaks[1] else 6)


# FlashAttention-4 and the feature sweep --------------------------------------------------------


def test_fa4_is_a_peer_where_flash_attn_cute_imports(monkeypatch):
    """`fa4` joins the peers on CUDA when `from flash_attn.cute import flash_attn_func` works, and is
    absent with the reason where not; its adapter passes causal, softcap and the sinks as FA4 names them."""
    from types import ModuleType

    from flashx_bench import implementations as impls

    cuda = torch.device("cuda")  # a device name: nothing here runs on it
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not importable, whatever is installed
    impls.fa4_missing.cache_clear()
    assert "fa4" not in [impl.name for impl in implementations(cuda)]
    assert "flash_attn.cute" in impls.absent(cuda)["fa4"] and impls.fa4_version() is None
    assert impls.absent(torch.device("cpu")) == {}  # FA4 is a CUDA peer: on the CPU, nothing is missing

    calls = []

    def flash_attn_func(q, k, v, **keywords):
        calls.append(keywords)
        return q * 2, None  # (out, lse), as FA4 returns them

    package, cute = ModuleType("flash_attn"), ModuleType("flash_attn.cute")
    package.__version__, package.cute, cute.flash_attn_func = "4.0.0b36", cute, flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    impls.fa4_missing.cache_clear()
    try:
        found = [impl.name for impl in implementations(cuda)]
        assert found[found.index("fa4") + 1:] == [impl.name for impl in impls.PEERS]
        assert impls.absent(cuda) == {} and impls.fa4_version() == "4.0.0b36"
        assert "fa4" not in [impl.name for impl in implementations(torch.device("cpu"))]
        sinks = torch.zeros(4)
        q = torch.ones(1, 8, 4, 16)
        attend = impls.FA4.build(Shape(1, 8, 4, 16, True), cuda, softcap=50.0, sinks=sinks)
        assert torch.equal(attend(q, q, q), 2 * q)
        assert calls[-1] == {"causal": True, "softcap": 50.0, "learnable_sink": sinks}
        impls.FA4.build(Shape(1, 8, 4, 16, False), cuda)(q, q, q)
        assert calls[-1] == {"causal": False, "softcap": 0.0, "learnable_sink": None}  # FA4's "no softcap"
        assert (impls.FA4.layout, impls.FA4.features) == ("BSHD", frozenset({"softcap", "sinks"}))
    finally:
        impls.fa4_missing.cache_clear()


def test_alibi_slopes_are_blooms():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    assert features.alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    for heads in (1, 4, 12, 16, 24, 40):
        bloom = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]  # slope times position 1
        assert features.alibi_slopes(heads) == pytest.approx(bloom.tolist(), rel=1e-6)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keywords", [
    {},
    {"softcap": 2.0},
    {"alibi_slopes": [0.5, 0.125, 1.0]},
    {"alibi_slopes": [[0.5, 0.125, 1.0], [0.25, 2.0, 0.0625]]},
    {"sinks": [0.5, -1.0, 2.0]},
    {"softcap": 2.0, "alibi_slopes": [0.5, 0.125, 1.0], "sinks": [0.5, -1.0, 2.0]},
], ids=["none", "softcap", "alibi", "alibi-per-batch", "sinks", "all"])
def test_the_feature_reference_is_the_contract(keywords, causal):
    """The sweep's float32 reference, run in float64, against flashx's NumPy backend (the contract's
    answer): o, dq, dk, dv and dsinks. Nq < Nk, so that ALiBi and causal are aligned bottom-right."""
    import numpy as np

    rng = np.random.default_rng(7)
    q, do = (rng.standard_normal((2, 5, 3, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 9, 3, 8)) for _ in range(2))
    options = {name: np.asarray(value, dtype=np.float64) if isinstance(value, list) else value
               for name, value in keywords.items()}
    o, res = flashx.attention_forward(q, k, v, causal=causal, backend="numpy", **options)
    gradients = flashx.attention_backward(do, q, k, v, o, res, causal=causal, backend="numpy", **options)
    expected = dict(zip(("o", "dq", "dk", "dv", "dsinks"), (o, *gradients)))

    tensors = {name: torch.from_numpy(value) if isinstance(value, np.ndarray) else value for name, value in options.items()}
    got = features.reference_outputs([torch.from_numpy(x) for x in (q, k, v, do)], causal, tensors, dtype=torch.float64)
    assert sorted(got) == sorted(expected)
    for name, value in got.items():
        value = value.transpose(1, 2) if value.dim() == 4 else value  # BHSD, as the GPU outputs are compared
        np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.filterwarnings("ignore::UserWarning")  # flex_attention runs eagerly here, and says so
def test_flex_score_mod_is_the_reference():
    from torch.nn.attention.flex_attention import flex_attention

    from flashx_bench.implementations import flex_score_mod

    assert flex_score_mod() is None
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 8) for _ in range(3))  # BSHD
    slopes = torch.tensor(features.alibi_slopes(4))
    for keywords in ({"softcap": 1.5}, {"alibi_slopes": slopes}, {"softcap": 1.5, "alibi_slopes": slopes}):
        o = flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), score_mod=flex_score_mod(**keywords))
        expected = features.reference(q, k, v, causal=False, **keywords)
        torch.testing.assert_close(o.transpose(1, 2), expected, rtol=1e-5, atol=1e-5)


def _feature_row(impl, feature, mode, causal, ms):
    shape = Shape(2, 8192, 16, 128, causal)
    return {"impl": impl, "feature": feature, "mode": mode, "batch": 2, "seqlen": 8192, "heads": 16, "head_dim": 128,
            "causal": causal, "status": "ok", "ms": ms, "sm_mhz": 1900.0, "wall_s": 1.0,
            "tflops": gpu.attention_flops(shape, mode) / ms / 1e9}


@pytest.fixture
def feature_results():
    """A feature run as the sweep writes it. Times (ms) without a feature: triton 1.0, FA4 0.8, Flex 2.0, cuDNN 0.9;
    triton's softcap 1.05 (0.95 of its speed), ALiBi 1.25 (0.80: misses the target) forward+backward causal, 1.0
    elsewhere; sinks declined by triton; FA4's softcap 0.84 and sinks 0.88; Flex's ALiBi WRONG in the check."""
    ms = {("flashx-triton", "none"): 1.0, ("flashx-triton", "softcap"): 1.05, ("flashx-triton", "alibi"): 1.0,
          ("fa4", "none"): 0.8, ("fa4", "softcap"): 0.84, ("fa4", "sinks"): 0.88,
          ("flex", "none"): 2.0, ("flex", "softcap"): 2.2, ("sdpa-cudnn", "none"): 0.9}
    speed = []
    for causal in (False, True):
        for feature in features.FEATURES:
            for impl in ("flashx-triton", "fa4", "flex", "sdpa-cudnn"):
                for mode in gpu.MODES:
                    if (impl, feature) in ms:
                        slow = 1.25 if (impl, feature, mode, causal) == ("flashx-triton", "alibi", "fwd+bwd", True) else 1
                        speed.append(_feature_row(impl, feature, mode, causal, ms[impl, feature] * slow))
                    elif (impl, feature) == ("flashx-triton", "sinks"):
                        speed.append({**_feature_row(impl, feature, mode, causal, 1.0), "status": "declined: sinks: "
                                      "not supported", "ms": None, "tflops": None})
                    elif (impl, feature) == ("flex", "alibi"):
                        speed.append({**_feature_row(impl, feature, mode, causal, 1.0),
                                      "status": "not timed: WRONG in the check", "ms": None, "tflops": None})

    def check(impl, feature, causal, status="ok", error=3e-3):
        errors = None if status.startswith("declined") else {"o": error, "dq": 4e-3}
        return {"impl": impl, "feature": feature, "batch": 2, "seqlen": 256, "heads": 4, "head_dim": 128,
                "causal": causal, "status": status, "errors": errors,
                "max_abs": errors and {"o": 0.02, "dq": 0.03}}

    checks = [check("flashx-triton", "softcap", False), check("flashx-triton", "sinks", False, "declined: sinks: not supported"),
              check("flex", "alibi", False, "wrong", 0.4), check("fa4", "sinks", True)]
    return {"kind": "features", "device": "NVIDIA H100 80GB HBM3", "device_memory_gib": 79.2, "date": "2026-11-29",
            "versions": {"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "flashx": "0.1.0",
                         "flash-attn-4": "4.0.0b36"},
            "absent": {}, "shape": {"dtype": "bfloat16", "batch": 2, "seqlen": 8192, "heads": 16, "head_dim": 128},
            "check_shape": {"batch": 2, "seqlen": 256, "heads": 4, "head_dim": 128}, "softcap": 50.0,
            "alibi_slopes": features.alibi_slopes(16),
            "timing": {"warmup_ms": 25, "rep_ms": 100, "rest_s": 1.0, "statistic": "median", "check_tolerance": 1e-2},
            "implementations": [
                {"name": "flashx-triton", "label": "flashx triton", "flashx": True, "layout": "BSHD",
                 "features": ["alibi", "sinks", "softcap"]},
                {"name": "fa4", "label": "FlashAttention-4", "flashx": False, "layout": "BSHD", "features": ["sinks", "softcap"]},
                {"name": "flex", "label": "FlexAttention (compiled)", "flashx": False, "layout": "BHSD",
                 "features": ["alibi", "softcap"]},
                {"name": "sdpa-cudnn", "label": "SDPA cuDNN", "flashx": False, "layout": "BHSD", "features": []}],
            "checks": checks, "speed": speed}


def test_feature_ratios_are_the_time_without_over_the_time_with(feature_results):
    ratios = {(r["impl"], r["feature"], r["mode"], r["causal"]): r["ratio"] for r in features.feature_ratios(feature_results)}
    assert ratios["flashx-triton", "softcap", "fwd", False] == pytest.approx(1 / 1.05)
    assert ratios["flashx-triton", "alibi", "fwd+bwd", True] == pytest.approx(0.8)
    assert ratios["flashx-triton", "alibi", "fwd", True] == pytest.approx(1.0)
    assert ratios["fa4", "sinks", "fwd", False] == pytest.approx(0.8 / 0.88)
    assert ratios["flex", "softcap", "fwd+bwd", True] == pytest.approx(2.0 / 2.2)
    assert not any(key[1] == "sinks" and key[0] == "flashx-triton" for key in ratios)  # declined: no ratio
    assert not any(key[0] == "flex" and key[1] == "alibi" for key in ratios)  # wrong: never timed
    assert len(ratios) == 2 * 2 * (2 + 2 + 1)  # triton softcap, alibi; FA4 softcap, sinks; Flex softcap

    versus = {(r["impl"], r["feature"], r["mode"], r["causal"]): r["ratio"] for r in features.fa4_ratios(feature_results)}
    assert set(versus) == {("flashx-triton", feature, mode, causal) for feature in ("none", "softcap")
                           for mode in gpu.MODES for causal in (False, True)}  # FA4 has no ALiBi; triton no sinks
    assert versus["flashx-triton", "none", "fwd", False] == pytest.approx(0.8)
    assert versus["flashx-triton", "softcap", "fwd+bwd", True] == pytest.approx(0.84 / 1.05)


def test_feature_targets(feature_results):
    found = {(t["impl"], t["feature"]): t for t in features.targets(feature_results)}
    assert list(found) == [("flashx-triton", "softcap"), ("flashx-triton", "alibi"), ("flashx-triton", "sinks")]
    assert found["flashx-triton", "softcap"]["met"] and found["flashx-triton", "softcap"]["measured"].startswith("worst 0.95 (fwd,")
    assert found["flashx-triton", "alibi"] == {"impl": "flashx-triton", "feature": "alibi", "met": False,
                                               "measured": "worst 0.80 (fwd+bwd, causal)"}
    assert found["flashx-triton", "sinks"]["measured"] == "declined" and not found["flashx-triton", "sinks"]["met"]
    cut = ("flashx-triton", "softcap", "fwd", True)  # one point left when the time limit struck
    partial = {**feature_results, "speed": [
        {**r, "status": "skipped: time limit", "ms": None} if (r["impl"], r["feature"], r["mode"], r["causal"]) == cut
        else r for r in feature_results["speed"]]}
    softcap = next(t for t in features.targets(partial) if t["feature"] == "softcap")
    assert softcap["measured"].endswith("3 of 4 points measured") and not softcap["met"]


def test_feature_markdown(feature_results):
    text = features.markdown(feature_results)
    assert text.startswith("# flashx features: NVIDIA H100 80GB HBM3, 2026-11-29\n")
    assert "flash-attn-4 4.0.0b36" in text and "softcap c = 50 (Gemma 2's)" in text
    assert "| flashx triton | softcap | worst 0.95 (fwd, not causal) | yes |" in text
    assert "| flashx triton | alibi | worst 0.80 (fwd+bwd, causal) | **no** |" in text
    forward = text.split("## Speed, forward: ")[1].split("##")[0]
    plain = gpu.attention_flops(Shape(2, 8192, 16, 128, False), "fwd") / 1e9
    assert (f"| no | none | {plain:.0f} | {plain / 0.8:.0f} | {plain / 2:.0f} | {plain / 0.9:.0f} |") in forward
    assert f"| no | softcap | {plain / 1.05:.0f} (0.95) | {plain / 0.84:.0f} (0.95) | {plain / 2.2:.0f} (0.91) | n/a |" in forward
    assert f"| no | alibi | {plain:.0f} (1.00) | n/a | not timed | n/a |" in forward
    assert f"| no | sinks | declined | {plain / 0.88:.0f} (0.91) | n/a | n/a |" in forward
    both = text.split("## Speed, forward+backward: ")[1].split("##")[0]
    assert "(0.80) | n/a | not timed | n/a |" in both.split("| yes | alibi |")[1].splitlines()[0]
    versus = text.split("## flashx / FA4 with the same feature (FA4's time / flashx's time)")[1].split("##")[0]
    assert "| mode | causal | feature | flashx triton |" in versus
    assert "| fwd | no | none | 0.80 |" in versus and "| fwd+bwd | yes | softcap | 0.80 |" in versus
    assert "alibi" not in versus and "sinks" not in versus
    checks = text.split("## Checks")[1].split("##")[0]
    assert "| FlexAttention (compiled) | alibi | no | **WRONG** | 4.0e-01 (o) | 3.0e-02 (dq) |" in checks
    assert "| flashx triton | sinks | no | declined |  |  |" in checks
    assert "- flashx triton, sinks: declined: sinks: not supported" in text
    assert "- FlexAttention (compiled), alibi: not timed: WRONG in the check" in text
    for line in text.splitlines():
        if line.startswith("|"):
            assert line.endswith("|")
    absent = features.markdown({**feature_results, "absent": {"fa4": "`from flash_attn.cute import ...` failed"}})
    assert "- fa4: absent: `from flash_attn.cute import ...` failed" in absent


def test_feature_record_and_history(feature_results, tmp_path, capsys):
    records.publish(feature_results, tmp_path, features.markdown)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["features-h100.json", "features-h100.md", "history.csv"]
    history = _history(tmp_path)
    speed = [r for r in history if r["metric"] == "tflops"]
    assert len(speed) == sum(r["status"] == "ok" for r in feature_results["speed"])
    assert {r["mode"] for r in speed} == {"fwd", "fwd+bwd", "fwd softcap", "fwd+bwd softcap", "fwd alibi",
                                          "fwd+bwd alibi", "fwd sinks", "fwd+bwd sinks"}
    row = next(r for r in speed if (r["impl"], r["mode"], r["causal"]) == ("fa4", "fwd sinks", "False"))
    assert float(row["value"]) == pytest.approx(gpu.attention_flops(Shape(2, 8192, 16, 128, False), "fwd") / 0.88e9,
                                                rel=1e-5)
    assert (row["dtype"], row["seqlen"], row["heads"], row["torch"]) == ("bfloat16", "8192", "16", "2.11.0")
    errors = [(r["impl"], r["mode"], r["value"]) for r in history if r["metric"] == "rel_error"]
    assert errors == [("flashx-triton", "fwd+bwd softcap", "0.004"), ("flex", "fwd+bwd alibi", "0.4"),
                      ("fa4", "fwd+bwd sinks", "0.004")]  # a declined check has no number

    (tmp_path / "features-h100.md").unlink()
    assert cli.main(["features", "report", str(tmp_path / "features-h100.json")]) == 0
    assert (tmp_path / "features-h100.md").read_text() == features.markdown(feature_results)
    assert "## Targets (issue 40)" in capsys.readouterr().out


def test_feature_options(capsys):
    args = features.parse_args([])
    assert (args.command, args.out, args.impl, args.features, args.batch, args.seqlen, args.heads, args.head_dim,
            args.time_limit) == ("run", records.DEFAULT_OUT.resolve(), None, list(features.FEATURES), 2, 8192, 16, 128, None)
    args = features.parse_args(["--impl", "flashx-triton", "fa4", "--features", "none", "sinks", "--seqlen", "4096",
                                "--head-dim", "64", "--time-limit", "300", "--out", "elsewhere"])
    assert (args.out.name, args.impl, args.features, args.seqlen, args.head_dim, args.time_limit) == (
        "elsewhere", ["flashx-triton", "fa4"], ["none", "sinks"], 4096, 64, 300.0)
    assert features.parse_args(["--record", "--time-limit", "500"]).out == records.CHECKOUT_RESULTS
    for refused in (["--record", "--seqlen", "4096"], ["--record", "--features", "none"], ["--record", "--out", "x"],
                    ["report"], ["--features", "dropout"]):
        with pytest.raises(SystemExit):
            features.parse_args(refused)
    with pytest.raises(SystemExit):
        features.parse_args(["--record", "--impl", "fa4"])
    assert "--impl runs part of it" in capsys.readouterr().err


def test_flashx_bench_features_fails_loudly_without_a_gpu(monkeypatch, tmp_path):
    from flashx import cli as flashx_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit:
        flashx_cli.main(["bench", "features", "--out", str(tmp_path)])
    assert "no CUDA device here" in str(exit.value.code)
    assert not any(tmp_path.iterdir())  # nothing written
    with pytest.raises(SystemExit) as exit:
        cli.main(["features", "--help"])
    assert exit.value.code == 0


def test_feature_sweep_plumbing_on_cpu(tmp_path, monkeypatch):
    """The whole feature sweep on tiny CPU shapes: flashx's NumPy backend with every feature, one
    backend that declines them (flashx's reasons on its rows; it cannot run at all, an error), one
    implementation that ignores its ALiBi slopes (WRONG in the check, never timed), SDPA math
    without a feature; the record."""
    import dataclasses

    from flashx_bench.implementations import flashx_backend, sdpa
    from torch.nn.attention import SDPBackend

    class NoFeatures(flashx.Backend):
        name, version, array_kind = "no-features", "0", "numpy"
        devices, dtypes, features = frozenset({"cpu"}), frozenset({"float32"}), frozenset({"causal"})

        def available(self):
            return None

        def priority(self, problem):
            return -1

    monkeypatch.setattr(gpu, "median_ms", _host_median_ms)
    monkeypatch.setattr(features, "CHECK_SHAPE", {"batch": 1, "seqlen": 32, "heads": 2})
    math = sdpa("sdpa-math", "SDPA math", SDPBackend.MATH)
    ignores_alibi = dataclasses.replace(math, name="ignores-alibi", label="ignores ALiBi",
                                        build=lambda shape, device, alibi_slopes=None: math.build(shape, device),
                                        features=frozenset({"alibi"}))
    impls = [flashx_backend("numpy"), flashx_backend("no-features"), ignores_alibi, math]
    args = features.parse_args(["--out", str(tmp_path), "--batch", "1", "--seqlen", "64", "--heads", "2",
                                "--head-dim", "16"])
    flashx.registry.register(NoFeatures())
    try:
        sweep = features.FeatureSweep(args, impls, torch.device("cpu"), dtype="float32")
        results = sweep.run()
    finally:
        flashx.registry.unregister("no-features")

    assert sweep.path == records.partial_path(tmp_path, records.stem(results))
    assert records.stem(results).startswith("features-")
    checks = {(c["impl"], c["feature"], c["causal"]): c for c in results["checks"]}
    assert len(checks) == 2 * (4 + 4 + 2 + 1)
    assert all(checks["flashx-numpy", feature, causal]["status"] == "ok" for feature in features.FEATURES
               for causal in (False, True))
    assert set(checks["flashx-numpy", "sinks", True]["errors"]) == {"o", "dq", "dk", "dv", "dsinks"}
    assert checks["flashx-numpy", "sinks", True]["errors"]["dsinks"] < 1e-5
    assert checks["ignores-alibi", "none", True]["status"] == "ok"
    assert checks["ignores-alibi", "alibi", True]["status"] == "wrong"
    assert checks["ignores-alibi", "alibi", True]["errors"]["o"] > 0.1
    declined = checks["flashx-no-features", "alibi", True]["status"]
    assert declined == "declined: does not support ALiBi slopes"  # flashx.explain's reason
    assert checks["flashx-no-features", "none", True]["status"].startswith("error: NotImplementedError")

    rows = {(r["impl"], r["feature"], r["mode"], r["causal"]): r for r in results["speed"]}
    assert len(rows) == 2 * 2 * (4 + 4 + 2 + 1)
    assert all(rows["flashx-numpy", feature, mode, causal]["status"] == "ok" and rows["flashx-numpy", feature, mode,
               causal]["tflops"] > 0 for feature in features.FEATURES for mode in gpu.MODES for causal in (False, True))
    assert rows["flashx-no-features", "alibi", "fwd", False]["status"] == declined
    assert rows["flashx-no-features", "none", "fwd+bwd", True]["status"].startswith("error: NotImplementedError")
    assert rows["ignores-alibi", "alibi", "fwd+bwd", False]["status"] == "not timed: WRONG in the check"
    assert rows["ignores-alibi", "none", "fwd+bwd", False]["status"] == "ok"
    text = features.markdown(results)
    assert "| ignores ALiBi | alibi | yes | **WRONG** |" in text
    assert "| flashx numpy | flashx no-features | ignores ALiBi | SDPA math |" in text
    records.publish(results, tmp_path, features.markdown)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [f"{records.stem(results)}.json", f"{records.stem(results)}.md", "history.csv"])


def test_timings_wait_for_what_a_first_call_left_running(monkeypatch):
    """A timing starts after every flashx backend has settled (``Backend.settle``): a backend
    still compiling elsewhere after the first call would be timed out of its steady state."""
    settled = []

    class Compiling(OneDtype):
        def settle(self):
            settled.append(self.name)

    monkeypatch.setattr(gpu, "median_ms", lambda fn, grad_to_none: settled.append("timed") or 1.0)
    flashx.registry.register(Compiling("compiling", "float16"))
    try:
        gpu._rested_median_ms(lambda: settled.append("first call"), (), torch.device("cpu"))
    finally:
        flashx.registry.unregister("compiling")
    assert settled == ["first call", "compiling", "timed"]


def test_first_call_script_names_what_it_cannot_run():
    """scripts/first_call.py runs flashx backends by name; another name is refused with the ones it
    takes, before any case starts."""
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "first_call.py")
    done = subprocess.run([sys.executable, script], check=False, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, FIRST_CALL_BACKENDS="triton,flex"))
    assert done.returncode == 1
    assert "(triton, cupy, numba), not flex" in done.stderr
