"""flashx bench model: the training step of transformers models through each attention implementation.

    flashx bench model [--out DIR | --record] [--quick] [--models NAME ...] [--impl NAME ...]
                       [--precision autocast|bf16|fp32] [--search-seconds S] [--no-search] [--time-limit S]
    flashx bench model report FILE.json     # FILE.md and FILE.png again, from the JSON

The FlashAttention paper's end-to-end result (GPT-2 small and medium trained 3x faster than
Hugging Face's implementation, and longer sequences fitting) measured on one GPU, through
transformers' ``attn_implementation``:

- **Models**, built from configs with random weights (nothing is downloaded): GPT-2 small (124M)
  and medium (355M) at N = 1k and 4k, ``n_positions`` raised to N where N > 1024 (GPT-2's learned
  position table has 1024 rows; raising it adds (N - 1024) x hidden weights), dropout 0 (as
  current pretraining runs it; FA4 has no dropout); a Llama-shaped model with GQA at 4k and 16k:
  Llama 3.2 1B's shape (hidden 2048, intermediate 8192, 16 layers, 32 query and 8 kv heads of 64)
  with Llama 2's vocabulary of 32000 instead of 128256, whose float32 logits and their gradient
  alone would take ~25 GB at 16k tokens (1.1B parameters). ``use_cache=False``, as in training.
- **Implementations**: ``eager`` and ``sdpa`` (transformers' own), ``flashx``
  (``flashx.integrations.transformers.register()``, which names it "flx"; flashx picks its
  backend, and the record says which), and ``fa4``, transformers' own "flash_attention_4"
  (``flash_attn.cute``), on CUDA where transformers finds the flash-attn-4 distribution.
- **The step**: forward with ``labels`` (transformers' causal LM loss), backward, AdamW step
  (fused on CUDA), gradients set to None. ``--precision autocast`` (the default on CUDA): float32
  weights under bf16 autocast, what ``Trainer(bf16=True)`` runs and the paper's mixed precision;
  ``bf16``: the weights in bf16 (less memory, AdamW on bf16 weights); ``fp32`` (the CPU's).
- **Per (model, N, implementation)**: B = tokens_per_step // N sequences (at least 1) of random
  tokens, the same batch and, through the seed, the same weights for every implementation;
  the median step time of ``timed_steps`` steps after ``warmup_steps`` (CUDA events), tokens/s,
  peak ``torch.cuda.max_memory_allocated`` over those steps (weights, gradients, AdamW state and
  activations), the first step's loss against eager's (sdpa's where eager failed): the check, and
  model TFLOP/s from 6 x (matmul weights) + 6 x layers x N x hidden FLOPs a token (the causal
  attention's two matmuls, forward and backward): with it, attention's share of the step.
- **Per (model, implementation), the longest sequence that fits**: two steps at B = 1 (the second
  holds the AdamW state the first creates), from the model's longest N, doubling until a step runs
  out of memory, then bisecting until the gap is within 1/16 (lengths multiples of
  ``search_multiple``), each try a fresh model (GPT-2's ``n_positions`` = N) and the memory
  released between tries; each search is time-boxed (``--search-seconds``): cut short, its result
  is a lower bound, marked as such.
- **On a CPU** (no CUDA) the same command runs tiny configs of both families (2 layers, hidden
  32, N = 64, two timed steps, the search capped at 256; weights drawn wide, ``TINY`` says why) in
  float32, flashx on its NumPy backend, as a smoke test of all of the above; peak memory is not
  measured there (torch keeps no CPU allocator statistics).

The run is the device's model record (``flashx_bench.records``): ``model-<device>.partial.json``
saved after every row, then ``model-<device>.json``, ``.md`` and ``.png`` replaced and its numbers
appended to ``history.csv`` (mode ``train <model>``; metrics ``tokens_per_s``, ``peak_mib``,
``max_seqlen``), in ``--out`` (default ./flashx-bench-results) or, with ``--record``, the source
checkout's benchmarks/results (the full sweep only).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

from flashx_bench import records

IMPLEMENTATIONS = ("eager", "sdpa", "flashx", "fa4")
LABELS = {"eager": "eager", "sdpa": "SDPA", "flashx": "flashx", "fa4": "FlashAttention-4"}
FA4_ATTENTION = "flash_attention_4"
SEED = 0
MIB = 2**20
#: Relative difference of a first-step loss from eager's above which the implementation is WRONG.
LOSS_TOLERANCE = {"autocast": 2e-2, "bf16": 2e-2, "fp32": 1e-4}
#: A search stops bisecting when the gap between fitting and not is within this fraction.
SEARCH_RESOLUTION = 1 / 16
#: The FlashAttention paper's Table 2 (8 x A100, OpenWebText, N = 1k): days to train, and its
#: speed-ups over Hugging Face's implementation and over Megatron-LM.
PAPER = {"gpt2-small": {"huggingface": 9.5, "megatron": 4.7, "flashattention": 2.7},
         "gpt2-medium": {"huggingface": 21.0, "megatron": 11.5, "flashattention": 6.9}}
PAPER_SEQLEN = 1024


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "gpt2" or "llama": the config and model classes
    sizes: dict  # the config's keywords
    seqlens: tuple[int, ...]
    tokens_per_step: int

    def config(self, seqlen: int):
        import transformers

        if self.family == "gpt2":
            return transformers.GPT2Config(**self.sizes, n_positions=max(1024, seqlen), use_cache=False,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.LlamaConfig(**self.sizes, max_position_embeddings=seqlen, use_cache=False)

    def model_class(self):
        import transformers

        return transformers.GPT2LMHeadModel if self.family == "gpt2" else transformers.LlamaForCausalLM

    def batch(self, seqlen: int) -> int:
        return max(1, self.tokens_per_step // seqlen)

    def geometry(self) -> dict:
        """layers, hidden, heads, kv_heads, head_dim: the names the record and the FLOP count use."""
        config = self.config(max(self.seqlens))
        heads = config.num_attention_heads
        return {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "heads": heads,
                "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
                "head_dim": config.hidden_size // heads}


GPT2 = {"vocab_size": 50257}
LLAMA_1B = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0}
#: The CPU's smoke test. Weights drawn 25x wider than transformers' 0.02: at 0.02 every attention
#: row is near uniform, and an output 10% off moved GPT-2's first loss by 7e-6, under the float32
#: check's 1e-4; at 0.5 it moves it by 3e-3.
TINY = {"vocab_size": 97, "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.5}
MODELS = {spec.name: spec for spec in (
    ModelSpec("gpt2-small", "gpt2", {**GPT2, "n_embd": 768, "n_layer": 12, "n_head": 12}, (1024, 4096), 8192),
    ModelSpec("gpt2-medium", "gpt2", {**GPT2, "n_embd": 1024, "n_layer": 24, "n_head": 16}, (1024, 4096), 8192),
    ModelSpec("llama-1b", "llama", LLAMA_1B, (4096, 16384), 16384),
    ModelSpec("gpt2-tiny", "gpt2", {**TINY, "n_embd": 32, "n_layer": 2, "n_head": 4}, (64,), 128),
    ModelSpec("llama-tiny", "llama", {**TINY, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "num_key_value_heads": 2}, (64,), 128),
)}


@dataclasses.dataclass(frozen=True)
class Plan:
    models: tuple[str, ...]
    warmup_steps: int
    timed_steps: int
    search_models: tuple[str, ...]  # the models whose longest fitting sequence is searched
    search_cap: int
    search_multiple: int
    search_seconds: float  # per (model, implementation)
    seqlens: dict = dataclasses.field(default_factory=dict)  # model -> its N here, where not its own

    def seqlens_of(self, spec: ModelSpec) -> tuple[int, ...]:
        return tuple(self.seqlens.get(spec.name, spec.seqlens))


#: About 8 minutes on an H100 (estimated: the timed rows ~3, the twelve searches ~25 s each).
FULL = Plan(("gpt2-small", "gpt2-medium", "llama-1b"), 3, 10, ("gpt2-small", "gpt2-medium", "llama-1b"),
            262144, 1024, 25.0)
#: The paper's settings (GPT-2 at 1k, and 4k) and Llama at 4k, the search on GPT-2 small only.
QUICK = dataclasses.replace(FULL, timed_steps=5, search_models=("gpt2-small",), search_seconds=20.0,
                            seqlens={"llama-1b": (4096,)})
CPU = Plan(("gpt2-tiny", "llama-tiny"), 1, 2, ("gpt2-tiny", "llama-tiny"), 256, 32, 60.0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The sweep's options; ``args.out`` is where the record goes (``--record``: the checkout's)."""
    parser = argparse.ArgumentParser(prog="flashx bench model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    records.add_sweep_arguments(parser)
    parser.add_argument("--quick", action="store_true",
                        help="GPT-2 at 1k and 4k, Llama at 4k only, 5 timed steps, the search on GPT-2 small only")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), metavar="NAME",
                        help=f"only these of {', '.join(MODELS)} (default: the GPU's three, or the CPU's tiny two)")
    parser.add_argument("--impl", nargs="+", choices=IMPLEMENTATIONS, metavar="NAME",
                        help=f"only these of {', '.join(IMPLEMENTATIONS)}")
    parser.add_argument("--precision", choices=tuple(LOSS_TOLERANCE),
                        help="autocast (float32 weights, bf16 autocast; CUDA's default), bf16 weights, or fp32 "
                             "(the CPU's default)")
    parser.add_argument("--search-seconds", type=float, metavar="S", help="time box of each longest-sequence search")
    parser.add_argument("--no-search", action="store_true", help="no longest-sequence search")
    parser.add_argument("--time-limit", type=float, metavar="S",
                        help="after S seconds, skip what is left (marked in the record) and write the record")
    args = parser.parse_args(argv)
    partial = [flag for flag, used in (("--quick", args.quick), ("--models", args.models), ("--impl", args.impl),
                                       ("--precision", args.precision not in (None, "autocast")),
                                       ("--no-search", args.no_search)) if used]
    return records.resolve_sweep_arguments(parser, args, partial, "model")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "report":
        results = records.load_json(args.results)
        written = records.redraw(results, args.results, markdown, plot)
    else:
        results = ModelSweep(args).run()
        written = records.publish(results, args.out, markdown, plot)
    print(markdown(results), end="")
    for path in written:
        print(f"wrote {path}")
    return 0


