"""The offline proposer: padding the report points at ranks first, with its evidence; same input, same output."""

from __future__ import annotations

import copy
import json
import random

import pytest

from support.paths import EXAMPLES
from tpu_agent.profilers.schema import Profile
from support.profiles import example_knobs, knob, knobs_of, profile, profile_data, recorded_script
from support.processes import run_tool
from tpu_agent.errors import InputError
from tpu_agent.plan.actions import Compile, Mesh, PadDim, PadOps, Plan
from tpu_agent.propose.playbook import builtin_playbooks
from tpu_agent.propose import PROPOSERS, ProposerChoice, choose_proposer, make_proposer
from tpu_agent.propose.base import TrialOutcome
from tpu_agent.propose.offline import OfflineProposer, propose_offline

PADDING_KINDS = {"pad_dim", "pad_ops"}


def kinds(c) -> set[str]:
    return {t.kind for t in c.actions}


def check_padding_first(prof, knobs):
    """The padding candidates (tier 1) lead, each backed by dims of the report, and they cover its worst dim."""
    ranked = propose_offline(prof, knobs).candidates
    report = {d.size: d for d in prof.padding.dims}
    padding = [c for c in ranked if kinds(c) & PADDING_KINDS]
    assert padding and ranked[: len(padding)] == padding, [c.id for c in ranked]
    for c in padding:
        sizes = {e.size for e in c.evidence if e.waste is not None}
        assert sizes and sizes <= set(report), (c.id, sizes)
        assert all(e.estimate for e in c.evidence if e.waste is not None)
    worst = prof.padding.dims[0].size
    assert worst in {e.size for e in ranked[0].evidence}
    assert [c.rank for c in ranked] == list(range(1, len(ranked) + 1))
    return ranked


def test_odd_mlp_padding_candidates_rank_first():
    prof = profile("odd_mlp")
    ranked = check_padding_first(prof, example_knobs("odd_mlp"))
    # The report's worst dim is the 10-way output head; padding NUM_CLASSES to 128 would swamp the softmax
    # (pad-vocab allows +25% at most), so the exact backend padding, which covers it, leads.
    assert prof.padding.dims[0].size == 10
    first = ranked[0]
    assert first.id == "pad-ops" and first.preserves_numerics and first.actions[0].choices == {"multiple": [8, 128]}
    assert {e.size for e in first.evidence if e.size} == {10, 127, 1023, 2047}
    dim10 = next(e for e in first.evidence if e.size == 10)
    assert dim10.op.startswith("aten.addmm") and dim10.dim == "K,N" and dim10.padded_to == 128
    by_knob = {c.actions[0].fixed.get("name"): c for c in ranked if kinds(c) == {"pad_dim"}}
    assert {k: c.actions[0].choices["new"] for k, c in by_knob.items()} == {
        "BATCH": [128], "IN_FEATURES": [1024], "BOTTLENECK": [1024], "HIDDEN": [2048]}
    assert [c.id for c in ranked[1:6]] == ["pad-batch@odd_mlp.py:15:8", "pad-ops-dims",
                                            "pad-matmul-dims@odd_mlp.py:16:14", "pad-matmul-dims@odd_mlp.py:18:13",
                                            "pad-matmul-dims@odd_mlp.py:17:9"]
    # the backend padding of the large dims just past a multiple only (exact): 1023 and 2047, not 10 or 127
    assert ranked[2].actions[0].fixed == {"sizes": [1023, 2047]} and ranked[2].preserves_numerics
    assert by_knob["BATCH"].evidence[0].size == 127 and by_knob["BATCH"].evidence[0].waste > 0
    # Knobs that set the same size share its waste.
    assert by_knob["IN_FEATURES"].score == by_knob["BOTTLENECK"].score < by_knob["BATCH"].score
    why = {t["playbook"]: t["why"] for t in propose_offline(prof, example_knobs("odd_mlp")).transcript
           if "playbook" in t}
    assert "NUM_CLASSES" in why["pad-vocab"] and "max_growth" in why["pad-vocab"]


def test_pad_dim_candidates_point_at_the_literal_in_the_source():
    source = recorded_script("odd_mlp").read_text().splitlines()
    for c in propose_offline(profile("odd_mlp"), example_knobs("odd_mlp")).candidates:
        for option in c.options():
            Plan(actions=list(option))
            for a in option:
                if isinstance(a, PadDim):
                    line = source[a.line - 1]
                    assert line[a.column:].startswith(str(a.old)) and line.startswith(a.name), line


