"""The benchmark harness on the CPU: FLOP counting, tables, plots, the records and the sweep's
plumbing. No timing assertions."""

import csv
import statistics
import time

import pytest
import torch

import flashx
from flashx_bench import cli, decode, gpu, records, report
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
              "copy_tbps": 3.0, "rows": [{"impl": "flashx", "batch": 1, "cache": 16384, "status": "ok", "tbps": 2.7},
                                         {"impl": "sdpa-flash", "batch": 1, "cache": 16384, "status": "OOM"}]}
    records.publish(decode, tmp_path, lambda results: "decode table\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["decode-h100.json", "decode-h100.md", "history.csv"]
    rows = [(r["impl"], r["mode"], r["batch"], r["seqlen"], r["heads"], r["head_dim"], r["metric"], r["value"])
            for r in _history(tmp_path)]
    assert rows == [("", "", "", "", "", "", "copy_tbps", "3"), ("flashx", "decode", "1", "16384", "32", "128", "tbps", "2.7")]



def _decode_row(impl, batch, cache, tbps):
    size = decode._kv_bytes(batch, cache)
    return {"impl": impl, "batch": batch, "cache": cache, "bytes": size, "status": "ok", "ms": size / tbps / 1e9,
            "timing": "graph", "tbps": tbps, "copy_fraction": tbps / 3.0}


@pytest.fixture
def decode_results():
    """Two points of the decode sweep on a 3.0 TB/s device: flashx behind cuDNN at B=1, ahead at B=4;
    pages of 16 out of memory at B=4."""
    speeds = {(1, 16384): {"flashx": 2.7, "flashx-page256": 2.25, "flashx-page16": 2.6, "flashx-page1": 2.5,
                           "sdpa-cudnn": 3.0, "sdpa-flash": 2.4},
              (4, 65536): {"flashx": 3.0, "flashx-page256": 2.0, "flashx-page16": None, "flashx-page1": 2.9,
                           "sdpa-cudnn": 2.9, "sdpa-flash": 2.8}}
    rows = [_decode_row(impl, batch, cache, tbps) if tbps else
            {"impl": impl, "batch": batch, "cache": cache, "status": "error: OutOfMemoryError: CUDA out of memory"}
            for (batch, cache), point in speeds.items() for impl, tbps in point.items()]
    return {"kind": "decode", "device": "NVIDIA H100 80GB HBM3", "sm_count": 132, "date": "2026-11-25",
            "versions": {"torch": "2.11.0", "triton": "3.6.0", "flashx": "0.1.0"},
            "shape": {**decode.SHAPE, "dtype": "bfloat16", "seqlen_q": 1}, "labels": decode.LABELS, "copy_tbps": 3.0,
            "rows": rows, "notes": ["Measured with tiles since replaced."],
            "splits_scan": [{"batch": 1, "cache": 16384, "chosen": 16, "tbps": {"0": 2.7, "1": 0.2, "16": 2.7}}]}


def test_decode_options():
    args = decode.parse_args([])
    assert (args.command, args.out, args.batches, args.caches, args.scan_splits, args.time_limit) == (
        "run", records.DEFAULT_OUT.resolve(), list(decode.BATCHES), list(decode.CACHES), False, None)
    args = decode.parse_args(["--scan-splits", "--batches", "1", "4", "--caches", "1024", "--max-tokens", "4096",
                              "--time-limit", "60", "--out", "elsewhere"])
    assert (args.out.name, args.batches, args.caches, args.max_tokens, args.scan_splits, args.time_limit) == (
        "elsewhere", [1, 4], [1024], 4096, True, 60.0)
    assert decode.parse_args(["--record", "--scan-splits"]).out == records.CHECKOUT_RESULTS
    for refused in (["--record", "--caches", "1024"], ["--record", "--out", "elsewhere"], ["report"]):
        with pytest.raises(SystemExit):
            decode.parse_args(refused)


def test_decode_rows_name_the_split_count_the_triton_backend_reports():
    q = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16)
    keys, values = (torch.zeros(2, 1024, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((2,), 1000, dtype=torch.int32)
    assert decode._chosen_splits(q, keys, values, lengths, num_splits=3) == 3
    table = torch.arange(2 * 64, dtype=torch.int32).view(2, 64)
    k_pages, v_pages = (torch.zeros(2 * 64, 16, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    assert decode._chosen_splits(q, k_pages, v_pages, lengths, block_table=table, num_splits=5) == 5


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
    assert len(history) == 1 + 11  # the copy bandwidth, and every row but the out-of-memory one
    assert [(r["impl"], r["batch"], r["seqlen"], r["metric"], r["value"]) for r in history[:2]] == [
        ("", "", "", "copy_tbps", "3"), ("flashx", "1", "16384", "tbps", "2.7")]


def test_decode_markdown(decode_results):
    text = decode.markdown(decode_results)
    assert "**Note.** Measured with tiles since replaced.\n" in text
    assert "| B=1, L=16k: >= 85% of copy bandwidth | 90.0% (2.70 of 3.00 TB/s) | yes |" in text
    assert "| >= 1.0x the faster of cuDNN and FA2 at every point | lowest 0.90x (B=1, L=16k) | **no** |" in text
    assert "| flashx, pages of 256: time <= 1.10x contiguous at every point | worst 1.50x (B=4, L=64k) | **no** |" in text
    assert "| flashx, pages of 16: time <= 1.10x contiguous at every point | worst 1.04x (B=1, L=16k) | yes |" in text
    assert "| 4 | 64k | 3.00 (100%) | 2.00 (67%) | error | 2.90 (97%) | 2.90 (97%) | 2.80 (93%) | 1.03x |" in text
    assert "- flashx-page16: error: OutOfMemoryError: CUDA out of memory" in text
    assert "| 1 | 16k | 16 | 2.70 | 0.20 | 2.70 |" in text  # the num_splits scan
    for line in text.splitlines():
        if line.startswith("|"):
            assert line.endswith("|")


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


def test_a_backend_that_declines_a_shape_is_recorded_not_raised(tmp_path, monkeypatch):
    """Every flashx backend available on the device runs beside the peers; one that cannot run a
    shape says why on its row, and the sweep goes on."""

    class Float16Only(flashx.Backend):
        name, version, array_kind = "float16-only", "0", "numpy"
        devices, dtypes, features = frozenset({"cpu"}), frozenset({"float16"}), frozenset({"causal"})

        def available(self):
            return None

        def priority(self, problem):
            return -1

    monkeypatch.setattr(gpu, "median_ms", _host_median_ms)
    flashx.registry.register(Float16Only())
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


def test_dense_scores_are_skipped_where_they_cannot_fit(tmp_path):
    device = torch.device("cpu")
    sweep = gpu.Sweep(gpu.QUICK, implementations(device, ["sdpa-math"]), device, tmp_path)
    math = sweep.impls[0]
    huge = Shape(1, 2**22, 16, 128, True)
    assert sweep._skip_reason(math, huge, "fwd+bwd").startswith("skipped: N*N float32 scores")
    assert sweep._skip_reason(math, Shape(1, 1024, 16, 128, True), "fwd+bwd") is None


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
