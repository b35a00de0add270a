"""Run one rank's part of a pipeline schedule: stage graphs, micro-batches, p2p, gradients.

A ``StageProgram`` holds a stage's compiled functional graphs (DESIGN.md §4.1):
``forward(params..., locals..., received...) -> (sent..., model outputs..., saved...)``,
``backward(saved..., tangents...) -> gradients in input order``, and the same backward split
into ``input_grad`` (I) and ``weight_grad`` (W). ``PipelineExecutor.run`` walks this rank's
lowered action list once per step: ``F``/``B``/``I``/``W``/``FB`` call the graphs and keep the
saved tensors per (stage, micro-batch) itself (no autograd tape), p2p groups move messages.

Messages. ``messages[s]`` names the values stage ``s`` hands to stage ``s + 1`` (its own
outputs and values passing through it to later stages); the backward message of stage ``s``
carries the gradients of ``messages[s - 1]``'s values that require one. A pass-through value's
gradient is what came from downstream plus what the stage's own use of it contributed.

Gradients. The last stage's loss is the mean over micro-batches, so every micro-batch's loss
gets the tangent ``1 / microbatches``; parameter gradients accumulate over micro-batches and
are then summed over the pipeline positions holding the same parameter (``p2p.exchange_and_
sum``). After the step one all-gather over the pipeline group collects every rank's loss share
and action timings, so every rank returns the loss and can draw the measured timeline.

Profiling. While a ``torch.profiler`` records, the step runs inside
``record_function("zeroc/pipeline_step")`` and each action group inside
``zeroc/<group label>`` (``zeroc/F0@s1``, ``zeroc/SEND_F0@s0->r1``; a compute's wait for
its messages is inside its action), the end-of-step exchanges inside ``zeroc/step_sync`` and
``zeroc/step_grad_exchange``, and the per-step ZeRO buckets as ``runtime/pipeline_zero.py``
names them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.actions import Action, ActionKind, Schedule
from zeroc.runtime.executor import PROFILE_PREFIX, record
from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.p2p import exchange_and_sum, post_receives, post_sends
from zeroc.runtime.pipeline_zero import HoistedParam, StepZero
from zeroc.runtime.planning_state import PLANNING
from zeroc.runtime.step_clock import StepClock
from zeroc.runtime.step_memory import tracking_scope

log = logging.getLogger(__name__)

ValueMeta = tuple[tuple[int, ...], torch.dtype, bool]
# Set on every parameter of a compiled pipeline: the first pipeline position that updates it.
PP_SOURCE_ATTR = "_zeroc_pp_source"
_STEP, _SYNC, _EXCHANGE = (PROFILE_PREFIX + n for n in (
    "pipeline_step", "step_sync", "step_grad_exchange"))


@dataclasses.dataclass
class StageProgram:
    """A stage's compiled graphs and the layout of their inputs and outputs."""

    index: int
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    input_grad: Callable[..., Any]
    weight_grad: Callable[..., Any]
    w_inputs: tuple[int, ...]
    num_input_grads: int
    param_inputs: tuple[int, ...]
    local_inputs: tuple[int, ...]
    in_keys: tuple[str, ...]
    out_keys: tuple[str, ...]
    num_model_outputs: int
    tangent_outputs: tuple[int, ...]
    # F&B graphs of this stage's forward with another stage's backward, by backward stage.
    overlapped: dict[int, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    # The forward-only graph for torch.no_grad() calls (no saved activations), compiled on
    # first use; None: run the training forward.
    inference: Callable[..., Any] | None = None


@dataclasses.dataclass
class PipelineLayout:
    """What every rank of the pipeline agrees on (computed identically everywhere)."""

    schedule: Schedule
    forward_schedule: Schedule
    messages: tuple[tuple[str, ...], ...]
    values: dict[str, ValueMeta]
    batch_inputs: frozenset[int]
    microbatch: int
    holders: dict[int, tuple[int, ...]]
    position: int
    global_ranks: tuple[int, ...]
    group_name: str
    # How micro-batch losses combine (see zeroc.passes.loss_normalization): the graphs
    # return numerators; the loss and every gradient are divided by the denominator, a
    # graph of the full-batch inputs (None: 1). "micro_mean" averages the micro-batches.
    loss_kind: str = "micro_mean"
    loss_denominator: Any = None
    # ZeRO once per step (runtime/pipeline_zero.py): this rank's parameters whose gather was
    # taken out of the stage graphs, and the bucket size of the per-step collectives.
    hoisted: dict[int, HoistedParam] = dataclasses.field(default_factory=dict)
    bucket_mb: float = 25.0


@dataclasses.dataclass(frozen=True)
class StepTimings:
    """Wall-clock (start, end) seconds of every action group of every rank in the last step."""

    labels: tuple[tuple[str, ...], ...]
    times: tuple[tuple[tuple[float, float], ...], ...]
    # Seconds each group waited, before it started, for receives it needed (per rank).
    waits: tuple[tuple[float, ...], ...] = ()


def action_groups(actions: tuple[Action, ...]) -> list[tuple[Action, ...]]:
    """One rank's actions grouped: each run of p2p actions together, every other alone."""
    groups: list[list[Action]] = []
    for action in actions:
        if action.is_p2p and groups and groups[-1][0].is_p2p:
            groups[-1].append(action)
        else:
            groups.append([action])
    return [tuple(g) for g in groups]


def group_label(group: tuple[Action, ...]) -> str:
    """A readable name of an action group for traces: ``F3@s1`` or ``SEND_F3@s1->r2 ...``."""
    return " ".join(str(a) for a in group)


class PipelineExecutor:
    """Runs this rank's actions of a pipeline step; see the module docstring."""

    def __init__(self, layout: PipelineLayout, stages: dict[int, StageProgram]) -> None:
        self.layout = layout
        self.stages = stages
        self.last_stage = layout.schedule.num_stages - 1
        self.timings: StepTimings | None = None
        self.steps = 0
        self.zero = StepZero(layout.hoisted, {s: p.param_inputs for s, p in stages.items()},
                             layout.bucket_mb) if layout.hoisted else None
        self.groups = {
            train: [action_groups(rank_actions) for rank_actions in schedule.actions]
            for train, schedule in ((True, layout.schedule), (False, layout.forward_schedule))
        }
        # Profiler names of this rank's action groups, made once (see the module docstring).
        self.profile_names = {
            train: tuple(PROFILE_PREFIX + group_label(g) for g in groups[layout.position])
            for train, groups in self.groups.items()
        }
        log.debug("zeroc: pipeline position %d runs stages %s: %d action groups per step",
                  layout.position, sorted(stages), len(self.groups[True][layout.position]))

    # -- one step -------------------------------------------------------------------------

    def run(self, inputs: list[Any], train: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the step on the model's flat inputs; return (mean loss, parameter gradients)."""
        with record(_STEP):
            loss, grads = self._run_step(inputs, train)
        if self.steps == 0:
            log.debug("zeroc: pipeline position %d ran its first %s step", self.layout.position,
                      "training" if train else "forward-only")
        self.steps += 1
        return loss, grads

    def _run_step(self, inputs: list[Any],
                  train: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        self._inputs = inputs
        self._train = train
        self._inbox_f: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._inbox_b: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._outbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        self._saved: dict[tuple[int, int], tuple[list[Any], dict[str, torch.Tensor]]] = {}
        self._pending_w: dict[tuple[int, int], list[Any]] = {}
        self._grads: dict[int, torch.Tensor] = {}
        tensor = next((v for v in inputs if isinstance(v, torch.Tensor)), None)
        self._step_device = device = tensor.device if tensor is not None else torch.device("cpu")
        self._loss = torch.zeros((), dtype=torch.float64, device=device)
        self._scale = self._normaliser(inputs)
        if self.zero is not None:
            self.zero.begin()
        my_groups = self.groups[train][self.layout.position]
        names = self.profile_names[train]
        clock = StepClock(device, PLANNING.simulated)
        marks: list[Any] = []  # per group: start, compute start (after waiting), end
        self._posted: dict[int, list] = {}
        self._arriving: dict[tuple[str, int, int], list[Any]] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []
        with torch.no_grad(), tracking_scope():
            for position, group in enumerate(my_groups):
                marks.append(clock.mark())
                with record(names[position]):
                    if group[0].is_p2p:
                        self._p2p(position, group)
                        marks.append(marks[-1])
                    else:
                        # Receives of the next p2p group are posted before this compute runs;
                        # this compute waits only for the messages it reads.
                        self._post_receives(position + 1, my_groups)
                        self._await_messages(group[0])
                        marks.append(clock.mark())
                        self._compute(group[0])
                marks.append(clock.mark())
            for works in self._arriving.values():  # messages nothing read (eval: gradients)
                for work in works:
                    work.wait()
            for work, _tensor in self._sends:  # sends completed in the background
                work.wait()
            self._sends = []
            seconds = clock.seconds(marks)
            spans = [(seconds[i + 1], seconds[i + 2]) for i in range(0, len(seconds), 3)]
            waits = [seconds[i + 1] - seconds[i] for i in range(0, len(seconds), 3)]
            with record(_SYNC):
                loss = self._finish(spans, waits, train)
            grads = self._grads
            if train and self.zero is not None:  # once per step, after the last backward
                self.zero.reduce(grads, inputs)
            if self.zero is not None:
                self.zero.end()
            if train:
                for stage in self.stages.values():
                    for index in stage.param_inputs:
                        if index not in grads:
                            grads[index] = torch.zeros_like(inputs[index])
                with record(_EXCHANGE):
                    grads = exchange_and_sum(grads, self.layout.holders, self.layout.position,
                                             self.layout.global_ranks)
                if self._scale != 1.0:
                    for grad in grads.values():
                        grad.mul_(self._scale)
        return loss, grads

    def _finish(self, spans: list[tuple[float, float]], waits: list[float],
                train: bool) -> torch.Tensor:
        """All-gather loss shares and timings over the pipeline group; return the mean loss."""
        groups = self.groups[train]
        digest = self._batch_digest()
        timing_width = 3 * max(len(g) for g in groups)
        device = self._loss.device
        mine = torch.zeros(1 + timing_width + digest.numel(), dtype=torch.float64,
                           device=device)
        mine[0] = self._loss
        flat = torch.tensor([t for span, wait in zip(spans, waits, strict=True)
                             for t in (*span, wait)], dtype=torch.float64)
        mine[1:1 + flat.numel()] = flat.to(device)
        mine[1 + timing_width:] = digest.to(device)
        group = resolve_group(self.layout.group_name)
        if group is None:
            rows = [mine]
        else:  # on the group's device (CUDA under NCCL), read on the host once
            rows = [torch.empty_like(mine) for _ in range(group.size())]
            dist.all_gather(rows, mine, group=group)
        if PLANNING.simulated:  # fake tensors: no values to read; the plan has no timings
            self.timings = None
            return (sum(row[0] for row in rows) * self._scale).float()
        rows = [row.cpu() for row in rows]
        self.timings = StepTimings(
            labels=tuple(tuple(group_label(g) for g in rank_groups) for rank_groups in groups),
            times=tuple(tuple((float(row[1 + 3 * i]), float(row[2 + 3 * i]))
                              for i in range(len(groups[r]))) for r, row in enumerate(rows)),
            waits=tuple(tuple(float(row[3 + 3 * i]) for i in range(len(groups[r])))
                        for r, row in enumerate(rows)),
        )
        self._check_same_batch([row[1 + timing_width:] for row in rows])
        total = sum(float(row[0]) for row in rows)
        return torch.tensor(total * self._scale, dtype=torch.float32)

    def _batch_digest(self) -> torch.Tensor:
        """Two position-weighted sums per batch input: equal on ranks given equal batches."""
        parts = []
        if PLANNING.simulated:
            return torch.zeros(2 * len(self.layout.batch_inputs), dtype=torch.float64)
        for index in sorted(self.layout.batch_inputs):
            flat = self._inputs[index].detach().reshape(-1).double()
            weights = torch.arange(flat.numel(), dtype=torch.float64) % 997 + 1
            parts += [flat.sum(), (flat * weights.to(flat.device)).sum()]
        return torch.stack(parts).cpu() if parts else torch.zeros(0, dtype=torch.float64)

    def _check_same_batch(self, digests: list[torch.Tensor]) -> None:
        """Every rank of a pipeline must run the same batch; raise on all of them if not."""
        odd = [i for i, d in enumerate(digests) if not torch.equal(d, digests[0])]
        if odd:
            ranks = self.layout.global_ranks
            raise ValueError(
                f"zeroc pipeline: the ranks of one pipeline were given different batches "
                f"(rank {ranks[0]} and rank {ranks[odd[0]]} differ): every rank of a pipeline "
                "must pass the same batch. Shard the data over the data-parallel dimension "
                "only, e.g. DistributedSampler(dataset, num_replicas=zeroc.data_parallel_size("
                "model), rank=zeroc.data_parallel_rank(model))")

    def _normaliser(self, inputs: list[Any]) -> float:
        """1 / the loss's denominator for this batch (every rank has the whole batch)."""
        if self.layout.loss_kind == "micro_mean":
            return 1.0 / self.layout.schedule.num_microbatches
        if self.layout.loss_denominator is None or PLANNING.simulated:
            return 1.0  # planning: the denominator's value does not exist (shapes are exact)
        denominator = float(self.layout.loss_denominator(*inputs))
        if denominator == 0:
            raise ValueError("zeroc pipeline: the loss's denominator is 0 for this batch "
                             "(every target is ignore_index)")
        return 1.0 / denominator

    # -- compute --------------------------------------------------------------------------

    def _compute(self, action: Action) -> None:
        if action.kind is ActionKind.FB:
            overlapped = self.stages[action.stage].overlapped.get(action.b_stage)
            if overlapped is not None and self._train:
                self._overlapped(action, overlapped)
                return
            for part in action.parts():
                self._compute(part)
            return
        if action.kind is ActionKind.F:
            self._forward(action.stage, action.microbatch)
        elif not self._train:
            return
        elif action.kind is ActionKind.B:
            self._backward(action.stage, action.microbatch, split=False)
        elif action.kind is ActionKind.I:
            self._backward(action.stage, action.microbatch, split=True)
        elif action.kind is ActionKind.W:
            self._weight(action.stage, action.microbatch)

    def _local(self, index: int, microbatch: int) -> Any:
        value = self._inputs[index]
        if index in self.layout.batch_inputs:
            size = self.layout.microbatch
            return value[microbatch * size:(microbatch + 1) * size]
        return value

    def forward_args(self, stage: int, microbatch: int) -> list[Any]:
        """The forward graph's arguments of ``stage`` for ``microbatch`` (consumes its inbox)."""
        program = self.stages[stage]
        received = self._inbox_f.pop((stage, microbatch), {})
        self._received = received
        if self.zero is not None:  # the first micro-batch of the stage gathers (UNSHARD)
            self.zero.gather(stage, self._inputs)
            params = [self.zero.parameter(i, self._inputs) for i in program.param_inputs]
        else:
            params = [self._inputs[i] for i in program.param_inputs]
        return (params
                + [self._local(i, microbatch) for i in program.local_inputs]
                + [received[k] for k in program.in_keys])

    def forward_results(self, stage: int, microbatch: int, outs: tuple) -> None:
        """Keep what the forward saved and hand its message on (locally or to the outbox)."""
        program = self.stages[stage]
        received = self._received
        produced = dict(zip(program.out_keys, outs, strict=False))
        done = len(program.out_keys) + program.num_model_outputs
        for value in outs[len(program.out_keys):done]:
            self._loss += value.detach().double().sum()
        if self._train:
            self._saved[(stage, microbatch)] = (list(outs[done:]), {})
        if stage == self.last_stage:
            return
        message = {k: produced[k] if k in produced else received[k]
                   for k in self.layout.messages[stage]}
        self._deliver("F", stage + 1, microbatch, message)

    def _forward(self, stage: int, microbatch: int) -> None:
        program = self.stages[stage]
        run = program.forward if self._train or program.inference is None else program.inference
        outs = run(*self.forward_args(stage, microbatch))
        self.forward_results(stage, microbatch, tuple(outs))

    def _deliver(self, kind: str, stage: int, microbatch: int,
                 message: dict[str, torch.Tensor]) -> None:
        """Give ``message`` to ``stage`` (forward, ``kind="F"``; backward, ``"B"``)."""
        rank = self.layout.schedule.rank_of(stage, microbatch)
        inbox = self._inbox_f if kind == "F" else self._inbox_b
        if rank == self.layout.position:
            inbox[(stage, microbatch)] = message
        else:
            self._outbox[(kind, stage, microbatch)] = list(message.values())

    def backward_args(self, stage: int, microbatch: int) -> list[Any]:
        """The backward graph's arguments: saved tensors then tangents."""
        program = self.stages[stage]
        saved, _ = self._saved.pop((stage, microbatch))
        grads_in = self._inbox_b.get((stage, microbatch), {})
        tangents = []
        for i in program.tangent_outputs:
            if i < len(program.out_keys):
                tangents.append(grads_in[program.out_keys[i]])
            else:  # d(numerator): the step scales every gradient by 1 / denominator at the end
                tangents.append(torch.ones((), dtype=torch.float32, device=self._device()))
        return saved + tangents

    def backward_results(self, stage: int, microbatch: int, grads: tuple) -> None:
        """Accumulate parameter gradients; send the input gradients upstream."""
        program = self.stages[stage]
        n_params = len(program.param_inputs)
        if grads is not None:
            self._accumulate(program, grads[:n_params])
        input_grads = grads[n_params + len(program.local_inputs):] if grads is not None else ()
        self._send_input_grads(stage, microbatch, input_grads)

    def _send_input_grads(self, stage: int, microbatch: int, input_grads: tuple) -> None:
        program = self.stages[stage]
        downstream = self._inbox_b.pop((stage, microbatch), {})
        if stage == 0:
            return
        own = dict(zip(program.in_keys, input_grads, strict=False))
        message = {}
        for key in self.layout.messages[stage - 1]:
            shape, dtype, requires_grad = self.layout.values[key]
            if not requires_grad:
                continue
            parts = [g for g in (own.get(key), downstream.get(key)) if g is not None]
            total = parts[0] if parts else torch.zeros(shape, dtype=dtype,
                                                       device=self._device())
            for part in parts[1:]:
                total = total + part
            message[key] = total
        self._deliver("B", stage - 1, microbatch, message)

    def _accumulate(self, program: StageProgram, grads: tuple) -> None:
        for index, grad in zip(program.param_inputs, grads, strict=True):
            if grad is None:
                continue
            if index in self._grads:
                self._grads[index].add_(grad)
            else:
                self._grads[index] = grad.clone()

    def _backward(self, stage: int, microbatch: int, split: bool) -> None:
        program = self.stages[stage]
        args = self.backward_args(stage, microbatch)
        if not split:
            self.backward_results(stage, microbatch, tuple(program.backward(*args)))
            return
        outs = tuple(program.input_grad(*args))
        stash = list(outs[program.num_input_grads:])
        self._pending_w[(stage, microbatch)] = stash + [args[j] for j in program.w_inputs]
        inputs = outs[:program.num_input_grads]
        self._send_input_grads(stage, microbatch, inputs[len(program.local_inputs):])

    def _weight(self, stage: int, microbatch: int) -> None:
        program = self.stages[stage]
        grads = program.weight_grad(*self._pending_w.pop((stage, microbatch)))
        self._accumulate(program, tuple(grads))

    def _overlapped(self, action: Action, graph: Callable[..., Any]) -> None:
        f_args = self.forward_args(action.stage, action.microbatch)
        b_args = self.backward_args(action.b_stage, action.b_microbatch)
        outs = tuple(graph(*f_args, *b_args))
        n_fwd = graph.num_forward_outputs
        self.forward_results(action.stage, action.microbatch, outs[:n_fwd])
        self.backward_results(action.b_stage, action.b_microbatch, outs[n_fwd:])

    # -- p2p ------------------------------------------------------------------------------

    def _skipped(self, action: Action) -> bool:
        return not self._train and action.kind in (ActionKind.SEND_B, ActionKind.RECV_B)

    def _post_receives(self, position: int, groups: list[tuple[Action, ...]]) -> None:
        """Post the receives of p2p group ``position`` now (if it is one, and not yet)."""
        if position < len(groups) and groups[position][0].is_p2p:
            self._post_group(position, groups[position])

    def _post_group(self, position: int, group: tuple[Action, ...]) -> None:
        if position in self._posted:
            return
        ranks = self.layout.global_ranks
        posted = []
        for action in group:
            if action.kind not in (ActionKind.RECV_F, ActionKind.RECV_B) or self._skipped(action):
                continue
            forward = action.kind is ActionKind.RECV_F
            keys = list(self.layout.messages[action.stage - 1] if forward
                        else self._grad_keys(action.stage))
            device = self._device()
            tensors = [torch.empty(self.layout.values[k][0], dtype=self.layout.values[k][1],
                                   device=device) for k in keys]
            works = post_receives(tensors, ranks[action.peer])
            inbox = self._inbox_f if forward else self._inbox_b
            posted.append((inbox, (action.stage, action.microbatch), keys, tensors, works))
        self._posted[position] = posted

    def _device(self) -> torch.device:
        """The step's device: its inputs' (the group's device for p2p and collectives)."""
        return self._step_device

    def _p2p(self, position: int, group: tuple[Action, ...]) -> None:
        """Post this group's sends (waited at the end of the step) and wait for its receives,
        posted here or before the previous compute."""
        ranks = self.layout.global_ranks
        for action in group:
            if self._skipped(action):
                continue
            if action.kind is ActionKind.SEND_F:
                tensors = self._outbox.pop(("F", action.stage + 1, action.microbatch))
            elif action.kind is ActionKind.SEND_B:
                tensors = self._outbox.pop(("B", action.stage - 1, action.microbatch))
            else:
                continue
            tensors = [t.contiguous() for t in tensors]
            self._sends.extend(zip(post_sends(tensors, ranks[action.peer]), tensors,
                                   strict=True))
        self._post_group(position, group)
        # The values land in the inboxes now; a compute that reads one waits for it first.
        for inbox, key, names, tensors, works in self._posted.pop(position, []):
            inbox[key] = dict(zip(names, tensors, strict=True))
            if works:
                self._arriving[("F" if inbox is self._inbox_f else "B", *key)] = works

    def _await_messages(self, action: Action) -> None:
        """Wait for the receives ``action`` reads: its forward input, its output gradients."""
        for part in action.parts():
            if part.kind is ActionKind.F:
                needed = ("F", part.stage, part.microbatch)
            elif part.kind in (ActionKind.B, ActionKind.I):
                needed = ("B", part.stage, part.microbatch)
            else:
                continue
            for work in self._arriving.pop(needed, ()):
                work.wait()

    def _grad_keys(self, stage: int) -> list[str]:
        """Keys of the backward message that ``stage`` receives (gradients of its outputs)."""
        return [k for k in self.layout.messages[stage] if self.layout.values[k][2]]