def plan_for(args, cuda: bool) -> Plan:
    plan = (QUICK if args.quick else FULL) if cuda else CPU
    if args.models:
        plan = dataclasses.replace(plan, models=tuple(args.models),
                                   search_models=tuple(m for m in args.models if m in plan.search_models))
    if args.search_seconds is not None:
        plan = dataclasses.replace(plan, search_seconds=args.search_seconds)
    if args.no_search:
        plan = dataclasses.replace(plan, search_models=())
    return plan


def attention_names(device, wanted) -> tuple[dict[str, str], dict[str, str]]:
    """(implementation -> transformers' attn_implementation, implementation -> why it is absent)."""
    from flashx.integrations import transformers as flashx_transformers

    found = {"eager": "eager", "sdpa": "sdpa", "flashx": flashx_transformers.register()}
    absent = {}
    if device.type == "cuda":
        from transformers.utils import is_flash_attn_4_available

        from flashx_bench.implementations import fa4_missing

        missing = fa4_missing()
        if missing is None and not is_flash_attn_4_available():
            missing = ("flash_attn.cute imports, but transformers does not find the flash-attn-4 distribution "
                       f"(transformers.utils.is_flash_attn_4_available()), which its {FA4_ATTENTION!r} needs")
        if missing:
            absent["fa4"] = missing
        else:
            found["fa4"] = FA4_ATTENTION
    else:
        absent["fa4"] = "CUDA only"
    chosen = wanted or IMPLEMENTATIONS
    return ({name: found[name] for name in IMPLEMENTATIONS if name in found and name in chosen},
            {name: why for name, why in absent.items() if name in chosen})


