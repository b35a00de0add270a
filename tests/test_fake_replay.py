"""Replaying a graph's outputs on fake tensors (``zeroc.runtime.fake_replay``).

A replayed call must leave the step's memory tracker exactly where running the graph would:
the same bytes live after it, the same peak, outputs with the same aliasing (views of inputs,
outputs sharing one storage, a view where it was one as ``fake_replay.is_view`` tells). A
planned pipeline's memory rows are the same with replaying and without. Graphs holding a
collective run every time.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from models.gpt import GPT, GPTConfig
from torch._subclasses.fake_tensor import FakeTensorMode

import zeroc
from zeroc.runtime import fake_replay
from zeroc.runtime.step_memory import StepMemory, tracking_scope


def _graph() -> torch.fx.GraphModule:
    def body(x: torch.Tensor, w: torch.Tensor):
        h = torch.relu(x @ w)  # a transient product, freed inside
        qkv = (h * 2).reshape(4, 3, 8)
        q, k, v = qkv.unbind(1)  # three views of one fresh storage
        return q, k, v, w.t(), x, (h + 1).sum(), (h * 3).t()  # the last: a whole-storage view

    return torch.fx.symbolic_trace(body)


def _run(call, graph, x, w):
    tracker = StepMemory()
    with tracker.active(), tracking_scope():
        outs = call(graph, x, w)
        live = tracker.live
    return outs, live, tracker.peak


def test_a_replay_leaves_the_tracker_where_a_run_does() -> None:
    graph = _graph()
    assert fake_replay.replayable(graph)
    with FakeTensorMode():
        x, w = torch.empty(4, 16), torch.empty(16, 24)
        run_outs, run_live, run_peak = _run(lambda g, *a: g(*a), graph, x, w)
        learned = fake_replay.learned()
        fake_replay.call(graph, x, w)  # learns
        assert fake_replay.learned() == learned + 1
        x2, w2 = torch.empty(4, 16), torch.empty(16, 24)
        outs, live, peak = _run(fake_replay.call, graph, x2, w2)
        assert fake_replay.learned() == learned + 1  # a replay learns nothing
    assert (live, peak) == (run_live, run_peak)
    q, k, v, wt, xo, total, whole = outs
    assert q.untyped_storage()._cdata == k.untyped_storage()._cdata == v.untyped_storage()._cdata
    assert wt.untyped_storage()._cdata == w2.untyped_storage()._cdata and wt.shape == (24, 16)
    assert xo is x2
    # A view where it can matter: an output alone, among the call's inputs and outputs, on a
    # storage it spans whole (the executor keeps such a gradient uncopied only when it is no
    # view, as ``is_view`` tells). A view of an input (``wt``) shares the input's storage: it
    # is copied anyway.
    def alone_and_whole(o, call):
        sharing = [p for p in call if isinstance(p, torch.Tensor)
                   and p.untyped_storage()._cdata == o.untyped_storage()._cdata]
        return len(sharing) == 1 and o.untyped_storage().nbytes() == o.numel() * o.element_size()

    is_view = fake_replay.is_view
    assert [is_view(o) for o in outs if alone_and_whole(o, (x2, w2, *outs))] == [
        is_view(o) for o in run_outs if alone_and_whole(o, (x, w, *run_outs))]
    assert is_view(whole) and run_outs[-1]._base is not None
    assert not is_view(total)
    assert [(o.shape, o.stride(), o.dtype) for o in outs] == [
        (o.shape, o.stride(), o.dtype) for o in run_outs]


def test_a_new_input_shape_runs_the_graph_again() -> None:
    graph = torch.fx.symbolic_trace(lambda x, w: (torch.relu(x @ w), w.t()))
    runs = []
    graph.register_forward_pre_hook(lambda module, args: runs.append(args[0].shape))
    with FakeTensorMode():
        w = torch.empty(16, 24)
        for rows in (4, 4, 6, 6, 4):
            fake_replay.call(graph, torch.empty(rows, 16), w)
    assert runs == [(4, 16), (6, 16)]


def test_a_graph_holding_a_collective_always_runs() -> None:
    graph = torch.fx.GraphModule({}, torch.fx.Graph())
    x = graph.graph.placeholder("x")
    reduced = graph.graph.call_function(torch.ops._c10d_functional.all_reduce.default,
                                        (x, "sum", "0"))
    graph.graph.output((reduced,))
    graph.recompile()
    assert not fake_replay.replayable(graph)
    assert fake_replay.replayable(_graph())


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_planned_memory_is_the_same_replayed_or_run(schedule: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def plan():  # one block per stage: DualPipeV runs 2 * pp stages, 1F1B pp
        layers = 4 if schedule == "dualpipev" else 2
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2,
                              d_model=32))
        tokens = torch.zeros(8, 16, dtype=torch.long)
        result = zeroc.explain(model, (tokens, tokens), world=4, pp=2, zero=3, device="cpu",
                               options={"schedule": schedule, "microbatches": 4})
        return [(m.rank, m.params, m.grads, m.optimizer, m.peak) for m in result.memory]

    replayed = plan()
    monkeypatch.setattr(fake_replay, "replayable", lambda graph: False)
    assert plan() == replayed


def test_micro_batches_at_other_offsets_are_replayed() -> None:
    """A micro-batch is a slice of the batch: its offset differs, its signature does not."""
    graph = torch.fx.symbolic_trace(lambda x, w: (x[1:], torch.relu(x @ w)))
    runs = []
    graph.register_forward_pre_hook(lambda module, args: runs.append(1))
    with FakeTensorMode():
        batch, w = torch.empty(8, 16), torch.empty(16, 24)
        for micro in range(4):
            x = batch[2 * micro:2 * micro + 2]
            view, _ = fake_replay.call(graph, x, w)
            assert view.storage_offset() == x.storage_offset() + 16
            assert view.untyped_storage()._cdata == batch.untyped_storage()._cdata
    assert len(runs) == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_step_that_records_measures_as_a_replayed_step(device: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A planned position is measured in one step, the one that records its graphs: a second
    step, which replays them all, gives the same figures (HF Llama, ZeRO-3, pp 2 x dp 2)."""
    import transformers

    from zeroc.world import fake_world, plan_workers

    def llama(layers: int):
        config = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)

    tokens = torch.zeros(8, 32, dtype=torch.long)
    measure = fake_world.measured_step
    steps = []

    def twice(compiled, module, optimizer, args, kwargs, backward):
        before = fake_replay.learned()
        first = measure(compiled, module, optimizer, args, kwargs, backward)
        recorded = fake_replay.learned() - before
        optimizer.state.clear()
        second = measure(compiled, module, optimizer, args, kwargs, backward)
        steps.append((first, second, recorded, fake_replay.learned() - before - recorded))
        return first

    monkeypatch.setattr(fake_world, "measured_step", twice)
    monkeypatch.setattr(plan_workers, "planning_cores", lambda: 1)  # the steps, seen here
    for schedule, layers in (("1f1b", 2), ("dualpipev", 4)):  # one layer per stage
        zeroc.explain(llama(layers), {"input_ids": tokens, "labels": tokens}, world=4, pp=2,
                      zero=3, device=device,
                      options={"schedule": schedule, "microbatches": 4})
    assert len(steps) == 4
    for first, second, recorded, recorded_again in steps:
        assert recorded > 0 and recorded_again == 0  # the first step ran graphs, the second not
        assert first == second
