"""Run one rank's part of a pipeline schedule: stage graphs, micro-batches, p2p, gradients.

A ``StageProgram`` holds a stage's compiled functional graphs (DESIGN.md §4.1):
``forward(params..., locals..., received...) -> (sent..., model outputs..., saved...)``,
``backward(saved..., tangents...) -> gradients in input order``, and the same backward split
into ``input_grad`` (I) and ``weight_grad`` (W). ``PipelineExecutor.run`` walks this rank's
lowered action list once per step: ``F``/``B``/``I``/``W``/``FB`` call the graphs and keep the
saved tensors per (stage, micro-batch) itself (no autograd tape), p2p groups move messages
(``runtime/pipeline/messages.py``); the step ends with one all-gather of loss shares, timings
and batch digests (``runtime/pipeline/sync.py``). What is the same every step (each group's
transfers and waits, profiler names, timing labels) is worked out once, in ``__init__``.

Messages. ``messages[s]`` names the values stage ``s`` hands to stage ``s + 1`` (its own
outputs and values passing through it to later stages); the backward message of stage ``s``
carries the gradients of ``messages[s - 1]``'s values that require one. A pass-through value's
gradient is what came from downstream plus what the stage's own use of it contributed.

Gradients. The last stage returns micro-batch loss numerators (``passes/front/loss_normalization.
py``); each gets the tangent ``1 / denominator`` of this replica's batch, so every gradient is
this replica's own before any data-parallel average (in the graphs with ``pp_reshard=True``,
else ``StepZero.reduce``): the gradient of the replicas' mean loss, as in DDP. Parameter
gradients accumulate over micro-batches and are then summed over the pipeline positions holding
the same parameter (``p2p.exchange_and_sum``). A micro-batch's first gradient of a parameter is
kept as the graph returned it when it is a fresh tensor, else copied. The step's all-gather
gives every rank its replica's loss (a device tensor) and, read when the next call ends, every
rank's action timings (the measured timeline) and batch digests: on a GPU the host waits there
only while the device still runs the previous call (``runtime/pipeline/sync.py``).

Failures (``runtime/pipeline/abort.py``). A call takes the model's next step number, which
the step's batch check compares across the ranks; a step that raises reports itself in the
job's store, and a blocking wait ends, raising, when a peer's step failed.

Profiling. While a ``torch.profiler`` records (checked once per step), the step runs inside
``record_function("zeroc/pipeline_step")``, each action group inside ``zeroc/<group label>``
(``zeroc/F0@s1``, ``zeroc/SEND_F0@s0->r1``; a compute's wait for its messages is inside its
action), the end-of-step exchanges inside ``zeroc/step_sync`` and ``zeroc/step_grad_exchange``
and the per-step ZeRO buckets as ``runtime/pipeline/zero.py`` names them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from zeroc.runtime.actions import Action, ActionKind, p2p_groups
from zeroc.runtime.executor import PROFILE_PREFIX, profiling, record
from zeroc.runtime.pipeline.abort import AbortWatch, StepCounter
from zeroc.runtime.pipeline.inputs import check_same_shapes
from zeroc.runtime.pipeline.messages import GroupPlan, StepMessages, plan_groups
from zeroc.runtime.pipeline.outputs import EvaluationOutputs
from zeroc.runtime.pipeline.p2p import exchange_and_sum, owns_storage, storage_counts
from zeroc.runtime.pipeline.sync import StepSync, StepTimings, group_label, read_rows
from zeroc.runtime.pipeline.zero import StepZero, zero_order
from zeroc.runtime.program import PipelineLayout, Program, StageProgram
from zeroc.runtime.step_clock import StepClock
from zeroc.runtime.step_memory import tracking_scope
from zeroc.runtime.world import PlannedWorld, stage_runner

__all__ = ["PP_SOURCE_ATTR", "PipelineExecutor", "PipelineLayout", "StageProgram", "StepTimings"]

log = logging.getLogger(__name__)

# Set on every parameter of a compiled pipeline: the first pipeline position that updates it.
PP_SOURCE_ATTR = "_zeroc_pp_source"
_STEP, _SYNC, _EXCHANGE = (PROFILE_PREFIX + n for n in (
    "pipeline_step", "step_sync", "step_grad_exchange"))


class PipelineExecutor:
    """Runs this rank's actions of a pipeline step; see the module docstring."""

    def __init__(self, program: Program, planned: PlannedWorld | None = None) -> None:
        if program.pipeline is None:
            raise ValueError(f"program {program.name} has no pipeline layout (pp = 1 runs "
                             "its graphs through AOTAutograd, not a pipeline executor)")
        self.program = program  # frozen: what this executor runs
        # How stage graphs run, chosen once: replayed in a planned world, called otherwise.
        self._runner = stage_runner(planned)
        self.layout: PipelineLayout = program.pipeline
        layout, stages = self.layout, program.stage_map()
        self.stages, self.last_stage = stages, layout.schedule.num_stages - 1
        self.steps = 0
        self.counter = StepCounter()  # the model's calls: pipeline_capture shares one per model
        self.abort = AbortWatch(planned is None, (layout.group_name, *sorted(
            {h.group_name for h in layout.hoisted.values() if h.group_name})))
        self._clock: StepClock | None = None  # made at the first step, on its device
        self.groups = {
            train: [p2p_groups(rank_actions) for rank_actions in schedule.actions]
            for train, schedule in ((True, layout.schedule), (False, layout.forward_schedule))
        }
        # Made once (module docstring): profiler names, message plans, the closing all-gather.
        position = layout.position
        stage_params = {s: p.param_inputs for s, p in stages.items()}
        self.zero = StepZero(
            layout.hoisted,
            {train: zero_order(tuple(groups[position]), stage_params, layout.hoisted)
             for train, groups in self.groups.items()},
            layout.bucket_mb, layout.prefetch, layout.gather_quant,
            layout.reduce_quant) if layout.hoisted else None
        self.profile_names = {
            train: tuple(PROFILE_PREFIX + group_label(g) for g in groups[position])
            for train, groups in self.groups.items()
        }
        self.plans = {train: plan_groups(groups[position], train, layout.messages,
                                         layout.values, layout.global_ranks)
                      for train, groups in self.groups.items()}
        self.sync = StepSync(self.groups, layout)
        self.messages = StepMessages()
        schedule = layout.schedule
        self._rank_of = {(s, m): schedule.rank_of(s, m) for s in range(schedule.num_stages)
                         for m in range(schedule.num_microbatches)}
        self._param_inputs = tuple(dict.fromkeys(  # this rank's: each gets a gradient
            i for p in stages.values() for i in p.param_inputs))
        self.evaluation = EvaluationOutputs(
            layout.outputs, schedule, layout.microbatch, position, layout.global_ranks,
            layout.group_name) if layout.outputs else None
        self.outputs: tuple[torch.Tensor, ...] = ()  # the latest evaluation step's
        log.debug("zeroc: pipeline position %d runs stages %s: %d action groups per step",
                  position, sorted(stages), len(self.groups[True][position]))

    @property
    def timings(self) -> StepTimings | None:
        """Every rank's action timings of the latest timed step (``runtime/pipeline/sync``):
        reads the rows not read yet, waiting for the device if need be (the plan asks)."""
        read_rows(wait=True, when="the last call")
        return self.sync.timings

    def run(self, inputs: list[Any], train: bool,
            reduce: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the step on the model's flat inputs; return (mean loss, parameter gradients).
        ``reduce=False``: this rank's own gradients, hoisted ones in full; ``reduce_gradients``
        of their sum (no-sync accumulation) gives what ``reduce=True`` returns. The step is
        numbered, checked against the other ranks' and reported when it fails
        (``runtime/pipeline/abort``)."""
        step, layout = self.counter.next(), self.layout
        with record(_STEP), self.abort.active(step):
            check_same_shapes(inputs, self.sync.batch_inputs, layout.input_names,
                              layout.host_group_name, layout.global_ranks, step, train)
            try:
                loss, grads = self._run_step(inputs, train, reduce)
            except BaseException as error:
                self.abort.report(error)
                raise
        if self.steps == 0:
            log.debug("zeroc: pipeline position %d ran its first %s step", self.layout.position,
                      "training" if train else "forward-only")
        self.steps += 1
        return loss, grads

    def _run_step(self, inputs: list[Any], train: bool,
                  reduce: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        self._inputs, self._train = inputs, train
        self._saved: dict[tuple[int, int], list[Any]] = {}
        self._pending_w: dict[tuple[int, int], list[Any]] = {}
        self._grads: dict[int, torch.Tensor] = {}
        tensor = next((v for v in inputs if isinstance(v, torch.Tensor)), None)
        self._step_device = device = tensor.device if tensor is not None else torch.device("cpu")
        self.abort.device = device
        self._loss = torch.zeros((), dtype=torch.float64, device=device)
        self._scale = self.sync.loss_scale(inputs, device)
        if self.zero is not None:  # the first gathers are issued now (prefetch)
            self.zero.begin(inputs, train)
        self.messages.begin(device)
        self._inbox_f, self._inbox_b = self.messages.inbox["F"], self.messages.inbox["B"]
        my_groups = self.groups[train][self.layout.position]
        plans = self.plans[train]
        if self._clock is None:
            self._clock = StepClock(device, self._runner.simulated)
        clock = self._clock
        marks: list[Any] = []  # per group: start, compute start (after waiting), end
        names = self.profile_names[train] if profiling() else None
        with torch.no_grad(), tracking_scope():
            # A stage's gradient reductions are issued as soon as they are complete.
            early_reduce = self.zero is not None and train and reduce
            for position, group in enumerate(my_groups):
                if names is None:
                    self._run_group(position, group, plans, clock, marks)
                else:
                    with record(names[position]):
                        self._run_group(position, group, plans, clock, marks)
                if early_reduce:
                    self.zero.reduce_ready(position, self._grads, inputs)
            self.messages.end()
            clock.step_done(marks, train)
            if self.evaluation is not None and not train:
                self.outputs = self.evaluation.finish(device)
            with record(_SYNC):
                loss = self.sync.finish(self._loss, clock, train, inputs, self._scale)
            grads = self._grads
            if train and reduce:  # once per step, after the last backward
                grads = self.reduce_gradients(grads, inputs)
            if self.zero is not None:
                self.zero.end()
            if train:
                # Bucket views stay referenced: autograd copies them out and frees the bucket.
                addresses = [g.untyped_storage()._cdata for g in grads.values()]
                self._grads = grads if reduce and len(set(addresses)) < len(addresses) else {}
        self._saved, self._pending_w = {}, {}
        return loss, grads

    def reduce_gradients(self, grads: dict[int, torch.Tensor],
                         inputs: list[Any]) -> dict[int, torch.Tensor]:
        """``grads`` reduced over dp (hoisted ones, per bucket), zero where a parameter got none,
        summed over the positions holding one parameter (linear in ``grads``)."""
        with self.abort.active(self.abort.step):  # a no-sync flush runs outside ``run``
            if self.zero is not None:
                self.zero.reduce(grads, inputs)
            for index in self._param_inputs:
                if index not in grads:
                    grads[index] = torch.zeros_like(inputs[index])
            with record(_EXCHANGE):
                return exchange_and_sum(grads, self.layout.holders, self.layout.position,
                                        self.layout.global_ranks)

    def _run_group(self, position: int, group: tuple[Action, ...],
                   plans: tuple[GroupPlan, ...], clock: StepClock, marks: list[Any]) -> None:
        """Run one action group, appending its start, compute-start and end marks."""
        plan = plans[position]
        start = clock.mark()
        marks.append(start)
        if plan.p2p:
            self.messages.exchange(plan)
            marks.append(start)
        else:  # this compute waits only for the messages it reads
            self.messages.await_inputs(plan)
            marks.append(clock.mark())
            self._compute(group[0])
        marks.append(clock.mark())

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
        losses = len(program.out_keys) + int(program.num_model_outputs > 0 and self.layout.has_loss)
        for value in outs[len(program.out_keys):losses]:
            self._loss += value.detach().double().sum()
            self._loss_dtype = value.dtype  # the backward's seed is of the loss's dtype
        if self.evaluation is not None and losses < done:  # after the loss: per-sample ones
            self.evaluation.add(microbatch, tuple(outs[losses:done]))
        if self._train:
            self._saved[(stage, microbatch)] = list(outs[done:])
        if stage == self.last_stage:
            return
        message = {k: produced[k] if k in produced else received[k]
                   for k in self.layout.messages[stage]}
        self._deliver("F", stage + 1, microbatch, message)

    def _forward(self, stage: int, microbatch: int) -> None:
        program = self.stages[stage]
        run = program.forward if self._train or program.inference is None else program.inference
        outs = self._runner.call(run, *self.forward_args(stage, microbatch))
        self.forward_results(stage, microbatch, tuple(outs))

    def _deliver(self, kind: str, stage: int, microbatch: int,
                 message: dict[str, torch.Tensor]) -> None:
        """Give ``message`` to ``stage`` (forward, ``kind="F"``; backward, ``"B"``)."""
        local = self._rank_of[(stage, microbatch)] == self.layout.position
        self.messages.deliver(kind, stage, microbatch, message, local)

    def backward_args(self, stage: int, microbatch: int) -> list[Any]:
        """The backward graph's arguments: saved tensors then tangents."""
        program = self.stages[stage]
        saved = self._saved.pop((stage, microbatch))
        grads_in = self._inbox_b.get((stage, microbatch), {})
        tangents = []
        for i in program.tangent_outputs:
            if i < len(program.out_keys):
                tangents.append(grads_in[program.out_keys[i]])
            else:  # 1 / this replica's denominator, before any dp average (module docstring)
                tangents.append(self._scale.tangent(self._step_device).to(self._loss_dtype))
        return saved + tangents

    def backward_results(self, stage: int, microbatch: int, grads: tuple,
                         call: tuple[Any, ...] = ()) -> None:
        """Accumulate parameter gradients; send the input gradients upstream. ``call``: the
        graph's arguments and outputs (a gradient aliasing none of them is kept uncopied)."""
        program = self.stages[stage]
        n_params = len(program.param_inputs)
        if grads is not None:
            self._accumulate(program, grads[:n_params], call)
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
                                                       device=self._step_device)
            for part in parts[1:]:
                total = total + part
            message[key] = total
        self._deliver("B", stage - 1, microbatch, message)

    def _accumulate(self, program: StageProgram, grads: tuple, call: tuple[Any, ...]) -> None:
        """Sum ``grads`` into the step's gradients. A micro-batch's first gradient is kept as
        it is when it is the graph's own fresh tensor (no view, sharing storage with no other
        argument or output of ``call``), else copied, since it is added to in place."""
        storages = None
        for index, grad in zip(program.param_inputs, grads, strict=True):
            if grad is None:
                continue
            held = self._grads.get(index)
            if held is not None:
                if not self._runner.adds_nothing(held, grad):
                    held.add_(grad)
                continue
            if storages is None:
                storages = storage_counts(call)
            self._grads[index] = grad if owns_storage(grad, storages) else grad.clone()

    def _backward(self, stage: int, microbatch: int, split: bool) -> None:
        program = self.stages[stage]
        args = self.backward_args(stage, microbatch)
        if not split:
            outs = tuple(self._runner.call(program.backward, *args))
            self.backward_results(stage, microbatch, outs, (*args, *outs))
            return
        outs = tuple(self._runner.call(program.input_grad, *args))
        split_at = program.num_input_grads  # input gradients, then what W needs
        self._pending_w[(stage, microbatch)] = [*outs[split_at:],
                                                *(args[j] for j in program.w_inputs)]
        self._send_input_grads(stage, microbatch, outs[len(program.local_inputs):split_at])

    def _weight(self, stage: int, microbatch: int) -> None:
        program = self.stages[stage]
        args = self._pending_w.pop((stage, microbatch))
        grads = tuple(self._runner.call(program.weight_grad, *args))
        self._accumulate(program, grads, (*args, *grads))

    def _overlapped(self, action: Action, graph: Callable[..., Any]) -> None:
        f_args = self.forward_args(action.stage, action.microbatch)
        b_args = self.backward_args(action.b_stage, action.b_microbatch)
        outs = tuple(self._runner.call(graph, *f_args, *b_args))
        n_fwd = graph.num_forward_outputs
        self.forward_results(action.stage, action.microbatch, outs[:n_fwd])
        self.backward_results(action.b_stage, action.b_microbatch, outs[n_fwd:],
                              (*f_args, *b_args, *outs))