# -- one model, one implementation ------------------------------------------------------------------


class TrainingRun:
    """One model at one length through one implementation: built from the seed, so that every
    implementation starts from the same weights, with AdamW; ``step`` runs one training step."""

    def __init__(self, spec: ModelSpec, seqlen: int, batch: int, attn_implementation: str, precision: str, device):
        import torch

        self.device, self.precision = device, precision
        torch.manual_seed(SEED)
        with torch.device(device):
            model = spec.model_class()(spec.config(seqlen))
        if precision == "bf16":
            model.to(torch.bfloat16)
        model.set_attn_implementation(attn_implementation)
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        tokens = torch.Generator(device).manual_seed(SEED + 1)
        self.ids = torch.randint(spec.sizes["vocab_size"], (batch, seqlen), generator=tokens, device=device)

    def step(self):
        """Forward, backward, AdamW step; the loss, still on the device."""
        import contextlib

        import torch

        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.precision == "autocast"
                    else contextlib.nullcontext())
        with autocast:
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def flops_per_token(self, seqlen: int, geometry: dict) -> float:
        """6 x the weights that multiply (every one but the input and position embeddings; the LM
        head, tied or not) + the causal attention's 6 x layers x N x hidden."""
        import torch

        embeddings = {id(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Embedding)}
        weights = {id(p): p for p in self.model.parameters()}
        matmul = sum(p.numel() for key, p in weights.items() if key not in embeddings)
        head = self.model.get_output_embeddings().weight
        matmul += head.numel() if id(head) in embeddings else 0
        return 6.0 * matmul + attention_flops_per_token(seqlen, geometry)

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def attention_flops_per_token(seqlen: int, geometry: dict) -> float:
    """The causal attention's two N x N x hidden matmuls a layer, halved by the mask, forward and backward."""
    return 6.0 * geometry["layers"] * seqlen * geometry["hidden"]


