"""The search space: the candidates whose options the study combines, one categorical choice each ("off"
included); sampling says which plan a trial's picks make."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpu_agent.propose.base import Candidate, ProposalRound

OFF = "off"


@dataclass
class Space:
    """The candidates whose options span the search, with their option lists."""

    candidates: list[Candidate]
    options: dict[str, list[tuple]] = field(default_factory=dict)


def build_space(round_: ProposalRound, limit: int, previous: Space | None = None) -> Space:
    """The top candidates (and their options) that the search will combine; earlier rounds' stay."""
    chosen = list(previous.candidates) if previous else []
    options = dict(previous.options) if previous else {}
    limit += len(chosen)
    for cand in round_.candidates:
        if cand.id in options:
            continue
        try:
            opts = cand.options()
        except ValueError:
            continue
        if not opts:
            continue
        # A plan holds at most one action of a single kind (one pad_ops, one compile): a candidate that would
        # add a second one is another option of the same choice, not a choice TPE could combine into invalid plans.
        singles = {a.kind for opt in opts for a in opt if type(a).single}
        twin = next((c for c in chosen if singles & {a.kind for opt in options[c.id] for a in opt if type(a).single}),
                    None)
        if twin is not None:
            options[twin.id] = options[twin.id] + [o for o in opts if o not in options[twin.id]]
            continue
        chosen.append(cand)
        options[cand.id] = opts
        if len(chosen) >= limit:
            break
    return Space(candidates=chosen, options=options)
