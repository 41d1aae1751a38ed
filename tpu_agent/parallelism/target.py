"""`tune --target SLICE [--slices N]`: the slice's plans ranked by projection (projection/rank.py's search over a
run.projection.SliceProjector: each trace in a child process, every data x fsdp split of a trace re-costed from it)
before the search measures anything on this host; across N slices the data axis spans them over DCN. After the
search, with --nproc N, the parallelism plans it measured ranked for the slice as well (measured.rank_for_slice)."""

from __future__ import annotations

from typing import Callable

from tpu_agent import slices
from tpu_agent.projection import rank
from tpu_agent.projection.rank import SliceRanking
from tpu_agent.run.projection import projector

from .measured import MeasuredParallelism, rank_for_slice


def for_tune(script: str, args: list[str], target: str, profile, script_batch: int | None,
             say: Callable[[str], None], keep: Callable[[SliceRanking], None]) -> SliceRanking | None:
    """`tune --target SLICE`: the slice's plans ranked by projection, unless the baseline ran on a real TPU (then
    the tune measures; nothing is projected)."""
    sl = slices.read(target)
    device = getattr(profile, "device", None)
    if device is not None and device.platform == "tpu" and not device.emulated:
        say(f"projection: not run, this host is a TPU ({device.device_kind}): the tune measures on it")
        return None
    dims = rank.tensor_dims(getattr(profile, "modules", None))
    across = f" in {sl.slices} slices joined by DCN" if sl.slices > 1 else ""
    say(f"projection ({sl.name}, {sl.total_chips} chips{across}; not attached here): plans ranked by projected step "
        f"time per sample among those that fit per chip, at most {rank.MAX_PROJECTIONS} traces (each trace's data x "
        "fsdp splits re-costed from it); estimates, never verified")
    return rank.rank(sl, projector(script, args, sl, script_batch), dims, script_batch, say=say, keep=keep)


def for_measured(measured: MeasuredParallelism, ranking: SliceRanking, script: str, args: list[str], target: str,
                 script_batch: int | None, say: Callable[[str], None]) -> MeasuredParallelism:
    """`tune --nproc N --target SLICE`: the parallelism plans the tune measured, ranked for the slice by projection
    (the slice ranking's own projections reused)."""
    sl = slices.read(target)
    return rank_for_slice(measured, ranking, projector(script, args, sl, script_batch), say)
