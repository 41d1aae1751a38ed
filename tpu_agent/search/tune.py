"""`tpu-agent tune`: profile, propose, search with Optuna, verify, report.

Flow: a baseline profile -> knobs and proposals -> an Optuna study whose
search space is the candidates' options (one categorical per candidate,
"off" included) -> each trial is a plan, timed step by step against a warm
baseline process (interleaved) -> the best plans are verified in fresh
processes (a confidence interval on the speedup, the numerics check) -> a
report, a patch and the plan. Only verified changes are reported as gains.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from pydantic import BaseModel, Field

from tpu_agent.errors import InputError, TpuAgentError
from tpu_agent.plan.actions import Mesh, PadDim, Plan
from tpu_agent.verify.stats import check_numerics, memory_saving, speedup
from tpu_agent.search.trials import StepRecord, TrialFailed, TrialProcess

STUDY_DB = "studies.db"
OFF = "off"


class TuneSettings(BaseModel):
    trials: int = Field(20, ge=1)
    timeout: float | None = Field(None, description="seconds for the search")
    steps: int = Field(10, ge=5, description="interleaved pairs per trial")
    pairs: int = Field(5, ge=5, description="interleaved pairs when verifying (at least `steps`)")
    warmup: int = Field(3, ge=1, description="steps each process runs before it is timed (compilation)")
    target: str = "cpu"
    objective: str = Field("time", pattern="^(time|memory|both)$")
    seed: int = 0
    study: str | None = None
    storage: str | None = None
    resume: bool = False
    min_gain: float = 0.03
    loss_tol: float = 0.02
    step_timeout: float = 300.0
    devices: int | None = None
    candidates: int = Field(6, ge=1, description="how many top candidates span the search space")
    playbooks: list[str] = Field(default_factory=list, description="extra playbook directories")
    rounds: int = Field(1, ge=1)
    token_budget: int = 200_000

    @property
    def verify_pairs(self) -> int:
        """Pairs for a verification or an ablation: noise on a shared host wants a fixed, ample sample."""
        return max(self.pairs, self.steps, 20)

    def fingerprint(self, script: Path, args: list[str]) -> str:
        """What makes two runs the same study: the script, its args and the measuring settings."""
        keep = self.model_dump(include={"steps", "warmup", "target", "objective", "min_gain", "loss_tol", "devices"})
        text = json.dumps({"script": str(script), "args": args, **keep}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class TrialRecord(BaseModel):
    number: int
    plan: Plan
    state: str  # complete | numerics (measured, losses off) | failed | pruned | invalid | repeated
    value: float | None = None
    speedup: float | None = None
    memory_ratio: float | None = None
    reason: str = ""
    duration_s: float = 0.0


@dataclass
class Space:
    """The candidates whose options span the search, with their option lists."""

    candidates: list
    options: dict[str, list[tuple]] = field(default_factory=dict)

    def plan_for(self, picks: dict[str, str]) -> Plan:
        actions = []
        for cand in self.candidates:
            pick = picks.get(cand.id, OFF)
            if pick != OFF:
                actions.extend(self.options[cand.id][int(pick)])
        return Plan(actions=actions)


def open_study(settings: TuneSettings, name: str, fingerprint: str, runs_root: Path) -> optuna.Study:
    storage = settings.storage or f"sqlite:///{(runs_root.parent / STUDY_DB).resolve()}"
    try:
        existing = optuna.study.get_all_study_names(storage=storage)
    except Exception as exc:  # noqa: BLE001 - any backend failure: one clear line
        raise InputError(f"cannot open the study storage {_redact(storage)}: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200]}") from None
    if name in existing:
        study = optuna.load_study(study_name=name, storage=storage)
        theirs = study.user_attrs.get("fingerprint")
        if theirs != fingerprint:
            raise InputError(f"study {name!r} exists with different settings (script, args or measuring "
                                "options); pick another --study name")
        if not settings.resume and study.trials:
            raise InputError(f"study {name!r} already has {len(study.trials)} trials; pass --resume to continue it")
        return study
    sampler = optuna.samplers.TPESampler(seed=settings.seed)
    # Timings on a shared machine are noisy: judge only after 4 pairs and 4 finished trials.
    pruner = optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=3)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize",
                                sampler=sampler, pruner=pruner)
    study.set_user_attr("fingerprint", fingerprint)
    return study


def _redact(url: str) -> str:
    return re.sub(r"//([^:/@]+):([^@]+)@", r"//\1:***@", url)


def batch_size(plan: Plan, baseline_batch: int | None) -> int | None:
    """The candidate's batch when a PadDim changes the batch literal (time is then per sample)."""
    if baseline_batch is None:
        return None
    for action in plan.of(PadDim):
        if action.name and "batch" in action.name.lower():
            return action.new
    return baseline_batch


