"""The callable a compiled pipeline hands Dynamo: one whole pipelined step per call.

``PipelinedStep(executor, grad_inputs, loss_output)`` runs the executor's schedule for the
batch (every micro-batch's forward and backward) inside the forward call and returns the
model's outputs with the mean loss. With gradients on, the step runs inside ``_TrainStep``,
an autograd function whose backward hands the step's kept parameter gradients to autograd
(scaled in place by the incoming gradient, on the device), so the user's
``loss.backward()`` and optimizer see ordinary ``.grad``s.

Gradient accumulation without sync (``model.set_requires_gradient_sync(False)``,
``zeroc.no_sync``). The step reads the model's switch when it is called (the stage graphs do
not depend on it), in one of three modes:

- ``accumulate`` (sync off): the executor reduces and exchanges nothing; the backward adds
  this rank's own gradients, times the seeded gradient (``(loss / k).backward()``,
  ``loss.backward(gradient=g)``), to ``ZeroState.pipeline_pending`` (in ``reduce_dtype``:
  full gradients for parameters gathered once per step, the in-graph reduced shards with
  ``pp_reshard=True``) and gives autograd nothing.
- ``flush`` (sync on after ``accumulate`` steps): the step's gradients are likewise kept
  unreduced; its backward adds them, scaled, to the pending sums and reduces the total once
  (``PipelineExecutor.reduce_gradients``: one reduction per bucket, then the sum over the
  positions holding a tied parameter, each position adding only its own stages' part).
- ``sync``: the step reduces at its end, as without accumulation.

Every rank runs the same loop, so every rank picks the same mode and the collectives of a
``flush`` backward match across ranks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from zeroc.passes.front.loss_output import LossOutput
from zeroc.runtime.pipeline.executor import PipelineExecutor
from zeroc.runtime.torch_compat import foreach_mul_
from zeroc.sharding.sharded_params import STATE_ATTR, ZeroState

__all__ = ["PipelinedStep"]

log = logging.getLogger(__name__)

SYNC, ACCUMULATE, FLUSH = "sync", "accumulate", "flush"


class _TrainStep(torch.autograd.Function):
    """Forward: the whole pipelined step; backward: the kept gradients times the incoming."""

    @staticmethod
    def forward(ctx, step: PipelinedStep, inputs: list[Any], mode: str,
                *params: torch.Tensor) -> torch.Tensor:
        loss, grads = step.executor.run(inputs, train=True, reduce=mode == SYNC)
        ctx.grads = [grads.get(i) for i in step.grad_inputs]
        ctx.step, ctx.inputs, ctx.mode = step, inputs, mode
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        scaled = _scale_in_place(ctx.grads, grad_loss)
        step, inputs, mode = ctx.step, ctx.inputs, ctx.mode
        ctx.grads = ctx.step = ctx.inputs = None
        if mode != SYNC:
            scaled = step.accumulate(inputs, scaled, flush=mode == FLUSH)
        return (None, None, None, *scaled)


def _scale_in_place(grads: list[torch.Tensor | None],
                    factor: torch.Tensor) -> list[torch.Tensor | None]:
    """``grads`` (the step's own tensors, which nothing else reads) times the incoming
    gradient, in place: one foreach multiply per dtype and device. Multiplying by
    ``loss.backward()``'s 1 too: telling it apart would read the device's value on the host."""
    groups: dict[tuple[torch.dtype, torch.device], dict[int, torch.Tensor]] = {}
    for grad in grads:
        if grad is not None:  # once per tensor, should one be returned for two inputs
            groups.setdefault((grad.dtype, grad.device), {})[id(grad)] = grad
    for (dtype, device), tensors in groups.items():
        foreach_mul_(list(tensors.values()), factor.detach().to(device, dtype))
    return grads


class PipelinedStep:
    """The callable Dynamo runs in place of the graph: one pipelined step per call."""

    def __init__(self, executor: PipelineExecutor, grad_inputs: tuple[int, ...],
                 loss_output: LossOutput) -> None:
        self.executor = executor
        self.grad_inputs = grad_inputs
        self.loss_output = loss_output
        self._state: ZeroState | None = None

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        inputs = list(args)
        if torch.is_grad_enabled() and self.grad_inputs:
            params = [inputs[i] for i in self.grad_inputs]
            loss = _TrainStep.apply(self, inputs, self._mode(inputs), *params)
        else:  # an evaluation program returns its per-sample outputs too (logits)
            loss, _ = self.executor.run(inputs, train=False)
            return self.loss_output.outputs(loss, self.executor.outputs)
        # A training step's other outputs (logits, caches) are meta tensors: see
        # passes/front/loss_output.
        return self.loss_output.outputs(loss)

    def _mode(self, inputs: list[Any]) -> str:
        """``sync``, ``accumulate`` or ``flush`` from the model's switch (module docstring)."""
        if self._state is None:  # the flat buffers carry their model's ZeroState
            self._state = next((s for i in self.grad_inputs
                                if isinstance(s := getattr(inputs[i], STATE_ATTR, None),
                                              ZeroState)), None)
        state = self._state
        if state is None:
            return SYNC
        if not state.requires_gradient_sync:
            state.pipeline_accumulating = True
            return ACCUMULATE
        if state.pipeline_accumulating:
            state.pipeline_accumulating = False
            return FLUSH
        return SYNC

    def accumulate(self, inputs: list[Any], grads: list[torch.Tensor | None],
                   flush: bool) -> list[torch.Tensor | None]:
        """Add one step's scaled, unreduced ``grads`` (by ``grad_inputs``) to the model's
        pending sums. ``flush``: reduce the sums and return them, each parameter's gradient
        for autograd; else return no gradient (nothing reaches ``.grad`` until the flush)."""
        pending = self._state.pipeline_pending
        hoisted = self.executor.layout.hoisted
        for index, grad in zip(self.grad_inputs, grads, strict=True):
            if grad is None:
                continue
            spec = hoisted.get(index)
            dtype = spec.reduce_dtype if spec is not None and spec.reduce_dtype else grad.dtype
            key = id(inputs[index])  # the flat buffer: the same in every pipeline of the model
            if key in pending:
                pending[key].add_(grad.to(dtype))
            else:  # the step's own tensor (the executor keeps no reference to it)
                pending[key] = grad.to(dtype)
        if not flush:
            return [None] * len(grads)
        total = {i: pending.pop(id(inputs[i])) for i in self.grad_inputs
                 if id(inputs[i]) in pending}
        if pending:  # accumulated by another compiled graph of the model that this one lacks
            count = len(pending)
            pending.clear()
            raise RuntimeError(
                f"zeroc pipeline: {count} parameters accumulated gradients without sync that "
                "the synchronised step does not train; run every micro-step through the same "
                "compiled model")
        log.debug("zeroc: pipelined step reduces %d accumulated gradients", len(total))
        reduced = self.executor.reduce_gradients(total, inputs)
        return [reduced.get(i) for i in self.grad_inputs]
