"""What a newcomer runs first: the ``flashx`` command (its options, its errors, the demo's
self-check, the commands plugins add), the README's examples, and the install hints.

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
from flashx import cli, devices, hookspecs
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


def test_no_command_prints_the_help():
    result = subprocess.run([sys.executable, "-m", "flashx"], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("usage: flashx ")
    listed = re.findall(r"^    (\w+)\s", result.stdout, re.MULTILINE)
    assert listed[:2] == ["info", "demo"]  # the core's, then the plugins' by name
    assert listed[2:] == sorted(listed[2:]) and {"bench", "tune"} <= set(listed[2:])


def test_the_core_commands_are_the_names_plugins_cannot_take():
    assert [command.name for command in cli.COMMANDS] == ["info", "demo"]
    assert set(hookspecs.CORE_COMMANDS) == {"info", "demo"}


def test_tune_is_the_triton_plugins_command(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["tune", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashx tune [-h] (--seqlen N [N ...] | --list | --clear)")
    assert flashx.registry.commands()["tune"].run.__module__ == "flashx_triton.cli"


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


class OffByALittle(flashx.Backend):
    """The NumPy backend's float32 forward, 1e-3 off, preferred by backend="auto"."""

    name, version, array_kind = "off-by-a-little", "0", "numpy"
    devices, dtypes = frozenset({"cpu"}), frozenset({"float32"})

    def priority(self, problem):
        return 1000

    def forward(self, problem, q, k, v):
        o, lse = flashx.registry.get("numpy").forward(problem, q, k, v)
        return o + np.float32(1e-3), lse


def test_demo_fails_when_the_result_is_wrong(capsys):
    """The float64 reference is the NumPy backend's, named: a wrong backend auto picks is caught."""
    flashx.registry.register(OffByALittle())
    try:
        assert cli.main(["demo", "--seqlen", "100", "--device", "cpu"]) == 1
    finally:
        flashx.registry.unregister("off-by-a-little")
    captured = capsys.readouterr()
    assert "backend (auto)       off-by-a-little" in captured.out
    assert re.search(r"max \|o - o_ref\| = 1\.00e-03 ", captured.out), captured.out
    assert "FAILED: error above 0.0001" in captured.err


# -- commands from plugins ---------------------------------------------------------------------

GREET = """
from flashx.hookspecs import Command, hookimpl

def greet(args):
    print(f"hello, {args.name}")
    return 3

def echo(argv):
    print(argv)
    return 0

@hookimpl
def flashx_commands():
    return [Command("greet", "say hello", run=greet, add_arguments=lambda parser: parser.add_argument("--name")),
            Command("echo", "print the words after echo", run=echo, own_arguments=True)]
"""
FAILING = """
from flashx.hookspecs import hookimpl

@hookimpl
def flashx_commands():
    raise RuntimeError("no terminal here")
"""
TAKEN = """
from flashx.hookspecs import Command, hookimpl

@hookimpl
def flashx_commands():
    return [Command("demo", "another demo", run=lambda args: 0), "not a command",
            Command("shout", "say it louder", run=lambda args: print("HELLO") or 0)]
"""


def install(root, name, module, source):
    """A distribution on sys.path whose module is a plugin of the flashx.plugins group."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[flashx.plugins]\n{name} = {module}\n")


@pytest.fixture
def command_plugins(tmp_path, monkeypatch):
    """Three installed plugins: greet-plugin's commands work; failing-commands' hook raises;
    taken-names returns, beside a command that works, one named like the core's and one that is
    no Command."""
    install(tmp_path, "greet-plugin", "greet_flashx_plugin", GREET)
    install(tmp_path, "failing-commands", "failing_commands_flashx_plugin", FAILING)
    install(tmp_path, "taken-names", "taken_names_flashx_plugin", TAKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    flashx.registry.reset()
    yield tmp_path
    flashx.registry.reset()


def test_a_plugin_command_gets_its_parsed_arguments(command_plugins, capsys):
    assert cli.main(["greet", "--name", "flashx"]) == 3
    assert capsys.readouterr().out == "hello, flashx\n"
    with pytest.raises(SystemExit) as exit:
        cli.main(["greet", "--loud"])
    assert exit.value.code == 2
    assert "flashx: error: unrecognized arguments: --loud" in capsys.readouterr().err


def test_a_command_with_its_own_arguments_gets_them_unparsed(command_plugins, capsys):
    assert cli.main(["echo", "--help", "decode", "-x"]) == 0
    assert capsys.readouterr().out == "['--help', 'decode', '-x']\n"


def test_commands_that_fail_to_load_are_reported_and_break_nothing(command_plugins, capsys):
    assert {"greet", "echo", "shout", "bench", "tune"} <= flashx.registry.commands().keys()
    assert flashx.registry.commands().keys().isdisjoint(hookspecs.CORE_COMMANDS)
    failures = [(failure.plugin, failure.load_error.rstrip().splitlines()[-1])
                for failure in flashx.registry.command_failures()]
    assert sorted(failures) == [("failing-commands", "RuntimeError: no terminal here"),
                                ("taken-names", "TypeError: 'not a command' is not a flashx.hookspecs.Command"),
                                ("taken-names", "ValueError: command name 'demo' is taken (by flashx)")]
    assert cli.main(["shout"]) == 0 and capsys.readouterr().out == "HELLO\n"
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "\nplugin failing-commands: commands left out:\nTraceback" in out
    assert "RuntimeError: no terminal here" in out and "command name 'demo' is taken (by flashx)" in out
    assert cli.main(["demo", "--seqlen", "5", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")


def test_a_command_name_is_the_first_plugins(command_plugins):
    install(command_plugins, "rival-greet", "rival_greet_flashx_plugin", GREET.replace("say hello", "hello again"))
    flashx.registry.reset()
    owner, refused = (("greet-plugin", "rival-greet") if flashx.registry.commands()["greet"].help == "say hello"
                      else ("rival-greet", "greet-plugin"))
    refusals = [f.load_error.rstrip().splitlines()[-1] for f in flashx.registry.command_failures() if f.plugin == refused]
    assert refusals == [f"ValueError: command name '{name}' is taken (by {owner})" for name in ("greet", "echo")]


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
    monkeypatch.setattr(devices, "cuda_present", lambda: False)
    assert "sees no CUDA device" in _cuda_refusal(capsys)


def test_demo_on_cuda_without_a_backend_for_it_gives_their_reasons(monkeypatch, capsys):
    pytest.importorskip("torch")
    rows = [
        SimpleNamespace(name="numpy", devices=("cpu",), available=True, reason=None),
        SimpleNamespace(name="triton", devices=("cuda",), available=False, reason="cannot import triton"),
    ]
    monkeypatch.setattr(devices, "cuda_present", lambda: True)
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
