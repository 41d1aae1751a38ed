"""Proposers: who decides what to try. Offline (playbooks, the default) or Claude (with a key).

Also the inputs they read: the knob finder (knobs.py) and the playbooks
(conditions.py, playbook.py). `choose_proposer` decides, once, which proposer a
run uses and why (a `ProposerChoice`), `make_proposer` builds that one, and every proposer (a `Proposer`,
base.py) answers `propose(profile, knobs, playbooks, results, round)` with a
`ProposalRound` (ranked candidates, a transcript, notes said out loud).
"""

from __future__ import annotations

from typing import Any, Mapping, get_args

from pydantic import BaseModel, ConfigDict

from tpu_agent import envvars
from tpu_agent.config import ChosenProposer, ProposerName
from tpu_agent.errors import InputError
from tpu_agent.propose.base import ProposalRound, Proposer, TokenUsage, TrialOutcome
from tpu_agent.propose.candidates import ActionTemplate, Candidate, Evidence

PROPOSERS: tuple[str, ...] = get_args(ProposerName)  # what --proposer accepts, as config declares it

__all__ = [
    "ActionTemplate", "Candidate", "Evidence", "ProposalRound", "Proposer", "TokenUsage", "TrialOutcome",
    "OfflineProposer", "propose_offline", "ProposerChoice", "choose_proposer", "make_proposer", "PROPOSERS",
]


def __getattr__(name: str):
    """The offline proposer loads playbooks, which use base's models: import it on first use (no cycle)."""
    if name in ("OfflineProposer", "propose_offline"):
        from tpu_agent.propose import offline

        return getattr(offline, name)
    raise AttributeError(name)


class ProposerChoice(BaseModel):
    """Which proposer a tune runs and why (`tune` prints both): decided once, by `choose_proposer`."""

    model_config = ConfigDict(frozen=True)

    name: ChosenProposer
    why: str


def choose_proposer(requested: str = "auto", offline: bool = False,
                    env: Mapping[str, str] | None = None) -> ProposerChoice:
    """The one decision: `--offline` wins; `auto` means Claude exactly when ANTHROPIC_API_KEY is set."""
    if requested not in PROPOSERS:
        raise InputError(f"unknown proposer {requested!r} (choose from {', '.join(PROPOSERS)})")
    if offline:
        if requested == "claude":
            raise InputError("--proposer claude and --offline contradict each other; drop one")
        return ProposerChoice(name="offline", why="--offline")
    if requested == "offline":
        return ProposerChoice(name="offline", why="--proposer offline")
    if requested == "claude":
        return ProposerChoice(name="claude", why="--proposer claude")
    if envvars.ANTHROPIC_API_KEY.get(env):
        return ProposerChoice(name="claude", why="ANTHROPIC_API_KEY is set (use --offline to keep to the playbooks)")
    return ProposerChoice(name="offline", why="no ANTHROPIC_API_KEY in the environment")


def make_proposer(chosen: ProposerChoice | ChosenProposer, **claude_options: Any) -> Proposer:
    """The proposer `choose_proposer` chose (its choice, or the chosen name), built; nothing is decided again.
    `claude_options` go to ClaudeProposer (model, audit_dir, token_budget...)."""
    name = chosen.name if isinstance(chosen, ProposerChoice) else chosen
    if name not in get_args(ChosenProposer):
        raise ValueError(f"make_proposer builds a chosen proposer ({' or '.join(get_args(ChosenProposer))}), "
                         f"not {name!r}: choose_proposer decides")
    if name == "offline":
        from tpu_agent.propose.offline import OfflineProposer

        return OfflineProposer()
    from tpu_agent.propose.claude import ClaudeProposer

    return ClaudeProposer(**claude_options)
