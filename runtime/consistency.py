"""Every rank of a group must compile graphs that issue the same collectives: checked through
the job's store, never with a collective of the group.

A rank that compiled a different graph (other options, other code) would issue other
collectives and hang the job. The text compared is what the ranks must agree on. A graph that
issues its own collectives (pp = 1) is compared by ``collective_text``: its collectives in
order, with their groups, shapes and dtypes. Ranks whose batches differ in size (an uneven
last batch, evaluation on each rank's own part of a data set) compile graphs that differ only
in activation shapes, and Dynamo may make one rank's sizes symbolic and another's static;
their collectives, on parameters and gradients, are the same, and so is the check. A
pipeline stage graph issues no collective (the executor does) and is compared whole.

Why the store and not a collective: Dynamo decides per rank when to compile. A rank whose
batch size matches a graph it compiled before reuses it while another rank, whose size
changed, compiles; a collective in the compiling rank's check would then meet the other
rank's training collective (gloo aborts on the size mismatch, NCCL hangs or corrupts). So
each rank publishes, in the job's c10d store, every collective text it compiled (under its
digest) and waits until every rank of the group has published the same digest: a rank that
reuses a graph published it when it compiled that graph, so the wait ends at once. Two ranks
each waiting for a digest the other never published are stuck: both raise
``PlanMismatchError`` at once, naming the first differing line of each one's text. A rank
that waits ``WAIT_S`` for a peer that is not waiting raises the same way, with the peer's
last published text.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
import torch.distributed as dist

from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.torch_compat import default_store


class PlanMismatchError(RuntimeError):
    """Ranks of one group compiled different graphs."""


# How long a rank waits for its group to compile (or to have compiled) the same collectives.
WAIT_S = float(os.environ.get("ZEROC_COMPILE_WAIT_S", "1800"))


_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d"})


def _issues_collective(target: object) -> bool:
    """Whether ``target`` communicates: a c10d (functional) op, or an op taking a group."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    if getattr(target, "namespace", None) in _COLLECTIVE_NAMESPACES:
        return True
    return any(arg.name == "group_name" for arg in schema.arguments)


def _describe(value: object) -> str:
    if isinstance(value, torch.fx.Node):
        meta = value.meta.get("val")
        if isinstance(meta, torch.Tensor):
            dtype = str(meta.dtype).removeprefix("torch.")
            return f"{dtype}[{', '.join(str(s) for s in meta.shape)}]"
        return f"<{type(meta).__name__}>"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)


def collective_text(graph: torch.fx.GraphModule) -> str:
    """``graph``'s collectives in order, one line each: the op, then its arguments (tensors as
    dtype and shape, everything else as written)."""
    lines = []
    for node in graph.graph.nodes:
        if node.op == "call_function" and _issues_collective(node.target):
            args = [_describe(a) for a in node.args]
            args += [f"{k}={_describe(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{node.target}({', '.join(args)})")
    return "\n".join(lines)


def text_digest(text: str) -> str:
    """A short, stable hash of a graph's text."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_same_graph(name: str, text: str, group_name: str,
                     device: torch.device | None = None) -> str:
    """Publish ``text`` for this rank and wait until every rank of the group has published the
    same text (now or earlier); raise ``PlanMismatchError`` on every stuck rank otherwise.

    Returns the digest. Without a group (``""``), a process group or a store, nothing is
    compared. ``device`` is accepted for the callers' symmetry; nothing goes to a device."""
    digest = text_digest(text)
    group = resolve_group(group_name)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return digest
    store = default_store()
    if store is None:
        return digest
    _Exchange(store, f"zeroc/graphs/{group_name}", dist.get_rank(),
              dist.get_process_group_ranks(group)).agree(name, text, digest)
    return digest


class _Exchange:
    """One rank's side of the store-based agreement for one group."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, ranks: list[int]) -> None:
        self.store, self.prefix, self.rank, self.ranks = store, prefix, rank, ranks

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def agree(self, name: str, text: str, digest: str) -> None:
        self.store.set(self._key("text", digest), text)
        self.store.set(self._key("has", digest, self.rank), name)
        self.store.set(self._key("last", self.rank), digest)
        self.store.set(self._key("waiting", self.rank), digest)
        deadline, pause = time.monotonic() + WAIT_S, 0.002
        while True:
            missing = [r for r in self.ranks if r != self.rank
                       and not self.store.check([self._key("has", digest, r)])]
            if not missing:
                # Done. A rank that raises keeps its key, so that a stuck peer sees it too.
                self.store.set(self._key("waiting", self.rank), "")
                return
            for peer in missing:
                theirs = self._get(self._key("waiting", peer))
                # Both wait for what the other never compiled: neither can go on.
                if theirs and theirs != digest and not self.store.check(
                        [self._key("has", theirs, self.rank)]):
                    self._raise(name, text, peer, theirs, "")
            if time.monotonic() > deadline:
                peer = missing[0]
                self._raise(name, text, peer, self._get(self._key("last", peer)),
                            f" (rank {peer} compiled no graph with this rank's "
                            f"collectives within {WAIT_S:.0f} s)")
            time.sleep(pause)
            pause = min(0.05, pause * 2)

    def _raise(self, name: str, text: str, peer: int, theirs: str | None, why: str) -> None:
        other = self._get(self._key("text", theirs)) if theirs else None
        mine_lines = text.splitlines()
        their_lines = (other or "").splitlines()
        index = next((i for i, (a, b) in enumerate(zip(mine_lines, their_lines, strict=False))
                      if a != b), min(len(mine_lines), len(their_lines)))

        def line(lines: list[str]) -> str:
            return repr(lines[index].strip()) if index < len(lines) else "<end of text>"

        theirs_text = line(their_lines) if other is not None else "<nothing published>"
        raise PlanMismatchError(
            f"zeroc: ranks compiled different plans for {name}: rank {self.rank} and rank "
            f"{peer} differ{why}; first difference at line {index + 1} of the compared text "
            f"(rank {self.rank} has {line(mine_lines)}; rank {peer} has {theirs_text}). "
            "Every rank must run the same model code and options."
        )