class Runner:
    """Runs trials: a warm baseline process, one candidate process per trial, stepped in turns."""

    def __init__(self, script: Path, args: list[str], settings: TuneSettings, run_dir: Path):
        self.script, self.args, self.settings, self.run_dir = script, args, settings, run_dir
        self.env = {"TPU_AGENT_DEVICES": str(settings.devices)} if settings.devices else {}
        self.baseline: TrialProcess | None = None
        self.baseline_count = 0
        self.verifications = 0
        self.last_baseline_steps: list[StepRecord] = []

    def _baseline(self) -> TrialProcess:
        if self.baseline is None or self.baseline.proc is None or self.baseline.proc.poll() is not None:
            if self.baseline is not None:  # it ran out of steps: keep what it measured (losses by step)
                self.last_baseline_steps.extend(self.baseline.steps)
            self.baseline_count += 1
            self.baseline = self._process(self.script, Plan(), f"baseline-{self.baseline_count}")
            self._warm(self.baseline)
        return self.baseline

    def _process(self, script: Path, plan: Plan, name: str) -> TrialProcess:
        return TrialProcess(script, self.args, plan, cwd=Path.cwd(), log_dir=self.run_dir / "logs",
                            step_timeout=self.settings.step_timeout, env=self.env, name=name)

    def candidate(self, plan: Plan, name: str) -> TrialProcess:
        script = self.script
        if plan.of(PadDim):
            from tpu_agent.plan.rewrite import apply_pad_dims

            rewrite = apply_pad_dims(plan, self.script, self.run_dir / "workspaces" / name)
            script = rewrite.script
        return self._process(script, plan, name)

    def measure(self, plan: Plan, name: str, pairs: int, report=None, fresh_baseline: bool = False):
        """(baseline steps, candidate steps, candidate's first-step info), interleaved."""
        if fresh_baseline:
            self.close()
            self.last_baseline_steps = []
        base = self._baseline()

        def baseline_step() -> StepRecord:
            nonlocal base
            try:
                return base.step()
            except TrialFailed as exc:
                if exc.kind != "too_few_steps":
                    raise
                base = self._baseline()  # the script ran out of steps: a fresh warm baseline
                return base.step()

        cand = self.candidate(plan, name)
        try:
            self._warm(cand)
            a, b = _interleave(baseline_step, cand.step, pairs, report)
            return a, b, cand
        finally:
            cand.stop()

    def measure_plans(self, without: Plan, plan: Plan, name: str, pairs: int):
        """Two fresh plan processes stepped in turns: (steps of `without`, steps of `plan`)."""
        self.close()
        a_proc, b_proc = self.candidate(without, f"{name}-without"), self.candidate(plan, f"{name}-with")
        try:
            self._warm(a_proc)
            self._warm(b_proc)
            return _interleave(a_proc.step, b_proc.step, pairs)
        finally:
            a_proc.stop()
            b_proc.stop()

    def _warm(self, proc: TrialProcess) -> None:
        proc.start()
        for _ in range(self.settings.warmup):
            proc.step()

    def close(self) -> None:
        if self.baseline is not None:
            self.last_baseline_steps.extend(self.baseline.steps)
            self.baseline.stop()
            self.baseline = None


def _interleave(step_a, step_b, pairs: int, report=None) -> tuple[list[StepRecord], list[StepRecord]]:
    """A B A B ... for `pairs` pairs; when the script's own step count ends a side, the pairs so far (>= 5)."""
    a: list[StepRecord] = []
    b: list[StepRecord] = []
    for i in range(pairs):
        try:
            first = step_a()
            second = step_b()
        except TrialFailed as exc:
            if exc.kind != "too_few_steps" or len(b) < 5:
                raise
            break
        a.append(first)
        b.append(second)
        if report is not None:
            report(i, a, b)
    return a, b


