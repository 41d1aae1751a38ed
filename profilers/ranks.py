"""The profile of a distributed run (`tpu-agent profile --nproc N`): each rank's own figures, then all of them.

PyTorch's launcher starts the profiled child once per rank; each rank's session writes its own profile to
`ranks/rank<R>/` of the run directory, with a `distributed` section holding that rank's entry alone: its step
time, peak device memory and collectives, the latter timed by the backend on the rank itself (every collective
from issue to completion, backend/distributed/collectives.py). After the job the parent gathers the ranks'
profiles into the run's profile.json: rank 0's profile, whose `distributed` section lists every rank and names
the slowest one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .schema import CollectiveStat, Distributed, Profile, RankProfile, SlowestRank, Step

RANKS_DIR = "ranks"
METHOD = ("each collective timed on its rank from issue to completion (block_until_ready on its result, its input "
          "waited for first), so a rank's time includes waiting for the others to join")


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int


def launch_of(environ=os.environ) -> Launch | None:
    """This process's rank when PyTorch's launcher started it as one of two or more; else None."""
    try:
        world, rank = int(environ.get("WORLD_SIZE", "1")), int(environ.get("RANK", "0"))
    except ValueError:
        return None
    return Launch(rank, world) if world > 1 else None


def rank_dir(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank{rank}"


Key = tuple[str, tuple[int, ...]]


class CollectiveWatch:
    """The backend's collective totals read at step boundaries: what each step ran."""

    def __init__(self) -> None:
        from tpu_agent.backend.distributed import collectives

        self._recorded = collectives.RECORDED
        collectives.record(True)
        self._last = self._read()

    def _read(self) -> dict[Key, tuple[int, int, float]]:
        return {key: (t.calls, t.bytes, t.seconds) for key, t in self._recorded.totals.items()}

    def step(self) -> dict[Key, tuple[int, int, float]]:
        """(calls, bytes, seconds) per (op, ranks) since the last call."""
        now = self._read()
        delta = {}
        for key, (calls, nbytes, seconds) in now.items():
            c0, b0, s0 = self._last.get(key, (0, 0, 0.0))
            if calls > c0:
                delta[key] = (calls - c0, nbytes - b0, seconds - s0)
        self._last = now
        return delta

    @property
    def untimed(self) -> int:
        return self._recorded.untimed

    def stop(self) -> None:
        from tpu_agent.backend.distributed import collectives

        collectives.record(False)


def rank_profile(rank: int, steps: list[Step], per_step: list[dict], *, status: str, exit_code: int | None,
                 live_peak: int | None, step_peak: int | None, xla_peak: int | None, runtime_peak: int | None, untimed: int) -> RankProfile:
    """One rank's figures over the steps the step statistics cover (`per_step[i]`: what step i+1 ran)."""
    from .analysis import percentile, step_stats, steady_steps  # the child's side: the device is loaded there

    chosen, _basis = steady_steps(steps)
    totals: dict[Key, list] = {}
    for st in chosen:
        for key, (calls, nbytes, seconds) in (per_step[st.index - 1] if st.index - 1 < len(per_step) else {}).items():
            acc = totals.setdefault(key, [0, 0, 0.0])
            acc[0] += calls
            acc[1] += nbytes
            acc[2] += seconds
    n = len(chosen)
    collectives = [CollectiveStat(op=op, ranks=list(ranks), count=c, calls_per_step=c / n, bytes=b, bytes_per_call=b / c,
                                  bytes_per_step=b / n, time_s=t, time_per_step_s=t / n,
                                  bandwidth=b / t if t > 0 else None)
                   for (op, ranks), (c, b, t) in sorted(totals.items(), key=lambda kv: -kv[1][2])]
    comm = [st.comm_s or 0.0 for st in chosen]
    wall = sum(st.wall_s for st in chosen)
    return RankProfile(
        rank=rank, status=status, exit_code=exit_code, step_time=step_stats(steps),
        comm_s_per_step=sum(comm) / n if n else None,
        comm_share=sum(comm) / wall if wall > 0 else None,
        compute_s_per_step=percentile([st.wall_s - c for st, c in zip(chosen, comm)], 0.5) if n else None,
        live_peak_bytes=live_peak, step_peak_bytes=step_peak, xla_peak_bytes=xla_peak, runtime_peak_bytes=runtime_peak, collectives=collectives,
        untimed_collectives=untimed,
    )


