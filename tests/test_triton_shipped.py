"""The Triton backend's shipped choices (flashx_triton/shipped.json): what a call runs, untimed,
where the table on disk has no choice; and the heuristic for a GPU without a table of its own.

Choices are made under Triton's interpreter with the GPU's candidate lists and environment
stood in for; ``run`` records what would have been launched.
"""

import os
import json
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (they import lazily)

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton", reason="the Triton backend needs triton (pip install 'flashx-attention[triton]')")

from triton.runtime.errors import OutOfResources  # noqa: E402

from flashx.problem import head_dim_class  # noqa: E402
from flashx_triton import tuning, tuning_cache  # noqa: E402
from flashx_triton.tuning import Config  # noqa: E402

H100 = tuning_cache.Environment("NVIDIA H100 80GB HBM3", "sm_90", "3.6.0", "0.1.0+0123456789ab")
KERNELS = ("forward", "dkdv", "dq", "fused", "gradients")


def problem(n=8192, d=128, dtype="bfloat16", causal=False, batch=2, heads=16):
    return SimpleNamespace(head_dim=d, head_dim_v=d, head_dim_class=head_dim_class(d), dtype=dtype,
                           band=(n, 0) if causal else None, batch=batch, heads_q=heads, seqlen_q=n, device_index=None,
                           dropout_p=0.0)


@pytest.fixture(autouse=True)
def gpu_lists(monkeypatch):
    """The candidate lists a GPU gets (the interpreter's is one small configuration)."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A process that has chosen nothing, on an sm_90 GPU, no table on disk."""
    monkeypatch.setenv("FLASHX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASHX_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "_sources", {})
    monkeypatch.setattr(tuning, "measured", {})
    monkeypatch.setattr(tuning_cache, "environment", lambda device_index: H100)
    ran = []

    def choose(kernel, on, fail=()):
        def run(config):
            ran.append(config)
            if config in fail:
                raise OutOfResources(300000, 232448, "shared memory")
            return []

        return tuning.choose(kernel, on, run)

    return SimpleNamespace(ran=ran, choose=choose)


def test_every_shipped_entry_is_a_candidate_and_every_16bit_class_has_one():
    table = tuning.shipped_table("sm_90")
    for d in (64, 128, 256):
        for dtype in ("bfloat16", "float16"):
            for causal in (False, True):
                for kernel in KERNELS:
                    entries = table[f"{kernel} d{d} {dtype} {'band' if causal else 'full'}"]
                    assert entries, (kernel, d, dtype, causal)
                    for n in entries:
                        on = problem(int(n), d, dtype, causal)
                        assert tuning.shipped(kernel, on, "sm_90") in tuning.candidates(kernel, on), (kernel, n)
    for d in (64, 128):
        assert tuning.shipped("forward", problem(d=d, dtype="float32"), "sm_90") is not None
    dropout_groups = [group for group in table if group.endswith(" dropout")]
    assert dropout_groups
    for group in dropout_groups:
        kernel, d, dtype, band, _ = group.split()
        for n in table[group]:
            on = SimpleNamespace(**{**vars(problem(int(n), int(d[1:]), dtype, band == "band")), "dropout_p": 0.1})
            assert tuning.shipped(kernel, on, "sm_90") in tuning.candidates(kernel, on), group


def test_shipped_text_is_written_as_it_is_read():
    """``text`` (which scripts/triton_defaults.py encodes with) and ``parse`` (which calls read with)
    are one format: every entry shipped, and every candidate in both of its forms, round-trips."""
    for entries in tuning.shipped_table("sm_90").values():
        for written in entries.values():
            assert tuning.text(tuning.parse(written)) == written
    for config in (Config(64, 128, 8, 3), Config(128, 64, 4, 2, host_descriptors=False)):
        assert tuning.parse(tuning.text(config)) == config
        assert tuning.text(tuning._encoded(config)) == tuning.text(config)
    assert tuning.text(Config(128, 64, 4, 2, host_descriptors=False)) == "128x64 w4 s2 in-kernel"
    assert tuning.parse(tuning.text("fused")) == "fused"


def test_a_shipped_choice_holds_from_its_length_class_up():
    entries = {"512": "64x64 w4 s3", "8192": "128x128 w8 s3 in-kernel"}
    table = {"sm_90": {"choices": {"forward d128 bfloat16 full": entries}}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning, "_shipped", lambda: table)
        small, large = Config(64, 64, 4, 3), Config(128, 128, 8, 3, host_descriptors=False)
        for n, want in ((64, small), (512, small), (6000, small), (8191, small), (8192, large), (100000, large)):
            assert tuning.shipped("forward", problem(n), "sm_90") == want, n
        assert tuning.shipped("forward", problem(d=64), "sm_90") is None
        assert tuning.shipped("forward", problem(), "sm_80") is None


def test_dropout_takes_its_own_group_where_the_table_has_one():
    plain, dropped = {"512": "128x128 w8 s3"}, {"512": "128x64 w8 s3"}
    table = {"sm_90": {"choices": {"forward d128 bfloat16 full": plain, "forward d128 bfloat16 full dropout": dropped}}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning, "_shipped", lambda: table)
        with_dropout = SimpleNamespace(**{**vars(problem()), "dropout_p": 0.1})
        assert tuning.shipped("forward", with_dropout, "sm_90") == Config(128, 64, 8, 3)
        assert tuning.shipped("forward", problem(), "sm_90") == Config(128, 128, 8, 3)
        causal_dropout = SimpleNamespace(**{**vars(problem(causal=True)), "dropout_p": 0.1})
        assert tuning.shipped("forward", causal_dropout, "sm_90") is None  # no band group at all


def test_encoding_a_partial_sweep_keeps_the_groups_it_did_not_reach(tmp_path, monkeypatch):
    from flashx_triton import defaults

    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"sm_90": {"measured": "before", "choices": {"dq d64 bfloat16 full": {"512": "64x64 w4 s3"}}}}))
    monkeypatch.setattr(tuning, "SHIPPED", shipped)
    choice = tuning._encoded(Config(128, 64, 8, 3))
    sweep = tmp_path / "sweep.json"  # B=2, N=8k, H=16, d128: the sweep's rows, n14 r19
    sweep.write_text(json.dumps({"device": "GPU", "capability": [9, 0], "triton": "3.6", "date": "2026-11-29", "keys": {
        "forward-d128x128-bfloat16-full-n14-r19-dropout": {"choice": choice, "medians": [[choice, 1.0]]}}}))
    defaults.encode(str(sweep))
    written = json.loads(shipped.read_text())["sm_90"]
    assert written["choices"] == {"dq d64 bfloat16 full": {"512": "64x64 w4 s3"},
                                  "forward d128 bfloat16 full dropout": {"8192": "128x64 w8 s3"}}
    assert written["measured"].startswith("before; GPU, Triton 3.6, 2026-11-29")


