"""Options reach one validated, frozen Config; bad input names the key, value and choices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zeroc.config import Config


def test_defaults_and_frozen() -> None:
    config = Config.build()
    assert config.mode == "default" and config.kernels == "auto" and config.fusion
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.fusion = False  # type: ignore[misc]


def test_mode_max_autotune_turns_on_kernel_autotune() -> None:
    assert Config.build("max-autotune").kernel_autotune
    assert not Config.build("default").kernel_autotune


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"bogus": 1}, ["'bogus'", "known options", "kernels"]),
        ({"kernels": "cuda"}, ["kernels='cuda'", "'auto'", "'triton'", "'aten'"]),
        ({"partitioner": "greedy"}, ["partitioner='greedy'", "'min_cut'"]),
        ({"fusion": "yes"}, ["fusion='yes'", "True or False"]),
        ({"cache_dir": ""}, ["cache_dir=''"]),
    ],
)
def test_bad_option_names_key_value_and_allowed(options: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        Config.build(None, options)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_mode() -> None:
    with pytest.raises(ValueError, match="mode='turbo'.*'max-autotune'"):
        Config.build("turbo")


def test_bad_option_through_torch_compile_is_a_value_error() -> None:
    """The error reaches the user as a ValueError, not wrapped by Dynamo."""
    compiled = torch.compile(lambda x: x + 1, backend="zeroc", options={"kernels": "gpu"})
    with pytest.raises(ValueError, match="kernels='gpu'"):
        compiled(torch.ones(3))


def test_options_reach_the_plan() -> None:
    import zeroc

    compiled = torch.compile(lambda x: torch.relu(x) * 3, backend="zeroc",
                             options={"fusion": False, "partitioner": "default"})
    compiled(torch.randn(5))
    options = dict(zeroc.explain(compiled).meta.options)
    assert options["fusion"] == "False" and options["partitioner"] == "default"
