"""The ``flashx`` command (also ``python -m flashx``): the core's ``flashx info`` and ``flashx demo``,
and every command a plugin adds through the ``flashx_commands`` hook (``flashx tune`` is the Triton
backend's, ``flashx bench`` is flashx_bench's)."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
import time

import flashx
from flashx.devices import cuda_present, cuda_refusal
from flashx.hookspecs import Command

#: The hint printed wherever a missing GPU library stops a command.
INSTALL_TRITON = "pip install 'flashx-attention[triton]'"


def main(argv: list[str] | None = None) -> int:
    """Run one command; with none, print the help (exit status 0: a bare ``flashx`` asks what there is)."""
    plugins = [command for _, command in sorted(flashx.registry.commands().items())]
    commands = {command.name: command for command in (*COMMANDS, *plugins)}
    parser = argparse.ArgumentParser(prog="flashx", description="Exact FlashAttention, one contract, many kernels.")
    parser.add_argument("--version", action="version", version=f"flashx {flashx.__version__}")
    subparsers = parser.add_subparsers(dest="command", title="commands")
    for command in commands.values():
        if command.own_arguments:  # its --help too: `flashx bench --help` is flashx_bench's
            subparsers.add_parser(command.name, help=command.help, add_help=False)
        else:
            command.add_arguments(subparsers.add_parser(command.name, help=command.help))
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    command = commands[args.command]
    if command.own_arguments:
        return command.run(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return command.run(args)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1; argparse reports anything else as a usage error naming the option."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seqlen", type=positive_int, default=None, help="sequence length (default: 4096 on CPU, 8192 on GPU)"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")


#: The core's own commands (``flashx.hookspecs.CORE_COMMANDS``); plugins add theirs.
COMMANDS = (
    Command("info", "versions, devices, and every backend with its status", run=lambda args: info()),
    Command("demo", "a realistic causal GQA call on the best device here, checked",
            run=lambda args: demo(args.seqlen, args.device), add_arguments=_demo_arguments),
)


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
    for failure in flashx.registry.command_failures():
        print(f"\nplugin {failure.plugin}: commands left out:\n{failure.load_error}")
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


def _cuda_refusal() -> str | None:
    """Why the demo cannot run on CUDA here (torch, a device and a backend for it), or None."""
    refusal = cuda_refusal(INSTALL_TRITON)
    if refusal:
        return refusal
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
    """Largest error of o and lse against float64, over the last ``rows`` queries of the first and
    last head (causal is bottom-right aligned, so those rows alone give the same problem; the
    first and last query heads read the first and last kv heads). The float64 result is the NumPy
    backend's through the public API: the same contract, computed in float64 on the host."""
    import numpy as np

    def host(x):
        return np.asarray(x.float().cpu() if hasattr(x, "cpu") else x, dtype=np.float64)

    q, k, v, o, lse = map(host, (q, k, v, o, lse))
    heads = [0, -1]
    want_o, want_lse = flashx.attention(q[:, -rows:, heads], k[:, :, heads], v[:, :, heads], causal=True,
                                        return_lse=True, backend="numpy")
    return max(np.abs(o[:, -rows:, heads] - want_o).max(), np.abs(lse[:, heads, -rows:] - want_lse).max())


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("torch.")


if __name__ == "__main__":
    raise SystemExit(main())