def test_transformer_padding_candidates_rank_first():
    prof = profile("transformer")
    ranked = check_padding_first(prof, example_knobs("transformer"))
    assert [d.size for d in prof.padding.dims] == [32, 64, 50257]
    ids = [c.id for c in ranked]
    assert ids[0] == "pad-ops"  # exact, and it covers every unaligned dim
    head = ranked[1]
    assert head.playbook == "attention-head-dim"
    assert head.actions[0].fixed["name"] == "N_HEADS" and head.actions[0].choices == {"new": [1]}
    assert head.evidence[0].size == 32 and "D_MODEL = 128 / heads" in head.evidence[-1].what
    vocab = ranked[2]
    assert vocab.actions[0].fixed["name"] == "VOCAB" and vocab.actions[0].choices == {"new": [50304]}
    # The sequence length is not padded: it changes what is trained.
    assert not any(c.actions[0].fixed.get("name") == "SEQ_LEN" for c in ranked)
    # the LM head's vocabulary dim padded in the backend only (exact: the model unchanged)
    assert ranked[3].id == "pad-ops-dims" and ranked[3].actions[0].fixed == {"sizes": [50257]}
    later = {c.playbook for c in ranked[4:]}
    assert "compiled-step" in later and not any(kinds(c) & PADDING_KINDS for c in ranked[4:])


def test_same_input_same_output_whatever_the_order():
    prof = profile("transformer")
    knobs = example_knobs("transformer")
    books = builtin_playbooks()
    first = propose_offline(prof, knobs, books).model_dump_json()
    shuffled_knobs, shuffled_books = knobs[:], books[:]
    random.Random(1).shuffle(shuffled_knobs)
    random.Random(2).shuffle(shuffled_books)
    assert propose_offline(profile("transformer"), shuffled_knobs, shuffled_books).model_dump_json() == first
    assert OfflineProposer().propose(profile("transformer"), knobs).model_dump_json() == first


def test_duplicates_merge_and_the_baseline_mode_is_not_proposed():
    ranked = propose_offline(profile("odd_mlp"), example_knobs("odd_mlp")).candidates
    compile_ = [c for c in ranked if kinds(c) == {"compile"}]
    assert len(compile_) == 1
    c = compile_[0]
    assert c.playbook == "compiled-step" and c.also_playbooks == ["static-shapes"]
    assert c.actions[0].choices == {"mode": ["compiled"]}  # the profile ran fused already
    assert any(e.metric == "recompilations_after_warmup" for e in c.evidence)
    assert [Compile(mode="compiled")] == [o[0] for o in c.options()]


def test_options_tried_in_earlier_rounds_are_dropped():
    prof, knobs = profile("odd_mlp"), example_knobs("odd_mlp")
    batch = PadDim(file="odd_mlp.py", line=15, column=8, old=127, new=128, name="BATCH")
    tried = [TrialOutcome(actions=[PadOps(multiple=128)], status="rejected", speedup=0.97),
             TrialOutcome(actions=[PadOps(multiple=8)], status="measured", speedup=1.01),
             # Tried together with another change: still measured.
             TrialOutcome(actions=[Compile(mode="compiled"), batch], status="accepted", speedup=1.4)]
    again = propose_offline(prof, knobs, results=tried, round=2)
    ids = [c.id for c in again.candidates]
    assert "pad-ops" not in ids and "compiled-step" not in ids and "pad-batch@odd_mlp.py:15:8" not in ids
    assert again.round == 2 and "pad-matmul-dims@odd_mlp.py:17:9" in ids
    assert any(t.get("dropped") for t in again.transcript)


def test_without_knobs_only_the_backend_padding_remains():
    ranked = propose_offline(profile("odd_mlp"), []).candidates
    assert ranked[0].id == "pad-ops" and not any(kinds(c) == {"pad_dim"} for c in ranked)
    why = {t["playbook"]: t["why"] for t in propose_offline(profile("odd_mlp"), []).transcript if "playbook" in t}
    assert why["pad-matmul-dims"].startswith("applies, but no knob sets the dims")


def test_generation_and_devices_shape_the_choices():
    data = copy.deepcopy(profile_data("odd_mlp"))
    data["padding"]["mxu"] = 256
    data["device"]["count"] = 2
    ranked = propose_offline(Profile.model_validate(data), example_knobs("odd_mlp")).candidates
    by_id = {c.id: c for c in ranked}
    assert by_id["pad-ops"].actions[0].choices == {"multiple": [8, 128, 256]}
    assert by_id["pad-batch@odd_mlp.py:15:8"].actions[0].choices == {"new": [128]}  # 256: more than double
    for pid in ("data-parallel", "fsdp", "tensor-parallel-mlp"):
        options = by_id[pid].options()
        assert len(options) == 1
        plan = Plan(actions=list(options[0]))
        assert isinstance(plan.mesh, Mesh) and plan.mesh.devices == 2 and plan.preserves_numerics


