"""The benchmark harness on the CPU: FLOP counting, tables, plots, the sweep's plumbing. No timing assertions."""

import statistics
import time

import pytest
import torch

from benchmarks import __main__ as cli
from benchmarks import gpu, report
from benchmarks.implementations import Shape, causal_block_mask, implementations


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
    assert gpu.device_slug(name) == slug


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
        "sections_s": {"ceilings": 2.0, "check": 10.0, "memory": 30.0, "speed": 300.0},
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


def test_commands_redraw_from_json(results, tmp_path, capsys):
    path = tmp_path / "h100-2026-11-21.json"
    report.save_json(results, path)
    cli.main(["table", str(path)])
    assert path.with_suffix(".md").read_text() == report.markdown(results)
    cli.main(["headline", str(path), "--seqlen", "4096"])
    assert "| N=4k |" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    cli.main(["plot", str(path)])
    for png in (path.with_suffix(".png"), tmp_path / "h100-2026-11-21-memory.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_replaces_rows_of_a_rerun(results):
    rerun = {**results, "date": "2026-11-22", "checks": [], "memory": [],
             "implementations": results["implementations"][:1] + [
                 {"name": "flex", "label": "FlexAttention (compiled)", "flashx": False, "layout": "BHSD"}],
             "speed": [_row("flashx-triton", "fwd", 128, True, 8192, 0.5), _row("flex", "fwd", 128, True, 8192, 1.0)]}
    merged = report.merge(results, rerun)
    assert [i["name"] for i in merged["implementations"]] == ["flashx-triton", "sdpa-cudnn", "sdpa-math", "flex"]
    assert len(merged["speed"]) == len(results["speed"]) + 1
    ours = [r for r in merged["speed"] if r["impl"] == "flashx-triton" and r["mode"] == "fwd" and r["causal"]
            and r["head_dim"] == 128 and r["seqlen"] == 8192]
    assert [r["ms"] for r in ours] == [0.5]
    assert merged["checks"] == results["checks"] and merged["merged"][0]["date"] == "2026-11-22"
    with pytest.raises(ValueError):
        report.merge(results, {**rerun, "device": "NVIDIA H200"})


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
    """The whole sweep on tiny CPU shapes: checks, timing rows, failures recorded, JSON and tables."""
    monkeypatch.setattr(gpu, "median_ms", _host_median_ms)
    device = torch.device("cpu")
    plan = gpu.Plan(seqlens=(64,), head_dims=(16,), tokens=128, model_dim=32, check_seqlen=64, memory_seqlens=(),
                    matmul_size=64, copy_bytes=2**16)
    impls = implementations(device, ["sdpa-math", "sdpa-flash", "sdpa-cudnn"])
    sweep = gpu.Sweep(plan, impls, device, tmp_path, suffix="-test")
    results = sweep.run()

    assert sweep.path.exists() and sweep.path.name.endswith("-test.json")
    assert report.load_json(sweep.path)["speed"] == results["speed"]
    checks = {c["impl"]: c for c in results["checks"]}
    assert checks["sdpa-math"]["status"] == "ok" and checks["sdpa-flash"]["status"] == "ok"
    assert checks["sdpa-cudnn"]["status"].startswith("error")  # no cuDNN on the CPU: recorded, not raised
    rows = [r for r in results["speed"] if r["impl"] == "sdpa-flash"]
    assert len(rows) == 2 * 2 and all(r["status"] == "ok" and r["tflops"] > 0 for r in rows)
    assert "SDPA flash" in report.markdown(results)


def test_dense_scores_are_skipped_where_they_cannot_fit(tmp_path):
    device = torch.device("cpu")
    sweep = gpu.Sweep(gpu.QUICK, implementations(device, ["sdpa-math"]), device, tmp_path)
    math = sweep.impls[0]
    huge = Shape(1, 2**22, 16, 128, True)
    assert sweep._skip_reason(math, huge, "fwd+bwd").startswith("skipped: N*N float32 scores")
    assert sweep._skip_reason(math, Shape(1, 1024, 16, 128, True), "fwd+bwd") is None


def test_cpu_mode_writes_json_and_markdown(tmp_path):
    pytest.importorskip("benchmarks.cpu")
    path = cli.run_cpu(tmp_path, batch=1, heads=2, seqlen=128, head_dim=16, memory_seqlen=128, repeats=1)
    assert report.load_json(path)["shape"]["seqlen"] == 128
    assert "| flashx numpy |" in path.with_suffix(".md").read_text()
