"""Host time of a decoding step's attention through flashx's transformers integration, against SDPA.

transformers' ``generate()`` calls attention once per layer and step with one query row: query
(B, Hq, 1, D) and key/value (B, Hk, S, D) in its BHSD layout (the query a transposed view of its
projection, the keys the KV cache's concatenation), no mask, not causal. At B=4, Hq=16, Hk=4,
D=128 in bf16 the kernels take microseconds, so a step is bound by the host. Two patterns:

- ``steady``: one S, again and again: the remembered plan's path;
- ``generate``: S growing by one per step, each S called once per layer, as ``generate()`` calls
  it (S = prompt .. prompt + new - 1): a step's first layer plans a new shape.

With ``--stub`` (the default without CUDA) nothing runs on a device: the Triton backend takes CPU
tensors (as under its interpreter), its launches do nothing, and one wave holds as many programs
as an H200's 132 multiprocessors, so that a call makes the launches it makes there. SDPA's time on
the same tensors is printed beside, a rough bar (on CPU its kernel is real work), and SDPA's on
(1, 1, 1, 8) tensors, its host path with next to no kernel, the better one; and the time of an
empty Python function of the integration's signature.

Measured on a CPU host, kernels stubbed (2026-11-28, python 3.11, torch 2.13; median us per call,
steady / generate): 28.3-30.8 / 28.4-30.4 with every call planned, 14.6-15.3 / 15.9-17.4 with
calls remembered whole (``flashx.plan.call_key``; docs/triton-design.md, "Host work per call",
has the time of each part), SDPA on (1, 1, 1, 8) tensors 3.6-4.0.

    python scripts/host_decode.py [--stub] [--rounds 7] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

BATCH, HEADS_Q, HEADS_K, HEAD_DIM = 4, 16, 4, 128
PROMPT, NEW_TOKENS, LAYERS = 512, 128, 4


def stub_kernels() -> None:
    """Make the Triton backend take CPU tensors and launch nothing (before it is first used)."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["FLASHX_BACKEND"] = "triton"  # on CPU, "auto" would pick a CPU backend
    from flashx_triton import launch

    launch.Launch.__call__ = lambda self, *tensors: None
    launch.fits_one_wave = lambda programs, device: programs <= 132  # an H200's multiprocessors


def step_tensors(length: int, device):
    """A decoding step's query, key and value as transformers passes them (BHSD views)."""
    import torch

    projected = torch.randn(BATCH, 1, HEADS_Q * HEAD_DIM, device=device, dtype=torch.bfloat16)
    query = projected.view(BATCH, 1, HEADS_Q, HEAD_DIM).transpose(1, 2)
    key, value = (torch.randn(BATCH, HEADS_K, length, HEAD_DIM, device=device, dtype=torch.bfloat16)
                  for _ in range(2))
    return query, key, value


def per_call_us(calls, rounds: int, synchronize, round_s: float = 0.2) -> float:
    """The median over ``rounds`` of a round's time per call; a round takes the calls in turn, as
    many as fill about ``round_s`` (SDPA's CPU kernel takes milliseconds, a stubbed call micro)."""
    start = time.perf_counter()
    for call in calls:
        call()
    synchronize()
    count = max(1, round(round_s / ((time.perf_counter() - start) / len(calls))))
    times = []
    for _ in range(rounds):
        synchronize()
        start = time.perf_counter()
        for i in range(count):
            calls[i % len(calls)]()
        synchronize()
        times.append((time.perf_counter() - start) / count * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stub", action="store_true", help="no device: stubbed launches on CPU tensors")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile the generate pattern's calls")
    args = parser.parse_args()
    import torch

    stub = args.stub or not torch.cuda.is_available()
    if stub:
        stub_kernels()
    device = "cpu" if stub else "cuda"
    synchronize = (lambda: None) if stub else torch.cuda.synchronize
    from flashx.integrations.transformers import attention_forward

    class Attention:  # what the integration reads of transformers' module
        is_causal = True

    module, scaling = Attention(), HEAD_DIM ** -0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def empty(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        return query, None

    def flashx_call(q, k, v):
        return lambda: attention_forward(module, q, k, v, None, dropout=0.0, scaling=scaling)

    def sdpa_call(q, k, v):
        return lambda: sdpa(q, k, v, attn_mask=None, dropout_p=0.0, scale=scaling, is_causal=False, enable_gqa=True)

    def empty_call(q, k, v):
        return lambda: empty(module, q, k, v, None, dropout=0.0, scaling=scaling)

    def tiny_sdpa_call(q, k, v):  # SDPA's host path with next to no kernel work: the bar on CPU
        q, k, v = (torch.ones(1, 1, 1, 8, device=device, dtype=torch.bfloat16) for _ in range(3))
        return sdpa_call(q, k, v)

    steady = step_tensors(PROMPT, device)
    growing = [step_tensors(length, device) for length in range(PROMPT, PROMPT + NEW_TOKENS)]
    print(f"host us per call, {'CPU, kernels stubbed' if stub else torch.cuda.get_device_name()}, "
          f"python {sys.version.split()[0]}, torch {torch.__version__}")
    with torch.no_grad():
        for name, make in (("empty function", empty_call), ("sdpa", sdpa_call), ("sdpa, 1x1x1x8", tiny_sdpa_call),
                           ("flashx", flashx_call)):
            steady_us = per_call_us([make(*steady)], args.rounds, synchronize)
            generate_calls = [make(*tensors) for tensors in growing for _ in range(LAYERS)]
            generate_us = per_call_us(generate_calls, args.rounds, synchronize)
            print(f"  {name:<15} steady {steady_us:8.1f} us   generate {generate_us:8.1f} us")
        if args.profile:
            calls = [flashx_call(*tensors) for tensors in growing for _ in range(LAYERS)]
            profile = cProfile.Profile()
            profile.runcall(lambda: [call() for call in calls])
            pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
