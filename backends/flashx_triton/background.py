"""Kernels compiled in another process, into Triton's cache on disk, while this one goes on.

Triton's compiler holds the GIL, so a compile in a thread of this process takes its time from
the calls; a process of its own does not. ``compile_elsewhere`` takes a launch's arguments,
lets Triton's JIT specialise them as for a launch, and stops it before it compiles
(``knobs.runtime.jit_cache_hook``): what it would have compiled, Triton's
``specialization_data``, goes to a worker process that compiles it with
``JITFunction.preload``. The worker writes Triton's cache (the directory this process uses), so
a launch here that comes after it finds the kernel there and loads it; had the worker failed, the
launch compiles here as any first launch does. The result is the same kernel either way: the
worker compiles for this process's target the same source, specialisation and options.

One worker per process and target compiles one kernel at a time: on a host with few cores, more
would take them from the calls. It starts with the first kernel sent to it (Python, torch and
Triton imported: about 1.5 s of a core) and is killed when this process exits; what it had not
finished is then compiled by whichever call needs it.

The worker is this module run as ``python -m flashx_triton.background``: its first line in is the
target, each later one a kernel to compile; it answers one line per kernel, in order.
"""

from __future__ import annotations

import atexit
import collections
import importlib
import json
import os
import subprocess
import sys
import threading


class Compiling:
    """A kernel sent to the worker: ``done()`` once the worker has answered (or died), ``wait()``
    until then."""

    def __init__(self):
        self._answered = threading.Event()

    def done(self) -> bool:
        return self._answered.is_set()

    def wait(self) -> None:
        self._answered.wait()


def compile_elsewhere(kernel, args: tuple, grid: tuple, options: dict) -> Compiling | None:
    """Send the kernel that ``kernel[grid](*args, **options)`` would compile to the worker;
    None where there is nothing to send: the kernel is compiled in this process already, or runs
    under Triton's interpreter, or no worker could start."""
    from flashx_triton import tuning

    if tuning.interpreting():
        return None
    sent = _specialisation(kernel, args, grid, options)
    if sent is None:
        return None
    from triton.runtime import driver

    try:
        return _worker(driver.active.get_current_target()).send(*sent)
    except OSError:  # no process to be had (a sandbox, no executable): the launch compiles here
        return None


def _specialisation(kernel, args: tuple, grid: tuple, options: dict) -> tuple[str, str, str] | None:
    """(module, name, Triton's specialization_data) of the kernel a launch with these arguments
    would compile; None where this process has compiled it already."""
    from triton import knobs

    me, found = threading.get_ident(), []
    other = knobs.runtime.jit_cache_hook

    def declined(**hook):
        function = hook["fn"]
        if threading.get_ident() != me or function.jit_function is not kernel:  # another thread's compile
            return other(**hook) if other is not None else None
        found.append((function.module, function.name, hook["compile"]["specialization_data"]))
        return True  # compile nothing here

    knobs.runtime.jit_cache_hook = declined
    try:
        kernel.warmup(*args, grid=grid, **options)
    finally:
        knobs.runtime.jit_cache_hook = other
    return found[0] if found else None


class _Worker:
    def __init__(self, target):
        from triton import knobs

        # This process's cache, module path and environment: the worker must compile what a
        # launch here looks up.
        env = dict(os.environ, TRITON_CACHE_DIR=knobs.cache.dir, PYTHONPATH=os.pathsep.join(filter(None, sys.path)))
        self.process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        self.waiting: collections.deque[Compiling] = collections.deque()
        self.lock = threading.Lock()  # a line written and its Compiling queued, in the same order
        self.process.stdin.write(json.dumps(target.__dict__) + "\n")
        self.process.stdin.flush()
        threading.Thread(target=self._answers, daemon=True).start()

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, module: str, name: str, specialization: str) -> Compiling:
        compiling = Compiling()
        with self.lock:
            self.waiting.append(compiling)
            try:
                self.process.stdin.write(json.dumps(dict(module=module, name=name, specialization=specialization))
                                         + "\n")
                self.process.stdin.flush()
            except OSError:  # the worker has ended: answered, by nobody
                compiling._answered.set()
                raise
        return compiling

    def _answers(self) -> None:
        for _ in self.process.stdout:
            self.waiting.popleft()._answered.set()
        # The worker ended: whatever it had not answered is compiled by the calls that need it.
        while self.waiting:
            self.waiting.popleft()._answered.set()


_workers: dict[tuple, _Worker] = {}
_starting = threading.Lock()


def _worker(target) -> _Worker:
    # by process too: a forked child has its parent's objects but neither its pipes' far ends nor its threads
    key = (os.getpid(), target)
    with _starting:
        found = _workers.get(key)
        if found is None or not found.alive():
            found = _workers[key] = _Worker(target)
    return found


def wait_for_all() -> None:
    """Until every kernel sent from this process has been compiled (or its worker has died)."""
    for (pid, _), worker in list(_workers.items()):
        if pid == os.getpid():
            for compiling in list(worker.waiting):
                compiling.wait()


@atexit.register
def _stop() -> None:
    for (pid, _), worker in _workers.items():
        if pid == os.getpid():
            worker.process.kill()


class _TargetOnly:
    """The driver a compile needs and no more: the target to compile for, on device 0."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_target(self):
        return self.target


def _serve() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what a compiler prints must not pass for an answer
    sys.stdout = sys.stderr
    target = json.loads(sys.stdin.readline())
    driver.set_active(_TargetOnly(GPUTarget(**target)))
    for line in sys.stdin:
        job = json.loads(line)
        try:
            getattr(importlib.import_module(job["module"]), job["name"]).preload(job["specialization"])
            answer = "compiled"
        except Exception as error:  # the launch that needs it compiles it and raises there
            answer = f"failed: {type(error).__name__}"
        print(answer, file=answers, flush=True)


if __name__ == "__main__":
    _serve()
