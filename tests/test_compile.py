"""torch.compile of code calling flashx: no graph break, the registered operators, values equal to eager.

The compiled functions run with the "eager" or "aot_eager" compiler backends: what is tested is
that Dynamo traces flashx whole (through the fake implementations) and that AOTAutograd
differentiates the operators through their autograd formula, not what Inductor generates
around them. The NumPy backend computes, on CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashx  # noqa: E402
from flashx import ops  # noqa: E402
from flashx.options import OPTIONS  # noqa: E402
from flashx_conformance import oracle  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Attention(torch.nn.Module):
    """A module that calls flashx.attention with the keywords it was built with."""

    def __init__(self, **keywords):
        super().__init__()
        self.keywords = keywords

    def forward(self, q, k, v, **arrays):
        return flashx.attention(q, k, v, backend="numpy", **self.keywords, **arrays)


def _inputs(shape_q, shape_k, dv=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape_v = shape_k[:-1] + (dv or shape_k[-1],)
    return tuple(torch.randn(shape, generator=generator, requires_grad=True) for shape in (shape_q, shape_k, shape_v))


CU = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
CASES = {
    "padded causal gqa": (Attention(causal=True), _inputs((2, 9, 4, 8), (2, 11, 2, 8)), {}),
    "varlen causal dropout": (
        Attention(causal=True, dropout_p=0.25),
        _inputs((12, 4, 8), (12, 2, 8), dv=6),
        {"cu_seqlens_q": CU, "cu_seqlens_k": CU},
    ),
    "masks window, seed past 2**63, lse": (
        Attention(window=(3, 1), dropout_p=0.1, seed=2**64 - 5, rng_offset=2**63 + 7, return_lse=True),
        _inputs((2, 8, 4, 8), (2, 8, 2, 8)),
        {
            "mask": torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.2,
            "block_mask": flashx.BlockMask(torch.tensor([[True, False], [True, True]]), (4, 4)),
            "seqlens_k": torch.tensor([8, 5]),
        },
    ),
}


def test_the_operators_take_every_option():
    """An option added to flashx.options must reach the operators (block_mask as blocks and size)."""
    assert set(ops._OPTION_NAMES) == set(OPTIONS) - {"seed"} | {"block_size", "backend"}


@pytest.mark.parametrize("case", list(CASES))
def test_compiles_without_graph_break_into_the_operator(case):
    module, inputs, arrays = CASES[case]
    explanation = torch._dynamo.explain(module)(*inputs, **arrays)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert "torch.ops.flashx.attention_forward" in explanation.graphs[0].code


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_equals_eager_and_the_oracle(case):
    module, inputs, arrays = CASES[case]
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    results = []
    for run in (compiled, module):
        torch.manual_seed(7)  # the dropout seed, where none is given, comes from torch's generator
        out = run(*inputs, **arrays)
        outputs = out if isinstance(out, tuple) else (out,)
        results.append((*outputs, *torch.autograd.grad(outputs[0], inputs, torch.cos(outputs[0]).detach())))
    for x, y in zip(*results):
        assert torch.equal(x, y)  # the same backend on the same inputs: bit for bit
    if "dropout_p" not in module.keywords or "seed" in module.keywords:
        o = results[0][0]
        options = {**module.keywords, **arrays}
        options.pop("return_lse", None)
        expected, _ = oracle.forward(*(x.detach().numpy() for x in inputs), **_numpy(options))
        np.testing.assert_allclose(o.detach().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_the_dropout_seed_drawn_in_the_forward_is_the_backwards():
    """seed=None under compile: the seed is drawn when the graph runs and handed to the backward."""
    q, k, v = _inputs((1, 16, 2, 8), (1, 16, 2, 8))
    compiled = torch.compile(Attention(dropout_p=0.5, return_lse=False), backend="aot_eager", fullgraph=True)
    torch.manual_seed(3)
    o = compiled(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())  # what the forward drew
    _, _, *expected = oracle.forward_backward(*(x.detach().numpy() for x in (torch.ones_like(o), q, k, v)),
                                              dropout_p=0.5, seed=seed)
    for got, want in zip((dq, dk, dv), expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_the_lse_takes_no_gradient_compiled_or_not():
    q, k, v = _inputs((1, 4, 2, 8), (1, 4, 2, 8))
    module = Attention(return_lse=True)
    for run in (torch.compile(module, backend="aot_eager", fullgraph=True), module):
        _, lse = run(q, k, v)
        assert not lse.requires_grad


def test_eager_calls_skip_the_operators():
    q, k, v = _inputs((1, 4, 2, 8), (1, 4, 2, 8))
    o = flashx.attention(q, k, v, backend="numpy")
    assert type(o.grad_fn).__name__ == "FlashAttentionFunctionBackward"


@pytest.mark.parametrize("layout", ["padded", "padded (B, H, N, D) views", "varlen"])
def test_opcheck(layout):
    """Schema, fake implementation (strides included), autograd registration and AOT dispatch (dynamic shapes)."""
    if layout.startswith("padded"):
        q, k, v = _inputs((2, 5, 4, 8), (2, 7, 2, 8))
        if layout.endswith("views"):  # as transformers hands them over: (B, H, N, D) transposed
            q, k, v = (x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v))
        arrays = {"seqlens_q": torch.tensor([5, 3])}
    else:
        q, k, v = _inputs((12, 4, 8), (12, 2, 8))
        arrays = {"cu_seqlens_q": CU, "cu_seqlens_k": CU}
    options = {**OPTIONS, "causal": True, "dropout_p": 0.2, "block_size": None, "backend": "numpy", **arrays}
    arguments = (q, k, v, 2**63 - 1, *(options[name] for name in ops._OPTION_NAMES))
    torch.library.opcheck(ops.forward_op, arguments)
    o, lse, seed = ops.forward_op(*(x.detach() if isinstance(x, torch.Tensor) else x for x in arguments))
    torch.library.opcheck(ops.backward_op, (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o, lse, seed,
                                            *arguments[4:]))


def test_sinks_compile_into_the_operator_and_take_their_gradient():
    """sinks that require grad: no graph break, and the compiled step's dsinks (the backward
    operator's fourth output) are eager's bit for bit, and the oracle's."""
    q, k, v = _inputs((2, 9, 4, 8), (2, 11, 2, 8))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.25], requires_grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    module = Attention(causal=True, softcap=2.0)
    explanation = torch._dynamo.explain(module)(q, k, v, sinks=sinks, alibi_slopes=slopes)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    results = []
    for run in (torch.compile(module, backend="aot_eager", fullgraph=True), module):
        o = run(q, k, v, sinks=sinks, alibi_slopes=slopes)
        results.append((o, *torch.autograd.grad(o, (q, k, v, sinks), torch.cos(o).detach())))
    for x, y in zip(*results):
        assert torch.equal(x, y)
    expected = oracle.forward_backward(*(x.detach().numpy() for x in (torch.cos(results[0][0]), q, k, v)), causal=True,
                                       softcap=2.0, sinks=sinks.detach().numpy(), alibi_slopes=slopes.numpy())
    for got, want in zip(results[0], expected[:1] + expected[2:]):
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-5)
    options = {**OPTIONS, "causal": True, "sinks": sinks, "block_size": None, "backend": "numpy"}
    arguments = (q, k, v, None, *(options[name] for name in ops._OPTION_NAMES))
    torch.library.opcheck(ops.forward_op, arguments)
    detached = [x.detach() if isinstance(x, torch.Tensor) else x for x in arguments]
    o, lse, seed = ops.forward_op(*detached)
    torch.library.opcheck(ops.backward_op, (torch.randn_like(o), *detached[:3], o, lse, seed, *detached[4:]))


