"""Arrays in and out through DLPack: NumPy, torch (CPU/CUDA) and CuPy.

flashx never imports an array library to inspect an array: it reads the type's module,
and it converts through ``from_dlpack`` of the target library, which shares memory.
The one copy the contract states: torch bfloat16 going to a NumPy backend (NumPy has no
bfloat16) is widened to float32 on the way in and rounded back on the way out. Torch FP8
tensors, which DLPack does not carry, go to NumPy and CuPy backends as uint8 views of their
bits: no copy, and a decoding cache stays writable in place.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from flashx.errors import DTypeError

KINDS = ("numpy", "torch", "cupy")
#: The 8-bit input dtypes of the contract's FP8 section, which only torch holds among the kinds.
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})


_kind_by_type: dict[type, str | None] = {}
_dtype_names: dict[Any, str] = {}


def kind_of(x: Any) -> str | None:
    """"numpy", "torch", "cupy", or None for anything else."""
    cls = type(x)
    kind = _kind_by_type.get(cls, "?")
    if kind == "?":
        root = cls.__module__.partition(".")[0]
        kind = _kind_by_type[cls] = root if root in KINDS else None
    return kind


def dtype_name(x: Any) -> str:
    dtype = x.dtype
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.") if kind_of(x) == "torch" else dtype.name
    return name


def device_of(x: Any) -> tuple[str, int | None]:
    """("cpu", None) or ("cuda", index)."""
    kind = kind_of(x)
    if kind == "torch":
        device = x.device
        return device.type, device.index
    if kind == "cupy":
        return "cuda", x.device.id
    return "cpu", None


def signature(x: Any) -> tuple | None:
    """Type, shape, dtype and device, hashable: all that validation reads of an array (None: not one)."""
    kind = kind_of(x)
    if kind is None:
        return None
    return type(x), x.shape, x.dtype, x.device if kind == "torch" else device_of(x)


def metadata(x: Any) -> tuple | None:
    """``signature`` with the strides: all that a call reads of an array but its contents and its
    address, hashable (None: not an array, or a torch tensor without strides, such as a sparse one)."""
    kind = kind_of(x)
    if kind == "torch":
        try:
            return type(x), x.shape, x.stride(), x.dtype, x.device
        except RuntimeError:  # no strides: the call's checks say what is wrong with it
            return None
    if kind is None:
        return None
    return type(x), x.shape, x.strides, x.dtype, device_of(x)


def resolved(x: Any) -> Any:
    """``x`` with torch's lazy negation and conjugation applied (DLPack and raw pointers drop both bits)."""
    if kind_of(x) == "torch" and (x.is_neg() or x.is_conj()):
        return x.resolve_neg().resolve_conj()
    return x


def traced(x: Any) -> bool:
    """Whether ``x`` is a torch tensor seen by torch.compile or torch.export, not a real one:
    then calls go through flashx's torch operators (``flashx.ops``)."""
    if kind_of(x) != "torch":
        return False
    import torch  # a plain import: Dynamo traces it (importlib would break the graph here)

    return torch.compiler.is_compiling()


def under_autocast(*xs: Any) -> tuple:
    """``xs`` (torch tensors) in torch.autocast's dtype where autocast is on for their device, as
    SDPA takes them: a model under autocast (``Trainer(bf16=True)``) can hand attention q and k
    in float32 beside a bfloat16 v. Other arrays, and tensors outside autocast, as they are."""
    first = xs[0]
    if kind_of(first) != "torch":
        return xs
    import torch  # a plain import: Dynamo traces it (importlib would break the graph here)

    device = first.device.type
    if not torch.is_autocast_enabled(device) or dtype_name(first) in FP8_DTYPES:  # FP8 is quantized on purpose
        return xs
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if kind_of(x) == "torch" and x.is_floating_point() else x for x in xs)


def module(kind: str):
    return importlib.import_module(kind)


def convert(x: Any, kind: str) -> Any:
    """The same memory seen as an array of ``kind`` (no copy, except torch bfloat16 to NumPy)."""
    source = kind_of(x)
    if source == kind:
        return x
    if source == "torch":
        x = x.detach()
        if kind == "numpy" and dtype_name(x) == "bfloat16":
            x = x.float()
        elif dtype_name(x) in FP8_DTYPES:
            x = x.view(module("torch").uint8)
    return module(kind).from_dlpack(x)


def for_backend(backend) -> Callable[[str, Any], Any]:
    """How an auxiliary array named ``name`` reaches ``backend``: as its ``array_kind``, and
    contiguous unless the backend declares that it reads that array's strides."""
    kind, strided = backend.array_kind, backend.strided_arrays

    def reach(name: str, x: Any) -> Any:
        x = convert(x, kind)
        return x if name in strided else contiguous(x)

    return reach


def to_caller(y: Any, like: Any, dtype: str) -> Any:
    """A backend's output as the caller's kind of array, in the contract's dtype."""
    kind = kind_of(like)
    y = astype(convert(y, kind), dtype)
    if kind == "numpy" and not y.dtype.isnative:
        return y.astype(y.dtype.newbyteorder("="))
    return y


def detached(x: Any) -> Any:
    """``x`` without torch's autograd history (itself for other kinds): an auxiliary array in a
    problem is data; autograd reaches the caller's tensor through the call's own inputs."""
    return x.detach() if kind_of(x) == "torch" else x


def astype(x: Any, dtype: str) -> Any:
    """``x`` in ``dtype``, on its device: itself when it already is."""
    if dtype_name(x) == dtype:
        return x
    if kind_of(x) == "torch":
        return x.to(getattr(module("torch"), dtype))
    return x.astype(dtype)


def contiguous(x: Any) -> Any:
    """``x`` in row-major order with no gaps (itself when it already is): what a backend that
    indexes an auxiliary array by position needs, whatever view the caller passed."""
    kind = kind_of(x)
    if kind == "torch":
        return x.contiguous()
    return module(kind).ascontiguousarray(x)


def to_host(x: Any):
    """A NumPy copy of a small array (lengths, offsets) for validation."""
    kind = kind_of(x)
    if kind == "torch":
        return x.detach().cpu().numpy()
    if kind == "cupy":
        return x.get()
    return x


def full(like: Any, shape: tuple[int, ...], value: float, dtype: str) -> Any:
    """A new array of ``like``'s kind and device."""
    kind = kind_of(like)
    if kind == "torch":
        torch = module("torch")
        return torch.full(shape, value, dtype=getattr(torch, dtype), device=like.device)
    if kind == "cupy":
        with like.device:
            return module("cupy").full(shape, value, dtype=dtype)
    return module("numpy").full(shape, value, dtype=dtype)


def require_array(x: Any, argument: str) -> str:
    kind = kind_of(x)
    if kind is None:
        raise DTypeError(f"{argument}: expected a NumPy array, torch tensor or CuPy array, got {type(x).__name__}")
    return kind
