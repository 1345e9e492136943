"""A compiled kernel launched again with as little host work as Triton 3.6 allows.

A short causal step is five launches and is timed by the host, not the GPU (docs/triton-design.md,
"Host work per call"). Most of a launch's host time through ``CompiledKernel[grid]`` is Python
around Triton's C launcher, which ``direct`` leaves out:

- with a host TMA descriptor among the arguments, Triton wraps the C launch in a loop over every
  argument (``wrap_handle_tensordesc``; 66-86 of ours) and encodes each descriptor again
  (``make_tensordesc_arg``). Here the bound arguments are laid out once and a descriptor is encoded
  once per tensor address (its shape, strides and tile are the launch's layout, fixed);
- every launch builds launch metadata and has the C launcher call two hook chains, empty unless a
  profiler registered a hook. Here none are passed while both chains are empty, and Triton's own
  runner launches whenever one is not.

It reaches into Triton's launcher, so it is built only where the launcher is laid out as in 3.6
(the C launch's leading arguments, the descriptor wrapper's closure: checked, not assumed);
anywhere else ``direct`` hands back Triton's runner.
"""

from __future__ import annotations

import inspect
from typing import Callable

#: the C launch's leading arguments in Triton 3.6: grid (3), stream, function, cooperative, PDL,
#: global and profile scratch, kernel metadata, launch metadata, enter and exit hooks
_LEADING_FORMAT = "iiiKKppOOOOOO"
_ENCODED_PER_DESCRIPTOR = 64  # tensor addresses remembered per descriptor argument


def direct(compiled, grid: tuple[int, int, int], per_call: int, bound: tuple) -> Callable:
    """``launch(*per_call_args)``: ``compiled[grid](*per_call_args, *bound)``, the ``per_call``
    leading arguments new each call and ``bound`` the same every time."""
    fallback = through_runner(compiled, grid, per_call, bound)  # also loads the kernel
    found = _c_launch(compiled)
    if found is None:
        return fallback
    c_launch, descriptors = found
    if any(position >= per_call for position in descriptors):
        return fallback
    import triton
    from triton import knobs
    from triton.backends.nvidia.driver import make_tensordesc_arg

    hooks = knobs.runtime
    driver = triton.runtime.driver.active
    current_stream, current_device = driver.get_current_stream, driver.get_current_device
    launcher = compiled.run
    function, metadata = compiled.function, compiled.packed_metadata
    cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
    metas = [descriptors.get(position, _PLAIN) for position in range(per_call)]
    encoded = {position: {} for position in descriptors}

    def encode(position, descriptor, meta):
        if meta is None:  # a descriptor Triton did not lower to TMA: passed as its tensor, shape, strides
            return make_tensordesc_arg(descriptor, meta)
        by_address = encoded[position]
        address = descriptor.base.data_ptr()
        found = by_address.get(address)
        if found is None:
            if len(by_address) >= _ENCODED_PER_DESCRIPTOR:
                by_address.clear()
            found = by_address[address] = make_tensordesc_arg(descriptor, meta)
        return found

    def launch(*args):
        if getattr(hooks.launch_enter_hook, "calls", True) or getattr(hooks.launch_exit_hook, "calls", True):
            return fallback(*args)  # a profiler's hooks: Triton builds what they are given
        flat = [*grid, current_stream(current_device()), function, cooperative, pdl, None, None, metadata, None, None,
                None]
        for position, (arg, meta) in enumerate(zip(args, metas)):
            if meta is _PLAIN:
                flat.append(arg)
            else:
                flat.extend(encode(position, arg, meta))
        c_launch(*flat, *bound)

    return launch


_PLAIN = object()  # an argument passed as it is


def through_runner(compiled, grid: tuple[int, int, int], per_call: int, bound: tuple) -> Callable:
    """``direct``'s launch through Triton's own runner (``CompiledKernel[grid]``)."""
    runner = compiled[grid]

    def launch(*args):
        runner(*args, *bound)

    return launch


def _c_launch(compiled):
    """(Triton's C launch of ``compiled``, {argument position: descriptor metadata}), or None where
    the launcher is not laid out as in Triton 3.6 or needs scratch memory allocated per launch."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return None
    launcher = getattr(compiled, "run", None)
    if (getattr(nvidia, "_BASE_ARGS_FORMAT", None) != _LEADING_FORMAT
            or not isinstance(launcher, getattr(nvidia, "CudaLauncher", ()))
            or getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)):
        return None
    launch = launcher.launch
    if inspect.isbuiltin(launch):  # no descriptor among the arguments: the C launch itself
        return launch, {}
    if getattr(launch, "__qualname__", None) != "wrap_handle_tensordesc.<locals>.inner":
        return None
    closure = inspect.getclosurevars(launch).nonlocals
    try:
        positions, metas = sorted(closure["tensordesc_indices"]), closure["tensordesc_meta"]
        return closure["launcher"], dict(zip(positions, metas, strict=True))
    except (KeyError, TypeError, ValueError):
        return None
