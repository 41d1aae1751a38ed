"""examples/ci/tpu-agent.yml, run locally: its `run:` steps in order, as GitHub's runner runs them (bash -eo
pipefail, the workflow's and the step's env, `if:` on an earlier step's output), in a git repository whose pull
request slows the script down. The `uses:` steps and the install are skipped (the installed CLI is used); `gh`
is a fake that keeps the comment it was asked to post."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
from pathlib import Path

import yaml

from support.paths import REPO, TPU_AGENT

WORKFLOW = REPO / "examples" / "ci" / "tpu-agent.yml"
SKIPPED = {"Install tpu-agent"}  # the test runs the CLI this checkout installed

TRAIN = textwrap.dedent("""
    import time
    import torch
    PAUSE = {pause}  # seconds of host work per step
    torch.manual_seed(0)
    w = torch.randn(64, 64).to("tpu").requires_grad_()
    opt = torch.optim.SGD([w], lr=0.01)
    for step in range(40):
        loss = (w @ w).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(PAUSE)
""")

FAKE_GH = """#!/bin/sh
# gh, faked: what it was asked and the comment's body
echo "$@" > "$FAKE_GH_LOG"
while [ $# -gt 0 ]; do
  if [ "$1" = "--body-file" ]; then cp "$2" "$FAKE_GH_LOG.body"; fi
  shift
done
"""


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


def expand(value, context: dict[str, str]) -> str:
    """`${{ expr }}` as GitHub fills it in, from the few expressions the workflow uses."""
    def one(match):
        expr = match.group(1).strip()
        assert expr in context, f"the workflow uses ${{{{ {expr} }}}}: teach the test what GitHub puts there"
        return context[expr]
    return re.sub(r"\$\{\{(.*?)\}\}", one, str(value))


def holds(condition: str, context: dict[str, str]) -> bool:
    """The `if:` forms the workflow uses: `steps.<id>.outputs.<name> != '<value>'` (or ==)."""
    match = re.fullmatch(r"\s*(steps\.\w+\.outputs\.\w+)\s*(!=|==)\s*'([^']*)'\s*", condition)
    assert match, f"unknown if: {condition!r}: teach the test to evaluate it"
    value = context.get(match.group(1), "")
    return (value != match.group(3)) if match.group(2) == "!=" else (value == match.group(3))


def test_the_workflow_profiles_base_and_head_posts_the_diff_and_fails_on_a_regression(tmp_path):
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert workflow.get("on", workflow.get(True)) == "pull_request"  # YAML 1.1 reads a bare `on` as True
    (job,) = workflow["jobs"].values()
    repo, runner_temp, bin_dir = tmp_path / "repo", tmp_path / "runner", tmp_path / "bin"
    for d in (repo, runner_temp, bin_dir):
        d.mkdir()
    (bin_dir / "gh").write_text(FAKE_GH)
    (bin_dir / "gh").chmod(0o755)
    script = workflow["env"]["SCRIPT"]
    git(repo, "init", "-q", "-b", "main")
    (repo / script).write_text(TRAIN.format(pause=0.0))
    git(repo, "add", script)
    git(repo, "commit", "-q", "-m", "base")
    base_sha = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "-b", "pr")
    (repo / script).write_text(TRAIN.format(pause=0.05))  # the pull request: 50 ms more a step
    git(repo, "commit", "-q", "-am", "slower")

    output = tmp_path / "github_output"
    context = {"github.event.pull_request.base.sha": base_sha, "github.token": "fake-token",
               "github.event.pull_request.number": "7"}
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{TPU_AGENT.parent}{os.pathsep}{os.environ['PATH']}",
           "RUNNER_TEMP": str(runner_temp), "GITHUB_OUTPUT": str(output), "FAKE_GH_LOG": str(tmp_path / "gh.log"),
           "TPU_AGENT_CACHE_DIR": str(tmp_path / "cache")}
    env.update({k: expand(v, context) for k, v in workflow.get("env", {}).items()})
    ran, exit_codes = [], {}
    for step in job["steps"]:
        if "uses" in step or step.get("name") in SKIPPED:
            continue
        if "if" in step and not holds(step["if"], context):
            continue
        step_env = {**env, **{k: expand(v, context) for k, v in step.get("env", {}).items()}}
        output.write_text("")
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=repo,
                              env=step_env, capture_output=True, text=True, timeout=240)
        ran.append(step["name"])
        exit_codes[step["name"]] = proc.returncode
        if proc.returncode and step["name"] != "Fail on a regression":
            raise AssertionError(f"step {step['name']!r} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        for line in output.read_text().splitlines():
            name, _, value = line.partition("=")
            context[f"steps.{step['id']}.outputs.{name}"] = value

    assert ran == ["Profile the base branch", "Profile the pull request", "Compare", "Post the table on the pull request",
                   "Fail on a regression"]
    assert context["steps.diff.outputs.code"] == "1" and exit_codes["Fail on a regression"] == 1  # the check fails
    assert (tmp_path / "gh.log").read_text().split() == ["pr", "comment", "7", "--body-file", "diff.md"]
    comment = (tmp_path / "gh.log.body").read_text()
    assert comment.startswith(f"### tpu-agent diff: {script}")
    assert "**Regression beyond 5 %:** step time (median) +" in comment
    assert "| step time (median) |" in comment and comment == (repo / "diff.md").read_text()