def losses_of(steps: list[StepRecord]) -> list[float]:
    return [s.loss for s in steps if s.loss is not None]


class Verdict(BaseModel):
    """Whether a plan's gain is verified, with the numbers that decided it."""

    plan: Plan
    accepted: bool
    reason: str
    speed: dict | None = None  # stats.SpeedupEstimate
    memory: dict | None = None  # stats.MemoryEstimate
    numerics: dict | None = None  # stats.NumericsCheck
    estimate_note: str | None = None  # a time gain that can only be estimated here (sharding on a CPU host)
    attribution: list[dict] = Field(default_factory=list)  # Attribution: what each group of actions adds
    left_out: list[str] = Field(default_factory=list)  # groups an ablation showed slowing the plan, and by how much


class Attribution(BaseModel):
    """The gain one group of a verified plan's actions adds on top of the rest of the plan, measured."""

    group: str = Field(description="padding, execution, precision or sharding")
    actions: str = Field(description="the group's actions, as the report writes them")
    without: str = Field(description="the plan it was compared against: the verified plan minus the group")
    speed: dict | None = None  # stats.SpeedupEstimate of the full plan over the plan without the group
    reason: str


class TuneResult(BaseModel):
    script: str
    args: list[str]
    settings: TuneSettings
    study: str
    storage: str
    run_dir: str
    baseline_profile: str | None = None
    proposer: str = "offline"
    proposer_notes: list[str] = Field(default_factory=list)
    candidates: list[dict] = Field(default_factory=list)
    trials: list[TrialRecord] = Field(default_factory=list)
    verdicts: list[Verdict] = Field(default_factory=list)
    best: Verdict | None = None
    interrupted: bool = False
    duration_s: float = 0.0
    summary: dict | None = Field(None, description="for `tpu-agent diff`: the step time after the verified change")


def simulated_devices_only(plan: Plan) -> bool:
    """A mesh over simulated CPU devices: its time cannot be measured honestly here."""
    import jax

    return plan.mesh is not None and jax.default_backend() == "cpu"


def _objective_value(settings: TuneSettings, speed: float | None, memory_ratio: float | None) -> float:
    if settings.objective == "time":
        return speed or 0.0
    if settings.objective == "memory":
        return (1.0 / memory_ratio) if memory_ratio else 0.0
    return (speed or 0.0) * ((1.0 / memory_ratio) if memory_ratio else 1.0)


