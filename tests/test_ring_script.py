"""scripts/ring_gpus.py's arithmetic: the overlap and the kernel time read from a trace, and the
longest context from peak memory (the GPU parts themselves run on a GPU host, or under RING_SMOKE=1)."""

from __future__ import annotations

import pytest

from tests.script_modules import load_script


@pytest.fixture(scope="module")
def ring():
    return load_script("ring_gpus")


def _kernel(name, start, duration):
    return {"cat": "kernel", "ph": "X", "name": name, "ts": start, "dur": duration}


def test_overlap_counts_transfers_only(ring):
    events = [
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 100),  # the barrier: waits, not a transfer
        _kernel("_forward_kernel", 100, 30),
        _kernel("_gradients_kernel", 125, 40),  # overlaps the forward: the union is [100, 165)
        _kernel("ncclDevKernel_SendRecv(args)", 110, 20),  # wholly under compute
        _kernel("ncclDevKernel_SendRecv(args)", 160, 10),  # half under compute
        {"cat": "cpu_op", "ph": "X", "name": "aten::add", "ts": 0, "dur": 500},
    ]
    found = ring._overlap(events)
    assert found["transfers"] == 2
    assert found["transfer_ms"] == pytest.approx(0.030)
    assert found["overlapped_ms"] == pytest.approx(0.025)
    assert found["compute_ms"] == pytest.approx(0.065)
    assert found["overlap"] == pytest.approx(25 / 30)


def test_kernel_time_of_the_step_only(ring):
    """A step from 100 us to its last kernel's end at 207 us: the barrier before it is left out,
    the copy counts as other GPU work."""
    events = [
        {"cat": "user_annotation", "ph": "X", "name": ring.STEP_LABEL, "ts": 100, "dur": 50},
        _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 90),  # the barrier
        _kernel("_forward_kernel", 110, 20),
        _kernel("ncclDevKernel_SendRecv(args)", 120, 40),
        _kernel("_gradients_kernel", 140, 60),
        _kernel("_gradients_kernel", 200, 5),
        {"cat": "gpu_memcpy", "ph": "X", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 205, "dur": 2},
        {"cat": "cpu_op", "ph": "X", "name": "aten::add", "ts": 100, "dur": 500},
    ]
    found = ring._kernel_time(events)
    assert found["timeline"] == "CUDA kernels"
    assert found["span_ms"] == pytest.approx(0.107) and found["host_ms"] == pytest.approx(0.050)
    assert found["idle_ms"] == pytest.approx(0.010)  # 100 to 110
    assert found["no_compute_ms"] == pytest.approx(0.020)  # and 130 to 140, NCCL's alone
    assert found["attention"] == dict(launches=3, ms=pytest.approx(0.085),
                                      top=[["_gradients_kernel", 2, pytest.approx(0.065)],
                                           ["_forward_kernel", 1, pytest.approx(0.020)]])
    assert (found["nccl"]["launches"], found["other"]["launches"]) == (1, 1)


def test_kernel_time_without_cuda_kernels_says_so(ring):
    events = [{"cat": "user_annotation", "ph": "X", "name": ring.STEP_LABEL, "ts": 0, "dur": 10},
              {"cat": "cpu_op", "ph": "X", "name": "aten::add", "ts": 2, "dur": 4}]
    found = ring._kernel_time(events)
    assert found["timeline"].startswith("CPU operators")
    assert found["other"]["launches"] == 1 and found["idle_ms"] == pytest.approx(0.006)


def test_packed_profile_table(ring):
    common = dict(part="trace-packed", heads_k=4, tokens=262144, documents=12, timeline="CUDA kernels",
                  host_ms=20.0, nccl=dict(launches=30, ms=40.0, top=[]), other=dict(launches=900, ms=10.0, top=[]))
    one = dict(common, world=1, seconds=0.2, idle_ms=1.0, no_compute_ms=1.0, overlap=None, trace="one.json.gz",
               attention=dict(launches=6, ms=190.0, top=[["_gradients_kernel", 2, 130.0]]))
    four = dict(common, world=4, seconds=0.065, attention=dict(launches=600, ms=52.0, top=[]), idle_ms=5.0,
                no_compute_ms=9.0, overlap=0.9, trace="four.json.gz")
    table = "\n".join(ring.render_packed_profile([four, one]))
    assert "| 1 | 200.0 | 20.0 | 190.0 (6) | 725 | 40.0 (30) | 10.0 (900) | 1.0 | 1.0 |  |" in table
    assert "| 4 | 65.0 | 20.0 | 52.0 (600) | 793 | 40.0 (30) | 10.0 (900) | 5.0 | 9.0 | 0.90 |" in table
    assert "W=1, the longest kernels by name: attention: `_gradients_kernel` 130.0 ms (2)" in table


def test_longest_context_from_two_peaks(ring):
    rows = [dict(part="time", world=4, seqlen=4 * n, peak_mib=1000 + n / 64, capacity_mib=10240)
            for n in (32768, 131072)]
    found = ring._longest(rows, 4)
    assert found["mib_per_token_per_rank"] == pytest.approx(1 / 64)
    assert found["longest_tokens"] == 4 * int((10240 - 2048 - 1000) * 64)
    assert found["verified_tokens"] == 4 * 131072
    assert ring._longest(rows[:1], 4) is None  # one length fits no line


def test_documents_span_the_lengths_asked_and_fill_the_tokens(ring):
    lengths = ring.document_lengths(262144, 1024, 65536)
    assert sum(lengths) == 262144 and max(lengths) == 65536 and min(lengths[:-1]) >= 1024 and lengths[-1] >= 1
    assert all(length % ring.DOCUMENT_MULTIPLE == 0 for length in lengths)  # document_zigzag on 2, 4 and 8 GPUs
    assert lengths == ring.document_lengths(262144, 1024, 65536)  # every rank draws the same documents
    assert ring.offsets([3, 0, 5]) == [0, 3, 3, 8]