def median_step_ms(trainer: TrainingRun, warmup: int, timed: int) -> tuple[float, float]:
    """(median step time in ms, the first step's loss): CUDA events around each step on a GPU,
    the wall clock on a CPU."""
    import torch

    from flashx_bench.implementations import settle_flashx

    loss = trainer.step().item()
    settle_flashx()  # the steps timed are the steady state's
    for _ in range(warmup - 1):
        trainer.step()
    times = []
    if trainer.device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(timed)]
        for start, end in events:
            start.record()
            trainer.step()
            end.record()
        torch.cuda.synchronize(trainer.device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(timed):
            start = time.perf_counter()
            trainer.step()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), loss


def longest_fitting(fits, start: int, cap: int, multiple: int, deadline: float | None) -> dict:
    """The longest N (a multiple of ``multiple``, at most ``cap``) for which ``fits(N)`` says "ok".

    From ``start``, doubling while it fits (halving while it does not, when ``start`` does not),
    then bisecting between the longest that fitted and the shortest that ran out of memory ("OOM")
    until their gap is within SEARCH_RESOLUTION of the latter. Any other status ends the search.
    Returns longest (None: nothing fitted), oom_at, the tries in order (N, status, what ``fits``
    returned beside it), and why it stopped: "bisected", "cap", "time box", or the status."""
    tries, longest, oom_at = [], None, None

    def attempt(n: int) -> str:
        status, extra = fits(n)
        tries.append({"seqlen": n, "status": status, **extra})
        return status

    def out_of_time() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    n, stopped = start, "bisected"
    while True:
        if out_of_time():
            return {"longest": longest, "oom_at": oom_at, "stopped": "time box", "tries": tries}
        status = attempt(n)
        if status == "ok":
            longest = n
            if oom_at is not None or n >= cap:
                stopped = "bisected" if oom_at is not None else "cap"
                break
            n = min(cap, 2 * n)
        elif status == "OOM":
            oom_at = n
            if longest is not None or n <= multiple:
                break
            n = max(multiple, n // 2 // multiple * multiple)
        else:
            return {"longest": longest, "oom_at": oom_at, "stopped": status, "tries": tries}
    while longest is not None and oom_at is not None and oom_at - longest > max(multiple, oom_at * SEARCH_RESOLUTION):
        if out_of_time():
            stopped = "time box"
            break
        middle = (longest + oom_at) // 2 // multiple * multiple
        status = attempt(middle)
        if status == "ok":
            longest = middle
        elif status == "OOM":
            oom_at = middle
        else:
            stopped = status
            break
    return {"longest": longest, "oom_at": oom_at, "stopped": stopped, "tries": tries}


# -- the sweep --------------------------------------------------------------------------------------


class ModelSweep:
    def __init__(self, args):
        try:
            import torch
            import transformers
        except ImportError as error:
            raise SystemExit(f"flashx bench model: needs {error.name}: pip install 'flashx-attention[bench]' transformers")
        from flashx_bench import gpu

        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if cuda else "cpu")
        self.plan = plan_for(args, cuda)
        self.precision = args.precision or ("autocast" if cuda else "fp32")
        self.runner = gpu.Runner(self.device, "float32" if self.precision == "fp32" else "bfloat16", args.time_limit)
        self.names, absent = attention_names(self.device, args.impl)
        facts = self.runner.facts()
        facts["versions"]["transformers"] = transformers.__version__
        self.results = {
            "kind": "model",
            **facts,
            "absent": absent,
            "plan": {**dataclasses.asdict(self.plan), "precision": self.precision,
                     "optimizer": f"AdamW{' (fused)' if cuda else ''}, lr 1e-4",
                     "loss_tolerance": LOSS_TOLERANCE[self.precision], "search_resolution": SEARCH_RESOLUTION},
            "models": [self._describe(MODELS[name]) for name in self.plan.models],
            "implementations": [{"name": name, "label": LABELS[name], "attn_implementation": attention}
                                for name, attention in self.names.items()],
            "rows": [],
            "searches": [],
        }
        self.path = records.partial_path(args.out, records.stem(self.results))

    def _describe(self, spec: ModelSpec) -> dict:
        return {"name": spec.name, "family": spec.family, "sizes": spec.sizes,
                "seqlens": list(self.plan.seqlens_of(spec)), "tokens_per_step": spec.tokens_per_step,
                **spec.geometry()}

    def run(self) -> dict:
        from flashx_bench.progress import Progress

        if self.device.type == "cuda":
            from flashx_bench.implementations import say_what_is_not_timed

            say_what_is_not_timed(self.device)
        for name, why in self.results["absent"].items():
            print(f"{name} is not timed: {why}")
        points = [(m, n) for m in self.results["models"] for n in m["seqlens"]]
        searches = [m for m in self.results["models"] if m["name"] in self.plan.search_models]
        self.progress = Progress(len(self.names) * (len(points) + len(searches)))
        self.progress.write(f"{self.results['device']}: {', '.join(self.names)}; {self.precision}; "
                            f"{len(points)} (model, N) points, {len(searches)} longest-sequence searches; "
                            f"saving as it goes to {self.path}")
        for model, seqlen in points:
            for impl in self.names:
                self._time(MODELS[model["name"]], seqlen, impl)
            self._check_losses(model["name"], seqlen)
        for model in searches:
            for impl in self.names:
                self._search(MODELS[model["name"]], impl)
        self.progress.close()
        return self.results

    def _out_of_time(self) -> bool:
        return self.runner.deadline is not None and time.perf_counter() > self.runner.deadline

    def _trainer(self, spec: ModelSpec, seqlen: int, batch: int, impl: str) -> TrainingRun:
        return TrainingRun(spec, seqlen, batch, self.names[impl], self.precision, self.device)

    def _time(self, spec: ModelSpec, seqlen: int, impl: str) -> None:
        from flashx_bench import gpu

        batch = spec.batch(seqlen)
        row = {"model": spec.name, "impl": impl, "seqlen": seqlen, "batch": batch, "tokens": batch * seqlen}
        start = time.perf_counter()

        def measure() -> dict:
            trainer = self._trainer(spec, seqlen, batch, impl)
            self._reset_peak()
            ms, loss = median_step_ms(trainer, self.plan.warmup_steps, self.plan.timed_steps)
            geometry = spec.geometry()
            flops = trainer.flops_per_token(seqlen, geometry)
            found = {"step_ms": ms, "tokens_per_s": batch * seqlen / ms * 1e3, "peak_mib": self._peak_mib(),
                     "loss": loss, "parameters": trainer.parameters(),
                     "model_tflops": flops * batch * seqlen / ms / 1e9,
                     "attention_share": attention_flops_per_token(seqlen, geometry) / flops}
            if impl == "flashx":
                found["flashx_backend"] = flashx_backend(geometry, seqlen, self.device, self.precision)
            return found

        if self._out_of_time():
            values, status = {}, "skipped: time limit"
        else:
            values, status = gpu.attempt(measure)
        gpu.release_memory()
        row.update(status=status, wall_s=round(time.perf_counter() - start, 1), **(values or {}))
        self.results["rows"].append(row)
        shown = (f"{row['step_ms']:8.1f} ms {row['tokens_per_s']:9.0f} tok/s {_mib(row['peak_mib']):>9} "
                 f"loss {row['loss']:.4f}" if status == "ok" else status[:160])
        self.progress.step(f"{spec.name:11} N={_seqlen(seqlen):4} B={batch:<3} {impl:7} {shown}")
        self._save()

    def _check_losses(self, model: str, seqlen: int) -> None:
        """Each first-step loss against eager's (sdpa's where eager did not run): "wrong" beyond the tolerance."""
        rows = [r for r in self.results["rows"] if r["model"] == model and r["seqlen"] == seqlen]
        done = {r["impl"]: r for r in rows if r["status"] == "ok"}
        reference = next((done[name] for name in ("eager", "sdpa") if name in done), None)
        if reference is None:
            return
        for row in done.values():
            row["loss_reference"] = reference["impl"]
            row["loss_error"] = abs(row["loss"] - reference["loss"]) / abs(reference["loss"])
            if not row["loss_error"] <= LOSS_TOLERANCE[self.precision]:  # NaN included
                row["status"] = "wrong"
        self._save()

    def _search(self, spec: ModelSpec, impl: str) -> None:
        from flashx_bench import gpu

        def fits(seqlen: int) -> tuple[str, dict]:
            def two_steps() -> float | None:
                trainer = self._trainer(spec, seqlen, 1, impl)
                self._reset_peak()
                for _ in range(2):
                    trainer.step()
                return self._peak_mib()

            start = time.perf_counter()
            peak, status = gpu.attempt(two_steps)
            gpu.release_memory()
            self.progress.write(f"  {spec.name} {impl} N={seqlen}: {status if status != 'ok' else _mib(peak)}")
            return status, {"peak_mib": peak, "s": round(time.perf_counter() - start, 1)}

        start = time.perf_counter()
        box = start + self.plan.search_seconds
        deadline = box if self.runner.deadline is None else min(box, self.runner.deadline)
        if self._out_of_time():
            found = {"longest": None, "oom_at": None, "stopped": "skipped: time limit", "tries": []}
        else:
            found = longest_fitting(fits, max(spec.seqlens), self.plan.search_cap, self.plan.search_multiple, deadline)
        self.results["searches"].append({"model": spec.name, "impl": impl, **found,
                                         "wall_s": round(time.perf_counter() - start, 1)})
        self.progress.step(f"{spec.name:11} {impl:7} longest fitting N: {_longest(found)} ({found['stopped']})")
        self._save()

    def _reset_peak(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _peak_mib(self) -> float | None:
        import torch

        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) / MIB

    def _save(self) -> None:
        records.save_json(self.results, self.path)


