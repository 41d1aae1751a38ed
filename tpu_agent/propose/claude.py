"""The Claude proposer: a tool-use loop over the official `anthropic` SDK.

The model reads the evidence through tools (profile summary, hot ops, padding
report, knobs and the source around them, playbooks, trial results) and
answers by calling `submit_proposals`. Its answer is data: it is validated by
pydantic against the `Plan` action kinds and the discovered knobs, and an
invalid one goes back to it with the error, a few times at most. Nothing the
model writes is ever executed; the source changes only through `PadDim` on a
knob the knob finder reported.

API failures (401/403, 429, 5xx, timeouts, no network) get bounded retries
with backoff (none for authentication errors: retrying cannot fix a key),
then the offline proposer takes over and says so. The key is read by the SDK
from ANTHROPIC_API_KEY only; it is never passed around, and every record
written for audit is scrubbed of it.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

from tpu_agent import envvars
from tpu_agent.config import TuneOptions
from tpu_agent.profilers.schema import Profile
from tpu_agent.propose.base import ProposalRound, Proposer, TokenUsage, TrialOutcome
from tpu_agent.propose.claude_tools import (  # noqa: F401 - SUBMIT_TOOL re-exported
    NAME,
    SUBMIT_TOOL,
    SYSTEM,
    TOOLS,
    ProposalError,
    _Context,
    _run_tool,
    to_candidates,
)
from tpu_agent.propose.knobs import Knob
from tpu_agent.propose.offline import propose_offline
from tpu_agent.propose.playbook import Playbook, builtin_playbooks

DEFAULT_MODEL = "claude-sonnet-5"
DEFAULT_TOKEN_BUDGET: int = TuneOptions.model_fields["token_budget"].default  # --token-budget's, declared in config
KEY_ENV = envvars.ANTHROPIC_API_KEY.name


# ------------------------------------------------------------------ the loop


class ApiFailure(Exception):
    """The API could not be used after the retries this kind of failure gets."""


def _secret() -> str | None:
    key = envvars.ANTHROPIC_API_KEY.get()
    return key if key and len(key) >= 8 else None


def scrub(text: str) -> str:
    """Remove the API key from anything about to be written or shown."""
    key = _secret()
    return text.replace(key, "[redacted]") if key else text


def _say(message: str) -> None:
    sys.stderr.write(f"tpu-agent: {message}\n")
    sys.stderr.flush()


def _block(b: Any) -> dict:
    """A response content block as the plain dict the next request carries."""
    kind = getattr(b, "type", None)
    if kind == "text":
        return {"type": "text", "text": b.text}
    if kind == "tool_use":
        return {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input}
    if hasattr(b, "model_dump"):
        return b.model_dump(mode="json", exclude_none=True)
    return dict(b)


class ClaudeProposer(Proposer):
    """One conversation across rounds: round k+1 starts by showing the model round k's trial results."""

    name: ClassVar[str] = NAME

    def __init__(self, *, client: Any = None, model: str = DEFAULT_MODEL, http_client: Any = None,
                 token_budget: int = DEFAULT_TOKEN_BUDGET, max_tokens: int = 4096, max_turns: int = 12,
                 max_invalid: int = 3, retries: int = 3, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 timeout_s: float = 120.0, audit_dir: str | Path | None = None, source_root: str | Path | None = None,
                 say: Callable[[str], None] | None = _say, sleep: Callable[[float], None] = time.sleep):
        self.model, self.max_tokens, self.max_turns, self.max_invalid = model, max_tokens, max_turns, max_invalid
        self.retries, self.backoff_s, self.max_backoff_s, self.timeout_s = retries, backoff_s, max_backoff_s, timeout_s
        self.audit_dir = Path(audit_dir) if audit_dir is not None else None
        self.source_root = Path(source_root) if source_root is not None else None
        self.say, self.sleep = say or (lambda _m: None), sleep
        self.usage = TokenUsage(budget=token_budget)
        self._client, self._http_client = client, http_client
        self._messages: list[dict] = []
        self._pending: list[dict] = []  # tool results owed to the model's last turn, sent with the next round
        self._disabled: str | None = None

    # -- plumbing

    def _get_client(self):
        if self._client is None:
            if not envvars.ANTHROPIC_API_KEY.get():
                raise ApiFailure(f"{KEY_ENV} is not set")
            import anthropic

            kwargs = {"max_retries": 0, "timeout": self.timeout_s}  # retries are ours: bounded, logged
            if self._http_client is not None:
                kwargs["http_client"] = self._http_client
            self._client = anthropic.Anthropic(**kwargs)  # reads the key from the environment itself
        return self._client

    def _record(self, transcript: list[dict], round: int, record: dict) -> None:
        record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "round": round, **record}
        record = json.loads(scrub(json.dumps(record, default=str)))
        transcript.append(record)
        if self.audit_dir is not None:
            self.audit_dir.mkdir(parents=True, exist_ok=True)
            with open(self.audit_dir / f"claude-round-{round:02d}.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def _create(self, transcript: list[dict], round: int):
        import anthropic

        client = self._get_client()
        attempt = 0
        while True:
            try:
                return client.messages.create(model=self.model, max_tokens=self.max_tokens, system=SYSTEM,
                                              tools=TOOLS, messages=self._messages)
            except (anthropic.AuthenticationError, anthropic.PermissionDeniedError) as exc:
                self._record(transcript, round, {"kind": "error", "status": exc.status_code, "error": str(exc)})
                raise ApiFailure(f"the API refused the key ({exc.status_code}); check {KEY_ENV}") from None
            except anthropic.APIStatusError as exc:
                retryable = exc.status_code in (408, 409, 429) or exc.status_code >= 500
                why = f"HTTP {exc.status_code}"
                after = exc.response.headers.get("retry-after") if exc.response is not None else None
                self._record(transcript, round, {"kind": "error", "status": exc.status_code, "error": str(exc)})
                if not retryable:
                    raise ApiFailure(f"the API answered {why}: {scrub(str(exc))[:200]}") from None
            except anthropic.APITimeoutError as exc:
                why, after = "a timeout", None
                self._record(transcript, round, {"kind": "error", "error": f"timeout: {exc}"})
            except anthropic.APIConnectionError as exc:
                why, after = "no connection", None
                self._record(transcript, round, {"kind": "error", "error": f"connection: {exc}"})
            if attempt >= self.retries:
                raise ApiFailure(f"{why} after {attempt + 1} attempts")
            try:
                delay = float(after) if after is not None else self.backoff_s * 2 ** attempt
            except ValueError:
                delay = self.backoff_s * 2 ** attempt
            delay = min(max(delay, 0.0), self.max_backoff_s)
            self._record(transcript, round, {"kind": "retry", "attempt": attempt + 1, "after_s": delay, "why": why})
            self.sleep(delay)
            attempt += 1

    def _fallback(self, reason: str, profile, knobs, playbooks, results, round, transcript, *, permanent: bool):
        if permanent:
            self._disabled = reason
        self._messages, self._pending = [], []
        note = f"Claude proposer: {reason}; the offline proposer takes over for round {round}"
        self.say(note)
        self._record(transcript, round, {"kind": "fallback", "reason": reason})
        out = propose_offline(profile, knobs, playbooks, results, round)
        return out.model_copy(update={
            "requested": NAME, "fallback": reason, "notes": [note, *self._usage_notes()],
            "transcript": transcript + [{"offline": out.transcript}], "usage": self.usage.model_copy(),
        })

    def _usage_notes(self) -> list[str]:
        u = self.usage
        return [f"Claude tokens: {u.input_tokens} in + {u.output_tokens} out = {u.total} of a {u.budget} budget "
                f"over {u.calls} call(s)"]

    def _opening(self, ctx: _Context, round: int) -> list[dict]:
        p = ctx.profile
        step = f"{p.steps.stats.median_s * 1e3:.3g} ms" if p.steps.stats else "unknown"
        tried = f"{len(ctx.results)} trial(s) so far: call trial_results." if ctx.results else "No trials yet."
        text = (f"Round {round}. Script {p.script}, baseline step {step}, mode {p.mode_used}, "
                f"{len(ctx.knobs)} knob(s), {len(ctx.playbooks)} playbook(s). {tried} "
                "Read what you need with the tools, then call submit_proposals.")
        return [{"type": "text", "text": text}]

    # -- the round

    def propose(self, profile: Profile, knobs: Sequence[Knob] = (), playbooks: Sequence[Playbook] | None = None,
                results: Sequence[TrialOutcome] = (), round: int = 1) -> ProposalRound:
        knob_refs = list(knobs)
        books = list(playbooks) if playbooks is not None else builtin_playbooks()
        outcomes = list(results)
        transcript: list[dict] = []
        args = (profile, knob_refs, books, outcomes, round, transcript)
        if self._disabled:
            return self._fallback(f"still unavailable ({self._disabled})", *args, permanent=True)
        ctx = _Context(profile, knob_refs, books, outcomes, self.source_root)
        if not self._messages and self.audit_dir is not None:
            self._record(transcript, round, {"kind": "setup", "model": self.model, "system": SYSTEM, "tools": TOOLS})
        self._messages.append({"role": "user", "content": [*self._pending, *self._opening(ctx, round)]})
        self._pending = []
        sent = len(self._messages) - 1
        invalid = 0
        for turn in range(1, self.max_turns + 1):
            if self.usage.budget is not None and self.usage.total >= self.usage.budget:
                return self._fallback(f"the token budget ({self.usage.budget}) is spent", *args, permanent=True)
            self._record(transcript, round, {"kind": "request", "turn": turn, "model": self.model,
                                             "messages": self._messages[sent:]})
            try:
                response = self._create(transcript, round)
            except ApiFailure as exc:
                return self._fallback(str(exc), *args, permanent=True)
            usage = getattr(response, "usage", None)
            self.usage.calls += 1
            self.usage.input_tokens += int(getattr(usage, "input_tokens", 0) or 0)
            self.usage.output_tokens += int(getattr(usage, "output_tokens", 0) or 0)
            content = [_block(b) for b in response.content]
            self._record(transcript, round, {"kind": "response", "turn": turn, "stop_reason": response.stop_reason,
                                             "content": content, "usage": self.usage.model_dump()})
            self._messages.append({"role": "assistant", "content": content})
            uses = [b for b in content if b.get("type") == "tool_use"]
            if not uses:
                invalid += 1
                if invalid > self.max_invalid:
                    return self._fallback(f"no valid proposal after {invalid} malformed answers", *args, permanent=False)
                self._messages.append({"role": "user", "content": [{"type": "text", "text": (
                    "That answer was not a submit_proposals call. Answer only by calling the tools; "
                    "finish with submit_proposals.")}]})
                sent = len(self._messages) - 1
                continue
            replies, accepted = [], None
            for use in uses:
                if use["name"] == "submit_proposals":
                    try:
                        accepted = to_candidates(use["input"], ctx, round)
                        replies.append({"type": "tool_result", "tool_use_id": use["id"],
                                        "content": f"accepted {len(accepted)} proposal(s); the search runs them next"})
                        self._record(transcript, round, {"kind": "accepted", "turn": turn,
                                                         "candidates": [c.id for c in accepted]})
                    except ProposalError as exc:
                        invalid += 1
                        replies.append({"type": "tool_result", "tool_use_id": use["id"], "is_error": True,
                                        "content": f"invalid submission, nothing was accepted: {exc}"})
                        self._record(transcript, round, {"kind": "invalid", "turn": turn, "error": str(exc)})
                else:
                    text, is_error = _run_tool(ctx, use["name"], use.get("input"))
                    reply = {"type": "tool_result", "tool_use_id": use["id"], "content": text}
                    replies.append({**reply, "is_error": True} if is_error else reply)
            if accepted is not None:
                self._pending = replies  # owed to this turn: they open the next round's message
                return ProposalRound(proposer=NAME, requested=NAME, round=round, candidates=accepted,
                                     transcript=transcript, notes=self._usage_notes(), usage=self.usage.model_copy())
            if invalid > self.max_invalid:
                return self._fallback(f"no valid proposal after {invalid} invalid answers", *args, permanent=False)
            self._messages.append({"role": "user", "content": replies})
            sent = len(self._messages) - 1
        return self._fallback(f"no proposal within {self.max_turns} turns", *args, permanent=False)


def propose_claude(profile: Profile, knobs: Sequence[Knob] = (), playbooks: Sequence[Playbook] | None = None,
                   results: Sequence[TrialOutcome] = (), round: int = 1, **options) -> ProposalRound:
    """One round with a fresh conversation (tune keeps a ClaudeProposer across rounds instead)."""
    return ClaudeProposer(**options).propose(profile, knobs, playbooks, results, round)
