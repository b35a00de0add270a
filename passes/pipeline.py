"""The literal pass pipelines, in the order they run.

Each entry is a function ``(gm, ctx) -> PassResult`` from its own file. ``run_passes`` in
``base.py`` lints the graph and records it before and after every pass.
"""

from __future__ import annotations

from zeroc.passes.dead_code import eliminate_dead_code
from zeroc.passes.fusion import fusion
from zeroc.passes.noop_views import remove_noop_views

# Per functional graph (forward, backward or inference) on one device.
SINGLE_DEVICE_PASSES = (
    remove_noop_views,
    eliminate_dead_code,
    fusion,
)
