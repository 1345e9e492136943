"""flashx bench features: what softcap, ALiBi and attention sinks cost, on every implementation that has them.

    flashx bench features [--out DIR | --record] [--impl NAME ...] [--features NAME ...]
                          [--batch B] [--seqlen N] [--heads H] [--head-dim D] [--time-limit S]
    flashx bench features report FILE.json     # FILE.md again, from the JSON

One shape (default bf16, B = 2, N = 8k, H = 16, d = 128: the main sweep's N = 8k d128 point),
not causal and causal, forward and forward+backward, for each feature:

- **none**: plain attention, every implementation's baseline;
- **softcap**: c = 50, the attention softcap of Gemma 2 (``softcap=50.0``);
- **alibi**: ALiBi with the slopes BLOOM computes for H heads, float32 (H,) (``alibi_slopes=``);
- **sinks**: one float32 logit per head, N(0, 1), that requires grad (``sinks=``; its gradient is
  part of forward+backward).

- **Implementations.** Every flashx backend available on CUDA (in bf16: the FP8 implementations
  are the main sweep's), through ``flashx.attention(..., backend=name, softcap=, alibi_slopes=,
  sinks=)``; a backend that declines a feature is reported
  as declined, with the reasons ``flashx.explain`` gives. FlashAttention-4 (``fa4``: softcap and
  learnable sinks, no ALiBi), where ``from flash_attn.cute import flash_attn_func`` works; it is
  absent, with the reason, where not. FlexAttention (softcap and ALiBi through score_mod, no
  sinks). SDPA's cuDNN kernel without a feature only. ``--impl`` names others (``flashx bench
  --help`` lists them).
- **Checks first.** Before any timing, each (implementation, feature) runs one forward+backward at
  B = 2, N = 256, H = 4 (each causal setting; FlexAttention, whose every shape is a compile, not
  causal only), compared with a float32 reference of the same feature written in plain torch ops
  (``reference``): the relative error ||x - ref|| / ||ref|| of o, dq, dk, dv (and dsinks) and the
  largest absolute error. Above the contract's bf16 bound (1e-2) the pair is WRONG: flagged in
  the record, never timed.
- **Timing and TFLOP/s** as the main sweep (``flashx_bench.gpu``: triton.testing.do_bench medians
  after a first call and a rest; the same FLOP count, which no feature changes). Reported: TFLOP/s,
  each feature's speed as a fraction of the same implementation's without it, flashx's speed over
  FA4's with the same feature, and the targets of issue 40 (on triton and cupy, each feature at
  >= 90% of the speed without it, forward and forward+backward).

The run is the device's feature record (``flashx_bench.records``): ``features-<device>.partial.json``
saved after every row, then ``features-<device>.json`` and ``.md`` replaced and its numbers appended
to ``history.csv`` (the feature in the mode: ``fwd softcap``), in ``--out`` (default
./flashx-bench-results) or, with ``--record``, the source checkout's benchmarks/results (the full
sweep only). It needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict
from pathlib import Path

from flashx_bench import records

FEATURES = ("none", "softcap", "alibi", "sinks")
SOFTCAP = 50.0  # Gemma 2's attention softcap
SHAPE = {"batch": 2, "seqlen": 8192, "heads": 16, "head_dim": 128}
CAUSALS = (False, True)
CHECK_SHAPE = {"batch": 2, "seqlen": 256, "heads": 4}  # N a multiple of FlexAttention's 128-wide blocks
#: Timed beside the flashx backends unless --impl names others.
PEERS = ("fa4", "flex", "sdpa-cudnn")
MODES = ("fwd", "fwd+bwd")
#: Issue 40: on these backends each feature keeps at least this fraction of the speed without it.
TARGET_BACKENDS, TARGET_FRACTION = ("flashx-triton", "flashx-cupy"), 0.90
INSTALL = "pip install 'flashx-attention[triton]' (and flash-attn-4 for FA4)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The sweep's options; ``args.out`` is where the record goes (``--record``: the checkout's)."""
    parser = argparse.ArgumentParser(prog="flashx bench features", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    records.add_sweep_arguments(parser)
    parser.add_argument("--impl", nargs="+", metavar="NAME",
                        help=f"only these implementations (default: every flashx backend, {', '.join(PEERS)})")
    parser.add_argument("--features", nargs="+", choices=FEATURES, default=list(FEATURES), metavar="NAME",
                        help=f"only these of {', '.join(FEATURES)} (the ratios need none)")
    for name, value in SHAPE.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, help=f"default {value}")
    parser.add_argument("--time-limit", type=float, metavar="S",
                        help="after S seconds, skip what is left (marked in the record) and write the record")
    args = parser.parse_args(argv)
    partial = [flag for flag, used in (("--impl", args.impl), ("--features", args.features != list(FEATURES)),
                                       *((f"--{name.replace('_', '-')}", getattr(args, name) != value)
                                         for name, value in SHAPE.items())) if used]
    return records.resolve_sweep_arguments(parser, args, partial, "feature")

