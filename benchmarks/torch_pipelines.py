"""The torch side of ``pipeline_vs_torch.py`` and the bytes a rank's communication moves.

- ``untied_gpt``, ``StageModule``, ``cross_entropy``: the zoo GPT cut by hand into pipeline
  stages (embeddings first, ``ln_f`` + head last), as ``torch.distributed.pipelining`` needs.
- ``build_torch``: this rank's stages as ``PipelineStage`` + ``Schedule1F1B`` or
  ``ScheduleDualPipeV``; with dp > 1 torchtitan's composition: a 2-D ``DeviceMesh`` ("pp",
  "dp"), pp-major as zeroc lays out its ranks, every block and then the stage module wrapped
  with FSDP2's ``fully_shard`` on ``mesh["dp"]`` (``reshard_after_forward=False``, torchtitan's
  default under pipelining: one all-gather per step, not one per micro-batch), the stages on
  ``mesh["pp"]``'s group.
- ``CommBytes``: a ``TorchDispatchMode`` that adds up the bytes this rank SENDS in every c10d
  collective and p2p op (``c10d::*`` and ``_c10d_functional::*``), per kind. Collectives count
  what a ring (bandwidth-optimal) algorithm sends per rank on a group of n: all-reduce
  ``2 (n-1)/n * S``, all-gather ``(n-1) * input``, reduce-scatter and all-to-all ``(n-1)/n *
  input``, broadcast ``(n-1) * S`` on the root and nothing elsewhere; p2p sends their tensors,
  receives nothing (the sender counts them). The sum over ranks is then what a link shared by
  every rank carries (``benchmarks/slow_link.py``'s loopback).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                 "tests")))
from models.gpt import GPT, GPTConfig  # noqa: E402


def untied_gpt(config: GPTConfig) -> GPT:
    """The zoo GPT with ``lm_head.weight`` its own parameter (a copy of the embedding)."""
    model = GPT(config, seed=0)
    model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
    return model


def num_stages(schedule: str, pp: int) -> int:
    """Stages of ``schedule`` on ``pp`` pipeline ranks: 2 per rank for dualpipev, else 1."""
    return 2 * pp if schedule == "dualpipev" else pp


class StageModule(nn.Module):
    """One pipeline stage of a GPT: its blocks, plus embeddings (first) or ``ln_f`` + head."""

    def __init__(self, gpt: GPT, stage: int, stages: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
        per = gpt.config.n_layer // stages  # parse_args checks that it divides evenly
        self.layers = nn.ModuleList(gpt.layers[stage * per:(stage + 1) * per])
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits (last) out."""
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on one micro-batch's logits."""
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build_torch(schedule: str, model: GPTConfig, microbatches: int, rank: int, pp: int,
                dp: int = 1) -> tuple[nn.Module, Callable[..., float | None]]:
    """Stage modules of this rank (pipeline position ``rank // dp``) and a ``step(x, y) ->
    loss|None`` on this replica's rows; with ``dp == 1`` no mesh and no FSDP."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV

    position, group = rank // dp, None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        group = mesh["pp"].get_group()
        assert mesh["pp"].get_local_rank() == position, (rank, pp, dp)
    stages = num_stages(schedule, pp)
    mine = [position, stages - 1 - position] if schedule == "dualpipev" else [position]
    gpt = untied_gpt(model)
    modules = [StageModule(gpt, s, stages) for s in mine]
    del gpt  # only this rank's stages stay alive, as in a real deployment
    if dp > 1:
        for module in modules:
            for block in module.layers:
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
    pipeline_stages = [PipelineStage(m, s, stages, torch.device("cpu"), group=group)
                       for m, s in zip(modules, mine, strict=True)]
    if schedule == "dualpipev":
        runner = ScheduleDualPipeV(pipeline_stages, microbatches, loss_fn=cross_entropy)
    else:
        runner = Schedule1F1B(pipeline_stages[0], microbatches, loss_fn=cross_entropy)
    first, last = 0 in mine, stages - 1 in mine
    # Older torch has no return_outputs; there the last stage keeps its merged outputs.
    extra = ({"return_outputs": False}
             if "return_outputs" in inspect.signature(runner.step).parameters else {})

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": losses} if last else {}
        runner.step(*args, **extra, **kwargs)
        return float(torch.stack(losses).detach().mean()) if last else None

    return nn.ModuleList(modules), step


# op name (without namespace) -> (kind, how the bytes sent follow from the payload S and the
# group size n): "ring" 2(n-1)/n S, "gather" (n-1) S_in, "scatter" (n-1)/n S_in, "send" S,
# "none" 0, "root" (n-1) S on the root; the payload is the argument named in PAYLOAD.
OPS = {
    "send": ("p2p", "send"), "recv_": ("p2p", "none"), "recv_any_source_": ("p2p", "none"),
    "allreduce_": ("all_reduce", "ring"), "allreduce_coalesced_": ("all_reduce", "ring"),
    "all_reduce": ("all_reduce", "ring"), "all_reduce_": ("all_reduce", "ring"),
    "all_reduce_coalesced": ("all_reduce", "ring"), "all_reduce_coalesced_": ("all_reduce", "ring"),
    "allgather_": ("all_gather", "gather"), "_allgather_base_": ("all_gather", "gather"),
    "allgather_coalesced_": ("all_gather", "gather"),
    "allgather_into_tensor_coalesced_": ("all_gather", "gather"),
    "all_gather_into_tensor": ("all_gather", "gather"),
    "all_gather_into_tensor_out": ("all_gather", "gather"),
    "all_gather_into_tensor_coalesced": ("all_gather", "gather"),
    "reduce_scatter_": ("reduce_scatter", "scatter"),
    "_reduce_scatter_base_": ("reduce_scatter", "scatter"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "scatter"),
    "reduce_scatter_tensor": ("reduce_scatter", "scatter"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "scatter"),
    "alltoall_": ("all_to_all", "scatter"), "alltoall_base_": ("all_to_all", "scatter"),
    "all_to_all_single": ("all_to_all", "scatter"),
    "broadcast_": ("broadcast", "root"), "broadcast": ("broadcast", "root"),
    "gather_": ("other", "scatter"), "scatter_": ("other", "scatter"),
    "reduce_": ("other", "scatter"),
}
# The argument whose tensors are the payload: the input where an op has input and output.
PAYLOAD = ("tensors", "input_tensors", "input_tensor", "input", "inputs", "input_list", "self")
KINDS = ("p2p", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "other")


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor or nested lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _group(schema_args: list, values: dict[str, Any]) -> tuple[int, int]:
    """(size, this rank's index) of the op's process group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in schema_args:
        if "ProcessGroup" in str(arg.type):
            group = dist.ProcessGroup.unbox(values[arg.name])
            return group.size(), group.rank()
    group = _resolve_process_group(values["group_name"])
    return group.size(), group.rank()


class CommBytes(TorchDispatchMode):
    """Adds up ``sent[kind]`` (bytes) and ``ops[kind]`` over the c10d ops dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = dict.fromkeys(KINDS, 0)
        self.ops = dict.fromkeys(KINDS, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self.count(func, args, kwargs)
        return func(*args, **kwargs)

    def count(self, func, args: tuple, kwargs: dict) -> None:
        """Add the bytes op ``func`` sends (ops without payload, e.g. barrier, are skipped)."""
        name = func.name().split("::", 1)[1]
        if name not in OPS:
            return
        kind, rule = OPS[name]
        schema_args = func._schema.arguments
        values = {a.name: v for a, v in zip(schema_args, args, strict=False)} | kwargs
        payload = next((values[p] for p in PAYLOAD if p in values), None)
        size = _nbytes(payload)
        if rule == "send":
            sent = size
        elif rule == "none":
            sent = 0
        else:
            n, me = _group(schema_args, values)
            if rule == "ring":
                sent = 2 * (n - 1) * size // n
            elif rule == "gather":
                sent = (n - 1) * size
            elif rule == "scatter":
                sent = (n - 1) * size // n
            else:  # root: the root rank sends to every other
                root = values.get("root_rank", values.get("src"))
                sent = (n - 1) * size if root == me else 0
        self.sent[kind] += sent
        self.ops[kind] += 1


def count_step(step: Any, compiled: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> CommBytes:
    """One more step, untimed, with this rank's collectives and p2p counted. zeroc's step is
    counted inside its executor (a dispatch mode around Dynamo's frame would make Dynamo run
    the model eagerly), its backward and AdamW under the mode as torch's whole step."""
    counter = CommBytes()
    dist.barrier()
    if compiled is None:
        with counter:
            step(x, y)
            optimizer.step()
    else:
        from zeroc.runtime.pipeline.executor import PipelineExecutor

        run = PipelineExecutor.run

        def counted_run(self, *args, **kwargs):
            with counter:
                return run(self, *args, **kwargs)

        PipelineExecutor.run = counted_run
        try:
            loss = compiled(x, y)
        finally:
            PipelineExecutor.run = run
        with counter:
            loss.backward()
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return counter
