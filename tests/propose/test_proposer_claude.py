"""The Claude proposer without a network: a fake client, and the real SDK over httpx2.MockTransport.

The SDK (anthropic 2.x) uses `httpx2`, its own httpx fork, so the mock
transport and client come from httpx2. The exchanges in tests/data/claude are
written in the Messages API's wire format (not captured from the live API).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import anthropic
import httpx2
import pytest

from support.claude import FakeClient, message, use
from support.paths import DATA
from support.profiles import example_knobs, knob, profile, recorded_script
from tpu_agent.plan.actions import Compile, PadDim, PadOps
from tpu_agent.propose.claude import DEFAULT_MODEL, SUBMIT_TOOL, TOOLS, ClaudeProposer, propose_claude
from tpu_agent.propose.base import TrialOutcome
from tpu_agent.propose.offline import propose_offline

GOOD = json.loads((DATA / "claude" / "tool_use_turns.json").read_text())["exchanges"][2]["body"]["content"][1]["input"]


# ------------------------------------------------------------------ helpers


def tool_results(request) -> dict:
    """tool_use_id -> tool_result block of the request's last user message."""
    last = request["messages"][-1]
    assert last["role"] == "user"
    return {b["tool_use_id"]: b for b in last["content"] if b.get("type") == "tool_result"}


def assert_well_formed(messages):
    """Roles alternate, and every tool_use is answered in the next user message."""
    assert messages[0]["role"] == "user"
    for a, b in zip(messages, messages[1:]):
        assert a["role"] != b["role"]
        if a["role"] == "assistant":
            asked = {c["id"] for c in a["content"] if c["type"] == "tool_use"}
            answered = {c["tool_use_id"] for c in b["content"] if isinstance(c, dict) and c.get("type") == "tool_result"}
            assert asked == answered


def proposer(client=None, **kw) -> ClaudeProposer:
    said = []
    p = ClaudeProposer(client=client, say=said.append, sleep=lambda s: said.append(f"sleep {s}"),
                       source_root=recorded_script("odd_mlp").parent, **kw)
    p.said = said
    return p


def odd():
    return profile("odd_mlp"), example_knobs("odd_mlp")


# ------------------------------------------------------------------ fake client


def test_tool_use_over_turns_reads_real_evidence_and_returns_valid_candidates():
    prof, knobs = odd()
    client = FakeClient([
        message([use("profile_summary", {}, "t1"), use("padding_report", {}, "t2")]),
        message([use("source_excerpt", {"knob": "NUM_CLASSES", "context": 1}, "t3"), use("list_playbooks", {}, "t4")]),
        message([use("submit_proposals", GOOD, "t5")]),
    ])
    p = proposer(client)
    out = p.propose(prof, knobs)
    assert out.proposer == out.requested == "claude" and out.fallback is None
    summary = json.loads(tool_results(client.requests[1])["t1"]["content"])
    assert summary["mode_used"] == "fused" and summary["padding_waste"] == pytest.approx(prof.padding.total_waste.value)
    report = json.loads(tool_results(client.requests[1])["t2"]["content"])
    assert [d["size"] for d in report["dims"]] == [d.size for d in prof.padding.dims]
    excerpt = json.loads(tool_results(client.requests[2])["t3"]["content"])["excerpt"]
    assert ">   19  NUM_CLASSES = 10" in excerpt and len(excerpt.splitlines()) == 3
    books = json.loads(tool_results(client.requests[2])["t4"]["content"])
    listed = {b["id"]: b for b in books}
    assert listed["pad-ops"]["applies"] is True and listed["data-parallel"]["applies"] is False
    assert "max_growth" in listed["pad-vocab"]["why"]
    # The request carried the tools, the system prompt and the model.
    assert client.requests[0]["model"] == DEFAULT_MODEL and client.requests[0]["tools"] == TOOLS
    assert_well_formed(client.requests[-1]["messages"])

    first, second = out.candidates
    assert first.proposer == "claude" and first.playbook == "pad-vocab" and first.rank == 1
    (option,) = first.options()
    assert option == (PadDim(file="odd_mlp.py", line=19, column=14, old=10, new=128, name="NUM_CLASSES"),)
    assert second.options() == [(PadOps(multiple=128), Compile(mode="compiled"))]
    # Compiled steps round Adam's update differently (class numerics): neither candidate keeps the losses exactly.
    assert not second.preserves_numerics and not first.preserves_numerics
    assert out.usage.calls == 3 and out.usage.total == 450
    assert "450 of a 200000 budget" in out.notes[0]


