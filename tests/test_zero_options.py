"""parallelize's options and their errors: mixed-precision policies, a user's DeviceMesh,
graph sizes, global-norm clipping across a pipeline, and bad input.

A 2-rank job covers the policies, the mesh, graph node counts and a DCP shape mismatch; a
4-rank job clips a pp=2 x dp=2 ZeRO-3 pipeline with ``zeroc.clip_grad_norm_``.
"""

from __future__ import annotations

import re

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from parity import ADAM, assert_tensors_match
from test_torch_distributed import MAX_NORM, batches, eager_run, make_gpt, rows

import zeroc

# Nodes per compiled graph of the zoo GPT on 2 ranks before parameters became DTensors
# (forward, backward); stage 1 had a forward gather then. The DTensor change adds none.
# Stage 1 now reduces as stage 2 does and puts each of the GPT's 28 parameters' rows back in
# a whole-size gradient (one zeroc::whole_from_shard each): stage 2's backward + 28.
NODES_BEFORE = {0: (125, 205), 1: (197, 238 + 28), 2: (197, 238), 3: (187, 294)}


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def options_job(rank: int, world: int, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    out: dict = {"nodes": {}, "policies": {}}
    batch = rows(batches(1)[0], rank, world)
    for zero in (0, 1, 2, 3):
        torch._dynamo.reset()
        model = zeroc.parallelize(make_gpt(), zero=zero)
        # NODES_BEFORE was counted with the cheap ops recomputed and the fused loss (then
        # the CPU defaults).
        compiled = torch.compile(model, backend="zeroc",
                                 options={"activation_recompute": True, "fused_loss": True})
        compiled(*batch).backward()
        graphs = {g.kind: g.nodes for g in zeroc.explain(compiled).graphs}
        out["nodes"][zero] = (graphs["forward"], graphs["backward"])
        out["nodes_ops"] = sorted({str(t) for g in zeroc.explain(compiled).graphs
                                   for t in g.code.split() if "DTensor" in t})
    for reduce_dtype in (torch.bfloat16, torch.float32):
        torch._dynamo.reset()
        policy = zeroc.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        model = zeroc.parallelize(make_gpt(), zero=3, mixed_precision=policy)
        compiled = torch.compile(model, backend="zeroc")
        compiled(*batch).backward()
        plan = zeroc.explain(compiled)
        out["policies"][str(reduce_dtype)] = {
            "grads": _full_grads(model),
            "dtypes": sorted({(c.op, c.dtype) for c in plan.collectives}),
        }
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    model = zeroc.parallelize(make_gpt(), zero=3, mesh=mesh)
    out["mesh"] = (model._zeroc_layout.dp, next(model.parameters()).device_mesh == mesh["dp"])
    try:
        zeroc.parallelize(make_gpt(), mesh=init_device_mesh("cpu", (world,),
                                                            mesh_dim_names=("tp",)))
    except ValueError as error:
        out["mesh_error"] = str(error)
    dcp.save(model.state_dict(), checkpoint_id=directory)
    wider = zeroc.parallelize(GPT(GPTConfig(vocab_size=80, block_size=16, n_layer=2, n_head=2,
                                            d_model=32), seed=5), zero=3)
    try:
        dcp.load(wider.state_dict(), checkpoint_id=directory)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        out["dcp_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def options(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("ckpt"))
    return run_ranks(options_job, 2, directory, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_dtensor_parameters_add_no_graph_nodes(options) -> None:
    for zero, (forward, backward) in options[0]["nodes"].items():
        assert forward <= NODES_BEFORE[zero][0] and backward <= NODES_BEFORE[zero][1], zero
    assert options[0]["nodes_ops"] == []  # no DTensor in any compiled graph


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_fp32_reduction_is_closer_to_fp32_eager_than_bf16(options) -> None:
    model = make_gpt()
    model(*batches(1)[0]).backward()
    errors = {}
    for key, result in options[0]["policies"].items():
        errors[key] = sum((result["grads"][n].float() - p.grad).norm().item() ** 2
                          for n, p in model.named_parameters()) ** 0.5
    assert errors["torch.float32"] < errors["torch.bfloat16"], errors
    assert options[0]["policies"]["torch.float32"]["dtypes"] == [
        ("all_gather", "bfloat16"), ("reduce_scatter", "float32")]
    assert options[0]["policies"]["torch.bfloat16"]["dtypes"] == [
        ("all_gather", "bfloat16"), ("reduce_scatter", "bfloat16")]


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_a_users_device_mesh_is_used(options) -> None:
    assert options[0]["mesh"] == (2, True)
    assert "mesh with dimensions ('tp',) is not allowed" in options[0]["mesh_error"]


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_dcp_load_with_other_shapes_names_the_parameter_and_both_shapes(options) -> None:
    # The tied embedding and head are one tensor under two names; DCP names one of them.
    assert re.search(r"Size mismatch between saved torch.Size\(\[64, 32\]\) and current: "
                     r"torch.Size\(\[80, 32\]\) for (tok_emb|lm_head).weight",
                     options[0]["dcp_error"])


def pipeline_clip_job(rank: int, world: int) -> dict:
    model = zeroc.parallelize(make_gpt(), zero=3, pp=2)
    compiled = torch.compile(model, backend="zeroc", options={"schedule": "1f1b"})
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    dp_index = model._zeroc_layout.mesh.dp_index
    norms = []
    for index in range(2):
        loss = compiled(*rows(batches()[index], dp_index, 2))
        loss.backward()
        norms.append(zeroc.clip_grad_norm_(model, MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"norms": norms, "full": zeroc.full_state_dict(model)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_clip_grad_norm_across_a_pipeline() -> None:
    results = run_ranks(pipeline_clip_job, 4, timeout=500)
    _, ref_norms, ref = eager_run(range(2), clip=MAX_NORM)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms),
                                   rtol=1e-5, atol=0)
    assert_tensors_match(ref.state_dict(), results[0]["full"], "pp=2 x dp=2 clipped")


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match=r"MixedPrecision\(param_dtype=torch.int32\) is not "
                                         r"allowed: use None or a floating-point torch.dtype"):
        zeroc.MixedPrecision(param_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"set_requires_gradient_sync: model GPT was not "
                                         r"parallelized by zeroc"):
        zeroc.set_requires_gradient_sync(make_gpt(), False)
    with pytest.raises(ValueError, match=r"no_sync: model GPT was not parallelized"):
        with zeroc.no_sync(make_gpt()):
            pass