def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "report":
        results = records.load_json(args.results)
        written = records.redraw(results, args.results, markdown)
        print(markdown(results), end="")
    else:
        results, written = run(args)
        print(markdown(results), end="")
    for path in written:
        print(f"wrote {path}")
    return 0


def run(args) -> tuple[dict, list[Path]]:
    """The sweep on this machine's GPU, published in ``args.out``; it refuses to start without one."""
    try:
        import torch
        import triton  # noqa: F401  (triton.testing times every implementation)
    except ImportError as error:
        raise SystemExit(f"flashx bench features: needs {error.name}: {INSTALL}")
    if not torch.cuda.is_available():
        raise SystemExit("flashx bench features: no CUDA device here; this sweep times GPU kernels and "
                         "runs on a CUDA machine only (`flashx bench features report FILE.json` redraws a record anywhere)")
    from flashx_bench.implementations import implementations, say_what_is_not_timed

    device = torch.device("cuda")
    say_what_is_not_timed(device)
    # FP8 implementations are the main sweep's: forward only, they have no forward+backward to check or time.
    impls = [impl for impl in implementations(device, args.impl)
             if not impl.fp8 and (args.impl or impl.is_flashx or impl.name in PEERS)]
    sweep = FeatureSweep(args, impls, device)
    print(f"the record goes to {args.out}: {sweep.path.name.replace('.partial', '')} and .md replaced; "
          f"{records.HISTORY} appended")
    results = sweep.run()
    return results, records.publish(results, args.out, markdown)


# -- the features and their reference -------------------------------------------------------------


