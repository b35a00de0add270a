"""Every rank of a group must compile the same graph: check it with one collective.

A rank that compiled a different graph (other options, other shapes, other code) would issue
other collectives and hang the job. After compiling, the ranks of a group all-gather a hash of
the compiled graph; on a mismatch every rank raises, naming the ranks that differ and the
first line where their graphs differ.
"""

from __future__ import annotations

import difflib
import hashlib

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from zeroc.runtime.mesh import resolve_group


class PlanMismatchError(RuntimeError):
    """Ranks of one group compiled different graphs."""


def text_digest(text: str) -> str:
    """A short, stable hash of a graph's text."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def first_difference(a: str, b: str) -> str:
    """The first differing line of two texts, as ``line N: 'x' != 'y'``."""
    lines_a, lines_b = a.splitlines(), b.splitlines()
    matcher = difflib.SequenceMatcher(a=lines_a, b=lines_b, autojunk=False)
    for tag, i1, _i2, j1, _j2 in matcher.get_opcodes():
        if tag != "equal":
            left = lines_a[i1].strip() if i1 < len(lines_a) else "<end>"
            right = lines_b[j1].strip() if j1 < len(lines_b) else "<end>"
            return f"line {i1 + 1}: {left!r} != {right!r}"
    return "texts are equal"


def check_same_graph(name: str, text: str, group_name: str) -> str:
    """All-gather the digest of ``text`` over the group; raise on every rank if they differ.

    Returns the digest. Without a group (``""``) or a process group, nothing is compared.
    """
    digest = text_digest(text)
    group = resolve_group(group_name)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return digest
    # Compilation runs under a fake-tensor mode; the exchange needs real tensors.
    with unset_fake_temporarily():
        return _compare(name, text, digest, group)


def _compare(name: str, text: str, digest: str, group: dist.ProcessGroup) -> str:
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return digest
    # Mismatch: every rank sees it; fetch the texts once more to name the difference.
    texts: list[str | None] = [None] * len(digests)
    dist.all_gather_object(texts, text, group=group)
    ranks = dist.get_process_group_ranks(group)
    odd = next(i for i, d in enumerate(digests) if d != digests[0])
    raise PlanMismatchError(
        f"zeroc: ranks compiled different plans for {name}: rank {ranks[0]} has "
        f"{digests[0]}, rank {ranks[odd]} has {digests[odd]}; first difference "
        f"(rank {ranks[0]} vs rank {ranks[odd]}) at {first_difference(texts[0], texts[odd])}. "
        "Every rank must run the same model code, options and input shapes."
    )