def test_round_two_shows_the_results_and_continues_the_conversation():
    prof, knobs = odd()
    client = FakeClient([message([use("submit_proposals", GOOD, "s1")]),
                         message([use("trial_results", {}, "r1")]),
                         message([use("submit_proposals", GOOD, "s2")])])
    p = proposer(client)
    p.propose(prof, knobs, round=1)
    results = [TrialOutcome(number=0, candidate="claude-r1-1", status="rejected", speedup=0.98,
                            actions=[PadDim(file="odd_mlp.py", line=19, column=14, old=10, new=128)],
                            note="loss worse than the tolerance")]
    out = p.propose(prof, knobs, results=results, round=2)
    opening = client.requests[1]["messages"][-1]["content"]
    assert opening[0] == {"type": "tool_result", "tool_use_id": "s1",
                          "content": "accepted 2 proposal(s); the search runs them next"}
    assert "Round 2" in opening[1]["text"] and "1 trial(s) so far" in opening[1]["text"]
    shown = json.loads(tool_results(client.requests[2])["r1"]["content"])
    assert shown[0]["status"] == "rejected" and shown[0]["note"] == "loss worse than the tolerance"
    assert_well_formed(client.requests[2]["messages"])
    assert out.round == 2 and out.candidates[0].id == "claude-r2-1" and out.usage.calls == 3


@pytest.mark.parametrize(("bad", "expected"), [
    ({"proposals": [{"title": "t", "reason": "r", "actions": [{"kind": "shell", "fixed": {"cmd": "rm -rf /"}}]}]},
     "proposals[0].actions[0].kind: Input should be 'pad_dim'"),
    ({"proposals": [{"title": "t", "reason": "r", "actions": [{"kind": "pad_dim", "knob": "os.py:1:0", "choices": {"new": [2]}}]}]},
     "proposals[0].actions[0].knob: pad_dim must name a knob from list_knobs"),
    ({"proposals": [{"title": "t", "reason": "r", "actions": [
        {"kind": "pad_dim", "knob": "BATCH", "fixed": {"file": "../x.py"}, "choices": {"new": [128]}}]}]},
     "set only `new` (got file)"),
    ({"proposals": [{"title": "t", "reason": "r", "actions": [
        {"kind": "pad_dim", "knob": "BATCH", "choices": {"new": [128], "file": ["/etc/passwd"]}}]}]},
     "proposals[0].actions[0]: pad_dim takes its file, line, column and old value from the knob; set only `new` (got file)"),
    ({"proposals": [{"title": "t", "reason": "r", "actions": [{"kind": "pad_dim", "knob": "BATCH", "choices": {"new": [127, "x"]}}]}]},
     "127, 'x' is not a new size for BATCH"),
    ({"proposals": [{"title": "t", "reason": "r", "actions": [{"kind": "pad_ops", "choices": {"multiple": [100000]}}]}]},
     "proposals[0].actions[0].choices.multiple: Input should be less than or equal to 1024"),
    ({"proposals": [{"title": "t", "reason": "r", "actions": [{"kind": "mesh", "fixed": {"axes": {"data": 4}}}]}]},
     "needs 4 devices; the profile ran on 1"),
    ({"proposals": [{"title": "t", "reason": "r", "actions": [{"kind": "batch_sharding", "fixed": {"axis": "data"}}]}]},
     "batch_sharding needs a mesh action"),
    ({"proposals": [{"title": "t", "reason": "r", "playbook": "go-fast", "actions": [{"kind": "pad_ops"}]}]},
     "proposals[0].playbook: unknown playbook 'go-fast'"),
    ({"proposals": []}, "proposals: List should have at least 1 item"),
    ({"proposals": [{"title": "t", "reason": "r", "actions": [{"kind": "pad_ops"}], "code": "print(1)"}]},
     "proposals[0].code: Extra inputs are not permitted"),
])
def test_invalid_proposals_go_back_with_the_error_then_a_fix_is_accepted(bad, expected):
    prof, knobs = odd()
    client = FakeClient([message([use("submit_proposals", bad, "bad")]), message([use("submit_proposals", GOOD, "ok")])])
    out = proposer(client).propose(prof, knobs)
    reply = tool_results(client.requests[1])["bad"]
    assert reply["is_error"] is True and expected in reply["content"], reply["content"]
    assert out.proposer == "claude" and len(out.candidates) == 2
    assert any(r["kind"] == "invalid" for r in out.transcript)


