"""Chrome/Perfetto trace of a measured pipeline step (or of a planned one): one track per rank.

The trace is the JSON "Trace Event Format" that ``chrome://tracing`` and ui.perfetto.dev read:
every action group of every rank becomes a complete event (``"ph": "X"``) on the track
(``tid``) of its rank, with times in microseconds from the earliest start of the step. Compute
actions are named by their action (``F3@s1``, ``F4@s0&B0@s3``), p2p groups by their transfers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from zeroc.runtime.plan.records import PipelineInfo


def _category(label: str) -> str:
    if "&" in label:
        return "F&B"
    head = label.split("@", 1)[0].rstrip("0123456789")
    # A p2p group's span is the time it took to post its transfers.
    return "p2p" if head.startswith(("SEND", "RECV")) else head


def trace_events(info: PipelineInfo) -> list[dict[str, Any]]:
    """The trace events of ``info``'s last measured step (empty when it never ran)."""
    starts = [t[0] for rank in info.event_times for t in rank]
    if not starts:
        return []
    waited = [t[0] - w for rank, rank_waits in zip(info.event_times, info.event_waits,
                                                     strict=False)
              for t, w in zip(rank, rank_waits, strict=True)]
    origin = min(starts + waited)
    events: list[dict[str, Any]] = []
    for rank, (labels, times) in enumerate(zip(info.event_labels, info.event_times,
                                               strict=True)):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        waits = info.event_waits[rank] if info.event_waits else (0.0,) * len(labels)
        for label, (start, end), wait in zip(labels, times, waits, strict=True):
            if wait > 0:  # waiting for the receives this group reads, right before it
                events.append({
                    "name": f"wait for {label}", "cat": "p2p wait", "ph": "X", "pid": 0,
                    "tid": rank, "ts": round((start - wait - origin) * 1e6, 3),
                    "dur": round(wait * 1e6, 3)})
            events.append({
                "name": label, "cat": _category(label), "ph": "X", "pid": 0, "tid": rank,
                "ts": round((start - origin) * 1e6, 3),
                "dur": round(max(end - start, 0.0) * 1e6, 3),
            })
    return events


def write_chrome_trace(info: PipelineInfo, path: str) -> str:
    """Write ``info``'s measured step to ``path`` as Chrome trace JSON; return ``path``."""
    events = trace_events(info)
    if not events:
        raise ValueError("chrome_trace: the pipeline has not run a step yet; call the compiled "
                         "model once, then explain it again")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"schedule": info.schedule,
                                 "microbatches": info.num_microbatches,
                                 "p2p_wait_ms_per_rank": list(info.measured_p2p_wait_ms)}},
                  handle)
    return path


def write_planned_trace(info: PipelineInfo, path: str) -> str:
    """Write the schedule as the plan models it (simulated with the plan's stage costs; one
    cost unit is drawn as one millisecond) to ``path``; return ``path``. For plans whose
    step never ran on real devices (``zeroc.explain(world=...)``)."""
    from zeroc.runtime.cost.simulate import ActionCosts, simulate
    from zeroc.runtime.plan.schedule_grid import info_schedule

    costs = ActionCosts(stages=info.stage_costs) if info.stage_costs else ActionCosts()
    timeline = simulate(info_schedule(info), costs)
    planned = dataclasses.replace(
        info,
        event_labels=tuple(tuple(str(t.action) for t in rank) for rank in timeline.ranks),
        event_times=tuple(tuple((t.start / 1000, t.end / 1000) for t in rank)
                          for rank in timeline.ranks),
        event_waits=(), measured_p2p_wait_ms=())
    return write_chrome_trace(planned, path)