def alibi_slopes(heads: int) -> list[float]:
    """BLOOM's ALiBi slopes (transformers' ``build_alibi_tensor``): for n, the largest power of two
    <= heads, the powers 1..n of 2^(-8/n); then, for the heads past n, the odd powers of 2^(-4/n)."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base**power for power in range(1, closest + 1)]
    extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
    return slopes + [extra_base**power for power in range(1, 2 * (heads - closest), 2)]


def modifications(feature: str, heads: int, device) -> dict:
    """flashx's keywords for ``feature`` at ``heads`` heads ({} for none): fresh tensors, sinks a leaf
    that requires grad."""
    import torch

    if feature == "softcap":
        return {"softcap": SOFTCAP}
    if feature == "alibi":
        return {"alibi_slopes": torch.tensor(alibi_slopes(heads), dtype=torch.float32, device=device)}
    if feature == "sinks":
        return {"sinks": torch.randn(heads, device=device).requires_grad_()}
    return {}


def reference(q, k, v, *, causal: bool, softcap=None, alibi_slopes=None, sinks=None):
    """o (B, Nq, H, Dv) of the contract's "Score modifications", in plain torch ops, in q's dtype:
    scale, softcap, ALiBi, the causal mask (bottom-right), the sink column, softmax, P V.

    q, k, v BSHD with as many heads in k as in q; alibi_slopes (H,) or (B, H); sinks (H,). Every
    row must keep a key (Nq <= Nk when causal): an empty row is NaN here, where the contract has 0.
    """
    import torch

    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    rows, cols = scores.shape[-2:]
    distance = (torch.arange(rows, device=q.device)[:, None] + cols - rows
                - torch.arange(cols, device=q.device)[None, :])  # i + Lk - Lq - j
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(scores.dtype)[..., None, None] * distance.abs()
    if causal:
        scores = scores.masked_fill(distance < 0, -math.inf)
    if sinks is not None:
        column = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
        probabilities = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probabilities = torch.softmax(scores, dim=-1)
    return (probabilities @ v).transpose(1, 2)


def reference_outputs(inputs, causal: bool, keywords: dict, dtype=None) -> dict:
    """o, dq, dk, dv in BHSD (as ``gpu.Runner.outputs`` gives them) of ``reference`` on q, k, v, do
    (BSHD) upcast to ``dtype`` (default float32), and dsinks with sinks."""
    import torch

    dtype = dtype or torch.float32
    q, k, v, do = (x.detach().to(dtype) for x in inputs)
    for x in (q, k, v):
        x.requires_grad_()
    keywords = {name: value.detach().to(dtype) if isinstance(value, torch.Tensor) else value
                for name, value in keywords.items()}
    if "sinks" in keywords:
        keywords["sinks"].requires_grad_()
    o = reference(q, k, v, causal=causal, **keywords)
    o.backward(do)
    found = {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    found = {name: x.transpose(1, 2) for name, x in found.items()}
    if "sinks" in keywords:
        found["dsinks"] = keywords["sinks"].grad
    return found


# -- the sweep --------------------------------------------------------------------------------------


class FeatureSweep:
    def __init__(self, args, impls: list, device, dtype: str = "bfloat16"):
        from flashx_bench import gpu
        from flashx_bench.implementations import Shape

        self.runner = gpu.Runner(device, dtype, args.time_limit)
        self.impls, self.device, self.features = impls, device, list(args.features)
        self.shapes = [Shape(args.batch, args.seqlen, args.heads, args.head_dim, causal) for causal in CAUSALS]
        self.results = {
            "kind": "features",
            **self.runner.facts(),
            "shape": {"dtype": dtype, "batch": args.batch, "seqlen": args.seqlen, "heads": args.heads,
                      "head_dim": args.head_dim},
            "check_shape": {**CHECK_SHAPE, "head_dim": args.head_dim},
            "softcap": SOFTCAP,
            "alibi_slopes": alibi_slopes(args.heads),
            "timing": {"warmup_ms": gpu.WARMUP_MS, "rep_ms": gpu.REP_MS, "rest_s": gpu.REST_S, "statistic": "median",
                       "check_tolerance": gpu.CHECK_TOLERANCE},
            "implementations": [{**impl.describe(), "features": sorted(impl.features)} for impl in impls],
            "checks": [],
            "speed": [],
        }
        self.path = records.partial_path(args.out, records.stem(self.results))

    def pairs(self) -> list[tuple]:
        """(implementation, feature) for every feature each implementation has, in the run's order."""
        return [(impl, feature) for feature in self.features for impl in self.impls
                if feature == "none" or feature in impl.features]

    def run(self) -> dict:
        import torch

        from flashx_bench.progress import Progress

        torch.manual_seed(0)
        pairs = self.pairs()
        checks = [(impl, feature, causal) for impl, feature in pairs for causal in (CAUSALS[:1] if impl.compiled else CAUSALS)]
        self.progress = Progress(len(checks) + len(pairs) * len(self.shapes) * len(MODES))
        self.progress.write(f"{self.results['device']}: {', '.join(impl.name for impl in self.impls)}; features "
                            f"{', '.join(self.features)}; {len(checks)} checks, then {len(pairs) * len(self.shapes)} "
                            f"timings of fwd and fwd+bwd; saving as it goes to {self.path}")
        verdicts = {}  # (implementation, feature) -> "ok", or the first check that was not
        for impl, feature, causal in checks:
            status = self._check(impl, feature, causal)
            if verdicts.get((impl.name, feature), "ok") == "ok":
                verdicts[impl.name, feature] = status
        for shape in self.shapes:
            self._time(shape, pairs, verdicts)
        self.progress.close()
        return self.results

    def _check(self, impl, feature: str, causal: bool) -> str:
        from flashx_bench import gpu
        from flashx_bench.implementations import Shape, refuse_unsupported

        shape = Shape(**self.results["check_shape"], causal=causal)
        inputs = self.runner.random(shape)
        keywords = modifications(feature, shape.heads, self.device)

        def outputs():
            refuse_unsupported(impl, *inputs[:3], causal=causal, **keywords)
            return self.runner.outputs(impl, shape, inputs, **keywords)

        with self.runner.charged(impl):
            got, status = gpu.attempt(outputs)
        errors = largest = None
        if status == "ok":
            expected = reference_outputs(inputs, causal, keywords)
            errors = gpu.relative_errors(got, expected)
            largest = {name: (got[name].float() - ref).abs().max().item() for name, ref in expected.items()}
            if not all(error <= gpu.CHECK_TOLERANCE for error in errors.values()):  # NaN included
                status = "wrong"
        self.results["checks"].append({"impl": impl.name, "feature": feature, **asdict(shape), "status": status,
                                       "errors": errors, "max_abs": largest})
        shown = ", ".join(f"{name} {error:.1e}" for name, error in (errors or {}).items())
        self.progress.step(f"check {feature:7} {_causal(causal):10} {impl.name:15} {status} {shown}")
        self._save()
        return status

    def _time(self, shape, pairs, verdicts) -> None:
        import dataclasses
        import functools

        from flashx_bench import gpu

        inputs = self.runner.random(shape)
        for impl, feature in pairs:
            keywords = modifications(feature, shape.heads, self.device)
            verdict = verdicts[impl.name, feature]
            if verdict == "ok":
                featured = dataclasses.replace(impl, build=functools.partial(impl.build, **keywords))
                leaves = tuple(x for x in keywords.values() if getattr(x, "requires_grad", False))
                rows = self.runner.per_mode(featured, shape, inputs, self.runner.speed_of, ("ms", "sm_mhz"), leaves)
            else:
                status = "not timed: WRONG in the check" if verdict == "wrong" else verdict
                rows = [{"status": status, "ms": None, "sm_mhz": None, "wall_s": 0.0} for _ in MODES]
            for mode, row in zip(MODES, rows):
                if row["status"] == "ok":
                    row["tflops"] = gpu.attention_flops(shape, mode) / row["ms"] / 1e9
                    shown = f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s"
                else:
                    shown = row["status"][:120]
                self.results["speed"].append({"impl": impl.name, "feature": feature, "mode": mode, **asdict(shape),
                                              **row})
                self.progress.step(f"{mode:7} {feature:7} {_causal(shape.causal):10} {impl.name:15} {shown}")
                self._save()
        del inputs
        gpu.release_memory()

    def _save(self) -> None:
        records.save_json(self.results, self.path)


