"""Per-kernel GPU time of flashx's and Flex's forward+backward (torch.profiler), and the autotuner's
timing of every backward candidate, on a GPU: ``python scripts/profile_backward.py``.

bf16, B*N = 16384, H*D = 2048 as in the sweep. The elementwise kernel in both lists accumulates
the leaves' ``.grad``. Flex is compiled afresh for each shape (static shapes, as the sweep does).
"""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile

import flashx
from flashx_triton import tuning


def short(c):
    return f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}{'' if c.host_descriptors else 'k'}"


def causal_mask(b, h, i, j):
    return i >= j


for d, n, causal in [(128, 512, True), (128, 1024, True), (128, 2048, True), (128, 512, False), (64, 512, True)]:
    try:
        b, h = 16384 // n, 2048 // d
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        flex_leaves = [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
        do_t = do.transpose(1, 2).contiguous()
        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        mask = create_block_mask(causal_mask, None, None, n, n, device="cuda") if causal else None

        def ours():
            flashx.attention(*leaves, causal=causal, backend="triton").backward(do)

        def theirs():
            flex(*flex_leaves, block_mask=mask).backward(do_t)

        for call in (ours, theirs, ours, theirs):
            call()
        torch.cuda.synchronize()
        for name, call in (("flashx", ours), ("flex", theirs)):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call()
                torch.cuda.synchronize()
            rows = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:6]
            total = sum(e.self_device_time_total for e in prof.key_averages()) / 10
            print(f"d{d} N={n} {'causal' if causal else 'full'} {name}: total {total:.0f} us/iter; " + "; ".join(
                f"{e.key[:40]} {e.self_device_time_total / 10:.0f}" for e in rows), flush=True)
        for key, log in tuning.measured.items():
            if key[0] != "forward" and key[1] == d and key[4] == causal and key[5][0] == n.bit_length():
                print("   ", key[0], " ".join(f"{c if isinstance(c, str) else short(c)}:{ms and round(ms * 1e3)}"
                                           for c, ms in log))
    except Exception as error:  # keep the other shapes
        print(f"d{d} N={n} causal={causal}: {type(error).__name__}: {str(error)[:300]}", flush=True)