def test_too_many_invalid_answers_fall_back_to_offline_out_loud(tmp_path):
    prof, knobs = odd()
    bad = {"proposals": [{"title": "t", "reason": "r", "actions": [{"kind": "compile", "fixed": {"mode": "turbo"}}]}]}
    client = FakeClient([message([use("submit_proposals", bad)]) for _ in range(3)]
                        + [message([{"type": "text", "text": "I give up"}], stop="end_turn")])
    p = proposer(client, max_invalid=3)
    out = p.propose(prof, knobs)
    assert out.proposer == "offline" and out.requested == "claude"
    assert out.fallback == "no valid proposal after 4 malformed answers"
    assert p.said == [f"Claude proposer: {out.fallback}; the offline proposer takes over for round 1"]
    assert out.notes[0] == p.said[0]
    assert [c.id for c in out.candidates] == [c.id for c in propose_offline(prof, knobs).candidates]


def test_model_text_is_never_executed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prof, knobs = odd()
    code = "__import__('os').system('touch PWNED')"
    evil = {"proposals": [{"title": code, "reason": code, "evidence": [code],
                           "actions": [{"kind": "shard_rule", "fixed": {"pattern": code, "spec": ["data"]}},
                                       {"kind": "mesh", "fixed": {"axes": {"data": 1}}}]}]}
    client = FakeClient([message([{"type": "text", "text": code}, use("submit_proposals", evil)])])
    out = proposer(client).propose(prof, knobs)
    assert not (tmp_path / "PWNED").exists()
    rule = out.candidates[0].options()[0][0]
    assert rule.pattern == code  # a glob string matched against parameter names, nothing more