def test_attention_with_kvcache_compiles_and_writes_the_cache():
    generator = torch.Generator().manual_seed(0)
    q, k_new, v_new = (torch.randn(2, 2, 4, 8, generator=generator) for _ in range(3))
    k_new, v_new = k_new[:, :, :2], v_new[:, :, :2]
    k_cache, v_cache = (torch.randn(2, 16, 2, 8, generator=generator) for _ in range(2))
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    slopes, sinks = torch.tensor([0.5, 0.25, 0.125, 0.0625]), torch.tensor([0.5, -1.0, 2.0, 0.25])

    def decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new, alibi_slopes, sinks):
        return flashx.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new,
                                             v_new=v_new, softcap=2.0, alibi_slopes=alibi_slopes, sinks=sinks,
                                             return_lse=True, backend="numpy")

    explanation = torch._dynamo.explain(decode)(q, k_cache.clone(), v_cache.clone(), lengths, k_new, v_new, slopes,
                                                sinks)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    caches = (k_cache.clone(), v_cache.clone())
    o, lse = torch.compile(decode, backend="aot_eager", fullgraph=True)(q, *caches, lengths, k_new, v_new, slopes,
                                                                        sinks)
    want_k, want_v, k, v, options = oracle.kvcache(q.numpy(), k_cache.numpy(), v_cache.numpy(),
                                                   cache_seqlens=lengths.numpy(), k_new=k_new.numpy(),
                                                   v_new=v_new.numpy(), softcap=2.0, alibi_slopes=slopes.numpy(),
                                                   sinks=sinks.numpy())
    np.testing.assert_array_equal(caches[0].numpy(), want_k)
    np.testing.assert_array_equal(caches[1].numpy(), want_v)
    want_o, want_lse = oracle.forward(q.numpy(), k, v, **options)
    np.testing.assert_allclose(o.numpy(), want_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(ops.kvcache_op, (q, k_cache.clone(), v_cache.clone(), lengths, k_new, v_new, None, True,
                                           None, None, 2.0, slopes, sinks, None, 0, True, None, None, "numpy"))


@pytest.mark.parametrize("name, value, error", [("seed", -1, flashx.OptionError), ("seed", 2**64, flashx.OptionError),
                                               ("rng_offset", -3, flashx.OptionError), ("seed", 1.5, flashx.DTypeError)])
def test_seeds_are_checked_as_in_eager_before_the_operator(name, value, error):
    """An int64 argument could not tell a negative seed from a large one: it never gets one."""
    q, k, v = _inputs((1, 4, 2, 8), (1, 4, 2, 8))
    options = {**OPTIONS, "dropout_p": 0.1, name: value}
    with pytest.raises(error, match=name):
        ops.attention(q, k, v, "numpy", options, False)
    with pytest.raises(error, match=name):
        # Without fullgraph: Dynamo breaks the graph at the raise and the error reaches the caller as it is.
        torch.compile(Attention(**{name: value, "dropout_p": 0.1}), backend="eager")(q, k, v)


def test_export_records_the_operator():
    q, k, v = (x.detach() for x in _inputs((1, 6, 2, 8), (1, 6, 2, 8)))
    module = Attention(causal=True)
    exported = torch.export.export(module, (q, k, v), strict=False)
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert torch.ops.flashx.attention_forward.default in targets
    assert torch.equal(exported.module()(q, k, v), module(q, k, v))


def _numpy(options):
    """flashx keywords with torch arrays as the oracle takes them."""
    converted = dict(options)
    for name, value in options.items():
        if isinstance(value, torch.Tensor):
            converted[name] = value.numpy()
        elif isinstance(value, flashx.BlockMask):
            converted[name] = flashx.BlockMask(value.blocks.numpy(), value.block_size)
    return converted
