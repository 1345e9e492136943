"""transformers ``generate()`` through flashx against SDPA: tokens a second, in alternation.

A random Llama (hidden 2048, 4 layers, 16 heads, 4 KV heads, bf16, as ``scripts/gpu_integrations.py``
part 3) generates NEW tokens greedily after prompts of PROMPT tokens, B at a time. A decoding step
is bound by the host at this size, so the two implementations are timed in alternation, one
``generate()`` each a round, and compared round by round: a busy host slows both sides of a round.
Prints each round and the medians; ``$OUT/generate.json`` keeps them.

    python scripts/generate_speed.py [--rounds 9] [--batch 4] [--prompt 512] [--new 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flashx.integrations.transformers as fx_transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    name = fx_transformers.register()
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    prompts = torch.randint(0, config.vocab_size, (args.batch, args.prompt), device="cuda")

    def generate(implementation: str) -> tuple[float, torch.Tensor]:
        model.set_attn_implementation(implementation)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            tokens = model.generate(prompts, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
        torch.cuda.synchronize()
        return args.batch * args.new / (time.perf_counter() - start), tokens

    implementations = ("sdpa", name)
    first = {implementation: generate(implementation) for implementation in implementations}  # warm-up
    same = torch.equal(first["sdpa"][1], first[name][1])
    rounds = []
    for round_ in range(args.rounds):
        rates = {implementation: generate(implementation)[0] for implementation in implementations}
        rounds.append(rates)
        print(f"round {round_ + 1}: sdpa {rates['sdpa']:7.0f}  flashx {rates[name]:7.0f} tokens/s  "
              f"flashx / sdpa {rates[name] / rates['sdpa']:.3f}", flush=True)
    medians = {implementation: statistics.median(r[implementation] for r in rounds) for implementation in implementations}
    ratio = statistics.median(r[name] / r["sdpa"] for r in rounds)
    print(f"B={args.batch}, prompt {args.prompt}, {args.new} new: median tokens/s sdpa {medians['sdpa']:.0f}, "
          f"flashx {medians[name]:.0f}; median of the rounds' ratios {ratio:.3f}; same tokens as SDPA: {same}")
    with open(os.path.join(os.environ.get("OUT", "."), "generate.json"), "w") as file:
        json.dump(dict(vars(args), rounds=rounds, medians=medians, ratio=ratio, same_tokens=same), file, indent=1)


if __name__ == "__main__":
    main()
