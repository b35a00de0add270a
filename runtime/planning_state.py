"""What the fake world (``zeroc.world.fake_world``) changes while it plans a job on fake tensors.

``PLANNING.skip_init``: ``zeroc.sharding.meta_init`` allocates a meta model's tensors without
running
any initializer (fake tensors have no values, and random initializers need a real device).
``PLANNING.device``: the device ``zeroc.parallelize`` allocates on (a fake ``cuda`` device on a
machine that has none). ``PLANNING.simulated``: the pipeline executor uses no CUDA events
(it times with the host clock) and replays its stage graphs (``zeroc.runtime.fake_replay``);
the values its step computes as a real one does (loss, timings, batch digest) are never read.
Thread-local, set only inside ``zeroc.world.fake_world.fake_world``.

``PLANNING.shared``: while ``zeroc.world.world_plan.plan_world`` plans the positions of one world,
a dict where a position leaves what the next can take as it is (``zeroc.pipeline.pipeline_front``);
``None`` otherwise. ``PLANNING.front_only``: set while ``plan_world`` builds that shared front
before any position is planned; the pipeline compiler then stops once the front is made
(raising ``zeroc.pipeline.pipeline_front.FrontBuilt``) and compiles no stage.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["PLANNING"]


class _Planning(threading.local):
    skip_init = False
    device: torch.device | None = None
    simulated = False
    shared: dict | None = None
    front_only = False


PLANNING = _Planning()
