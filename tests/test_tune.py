"""``zeroc.tune``: the search space, estimate-then-measure, the cache, and bad input.

Single-process cases tune the tiny zoo GPT over a narrowed search (each candidate is planned
in the fake world, a few seconds here) on a published profile, so no calibration runs; the
2-rank case (``tests/test_demo_launch.py``, through ``python -m zeroc tune --nproc 2``)
estimates in a child process (the fake world cannot share a process with a real process
group) and measures on gloo.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc.runtime.cached_files import checksum
from zeroc.runtime.cost.hardware import get_profile
from zeroc.runtime.errors import OptionError
from zeroc.sharding.tune_cache import TUNE_FORMAT, write_cached
from zeroc.tuning.tune_space import Candidate, candidates

NARROW = {"fused_loss": [True, False], "partitioner": ["default"]}


def _model_and_inputs() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    model = GPT(GPTConfig.tiny(), seed=0)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    return model, (tokens, tokens)


def test_candidates_cover_the_axes_defaults_first() -> None:
    one = candidates(1, 4)
    assert {c.zero for c in one} == {0} and {c.pp for c in one} == {1}
    assert len(one) == 4  # fused_loss x partitioner
    assert one[0].options_dict() == {"fused_loss": True, "partitioner": "min_cut"}
    two = candidates(2, 8)
    assert {c.zero for c in two if c.pp == 1} == {0, 2, 3}
    piped = [c for c in two if c.pp == 2]
    assert {c.options_dict()["schedule"] for c in piped} == {"1f1b", "dualpipev"}
    assert all(8 % c.options_dict()["microbatches"] == 0 for c in piped)
    assert two[0].zero == 3 and two[0].options_dict()["prefetch"] == 1
    assert Candidate.from_json(two[5].to_json()) == two[5]
    with pytest.raises(OptionError, match="unknown search axes"):
        candidates(2, 8, {"zeros": [3]})
    with pytest.raises(OptionError, match="does not divide"):
        candidates(2, 8, {"pp": [3]})


def test_tune_measures_the_best_and_caches_it(tmp_path, monkeypatch) -> None:
    model, inputs = _model_and_inputs()
    result = zeroc.tune(model, inputs, search=NARROW, budget_s=300, measure_best=2, steps=2,
                        hardware="a100-80gb", cache_dir=str(tmp_path))
    assert not result.from_cache and len(result.trials) == 2
    measured = [t for t in result.trials if t.measured_s is not None]
    assert len(measured) == 2 and all(t.estimated_s > 0 and t.peak_bytes > 0 for t in measured)
    assert result.best == min(measured, key=lambda t: t.measured_s).candidate
    table = result.table()
    assert "estimated step (ms)" in table and " *" in table
    saved = json.loads(open(result.cache_file).read())
    assert Candidate.from_json(saved["data"]["best"]) == result.best
    assert os.stat(os.path.dirname(result.cache_file)).st_mode & 0o777 == 0o700

    tune_module = sys.modules["zeroc.tuning.tune"]  # zeroc.tune is the function

    def no_search(*args, **kwargs):
        raise AssertionError("a cached layout must not be searched again")

    monkeypatch.setattr(tune_module, "estimate_all", no_search)
    again = zeroc.tune(model, inputs, search=NARROW, hardware="a100-80gb",
                       cache_dir=str(tmp_path))
    assert again.from_cache and again.best == result.best
    options = again.apply(model)
    assert options == result.best.options_dict()
    compiled = torch.compile(model, backend="zeroc", options=options)
    assert torch.isfinite(compiled(*inputs))


def test_cache_from_another_torch_version_is_ignored(tmp_path, monkeypatch, caplog) -> None:
    model, inputs = _model_and_inputs()
    first = zeroc.tune(model, inputs, search={"fused_loss": [True], "partitioner": ["default"]},
                       budget_s=300, measure_best=1, steps=1, hardware="a100-80gb",
                       cache_dir=str(tmp_path))
    saved = json.loads(open(first.cache_file).read())
    saved["key"]["versions"]["torch"] = "1.0.0"
    saved["sha256"] = checksum("tune result", TUNE_FORMAT, saved["key"], saved["data"])
    open(first.cache_file, "w").write(json.dumps(saved))
    with caplog.at_level(logging.INFO, logger="zeroc"):
        again = zeroc.tune(model, inputs, search={"fused_loss": [True],
                                                  "partitioner": ["default"]},
                           budget_s=300, measure_best=1, steps=1, hardware="a100-80gb",
                           cache_dir=str(tmp_path))
    assert not again.from_cache
    assert any("another setup" in r.getMessage() and "1.0.0" in r.getMessage()
               for r in caplog.records)


def test_budget_too_small_says_how_long_one_takes(tmp_path) -> None:
    model, inputs = _model_and_inputs()
    with pytest.raises(OptionError, match=r"budget_s=0.01 is too small: .* s a candidate"):
        zeroc.tune(model, inputs, search={"fused_loss": [True], "partitioner": ["default"]},
                   budget_s=0.01, hardware="a100-80gb", cache_dir=str(tmp_path))


def test_nothing_fits_names_the_smallest_peak(tmp_path) -> None:
    model, inputs = _model_and_inputs()
    tiny = {**get_profile("a100-80gb").to_dict(), "name": "tiny", "memory_bytes": 1000}
    with pytest.raises(OptionError, match=r"no candidate fits in memory on cpu: the smallest "
                                          r"planned peak is .*KiB against 1000 B"):
        zeroc.tune(model, inputs, search={"fused_loss": [True], "partitioner": ["default"]},
                   budget_s=300, hardware=tiny, cache_dir=str(tmp_path))


def test_planning_a_world_that_is_not_here_ranks_by_estimate(tmp_path) -> None:
    model, inputs = _model_and_inputs()
    search = {"pp": [1, 2], "zero": [3], "fused_loss": [True], "partitioner": ["default"],
              "schedule": ["1f1b"], "microbatches": [2], "prefetch": [1]}
    result = zeroc.tune(model, inputs, world=4, search=search, hardware="h100-sxm",
                        device="cpu", cache_dir=str(tmp_path))
    assert not result.measured and all(t.measured_s is None for t in result.trials)
    estimated = [t for t in result.trials if t.estimated_s is not None]
    assert {t.candidate.pp for t in estimated} == {1, 2}
    assert result.best == min(estimated, key=lambda t: t.estimated_s).candidate
    why = result.why()
    assert result.best.label() in why and "bubble" in why and "next best" in why
    piped = next(t for t in estimated if t.candidate.pp == 2)
    assert piped.parts["bubble"] > 0  # a 2-stage 1F1B pipeline of 2 micro-batches idles


FACTORY = '''
import torch
from torch import nn


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


def build():
    torch.manual_seed(0)
    return TwoLayer(), (torch.randn(8, 16), torch.randint(0, 4, (8,)))
'''


def test_cli_plans_a_world_and_documents_every_flag(tmp_path) -> None:
    import subprocess

    from zeroc.cli.tune_cli import _parser

    help_text = _parser().format_help()
    for flag in ("--nproc", "--budget", "--search", "--measure", "--steps", "--world",
                 "--device", "--hardware", "--cache-dir", "--force", "--json"):
        assert flag in help_text, flag
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY)
    out = tmp_path / "tuned.json"
    search = json.dumps({"zero": [2, 3], "fused_loss": [True], "partitioner": ["default"],
                         "pp": [1], "prefetch": [1]})
    done = subprocess.run(
        [sys.executable, "-m", "zeroc", "tune", f"{factory}:build", "--world", "4",
         "--hardware", "h100-sxm", "--device", "cpu", "--search", search,
         "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "chosen: zero" in done.stdout and "why: " in done.stdout
    saved = json.loads(out.read_text())
    assert saved["measured"] is False and len(saved["trials"]) == 2


def test_parallelize_layout_auto_reads_the_tuned_layout(tmp_path) -> None:
    """``parallelize(layout="auto")`` takes the tuned layout, its options become the compile's
    defaults under ``mode="max-autotune"``, and the plan names the cache file."""
    model, inputs = _model_and_inputs()
    with pytest.raises(OptionError, match="no tuned layout for this model on 1 rank"):
        zeroc.parallelize(GPT(GPTConfig.tiny(), seed=0), layout="auto",
                          cache_dir=str(tmp_path))
    with pytest.raises(OptionError, match="layout='bogus' is not allowed"):
        zeroc.parallelize(GPT(GPTConfig.tiny(), seed=0), layout="bogus")
    result = zeroc.tune(model, inputs, search={"fused_loss": [False], "partitioner": ["default"]},
                        budget_s=300, measure_best=1, steps=1, hardware="a100-80gb",
                        cache_dir=str(tmp_path))
    fresh = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=0), layout="auto",
                              cache_dir=str(tmp_path))
    assert fresh._zeroc_layout.zero == result.best.zero
    assert dict(fresh._zeroc_layout.tuned_options) == result.best.options_dict()
    compiled = torch.compile(fresh, backend="zeroc", mode="max-autotune")
    compiled(*inputs).backward()
    plan = zeroc.explain(compiled)
    options = dict(plan.meta.options)
    assert options["fused_loss"] == "False" and options["partitioner"] == "default"
    assert options["kernel_autotune"] == "True"  # what max-autotune itself sets
    assert plan.meta.layout_from == result.cache_file
    first = _first_line(str(plan))
    assert "tuned by zeroc.tune" in first and result.cache_file in first
    assert "model structure, world 1" in first and "input shapes 4x16, 4x16 matched" in first
    assert zeroc.Plan.from_json(plan.to_json()) == plan


def _first_line(text: str) -> str:
    """The plan's first line, its wrapped continuation lines joined."""
    lines = text.splitlines()
    found = [lines[0]]
    for line in lines[1:]:
        if not line.startswith("  "):
            break
        found.append(line.strip())
    return " ".join(found)


