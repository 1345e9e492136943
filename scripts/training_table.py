"""The training-step table of issues 38 and 39 in one process: flashx's Triton and CuPy backends
beside cuDNN (SDPA), FlexAttention and FlashAttention-4, on a CUDA GPU.

    python scripts/training_table.py [--seconds 470] [--implementations cupy cudnn] [--modes fwd+bwd]

bf16 throughout. Each row is a shape and mode (fwd or fwd+bwd): d128 and d64 at B*N = 16k and
H*D = 2048, causal or not; GQA Hq 32 / Hk 8 (B=4, N=4k, causal); B=32, N=512, causal; a window
(1024, 0); d256 (B=2, N=4k, H=8); B=1, N=32k, causal; and dropout 0.1 on flashx alone. TFLOP/s as
flash-attn counts: 4 B H D times the allowed pairs for the forward, 3.5 times that for
forward+backward. Each point is the median of ``triton.testing.do_bench``, after a first call,
what it left running (``settle_flashx``: the steady state's speed, as ``flashx bench`` times it)
and 0.5 s of rest. FlexAttention is compiled per row from a reset dynamo, with its block mask built by
``create_block_mask``. FA4 is timed where ``flash_attn.cute`` imports
(``../shared/device/fa4-wheels.sh`` installs it on a machine without a network). A row that a
peer cannot run records the error instead.

With ``--kernels``, each point also says where its time goes: the GPU time of each kernel a step
launches (``torch.profiler`` over KERNEL_STEPS steps) and the step replayed from a CUDA graph, with
no host work between its launches. A step slower than its kernels' sum is bound by the host.

Rows land in ``$OUT/table.json`` (default /tmp) as they are timed. Past ``--seconds`` no new point
starts, so that a time box keeps what was done. A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import flashx
from flashx_bench.implementations import settle_flashx

IMPLEMENTATIONS = ("triton", "cupy", "cudnn", "flex", "fa4")
#: (label, mode, batch, seqlen, heads_q, heads_k, head_dim, causal, window, dropout, implementations)
ROWS = [
    ("d128", "fwd+bwd", 2, 8192, 16, 16, 128, False, None, 0.0, IMPLEMENTATIONS),
    ("d128 causal", "fwd+bwd", 2, 8192, 16, 16, 128, True, None, 0.0, IMPLEMENTATIONS),
    ("d64", "fwd+bwd", 2, 8192, 32, 32, 64, False, None, 0.0, IMPLEMENTATIONS),
    ("d64 causal", "fwd+bwd", 2, 8192, 32, 32, 64, True, None, 0.0, IMPLEMENTATIONS),
    ("GQA 32/8 B4 N4k causal", "fwd+bwd", 4, 4096, 32, 8, 128, True, None, 0.0, IMPLEMENTATIONS),
    ("B32 N512 causal", "fwd+bwd", 32, 512, 16, 16, 128, True, None, 0.0, IMPLEMENTATIONS),
    ("window (1024, 0)", "fwd+bwd", 2, 8192, 16, 16, 128, False, 1024, 0.0, ("triton", "cupy", "flex", "fa4")),
    ("d128", "fwd", 2, 8192, 16, 16, 128, False, None, 0.0, IMPLEMENTATIONS),
    ("d128 causal", "fwd", 2, 8192, 16, 16, 128, True, None, 0.0, IMPLEMENTATIONS),
    ("d256 B2 N4k H8", "fwd", 2, 4096, 8, 8, 256, False, None, 0.0, IMPLEMENTATIONS),
    ("d256 B2 N4k H8 causal", "fwd", 2, 4096, 8, 8, 256, True, None, 0.0, IMPLEMENTATIONS),
    ("d64", "fwd", 2, 8192, 32, 32, 64, False, None, 0.0, IMPLEMENTATIONS),
    ("GQA 32/8 B4 N4k causal", "fwd", 4, 4096, 32, 8, 128, True, None, 0.0, IMPLEMENTATIONS),
    ("B1 N32k causal", "fwd", 1, 32768, 16, 16, 128, True, None, 0.0, IMPLEMENTATIONS),
    ("d128 dropout 0.1", "fwd+bwd", 2, 8192, 16, 16, 128, False, None, 0.1, ("triton", "cupy")),
]


def allowed_pairs(seqlen: int, causal: bool, window: int | None) -> float:
    if window is not None:
        return sum(min(i + 1, window + 1) for i in range(seqlen))
    return seqlen * (seqlen + 1) / 2 if causal else seqlen * seqlen


def attend(name: str, q, k, v, causal: bool, window: int | None, dropout: float):
    """A callable computing attention by implementation ``name`` on BSHD ``q, k, v`` (BHSD views for
    the peers that take that layout), its inputs, and the layout's gradient of the output."""
    gqa = q.shape[2] != k.shape[2]
    bhsd = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    if name in ("triton", "cupy"):
        band = {"window": (window, 0)} if window is not None else {"causal": causal}
        return (lambda: flashx.attention(q, k, v, backend=name, dropout_p=dropout, **band)), (q, k, v), False
    if name == "cudnn":
        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(*bhsd, is_causal=causal, enable_gqa=gqa)
        return call, bhsd, True
    if name == "flex":
        if window is not None:
            def rule(b, h, i, j):
                return (i >= j) & (i - j <= window)
        else:
            def rule(b, h, i, j):
                return i >= j
        mask = create_block_mask(rule, None, None, q.shape[1], k.shape[1]) if causal or window else None
        compiled = torch.compile(flex_attention)
        return (lambda: compiled(*bhsd, block_mask=mask, enable_gqa=gqa)), bhsd, True
    from flash_attn.cute import flash_attn_func

    def call():
        result = flash_attn_func(q, k, v, causal=causal, window_size=(window, 0) if window is not None else (None, None))
        return result[0] if isinstance(result, tuple) else result
    return call, (q, k, v), False


