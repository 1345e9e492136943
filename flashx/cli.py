"""The ``flashx`` command (also ``python -m flashx``): ``flashx info``, ``flashx demo``, ``flashx bench`` and
``flashx tune``."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time

import flashx
from flashx.devices import cuda_present

#: The hint printed wherever a missing GPU library stops a command.
INSTALL_TRITON = "pip install 'flashx-attention[triton]'"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashx", description="Exact FlashAttention, one contract, many kernels.")
    parser.add_argument("--version", action="version", version=f"flashx {flashx.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, devices, and every backend with its status")
    demo_parser = commands.add_parser("demo", help="a realistic causal GQA call on the best device here, checked")
    demo_parser.add_argument(
        "--seqlen", type=_positive_int, default=None, help="sequence length (default: 4096 on CPU, 8192 on GPU)"
    )
    demo_parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    # flashx bench's arguments are flashx_bench's to parse (`flashx bench --help`).
    commands.add_parser("bench", add_help=False, help="time the backends beside PyTorch's kernels (GPU, or --cpu)")
    _add_tune_parser(commands)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from flashx_bench.cli import main as bench

        return bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "tune":
        return tune(args)
    return info() if args.command == "info" else demo(args.seqlen, args.device)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1; argparse reports anything else as a usage error naming the option."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def info() -> int:
    print(f"flashx {flashx.__version__}  (python {platform.python_version()}, {platform.machine()})")
    # CuPy's distribution is named for its CUDA (cupy-cuda13x): found through the module it provides.
    cupy = importlib.metadata.packages_distributions().get("cupy", ["cupy"])
    for library in ("numpy", "pluggy", "torch", "triton", *cupy, "numba", "numba-cuda"):
        try:
            print(f"  {library:<12} {importlib.metadata.version(library)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    print("devices:")
    for device in _devices():
        print(f"  {device}")
    print("backends:")
    rows = flashx.backends()
    width = max((len(row.name) for row in rows), default=0)
    for row in rows:
        status = f"available on {', '.join(row.devices)}" if row.available else f"not available: {row.reason}"
        print(f"  {row.name:<{width}}  {row.version:<8} {status}  [{row.plugin}]")
    for row in rows:
        if row.load_error:
            print(f"\nplugin {row.plugin} failed to load:\n{row.load_error}")
    return 0


def _devices() -> list[str]:
    devices = [f"cpu: {platform.processor() or platform.machine()}"]
    try:
        import torch
    except ImportError:
        return devices
    if cuda_present():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(f"cuda:{index}: {props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}")
    return devices


def demo(seqlen: int | None, device: str) -> int:
    """Causal GQA (32 query heads over 8 kv heads on GPU, 8 over 2 on CPU) through backend="auto"."""
    import numpy as np

    refusal = None if device == "cpu" else _cuda_refusal()
    if device == "cuda" and refusal:
        print(f"flashx demo: --device cuda: {refusal}", file=sys.stderr)
        return 1
    use_cuda = device != "cpu" and not refusal
    rng = np.random.default_rng(0)
    if use_cuda:
        import torch

        batch, heads_q, heads_k, dim, seqlen = 1, 32, 8, 128, seqlen or 8192
        dtype, tolerance = torch.bfloat16, 2e-2

        def make(heads, seed):
            return torch.randn(batch, seqlen, heads, dim, generator=torch.Generator("cuda").manual_seed(seed), device="cuda", dtype=dtype)

        q, k, v = make(heads_q, 1), make(heads_k, 2), make(heads_k, 3)
    else:
        batch, heads_q, heads_k, dim, seqlen = 1, 8, 2, 64, seqlen or 4096
        tolerance = 1e-4

        def make(heads, _seed):
            return rng.standard_normal((batch, seqlen, heads, dim), dtype=np.float32)

        q, k, v = make(heads_q, 1), make(heads_k, 2), make(heads_k, 3)

    chosen = flashx.explain(q, k, v, causal=True).chosen
    flashx.attention(q, k, v, causal=True)  # warm-up: kernel compilation, autotuning
    seconds, peak, (o, lse) = _measure(lambda: flashx.attention(q, k, v, causal=True, return_lse=True), use_cuda)
    rows = min(64, seqlen)
    error = _check_slice(q, k, v, o, lse, rows)

    naive = batch * heads_q * seqlen * seqlen * 4
    flops = 4.0 * batch * heads_q * seqlen * seqlen * dim / 2
    where = "cuda: " + _devices()[1] if use_cuda else "cpu"
    print(f"flashx demo: causal GQA attention, B={batch} N={seqlen} Hq={heads_q} Hk={heads_k} D={dim} {_dtype(q)} on {where}")
    print(f"  backend (auto)       {chosen}")
    rate = flops / seconds
    shown = f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"
    print(f"  time                 {seconds * 1e3:.2f} ms  ({shown}, one call, launch included)")
    print(f"  peak extra memory    {peak / 2**20:.1f} MiB  (the naive N x N float32 scores alone: {naive / 2**20:.0f} MiB)")
    print(f"  check vs float64     max |o - o_ref| = {error:.2e} over the last {rows} query rows of the first and last head")
    if not error <= tolerance:
        print(f"  FAILED: error above {tolerance:g}", file=sys.stderr)
        return 1
    print("  OK")
    return _decode_demo(use_cuda)


def _decode_demo(use_cuda: bool) -> int:
    """Greedy generation by a one-layer toy model whose keys and values live in a paged cache
    (``flashx.attention_with_kvcache``: the prompt prefilled in one call, then one token per
    step), beside the dense path the cache replaces: recomputing the keys and values of the
    whole sequence and attending over all of it at every step."""
    import numpy as np

    rng = np.random.default_rng(1)
    if use_cuda:
        import torch

        batch, heads_q, heads_k, dim, width, vocab, prompt, steps, tolerance = 4, 32, 8, 128, 1024, 4096, 128, 64, 2e-2

        def array(x, dtype="bfloat16"):
            return torch.from_numpy(x).to("cuda", getattr(torch, dtype))

        join, sync = torch.cat, torch.cuda.synchronize
    else:
        batch, heads_q, heads_k, dim, width, vocab, prompt, steps, tolerance = 2, 8, 2, 64, 256, 512, 24, 32, 1e-5

        def array(x, dtype="float32"):
            return x.astype(dtype)

        join, sync = np.concatenate, lambda: None
    page_size, pages = 16, -(-(prompt + steps) // 16)
    shapes = {"embed": (vocab, width), "q": (width, heads_q * dim), "k": (width, heads_k * dim),
              "v": (width, heads_k * dim), "out": (heads_q * dim, vocab)}
    weights = {name: array(rng.standard_normal(shape) / (1 if name == "embed" else np.sqrt(shape[0])))
               for name, shape in shapes.items()}
    table = array(rng.permutation(batch * pages).reshape(batch, pages), "int32")  # pages in a random order
    k_cache, v_cache = (array(np.zeros((batch * pages, page_size, heads_k, dim))) for _ in range(2))
    lengths = array(np.zeros(batch), "int32")
    tokens = array(rng.integers(0, vocab, (batch, prompt)), "int64")

    def project(tokens):  # (B, N) tokens -> q (B, N, Hq, D), k and v (B, N, Hk, D)
        x = weights["embed"][tokens]
        return [(x @ weights[name]).reshape(batch, -1, heads, dim) for name, heads in (("q", heads_q), ("k", heads_k),
                                                                                        ("v", heads_k))]

    def timed(call):
        sync()
        start = time.perf_counter()
        result = call()
        sync()
        return result, time.perf_counter() - start

    chosen = flashx.kvcache.explain(project(tokens)[0], k_cache, v_cache, cache_seqlens=lengths, block_table=table).chosen
    worst, agree, seconds = 0.0, 0, {"paged": 0.0, "dense": 0.0}
    for step in range(steps + 1):  # step 0 prefills the prompt
        new = tokens if step == 0 else tokens[:, -1:]

        def paged():
            q, k, v = project(new)
            o = flashx.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k, v_new=v,
                                              block_table=table)
            return o, o[:, -1].reshape(batch, -1) @ weights["out"]

        def dense():
            q, k, v = project(tokens)
            o = flashx.attention(q[:, -new.shape[1]:], k, v, causal=True)
            return o, o[:, -1].reshape(batch, -1) @ weights["out"]

        (o, logits), paged_s = timed(paged)
        (o_dense, logits_dense), dense_s = timed(dense)
        if step > 1:  # past the prefill and the first step, which compile
            seconds["paged"] += paged_s
            seconds["dense"] += dense_s
        o, o_dense = (np.asarray(x.float().cpu() if use_cuda else x, dtype=np.float64) for x in (o, o_dense))
        worst = max(worst, float(np.abs(o - o_dense).max() / np.abs(o_dense).max()))
        agree += int((logits.argmax(-1) == logits_dense.argmax(-1)).sum()) if step else 0
        lengths += new.shape[1]  # the caller advances the lengths
        tokens = join([tokens, logits.argmax(-1)[:, None]], 1)

    timed_steps = steps - 1
    print(f"flashx demo: greedy decoding, B={batch} Hq={heads_q} Hk={heads_k} D={dim} {_dtype(k_cache)}, "
          f"KV cache in pages of {page_size} slots")
    print(f"  backend (auto)       {chosen}")
    print(f"  tokens               a {prompt}-token prompt per sequence prefilled in one call, {steps} generated")
    print(f"  per token            {seconds['paged'] / timed_steps * 1e3:.2f} ms with the cache, "
          f"{seconds['dense'] / timed_steps * 1e3:.2f} ms recomputing the whole sequence")
    print(f"  check vs dense       max |o - o_dense| / max |o_dense| = {worst:.1e}; "
          f"greedy tokens agree at {agree} of {steps * batch}")
    if not worst <= tolerance:
        print(f"  FAILED: error above {tolerance:g}", file=sys.stderr)
        return 1
    print("  OK")
    return 0


def _add_tune_parser(commands) -> None:
    parser = commands.add_parser(
        "tune", help="time the Triton kernels' configurations for the shapes you name, once per machine",
        description="Time the Triton backend's candidate configurations for the shapes named and keep the fastest "
                    "on disk, where every later process on this machine finds them (docs/triton-design.md, Tuning).")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--seqlen", type=_positive_int, nargs="+", metavar="N", help="sequence lengths to tune")
    what.add_argument("--list", action="store_true", help="show the choices kept on disk")
    what.add_argument("--clear", action="store_true", help="remove the choices kept on disk")
    parser.add_argument("--batch", type=_positive_int, default=1)
    parser.add_argument("--heads", type=_positive_int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=_positive_int, default=None, help="key and value heads (default: --heads)")
    parser.add_argument("--head-dim", type=_positive_int, default=128)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="tune the backward's kernels too")


def tune(args) -> int:
    """Run one call (and its backward with --backward) per named length, so that every kernel it
    launches is tuned and its choice kept on disk (flashx_triton.tuning_cache); print the choices."""
    from flashx_triton import tuning, tuning_cache

    if args.list:
        return _list_tuned(tuning_cache)
    if args.clear:
        removed = tuning_cache.clear()
        print(f"flashx tune: removed {_choices(removed)} from {tuning_cache.table_directory()}")
        return 0
    refusal = None if tuning.interpreting() else _cuda_refusal()  # the interpreter: tests only
    if refusal:
        print(f"flashx tune: {refusal}", file=sys.stderr)
        return 1
    import torch

    os.environ["FLASHX_TRITON_AUTOTUNE"] = "1"  # time what the table on disk lacks
    device = "cpu" if tuning.interpreting() else "cuda"
    where = tuning_cache.environment(torch.cuda.current_device() if device == "cuda" else None)
    kv_heads = args.kv_heads or args.heads
    print(f"flashx tune: {where}")
    shown = {made.key for made in tuning.choices()}
    for seqlen in args.seqlen:
        generator = torch.Generator(device).manual_seed(seqlen)

        def normal(heads, grad=args.backward):
            return torch.randn(args.batch, seqlen, heads, args.head_dim, generator=generator, device=device,
                               dtype=getattr(torch, args.dtype), requires_grad=grad)

        q, k, v = normal(args.heads), normal(kv_heads), normal(kv_heads)
        start = time.perf_counter()
        try:
            o = flashx.attention(q, k, v, causal=args.causal, backend="triton")
        except flashx.FlashXError as error:  # a shape the backend declines: the user's to change
            print(f"flashx tune: {error}", file=sys.stderr)
            return 1
        if args.backward:
            o.backward(normal(args.heads, grad=False))
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"  B={args.batch} N={seqlen} Hq={args.heads} Hk={kv_heads} D={args.head_dim} {args.dtype}"
              f"{' causal' if args.causal else ''}{', with the backward' if args.backward else ''}: "
              f"{time.perf_counter() - start:.1f} s")
        for made in tuning.choices():
            if made.key not in shown:
                shown.add(made.key)
                medians = [ms for _, ms in made.timings or () if ms is not None]
                how = f"fastest of {len(medians)} timed, {min(medians):.3f} ms" if medians else (
                    "found on disk" if made.source == "disk" else made.source)
                print(f"    {made.key:<44} {_choice_text(made.choice)}  ({how})")
    print(f"choices kept in {where.directory}")
    return 0


def _list_tuned(tuning_cache) -> int:
    found = list(tuning_cache.records())
    print(f"flashx tune: {_choices(len(found))} in {tuning_cache.table_directory()}")
    environment = None
    for path, record in found:
        if path.parent.name != environment:
            environment = path.parent.name
            print(f"  {environment}")
        try:
            median = record["median_ms"]
            line = f"{record['key']:<44} {_choice_text(record['choice'])}" + (f"  {median:.3f} ms" if median else "")
        except (TypeError, KeyError, ValueError):
            line = f"{path.name}: unreadable (ignored)"
        print(f"    {line}")
    return 0


def _choices(count: int) -> str:
    return f"{count} tuned choice{'' if count == 1 else 's'}"


def _choice_text(choice) -> str:
    """A choice as the table on disk holds it (a configuration's fields, or a plan's name), on one line."""
    return " ".join(f"{name}={value}" for name, value in choice.items()) if isinstance(choice, dict) else str(choice)


def _cuda_refusal() -> str | None:
    """Why the demo cannot run on CUDA here (torch, a device and a backend for it), or None."""
    try:
        import torch
    except ImportError:
        return f"needs torch, which is not installed: {INSTALL_TRITON}"
    if not cuda_present():
        return f"torch {torch.__version__} sees no CUDA device"
    for_cuda = [row for row in flashx.backends() if "cuda" in row.devices]
    if not any(row.available for row in for_cuda):
        reasons = "; ".join(f"{row.name}: {row.reason}" for row in for_cuda) or INSTALL_TRITON
        return f"no backend can run on CUDA here ({reasons})"
    return None


def _measure(call, use_cuda):
    if use_cuda:
        import torch

        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = call()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return seconds, torch.cuda.max_memory_allocated() - base, result
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak, result


def _check_slice(q, k, v, o, lse, rows):
    """Largest error of o and lse against the float64 oracle, over the last ``rows`` queries of
    the first and last head (causal is bottom-right aligned, so those rows alone give the same
    problem; the first and last query heads read the first and last kv heads)."""
    import numpy as np
    from flashx_conformance import oracle

    def host(x):
        return np.asarray(x.float().cpu() if hasattr(x, "cpu") else x, dtype=np.float64)

    q, k, v, o, lse = map(host, (q, k, v, o, lse))
    heads = [0, -1]
    want_o, want_lse = oracle.forward(q[:, -rows:, heads], k[:, :, heads], v[:, :, heads], causal=True)
    return max(np.abs(o[:, -rows:, heads] - want_o).max(), np.abs(lse[:, heads, -rows:] - want_lse).max())


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("torch.")


if __name__ == "__main__":
    raise SystemExit(main())
