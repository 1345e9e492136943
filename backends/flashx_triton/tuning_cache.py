"""The tuner's choices kept on disk, so that tuning is paid once per machine rather than once per process.

A choice is valid for one environment: the GPU (its name and compute capability), Triton's
version, and flashx's version with a digest of this package's sources (a kernel edited under an
unchanged version number must be tuned again: the tuner's agreement check, which a stored choice
skips, is what catches a configuration that miscompiles). Each choice is one file,

    <cache>/triton-tuning/<environment>/<kernel key>.json

where <cache> is ``$FLASHX_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashx``, else ``~/.cache/flashx``.
One file per choice means that processes tuning different keys never share a file, and a writer
writes a temporary file beside the record and renames it over it (``os.replace``, atomic), so a
reader sees a whole record or none; two processes tuning the same key leave one of their two
choices. A record that cannot be read or parsed is ignored with a warning, and one that names
another environment or key (two names alike once made safe for a file system) silently: either
way the kernel is tuned again and the record rewritten. A record that cannot be written is
reported by a warning and the call goes on. ``flashx tune --clear`` (``clear``) removes them all.

This module imports neither torch nor Triton until an environment is asked for.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from flashx.storage import cache_directory

TABLE = "triton-tuning"


@dataclass(frozen=True)
class Environment:
    """What a tuned choice holds for: the same kernels compiled by the same Triton for the same GPU."""

    gpu: str  # torch.cuda.get_device_name
    capability: str  # "sm_90"
    triton: str
    flashx: str  # flashx's version + "+" + the digest of this package's sources

    @property
    def directory(self) -> Path:
        return table_directory() / _file_name(f"{self.gpu}-{self.capability}-triton{self.triton}-flashx{self.flashx}")

    def __str__(self) -> str:
        return f"{self.gpu} ({self.capability}), triton {self.triton}, flashx {self.flashx}"


def table_directory() -> Path:
    return cache_directory() / TABLE


def environment(device_index: int | None) -> Environment:
    """The environment of the CUDA device ``device_index`` (under TRITON_INTERPRET=1: the interpreter's)."""
    import triton

    import flashx

    gpu, capability = (("Triton interpreter", "cpu") if os.environ.get("TRITON_INTERPRET") == "1"
                       else _gpu(device_index))
    return Environment(gpu, capability, triton.__version__, f"{flashx.__version__}+{_source_digest()}")


@functools.cache
def _gpu(device_index: int | None) -> tuple[str, str]:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return torch.cuda.get_device_name(device_index), f"sm_{major}{minor}"


@functools.cache
def _source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def load(where: Environment, key: str) -> Any:
    """The stored choice of kernel key ``key`` in ``where`` (as ``store`` was given it), or None."""
    path = _record_path(where, key)
    try:
        record = json.loads(path.read_text())
        if record["environment"] != asdict(where) or record["key"] != key:
            return None
        return record["choice"]
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        warnings.warn(f"flashx: cannot read the tuning record {path} ({error}); the kernel is tuned again",
                      stacklevel=2)
        return None
    except (ValueError, KeyError, TypeError) as error:
        warnings.warn(f"flashx: ignoring the damaged tuning record {path} ({error!r}); the kernel is tuned again",
                      stacklevel=2)
        return None


def store(where: Environment, key: str, choice: Any, median_ms: float | None) -> None:
    """Keep ``choice`` (anything JSON holds) for kernel key ``key`` in ``where``; a failure warns."""
    path = _record_path(where, key)
    record = {"environment": asdict(where), "key": key, "choice": choice, "median_ms": median_ms}
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(record, file, indent=1)
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        warnings.warn(f"flashx: could not keep a tuning choice in {path} ({error}); it holds for this process only",
                      stacklevel=2)


def records() -> Iterator[tuple[Path, dict | None]]:
    """Every record on disk, by path, with its contents (None: unreadable)."""
    for path in sorted(table_directory().glob("*/*.json")):
        try:
            yield path, json.loads(path.read_text())
        except (OSError, ValueError):
            yield path, None


def clear() -> int:
    """Remove every record (and any temporary file a killed writer left); returns how many records there were."""
    directory = table_directory()
    if not directory.exists():
        return 0
    count = sum(1 for _ in directory.glob("*/*.json"))
    shutil.rmtree(directory)
    return count


def _record_path(where: Environment, key: str) -> Path:
    return where.directory / f"{_file_name(key)}.json"


def _file_name(text: str) -> str:
    """``text`` with every character that some file system refuses or treats specially made "_"."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)
