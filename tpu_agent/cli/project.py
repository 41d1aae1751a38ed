"""`tpu-agent project SCRIPT --target v5p-256 [--mesh ...|--plan ...] -- ARGS`: the step projected onto a TPU slice."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from tpu_agent.cli.inputs import check_script
from tpu_agent.cli.options import ScriptArg, ScriptArgs
from tpu_agent.errors import InputError


def _plan_sharding(path: str, chips: int):
    from tpu_agent.cli.run import load_plan
    from tpu_agent.plan.actions import BatchSharding, ShardRule

    plan = load_plan(path)
    if plan.mesh is None:
        raise InputError(f"--plan {path}: the plan has no mesh action; give --mesh")
    rules = [(a.pattern, tuple(a.spec)) for a in plan.actions if isinstance(a, ShardRule)]
    batch = next((a.axis for a in plan.actions if isinstance(a, BatchSharding)), None)
    return dict(plan.mesh.axes), rules, batch


def project(
    script: ScriptArg,
    script_args: ScriptArgs = None,
    target: Annotated[str, typer.Option("--target", metavar="SLICE",
                                        help="A TPU slice: the generation's name (v5p-256, v6e-256, v7x-128: "
                                             "TensorCores on v4/v5p/v7x, chips on v5e/v6e), a topology "
                                             "(tpu7x-4x4x4), or a generation with --chips.")] = ...,
    chips: Annotated[int | None, typer.Option("--chips", metavar="N",
                                              help="Chips in the slice (with --target v7x: --chips 64 is v7x-128).")] = None,
    num_slices: Annotated[int, typer.Option("--slices", metavar="N",
                                            help="N such slices joined by DCN (multislice): the data axis spans them; "
                                                 "--mesh's product is N x the slice's chips.")] = 1,
    mesh: Annotated[str | None, typer.Option("--mesh", metavar="AXIS=N,...",
                                             help="Mesh axes (data, fsdp, tensor, expert); product = chips. "
                                                  "Default: fsdp over every chip.")] = None,
    plan: Annotated[str | None, typer.Option("--plan", metavar="PLAN.json",
                                             help="A plan's mesh, shard_rule and batch_sharding actions.")] = None,
    per_chip_batch: Annotated[int | None, typer.Option("--per-chip-batch", metavar="N",
                                                       help="Trace the step with a global batch of N x the data-"
                                                            "parallel degree in place of the script's.")] = None,
    offload_block_inputs: Annotated[bool, typer.Option(
        "--offload-block-inputs", help="The repeated blocks' inputs saved for backward are held in host memory "
                                       "(MaxText's decoder_layer_input=offload): host memory, not HBM, and their "
                                       "copies over the host link overlapped with compute.")] = False,
    whole: Annotated[bool, typer.Option("--whole", help="Trace every repeated block instead of 2 and 1, scaled.")] = False,
    json_out: Annotated[str | None, typer.Option("--json", metavar="PATH", help="Also write the projection as JSON.")] = None,
) -> int:
    """Project the script's training step onto a TPU slice it has no access to: memory per chip, step time, MFU,
    collectives (an estimate; see docs/projection.md)."""
    from tpu_agent import slices
    from tpu_agent.cli.project_view import render
    from tpu_agent.run.projection import project as projected

    sl = slices.multislice(slices.read(target, chips), num_slices)
    path = check_script(script)
    if mesh and plan:
        raise InputError("give --mesh or --plan, not both")
    rules, batch = [], None
    if plan:
        axes, rules, batch = _plan_sharding(plan, sl.total_chips)
        slices.check_mesh(axes, sl.total_chips, f"--plan {plan}")
    elif mesh:
        axes = slices.parse_mesh(mesh, sl.total_chips)
    else:
        axes = {"data": sl.slices, "fsdp": sl.chips} if sl.slices > 1 else {"fsdp": sl.chips}
    slices.in_slice_mesh(axes, sl)  # refused before any work: a mesh whose data axis does not span the slices
    if per_chip_batch is not None and per_chip_batch < 1:
        raise InputError(f"--per-chip-batch {per_chip_batch}: give 1 or more sequences per chip")
    t0 = time.perf_counter()
    partitioned, projection = projected(str(path), list(script_args or []), sl, axes, rules=rules,
                                        batch_axis=batch, scale_layers=not whole, per_chip_batch=per_chip_batch,
                                        offload_block_inputs=offload_block_inputs)
    print(render(partitioned, projection, time.perf_counter() - t0))
    if json_out:
        Path(json_out).write_text(projection.model_dump_json(indent=2) + "\n")
    return 0


def register(app: typer.Typer) -> None:
    app.command("project")(project)