def flashx_backend(geometry: dict, seqlen: int, device, precision: str) -> str | None:
    """The backend flashx picks for one layer's attention at ``seqlen`` (``flashx.explain``)."""
    import torch

    import flashx

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    q = torch.empty(1, seqlen, geometry["heads"], geometry["head_dim"], device=device, dtype=dtype)
    kv = torch.empty(1, seqlen, geometry["kv_heads"], geometry["head_dim"], device=device, dtype=dtype)
    return flashx.explain(q, kv, kv, causal=True).chosen


# -- the report (from the JSON alone) ---------------------------------------------------------------


def _seqlen(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n:,}"


def _mib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f} GiB"


def _longest(search: dict) -> str:
    longest = search["longest"]
    if longest is None:
        return "none" if search["tries"] else "-"
    bound = "≥ " if search["stopped"] in ("cap", "time box") else ""
    return f"{bound}{_seqlen(longest)}"


def _rows(results: dict) -> dict[tuple, dict]:
    return {(r["model"], r["seqlen"], r["impl"]): r for r in results["rows"]}


def _ok(row: dict | None) -> bool:
    return row is not None and row["status"] == "ok"


def _ratio(results: dict, model: str, seqlen: int, ours: str, theirs: str) -> float | None:
    """``ours``' tokens/s over ``theirs`` at one point, where both ran and passed the check."""
    rows = _rows(results)
    mine, other = rows.get((model, seqlen, ours)), rows.get((model, seqlen, theirs))
    return mine["tokens_per_s"] / other["tokens_per_s"] if _ok(mine) and _ok(other) else None


