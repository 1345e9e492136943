"""Compiled kernels kept on disk: a process loads the cubins an earlier one compiled instead of
compiling them again (NVVM and ptxas: seconds a kernel).

numba-cuda's own cache (``cuda.jit(cache=True)``) does the storing: per kernel an index file
and data files, written atomically, each entry the kernel's cubin for a compute capability with
its PTX and LLVM IR. Used as it comes it would serve the kernels here badly, and ``KernelCache``
changes four things:

- The key. numba-cuda keys an entry by the signature, the compute capability and CUDA
  runtime, its own version, and a digest of the pickled closure. The kernels here close over
  the device functions of a ``fragments`` form, whose pickles carry the per-process uuids of
  the intrinsics they call: no process would find another's entry. The key here holds the same
  parts with the factory's arguments (``Tiles``, dtype, tensor cores) in place of the closure:
  with the sources, they fix every constant a kernel closes over.
- Freshness. numba-cuda dates an entry by the kernel's own file; a kernel here is also made of
  ``primitives``, ``fragments``, ``mma`` and ``philox``. The stamp of an index is a digest of
  every source file of this package, so an edit anywhere in it compiles every kernel again (an
  index of another stamp reads as empty, and its entries are overwritten).
- Loading. numba-cuda refreshes its target context before it looks an entry up, which imports
  every typing and lowering registry (0.7 s where it was measured, while the four kernels of a
  fwd+bwd load in 0.06 s); a loaded kernel launches without them, and a compile refreshes the
  context itself.
- Failures. An entry that cannot be read (a damaged index or data file, a cubin the driver
  rejects) warns and is compiled again, the kernel's index reset so that the new entry can be
  written; an entry that cannot be written, or a directory that cannot be made, warns and the
  kernel is compiled for this process only. No call fails for its cache.

The files live in ``<cache>/numba-kernels``, where <cache> is ``$FLASHX_CACHE_DIR``, else
``$XDG_CACHE_HOME/flashx``, else ``~/.cache/flashx`` (as the Triton backend's tuning records),
named after the kernel (``kernels.forward_kernel.locals.kernel-<line>.py<version>.nbi``); one
index holds every specialization of a kernel. Two processes saving entries of one kernel at
once may leave one of the two in the index: the other is compiled again by a later process.

Under the CUDA simulator nothing is compiled, and nothing is kept.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import warnings
from pathlib import Path

from numba import cuda

from flashx.storage import cache_directory
from flashx_numba.primitives import SIMULATOR

TABLE = "numba-kernels"


def table_directory() -> Path:
    """The folder of the compiled kernels in flashx's cache directory."""
    return cache_directory() / TABLE


def sources_digest(package: Path) -> str:
    """A digest of the names and contents of the ``*.py`` files of ``package``."""
    digest = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def package_digest() -> str:
    """``sources_digest`` of this package, read once: the sources the running kernels came from."""
    return sources_digest(Path(__file__).parent)


def cached_kernel(signature, *specialization, launch_bounds=None):
    """``cuda.jit(signature, launch_bounds=launch_bounds)``, the compiled kernel kept on disk under
    ``specialization``: the arguments of the factory that builds it, which with this package's
    sources must fix everything the kernel closes over (its launch bounds among them). The
    simulator takes no launch bounds."""

    def compile_kernel(py_func):
        if SIMULATOR:
            return cuda.jit(signature)(py_func)
        kernel = cuda.jit(py_func, launch_bounds=launch_bounds)  # cuda.jit(signature)'s dispatcher, before it compiles
        # numba-cuda takes no cache but its own (``enable_caching``): the dispatcher's is replaced
        kernel._cache = _kernel_cache(py_func, specialization)
        kernel.compile(signature.args)
        kernel.disable_compile()
        kernel._specialized = True  # as cuda.jit(signature) leaves it: a launch skips typing its arguments
        return kernel

    return compile_kernel


if not SIMULATOR:
    import numba_cuda
    from numba.cuda.core.caching import NullCache, _CacheLocator
    from numba.cuda.dispatcher import CUDACache, CUDACacheImpl
    from numba.cuda.utils import numba_target_override

    class _Locator(_CacheLocator):
        """Every kernel in ``<cache>/numba-kernels``, stamped with the package's digest."""

        def __init__(self, py_func):
            self._path = str(table_directory())
            self._lineno = py_func.__code__.co_firstlineno

        def get_cache_path(self):
            return self._path

        def get_source_stamp(self):
            return package_digest()

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            locator = cls(py_func)
            locator.ensure_cache_path()  # an OSError: no cache (``_kernel_cache``)
            return locator

    class _KernelCacheImpl(CUDACacheImpl):
        _locator_classes = [_Locator]

    class KernelCache(CUDACache):
        """numba-cuda's kernel cache, keyed by specialization rather than closure, where no
        failure to read or write escapes (see the module's docstring)."""

        _impl_class = _KernelCacheImpl

        def __init__(self, py_func, specialization: tuple):
            self._specialization = specialization
            super().__init__(py_func)

        def _index_key(self, sig, codegen):
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__, self._specialization)
            return key if self._launch_config_key is None else (*key, ("launch_config", self._launch_config_key))

        def load_overload(self, sig, target_context):
            """numba-cuda's, less its refresh of the target context (see the module's docstring)."""
            try:
                with numba_target_override():
                    kernel = self._load_overload(sig, target_context)
                if kernel is not None:
                    kernel.bind()  # the cubin loads now: one the driver rejects is compiled again, not met at launch
                return kernel
            except Exception as error:  # unpickling a damaged file raises nearly anything
                warnings.warn(f"flashx: cannot load {self._described()} from {self.cache_path} ({error!r}); "
                              "it is compiled again", stacklevel=2)
                with contextlib.suppress(OSError):
                    self.flush()  # a damaged index would refuse every later entry
                return None

        def save_overload(self, sig, data):
            try:
                super().save_overload(sig, data)
            except Exception as error:  # OSError, or a kernel numba-cuda cannot pickle
                warnings.warn(f"flashx: could not keep {self._described()} in {self.cache_path} ({error!r}); "
                              "it is compiled again in the next process", stacklevel=2)

        def _described(self) -> str:
            return f"the compiled kernel {self._py_func.__qualname__} {self._specialization}"

    def _kernel_cache(py_func, specialization: tuple):
        """A ``KernelCache``, or numba-cuda's null cache where its directory cannot be made or written."""
        try:
            return KernelCache(py_func, specialization)
        except OSError as error:
            warnings.warn(f"flashx: cannot keep compiled kernels in {table_directory()} ({error}); "
                          "they are compiled in every process", stacklevel=3)
            return NullCache()