def _causal(causal: bool) -> str:
    return "causal" if causal else "not causal"


# -- the report (from the JSON alone) ---------------------------------------------------------------


def _speed_index(results: dict) -> dict[tuple, dict]:
    return {(r["impl"], r["feature"], r["mode"], r["causal"]): r for r in results["speed"]}


def _ok(row: dict | None) -> bool:
    return row is not None and row["status"] == "ok"


def _features(results: dict) -> list[str]:
    present = {row["feature"] for row in results["speed"]}
    return [feature for feature in FEATURES if feature in present]


def _causals(results: dict) -> list[bool]:
    return sorted({row["causal"] for row in results["speed"]})


def feature_ratios(results: dict) -> list[dict]:
    """Each feature's speed as a fraction of the same implementation's without it (its time without /
    its time with), per mode and causal setting, where both were measured."""
    index = _speed_index(results)
    found = []
    for (impl, feature, mode, causal), row in index.items():
        plain = index.get((impl, "none", mode, causal))
        if feature != "none" and _ok(row) and _ok(plain):
            found.append({"impl": impl, "feature": feature, "mode": mode, "causal": causal,
                          "ratio": plain["ms"] / row["ms"]})
    return found


def fa4_ratios(results: dict) -> list[dict]:
    """Each flashx backend's speed over FA4's with the same feature (FA4's time / flashx's time)."""
    index = _speed_index(results)
    flashx = {impl["name"] for impl in results["implementations"] if impl["flashx"]}
    found = []
    for (impl, feature, mode, causal), row in index.items():
        theirs = index.get(("fa4", feature, mode, causal))
        if impl in flashx and _ok(row) and _ok(theirs):
            found.append({"impl": impl, "feature": feature, "mode": mode, "causal": causal,
                          "ratio": theirs["ms"] / row["ms"]})
    return found


