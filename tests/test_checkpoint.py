"""Checkpoints that cannot come back mixed (``zeroc.save_checkpoint``).

Two ZeRO-3 ranks save step 1's state, train a step and save again over it; rank 1 dies in
the middle of writing its files. With ``dcp.save`` straight over the directory the result
loads and holds parts of both steps; with ``zeroc.save_checkpoint`` what loads is exactly
step 1's state. A save lost after the new checkpoint was written but between the helper's
renames loads the previous checkpoint.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from dist_harness import RankError, run_ranks
from models.gpt import GPT, GPTConfig

import zeroc


def _gpt() -> GPT:
    return GPT(GPTConfig.tiny(), seed=4)


def _step(model, optimizer, seed: int) -> None:
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(seed))
    model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"model": get_model_state_dict(model)}


def lost_save_job(rank: int, world: int, directory: str, helper: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    model = zeroc.parallelize(_gpt(), zero=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    _step(model, optimizer, 1)
    save = zeroc.save_checkpoint if helper else (
        lambda state, path: dcp.save(state, checkpoint_id=path))
    save(_state(model), directory)
    step1 = zeroc.full_state_dict(model)
    _step(model, optimizer, 2)
    if rank == 1:  # dies once it is writing its files, after rank 0 has written its own
        original = FileSystemWriter.write_data

        def die(self, plan, planner):
            import time

            time.sleep(1.0)
            os._exit(3)

        FileSystemWriter.write_data = die
    else:
        original = None
    try:
        save(_state(model), directory)
    except Exception as error:  # noqa: BLE001 - rank 0 sees its peer die
        return {"step1": step1, "error": type(error).__name__}
    finally:
        if original is not None:
            FileSystemWriter.write_data = original
    return {"step1": step1, "error": ""}


def _loaded(directory: str) -> dict:
    state = {"model": _gpt().state_dict()}
    zeroc.load_checkpoint(state, directory)
    return state["model"]


def _differences(loaded: dict, expected: dict) -> list[str]:
    return [k for k, v in expected.items() if not torch.equal(loaded[k], v)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("helper", [False, True], ids=["dcp_over_it", "save_checkpoint"])
def test_a_rank_lost_mid_save_leaves_one_steps_state(tmp_path, helper: bool) -> None:
    directory = str(tmp_path / "ckpt")
    try:
        results = run_ranks(lost_save_job, 2, directory, helper, timeout=240,
                            may_exit=frozenset({1}))
    except RankError as error:
        pytest.fail(f"rank 0 did not see its peer die: {error}")
    step1 = results[0]["step1"]
    assert results[0]["error"], "rank 0's second save should have failed"
    changed = _differences(_loaded(directory), step1)
    if helper:
        assert changed == [], changed  # exactly step 1's state
        assert not os.path.exists(directory + ".previous")
    else:
        assert changed, "dcp.save over the directory left it mixed (this is what it shows)"


def test_a_save_lost_between_the_renames_loads_the_previous_checkpoint(tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    model = _gpt()
    zeroc.save_checkpoint({"model": model.state_dict()}, directory)
    os.rename(directory, directory + ".previous")  # as a crash after the first rename leaves
    loaded = _loaded(directory)
    assert _differences(loaded, model.state_dict()) == []
    with pytest.raises(ValueError, match="path=None must be a directory path"):
        zeroc.save_checkpoint({}, None)
    with pytest.raises(TypeError, match=r"path is a dict \(keys \['model'\]\); the state "
                       "comes first") as swapped:  # short: not the whole state's repr
        zeroc.save_checkpoint(directory, {"model": model.state_dict()})
    assert len(str(swapped.value)) < 200
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        zeroc.load_checkpoint({}, str(tmp_path / "missing"))


def test_entries_the_state_has_no_place_for_are_named(tmp_path, caplog) -> None:
    """An optimizer's ``state_dict()`` before its first step is empty: loading into it reads
    none of the saved moments, which DCP does silently. zeroc names what it left unread."""
    directory = str(tmp_path / "ckpt")
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer, seed=0)
    zeroc.save_checkpoint({"model": model.state_dict(), "optim": optimizer.state_dict()},
                          directory)
    fresh = _gpt()
    state = {"model": fresh.state_dict(),
             "optim": torch.optim.AdamW(fresh.parameters()).state_dict()}
    with caplog.at_level(logging.WARNING, logger="zeroc"):
        zeroc.load_checkpoint(state, directory)
    assert "were not loaded" in caplog.text and "optim.state.0.exp_avg" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zeroc"):  # the model alone: nothing unread
        zeroc.load_checkpoint({"model": fresh.state_dict()}, directory)
    assert "were not loaded" not in caplog.text
