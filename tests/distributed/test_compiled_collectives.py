"""Collectives inside `torch.compile(step)` programs (issue #26 point 1; backend/distributed/in_program.py): what the
ranks' check compares before a program with collectives runs. The 2-rank job (a DDP step and an FSDP2 step, per
layer and root with AdamW, each captured with its all-reduces / all-gathers / reduce-scatters as parts of the
program and replayed as ONE program per step, only the ranks' check between programs, training as the same model
does on CPU gloo; a rank that reads its loss mid-step; FSDP2 under compiled steps, its forward holding its
all-gathers run as written inside the step's window; and fused mode's graphs holding the collectives) is COMPILED,
a part of the job in tests/distributed/test_collectives.py."""

from __future__ import annotations


HLO = """
  %p = f32[32]{0} slice(%param.1), slice={[{offset}:{end}]}
  %all-gather.1 = f32[64]{0} all-gather(f32[32]{0} %p), channel_id=1, replica_groups={{0,1}}, dimensions={0}, \
use_global_device_ids=true, metadata={op_name="jit(graph)/all_gather" stack_frame_id=3}
  %all-reduce.2 = (f32[4]{0}, f32[4]{0}) all-reduce(%a, %b), channel_id=2, replica_groups={{0,1}}, \
to_apply=%region_0.1, metadata={op_name="jit(graph)/psum"}
  %rs = f32[2]{0} reduce-scatter(f32[4]{0} %c), channel_id=3, replica_groups={{0,1}}, dimensions={0}, to_apply=%r
"""


def test_ranks_agree_on_the_order_of_their_collectives_not_on_the_rest_of_their_programs():
    """What the ranks' check compares (in_program.collective_order): FSDP2's two ranks slice at their own offsets
    and still agree; the same collectives scheduled in another order (as XLA did for two programs differing only in
    a constant, which then hung) do not, nor another shape."""
    from tpu_agent.backend.distributed.in_program import collective_order

    rank0 = HLO.replace("{offset}", "0").replace("{end}", "32")
    rank1 = HLO.replace("{offset}", "32").replace("{end}", "64")
    assert collective_order(rank0) == collective_order(rank1)
    assert len(collective_order(rank0).splitlines()) == 3 and "metadata" not in collective_order(rank0)
    lines = rank0.strip().splitlines()
    reordered = "\n".join([lines[0], lines[2], lines[1], lines[3]])  # the all-reduce before the all-gather
    assert collective_order(reordered) != collective_order(rank0)
    assert collective_order(rank0.replace("f32[2]{0} reduce", "f32[3]{0} reduce")) != collective_order(rank0)