def targets(results: dict) -> list[dict]:
    """Issue 40's target for each feature on each target backend that ran: at least TARGET_FRACTION
    of its speed without the feature, at every mode and causal setting."""
    index = _speed_index(results)
    ratios = {(r["impl"], r["feature"], r["mode"], r["causal"]): r["ratio"] for r in feature_ratios(results)}
    if "none" not in _features(results):
        return []
    ran = {row["impl"] for row in results["speed"]}
    points = [(mode, causal) for mode in MODES for causal in _causals(results)]
    found = []
    for impl in (name for name in TARGET_BACKENDS if name in ran):
        for feature in _features(results)[1:]:  # none first
            measured = [(ratios[key], mode, causal) for mode, causal in points
                        if (key := (impl, feature, mode, causal)) in ratios]
            if measured:
                worst, mode, causal = min(measured)
                shown = f"worst {worst:.2f} ({mode}, {_causal(causal)})"
                if len(measured) < len(points):
                    shown += f"; {len(measured)} of {len(points)} points measured"
                met = len(measured) == len(points) and worst >= TARGET_FRACTION
            else:
                statuses = {index[key]["status"] for mode, causal in points if (key := (impl, feature, mode, causal)) in index}
                shown, met = ", ".join(sorted(_short(s) for s in statuses)) or "not run", False
            found.append({"impl": impl, "feature": feature, "measured": shown, "met": met})
    return found


def _short(status: str) -> str:
    return status.split(":")[0]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _worst(values: dict[str, float]) -> str:
    name = max(values, key=lambda n: values[n] if values[n] == values[n] else math.inf)  # NaN is worst
    return f"{values[name]:.1e} ({name})"


