"""flashx as a Hugging Face transformers attention implementation, against attn_implementation="sdpa"
(Llama) or "eager" (gpt-oss's sinks, Gemma 2's softcap and sliding window).

Tiny models (2 layers, GQA 4:2 heads) built from configs with random weights: nothing is
downloaded. The NumPy backend computes on CPU, in float32.
"""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: nothing here downloads
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashx  # noqa: E402
from flashx.integrations import transformers as integration  # noqa: E402


@pytest.fixture(scope="module")
def models():
    """The same weights twice: SDPA and flashx (each with a config of its own: the implementation lives there)."""
    name = integration.register()
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    sdpa = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()
    sdpa.set_attn_implementation("sdpa")
    ours = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()
    ours.load_state_dict(sdpa.state_dict())
    ours.set_attn_implementation(name)
    with flashx.use_backend("numpy"):
        yield sdpa, ours


@pytest.fixture(scope="module")
def batch():
    """Two sequences of 9 tokens, the second left-padded by 3 (as generate() pads)."""
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0
    return ids, attention_mask


def test_register_names_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = integration.register()
    assert "flash" not in name
    assert AttentionInterface._global_mapping[name] is integration.attention_forward
    # Without a mask builder of its own, transformers would build no mask for the name at all.
    assert name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    with pytest.raises(ValueError, match="flash"):
        integration.register("flashx")


@pytest.mark.parametrize("padded", [False, True])
def test_logits_match_sdpa(models, batch, padded):
    sdpa, ours = models
    ids, attention_mask = batch
    mask = attention_mask if padded else None
    with torch.no_grad():
        expected, got = (model(ids, attention_mask=mask).logits for model in (sdpa, ours))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_training_step_gradients_match_sdpa(models, batch):
    ids, attention_mask = batch
    grads = []
    for model in models:
        model.train()
        model.zero_grad()
        model(ids, attention_mask=attention_mask, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
        model.eval()
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_generate_gives_the_same_tokens(models, batch):
    ids, attention_mask = batch
    expected, got = (model.generate(ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
                     for model in models)
    assert torch.equal(got, expected)


def test_traces_without_graph_break(models, batch):
    _, ours = models
    ids, attention_mask = batch
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(ours)(ids, attention_mask=attention_mask)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert any("flashx.attention_forward" in graph.code for graph in explanation.graphs)


@pytest.mark.parametrize("keyword, value", [("position_bias", torch.zeros(1, 4, 3, 3)), ("output_attentions", True)])
def test_declines_what_flashx_does_not_compute(keyword, value):
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(flashx.UnsupportedError, match=keyword):
        integration.attention_forward(torch.nn.Module(), q, q, q, None, **{keyword: value})


#: Current models' score modifications, each in a tiny config with one sliding-window layer.
MODIFIED = {
    "gpt-oss (sinks)": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "gemma-2 (softcap)": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4,
        attn_logit_softcapping=1.5, final_logit_softcapping=30.0)),
}


@pytest.fixture(scope="module", params=list(MODIFIED))
def modified_models(request):
    """The same weights twice, transformers' eager attention and flashx; gpt-oss's sinks drawn away
    from 0, so that they matter."""
    name = integration.register()
    torch.manual_seed(0)
    eager = MODIFIED[request.param]().eval()
    with torch.no_grad():
        for module in eager.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 2.0)
    ours = copy.deepcopy(eager)
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation(name)
    with flashx.use_backend("numpy"):
        yield eager, ours


def test_modified_models_logits_gradients_and_tokens_match_eager(modified_models, batch):
    """Logits of a padded batch, the gradients of every weight (the sinks' included) and greedy
    tokens. Padding rows are left out of the logits and the loss: eager attention gives a row with
    no allowed key the mean of every value, where flashx gives 0 (the contract's empty rows; with
    gpt-oss's sinks eager gives 0 too)."""
    eager, ours = modified_models
    ids, attention_mask = batch
    real = attention_mask.bool()
    with torch.no_grad():
        expected, got = (model(ids, attention_mask=attention_mask).logits for model in (eager, ours))
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)
    # A token's loss reads the logits of the row before it: the first real token's, a padding row's.
    follows_padding = torch.cat([torch.zeros_like(real[:, :1]), ~real[:, :-1]], dim=1)
    labels = ids.masked_fill(~real | follows_padding, -100)
    grads = []
    for model in (eager, ours):
        model.zero_grad()
        model(ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
    expected, got = (model.generate(ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
                     for model in (eager, ours))
    assert torch.equal(got, expected)
