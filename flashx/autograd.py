"""torch autograd of eager calls: saves o and the residuals, and calls the same backend's backward.

``sinks`` is an input of the function beside q, k and v, so that its gradient (dsinks, the
contract's "Score modifications") reaches the caller's tensor; the problem holds a detached copy
for the backend. Under ``torch.compile`` the same formula is the autograd registration of
flashx's operators (``flashx.ops``); eager calls come here, the shorter way for the host.
"""

from __future__ import annotations

import functools

from flashx.execute import run_backward, run_forward


@functools.cache
def _function():
    import torch

    class FlashAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, impl, problem):
            o, lse = run_forward(impl, problem, q, k, v)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.impl, ctx.problem = impl, problem
            ctx.mark_non_differentiable(lse)
            # lse takes no gradient: without this autograd fills a zero tensor for it, one more
            # allocation and kernel launch per backward.
            ctx.set_materialize_grads(False)
            return o, lse

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, do, _dlse):
            if do is None:  # only lse was used downstream: nothing reaches q, k, v or sinks
                return None, None, None, None, None, None
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv, *dsinks = run_backward(ctx.impl, ctx.problem, q, k, v, o, lse, do)
            return dq, dk, dv, dsinks[0] if ctx.needs_input_grad[3] else None, None, None

    return FlashAttentionFunction


def differentiable_forward(impl, problem, q, k, v, sinks):
    return _function().apply(q, k, v, sinks, impl, problem)
