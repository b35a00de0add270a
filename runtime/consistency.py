"""Every rank of a group must compile the same graph: check it with one collective.

A rank that compiled a different graph (other options, other shapes, other code) would issue
other collectives and hang the job. After compiling, the ranks of a group all-gather, in one
collective, a record of the compiled graph: its digest and a hash per line. On a mismatch every
rank raises, naming the ranks that differ and the first line where their graphs differ.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.torch_compat import all_gather_single, unset_fake_temporarily


class PlanMismatchError(RuntimeError):
    """Ranks of one group compiled different graphs."""


def text_digest(text: str) -> str:
    """A short, stable hash of a graph's text."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_same_graph(name: str, text: str, group_name: str,
                     device: torch.device | None = None) -> str:
    """All-gather the digest of ``text`` over the group; raise on every rank if they differ.

    ``device`` is where the exchanged record lives: the graph's device (an NCCL group has no
    CPU backend); the CPU when not given. Returns the digest. Without a group (``""``) or a
    process group, nothing is compared.
    """
    digest = text_digest(text)
    group = resolve_group(group_name)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return digest
    # Compilation runs under a fake-tensor mode; the exchange needs real tensors.
    with unset_fake_temporarily():
        return _compare(name, text, digest, group, device or torch.device("cpu"))


# Lines whose hashes travel with the digest: enough to name the first difference of any graph
# zeroc compiles in one collective (a longer graph is still compared whole by its digest).
MAX_LINES = 8192


def _record(text: str) -> torch.Tensor:
    """The digest (16 bytes), the line count and one 32-bit hash per line, as int64s."""
    lines = text.splitlines()
    record = torch.zeros(2 + 1 + MAX_LINES, dtype=torch.int64)
    digest = hashlib.sha256(text.encode()).digest()
    record[0] = int.from_bytes(digest[:8], "little", signed=True)
    record[1] = int.from_bytes(digest[8:16], "little", signed=True)
    record[2] = len(lines)
    hashes = [int.from_bytes(hashlib.sha256(line.encode()).digest()[:4], "little")
              for line in lines[:MAX_LINES]]
    record[3:3 + len(hashes)] = torch.tensor(hashes, dtype=torch.int64)
    return record


def _compare(name: str, text: str, digest: str, group: dist.ProcessGroup,
             device: torch.device) -> str:
    size = dist.get_world_size(group)
    mine = _record(text).to(device)
    everyone = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
    all_gather_single(everyone, mine, group=group)
    records = everyone.view(size, -1).cpu()
    odd = next((i for i in range(1, size) if not torch.equal(records[i, :2], records[0, :2])),
               None)
    if odd is None:
        return digest
    ranks = dist.get_process_group_ranks(group)
    lines = text.splitlines()
    differs = (records[0, 3:] != records[odd, 3:]).nonzero()
    index = int(differs[0]) if len(differs) else min(MAX_LINES, len(lines))
    here = repr(lines[index].strip()) if index < len(lines) else "<end of graph>"
    raise PlanMismatchError(
        f"zeroc: ranks compiled different plans for {name}: rank {ranks[0]} and rank "
        f"{ranks[odd]} differ; first difference at line {index + 1} of the compiled graph "
        f"(rank {dist.get_rank()} has {here}). Every rank must run the same model code, "
        "options and input shapes."
    )
