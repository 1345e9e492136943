"""The Triton tuner's table on disk (flashx_triton.tuning_cache): a choice is timed once per
machine, found again by a later process without timing anything, kept apart per GPU and
software version, and never trusted when damaged; ``flashx tune`` fills, lists and clears it.

The interpreter has no GPU clock, so do_bench is replaced by given medians; a later process is
this one with its in-process tables emptied (``fresh_process``). Kernels run under Triton's
interpreter, on shapes of a few tiles.
"""

import itertools
import math
import os
import re
import subprocess
import sys
import warnings
from dataclasses import asdict, replace
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (they import lazily)

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the Triton backend needs triton (pip install 'flashx-attention[triton]')")

import triton.testing  # noqa: E402
from flashx_conformance import oracle  # noqa: E402

import flashx  # noqa: E402
from flashx import cli  # noqa: E402
from flashx_triton import launch, tuning, tuning_cache  # noqa: E402
from flashx_triton.tuning import Config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's 1/0 on empty rows

CONFIGS = [Config(64, 64, 4, 3), Config(32, 64, 4, 2, host_descriptors=False), Config(128, 64, 8, 3)]
MEDIANS = {CONFIGS[0]: 2.0, CONFIGS[1]: 1.0, CONFIGS[2]: 3.0}  # the second is the fastest
PROBLEM = SimpleNamespace(head_dim=64, head_dim_v=64, head_dim_class=64, dtype="bfloat16", band=None, batch=2, heads_q=4, seqlen_q=1000,
                          device_index=None, dropout_p=0.0)
KEY = "dkdv-d64x64-bfloat16-full-n10-r13"  # PROBLEM's: 1000 < 2**10 rows per head, 8000 < 2**13 in all
HERE = tuning_cache.Environment("NVIDIA H100 80GB HBM3", "sm_90", "3.6.0", "0.1.0+0123456789ab")


@pytest.fixture
def table(tmp_path, monkeypatch):
    """The table's directory, empty, and a process that has chosen nothing yet."""
    monkeypatch.setenv("FLASHX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHX_TRITON_AUTOTUNE", raising=False)
    fresh_process(monkeypatch)
    return tmp_path / "cache" / "triton-tuning"


def fresh_process(monkeypatch):
    """Forget every choice and every launch built in this process: what a new process knows."""
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "measured", {})
    monkeypatch.setattr(launch, "_built", {})


@pytest.fixture
def timings(monkeypatch):
    """The configurations choose() ran (``ran``) and timed (``timed``); each is timed at its MEDIANS."""
    log = SimpleNamespace(ran=[], timed=[])

    def do_bench(fn, **kwargs):
        fn()
        log.timed.append(log.ran[-1])
        return MEDIANS[log.ran[-1]]

    def run(config):
        log.ran.append(config)
        return [torch.arange(4.0)]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(tuning, "candidates", lambda kernel, problem: CONFIGS)
    monkeypatch.setenv("FLASHX_TRITON_AUTOTUNE", "1")  # time what the tables lack
    log.choose = lambda: tuning.choose("dkdv", PROBLEM, run)
    return log


def plans_timed(monkeypatch, medians):
    """Time the backward's plans (both candidates under the interpreter here) at ``medians`` in turn;
    returns the list of medians handed out."""
    monkeypatch.setattr(tuning, "INTERPRETED_GRADIENTS", ["fused", "split"])
    monkeypatch.setenv("FLASHX_TRITON_AUTOTUNE", "1")
    given, queue = [], itertools.cycle(medians)

    def do_bench(fn, **kwargs):
        fn()
        given.append(next(queue))
        return given[-1]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    return given


def test_a_later_process_finds_the_choice_on_disk_and_times_nothing(table, timings, monkeypatch):
    assert timings.choose() == CONFIGS[1]
    assert timings.timed == CONFIGS  # each checked once, then timed once
    (record,) = table.glob("*/*.json")
    assert record.name == f"{KEY}.json"
    assert tuning_cache.load(tuning_cache.environment(None), KEY) == asdict(CONFIGS[1])

    fresh_process(monkeypatch)
    timings.ran.clear(), timings.timed.clear()
    assert timings.choose() == CONFIGS[1]
    assert timings.ran == [] and timings.timed == []
    assert tuning.choices() == [(KEY, asdict(CONFIGS[1]), "disk", None)]


