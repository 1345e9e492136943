"""scripts/training_table.py's arithmetic: the allowed pairs behind every TFLOP/s it reports, and
the rows it times (the timing itself runs on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.script_modules import load_script


@pytest.fixture(scope="module")
def table():
    return load_script("training_table")


@pytest.mark.parametrize("seqlen, causal, window", [(7, False, None), (7, True, None), (9, False, 3), (5, False, 0),
                                                    (6, False, 10)])
def test_allowed_pairs_count_the_mask(table, seqlen, causal, window):
    i, j = np.arange(seqlen)[:, None], np.arange(seqlen)[None, :]
    allowed = np.ones((seqlen, seqlen), bool)
    if causal or window is not None:
        allowed &= j <= i
    if window is not None:
        allowed &= i - j <= window
    assert table.allowed_pairs(seqlen, causal, window) == allowed.sum()


def test_rows_name_known_implementations_and_modes(table):
    for label, mode, *_, names in table.ROWS:
        assert mode in ("fwd", "fwd+bwd") and set(names) <= set(table.IMPLEMENTATIONS), label
    assert len({(row[0], row[1]) for row in table.ROWS}) == len(table.ROWS)  # each row once


def test_selected_rows_keep_the_named_implementations_and_modes(table):
    rows = table.selected(table.ROWS, ["cupy", "flex"], ["fwd+bwd"])
    assert rows and all(row[1] == "fwd+bwd" and set(row[-1]) <= {"cupy", "flex"} for row in rows)
    assert [row[0] for row in rows] == [row[0] for row in table.ROWS if row[1] == "fwd+bwd"]  # dropout's has cupy
    assert [row[-1] for row in table.selected(table.ROWS, ["flex"], None)] == [("flex",)] * (len(table.ROWS) - 1)
    assert table.selected(table.ROWS, None, None) == [tuple(row) for row in table.ROWS]


def test_kernel_ms_sums_each_kernel_per_step(table):
    from types import SimpleNamespace

    import torch

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    long_name = "_gradients_kernel" + "x" * 80
    events = [SimpleNamespace(device_type=cuda, name="_forward_kernel", device_time=1000.0),
              SimpleNamespace(device_type=cuda, name=long_name, device_time=3000.0),
              SimpleNamespace(device_type=cuda, name="_forward_kernel", device_time=1000.0),
              SimpleNamespace(device_type=cpu, name="aten::empty", device_time=9000.0)]
    got = table.kernel_ms(events, steps=2)
    assert got == {long_name[:table.KERNEL_NAME]: 1.5, "_forward_kernel": 1.0}
    assert list(got) == [long_name[:table.KERNEL_NAME], "_forward_kernel"], "the longest first"
