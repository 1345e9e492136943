"""`flashx bench model` on the CPU: the tiny GPT-2 and Llama configs trained through eager, SDPA and
flashx (its NumPy backend), the record it writes, the loss check, and the longest-sequence search."""

from __future__ import annotations

import csv
import json
import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: nothing here downloads
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashx  # noqa: E402
from flashx_bench import cli, model, records  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("the CPU smoke test: on a GPU the command runs the full models", allow_module_level=True)


def _record(out) -> dict:
    (path,) = out.glob("model-*.json")
    return json.loads(path.read_text())


def test_cpu_run_trains_every_implementation_and_writes_the_record(tmp_path):
    assert cli.main(["model", "--out", str(tmp_path)]) == 0
    results = _record(tmp_path)
    assert results["kind"] == "model" and results["plan"]["precision"] == "fp32"
    assert results["absent"] == {"fa4": "CUDA only"}
    assert {i["name"]: i["attn_implementation"] for i in results["implementations"]} == {
        "eager": "eager", "sdpa": "sdpa", "flashx": "flx"}
    rows = {(r["model"], r["impl"]): r for r in results["rows"]}
    assert set(rows) == {(m, i) for m in ("gpt2-tiny", "llama-tiny") for i in ("eager", "sdpa", "flashx")}
    for (name, impl), row in rows.items():
        assert row["status"] == "ok", (name, impl, row["status"])
        assert (row["seqlen"], row["batch"], row["tokens"]) == (64, 2, 128)
        # Same weights, same batch: the first loss is eager's to float32 rounding, and near ln(97)
        # (random weights) without being it (weights drawn wide).
        assert row["loss_reference"] == "eager" and row["loss_error"] <= 1e-4
        assert 3.0 < row["loss"] < 20.0
        assert row["step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(128 / row["step_ms"] * 1e3)
        assert row["model_tflops"] > 0 and 0 < row["attention_share"] < 1
        assert row["peak_mib"] is None  # no allocator statistics on a CPU
        assert row["parameters"] > 10_000
    assert rows["gpt2-tiny", "flashx"]["flashx_backend"] == "numpy"
    assert rows["gpt2-tiny", "eager"]["parameters"] != rows["llama-tiny", "eager"]["parameters"]
    searches = {(s["model"], s["impl"]): s for s in results["searches"]}
    assert set(searches) == set(rows)
    for search in searches.values():
        assert search["stopped"] == "cap" and search["longest"] == 256
        assert [t["seqlen"] for t in search["tries"]] == [64, 128, 256]

    markdown = (tmp_path / f"{records.stem(results)}.md").read_text()
    assert "## Targets (issue 46)" in markdown and "## gpt2-tiny" in markdown and "≥ 256" in markdown
    assert (tmp_path / f"{records.stem(results)}.png").stat().st_size > 0
    with (tmp_path / records.HISTORY).open() as file:
        history = list(csv.DictReader(file))
    assert {(h["mode"], h["impl"], h["metric"]) for h in history} == {
        (f"train {m}", i, metric) for m in ("gpt2-tiny", "llama-tiny") for i in ("eager", "sdpa", "flashx")
        for metric in ("tokens_per_s", "max_seqlen")}
    assert not list(tmp_path.glob("*.partial.json"))

    json_path = tmp_path / f"{records.stem(results)}.json"
    (tmp_path / f"{records.stem(results)}.md").unlink()
    assert cli.main(["model", "report", str(json_path)]) == 0
    assert (tmp_path / f"{records.stem(results)}.md").read_text() == markdown


def test_a_wrong_attention_is_flagged_and_left_out_of_the_ratios(tmp_path, monkeypatch):
    """flashx's place taken by SDPA with its output scaled by 0.9: the loss check marks it WRONG."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def off_by_ten_percent(module, query, key, value, attention_mask, **kwargs):
        output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return 0.9 * output, None

    AttentionInterface.register("off-by-ten-percent", off_by_ten_percent)
    AttentionMaskInterface.register("off-by-ten-percent", sdpa_mask)
    monkeypatch.setattr(model, "attention_names", lambda device, wanted: (
        {"eager": "eager", "sdpa": "sdpa", "flashx": "off-by-ten-percent"}, {}))
    assert model.main(["--out", str(tmp_path), "--models", "gpt2-tiny", "--no-search"]) == 0
    results = _record(tmp_path)
    statuses = {r["impl"]: r["status"] for r in results["rows"]}
    assert statuses == {"eager": "ok", "sdpa": "ok", "flashx": "wrong"}
    assert model.targets(results) == []  # a wrong row has no ratio
    assert "flashx **WRONG**" in model.markdown(results)
    assert results["searches"] == []


def _fits_up_to(limit: int):
    seen = []

    def fits(seqlen: int):
        seen.append(seqlen)
        return ("ok" if seqlen <= limit else "OOM"), {"peak_mib": float(seqlen)}
    return fits, seen


def test_longest_fitting_doubles_then_bisects_to_the_resolution():
    fits, seen = _fits_up_to(3000)
    found = model.longest_fitting(fits, 1024, 262144, 256, None)
    assert seen == [1024, 2048, 4096, 3072, 2560, 2816]
    assert (found["longest"], found["oom_at"], found["stopped"]) == (2816, 3072, "bisected")
    assert found["tries"][0] == {"seqlen": 1024, "status": "ok", "peak_mib": 1024.0}


def test_longest_fitting_halves_from_a_start_that_does_not_fit():
    fits, seen = _fits_up_to(600)
    found = model.longest_fitting(fits, 4096, 262144, 256, None)
    assert seen == [4096, 2048, 1024, 512, 768]
    assert (found["longest"], found["oom_at"]) == (512, 768)
    fits, seen = _fits_up_to(100)
    assert model.longest_fitting(fits, 512, 4096, 256, None)["longest"] is None
    assert seen == [512, 256]


def test_longest_fitting_stops_at_the_cap_an_error_and_the_time_box():
    fits, seen = _fits_up_to(10**9)
    found = model.longest_fitting(fits, 1024, 4096, 256, None)
    assert (seen, found["longest"], found["stopped"]) == ([1024, 2048, 4096], 4096, "cap")
    found = model.longest_fitting(lambda n: ("error: RuntimeError: boom", {}), 1024, 4096, 256, None)
    assert (found["longest"], found["stopped"], len(found["tries"])) == (None, "error: RuntimeError: boom", 1)
    found = model.longest_fitting(fits, 1024, 4096, 256, time.perf_counter() - 1)
    assert (found["longest"], found["stopped"], found["tries"]) == (None, "time box", [])


def test_model_plans():
    """The GPU models are the issue's: GPT-2 at 1k and 4k, the Llama shape with GQA at 4k and 16k."""
    assert [model.MODELS[m].seqlens for m in model.FULL.models] == [(1024, 4096), (1024, 4096), (4096, 16384)]
    llama = model.MODELS["llama-1b"].geometry()
    assert llama == {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "head_dim": 64}
    assert model.MODELS["gpt2-small"].config(4096).n_positions == 4096
    assert model.MODELS["gpt2-small"].config(1024).n_positions == 1024
    assert model.QUICK.seqlens_of(model.MODELS["llama-1b"]) == (4096,)
    assert model.MODELS["llama-1b"].batch(16384) == 1 and model.MODELS["gpt2-small"].batch(1024) == 8


def test_llama_trains_through_flashx_under_bf16_autocast():
    """Under bf16 autocast Llama's rotary embedding hands attention q and k in float32 beside a
    bf16 v; flashx takes them in the autocast dtype, as SDPA does (the contract's Autocast)."""
    names = model.attention_names(torch.device("cpu"), ["flashx", "sdpa"])[0]
    losses = [model.TrainingRun(model.MODELS["llama-tiny"], 64, 2, names[name], "autocast", torch.device("cpu")).step()
              for name in ("flashx", "sdpa")]
    assert torch.isfinite(losses[0])
    assert abs(losses[0].item() - losses[1].item()) <= 2e-2 * abs(losses[1].item())
