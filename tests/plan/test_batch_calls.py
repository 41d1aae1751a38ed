"""The fixed-length pad_batch change as a source patch: `pad_to_multiple_of=L` in the script's tokenizer and
collator calls that pad to the longest, written into patch.diff (and by --apply); the run-time form stays for a
plan of several buckets and for a script that pads otherwise."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tpu_agent.plan.actions import Compile, PadBatch, PadDim, Plan
from tpu_agent.plan.batch_calls import padding_calls, pad_calls_to, run_time_actions
from tpu_agent.plan.patch import apply_patch
from tpu_agent.plan.rewrite import source_changes, write_source_patch

SCRIPT = '''\
from transformers import AutoTokenizer, DataCollatorWithPadding

MAX_LEN = 127
tokenizer = AutoTokenizer.from_pretrained("gpt2")


def collate(texts):
    return tokenizer(texts, padding="longest", truncation=True, max_length=MAX_LEN, return_tensors="pt")


collator = DataCollatorWithPadding(tokenizer)
fixed = tokenizer(["a"], padding="max_length", max_length=64)  # fixes its length already: left alone
plain = tokenizer(["a"])  # pads nothing
seq2seq = DataCollatorForSeq2Seq(
    tokenizer,
    pad_to_multiple_of=8,
)
'''
FIXED = PadBatch(buckets=(96,), values={"['input_ids']": 0, "['attention_mask']": 0})
BUCKETS = PadBatch(buckets=(64, 96), values={"['input_ids']": 0})


def test_the_calls_that_pad_to_the_longest_are_found_and_get_the_length():
    found = padding_calls(SCRIPT.encode())
    assert [(c.line, c.name) for c in found] == [(8, "tokenizer"), (11, "DataCollatorWithPadding"),
                                                 (14, "DataCollatorForSeq2Seq")]
    after = pad_calls_to(SCRIPT.encode(), 96).decode()
    assert ('tokenizer(texts, padding="longest", truncation=True, max_length=MAX_LEN, return_tensors="pt", '
            "pad_to_multiple_of=96)") in after
    assert "collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=96)\n" in after
    assert "    pad_to_multiple_of=96,\n)" in after  # an existing value replaced, the layout kept
    assert 'fixed = tokenizer(["a"], padding="max_length", max_length=64)  #' in after
    assert 'plain = tokenizer(["a"])  #' in after
    assert after.count("\n") == SCRIPT.count("\n")


def test_the_patch_holds_the_literal_and_the_padding_calls_and_applies_with_git(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plan = Plan(actions=[PadDim(file="train.py", line=3, column=10, old=127, new=128, name="MAX_LEN"), FIXED,
                         Compile(mode="fused")])
    patch = write_source_patch(plan, script, tmp_path / "patch.diff")
    text = patch.read_text()
    assert "-MAX_LEN = 127\n+MAX_LEN = 128\n" in text
    assert "+collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=96)\n" in text
    if shutil.which("git") and not (tmp_path / ".git").exists():
        subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
        assert subprocess.run(["git", "apply", "--check", str(patch)], cwd=tmp_path).returncode == 0
    # buckets have no keyword: only the literal is in the source; a plan without source edits has no patch
    (only,) = source_changes(Plan(actions=[BUCKETS, PadDim(file="train.py", line=3, column=10, old=127, new=128)]),
                             script)
    assert b"pad_to_multiple_of=96" not in only.after and b"MAX_LEN = 128" in only.after
    assert write_source_patch(Plan(actions=[BUCKETS]), script, tmp_path / "none.diff") is None


def test_a_script_that_pads_in_its_own_collate_keeps_the_run_time_form(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("ids = pad_sequence(batch, batch_first=True, padding_value=0)\n")
    assert source_changes(Plan(actions=[FIXED]), script) == []


def test_apply_writes_the_padding_call_and_names_only_the_rest_as_run_time(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    said: list[str] = []
    apply_patch(Plan(actions=[FIXED, Compile(mode="fused")]), script, force=True, say=said.append)
    assert "DataCollatorWithPadding(tokenizer, pad_to_multiple_of=96)" in script.read_text()
    applied, not_applied = said
    assert applied.startswith("applied to train.py")
    assert "fused execution" in not_applied and "batch dim" not in not_applied and "fixed-length" not in not_applied


@pytest.mark.parametrize("plan", [Plan(actions=[BUCKETS]), Plan(actions=[Compile(mode="fused")])])
def test_without_a_fixed_length_apply_leaves_the_padding_calls(tmp_path: Path, monkeypatch, plan):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    said: list[str] = []
    apply_patch(plan, script, force=True, say=said.append)
    assert script.read_text() == SCRIPT
    assert len(said) == 1 and said[0].startswith("not applied")


def test_the_run_time_part_of_a_plan_leaves_out_what_the_patch_holds(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    fused = Compile(mode="fused")
    assert run_time_actions(Plan(actions=[FIXED, fused]), script) == [fused]  # report.md lists only fused
    assert run_time_actions(Plan(actions=[BUCKETS, fused]), script) == [BUCKETS, fused]
    (tmp_path / "collate.py").write_text("ids = pad_sequence(batch, batch_first=True)\n")
    assert run_time_actions(Plan(actions=[FIXED]), tmp_path / "collate.py") == [FIXED]
    assert run_time_actions(Plan(actions=[FIXED]), tmp_path / "gone.py") == [FIXED]


def test_report_md_lists_a_patched_pad_batch_in_the_patch_not_among_the_run_time_changes(tmp_path: Path):
    from tpu_agent.config import TuneOptions
    from tpu_agent.report import markdown as report
    from tpu_agent.report.result import TuneResult
    from tpu_agent.verify.verdict import Verdict

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plan = Plan(actions=[FIXED, Compile(mode="fused")])
    best = Verdict(plan=plan, accepted=True, reason="faster")
    result = TuneResult(script=str(script), args=[], settings=TuneOptions(), study="s", storage="sqlite://",
                        run_dir=str(tmp_path), best=best, verdicts=[best])
    files = report.write_all(result, script)
    assert "pad_to_multiple_of=96" in files["patch.diff"].read_text()
    text = files["report.md"].read_text()
    runtime = text.split("Run-time changes", 1)[1].split("###", 1)[0]
    assert "fused execution" in runtime and "fixed-length" not in runtime
    bucketed = Verdict(plan=Plan(actions=[BUCKETS]), accepted=True, reason="faster")
    files = report.write_all(result.model_copy(update={"best": bucketed, "verdicts": [bucketed]}), script)
    assert "patch.diff" not in files and "bucketed batches" in files["report.md"].read_text()
