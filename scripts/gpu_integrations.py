"""GPU checks of flashx's framework integration (torch.compile, transformers) with the Triton backend.

    python3 gpu_integrations.py            # on the lent GPU (triton backend, CUDA)
    python3 gpu_integrations.py --cpu      # a dry run of the same code on CPU (numpy backend, tiny sizes)

1. torch.compile(fullgraph=True, Inductor) of a module calling flashx.attention, padded and varlen,
   bf16: graph breaks (torch._dynamo.explain), compiled forward and gradients vs eager.
2. transformers: a tiny random Llama (GQA) in float32, attn_implementation=flx vs sdpa: logits,
   gradients of a training step, generate() tokens; and 0 graph breaks of the model under Dynamo.
3. Tokens/s of a training step (forward+backward) and of greedy generation, flx vs sdpa, on a
   bigger random Llama in bf16 (no download).
4. Host time per call of flashx.attention at a small shape: eager, eager through the operators,
   and compiled (calls queued behind a GPU sleep, so none waits on the GPU).
Prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import flashx  # noqa: E402
import flashx.integrations.transformers as fx_transformers  # noqa: E402
import flashx.options  # noqa: E402
from flashx import ops  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()
DEVICE, BACKEND = ("cpu", "numpy") if args.cpu else ("cuda", "triton")
TABLE: list[tuple[str, str]] = []


def report(check, result):
    TABLE.append((check, str(result)))
    print(f"{check}: {result}", flush=True)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def max_diff(xs, ys):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(xs, ys))


# 1. torch.compile of flashx.attention -----------------------------------------------------------------
class Attention(torch.nn.Module):
    def __init__(self, **keywords):
        super().__init__()
        self.keywords = keywords

    def forward(self, q, k, v, **arrays):
        return flashx.attention(q, k, v, backend=BACKEND, **self.keywords, **arrays)


def compile_check():
    dtype = torch.float32 if args.cpu else torch.bfloat16
    b, n, hq, hk, d = (2, 64, 4, 2, 32) if args.cpu else (4, 1024, 16, 4, 128)
    g = torch.Generator(DEVICE).manual_seed(0)
    lengths = torch.tensor([n // 3, 0, n, n // 2 + 5])
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(DEVICE, torch.int32)
    total = int(lengths.sum())
    cases = {
        "padded causal": (Attention(causal=True), (b, n, hq, d), (b, n, hk, d), {}),
        "padded causal dropout (seed drawn)": (Attention(causal=True, dropout_p=0.1), (b, n, hq, d), (b, n, hk, d), {}),
        "varlen causal": (Attention(causal=True), (total, hq, d), (total, hk, d), {"cu_seqlens_q": cu, "cu_seqlens_k": cu}),
    }
    for name, (module, shape_q, shape_k, arrays) in cases.items():
        q, k, v = (torch.randn(s, device=DEVICE, dtype=dtype, generator=g).requires_grad_() for s in (shape_q, shape_k, shape_k))
        do = torch.randn(shape_q, device=DEVICE, dtype=dtype, generator=g)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(module)(q, k, v, **arrays)
        compiled = torch.compile(module, fullgraph=True)  # Inductor
        results = []
        for run in (compiled, module):
            torch.manual_seed(1)
            o = run(q, k, v, **arrays)
            results.append((o, *torch.autograd.grad(o, (q, k, v), do)))
        report(f"compile {name}: graph breaks", explanation.graph_break_count)
        report(f"compile {name}: max |compiled - eager| (o, dq, dk, dv)", max_diff(*results))


# 2. transformers correctness --------------------------------------------------------------------------
def tiny_llama_check(name):
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    sdpa = LlamaForCausalLM(copy.deepcopy(config)).to(DEVICE).eval()
    sdpa.set_attn_implementation("sdpa")
    ours = LlamaForCausalLM(copy.deepcopy(config)).to(DEVICE).eval()
    ours.load_state_dict(sdpa.state_dict())
    ours.set_attn_implementation(name)
    ids = torch.randint(0, 97, (3, 40), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :20] = 0
    with torch.no_grad():
        a, b = (m(ids, attention_mask=mask).logits for m in (sdpa, ours))
    valid = mask.bool()
    report("transformers fp32: max |logits flx - sdpa| (non-pad tokens)", f"{(a - b)[valid].abs().max().item():.2e}")
    grads = []
    for m in (sdpa, ours):
        m.train()
        m.zero_grad()
        m(ids, attention_mask=mask, labels=ids.masked_fill(~valid, -100)).loss.backward()
        grads.append([p.grad for p in m.parameters()])
        m.eval()
    worst = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(grads[1], grads[0]))
    report("transformers fp32: training step, max relative gradient difference", f"{worst:.2e}")
    tokens = [m.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False) for m in (sdpa, ours)]
    report("transformers fp32: generate() tokens equal", torch.equal(*tokens))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(ours)(ids, attention_mask=mask)
    report("transformers: graph breaks of the model under Dynamo", explanation.graph_break_count)
    torch._dynamo.reset()


# 3. tokens/s --------------------------------------------------------------------------------------------
def timed(fn, repeats):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput(name):
    if args.cpu:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        batch, length, prompt, new, dtype = 2, 128, 32, 8, torch.float32
    else:
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
        batch, length, prompt, new, dtype = 4, 2048, 512, 128, torch.bfloat16
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DEVICE, dtype)
    ids = torch.randint(0, config.vocab_size, (batch, length), device=DEVICE)
    prompts = ids[:, :prompt]
    for implementation in ("sdpa", name):
        model.set_attn_implementation(implementation)
        model.train()

        def step():
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        seconds = timed(step, 3 if args.cpu else 10)
        report(f"tokens/s training step (B={batch}, N={length}, fwd+bwd) {implementation}", f"{batch * length / seconds:,.0f}")
        model.eval()
        with torch.no_grad():
            seconds = timed(lambda: model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False), 3)
        report(f"tokens/s generate (B={batch}, prompt {prompt}, {new} new) {implementation}", f"{batch * new / seconds:,.0f}")


# 4. host time of the operator layer ---------------------------------------------------------------------
def host_time():
    dtype = torch.float32 if args.cpu else torch.bfloat16
    q, k, v, do = (torch.randn(1, 128, 4, 64, device=DEVICE, dtype=dtype) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    options = flashx.options.complete("attention", {"causal": True})

    def direct(*x):
        return flashx.attention(*x, causal=True, backend=BACKEND)

    def through_ops(*x):
        return ops.attention(*x, BACKEND, options, False)

    compiled = torch.compile(direct, fullgraph=True)
    ways = {"eager": direct, "eager through the operators": through_ops, "torch.compile (Inductor)": compiled}
    for way, fn in ways.items():
        for label, call in (("forward", lambda: fn(q, k, v)), ("forward+backward", lambda: fn(*leaves).backward(do))):
            for _ in range(20):
                call()
            rounds = []
            for _ in range(5):
                sync()
                if DEVICE == "cuda":
                    torch.cuda._sleep(200_000_000)  # the calls below only queue
                start = time.perf_counter()
                for _ in range(20):
                    call()
                rounds.append((time.perf_counter() - start) / 20 * 1e6)
                sync()
            report(f"host us per call, {label}, {way}", f"{min(rounds):.0f}")


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", flush=True)
    name = fx_transformers.register()
    with flashx.use_backend(BACKEND):
        compile_check()
        tiny_llama_check(name)
        throughput(name)
        host_time()
    width = max(len(check) for check, _ in TABLE)
    print("\n| check | result |\n| --- | --- |")
    for check, result in TABLE:
        print(f"| {check:<{width}} | {result} |")