def slowest(ranks: list[RankProfile]) -> SlowestRank | None:
    """The straggler: the rank with the longest step outside collectives. In a synchronous job every rank's
    step takes as long as the slowest one's (the others wait in their collectives), so its wall time alone
    names no one; without collective times, the longest median step. None with fewer than two ranks measured."""
    if len([r for r in ranks if r.step_time is not None]) < 2:
        return None
    timed = [r for r in ranks if r.compute_s_per_step is not None and r.comm_s_per_step]
    if timed:
        worst = max(timed, key=lambda r: r.compute_s_per_step)
        best = min(r.compute_s_per_step for r in timed)
        return SlowestRank(rank=worst.rank, compute_s_per_step=worst.compute_s_per_step,
                           step_s=worst.step_time.median_s if worst.step_time else None,
                           spread=worst.compute_s_per_step / best - 1 if best > 0 else None,
                           basis="the longest median step time outside collectives (measured): the others wait "
                                 "for it in their collectives")
    stepped = [r for r in ranks if r.step_time is not None]
    if not stepped:
        return None
    worst = max(stepped, key=lambda r: r.step_time.median_s)
    best = min(r.step_time.median_s for r in stepped)
    return SlowestRank(rank=worst.rank, step_s=worst.step_time.median_s,
                       spread=worst.step_time.median_s / best - 1 if best > 0 else None,
                       basis="the longest median step time (measured; no collective was timed)")


def gather(run_dir: Path, world_size: int, exit_code: int) -> Profile | None:
    """The run's profile from its ranks' profiles: rank 0's (the lowest rank's that wrote one) with every rank's
    entry in `distributed`; None when no rank wrote one."""
    profiles: dict[int, Profile] = {}
    notes = []
    for rank in range(world_size):
        path = rank_dir(run_dir, rank) / "profile.json"
        try:
            profiles[rank] = Profile.model_validate_json(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            notes.append(f"rank {rank}'s profile could not be read: {exc}")
    if not profiles:
        return None
    first = min(profiles)
    merged = profiles[first].model_copy(deep=True)
    entries = []
    for rank, prof in sorted(profiles.items()):
        own = prof.distributed.ranks if prof.distributed is not None else []
        entry = own[0] if own else RankProfile(rank=rank, status=prof.status, exit_code=prof.exit_code,
                                               step_time=prof.steps.stats, live_peak_bytes=prof.memory.live_peak_bytes,
                                               step_peak_bytes=prof.memory.step_peak_bytes,
                                               xla_peak_bytes=prof.memory.xla_peak_bytes)
        entry.profile = str(rank_dir(run_dir, rank) / "profile.json")
        entries.append(entry)
    missing = [r for r in range(world_size) if r not in profiles]
    shares = [e.comm_share for e in entries if e.comm_share is not None]
    paces = [e.step_time.median_s for e in entries if e.step_time is not None]
    merged.distributed = Distributed(
        world_size=world_size, ranks=entries, missing_ranks=missing,
        step_time_s=max(paces) if paces else None, comm_share=sum(shares) / len(shares) if shares else None,
        slowest_rank=slowest(entries), method=METHOD)
    merged.run_dir = str(run_dir)
    merged.files.refused = [r for _, prof in sorted(profiles.items()) for r in prof.files.refused]  # every rank's
    failed = [e.rank for e in entries if e.status == "failed"]
    if failed or exit_code != 0:
        merged.status, merged.exit_code = "failed", exit_code
        if merged.error is None and failed:
            merged.error = profiles[failed[0]].error
    merged.notes = [f"a distributed run of {world_size} ranks: this profile is rank {first}'s; every rank's own "
                    f"is in {RANKS_DIR}/rank<R>/profile.json"] + notes + merged.notes
    if missing:
        merged.notes.insert(1, f"rank(s) {', '.join(map(str, missing))} wrote no profile")
    if merged.device is not None and merged.device.platform == "cpu":
        merged.notes.append(f"the {world_size} ranks share this machine's CPU cores: each rank's MFU is against the "
                            "whole CPU's peak")
    return merged
