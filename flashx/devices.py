"""Whether this machine has a CUDA device, asked once here for everything that needs to know.

The question goes to torch, imported only when asked (the core never needs it), so that the
conformance suite's default device, the ``flashx`` command and nox's choice of CPU
stand-ins always agree.
"""

from __future__ import annotations


def cuda_present() -> bool:
    """True when torch is installed and sees at least one CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def cuda_refusal(install_hint: str) -> str | None:
    """Why nothing can run on CUDA here (torch missing, ``install_hint`` naming what to install,
    or no device), or None."""
    try:
        import torch
    except ImportError:
        return f"needs torch, which is not installed: {install_hint}"
    if not cuda_present():
        return f"torch {torch.__version__} sees no CUDA device"
    return None