def selected(rows: list, implementations, modes) -> list:
    """The rows of ``modes`` (all where None), each with only the ``implementations`` named (all
    where None); a row left with none is dropped."""
    chosen = []
    for *fields, names in rows:
        names = tuple(name for name in names if implementations is None or name in implementations)
        if names and (modes is None or fields[1] in modes):
            chosen.append((*fields, names))
    return chosen


#: Steps profiled for ``--kernels``, and the length of the kernel names it keeps.
KERNEL_STEPS, KERNEL_NAME = 10, 60


def kernel_ms(events, steps: int) -> dict[str, float]:
    """Milliseconds a step of each kernel (its name cut to KERNEL_NAME characters) among a
    profile's ``events``, ``steps`` steps long, the longest first."""
    totals: dict[str, float] = {}
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:KERNEL_NAME]
            totals[name] = totals.get(name, 0.0) + event.device_time / 1000 / steps
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def where_time_goes(step) -> dict:
    """``step``'s kernels (``kernel_ms``) and its replay from a CUDA graph in ms, or why it could
    not be captured."""
    with profile(activities=[ProfilerActivity.CUDA]) as run:
        for _ in range(KERNEL_STEPS):
            step()
        torch.cuda.synchronize()
    kernels = kernel_ms(run.events(), KERNEL_STEPS)
    try:
        side = torch.cuda.Stream()  # capture's warm-up runs off the default stream, as torch asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = round(do_bench(graph.replay, warmup=25, rep=150, return_mode="median"), 4)
    except Exception as error:  # noqa: BLE001 - a step that cannot be captured says why
        replay = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:80]}"
    return {"kernels_ms": round(sum(kernels.values()), 4), "graph_ms": replay,
            "top": {name: round(ms, 4) for name, ms in list(kernels.items())[:5]}}


def time_row(row, deadline: float, kernels: bool = False) -> dict:
    label, mode, batch, seqlen, heads_q, heads_k, dim, causal, window, dropout, names = row
    torch._dynamo.reset()  # static shapes, one compile a row
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen, heads_q, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seqlen, heads_k, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad_out = torch.randn_like(q)
    flops = 4 * batch * heads_q * dim * allowed_pairs(seqlen, causal, window) * (3.5 if mode == "fwd+bwd" else 1)
    result = {"row": label, "mode": mode}
    for name in names:
        if time.time() > deadline:
            break
        try:
            call, leaves, transposed = attend(name, q, k, v, causal, window, dropout)
            dout = grad_out.transpose(1, 2) if transposed else grad_out
            if mode == "fwd":
                def step():
                    with torch.no_grad():
                        call()
            else:
                def step():
                    torch.autograd.grad(call(), leaves, dout)
            step()
            settle_flashx()
            torch.cuda.synchronize()
            time.sleep(0.5)
            ms = do_bench(step, warmup=25, rep=150, return_mode="median")
            result[name] = round(flops / ms / 1e9, 1)
            if kernels:
                result.setdefault("where", {})[name] = {"step_ms": round(ms, 4), **where_time_goes(step)}
        except Exception as error:  # noqa: BLE001 - a peer that cannot run a row records why
            result[name] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:80]}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=470, help="no new point starts after this many seconds")
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, help="only these (default: all)")
    parser.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), help="only these rows (default: all)")
    parser.add_argument("--kernels", action="store_true", help="also each step's kernels and its CUDA graph replay")
    args = parser.parse_args()
    deadline = time.time() + args.seconds
    out = os.path.join(os.environ.get("OUT", "/tmp"), "table.json")
    rows = []
    for row in selected(ROWS, args.implementations, args.modes):
        if time.time() > deadline:
            break
        rows.append(time_row(row, deadline, args.kernels))
        with open(out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, file, indent=1)
        print(json.dumps(rows[-1]), flush=True)
    print("\n| case | mode | " + " | ".join(IMPLEMENTATIONS) + " |\n|" + " --- |" * (len(IMPLEMENTATIONS) + 2))
    for result in rows:
        cells = (str(result.get(name, "-"))[:22] for name in IMPLEMENTATIONS)
        print(f"| {result['row']} | {result['mode']} | " + " | ".join(cells) + " |")
    if args.kernels:
        print("\n| case | mode | implementation | step ms | kernels ms | graph replay ms | longest kernel ms |\n|"
              + " --- |" * 7)
        for result in rows:
            for name, where in result.get("where", {}).items():
                longest = next(iter(where["top"].items()), ("-", "-"))
                print(f"| {result['row']} | {result['mode']} | {name} | {where['step_ms']} | {where['kernels_ms']} | "
                      f"{where['graph_ms']} | {longest[0][:40]}: {longest[1]} |")


if __name__ == "__main__":
    main()
