"""The ``zeroc`` torch.compile backend.

Registered only through the ``torch_dynamo_backends`` entry point (see pyproject.toml), so
``torch.compile(model, backend="zeroc")`` works without ``import zeroc``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.fx

from zeroc.capture import compile_dynamo_graph
from zeroc.config import Config
from zeroc.errors import OptionError, passthrough
from zeroc.pipeline_capture import PipelineError, compile_pipeline, pipeline_layout_of
from zeroc.runtime.consistency import PlanMismatchError
from zeroc.runtime.shutdown import drop_captured_groups
from zeroc.session import find_compile_wrapper, session_for


def zeroc_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Compile one Dynamo graph with zeroc.

    ``mode`` and ``options`` are what the user passed to ``torch.compile``; they are
    validated into one frozen :class:`zeroc.config.Config` (``ValueError`` on bad input).
    """
    # torch.compile imported torch._dynamo (and with it torch.distributed.nn) just now, maybe
    # after init_process_group: do not let those imports keep the default group alive.
    drop_captured_groups()
    try:
        config = Config.build(mode, options)
        session = session_for(find_compile_wrapper(), config)
        layout = pipeline_layout_of(example_inputs)
        if layout is not None:
            return compile_pipeline(gm, example_inputs, config, session, layout)
        return compile_dynamo_graph(gm, example_inputs, config, session)
    except (OptionError, PipelineError, PlanMismatchError) as error:
        raise passthrough(error) from None
