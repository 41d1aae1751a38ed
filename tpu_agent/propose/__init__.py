"""Proposers: who decides what to try. Offline (playbooks, the default) or Claude (with a key).

Also the inputs they read: the knob finder (knobs.py) and the playbooks
(conditions.py, playbook.py). `choose_proposer` says which proposer a run
uses and why, `make_proposer` builds it, and every proposer (a `Proposer`,
base.py) answers `propose(profile, knobs, playbooks, results, round)` with a
`ProposalRound` (ranked candidates, a transcript, notes said out loud).
"""

from __future__ import annotations

from typing import Any, Mapping

from tpu_agent import envvars
from tpu_agent.errors import InputError
from tpu_agent.propose.base import ProposalRound, Proposer, TokenUsage, TrialOutcome
from tpu_agent.propose.candidates import ActionTemplate, Candidate, Evidence

PROPOSERS = ("auto", "offline", "claude")

__all__ = [
    "ActionTemplate", "Candidate", "Evidence", "ProposalRound", "Proposer", "TokenUsage", "TrialOutcome",
    "OfflineProposer", "propose_offline", "choose_proposer", "make_proposer", "PROPOSERS",
]


def __getattr__(name: str):
    """The offline proposer loads playbooks, which use base's models: import it on first use (no cycle)."""
    if name in ("OfflineProposer", "propose_offline"):
        from tpu_agent.propose import offline

        return getattr(offline, name)
    raise AttributeError(name)


def choose_proposer(requested: str = "auto", offline: bool = False,
                    env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(offline | claude, why): `--offline` wins; `auto` means Claude exactly when ANTHROPIC_API_KEY is set."""
    if requested not in PROPOSERS:
        raise InputError(f"unknown proposer {requested!r} (choose from {', '.join(PROPOSERS)})")
    if offline:
        if requested == "claude":
            raise InputError("--proposer claude and --offline contradict each other; drop one")
        return "offline", "--offline"
    if requested == "offline":
        return "offline", "--proposer offline"
    if requested == "claude":
        return "claude", "--proposer claude"
    if envvars.ANTHROPIC_API_KEY.get(env):
        return "claude", "ANTHROPIC_API_KEY is set (use --offline to keep to the playbooks)"
    return "offline", "no ANTHROPIC_API_KEY in the environment"


def make_proposer(requested: str = "auto", offline: bool = False, *, env: Mapping[str, str] | None = None,
                  **claude_options: Any) -> Proposer:
    """The proposer `choose_proposer` picks; `claude_options` go to ClaudeProposer (model, audit_dir, token_budget...)."""
    name, _why = choose_proposer(requested, offline, env)
    if name == "offline":
        from tpu_agent.propose.offline import OfflineProposer

        return OfflineProposer()
    from tpu_agent.propose.claude import ClaudeProposer

    return ClaudeProposer(**claude_options)
