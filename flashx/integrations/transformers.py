"""Hugging Face transformers: flashx as an attention implementation.

    import flashx.integrations.transformers as fx_transformers
    name = fx_transformers.register()            # "flx"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)

``register`` adds flashx to transformers' ``AttentionInterface`` (attention functions) and to its
``AttentionMaskInterface`` (mask builders) under one name. Both are needed: for a name with no
mask builder, transformers builds no mask at all and leaves causality and padding to the attention
function's ``is_causal`` flag alone, so a padded batch would attend to its padding. flashx takes
the masks that SDPA takes (``transformers.masking_utils.sdpa_mask``: a bool mask, True = attend, or
None where SDPA's top-left ``is_causal`` suffices) and computes what SDPA computes with them, through
``flashx.compat.sdpa_as_flashx``: the GQA key/value heads as they are (never repeated), and the
output in the (B, N, H, D) layout transformers expects. transformers sends every implementation name
containing "flash" to its flash-attn loader, hence the name.

The score modifications of current models go to flashx as its own keywords (the contract's
"Score modifications"): gpt-oss's learned sinks (``s_aux``) as ``sinks``, Gemma 2's ``softcap`` as
``softcap``; a backend that does not implement one declines the call with its reason. What flashx
cannot compute raises ``UnsupportedError``: T5-style position biases, and the attention weights
(``output_attentions=True``).
"""

from __future__ import annotations

from flashx.compat import sdpa_as_flashx
from flashx.errors import UnsupportedError

NAME = "flx"


def register(name: str = NAME) -> str:
    """Register flashx with transformers' attention and mask interfaces; returns the ``attn_implementation``."""
    if "flash" in name:
        raise ValueError(f"name: transformers sends names containing 'flash' to its flash-attn loader, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      softcap=None, s_aux=None, position_bias=None, output_attentions=False, **kwargs):
    """transformers' attention-function contract: query (B, Hq, N, D), key and value (B, Hk, S, D)
    -> (output (B, N, Hq, Dv), None). Other keywords (sliding_window, position_ids, ...) are already
    in the mask, as they are for SDPA."""
    if position_bias is not None or output_attentions:
        for given, what in ((position_bias is not None, "position_bias: an additive position bias"),
                            (output_attentions, "output_attentions: the attention weights, which flashx never materialises")):
            if given:
                raise UnsupportedError(f"{what} are not computed by flashx; use attn_implementation='eager'")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' SDPA integration: a single query row attends to every key (decoding), and a
    # mask, when there is one, already holds causality. The shape is tested first so that a
    # symbolic length under torch.compile never reaches the bool.
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    modifications = {} if s_aux is None else {"sinks": s_aux}
    output = sdpa_as_flashx(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
                            scale=scaling, enable_gqa=True, softcap=softcap, **modifications)
    return output, None