def test_a_stored_plan_runs_the_backward_untimed_and_exact(table, monkeypatch):
    """End to end: the backward's plan tuned in one process is the one a later process launches,
    without timing, and its gradients are the oracle's (every element written: outputs poisoned)."""
    medians = plans_timed(monkeypatch, [2.0, 1.0])  # fused, then split: split is the faster
    empty = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: empty(*a, **kw).fill_(math.nan))
    generator = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 40, 2, 16, generator=generator, dtype=torch.float64).float() for _ in range(4))

    def gradients():
        o, res = flashx.attention_forward(q, k, v, causal=True, backend="triton")
        return flashx.attention_backward(do, q, k, v, o, res, causal=True, backend="triton")

    first = gradients()
    assert medians == [2.0, 1.0]

    fresh_process(monkeypatch)
    launched, tuned_launch = [], tuning.tuned_launch
    monkeypatch.setattr(tuning, "tuned_launch", lambda kernel, *a: launched.append(kernel) or tuned_launch(kernel, *a))
    second = gradients()
    assert medians == [2.0, 1.0]  # nothing timed
    assert launched == ["forward", "gradients", "dkdv", "dq"]  # split's two launches, not fused's one
    want = oracle.forward_backward(*(x.double().numpy() for x in (do, q, k, v)), causal=True)[2:]
    for name, x, y, ref in zip(("dq", "dk", "dv"), first, second, want):
        assert torch.equal(x, y), name  # the plan changes the launches, not the arithmetic
        np.testing.assert_allclose(y.double().numpy(), ref, rtol=0, atol=2e-5 * np.abs(ref).max(), err_msg=name)


def test_choices_are_kept_apart_per_gpu_and_software(table, timings, monkeypatch):
    others = [replace(HERE, gpu="NVIDIA H200"), replace(HERE, capability="sm_100"), replace(HERE, triton="3.7.0"),
              replace(HERE, flashx="0.1.0+ba9876543210"), replace(HERE, flashx="0.2.0+0123456789ab")]
    tuning_cache.store(HERE, KEY, "split", 1.0)
    assert tuning_cache.load(HERE, KEY) == "split"
    assert [tuning_cache.load(other, KEY) for other in others] == [None] * len(others)
    assert len({where.directory for where in [HERE, *others]}) == 1 + len(others)

    for where in (HERE, others[0]):  # through the tuner: a choice made on one GPU is no other's
        fresh_process(monkeypatch)
        monkeypatch.setattr(tuning_cache, "environment", lambda device_index, where=where: where)
        timings.timed.clear()
        assert timings.choose() == CONFIGS[1] and timings.timed == CONFIGS
        assert tuning_cache.load(where, KEY) == asdict(CONFIGS[1])


def test_the_interpreters_environment_names_the_versions():
    import triton

    where = tuning_cache.environment(None)
    assert (where.gpu, where.capability, where.triton) == ("Triton interpreter", "cpu", triton.__version__)
    version, digest = where.flashx.split("+")
    assert version == flashx.__version__ and re.fullmatch("[0-9a-f]{12}", digest)


@pytest.mark.parametrize("text", [b"", b"{not json", b"[]", b'{"key": "x"}', b"\xff\xfe\x00"])
def test_a_damaged_record_is_ignored_with_a_warning_and_rewritten(table, timings, monkeypatch, text):
    timings.choose()
    (record,) = table.glob("*/*.json")
    record.write_bytes(text)
    fresh_process(monkeypatch)
    timings.timed.clear()
    with pytest.warns(UserWarning, match="damaged tuning record"):
        assert timings.choose() == CONFIGS[1]
    assert timings.timed == CONFIGS  # tuned again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning_cache.load(tuning_cache.environment(None), KEY) == asdict(CONFIGS[1])


def test_a_stored_choice_that_is_no_longer_a_candidate_is_tuned_again_silently(table, timings, monkeypatch):
    tuning_cache.store(tuning_cache.environment(None), KEY, asdict(Config(256, 16, 2, 1)), 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert timings.choose() == CONFIGS[1]
    assert timings.timed == CONFIGS


def test_a_table_that_cannot_be_written_warns_and_the_choice_holds_for_the_process(table, timings, monkeypatch,
                                                                                   tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHX_CACHE_DIR", str(blocker))  # no directory can be made under a file
    with pytest.warns(UserWarning, match="could not keep a tuning choice"):
        assert timings.choose() == CONFIGS[1]
    timings.timed.clear()
    assert timings.choose() == CONFIGS[1] and timings.timed == []
    assert list(tmp_path.glob("**/*.tmp")) == []


def test_untimed_choices_read_the_table_and_never_write_it(table, timings, monkeypatch):
    """By default nothing is timed: a choice on disk (``flashx tune``'s) wins; without one the
    shipped choice runs, and nothing is written."""
    monkeypatch.delenv("FLASHX_TRITON_AUTOTUNE")
    assert timings.choose() == CONFIGS[0]  # no table for the interpreter: the list's first
    assert timings.ran == [CONFIGS[0]] and timings.timed == []
    assert not table.exists()

    fresh_process(monkeypatch)
    tuning_cache.store(tuning_cache.environment(None), KEY, asdict(CONFIGS[2]), 0.5)
    timings.ran.clear()
    assert timings.choose() == CONFIGS[2]
    assert timings.ran == [] and timings.timed == []
    assert tuning.choices() == [(KEY, asdict(CONFIGS[2]), "disk", None)]


WRITER = """
import sys
from flashx_triton import tuning_cache
where = tuning_cache.Environment("GPU", "sm_90", "3.6.0", "0.1.0+0123456789ab")
for i in range(150):
    tuning_cache.store(where, "forward-key", {"writer": int(sys.argv[1]), "i": i}, 1.0)
"""


def test_concurrent_writers_leave_a_whole_record(table):
    """Four processes rewrite one record while this one reads it: every read finds nothing yet or
    a whole record, and no temporary file is left behind."""
    where = tuning_cache.Environment("GPU", "sm_90", "3.6.0", "0.1.0+0123456789ab")
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(n)], env=os.environ.copy(), stderr=subprocess.PIPE)
               for n in range(4)]
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn record would warn
        while any(writer.poll() is None for writer in writers):
            found = tuning_cache.load(where, "forward-key")
            if found is not None:
                seen.add((found["writer"], found["i"]))
    assert [writer.wait() for writer in writers] == [0] * 4, [writer.stderr.read() for writer in writers]
    final = tuning_cache.load(where, "forward-key")
    assert final["writer"] in range(4) and final["i"] == 149
    assert all(writer in range(4) and i in range(150) for writer, i in seen)
    assert [path.name for path in table.glob("*/*")] == ["forward-key.json"]