def test_the_default_call_runs_the_shipped_choice_untimed(gpu, monkeypatch):
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **kw: pytest.fail("timed by default"))
    for kernel in KERNELS:
        on = problem(6000, causal=True)
        want = tuning.shipped(kernel, on, "sm_90")
        gpu.ran.clear()
        assert gpu.choose(kernel, on) == want
        assert gpu.ran == [want]  # that one compiled and ran, once
    assert {made.source for made in tuning.choices()} == {"shipped"}
    assert not list((tuning_cache.table_directory()).glob("**/*.json"))  # nothing written


def test_a_choice_on_disk_wins_over_the_shipped_one(gpu):
    on = problem()
    other = next(c for c in tuning.candidates("forward", on) if c != tuning.shipped("forward", on, "sm_90"))
    tuning_cache.store(H100, tuning.kernel_key("forward", on), tuning._encoded(other), 1.0)
    assert gpu.choose("forward", on) == other and gpu.ran == []


def test_timing_is_opt_in_and_kept_on_disk(gpu, monkeypatch):
    import triton.testing

    on = problem(1024)
    options = tuning.candidates("forward", on)
    medians = {config: 2.0 + i for i, config in enumerate(options)}
    medians[options[-1]] = 1.0  # the last candidate is the fastest
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or medians[gpu.ran[-1]])
    monkeypatch.setenv("FLASHX_TRITON_AUTOTUNE", "1")
    assert gpu.choose("forward", on) == options[-1]
    assert tuning_cache.load(H100, tuning.kernel_key("forward", on)) == tuning._encoded(options[-1])
    assert [made.source for made in tuning.choices()] == ["timed"]


def test_a_shipped_choice_that_does_not_fit_gives_way_to_the_next(gpu):
    on = problem()
    shipped = tuning.shipped("forward", on, "sm_90")
    rest = [c for c in tuning.candidates("forward", on) if c != shipped]
    assert gpu.choose("forward", on, fail=(shipped,)) == rest[0]
    assert gpu.ran == [shipped, rest[0]]


def test_a_gpu_without_a_table_starts_from_sm_90s_within_its_shared_memory():
    on = problem()
    options = tuning.candidates("forward", on)
    reference = tuning.shipped("forward", on, "sm_90")
    big = tuning.untimed_order("forward", on, options, "sm_100", lambda: 232448)
    assert big[0] == reference and sorted(map(str, big)) == sorted(map(str, options))
    small = tuning.untimed_order("forward", on, options, "sm_89", lambda: 101376)
    assert small and all(tuning.shared_memory_needed("forward", c, on) <= 101376 for c in small)
    assert reference not in small  # 128x128 tiles, 3 stages of K and V: 196608 bytes
    tiny = tuning.untimed_order("forward", on, options, "sm_75", lambda: 1024)
    assert tiny[0] == reference and len(tiny) == len(options)  # none fits: all, in order, compile decides
    plans = tuning.candidates("gradients", on)
    assert tuning.untimed_order("gradients", on, plans, "sm_89", lambda: 0)[0] == tuning.shipped("gradients", on,
                                                                                                  "sm_90")


def test_sm_90s_order_is_its_entry_then_the_list():
    on = problem(dtype="float32")
    options = tuning.candidates("dkdv", on)  # no float32 backward is shipped
    assert tuning.shipped("dkdv", on, "sm_90") is None
    assert tuning.untimed_order("dkdv", on, options, "sm_90", lambda: pytest.fail("not asked on sm_90")) == options
