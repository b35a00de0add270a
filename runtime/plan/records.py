"""Immutable records that make up a Plan: graphs, nodes' costs, parameters, kernels, passes.

Every record is a frozen dataclass of plain values (str, int, float, bool, tuples of those or
of other records) so that a Plan round-trips through JSON exactly.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """Cost of one graph node, computed from its fake-tensor metadata."""

    name: str
    target: str
    flops: int
    bytes: int
    # The call as ``zeroc.runtime.cost.op_timing.encode_call`` gives it ("" when it cannot be
    # rebuilt): what the step estimate times on the machine at hand.
    call: str = ""


@dataclasses.dataclass(frozen=True)
class GraphInfo:
    """One compiled functional graph (a forward, backward or inference graph)."""

    name: str
    kind: str
    nodes: int
    inputs: int
    outputs: int
    flops: int
    bytes: int
    peak_bytes: int
    node_costs: tuple[NodeCost, ...]
    code: str


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A model parameter as the compiled graph sees it.

    ``shape``, ``numel`` and ``bytes`` are the tensor the graph reads: for a parallelized
    model its flat buffer (ZeRO-2/3: this rank's padded shard). ``full_shape`` is the
    parameter's shape as the model defines it when that differs (``()``: the same as
    ``shape``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    bytes: int
    full_shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class KernelInfo:
    """A generated kernel: which graph node it replaces and how it runs.

    ``backend`` is ``"triton"`` when the generated Triton source is launched, ``"aten"`` when
    the fused group runs through the original aten ops (no Triton available for the device).
    ``inductor`` when Inductor generated it (``kernels="inductor"``). ``block`` lists the launch
    parameters (name, value): the ones launched once the kernel has run (autotuned with
    ``kernel_autotune``), empty for a group that runs as aten ops and for Inductor's kernels.
    """

    name: str
    graph: str
    backend: str
    kind: str
    ops: tuple[str, ...]
    numel: int
    source: str
    source_hash: str
    block: tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class PassInfo:
    """What one pass did to one graph; ``before``/``after`` are the graph texts."""

    pass_name: str
    graph: str
    changed: bool
    nodes_before: int
    nodes_after: int
    before: str
    after: str
    stats: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class StageInfo:
    """A pipeline stage: the modules it holds and what it costs."""

    index: int
    modules: tuple[str, ...]
    params: int
    param_bytes: int
    flops: int
    activation_bytes: int
    # The parameters the stage reads (pipelines; a tied parameter under its first name).
    param_names: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
    """A collective in a compiled graph (bucket of parameters, bytes, issue and wait points)."""

    name: str
    graph: str
    op: str
    group: str
    params: tuple[str, ...]
    bytes: int
    issued_at: str
    waited_at: str
    dtype: str = ""  # the dtype it moves (mixed precision: bf16 gathers, fp32 reductions)
    # The mesh dimension whose process group runs it ("dp", "pp"; "" when not known):
    # ``group`` is that process group's registered name.
    mesh_dim: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes on one rank."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    moved: int = 0  # bytes this rank moves in collectives per training step (ZeRO accounting)
    host: int = 0  # optimizer offload: master rows, gradients and optimizer state on the host


@dataclasses.dataclass(frozen=True)
class PipelineInfo:
    """A pipelined model's schedule, as planned and as it last ran.

    ``actions[r]`` lists rank ``r``'s compute actions (``str(Action)``); ``grid`` is the
    schedule drawn from the cost model's simulation; ``bubble_ratios`` and
    ``peak_activations`` (micro-batches held) / ``peak_activation_bytes`` are per rank.
    ``event_labels``/``event_times`` are the last measured step: per rank, every action
    group's label and its (start, end) wall-clock seconds (empty before the first step).
    ``stage_costs`` (one ``(F, B, W)`` per stage), ``grid_time_unit`` and ``grid_legend`` are
    what ``grid`` was drawn with, so ``Plan.schedule_grid`` can draw it again for other ranks
    or another width (empty / 0 in a plan made without them).
    """

    schedule: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    placement: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[str, ...], ...]
    grid: str
    bubble_ratios: tuple[float, ...]
    measured_bubble_ratios: tuple[float, ...]
    peak_activations: tuple[int, ...]
    peak_activation_bytes: tuple[int, ...]
    event_labels: tuple[tuple[str, ...], ...]
    event_times: tuple[tuple[tuple[float, float], ...], ...]
    # Per rank, ms of the last step spent waiting in p2p (empty before the first step).
    measured_p2p_wait_ms: tuple[float, ...] = ()
    # Per rank and action group, seconds the group waited for receives before it started.
    event_waits: tuple[tuple[float, ...], ...] = ()
    # The simulation behind ``grid``: per stage (F, B, W), one column's duration, the legend.
    stage_costs: tuple[tuple[float, float, float], ...] = ()
    grid_time_unit: float = 0.0
    grid_legend: str = ""
    # Bytes each micro-batch sends from stage s to stage s + 1 (activations; gradients back).
    message_bytes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """A planned job's step time on a hardware profile (``zeroc.world.step_estimate``), seconds."""

    hardware: str
    dtype: str
    step_s: float
    compute_s: float
    exposed_communication_s: float
    optimizer_s: float
    bubble: float
    # Seconds per call of each compiled graph (its roofline), and the slowest rank's step by
    # action kind (F, B, I, W, F&B, p2p, forward/backward graphs, collectives, optimizer).
    graphs: tuple[tuple[str, float], ...] = ()
    kinds: tuple[tuple[str, float], ...] = ()