def search(study: optuna.Study, space: Space, runner: Runner, settings: TuneSettings, baseline_batch: int | None,
           baseline_losses: dict[int, float], on_trial=None) -> list[TrialRecord]:
    """Run the Optuna study; every finished trial is in the study's storage as it ends."""
    records: list[TrialRecord] = []
    # Plans already measured (this run or an earlier one of the study): plan key -> (trial number, value).
    measured = {t.user_attrs["plan_key"]: (t.number, t.value) for t in study.trials
                if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
                and t.user_attrs.get("plan_key")}

    def objective(trial: optuna.Trial) -> float:
        picks = {c.id: trial.suggest_categorical(c.id, [OFF] + [str(i) for i in range(len(space.options[c.id]))])
                 for c in space.candidates}
        t0 = time.perf_counter()
        try:
            plan = space.plan_for(picks)
        except ValueError as exc:
            return _finish(trial, TrialRecord(number=trial.number, plan=Plan(), state="invalid",
                                              reason=f"invalid combination: {exc}"), fail=True)
        if not plan.actions:  # every candidate off: the baseline itself, by definition 1.0
            trial.set_user_attr("plan", plan.model_dump(mode="json"))
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="repeated", value=1.0,
                                              speedup=1.0, reason="no change: the baseline itself, not run"))
        key = plan.key()
        trial.set_user_attr("plan", plan.model_dump(mode="json"))
        trial.set_user_attr("plan_key", key)
        if key in measured:
            number, value = measured[key]
            record = TrialRecord(number=trial.number, plan=plan, state="repeated",
                                 value=value, reason=f"same plan as trial {number}: not run again")
            return _finish(trial, record, fail=value is None)
        invalid = _invalid_for_devices(plan, settings)
        if invalid:
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="invalid", reason=invalid), fail=True)

        cand_batch = batch_size(plan, baseline_batch)
        per_sample = baseline_batch is not None and cand_batch != baseline_batch
        scale = (cand_batch / baseline_batch) if per_sample else 1.0  # time per sample when the batch grows

        def report(i, a, b):
            ratio = sorted(scale * x.wall_s / y.wall_s for x, y in zip(a, b))[len(a) // 2]
            trial.report(ratio, i)
            # Clearly slow: under the median of earlier trials at this point, and slower than the baseline.
            if ratio < 1.0 and trial.should_prune():
                raise optuna.TrialPruned(f"running median {ratio:.3f}x after {i + 1} pairs")

        try:
            a, b, cand = runner.measure(plan, f"trial-{trial.number}", settings.steps, report=report)
        except optuna.TrialPruned as exc:
            record = TrialRecord(number=trial.number, plan=plan, state="pruned", reason=str(exc),
                                 duration_s=time.perf_counter() - t0)
            records.append(record)
            if on_trial:
                on_trial(record)
            raise
        except TrialFailed as exc:
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="failed",
                                              reason=f"{exc.kind}: {exc.message.splitlines()[0][:300]}",
                                              duration_s=time.perf_counter() - t0), fail=True)
        for s in runner.baseline.steps if runner.baseline else a:
            if s.loss is not None:
                baseline_losses.setdefault(s.step, s.loss)
        ratios = [scale * x.wall_s / y.wall_s for x, y in zip(a, b)]
        speed = sorted(ratios)[len(ratios) // 2]
        # Numerics already in the search: the candidate's losses against the baseline's at the same steps.
        pairs_ = [(baseline_losses[s.step], s.loss) for s in cand.steps if s.loss is not None and s.step in baseline_losses]
        numerics = check_numerics([p[0] for p in pairs_], [p[1] for p in pairs_],
                                  preserves_numerics=plan.preserves_numerics, loss_tol=settings.loss_tol) if pairs_ else None
        mem_a = sorted(s.device_bytes for s in a)[len(a) // 2]
        mem_b = sorted(s.device_bytes for s in b)[len(b) // 2]
        memory_ratio = (mem_b / mem_a) if mem_a else None
        value = _objective_value(settings, speed, memory_ratio)
        if numerics is not None and not numerics.passed:
            trial.set_user_attr("speedup", speed)
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="numerics", value=0.0,
                                              speedup=speed, memory_ratio=memory_ratio,
                                              duration_s=time.perf_counter() - t0, reason=numerics.reason))
        trial.set_user_attr("speedup", speed)
        trial.set_user_attr("memory_ratio", memory_ratio)
        trial.set_user_attr("candidate_losses", losses_of(b))
        record = TrialRecord(number=trial.number, plan=plan, state="complete", value=value, speedup=speed,
                             memory_ratio=memory_ratio, duration_s=time.perf_counter() - t0,
                             reason="; ".join(cand.notes))
        return _finish(trial, record)

    def _finish(trial, record: TrialRecord, fail: bool = False):
        trial.set_user_attr("state", record.state)
        trial.set_user_attr("reason", record.reason)
        records.append(record)
        if on_trial:
            on_trial(record)
        if record.state != "repeated" and record.plan.actions:
            measured.setdefault(record.plan.key(), (trial.number, None if fail else record.value))
        if fail:
            raise _Failed(record.reason)
        return record.value

    done = sum(1 for t in study.trials if t.state.is_finished())
    remaining = max(settings.trials - done, 0)
    if remaining:
        study.optimize(objective, n_trials=remaining, timeout=settings.timeout, catch=(_Failed,),
                       gc_after_trial=False)
    return records


class _Failed(Exception):
    """A trial that could not produce a value: Optuna records it as FAIL and goes on."""


def _invalid_for_devices(plan: Plan, settings: TuneSettings) -> str | None:
    mesh = plan.mesh
    if mesh is None:
        return None
    available = settings.devices or 1
    if mesh.devices > available:
        return f"invalid combination: mesh {dict(mesh.axes)} needs {mesh.devices} devices, {available} available"
    return None


def sharding_estimate(profile, plan: Plan, target: str) -> str | None:
    """A roofline guess of a sharded step on a TPU generation: labelled an estimate wherever it is shown.

    Per-device compute and memory traffic divide by the mesh size; a data-parallel
    step adds an all-reduce of the gradients (2 (n-1)/n of the parameter bytes)
    at HBM bandwidth, a lower bound on its cost over the interconnect.
    """
    from tpu_agent.backend.generations import GENERATIONS

    mesh = plan.mesh
    if mesh is None or profile is None or profile.flops is None:
        return None
    gen = GENERATIONS.get(target if target != "cpu" else "v5e")
    flops, traffic = profile.flops.per_step, profile.flops.bytes_per_step
    n = mesh.devices
    single = max(flops / gen.peak_bf16_flops, traffic / gen.hbm_bandwidth)
    live = profile.memory.live_peak_bytes or 0
    allreduce = 2 * (n - 1) / n * live / 4 / gen.hbm_bandwidth  # a quarter of live bytes as gradients: rough
    sharded = single / n + allreduce
    return (f"estimate (roofline, TPU {gen.name}): {single * 1e3:.3f} ms per step on one chip, "
            f"{sharded * 1e3:.3f} ms over {n} chips ({single / sharded:.2f}x); not measured")


def verify(plan: Plan, runner: Runner, settings: TuneSettings, baseline_batch: int | None,
           profile=None) -> Verdict:
    """Fresh processes for both, interleaved pairs, CI on the speedup, the numerics check."""
    pairs = settings.verify_pairs
    try:
        runner.verifications += 1
        a, b, cand = runner.measure(plan, f"verify-{runner.verifications}", pairs, fresh_baseline=True)
    except TrialFailed as exc:
        return Verdict(plan=plan, accepted=False, reason=f"verification run failed: {exc.kind}: {exc.message[:200]}")
    finally:
        runner.close()
    by_step: dict[int, float] = {}
    for s in runner.last_baseline_steps:  # every baseline process runs the same steps from step 1
        if s.loss is not None:
            by_step.setdefault(s.step, s.loss)
    aligned = [(by_step[s.step], s.loss) for s in cand.steps if s.loss is not None and s.step in by_step]
    numerics = check_numerics(
        [x for x, _ in aligned], [y for _, y in aligned], preserves_numerics=plan.preserves_numerics,
        loss_tol=settings.loss_tol,
    ) if aligned else None
    cand_batch = batch_size(plan, baseline_batch)
    per_sample = baseline_batch is not None and cand_batch != baseline_batch
    speed = speedup([s.wall_s for s in a], [s.wall_s for s in b], min_gain=settings.min_gain, seed=settings.seed,
                    baseline_batch=baseline_batch if per_sample else None,
                    candidate_batch=cand_batch if per_sample else None)
    memory = memory_saving([s.device_bytes for s in a], [s.device_bytes for s in b], min_gain=settings.min_gain,
                           seed=settings.seed) if all(s.device_bytes for s in a + b) else None
    estimate_note = None
    if simulated_devices_only(plan):
        estimate = sharding_estimate(profile, plan, settings.target)
        estimate_note = ("time on simulated CPU devices is not a TPU's: the speed figure is measured here but "
                         "not claimed" + (f"; {estimate}" if estimate else ""))
    time_ok = speed.accepted and estimate_note is None
    memory_ok = memory is not None and memory.accepted
    wanted = {"time": time_ok, "memory": memory_ok, "both": time_ok or memory_ok}[settings.objective]
    numerics_ok = numerics is None or numerics.passed
    if not numerics_ok:
        reason = f"numerics: {numerics.reason}"
    elif wanted:
        parts = []
        if time_ok:
            parts.append(speed.reason)
        if memory_ok and settings.objective != "time":
            parts.append(memory.reason)
        reason = "; ".join(parts)
    else:
        reason = speed.reason if settings.objective == "time" else (
            memory.reason if memory is not None else "no device memory figures")
        if estimate_note and settings.objective == "time":
            reason = estimate_note
    return Verdict(plan=plan, accepted=bool(wanted and numerics_ok), reason=reason,
                   speed=speed.model_dump(), memory=memory.model_dump() if memory else None,
                   numerics=numerics.model_dump() if numerics else None, estimate_note=estimate_note)



def baseline_profile(script: Path, args: list[str], run_dir: Path, settings: TuneSettings):
    """Profile the unchanged script in a child process (its output goes to a log)."""
    from tpu_agent.profilers.schema import Profile, Settings
    from tpu_agent.profilers.session import PROFILE_ENV, PROFILE_FILE
    from tpu_agent.run.launch import run_script

    prof_settings = Settings(steps=settings.steps, warmup=settings.warmup, mode="eager",
                             devices=settings.devices or 1, target=None if settings.target == "cpu" else settings.target)
    env = dict(os.environ)
    env[PROFILE_ENV] = prof_settings.model_dump_json()
    if settings.devices:
        env["TPU_AGENT_DEVICES"] = str(settings.devices)
    log = open(run_dir / "baseline-profile.log", "wb")
    try:
        result = run_script(script, args, runs_root=run_dir, env=env, stdout=log.fileno(), stderr=log.fileno())
    finally:
        log.close()
    path = Path(result.run_dir) / PROFILE_FILE
    if not path.exists():
        tail = (run_dir / "baseline-profile.log").read_text(errors="replace").strip().splitlines()[-12:]
        raise TpuAgentError("the baseline run failed (exit {}): {}".format(result.exit_code, " | ".join(tail)[-600:]))
    return Profile.model_validate_json(path.read_text()), path


def make_proposer(proposer: str, *, audit_dir: Path, model: str | None, token_budget: int, script: Path):
    """The offline proposer, or Claude (which falls back to the offline one itself, out loud)."""
    from tpu_agent.propose import make_proposer as make

    options = {"audit_dir": audit_dir, "token_budget": token_budget, "source_root": script.resolve().parent}
    if model:
        options["model"] = model
    return make(proposer, **options)


def build_space(round_, knobs, limit: int, previous: Space | None = None) -> Space:
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
        chosen.append(cand)
        options[cand.id] = opts
        if len(chosen) >= limit:
            break
    return Space(candidates=chosen, options=options)


def run(script: Path, args: list[str], settings: TuneSettings, *, console, proposer: str = "offline",
        runs_root: Path, model: str | None = None) -> TuneResult:
    """The whole job; the result is written to the run directory as it goes."""
    from tpu_agent.propose import knobs as knob_scan
    from tpu_agent.paths import new_run_dir
    from tpu_agent.propose.playbook import load_playbooks

    t_start = time.perf_counter()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens
    run_dir = new_run_dir(script, runs_root)
    fingerprint = settings.fingerprint(script.resolve(), args)
    name = settings.study or f"{script.stem}-{fingerprint[:8]}"
    storage = settings.storage or f"sqlite:///{(runs_root.parent / STUDY_DB).resolve()}"
    study = open_study(settings, name, fingerprint, runs_root)
    result = TuneResult(script=str(script), args=args, settings=settings, study=name, storage=_redact(storage),
                        run_dir=str(run_dir))

    console.print(f"[bold]baseline[/bold]: profiling {script.name} ({settings.warmup} warm-up + {settings.steps} steps)")
    profile, profile_path = baseline_profile(script, args, run_dir, settings)
    result.baseline_profile = str(profile_path)
    result.summary = _summary(profile, None)
    report = knob_scan.discover(script, profile=profile, script_args=args, profile_path=str(profile_path))
    knobs = report.knobs
    batch_knob = next((k for k in knobs if k.batch and not k.overridden), None)
    baseline_batch = batch_knob.value if batch_knob else None

    playbooks = load_playbooks(settings.playbooks, project_dir=script.resolve().parent)
    agent = make_proposer(proposer, audit_dir=run_dir / "agent", model=model, token_budget=settings.token_budget,
                          script=script)
    runner = Runner(script, args, settings, run_dir)
    baseline_losses: dict[int, float] = {}
    space = Space(candidates=[])

    def on_trial(record: TrialRecord):
        shown = f"{record.speedup:.3f}x" if record.speedup is not None else "-"
        console.print(f"  trial {record.number:3d} {record.state:9s} {shown:>8s}  {_plan_text(record.plan)}"
                      + (f"  [dim]{record.reason[:90]}[/dim]" if record.reason and record.state != "complete" else ""))
        result.trials.append(record)
        _save(result, run_dir, t_start)

    try:
        for round_number in range(1, settings.rounds + 1):
            round_ = agent.propose(profile, knobs=knobs, playbooks=playbooks,
                                   results=[_outcome(t) for t in result.trials], round=round_number)
            result.proposer = round_.proposer
            result.proposer_notes += list(round_.notes)
            for note in round_.notes:
                console.print(f"[yellow]{note}[/yellow]")
            space = build_space(round_, knobs, settings.candidates, space)
            result.candidates = [c.model_dump(mode="json") for c in space.candidates]
            if not space.candidates:
                console.print("no candidate changes for this profile: nothing to search")
                break
            budget = settings.trials * round_number // settings.rounds
            console.print(f"[bold]search[/bold] (round {round_number}): {len(space.candidates)} candidates, "
                          f"trials up to {budget} of {settings.trials} (study {name!r})")
            for c in space.candidates:
                console.print(f"  {c.rank}. {c.title} [dim]({c.proposer}, {len(space.options[c.id])} options)[/dim]")
            search(study, space, runner, settings.model_copy(update={"trials": budget}), baseline_batch,
                   baseline_losses, on_trial=on_trial)
    except KeyboardInterrupt:
        result.interrupted = True
        console.print("[yellow]interrupted: finished trials are saved in the study; --resume continues[/yellow]")
    finally:
        runner.close()

    if not result.interrupted:
        for plan in _ranked_plans(study, settings)[:3]:
            console.print(f"[bold]verify[/bold]: {_plan_text(plan)} (fresh processes, interleaved pairs)")
            verdict = verify(plan, runner, settings, baseline_batch, profile)
            result.verdicts.append(verdict)
            console.print(("  [green]accepted[/green]: " if verdict.accepted else "  [red]rejected[/red]: ")
                          + verdict.reason)
            if verdict.accepted:
                if settings.objective != "memory" and not verdict.estimate_note:
                    verdict = settle(verdict, runner, settings, baseline_batch, profile, console, result.verdicts)
                result.best = verdict
                result.summary = _summary(profile, verdict)
                break
    return _save(result, run_dir, t_start)


GROUPS = {"pad_dim": "padding", "pad_ops": "padding", "compile": "execution", "matmul_precision": "precision",
          "mesh": "sharding", "shard_rule": "sharding", "batch_sharding": "sharding"}


def attribute(plan: Plan, runner: Runner, settings: TuneSettings, baseline_batch: int | None) -> list[Attribution]:
    """Ablate a verified plan: each group of its actions against the plan without it, so a gain is not
    credited to padding when fused execution carried it (or the reverse). Only for plans of two groups or more."""
    groups: dict[str, list] = {}
    for action in plan.actions:
        groups.setdefault(GROUPS.get(action.kind, action.kind), []).append(action)
    if len(groups) < 2:
        return []
    out = []
    pairs = settings.verify_pairs
    for group, actions in groups.items():
        without = Plan(actions=[a for a in plan.actions if a not in actions])
        text = _plan_text(Plan(actions=actions))
        try:
            a, b = runner.measure_plans(without, plan, f"ablate-{group}", pairs)
        except TrialFailed as exc:
            out.append(Attribution(group=group, actions=text, without=_plan_text(without),
                                   reason=f"not measured: {exc.kind}: {exc.message[:160]}"))
            continue
        before, after = batch_size(without, baseline_batch), batch_size(plan, baseline_batch)
        per_sample = baseline_batch is not None and before != after
        speed = speedup([s.wall_s for s in a], [s.wall_s for s in b], min_gain=settings.min_gain, seed=settings.seed,
                        baseline_batch=before if per_sample else None, candidate_batch=after if per_sample else None)
        out.append(Attribution(group=group, actions=text, without=_plan_text(without), speed=speed.model_dump(),
                               reason=speed.reason))
    return out


def settle(verdict: Verdict, runner: Runner, settings: TuneSettings, baseline_batch: int | None, profile,
           console, verdicts: list[Verdict]) -> Verdict:
    """Ablate a verified plan; when a group of its actions verifiably slows it (the interval of what it adds
    lies below 1), verify the plan without that group and keep it if it passes (then ablate that one)."""
    verdict.attribution = [a.model_dump() for a in attribute(verdict.plan, runner, settings, baseline_batch)]
    for a in verdict.attribution:
        shown = _speed_text(a["speed"]) if a["speed"] else a["reason"]
        console.print(f"  {a['group']} ({a['actions']}) adds {shown} over the rest of the plan")
    slow = [a for a in verdict.attribution if a["speed"] and a["speed"]["ci_high"] < 1.0]
    if not slow:
        return verdict
    groups = {a["group"] for a in slow}
    smaller = Plan(actions=[x for x in verdict.plan.actions if GROUPS.get(x.kind, x.kind) not in groups])
    if not smaller.actions:
        return verdict
    left_out = [f"{a['group']} ({a['actions']}): it slowed the verified plan, {_speed_text(a['speed'])}" for a in slow]
    console.print(f"[bold]verify[/bold]: {_plan_text(smaller)} (without {', '.join(sorted(groups))}, which slowed it)")
    trimmed = verify(smaller, runner, settings, baseline_batch, profile)
    verdicts.append(trimmed)
    console.print(("  [green]accepted[/green]: " if trimmed.accepted else "  [red]rejected[/red]: ") + trimmed.reason)
    if not trimmed.accepted:
        return verdict
    trimmed.left_out = verdict.left_out + left_out
    return settle(trimmed, runner, settings, baseline_batch, profile, console, verdicts)


def _summary(profile, verdict: Verdict | None) -> dict:
    """The baseline's figures; with a verified change, its measured step time (other figures unknown)."""
    from tpu_agent.report.summary import from_profile

    summary = from_profile(profile).model_copy(update={"source": "report"})
    if verdict is not None and verdict.speed and not verdict.speed.get("per_sample"):
        summary = summary.model_copy(update={
            "step_time_s": verdict.speed["candidate_median_s"], "steps_measured": verdict.speed["pairs"],
            "flops_per_step": None, "mfu": None, "peak_memory_bytes": None, "live_peak_bytes": None,
            "padding_waste": None})
    return summary.model_dump(mode="json")


def _outcome(t: TrialRecord) -> dict:
    """A trial as the proposers read it (proposers.base.TrialOutcome)."""
    status = {"complete": "measured", "numerics": "rejected", "repeated": "measured"}.get(t.state, t.state)
    return {"number": t.number, "actions": [a.model_dump(mode="json") for a in t.plan.actions], "status": status,
            "speedup": t.speedup, "loss_ok": t.state != "numerics", "note": t.reason or None}


def _ranked_plans(study: optuna.Study, settings: TuneSettings) -> list[Plan]:
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None
            and t.user_attrs.get("plan")]
    done.sort(key=lambda t: t.value, reverse=True)
    plans, seen = [], set()
    for t in done:
        plan = Plan.model_validate(t.user_attrs["plan"])
        if not plan.actions or plan.key() in seen:
            continue
        if t.value <= 1.0:
            break
        seen.add(plan.key())
        plans.append(plan)
    return plans


def _speed_text(s: dict) -> str:
    unit = " per sample" if s.get("per_sample") else ""
    return f"{s['speedup']:.3f}x{unit} (95% CI {s['ci_low']:.3f}-{s['ci_high']:.3f}, {s['pairs']} pairs)"


def _plan_text(plan: Plan) -> str:
    if not plan.actions:
        return "(no change)"
    parts = []
    for a in plan.actions:
        if isinstance(a, PadDim):
            parts.append(f"{a.name or 'literal'} {a.old}->{a.new} ({a.file}:{a.line})")
        else:
            fields = {k: v for k, v in a.model_dump().items() if k != "kind"}
            parts.append(f"{a.kind} {json.dumps(fields, separators=(',', ':'))}")
    return "; ".join(parts)


def _save(result: TuneResult, run_dir: Path, t_start: float) -> TuneResult:
    result.duration_s = time.perf_counter() - t_start
    (run_dir / "tune.json").write_text(result.model_dump_json(indent=2) + "\n")
    return result
