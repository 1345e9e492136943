"""What a newcomer runs first: the ``flashx`` command (its options, its errors, the demo's
self-check), the README's examples, and the install hints.

Commands run in this process through ``flashx.cli.main``; only ``python -m flashx`` needs a
process of its own.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import flashx
from flashx import cli
from flashx.problem import FEATURES

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"flashx {flashx.__version__}"


def test_python_m_flashx_is_the_flashx_command():
    result = subprocess.run([sys.executable, "-m", "flashx", "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == f"flashx {flashx.__version__}"
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="flashx")
    assert script.value == "flashx.cli:main"


def test_info_lists_the_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"flashx {flashx.__version__}")
    assert re.search(r"^  numpy\s.*available on cpu", out, re.MULTILINE), out


@pytest.mark.parametrize("seqlen", ["0", "-5", "abc", "1.5", ""])
def test_demo_refuses_a_seqlen_that_is_not_a_positive_integer(seqlen, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["demo", "--seqlen", seqlen, "--device", "cpu"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --seqlen: expected a positive integer, got {seqlen!r}" in err
    assert "Traceback" not in err


def test_demo_refuses_an_unknown_device(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["demo", "--device", "gpu"])
    assert exit.value.code == 2
    assert "argument --device: invalid choice: 'gpu'" in capsys.readouterr().err


def test_demo_runs_and_checks_itself(capsys):
    assert cli.main(["demo", "--seqlen", "300", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "N=300" in out and "backend (auto)       numpy" in out and out.rstrip().endswith("OK")


def test_demo_checks_sequences_shorter_than_its_slice(capsys):
    assert cli.main(["demo", "--seqlen", "5", "--device", "cpu"]) == 0
    assert "over the last 5 query rows" in capsys.readouterr().out


def test_demo_fails_when_the_result_is_wrong(monkeypatch, capsys):
    attention = flashx.attention

    def off_by_a_little(*args, return_lse=False, **kwargs):
        o, lse = attention(*args, return_lse=True, **kwargs)
        o = o + np.float32(1e-3)
        return (o, lse) if return_lse else o

    monkeypatch.setattr(flashx, "attention", off_by_a_little)
    assert cli.main(["demo", "--seqlen", "100", "--device", "cpu"]) == 1
    assert "FAILED: error above" in capsys.readouterr().err


def _cuda_refusal(capsys) -> str:
    assert cli.main(["demo", "--device", "cuda"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("flashx demo: --device cuda: ")
    return captured.err


def test_demo_on_cuda_without_torch_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert "needs torch, which is not installed: pip install 'flashx-attention[triton]'" in _cuda_refusal(capsys)


def test_demo_on_cuda_without_a_device(monkeypatch, capsys):
    pytest.importorskip("torch")
    monkeypatch.setattr(cli, "cuda_present", lambda: False)
    assert "sees no CUDA device" in _cuda_refusal(capsys)


def test_demo_on_cuda_without_a_backend_for_it_gives_their_reasons(monkeypatch, capsys):
    pytest.importorskip("torch")
    rows = [
        SimpleNamespace(name="numpy", devices=("cpu",), available=True, reason=None),
        SimpleNamespace(name="triton", devices=("cuda",), available=False, reason="cannot import triton"),
    ]
    monkeypatch.setattr(cli, "cuda_present", lambda: True)
    monkeypatch.setattr(flashx, "backends", lambda: rows)
    assert "no backend can run on CUDA here (triton: cannot import triton)" in _cuda_refusal(capsys)


def test_install_hints_name_the_distribution_and_its_extras():
    """The import name ``flashx`` is another project's distribution on the package index."""
    extras = set(importlib.metadata.metadata("flashx-attention").get_all("Provides-Extra"))
    sources = [ROOT / "README.md", ROOT / "noxfile.py"]
    for folder in ("flashx", "backends", "conformance", "benchmarks", "docs", "examples", "tests"):
        sources += [path for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".md", ".toml")]
    hinted = set()
    for path in sources:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(?<![\w-])flashx\[", text), f"{path.relative_to(ROOT)} names the wrong distribution"
        hinted.update(re.findall(r"flashx-attention\[(\w+)\]", text))
    assert "triton" in hinted and hinted <= extras, hinted - extras


def _readme_blocks(section: str, language: str) -> list[str]:
    """The ``language`` code blocks of the README section titled ``section`` (up to the next ``## ``)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(f"\n{section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(rf"```{language}\n(.*?)```", text[start:end], re.DOTALL)


def test_readme_usage_examples_run_without_a_gpu():
    pytest.importorskip("torch")
    blocks = [block for block in _readme_blocks("## Usage", "python") if "cuda" not in block]
    assert len(blocks) == 2, "the NumPy example and the varlen example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_plugin_is_a_whole_plugin():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    (code,) = _readme_blocks("### Writing a backend plugin", "python")
    (toml,) = _readme_blocks("### Writing a backend plugin", "toml")
    project = tomllib.loads(toml)
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"
    assert "flashx-attention" in project["project"]["dependencies"]
    (module,) = project["project"]["entry-points"]["flashx.backends"].values()
    assert project["tool"]["setuptools"]["packages"] == [module] == ["my_backend"]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    (backend,) = namespace["flashx_backends"]()
    assert isinstance(backend, flashx.Backend) and backend.features <= set(FEATURES)