def _auto_layout_with_a_cache_per_node(rank: int, world: int, root: str) -> tuple:
    """Rank 0's cache holds a tuned layout, rank 1's is empty (another node's disk)."""
    model, inputs = _model_and_inputs()
    cache_dir = os.path.join(root, f"node{rank}")
    if rank == 0:
        best = Candidate(zero=2, pp=1, options=(("fused_loss", False),))
        write_cached(cache_dir, model, inputs, world, "cpu", best, [])
    parallel = zeroc.parallelize(model, layout="auto", cache_dir=cache_dir)
    tuned = zeroc.tune(model, inputs, cache_dir=cache_dir, budget_s=60)
    return (parallel._zeroc_layout.zero, dict(parallel._zeroc_layout.tuned_options),
            tuned.from_cache, tuned.best.label())


@pytest.mark.slow
def test_ranks_agree_on_rank0s_tuned_layout_with_a_cache_per_node(tmp_path) -> None:
    """Only rank 0 writes the tune cache, so only rank 0 reads it: with a cache directory
    per node, every rank still takes the same layout (and ``tune`` returns the cached result
    everywhere instead of tuning on some ranks only)."""
    from dist_harness import run_ranks

    results = run_ranks(_auto_layout_with_a_cache_per_node, 2, str(tmp_path), timeout=240)
    expected = (2, {"fused_loss": False}, True, "zero2 pp1 fused_loss=False")
    assert results[0] == results[1] == expected
