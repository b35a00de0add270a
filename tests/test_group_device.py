"""Which device a rank's parameters and collectives use, decided by what the default group
can do (``zeroc.runtime.mesh.group_device``), not by its backend's name: the README's
multi-node recipe calls ``init_process_group()`` with no backend, which torch reports as
``"undefined"`` while routing CUDA tensors to NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zeroc.runtime.mesh import group_device


@pytest.mark.parametrize(("config", "backend", "gpu", "expected"), [
    ("cpu:gloo,cuda:nccl", "undefined", True, "cuda:1"),  # init_process_group() on a GPU node
    ("cuda:nccl", "nccl", True, "cuda:1"),
    ("cpu:gloo,cuda:gloo", "gloo", True, "cpu"),  # gloo asked for: CPU tensors
    ("cpu:gloo,cuda:nccl", "undefined", False, "cpu"),  # no GPU visible to this process
    ("cpu:gloo", "undefined", False, "cpu"),
])
def test_group_device_follows_the_groups_cuda_route(monkeypatch, config: str, backend: str,
                                                    gpu: bool, expected: str) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert str(group_device()) == expected


def test_without_a_process_group_the_device_is_the_cpu() -> None:
    assert not dist.is_initialized()
    assert group_device() == torch.device("cpu")