def targets(results: dict) -> list[dict]:
    """Issue 46's targets: flashx's step at least as fast as sdpa's on every row, and its longest
    fitting sequence at least sdpa's for every model."""
    found = []
    for model in results["models"]:
        for seqlen in model["seqlens"]:
            ratio = _ratio(results, model["name"], seqlen, "flashx", "sdpa")
            if ratio is not None:
                found.append({"target": f"{model['name']} N={_seqlen(seqlen)}: flashx tokens/s >= SDPA's",
                              "measured": f"{ratio:.2f}x", "met": ratio >= 1.0})
        searched = {s["impl"]: s for s in results["searches"] if s["model"] == model["name"]}
        if "flashx" in searched and "sdpa" in searched:
            mine, theirs = searched["flashx"], searched["sdpa"]
            conclusive = theirs["stopped"] not in ("time box", "cap") or mine["stopped"] == "cap"
            met = (mine["longest"] or 0) >= (theirs["longest"] or 0) and conclusive
            found.append({"target": f"{model['name']}: flashx's longest fitting N >= SDPA's",
                          "measured": f"{_longest(mine)} against {_longest(theirs)}", "met": met})
    return found


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def markdown(results: dict) -> str:
    plan = results["plan"]
    names = [impl["name"] for impl in results["implementations"]]
    labels = {impl["name"]: impl["label"] for impl in results["implementations"]}
    rows = _rows(results)
    versions = ", ".join(f"{name} {version}" for name, version in results["versions"].items())
    precision = {"autocast": "float32 weights under bf16 autocast", "bf16": "bf16 weights",
                 "fp32": "float32"}[plan["precision"]]
    attention = ", ".join(f"{labels[i['name']]} = `{i['attn_implementation']}`" for i in results["implementations"])
    lines = [
        f"# Training step through transformers: {results['device']}, {results['date']}",
        "",
        f"Forward, backward and {plan['optimizer']} step of transformers models with random weights, {precision} "
        f"(`flashx bench model`; its docstring says how). Median of {plan['timed_steps']} steps after "
        f"{plan['warmup_steps']}; peak memory is `torch.cuda.max_memory_allocated` over those steps (weights, "
        f"gradients, AdamW state, activations). attn_implementation: {attention}. Model TFLOP/s count 6 FLOPs a "
        "weight a token and the causal attention's 6 x layers x N x hidden; \"attention\" is the latter's share. "
        f"{versions}.",
        "",
        *(f"**Note.** {note}\n" for note in results.get("notes", ())),
    ]
    found = targets(results)
    if found:
        lines += ["## Targets (issue 46)", ""]
        lines += _table(["target", "measured", "met"], [[t["target"], t["measured"], "yes" if t["met"] else "**no**"]
                                                         for t in found])
        lines.append("")
    lines += _paper(results)
    for model in results["models"]:
        geometry = (f"{model['layers']} layers, hidden {model['hidden']}, {model['heads']} heads"
                    + (f" / {model['kv_heads']} kv heads" if model["kv_heads"] != model["heads"] else "")
                    + f" of {model['head_dim']}")
        parameters = sorted({r["parameters"] for r in results["rows"] if r["model"] == model["name"] and "parameters" in r})
        size = f", {' to '.join(dict.fromkeys(_count(p) for p in (parameters[0], parameters[-1])))} parameters" \
            if parameters else ""
        lines += [f"## {model['name']}: {geometry}{size}", ""]
        table = []
        for seqlen in model["seqlens"]:
            for name in names:
                row = rows.get((model["name"], seqlen, name))
                if row is None:
                    continue
                batch = f"{row['batch']} x {_seqlen(seqlen)}"
                if row["status"] in ("ok", "wrong"):
                    vs_sdpa = _ratio(results, model["name"], seqlen, name, "sdpa")
                    error = f"{row['loss_error']:.1e} ({row['loss_reference']})" if "loss_error" in row else ""
                    table.append([batch, labels[name] + (" **WRONG**" if row["status"] == "wrong" else ""),
                                  f"{row['tokens_per_s']:,.0f}", f"{vs_sdpa:.2f}" if vs_sdpa else "",
                                  f"{row['step_ms']:.1f}", _mib(row["peak_mib"]), f"{row['model_tflops']:.0f}",
                                  f"{row['attention_share']:.0%}", f"{row['loss']:.4f}", error])
                else:
                    table.append([batch, labels[name], row["status"].split(":")[0]] + [""] * 7)
        lines += _table(["B x N", "implementation", "tokens/s", "/ SDPA", "step ms", "peak memory", "model TFLOP/s",
                         "attention", "loss", "loss vs reference"], table)
        searched = [s for s in results["searches"] if s["model"] == model["name"]]
        if searched:
            lines += ["", "Longest sequence that fits (B = 1, two steps; ≥: a lower bound, the search cut short):", ""]
            lines += _table(["implementation", "longest N", "out of memory at", "tries", "stopped", "s"],
                            [[labels.get(s["impl"], s["impl"]), _longest(s), _seqlen(s["oom_at"]) if s["oom_at"] else "",
                              str(len(s["tries"])), s["stopped"], f"{s['wall_s']:.0f}"] for s in searched])
        lines.append("")
    backends = sorted({r["flashx_backend"] for r in results["rows"] if r.get("flashx_backend")})
    if backends:
        lines.append(f"flashx ran on its {', '.join(backends)} backend (`flashx.explain`).")
    failures = sorted({(r["impl"], r["status"]) for r in results["rows"] if r["status"] not in ("ok", "wrong")})
    if failures or results.get("absent"):
        lines += ["", "## Not measured", ""]
        lines += [f"- {labels.get(name, name)}: absent: {why}" for name, why in results.get("absent", {}).items()]
        lines += [f"- {labels.get(impl, impl)}: {status}" for impl, status in failures]
    return "\n".join(lines) + "\n"


