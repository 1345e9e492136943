"""scripts/ring_gpus.py's arithmetic: the overlap read from a trace, and the longest context from
peak memory (the GPU parts themselves run on a GPU host, or under RING_SMOKE=1)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ring_gpus.py"


@pytest.fixture(scope="module")
def ring():
    spec = importlib.util.spec_from_file_location("ring_gpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    assert "| 4 | document_zigzag | ring | 4 | 0.270 | 300 | 1.00 | 0.93 | 40.0 | 37.0 | 2.00 | 8,178,892 |" in table


def test_causal_work_of_the_layouts(ring):
    """Two documents of 8 and 4 rows on two ranks: zigzag's quarters of the axis hold rows 0-2,
    9-11 and 3-8; document_zigzag's, a quarter of each document twice."""
    assert ring.causal_work([8, 4], 2, "zigzag") == [1 + 2 + 3 + 2 + 3 + 4, 4 + 5 + 6 + 7 + 8 + 1]
    assert ring.causal_work([8, 4], 2, "document_zigzag") == [1 + 2 + 7 + 8 + 1 + 4, 3 + 4 + 5 + 6 + 2 + 3]


def test_check_layouts_reach_every_check_part_only(ring, tmp_path):
    plan = ring._plan([2, 4], tmp_path / "trace.json.gz", {"check", "packed"}, ["document_zigzag"])
    checks = [args for _, args in plan if args[0] == "check"]
    assert checks == [["check", "document_zigzag"]] * 2
    assert all(args[0] == "check" or "document_zigzag" not in args for _, args in plan)
    assert [args for _, args in ring._plan([2], tmp_path / "t", {"check"}, [])] == [["check"]]