def test_the_tuning_table_lives_in_flashx_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHX_CACHE_DIR", str(tmp_path / "mine"))
    assert tuning_cache.table_directory() == tmp_path / "mine" / "triton-tuning"


def test_environment_directories_are_file_names_anywhere():
    odd = replace(HERE, gpu='NVIDIA A100-SXM4-40GB MIG 1g.5gb/"x":*?<>|')
    assert re.fullmatch(r"[A-Za-z0-9._+-]+", odd.directory.name)


TUNE = ["tune", "--seqlen", "40", "--heads", "2", "--head-dim", "16", "--dtype", "float32", "--causal", "--backward"]
TUNED_KEY = "gradients-d16x16-float32-band-n6-r7"


def test_flashx_tune_fills_lists_and_clears_the_table(table, monkeypatch, capsys):
    medians = plans_timed(monkeypatch, [2.0, 1.0])  # fused, then split
    monkeypatch.delenv("FLASHX_TRITON_AUTOTUNE")  # flashx tune times without being asked
    assert cli.main(TUNE) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^    {TUNED_KEY}\s+split  \(fastest of 2 timed, 1\.000 ms\)$", out, re.MULTILINE), out
    assert out.splitlines()[-1] == f"choices kept in {tuning_cache.environment(None).directory}"

    fresh_process(monkeypatch)
    assert cli.main(TUNE) == 0
    assert re.search(rf"^    {TUNED_KEY}\s+split  \(found on disk\)$", capsys.readouterr().out, re.MULTILINE)
    assert medians == [2.0, 1.0]  # nothing timed the second time

    assert cli.main(["tune", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"flashx tune: 1 tuned choice in {table}\n")
    assert re.search(rf"^    {TUNED_KEY}\s+split  1\.000 ms$", out, re.MULTILINE), out

    assert cli.main(["tune", "--clear"]) == 0
    assert capsys.readouterr().out == f"flashx tune: removed 1 tuned choice from {table}\n"
    assert not table.exists()
    assert cli.main(["tune", "--list"]) == 0
    assert capsys.readouterr().out == f"flashx tune: 0 tuned choices in {table}\n"


def test_flashx_tune_refuses_in_one_line_where_it_cannot_time(table, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert cli.main(TUNE) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and "sees no CUDA device" in captured.err
    assert not table.exists()


def test_flashx_tune_names_a_shape_the_backend_declines_in_one_line(table, capsys):
    assert cli.main(["tune", "--seqlen", "40", "--heads", "3", "--kv-heads", "2", "--head-dim", "16"]) == 1
    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1 and "flashx tune: " in captured.err and "Traceback" not in captured.err


def test_flashx_tune_needs_a_shape_or_list_or_clear(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["tune"])
    assert exit.value.code == 2
    assert "one of the arguments --seqlen --list --clear is required" in capsys.readouterr().err


def test_flashx_tune_takes_fp8_inputs_for_the_forward(table, monkeypatch, capsys):
    two = [tuning.INTERPRETED, replace(tuning.INTERPRETED, num_stages=2)]
    monkeypatch.setattr(tuning, "candidates", lambda kernel, problem: two if kernel == "forward" else two[:1])
    plans_timed(monkeypatch, [2.0, 1.0])
    assert cli.main(["tune", "--seqlen", "40", "--heads", "2", "--head-dim", "16", "--dtype", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^    forward-d16x16-float8_e4m3fn-\S+ .*num_stages=2 .*\(fastest of 2 timed, 1\.000 ms\)$", out,
                     re.MULTILINE), out
    assert cli.main(["tune", "--seqlen", "40", "--dtype", "float8_e4m3fn", "--backward"]) == 1
    assert capsys.readouterr().err == "flashx tune: FP8 attention is forward only; leave out --backward\n"


def test_dropout_problems_keep_choices_of_their_own():
    """Dropout's kernels take more registers and shared memory: a choice made without it may not
    launch with it, so the two are kept apart."""
    from flashx_triton import tuning

    assert tuning.kernel_key("dkdv", PROBLEM) == KEY
    assert tuning.kernel_key("dkdv", SimpleNamespace(**{**vars(PROBLEM), "dropout_p": 0.1})) == KEY + "-dropout"
