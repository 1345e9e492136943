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