def markdown(results: dict) -> str:
    shape, check, timing = results["shape"], results["check_shape"], results["timing"]
    labels = {impl["name"]: impl["label"] for impl in results["implementations"]}
    has = {impl["name"]: set(impl["features"]) | {"none"} for impl in results["implementations"]}
    names = [impl["name"] for impl in results["implementations"]]
    index = _speed_index(results)
    features, causals = _features(results), _causals(results)
    versions = ", ".join(f"{name} {version}" for name, version in results["versions"].items())
    lines = [
        f"# flashx features: {results['device']}, {results['date']}",
        "",
        f"{shape['dtype']}, B={shape['batch']}, N={shape['seqlen']}, H={shape['heads']}, d={shape['head_dim']} "
        f"(`flashx bench features`; its docstring says how). Features: softcap c = {results['softcap']:g} (Gemma 2's); "
        f"ALiBi with BLOOM's slopes for {shape['heads']} heads, float32; sinks: one float32 logit per head, "
        "N(0, 1), that requires grad. TFLOP/s as flash-attn counts (forward 4·B·H·N²·d, halved when causal; "
        "forward+backward 3.5x): a feature adds no FLOPs. Medians of `triton.testing.do_bench` "
        f"({timing['warmup_ms']} ms warm-up, {timing['rep_ms']} ms of repeats), each after a first call and "
        f"{timing['rest_s']:g} s of idle GPU. {versions}.",
        "",
        *(f"**Note.** {note}\n" for note in results.get("notes", ())),
    ]
    found = targets(results)
    if found:
        lines += [f"## Targets (issue 40): each feature at >= {TARGET_FRACTION:.0%} of the backend's speed without it, "
                  "fwd and fwd+bwd, causal and not", ""]
        lines += _table(["backend", "feature", "speed with / without", "met"],
                        [[labels[t["impl"]], t["feature"], t["measured"], "yes" if t["met"] else "**no**"] for t in found])
        lines.append("")
    ratios = {(r["impl"], r["feature"], r["mode"], r["causal"]): r["ratio"] for r in feature_ratios(results)}
    for mode in MODES:
        title = "forward" if mode == "fwd" else "forward+backward"
        rows = []
        for causal in causals:
            for feature in features:
                cells = []
                for name in names:
                    row = index.get((name, feature, mode, causal))
                    if row is None:
                        cells.append("-" if feature in has[name] else "n/a")
                    elif not _ok(row):
                        cells.append(_short(row["status"]))
                    else:
                        ratio = ratios.get((name, feature, mode, causal))
                        cells.append(f"{row['tflops']:.0f}" + (f" ({ratio:.2f})" if ratio is not None else ""))
                rows.append(["yes" if causal else "no", feature] + cells)
        lines += [f"## Speed, {title}: TFLOP/s (in parentheses: speed with the feature / without it)", ""]
        lines += _table(["causal", "feature"] + [labels[n] for n in names], rows)
        lines.append("")
    lines.append("n/a: the implementation has no such feature.")
    versus = {(r["impl"], r["feature"], r["mode"], r["causal"]): r["ratio"] for r in fa4_ratios(results)}
    if versus:
        ours = [n for n in names if any(key[0] == n for key in versus)]
        rows = [[mode, "yes" if causal else "no", feature]
                + [f"{versus[key]:.2f}" if (key := (n, feature, mode, causal)) in versus else "-" for n in ours]
                for mode in MODES for causal in causals for feature in features
                if any((n, feature, mode, causal) in versus for n in ours)]
        lines += ["", "## flashx / FA4 with the same feature (FA4's time / flashx's time)", ""]
        lines += _table(["mode", "causal", "feature"] + [labels[n] for n in ours], rows)
    if results["checks"]:
        lines += ["", f"## Checks: forward+backward against a float32 reference of the same feature (B={check['batch']}, "
                      f"N={check['seqlen']}, H={check['heads']}, d={check['head_dim']}; WRONG above a relative "
                      f"error of {timing['check_tolerance']:g}, and not timed)", ""]
        rows = []
        for c in results["checks"]:
            status = {"ok": "ok", "wrong": "**WRONG**"}.get(c["status"], _short(c["status"]))
            errors = [_worst(c[field]) if c[field] else "" for field in ("errors", "max_abs")]
            rows.append([labels.get(c["impl"], c["impl"]), c["feature"], "yes" if c["causal"] else "no", status, *errors])
        lines += _table(["implementation", "feature", "causal", "status", "largest relative error",
                         "largest absolute error"], rows)
    lines += _not_measured(results, labels)
    return "\n".join(lines) + "\n"


def _not_measured(results: dict, labels: dict[str, str]) -> list[str]:
    """Every peer absent and every status other than ok or wrong, in full: nothing is dropped silently."""
    struck: dict[tuple[str, str, str], int] = {}
    for row in results["checks"] + results["speed"]:
        if row["status"] not in ("ok", "wrong"):
            key = (row["impl"], row["feature"], row["status"])
            struck[key] = struck.get(key, 0) + 1
    absent = results.get("absent", {})
    if not struck and not absent:
        return []
    lines = ["", "## Not measured", ""] + [f"- {name}: absent: {reason}" for name, reason in absent.items()]
    lines += [f"- {labels.get(impl, impl)}, {feature}: {status}" for impl, feature, status in struck]
    return lines