def test_choose_proposer():
    assert choose_proposer("auto", env={}) == ProposerChoice(name="offline", why="no ANTHROPIC_API_KEY in the environment")
    assert choose_proposer("auto", env={"ANTHROPIC_API_KEY": "x"}).name == "claude"
    assert choose_proposer("auto", offline=True, env={"ANTHROPIC_API_KEY": "x"}) == ProposerChoice(name="offline",
                                                                                                   why="--offline")
    assert choose_proposer("offline", env={"ANTHROPIC_API_KEY": "x"}).why == "--proposer offline"
    assert choose_proposer("claude", env={}).name == "claude"
    with pytest.raises(InputError, match="contradict"):
        choose_proposer("claude", offline=True)
    with pytest.raises(InputError, match="unknown proposer"):
        choose_proposer("gpt")
    assert PROPOSERS == ("auto", "offline", "claude")


def test_make_proposer_builds_the_choice_without_deciding_again():
    assert make_proposer(choose_proposer("auto", env={})).name == "offline"
    assert make_proposer("offline").name == "offline"  # a name chosen before (pipeline passes it on)
    with pytest.raises(ValueError, match="choose_proposer decides"):
        make_proposer("auto")


@pytest.mark.parametrize("name", ["odd_shapes"])
def test_live_profile_ranks_the_reported_padding_first(tmp_path, name):
    """The real profiler on the example (a few seconds), not the recorded file."""
    proc = run_tool("profile", str(EXAMPLES / f"{name}.py"), "--steps", "1", "--warmup", "1", "--json",
                    "-o", str(tmp_path / "runs"), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from tpu_agent.profilers.schema import Profile

    prof = Profile.model_validate(json.loads(proc.stdout))
    assert prof.padding is not None and prof.padding.dims
    ranked = check_padding_first(prof, knobs_of(EXAMPLES / f"{name}.py"))  # the example as it is now
    assert ranked[0].actions[0].kind in PADDING_KINDS


@pytest.mark.parametrize("name", ["odd_mlp", "transformer"])
def test_the_knob_finders_knobs_give_the_same_ranking(name):
    """tpu_agent.knobs.Knob (the real finder) feeds the proposer as the test's plain knobs do."""
    from tpu_agent.propose.knobs import discover

    prof = profile(name)
    found = discover(recorded_script(name), profile=prof).knobs
    ours = [c.model_dump() for c in propose_offline(prof, example_knobs(name)).candidates]
    theirs = [c.model_dump() for c in propose_offline(prof, found).candidates]
    for c in [*ours, *theirs]:  # the finder also says what each literal changes, which the plain knobs do not
        for t in c["actions"]:
            for spot in [t["fixed"], *t["tied"]]:
                spot.pop("effect", None), spot.pop("batch", None)
    assert theirs == ours


def test_batch_flag_overridden_knobs_and_groups():
    prof = profile("odd_mlp")
    knobs = [
        # The finder says this unnamed-looking knob is the batch; pad-batch takes it, pad-matmul-dims does not.
        knob("t.py", 3, 4, 127, "n", batch=True),
        # Overridden on the command line: rewriting the literal would change nothing.
        knob("t.py", 4, 4, 2047, "HIDDEN", overridden="--hidden 2048"),
        # One dim written twice (Linear(..., 1023) then Linear(1023, ...)): padded together.
        knob("t.py", 5, 20, 1023, None, group="t.py:build:1023"),
        knob("t.py", 6, 14, 1023, None, group="t.py:build:1023"),
    ]
    ranked = propose_offline(prof, knobs).candidates
    by_id = {c.id: c for c in ranked}
    assert by_id["pad-batch@t.py:3:4"].actions[0].fixed["name"] == "n"
    assert "pad-matmul-dims@t.py:3:4" not in by_id
    assert not any(c.actions[0].fixed.get("name") == "HIDDEN" for c in ranked)
    grouped = [c for c in ranked if c.playbook == "pad-matmul-dims"]
    assert [c.id for c in grouped] == ["pad-matmul-dims@t.py:5:20"]  # one candidate for the group
    (option,) = grouped[0].options()
    assert [(a.line, a.old, a.new) for a in option] == [(5, 1023, 1024), (6, 1023, 1024)]
    Plan(actions=list(option))


def test_head_dim_prefers_the_model_width_knob():
    prof = profile("transformer")
    knobs = example_knobs("transformer")
    # A knob of 128 declared before D_MODEL must not be taken for the width.
    knobs.insert(0, knob("transformer.py", 1, 0, 128, "LOG_EVERY"))
    head = next(c for c in propose_offline(prof, knobs).candidates if c.playbook == "attention-head-dim")
    assert "through D_MODEL = 128 / heads" in head.evidence[-1].what
