"""What the pipeline front's passes read and publish: ``FrontContext``.

The pipeline front (``zeroc.pipeline.pipeline_front``) runs its passes with ``run_passes`` on
two graphs: ``<prefix>.front``, the Dynamo graph at the call's sizes, and
``<prefix>.microbatch``, the graph whose stages the pipeline compiles. A ``FrontContext`` is
the ``PassContext`` of one of them. The front fills in what the passes read (the call's
inputs, which of them are parameters and batch inputs, the sizes), and each pass publishes
what it found beside the graph it returns:

- ``specialize`` / ``specialize_outputs`` (``zeroc.passes.front.specialize_shapes``) read
  ``inputs`` and ``costs``;
- ``keep_loss_output`` (``zeroc.passes.front.loss_output``) reads ``evaluation``, ``kept_outputs``,
  ``batch_inputs`` and ``traced_batch``, publishes ``loss_output``;
- ``normalize_loss`` (``zeroc.passes.front.loss_normalization``) publishes ``normalization``;
- ``hoist_unshards`` (``zeroc.passes.front.hoist_unshard``) reads ``names``, publishes ``hoisted``;
- ``microbatch_graph`` (``zeroc.passes.front.microbatch_shapes``) reads ``fake_inputs``,
  ``batch_inputs``, ``traced_batch`` and ``microbatch``, publishes ``mgraph``;
- ``split_stages`` (``zeroc.passes.front.split_stages``) reads ``num_stages``, publishes ``split``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from zeroc.passes.base import PassContext

if TYPE_CHECKING:
    from zeroc.passes.front.loss_normalization import LossNormalization
    from zeroc.passes.front.loss_output import LossOutput
    from zeroc.passes.front.microbatch_shapes import MicrobatchGraph
    from zeroc.passes.front.split_stages import StageSplit
    from zeroc.runtime.pipeline.zero import HoistedParam

__all__ = ["FrontContext", "PassOrderError", "front_context", "published"]


@dataclasses.dataclass(kw_only=True)
class FrontContext(PassContext):
    """The ``PassContext`` of one of the pipeline front's graphs (see the module docstring).

    Read by the passes: ``inputs`` the graph inputs a dynamic graph is specialized to (real
    tensors and ints), ``costs`` whether ``specialize`` also costs every node, ``params`` the
    positions of the parameter inputs, ``names`` every input's source name, ``batch_inputs``
    the inputs cut into micro-batches, ``traced_batch`` the batch the graph is at,
    ``microbatch`` the rows of one micro-batch, ``fake_inputs`` the inputs with every hoisted
    parameter a fake full-size one, ``num_stages`` the stages to cut. Published by them:
    ``loss_output``, ``normalization``, ``hoisted``, ``mgraph``, ``split``."""

    inputs: list[Any] = dataclasses.field(default_factory=list)
    costs: bool = False
    params: set[int] = dataclasses.field(default_factory=set)
    names: list[str] = dataclasses.field(default_factory=list)
    batch_inputs: set[int] = dataclasses.field(default_factory=set)
    traced_batch: int = 0
    microbatch: int = 0
    fake_inputs: list[Any] = dataclasses.field(default_factory=list)
    num_stages: int = 0
    loss_output: LossOutput | None = None
    normalization: LossNormalization | None = None
    hoisted: dict[int, HoistedParam] = dataclasses.field(default_factory=dict)
    mgraph: MicrobatchGraph | None = None
    split: StageSplit | None = None
    # An evaluation graph (traced with gradients off) keeps its per-sample outputs; the
    # micro-batch graph keeps those the full-batch graph kept (``kept_outputs``).
    evaluation: bool = False
    kept_outputs: tuple[int, ...] | None = None


def front_context(ctx: PassContext, pass_name: str) -> FrontContext:
    """``ctx`` as a ``FrontContext``; a front pass run with any other context is refused."""
    if not isinstance(ctx, FrontContext):
        raise TypeError(f"pass {pass_name} is a pipeline front pass: it runs with a "
                        f"FrontContext, not a {type(ctx).__name__}")
    return ctx


class PassOrderError(Exception):
    """A front pass ran before the pass that publishes what it reads, or a pass between
    them changed the graph: the front's pass lists are out of order."""


def published(value: Any, what: str, by: str) -> Any:
    """``value``, which the pass ``by`` publishes in the context as ``what``; raises
    ``PassOrderError`` when it has not run yet."""
    if value is None:
        raise PassOrderError(f"zeroc: {what} is published by the pass {by}, which has not "
                             "run on this graph yet")
    return value