def test_source_excerpt_reads_only_the_scripts_files(tmp_path):
    prof, _ = odd()
    (tmp_path / "secret.txt").write_text("API_KEY = 1\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("WIDTH = 100\n")
    knobs = [knob("../secret.txt", 1, 10, 1, "API_KEY"), knob("train.py", 1, 8, 100, "WIDTH")]
    client = FakeClient([message([use("source_excerpt", {"knob": "API_KEY"}, "a"),
                                  use("source_excerpt", {"knob": "WIDTH"}, "b"),
                                  use("source_excerpt", {"knob": "nope"}, "c"),
                                  use("read_file", {"path": "/etc/passwd"}, "d")]),
                         message([use("submit_proposals", GOOD | {"proposals": GOOD["proposals"][1:]})])])
    ClaudeProposer(client=client, say=None, source_root=tmp_path / "src").propose(prof, knobs)
    replies = tool_results(client.requests[1])
    assert replies["a"]["is_error"] and "API_KEY = 1" not in replies["a"]["content"]
    assert "WIDTH = 100" in replies["b"]["content"] and "is_error" not in replies["b"]
    assert replies["c"]["is_error"] and "unknown knob 'nope'" in replies["c"]["content"]
    assert replies["d"]["is_error"] and "unknown tool 'read_file'" in replies["d"]["content"]


def test_token_budget_is_reported_and_ends_claude_rounds():
    prof, knobs = odd()
    client = FakeClient([message([use("profile_summary", {})], tokens=(900, 200))])
    p = proposer(client, token_budget=1000)
    out = p.propose(prof, knobs)
    assert out.proposer == "offline" and out.fallback == "the token budget (1000) is spent"
    assert out.usage.total == 1100 and out.usage.budget == 1000
    assert "1100 of a 1000 budget over 1 call(s)" in out.notes[1]
    again = p.propose(prof, knobs, round=2)
    assert again.proposer == "offline" and again.fallback.startswith("still unavailable")
    assert len(client.requests) == 1


def test_no_key_falls_back_without_a_request(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    said = []
    out = propose_claude(profile("odd_mlp"), example_knobs("odd_mlp"), say=said.append)
    assert out.proposer == "offline" and out.fallback == "ANTHROPIC_API_KEY is not set"
    assert said and "offline proposer takes over" in said[0]


def test_connection_errors_get_bounded_retries_with_backoff():
    prof, knobs = odd()
    request = httpx2.Request("POST", "https://api.anthropic.com/v1/messages")
    client = FakeClient([anthropic.APIConnectionError(request=request)] * 4)
    p = proposer(client, retries=3, backoff_s=0.5)
    out = p.propose(prof, knobs)
    assert out.fallback == "no connection after 4 attempts"
    assert [s for s in p.said if s.startswith("sleep")] == ["sleep 0.5", "sleep 1.0", "sleep 2.0"]
    assert len(client.requests) == 4


# ------------------------------------------------------------------ the real SDK over a mock transport


class Replay:
    """An httpx2 transport that answers from a recorded scenario and keeps every request."""

    def __init__(self, scenario: str, key: str = ""):
        self.exchanges = json.loads((DATA / "claude" / f"{scenario}.json").read_text())["exchanges"]
        self.key, self.requests = key, []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append({"url": str(request.url), "headers": dict(request.headers),
                              "json": json.loads(request.content)})
        ex = self.exchanges[len(self.requests) - 1]
        body = json.dumps(ex["body"]).replace("{KEY}", self.key)
        return httpx2.Response(ex["status"], headers=ex["headers"], content=body.encode())

    def client(self) -> httpx2.Client:
        return httpx2.Client(transport=httpx2.MockTransport(self))


@pytest.fixture
def key(monkeypatch) -> str:
    value = "sk-ant-test-" + secrets.token_hex(16)
    monkeypatch.setenv("ANTHROPIC_API_KEY", value)
    return value


def sdk_proposer(replay: Replay, audit_dir: Path | None = None, **kw) -> ClaudeProposer:
    said = []
    p = ClaudeProposer(http_client=replay.client(), audit_dir=audit_dir, source_root=recorded_script("odd_mlp").parent,
                       say=said.append, sleep=lambda s: said.append(f"sleep {s}"), **kw)
    p.said = said
    return p


def test_sdk_tool_use_over_several_turns(key, tmp_path):
    replay = Replay("tool_use_turns")
    p = sdk_proposer(replay, audit_dir=tmp_path / "audit")
    out = p.propose(*odd())
    assert out.proposer == "claude" and [c.id for c in out.candidates] == ["claude-r1-1", "claude-r1-2"]
    assert len(replay.requests) == 3
    first = replay.requests[0]
    assert first["url"].endswith("/v1/messages") and first["json"]["model"] == DEFAULT_MODEL
    assert {t["name"] for t in first["json"]["tools"]} >= {"padding_report", SUBMIT_TOOL["name"]}
    # The key reached the API from the environment, in a header.
    assert any(key in v for v in first["headers"].values())
    third = replay.requests[2]["json"]["messages"]
    assert_well_formed(third)
    results = {b["tool_use_id"]: b for b in third[-1]["content"]}
    assert "NUM_CLASSES = 10" in results["toolu_02b"]["content"]
    assert results["toolu_02c"]["content"].startswith("id: pad-vocab")
    assert out.usage.input_tokens == 1200 + 4200 + 6100 and out.usage.calls == 3
    # Prompts and responses are kept for audit.
    records = [json.loads(line) for line in (tmp_path / "audit" / "claude-round-01.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "setup" and kinds.count("request") == 3 and kinds.count("response") == 3 and kinds[-1] == "accepted"
    assert records[0]["system"].startswith("You are the tuning agent")


def test_sdk_malformed_answer_then_a_proposal(key):
    replay = Replay("malformed_answer")
    out = sdk_proposer(replay).propose(*odd())
    assert out.proposer == "claude" and len(out.candidates) == 2
    reminder = replay.requests[1]["json"]["messages"][-1]["content"][0]["text"]
    assert "not a submit_proposals call" in reminder


def test_sdk_invalid_action_goes_back_with_the_validation_error(key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    replay = Replay("invalid_action")
    out = sdk_proposer(replay).propose(*odd())
    reply = replay.requests[1]["json"]["messages"][-1]["content"][0]
    assert reply["is_error"] is True and reply["content"].startswith("invalid submission, nothing was accepted")
    assert "proposals[0].actions[0].kind" in reply["content"]
    assert out.proposer == "claude" and len(out.candidates) == 2
    assert not (tmp_path / "PWNED").exists()


def test_sdk_rate_limit_then_success(key):
    replay = Replay("rate_limited_then_ok")
    p = sdk_proposer(replay)
    out = p.propose(*odd())
    assert out.proposer == "claude" and out.fallback is None and len(replay.requests) == 2
    assert p.said == ["sleep 2.0"]  # the server's retry-after
    assert [r["kind"] for r in out.transcript if r["kind"] in ("error", "retry")] == ["error", "retry"]


def test_sdk_unauthorized_falls_back_to_offline_without_retrying(key, tmp_path):
    replay = Replay("unauthorized")
    p = sdk_proposer(replay, audit_dir=tmp_path / "audit")
    prof, knobs = odd()
    out = p.propose(prof, knobs)
    assert len(replay.requests) == 1
    assert out.proposer == "offline" and out.requested == "claude"
    assert out.fallback == "the API refused the key (401); check ANTHROPIC_API_KEY"
    assert p.said == [f"Claude proposer: {out.fallback}; the offline proposer takes over for round 1"]
    assert out.candidates[0].id == propose_offline(prof, knobs).candidates[0].id
    assert p.propose(prof, knobs, round=2).proposer == "offline" and len(replay.requests) == 1


def test_sdk_overloaded_retries_are_bounded(key):
    replay = Replay("overloaded")
    p = sdk_proposer(replay, retries=3, backoff_s=1.0, max_backoff_s=3.0)
    out = p.propose(*odd())
    assert len(replay.requests) == 4 and out.fallback == "HTTP 529 after 4 attempts"
    assert [s for s in p.said if s.startswith("sleep")] == ["sleep 1.0", "sleep 2.0", "sleep 3.0"]


def test_the_key_never_reaches_a_written_file(key, tmp_path):
    run_dir = tmp_path / "run"
    replay = Replay("key_echo", key=key)
    p = sdk_proposer(replay, audit_dir=run_dir / "agent")
    out = p.propose(*odd())
    assert out.proposer == "claude"
    assert any(key in v for v in replay.requests[0]["headers"].values())
    (run_dir / "round.json").write_text(out.model_dump_json())
    written = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert len(written) >= 2
    for f in written:
        assert key not in f.read_text(errors="replace"), f
    assert "[redacted]" in (run_dir / "agent" / "claude-round-01.jsonl").read_text()
    assert key not in json.dumps(out.transcript)
