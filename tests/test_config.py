"""Options reach one validated, frozen Config; bad input names the key, value and choices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zeroc.frontend.config import Config


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


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("bucket_mb", float("inf"), "finite number of MiB in (0, 1048576]"),
    ("bucket_mb", float("nan"), "finite number of MiB"),
    ("bucket_mb", -1.0, "finite number of MiB"),
    ("bucket_mb", 1e30, "finite number of MiB"),
    ("prefetch", -1, "integer in [0, 4096]"),
    ("prefetch", 10**9, "integer in [0, 4096]"),
    ("prefetch", float("inf"), "integer in [0, 4096]"),
    ("microbatches", 0, "None or an integer in [1, 65536]"),
    ("microbatches", 10**9, "None or an integer in [1, 65536]"),
    ("microbatches", float("nan"), "None or an integer in [1, 65536]"),
])
def test_numeric_options_must_be_finite_and_in_range(key: str, value: object,
                                                     allowed: str) -> None:
    """An infinite, NaN, negative or absurd value is refused when the options are read,
    naming the option, rather than failing later somewhere that does not name it."""
    with pytest.raises(ValueError) as info:
        Config.build(None, {key: value})
    assert f"option {key}={value!r}" in str(info.value) and allowed in str(info.value)
    assert Config.build(None, {"bucket_mb": 1 << 20, "prefetch": 4096,
                               "microbatches": 1 << 16}).bucket_mb == float(1 << 20)


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
