"""``zeroc.explain`` for every way of compiling: ``torch.compile(model)``, ``model.compile()``,
per-block compile (one plan of every region), and ``torch.compile(fn)``.

The session is found from torch's own attributes, never the Python stack; these tests cover
each one ``zeroc.frontend.session`` documents, on whichever torch is installed (CI: 2.13; the same
tests pass on 2.11): ``InstructionTranslator.current_tx().output.compiler_fn`` on the backend
side, ``OptimizedModule.dynamo_ctx.callback``, a compiled function's closure and
``module._compiled_call_impl`` on the compiled side, joined by ``_torchdynamo_orig_backend``.
"""

from __future__ import annotations

import pytest
import torch

import zeroc
from zeroc.frontend.session import compiled_regions, find_compile_wrapper, wrapper_of

X = torch.ones(4, 8)
BLOCK_PARAMS = ["layers.0.fc.weight", "layers.0.fc.bias", "layers.1.fc.weight",
                "layers.1.fc.bias"]
PARAMS = [*BLOCK_PARAMS, "head.weight", "head.bias"]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x))


class Tiny(torch.nn.Module):
    """torchtitan's shape in small: ``layers`` of blocks, then a head.

    Its forwards are user code: ``module.compile()`` of a module whose forward is torch.nn's
    own (an ``nn.Sequential`` of ``nn.Linear``) compiles only what Dynamo does not skip, and
    that differs between torch 2.11 and 2.13.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def tiny(zero: int | None = 3) -> Tiny:
    """The model, parallelized (one rank) unless ``zero`` is None."""
    torch.manual_seed(0)
    return Tiny() if zero is None else zeroc.parallelize(Tiny(), zero=zero)


def step(fn) -> None:
    fn(X).sum().backward()


def kinds(plan: zeroc.Plan) -> list[str]:
    return [g.name for g in plan.graphs]


def test_torch_compile_of_the_model() -> None:
    compiled = torch.compile(tiny(), backend="zeroc")
    step(compiled)
    plan = zeroc.explain(compiled)
    assert kinds(plan) == ["g0.joint", "g0.forward", "g0.backward"]


def test_model_compile_method() -> None:
    model = tiny()
    model.compile(backend="zeroc")
    step(model)
    plan = zeroc.explain(model)
    assert kinds(plan) == ["g0.joint", "g0.forward", "g0.backward"]


@pytest.mark.parametrize("style", ["block.compile()", "torch.compile(block)"])
def test_per_block_compile_gathers_one_plan_of_every_region(style: str) -> None:
    model = tiny()
    for index, block in enumerate(model.layers):
        if style == "block.compile()":
            block.compile(backend="zeroc")
        else:  # torchtitan's older form: the compiled block replaces the block
            model.layers[index] = torch.compile(block, backend="zeroc")
    step(model)
    plan = zeroc.explain(model)
    assert kinds(plan) == [f"layers.{i}.g0.{kind}" for i in (0, 1)
                           for kind in ("joint", "forward", "backward")]
    assert {p.graph for p in plan.passes} >= {"layers.0.g0.forward", "layers.1.g0.backward"}
    one = zeroc.explain(model.layers[1])  # a region alone: its own names
    assert kinds(one) == ["g0.joint", "g0.forward", "g0.backward"]


def test_parameters_are_named_by_module_path_in_every_form() -> None:
    """Each region's parameters under its path, so the gathered plan holds each one once."""
    model = tiny()
    for block in model.layers:
        block.compile(backend="zeroc")
    step(model)
    plan = zeroc.explain(model)
    assert [p.name for p in plan.params] == BLOCK_PARAMS
    assert plan.stages[0].params == 2 * (64 + 8)  # the head ran eagerly
    whole = torch.compile(tiny(), backend="zeroc")
    step(whole)
    assert [p.name for p in zeroc.explain(whole).params] == PARAMS


def test_torch_compile_of_a_function() -> None:
    model = tiny()
    compiled = torch.compile(lambda x: model(x).sum(), backend="zeroc")
    compiled(X).backward()
    plan = zeroc.explain(compiled)
    assert kinds(plan) == ["g0.joint", "g0.forward", "g0.backward"]


def test_the_backend_finds_the_wrapper_that_the_compiled_object_holds() -> None:
    """The two ends of the lookup meet at the same object, for each form."""
    seen = []

    def spy(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(find_compile_wrapper())
        return gm.forward

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin() + 1

    compiled_fn = torch.compile(fn, backend=spy)
    compiled_fn(X)
    model = torch.nn.Sequential(tiny())  # Dynamo compiles the inner (parallelized) module
    compiled_module = torch.compile(model, backend=spy)
    compiled_module(X)
    block = tiny()
    block.compile(backend=spy)
    block(X)
    holders = [wrapper_of(compiled_fn), wrapper_of(compiled_module), wrapper_of(block)]
    assert len(seen) == 3 and all(w is not None for w in holders)
    assert all(a is b for a, b in zip(seen, holders, strict=True))
    assert len({id(w) for w in holders}) == 3  # one per torch.compile call
    assert find_compile_wrapper() is None  # outside a Dynamo compile


def test_regions_and_errors() -> None:
    plain = tiny(zero=None)
    with pytest.raises(ValueError, match="not compiled by zeroc"):
        zeroc.explain(plain)
    other = tiny()
    other.layers[0].compile(backend="aot_eager")
    step(other)
    with pytest.raises(ValueError, match="backend='aot_eager'"):
        zeroc.explain(other)
    lazy = torch.compile(tiny(), backend="zeroc")
    with pytest.raises(ValueError, match="call the compiled model once"):
        zeroc.explain(lazy)
    mixed = tiny()
    mixed.layers[0].compile(backend="zeroc")
    mixed.layers[1].compile(backend="zeroc", options={"prefetch": 2})
    step(mixed)
    assert [path for path, _ in compiled_regions(mixed)] == ["layers.0", "layers.1"]
    with pytest.raises(ValueError, match=r"'layers.0' and 'layers.1' use different options"):
        zeroc.explain(mixed)