def test_packed_table_from_peaks(ring):
    common = dict(part="packed", tokens=262144, documents=12, shortest=1024, longest=65536, heads_k=4,
                  tflops_per_gpu=300.0, capacity_mib=81920.0, counted_kib_per_token=37.0, balance=1.0)
    one = dict(common, world=1, layout="", exchange="one GPU", seconds=1.0, peak_mib=262144 * 20 / 1024)
    four = dict(common, world=4, layout="document_zigzag", exchange="ring", seconds=0.27, peak_mib=65536 * 40 / 1024)
    assert ring.packed_kib_per_token(four) == pytest.approx(40.0)
    assert ring.longest_packed(four) == 4 * int((81920 - 2048) * 1024 / 40.0)
    table = "\n".join(ring.render_packed([one, four]))
    assert "| 4 | document_zigzag | ring | 4 |  | 0.270 | 300 | 1.00 | 0.93 | 40.0 | 37.0 | 2.00 | 8,178,892 |" in table
    grouped = "\n".join(ring.render_packed([one, dict(four, head_groups=2)]))  # rows record their groups
    assert "| 4 | document_zigzag | ring | 4 | 2 | 0.270 | 300 |" in grouped


def test_head_groups_reach_the_time_table_and_history(ring):
    """A ring step's row records the backward's head groups and their count: the scaling table
    shows them, and history.csv tells a grouped backward's series apart from one group's."""
    results = dict(gpus=4, device="GPU", date="today", flashx="0", torch="0", triton="0", nccl="0", longest=[],
                   rows=[dict(part="time", world=1, seqlen=32768, repeats=3, seconds=0.04, tflops_per_gpu=400.0,
                              peak_mib=1030.0, counted_kib_per_token=32.0, head_groups=None),
                         dict(part="time", world=4, seqlen=131072, repeats=3, seconds=0.16, tflops_per_gpu=390.0,
                              peak_mib=1700.0, counted_kib_per_token=48.0, head_groups=4)])
    text = ring.render(results)
    assert "| 131072 | 4 | 32768 | 3 | 0.160 | 390 | 0.97 |  | 1700 | 4 | 48.0 |" in text
    assert "| 32768 | 1 | 32768 | 3 | 0.040 | 400 |  |  | 1030 |  | 32.0 |" in text
    modes = {(row["impl"], row["mode"]) for row in ring.history_rows(results)}
    assert modes == {("flashx-triton", "fwd+bwd"), ("flashx-ring-zigzag-w4", "fwd+bwd head_groups=4")}


def test_counted_memory_in_the_ring_default_head_groups(ring):
    """The script's count is peak_bytes_per_token's in ring_attention's default groups, at W = 4:
    bf16, H = 16, D = 128, with backward_into (Triton) on a GPU, 4 groups of 48 KiB per token;
    float32, H = 4, D = 16, numpy under RING_SMOKE, 2 groups of 3.4375 KiB."""
    import torch

    kib, groups = (3.4375, 2) if ring.SMOKE else (48.0, 4)
    assert ring.counted(torch, 4, ring.HEADS) == dict(kib_per_token=kib, head_groups=groups)
    assert ring.counted(torch, 1, ring.HEADS) == dict(kib_per_token=32.0 if not ring.SMOKE else 2.0, head_groups=None)


def test_causal_work_of_the_layouts(ring):
    """Two documents of 8 and 4 rows on two ranks: zigzag's quarters of the axis hold rows 0-2,
    9-11 and 3-8; document_zigzag's, a quarter of each document twice."""
    assert ring.causal_work([8, 4], 2, "zigzag") == [1 + 2 + 3 + 2 + 3 + 4, 4 + 5 + 6 + 7 + 8 + 1]
    assert ring.causal_work([8, 4], 2, "document_zigzag") == [1 + 2 + 7 + 8 + 1 + 4, 3 + 4 + 5 + 6 + 2 + 3]


def test_check_layouts_reach_every_check_part_only(ring, tmp_path):
    plan = ring._plan([2, 4], str(tmp_path / "trace"), {"check", "packed"}, ["document_zigzag"])
    checks = [args for _, args in plan if args[0] == "check"]
    assert checks == [["check", "document_zigzag"]] * 2
    assert all(args[0] == "check" or "document_zigzag" not in args for _, args in plan)
    assert [args for _, args in ring._plan([2], str(tmp_path / "t"), {"check"}, [])] == [["check"]]


def test_packed_profile_on_the_most_gpus_and_one(ring):
    plan = ring._plan([2, 4], "out/ring-trace", {"trace-packed"}, [])
    assert plan == [(w, ["trace-packed", str(ring.PACKED_TOKENS), f"out/ring-trace-packed-w{w}.json.gz"])
                    for w in (4, 1)]


def test_a_part_that_aborts_after_its_results_is_told_apart(ring):
    """A part whose processes abort in their teardown once its results are written (NCCL and the
    profiler shutting down) keeps its rows, and the record says it ended abnormally after them,
    apart from parts that did not finish."""
    results = dict(gpus=2, device="GPU", date="today", flashx="0", torch="0", triton="0", nccl="0", longest=[],
                   rows=[dict(part="error", world=2, args=["trace-packed", "262144"], after_results=True),
                         dict(part="error", world=2, args=["check", "(not run: time box)"])])
    text = ring.render(results)
    assert "Parts that did not finish: W=2 check (not run: time box)." in text
    assert "after writing their results (which stand): W=2 trace-packed 262144." in text
