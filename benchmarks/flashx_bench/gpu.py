"""The GPU sweep: ceilings, a correctness check, memory, the speed of every implementation, and
the host time of its calls at short sequences.

Every measurement lands in one JSON document, saved after each row (``records.partial_path``),
so that a run stopped at its time limit still leaves everything it measured. ``Runner`` runs and
times one implementation at one shape, for this sweep and the feature sweep (``features``) alike.

An FP8 implementation (``flashx-<backend>-fp8``, ``implementations.flashx_fp8``) is timed on
float8_e4m3fn casts of the same inputs, beside the bf16 implementations at every shape. It is
forward only: its forward+backward, its memory (one forward+backward) and its forward+backward host
time are rows "not applicable" (NOT_APPLICABLE). Its check compares o alone with the same float32
reference as the bf16 implementations', under FP8_CHECK_TOLERANCE. The report sets its forward
against the same backend's bf16 forward and grades issue 43's targets (``report.fp8_targets``).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

import flashx
from flashx_bench import records
from flashx_bench.report import MODES, NOT_APPLICABLE, SECTIONS
from flashx_bench.implementations import (CHECK_TOLERANCE, FP8_CHECK_TOLERANCE, Implementation, Shape, absent,
                                          failure_status, fa4_version, settle_flashx, to_bhsd, to_layout)
from flashx_bench.progress import Progress

BACKWARD_FLOPS = 2.5  # the backward costs 2.5 forwards, as flash-attn counts (5 matmuls against 2)
WARMUP_MS = 25
REP_MS = 100
REST_S = 1.0  # idle before each timing, after the first call (compiles, autotuning): see SmClock
HOST_CALLS = 20  # calls timed back to back in one round of the host section
HOST_ROUNDS = 3
HOST_BUSY_S = 0.1  # GPU work queued ahead of each round: longer than the round's host time
MIB = 2**20


def attention_flops(shape: Shape, mode: str) -> float:
    """FLOPs as flash-attn counts them: two N x N x D matmuls a head, halved when causal."""
    forward = 4 * shape.batch * shape.heads * shape.seqlen**2 * shape.head_dim / (2 if shape.causal else 1)
    return forward * (1 + BACKWARD_FLOPS) if mode == "fwd+bwd" else forward


def median_ms(fn, grad_to_none=None) -> float:
    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=grad_to_none, return_mode="median")


class SmClock:
    """The SM clock (MHz) while a point is timed: the median of the samples, read every SAMPLE_S
    through NVML (``torch.cuda.clock_rate``) on a thread of its own, that fall in the last REP_MS
    (the repeats, not a compile or the warm-up before them); None where NVML cannot be read.

    Why: under sustained load the H100 holds its 700 W cap by lowering the clock, so a point
    compares the energy each call takes as much as its speed, and an implementation timed right
    after seconds of idle (a compile) runs at the full clock. At d128 N = 1k, flashx's fwd+bwd ran
    at 1800 MHz and Flex's at 1920 after 3 s of each; rested 2 ms before each step, both ran at
    1980 and flashx was 8% faster. So each timing starts after REST_S of idle
    (``_rested_median_ms``): after 3 s of steps, 1 s of rest brought the clock back to 1920-1980
    MHz, and the table shows whether it did. (NVML's power reading is averaged over about a
    second, too long for a point: not recorded.)
    """

    SAMPLE_S = 0.02

    def __init__(self, device: torch.device):
        self.device = device
        self.samples: list[tuple[float, float]] = []  # (time, MHz)
        self.end = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            try:
                mhz = torch.cuda.clock_rate(self.device)
            except Exception:  # noqa: BLE001 - no NVML here: the row says None
                return
            self.samples.append((time.perf_counter(), float(mhz)))

    def __enter__(self) -> SmClock:
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.end = time.perf_counter()
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()

    def median_mhz(self) -> float | None:
        timed = [mhz for at, mhz in self.samples if at >= self.end - REP_MS / 1e3]
        return statistics.median(timed) if timed else None


@dataclass(frozen=True)
class Plan:
    seqlens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    head_dims: tuple[int, ...] = (64, 128)
    causals: tuple[bool, ...] = (False, True)
    tokens: int = 16384  # B * N of every speed shape
    model_dim: int = 2048  # H * D of every speed shape
    check_seqlen: int = 1024
    host_seqlens: tuple[int, ...] = (512, 1024)  # causal: where a step can wait on the host
    memory_seqlens: tuple[int, ...] = (4096, 16384, 65536, 131072)
    memory_heads: int = 16
    memory_head_dim: int = 128
    matmul_size: int = 8192
    copy_bytes: int = 2**31
    dtype: str = "bfloat16"

    def speed_shapes(self) -> list[Shape]:
        # Longest sequences first: when a budget runs out, the shortest go untimed.
        return [
            Shape(self.tokens // n, n, self.model_dim // d, d, causal)
            for n in sorted(self.seqlens, reverse=True)
            for d in self.head_dims
            for causal in self.causals
        ]

    def check_shapes(self) -> list[Shape]:
        return [Shape(2, self.check_seqlen, 4, d, causal) for d in self.head_dims for causal in self.causals]

    def memory_shapes(self) -> list[Shape]:
        return [Shape(1, n, self.memory_heads, self.memory_head_dim, True) for n in self.memory_seqlens]

    def host_shapes(self) -> list[Shape]:
        return [Shape(self.tokens // n, n, self.model_dim // d, d, True) for n in self.host_seqlens for d in self.head_dims]


FULL = Plan()
QUICK = Plan(seqlens=(2048, 8192), head_dims=(128,), host_seqlens=(1024,), memory_seqlens=(4096, 16384))


def _device_facts(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory
    return platform.processor() or platform.machine(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Runner:
    """What every GPU sweep shares: one device and dtype, a time limit, a compile budget, and how one
    implementation runs at one shape, timed in each mode (or why not)."""

    def __init__(self, device: torch.device, dtype: str, time_limit_s: float | None = None,
                 compile_budget_s: float | None = None):
        self.device = device
        self.dtype = getattr(torch, dtype)
        self.deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
        self.compile_budget_s = compile_budget_s
        self.compiled_s = 0.0
        self.device_name, self.capacity = _device_facts(device)

    def facts(self) -> dict:
        """A record's first fields: the device, the date, the versions, and the peers absent here."""
        fa4 = fa4_version()
        return {
            "device": self.device_name,
            "device_memory_gib": round(self.capacity / 2**30, 1),
            "date": datetime.date.today().isoformat(),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "triton": triton.__version__,
                "flashx": flashx.__version__,
                **({"flash-attn-4": fa4} if fa4 else {}),
            },
            "absent": absent(self.device),
        }

    def random(self, shape: Shape) -> list[torch.Tensor]:
        """q, k, v, do in BSHD: fresh normal samples, never zeros."""
        size = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
        return [torch.randn(size, device=self.device, dtype=self.dtype) for _ in range(4)]

    def in_layout(self, impl: Implementation, inputs: list[torch.Tensor]):
        """q, k, v, do in ``impl``'s layout: q, k, v leaves that require grad, or for an FP8
        implementation casts to its dtype (forward only: flashx refuses FP8 that requires grad)."""
        q, k, v, do = (to_layout(x, impl.layout) for x in inputs)
        if impl.fp8:
            return *(x.to(getattr(torch, impl.fp8)) for x in (q, k, v)), do
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do

    def skip_reason(self, impl: Implementation, shape: Shape, mode: str) -> str | None:
        if impl.fp8 and mode == "fwd+bwd":
            return NOT_APPLICABLE
        if self.deadline is not None and time.perf_counter() > self.deadline:
            return "skipped: time limit"
        if impl.compiled and self.compile_budget_s is not None and self.compiled_s > self.compile_budget_s:
            return f"skipped: compile budget ({self.compile_budget_s:.0f} s) spent"
        if impl.dense_scores:
            # The forward holds the float32 scores and probabilities; the backward their gradients too.
            needed = (2 if mode == "fwd" else 4) * shape.batch * shape.heads * shape.seqlen**2 * 4
            if needed > self.capacity:
                return f"skipped: N*N float32 scores need ~{needed / 2**30:.0f} GiB"
        return None

    def per_mode(self, impl: Implementation, shape: Shape, inputs: list[torch.Tensor], measure,
                 fields: tuple[str, ...], leaves: tuple[torch.Tensor, ...] = ()) -> list[dict]:
        """One row per mode: ``measure(call, leaves)``, a dict of ``fields``, for the forward and
        for forward+backward, or why not (its fields None). ``leaves``: the tensors other than q,
        k, v whose gradients the backward fills (sinks)."""
        skips = [self.skip_reason(impl, shape, mode) for mode in MODES]
        if all(skips):
            return [{"status": skip, **dict.fromkeys(fields), "wall_s": 0.0} for skip in skips]
        q, k, v, do = self.in_layout(impl, inputs)
        rows = []
        with self.charged(impl), impl.context():
            attend, built = attempt(lambda: impl.build(shape, self.device))
            # The forward runs on inputs that require grad, as in training (and as flash-attn's
            # benchmark does): one FlexAttention compile serves both modes.
            runs = {"fwd": lambda: attend(q, k, v), "fwd+bwd": lambda: attend(q, k, v).backward(do)}
            for mode, skip in zip(MODES, skips):
                start = time.perf_counter()
                values, status = None, skip or built
                if status == "ok":
                    values, status = attempt(lambda: measure(runs[mode], [q, k, v, *leaves]))
                rows.append({"status": status, **(values or dict.fromkeys(fields)),
                             "wall_s": round(time.perf_counter() - start, 2)})
        return rows

    def outputs(self, impl: Implementation, shape: Shape, inputs: list[torch.Tensor], **modifications):
        """o, dq, dk, dv in BHSD from one forward+backward of ``impl``, and dsinks, the gradient that
        reached ``modifications["sinks"]`` when it is given; o alone from an FP8 implementation's forward."""
        q, k, v, do = self.in_layout(impl, inputs)
        with impl.context():
            o = impl.build(shape, self.device, **modifications)(q, k, v)
            if impl.fp8:
                return {"o": to_bhsd(o, impl.layout)}
            o.backward(do)
        got = {name: to_bhsd(x, impl.layout) for name, x in (("o", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}
        sinks = modifications.get("sinks")
        if sinks is not None:
            if sinks.grad is None:
                raise RuntimeError(f"{impl.name} returned no gradient for the sinks")
            got["dsinks"] = sinks.grad
        return got

    def speed_of(self, call, leaves) -> dict:
        with SmClock(self.device) as clock:
            ms = _rested_median_ms(call, leaves, self.device)
        return {"ms": ms, "sm_mhz": clock.median_mhz()}

    @contextlib.contextmanager
    def charged(self, impl: Implementation):
        """Adds the wall time of a compiled implementation (compiles included) to its budget."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if impl.compiled:
                self.compiled_s += time.perf_counter() - start


class Sweep(Runner):
    def __init__(self, plan: Plan, impls: list[Implementation], device: torch.device, out_dir: Path,
                 time_limit_s: float | None = None, compile_budget_s: float | None = None):
        super().__init__(device, plan.dtype, time_limit_s, compile_budget_s)
        self.plan, self.impls = plan, impls
        self.results = {
            "kind": "gpu",
            **self.facts(),
            "plan": asdict(plan),
            "timing": {"warmup_ms": WARMUP_MS, "rep_ms": REP_MS, "rest_s": REST_S, "statistic": "median",
                       "check_tolerance": CHECK_TOLERANCE, "fp8_check_tolerance": FP8_CHECK_TOLERANCE,
                       "host": {"calls": HOST_CALLS, "rounds": HOST_ROUNDS, "busy_s": HOST_BUSY_S}},
            "implementations": [impl.describe() for impl in impls],
            "ceilings": {},
            "checks": [],
            "memory": [],
            "speed": [],
            "host": [],
            "sections_s": {},
        }
        self.path = records.partial_path(out_dir, records.stem(self.results))

    def run(self, sections=SECTIONS) -> dict:
        """The ceilings, then each of ``sections`` (of SECTIONS) in SECTIONS' order."""
        torch.manual_seed(0)
        plan, impls = self.plan, self.impls
        steps = {  # one progress step a row
            "check": sum(len(plan.check_shapes()) if not impl.compiled else 1 for impl in impls),
            "memory": len(impls) * len(plan.memory_shapes()),
            "speed": len(impls) * len(MODES) * len(plan.speed_shapes()),
            "host": len(impls) * len(MODES) * len(plan.host_shapes()),
        }
        sections = [name for name in SECTIONS if name in sections]
        self.progress = Progress(2 + sum(steps[name] for name in sections))  # the two ceilings first
        self.progress.write(
            f"{self.results['device']}: {', '.join(impl.name for impl in self.impls)}; "
            f"{len(plan.check_shapes())} check shapes, {len(plan.memory_shapes())} memory shapes, "
            f"{len(plan.speed_shapes())} speed and {len(plan.host_shapes())} host-time shapes x {len(MODES)} modes; "
            f"saving as it goes to {self.path}"
        )
        for section in [self.ceilings] + [getattr(self, name) for name in sections]:
            start = time.perf_counter()
            section()
            elapsed = time.perf_counter() - start
            self.results["sections_s"][section.__name__] = round(elapsed, 1)
            self.save()
            self.progress.write(f"== {section.__name__}: {elapsed:.0f} s")
        self.progress.close()
        return self.results

    def save(self) -> None:
        records.save_json(self.results, self.path)

    # Sections ---------------------------------------------------------------------------------

    def ceilings(self) -> None:
        n = self.plan.matmul_size
        a, b = self._matmul_operands()
        tflops = 2 * n**3 / median_ms(lambda: a @ b) / 1e9
        self.progress.step(f"ceiling: {self.plan.dtype} {n}^3 matmul {tflops:.0f} TFLOP/s")
        source = torch.randn(self.plan.copy_bytes // 4, device=self.device)
        target = torch.empty_like(source)
        tbps = 2 * self.plan.copy_bytes / median_ms(lambda: target.copy_(source)) / 1e9
        self.progress.step(f"ceiling: device copy {tbps:.2f} TB/s (bytes read + written)")
        self.results["ceilings"] = {"matmul_tflops": tflops, "copy_tbps": tbps}

    def check(self) -> None:
        shapes = self.plan.check_shapes()
        for shape in shapes:
            inputs = self.random(shape)
            reference = _float32_reference(inputs, shape.causal)
            # A compile costs seconds of the budget: compiled peers are checked at one shape.
            for impl in (i for i in self.impls if not i.compiled or shape == shapes[-1]):
                with self.charged(impl):
                    errors, status = attempt(lambda: relative_errors(self.outputs(impl, shape, inputs), reference))
                if status == "ok" and not all(error <= impl.check_tolerance for error in errors.values()):
                    status = "wrong"
                self.results["checks"].append({"impl": impl.name, **asdict(shape), "status": status, "errors": errors})
                shown = ", ".join(f"{name} {error:.1e}" for name, error in (errors or {}).items())
                self.progress.step(f"check {_label(shape)} {impl.name}: {status} {shown}")
                self.save()

    def memory(self) -> None:
        for shape in self.plan.memory_shapes():
            inputs = self.random(shape)
            for impl in self.impls:
                status = self.skip_reason(impl, shape, "fwd+bwd")
                mib = None
                if status is None:
                    with self.charged(impl):
                        mib, status = attempt(lambda: self._peak_mib(impl, shape, inputs))
                self.results["memory"].append({"impl": impl.name, **asdict(shape), "status": status, "mib": mib})
                shown = f"{mib:.0f} MiB" if status == "ok" else status
                self.progress.step(f"memory fwd+bwd N={shape.seqlen} {impl.name}: {shown}")
                self.save()
            del inputs
            release_memory()

    def speed(self) -> None:
        matmul = self.results["ceilings"]["matmul_tflops"]
        for shape in self.plan.speed_shapes():
            inputs = self.random(shape)
            for impl in self.impls:
                for mode, row in zip(MODES, self.per_mode(impl, shape, inputs, self.speed_of, ("ms", "sm_mhz"))):
                    if row["status"] == "ok":
                        row["tflops"] = attention_flops(shape, mode) / row["ms"] / 1e9
                        row["fraction"] = row["tflops"] / matmul
                        shown = f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s {row['fraction']:4.0%}"
                    else:
                        shown = row["status"]
                    if impl.compiled:
                        shown += f" ({row['wall_s']:.0f} s with compiles)"
                    self.results["speed"].append({"impl": impl.name, "mode": mode, **asdict(shape), **row})
                    self.progress.step(f"{mode:7} {_label(shape)} {impl.name:15} {shown}")
                    self.save()
            del inputs
            release_memory()
        spent = {}
        for row in self.results["speed"]:
            spent[row["impl"]] = spent.get(row["impl"], 0.0) + row["wall_s"]
        self.progress.write("time spent per implementation: " + ", ".join(f"{k} {v:.0f} s" for k, v in spent.items()))

    def host(self) -> None:
        """Host time per call at the short causal shapes, where a step can wait on the host.

        do_bench times the GPU, and its L2 flush before each call gives the host a head start that
        hides most of the host's time; a training step has no such head start. Here each round
        queues HOST_BUSY_S of GPU work first, then times HOST_CALLS calls back to back by the
        wall clock, so that no call waits on the GPU unless it synchronises (which then shows)."""
        a, b = self._matmul_operands()
        product = torch.empty_like(a)
        matmul_s = 2 * self.plan.matmul_size**3 / (self.results["ceilings"]["matmul_tflops"] * 1e12)

        def occupy_gpu():
            if self.device.type == "cuda":
                for _ in range(math.ceil(HOST_BUSY_S / matmul_s)):
                    torch.mm(a, b, out=product)

        def host_us(call, leaves):
            call()  # compiles, tunes
            rounds = []
            for _ in range(HOST_ROUNDS):
                _synchronize(self.device)
                occupy_gpu()
                start = time.perf_counter()
                for _ in range(HOST_CALLS):
                    for x in leaves:
                        x.grad = None
                    call()
                rounds.append((time.perf_counter() - start) / HOST_CALLS * 1e6)
            _synchronize(self.device)
            return {"host_us": statistics.median(rounds)}

        for shape in self.plan.host_shapes():
            inputs = self.random(shape)
            for impl in self.impls:
                for mode, row in zip(MODES, self.per_mode(impl, shape, inputs, host_us, ("host_us",))):
                    self.results["host"].append({"impl": impl.name, "mode": mode, **asdict(shape), **row})
                    shown = f"{row['host_us']:7.0f} us" if row["status"] == "ok" else row["status"]
                    self.progress.step(f"host {mode:7} {_label(shape)} {impl.name:15} {shown}")
                    self.save()
            del inputs
            release_memory()

    def _matmul_operands(self) -> list[torch.Tensor]:
        n = self.plan.matmul_size
        return [torch.randn(n, n, device=self.device, dtype=self.dtype) for _ in range(2)]

    def _peak_mib(self, impl: Implementation, shape: Shape, inputs) -> float:
        q, k, v, do = self.in_layout(impl, inputs)
        with impl.context():
            attend = impl.build(shape, self.device)
            attend(q, k, v).backward(do)  # compiles, autotunes, creates workspaces
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            inputs_bytes = torch.cuda.memory_allocated(self.device)
            attend(q, k, v).backward(do)
            torch.cuda.synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - inputs_bytes) / MIB


def _rested_median_ms(fn, grad_to_none, device: torch.device) -> float:
    """``median_ms`` after a first call, what it left running (``settle_flashx``) and REST_S of
    idle GPU: every implementation starts its timing from the same power state, whatever ran
    before it."""
    fn()
    settle_flashx()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        time.sleep(REST_S)
    return median_ms(fn, grad_to_none)



def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _float32_reference(inputs: list[torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    """o, dq, dk, dv in BHSD from SDPA's math kernel on the inputs upcast to float32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = (x.transpose(1, 2).float() for x in inputs)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(do)
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def relative_errors(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """||x - ref|| / ||ref|| of each output ``got`` has, as the contract's Numerics section bounds it."""
    return {name: ((x.float() - reference[name]).norm() / reference[name].norm()).item() for name, x in got.items()}


def attempt(measure):
    """(value, "ok"), or (None, why not): one implementation's failure never ends the sweep."""
    try:
        return measure(), "ok"
    except Exception as error:  # noqa: BLE001 - recorded in the results, shown in the tables
        status = failure_status(error)
    release_memory()  # outside the handler, once the traceback no longer holds the tensors
    return None, status


def release_memory() -> None:
    """Hand the device memory of dropped tensors back, for the next shape or implementation
    (a collection costs about half a second in a full process: done for a GPU only)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def _label(shape: Shape) -> str:
    return f"d{shape.head_dim} {'causal' if shape.causal else 'full  '} N={shape.seqlen:<6}"
