"""The parallelism playbooks (issue #26 point 6): a baseline profiled with several ranks (profile --nproc) gets
the mesh factorisations its model's dims allow, FSDP2's reshard_after_forward both ways, activation checkpointing,
and bfloat16 FSDP2 parameters when its matmuls ran in float32; a single-process run gets none of them."""

from __future__ import annotations

from support.fake_profiles import hot_op, make_profile
from support.paths import EXAMPLES
from tpu_agent.profilers.schema import BuiltModules, Distributed, ModuleSize
from tpu_agent.propose.offline import propose_offline
from tpu_agent.propose.scope import candidates_in_scope

PARALLEL = {"mesh-shape", "fsdp-reshard-after-forward", "fsdp-param-dtype", "activation-checkpointing"}


def linear(i: int, o: int, count: int = 2) -> ModuleSize:
    return ModuleSize(kind="Linear", sizes={"in_features": i, "out_features": o}, count=count)


def dist_profile(script, world=2, widths=((32, 32), (32, 64), (64, 32)), dtype="f32"):
    prof = make_profile(script=str(script), waste=None,
                        hot_ops=[hot_op((8, 32), (32, 32), (8, 32), 1.0)] if dtype == "f32" else [])
    if dtype != "f32":
        prof.hot_ops = [h.model_copy(update={"operands": [o.replace("f32", "bf16") for o in h.operands]})
                        for h in [hot_op((8, 32), (32, 32), (8, 32), 1.0)]]
    prof.distributed = Distributed(world_size=world) if world > 1 else None
    prof.modules = BuiltModules(models=["Llama"], sizes=[linear(i, o) for i, o in widths])
    return prof


def options(round_, playbook):
    cand = next(c for c in round_.candidates if c.playbook == playbook)
    return [tuple(a.model_dump(exclude={"kind"}) for a in o) for o in cand.options()]


def test_an_fsdp_tp_run_at_two_ranks_gets_every_parallelism_change():
    round_ = propose_offline(dist_profile(EXAMPLES / "fsdp_tp.py"))
    assert PARALLEL <= {c.playbook for c in round_.candidates}
    # fsdp_tp.py reads its dp coordinate for its batches: another dp is another training
    assert options(round_, "mesh-shape") == [({"shape": (2, 1), "dp_batches": True, "effect": "training"},),
                                             ({"shape": (1, 2), "dp_batches": True, "effect": "training"},)]
    assert options(round_, "fsdp-reshard-after-forward") == [({"reshard": True, "effect": "exact"},),
                                                             ({"reshard": False, "effect": "exact"},)]
    assert [o[0]["every"] for o in options(round_, "activation-checkpointing")] == [1, 2]
    assert options(round_, "fsdp-param-dtype") == [({"param_dtype": "bfloat16", "effect": "numerics"},)]
    kept, out = candidates_in_scope(round_, [])  # tune's default: exact and numerics
    assert {c.playbook for c in kept.candidates} & PARALLEL == PARALLEL - {"mesh-shape"}
    assert [line for line in out if "dp x tp" in line] == [
        "candidate \"Another dp x tp factorisation of the script's mesh\": not searched, a training change "
        "(`--allow training` searches it)"]
    kept, _ = candidates_in_scope(round_, ["training"])
    assert PARALLEL <= {c.playbook for c in kept.candidates}


def test_tp_sizes_follow_the_blocks_widths_and_bf16_params_are_not_proposed_again():
    round_ = propose_offline(dist_profile(EXAMPLES / "fsdp_tp.py", world=4, widths=((32, 6), (6, 32)), dtype="bf16"))
    assert [o[0]["shape"] for o in options(round_, "mesh-shape")] == [(4, 1), (2, 2)]  # 4 does not divide 6
    assert "fsdp-param-dtype" not in {c.playbook for c in round_.candidates}


def test_a_mesh_whose_ranks_read_the_same_batches_is_the_same_math(tmp_path):
    script = tmp_path / "same.py"
    script.write_text("from torch.distributed.device_mesh import init_device_mesh\n"
                      "mesh = init_device_mesh('tpu', (1, 2), mesh_dim_names=('dp', 'tp'))\n")
    round_ = propose_offline(dist_profile(script))
    assert options(round_, "mesh-shape") == [({"shape": (2, 1), "dp_batches": False, "effect": "exact"},)]  # not (1, 2)
    assert "fsdp-reshard-after-forward" not in {c.playbook for c in round_.candidates}  # no fully_shard, no FSDP


def test_ddp_gets_checkpointing_only_and_one_process_gets_none():
    ddp = {c.playbook for c in propose_offline(dist_profile(EXAMPLES / "ddp.py")).candidates}
    assert ddp & PARALLEL == {"activation-checkpointing"}
    single = {c.playbook for c in propose_offline(dist_profile(EXAMPLES / "fsdp_tp.py", world=1)).candidates}
    assert single & PARALLEL == set()


def test_a_parallelism_plan_is_a_point_of_the_projections_space():
    from tpu_agent.plan.actions import ActivationCheckpointing, FsdpReshard, MeshShape, Plan
    from tpu_agent.propose.parallel import slice_plan

    point = slice_plan(Plan(actions=[MeshShape(shape=(2, 2)), ActivationCheckpointing()]), 4)
    assert (point.mesh, point.checkpoint, point.per_chip_batch) == ({"fsdp": 2, "tensor": 2}, True, None)
    assert slice_plan(Plan(actions=[ActivationCheckpointing()]), 4).mesh == {"fsdp": 4}
    assert slice_plan(Plan(actions=[MeshShape(shape=(1, 2))]), 2).mesh == {"tensor": 2}
    assert slice_plan(Plan(actions=[FsdpReshard(reshard=False)]), 2) is None  # not in the projection's space
