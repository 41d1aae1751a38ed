"""Playbooks: the built-ins load and make sense; bad files name the file, the field and the problem."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from support.profiles import profile
from support.processes import clean_env, one_error_line, run_tool
from tpu_agent.errors import InputError
from tpu_agent.plan.actions import ACTION_KINDS
from tpu_agent.propose.playbook import (
    METRICS,
    Condition,
    PlaybookError,
    builtin_playbooks,
    check_field_path,
    load_dir,
    load_file,
    load_playbooks,
    name_words,
    project_playbook_dirs,
)

BUILTIN_IDS = {
    "pad-matmul-dims", "pad-batch", "pad-vocab", "attention-head-dim", "pad-ops", "compiled-step",
    "data-parallel", "fsdp", "tensor-parallel-mlp", "bf16-matmul", "static-shapes", "bucket-lengths", "moe-experts",
}

GOOD = """\
id: my-pad
title: Pad my layers
applies_when:
  - metric: padding_waste
    gt: 0.01
targets:
  dims: {roles_any: [N]}
  knobs: {match: dim, name_words: [width]}
actions:
  - kind: pad_dim
    choices:
      new: {round_up_to: [128, $mxu]}
preserves_numerics: false
rationale: Because the MXU is 128 wide.
"""


def more_actions(text: str) -> str:
    return GOOD.replace("preserves_numerics:", text + "preserves_numerics:")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_builtins_cover_the_issue_and_use_only_plan_actions():
    books = builtin_playbooks()
    assert BUILTIN_IDS <= {pb.id for pb in books}
    for pb in books:
        assert pb.rationale.strip() and pb.references, pb.id
        assert {a.kind for a in pb.actions} <= set(ACTION_KINDS)
        assert pb.source == f"builtin:{pb.id}.yaml"
        assert pb.text().startswith(f"id: {pb.id}\n")


def test_builtins_declare_numerics_as_their_actions_do():
    books = {pb.id: pb for pb in builtin_playbooks()}
    assert books["pad-ops"].preserves_numerics
    assert not books["pad-matmul-dims"].preserves_numerics and not books["bf16-matmul"].preserves_numerics
    # Compiled steps take XLA's derived backward (other rounding): a playbook offering them says so.
    assert not books["compiled-step"].preserves_numerics


@pytest.mark.parametrize(("text", "field", "problem"), [
    (GOOD.replace("kind: pad_dim", "kind: pad_everything"), "actions[0].kind", "unknown action kind 'pad_everything'"),
    (GOOD.replace("metric: padding_waste", "field: padding.totl_waste.value"), "applies_when[0]",
     "padding has no field 'totl_waste'"),
    (GOOD.replace("metric: padding_waste", "metric: paddingwaste"), "applies_when[0]", "unknown metric 'paddingwaste'"),
    (GOOD.replace("gt: 0.01", "gt: 0.01\n    lt: lots"), "applies_when[0].lt", "valid number"),
    (GOOD.replace("$mxu", "$mxx"), "actions[0]", "unknown variable '$mxx'"),
    (GOOD.replace("preserves_numerics: false", "preserves_numerics: true"), "preserves_numerics",
     "pad_dim can change the losses"),
    (GOOD.replace("  knobs: {match: dim, name_words: [width]}\n", ""), "actions[0].choices.new",
     "needs targets.knobs"),
    (GOOD.replace("applies_when:", "applies_whenn:"), "applies_whenn", "unknown field"),
    (GOOD.replace("id: my-pad", "id: My Pad"), "id", "should match pattern"),
    (GOOD.replace("title: Pad my layers\n", ""), "title", "Field required"),
    (more_actions("  - kind: compile\n    fixed: {mode: turbo}\n"), "actions[1].fixed.mode", "'eager', 'fused' or 'compiled'"),
    (more_actions("  - kind: pad_ops\n    choices: {multiple: [4096]}\n"), "actions[1].choices.multiple", "less than or equal to 1024"),
    (more_actions("  - kind: pad_ops\n    fixed: {multple: 128}\n"), "actions[1].fixed.multple", "pad_ops has no field 'multple'"),
    (GOOD.replace("new: {round_up_to: [128, $mxu]}", "new: {round_up_to: [128], for_head_dim: 128}"),
     "actions[0].choices.new", "exactly one of"),
    (GOOD.replace("new: {round_up_to: [128, $mxu]}", "new: {round_up_to: [128], max_growth: -1}"),
     "actions[0].choices.new.max_growth", "greater than 0"),
])
def test_invalid_playbook_names_file_field_and_problem(tmp_path, text, field, problem):
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(PlaybookError) as info:
        load_file(path)
    err = info.value
    assert isinstance(err, InputError) and err.exit_code == 2
    assert err.file == str(path)
    assert err.field == field, str(err)
    assert problem in err.problem, str(err)
    assert str(err).startswith(f"{path}: {field}: ")


def test_yaml_errors_and_non_mappings_name_the_file(tmp_path):
    with pytest.raises(PlaybookError, match=r"broken\.yaml: line 3: not valid YAML"):
        load_file(write(tmp_path / "broken.yaml", "id: a\ntitle: [unclosed\n"))
    with pytest.raises(PlaybookError, match=r"list\.yaml: \(top level\): a playbook is a YAML mapping"):
        load_file(write(tmp_path / "list.yaml", "- id: a\n"))


def test_the_good_example_loads_and_duplicate_ids_in_a_directory_are_rejected(tmp_path):
    pb = load_file(write(tmp_path / "one" / "a.yaml", GOOD))
    assert pb.id == "my-pad" and pb.source == str(tmp_path / "one" / "a.yaml")
    write(tmp_path / "one" / "b.yaml", GOOD)
    with pytest.raises(PlaybookError, match=r"b\.yaml: id: 'my-pad' is already defined in .*a\.yaml"):
        load_dir(tmp_path / "one")


def test_user_dirs_and_pyproject_add_playbooks_and_replace_builtins_by_id(tmp_path):
    write(tmp_path / "mine" / "mine.yaml", GOOD)
    write(tmp_path / "mine" / "pad-ops.yaml", """\
        id: pad-ops
        title: My operand padding
        actions:
          - kind: pad_ops
            choices: {multiple: [256]}
        preserves_numerics: true
        rationale: Our chips are v6e.
        """)
    write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n\n[tool.tpu-agent]\nplaybooks = "mine"\n')
    (tmp_path / "sub").mkdir()
    assert project_playbook_dirs(tmp_path / "sub") == [(tmp_path / "mine").resolve()]
    books = {pb.id: pb for pb in load_playbooks(project_dir=tmp_path / "sub")}
    assert "my-pad" in books and BUILTIN_IDS <= set(books)
    assert books["pad-ops"].title == "My operand padding" and not books["pad-ops"].builtin
    write(tmp_path / "sub" / "pyproject.toml", '[project]\nname = "inner"\n')  # no table: look further up
    assert project_playbook_dirs(tmp_path / "sub") == [(tmp_path / "mine").resolve()]
    (tmp_path / "pyproject.toml").unlink()
    assert project_playbook_dirs(tmp_path / "sub") == []
    assert {pb.id for pb in load_playbooks(project_dir=tmp_path / "sub")} == {pb.id for pb in builtin_playbooks()}
    plain = {pb.id for pb in load_playbooks([tmp_path / "mine"], project_dir=Path("/"))}
    assert "my-pad" in plain


def test_pyproject_playbooks_must_be_paths(tmp_path):
    write(tmp_path / "pyproject.toml", "[tool.tpu-agent]\nplaybooks = 3\n")
    with pytest.raises(PlaybookError, match=r"pyproject\.toml: tool\.tpu-agent\.playbooks: must be"):
        project_playbook_dirs(tmp_path)


def test_field_paths_are_checked_against_the_profile_schema():
    assert check_field_path("padding.total_waste.value") is None
    assert check_field_path("steps.stats.median_s") is None
    assert "has no sub-fields" in check_field_path("mode_used.x")
    assert "has no field 'nope'" in check_field_path("nope")


def test_conditions_evaluate_on_a_recorded_profile():
    p = profile("odd_mlp")
    waste = p.padding.total_waste.value
    ok, evidence = Condition.model_validate({"field": "padding.total_waste.value", "gt": waste / 2}).evaluate(p)
    assert ok and evidence[0].value == pytest.approx(waste, rel=1e-5) and evidence[0].estimate
    assert not Condition.model_validate({"field": "padding.total_waste.value", "gt": waste * 2}).evaluate(p)[0]
    assert Condition.model_validate({"metric": "mode", "eq": "fused"}).evaluate(p)[0]
    assert not Condition.model_validate({"metric": "devices", "gt": 1}).evaluate(p)[0]
    # A list field compares by its length; any/all combine.
    n = len(p.recompilations)
    assert Condition.model_validate({"field": "recompilations", "eq": n}).evaluate(p)[0]
    assert Condition.model_validate({"any": [{"metric": "devices", "gt": 1}, {"metric": "mode", "in": ["fused"]}]}).evaluate(p)[0]
    assert not Condition.model_validate({"all": [{"metric": "devices", "gt": 1}, {"metric": "mode", "in": ["fused"]}]}).evaluate(p)[0]
    assert METRICS["recompilations_after_warmup"][1](p) == sum(1 for r in p.recompilations if r.step and r.step > 2)


def test_name_words_split_names_into_words():
    assert name_words("NUM_CLASSES") == ["num", "classes"]
    assert name_words("BOTTLENECK") == ["bottleneck"]  # "len" must not match inside it
    assert name_words("nHeads") == ["n", "heads"]
    assert name_words("d_model2") == ["d", "model", "2"]


# ------------------------------------------------------------------ the CLI


def test_cli_validate_bad_file_is_one_error_line_exit_2(tmp_path):
    path = write(tmp_path / "bad.yaml", GOOD.replace("kind: pad_dim", "kind: exec_python"))
    proc = run_tool("playbooks", "validate", str(path), cwd=tmp_path)
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert line.startswith(f"error: {path}: actions[0].kind: unknown action kind 'exec_python'")


def test_cli_validate_list_and_show(tmp_path):
    write(tmp_path / "mine" / "mine.yaml", GOOD)
    proc = run_tool("playbooks", "validate", str(tmp_path / "mine"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ok:" in proc.stdout and "my-pad" in proc.stdout

    proc = run_tool("playbooks", "list", "--json", "--playbooks", str(tmp_path / "mine"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = {row["id"]: row for row in json.loads(proc.stdout)}
    assert BUILTIN_IDS | {"my-pad"} <= set(listed)
    assert listed["my-pad"]["actions"] == ["pad_dim"]

    proc = run_tool("playbooks", "list", cwd=tmp_path, env=clean_env(COLUMNS="160"))
    assert proc.returncode == 0 and "pad-ops" in proc.stdout and "my-pad" not in proc.stdout

    proc = run_tool("playbooks", "show", "pad-vocab", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# pad-vocab (built-in)\nid: pad-vocab\n")

    proc = run_tool("playbooks", "show", "nope", cwd=tmp_path)
    assert proc.returncode == 2 and "no playbook 'nope'" in one_error_line(proc)
