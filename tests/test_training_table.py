"""scripts/training_table.py's arithmetic: the allowed pairs behind every TFLOP/s it reports, and
the rows it times (the timing itself runs on a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "training_table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("training_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
