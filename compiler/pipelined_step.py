"""The callable a compiled pipeline hands Dynamo: one whole pipelined step per call.

``PipelinedStep(executor, grad_inputs, loss_output)`` runs the executor's schedule for the
batch (every micro-batch's forward and backward) inside the forward call and returns the
model's outputs with the mean loss. With gradients on, the step runs inside ``_TrainStep``,
an autograd function whose backward hands the step's kept parameter gradients to autograd
(scaled by the incoming gradient unless it is ``loss.backward()``'s 1), so the user's
``loss.backward()`` and optimizer see ordinary ``.grad``s.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroc.passes.loss_output import LossOutput
from zeroc.runtime.pipeline_executor import PipelineExecutor
from zeroc.runtime.planning_state import PLANNING

__all__ = ["PipelinedStep"]


class _TrainStep(torch.autograd.Function):
    """Forward: the whole pipelined step; backward: the kept gradients times the incoming."""

    @staticmethod
    def forward(ctx, executor: PipelineExecutor, inputs: list[Any], indices: tuple[int, ...],
                *params: torch.Tensor) -> torch.Tensor:
        loss, grads = executor.run(inputs, train=True)
        ctx.grads = [grads.get(i) for i in indices]
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if (not PLANNING.simulated and grad_loss.numel() == 1
                and float(grad_loss) == 1.0):  # loss.backward(): the gradients as they are
            scaled = ctx.grads
        else:
            scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.grads]
        ctx.grads = None
        return (None, None, None, *scaled)


class PipelinedStep:
    """The callable Dynamo runs in place of the graph: one pipelined step per call."""

    def __init__(self, executor: PipelineExecutor, grad_inputs: tuple[int, ...],
                 loss_output: LossOutput) -> None:
        self.executor = executor
        self.grad_inputs = grad_inputs
        self.loss_output = loss_output

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        inputs = list(args)
        if torch.is_grad_enabled() and self.grad_inputs:
            params = [inputs[i] for i in self.grad_inputs]
            loss = _TrainStep.apply(self.executor, inputs, self.grad_inputs, *params)
        else:
            loss, _ = self.executor.run(inputs, train=False)
        # The model's other outputs (logits, caches) are meta tensors: see passes/loss_output.
        return self.loss_output.outputs(loss)