def _paper(results: dict) -> list[str]:
    """flashx against eager (and SDPA) at the paper's GPT-2 settings, beside the paper's ratios."""
    table = []
    for model, days in PAPER.items():
        over_eager = _ratio(results, model, PAPER_SEQLEN, "flashx", "eager")
        over_sdpa = _ratio(results, model, PAPER_SEQLEN, "flashx", "sdpa")
        if over_eager or over_sdpa:
            row = _rows(results)[model, PAPER_SEQLEN, "flashx"]
            table.append([model, f"{over_eager:.2f}x" if over_eager else "", f"{over_sdpa:.2f}x" if over_sdpa else "",
                          f"{row['attention_share']:.0%}",
                          f"{days['huggingface'] / days['flashattention']:.1f}x",
                          f"{days['megatron'] / days['flashattention']:.1f}x"])
    if not table:
        return []
    return ["## The paper's GPT-2 result, on this GPU (N = 1k)", "",
            "The FlashAttention paper (Dao et al. 2022, Table 2) trained GPT-2 on OpenWebText on 8 A100s: small in "
            "2.7 days against Hugging Face's 9.5 and Megatron-LM's 4.7, medium in 6.9 against 21.0 and 11.5. Here: "
            "one training step on one GPU, flashx's tokens/s over eager's (transformers' attention in plain torch "
            "ops, as Hugging Face's was) and over SDPA's (fused kernels, the role Megatron-LM's fused softmax played). "
            "\"attention\": its share of the step's FLOPs, the most any attention kernel can save.", "",
            *_table(["model", "flashx / eager", "flashx / SDPA", "attention", "paper: FlashAttention / HF",
                     "paper: / Megatron-LM"], table), ""]


def plot(results: dict, path: Path) -> Path:
    """Per model, tokens/s at each timed N (top) and peak memory at B = 1 against N, from the
    longest-sequence searches' tries that fitted (bottom; log-log), per implementation.

    Raises ModuleNotFoundError without matplotlib; the caller says how to draw it later."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    models = [m["name"] for m in results["models"]]
    names = [impl["name"] for impl in results["implementations"]]
    labels = {impl["name"]: impl["label"] for impl in results["implementations"]}
    colors = {name: f"C{i}" for i, name in enumerate(IMPLEMENTATIONS)}
    fig, axes = plt.subplots(2, len(models), figsize=(4.4 * len(models), 7.0), squeeze=False)
    for column, model in enumerate(models):
        speed, memory = axes[0][column], axes[1][column]
        for name in names:
            points = sorted((r["seqlen"], r["tokens_per_s"]) for r in results["rows"]
                            if r["model"] == model and r["impl"] == name and r["status"] == "ok")
            if points:
                speed.plot(*zip(*points), "-o", color=colors[name], label=labels[name], markersize=4)
            search = next((s for s in results["searches"] if s["model"] == model and s["impl"] == name), None)
            fitted = sorted((t["seqlen"], t["peak_mib"] / 1024) for t in (search or {}).get("tries", ())
                            if t["status"] == "ok" and t.get("peak_mib") is not None)
            if fitted:
                memory.plot(*zip(*fitted), "-o", color=colors[name], label=labels[name], markersize=4)
            if search and search["oom_at"]:
                memory.axvline(search["oom_at"], color=colors[name], linestyle=":", linewidth=1)
        speed.set_title(model, fontsize=10)
        speed.set_ylim(bottom=0)
        speed.set_ylabel("tokens/s (training step)")
        memory.set_ylabel("peak memory, GiB (B = 1)")
        for ax in (speed, memory):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda n, _: _seqlen(int(n))))
            ax.set_xlabel("N")
            ax.grid(alpha=0.3)
        speed.legend(fontsize=7)
        if memory.lines:
            memory.set_yscale("log")
            if results.get("device_memory_gib"):
                memory.axhline(results["device_memory_gib"], color="gray", linestyle="--", linewidth=1,
                               label="device memory")
            memory.legend(fontsize=7)
    fig.suptitle(f"Training step through transformers, {results['device']} ({results['date']}), "
                 f"{results['plan']['precision']}; dotted: out of memory", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
