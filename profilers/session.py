"""The profiler inside the run's child process: hooks in, steps timed, stop at --steps.

Host/device split (`host_device` in the profile): after the last measured
step (or, without --steps, right after the warm-up, since the end is not
known) the profiler runs `host_device_steps` more steps with
`STATE.time_executables` on (backend/core/state.py), flipped at the step boundary, so every launch
waits for its executable: the launches' time is device time and the rest of
the wall time is host time, with no overlap to hide either. Those steps are
`instrumented` and left out of the statistics; with --steps they come on top
of the measured steps, so the user still gets N measured steps.

Everything on the step path is kept cheap (a device sync, a clock read, a few
counters); the expensive analysis waits for `finish`, after the script, and
gets only what was collected (`build_profile(data, run, ...)`). The child
(`tpu_agent.run.child`) builds the Session from what the parent asked for and
hands it the application's parts it needs (the environment probe, the
progress pipe): the profiler imports nothing of the application.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from .collected import Collected, RunInfo, Window
from .schema import Environment, Settings, Step

PROFILE_FILE = "profile.json"
PLOT_FILE = "step_times.png"


class StopProfiling(BaseException):
    """Raised at the step boundary after the last requested step; the child catches it.

    A BaseException, so a script's `except Exception` does not swallow it and its
    `finally` blocks run.
    """


def _stats_tuple():
    from tpu_agent.backend.core.state import STATS

    return (STATS.h2d_count, STATS.h2d_bytes, STATS.d2h_count, STATS.d2h_bytes)


def _launch_totals() -> tuple[float, int]:
    """Seconds and count of executable launches so far (every executable, whole run)."""
    from tpu_agent.backend.core import executables

    registry = executables.all()
    return sum(e.time_s for e in registry), sum(e.calls for e in registry)


def _snapshot() -> Window:
    from tpu_agent.backend.core import executables

    from tpu_agent.backend.core.lazy import RECORDER

    registry = executables.all()
    return Window({e.id: e.calls for e in registry}, _stats_tuple(), len(registry), len(RECORDER.breaks))


class Session:
    def __init__(self, settings: Settings, run_dir: Path, script: str, args: list[str], *,
                 progress: Callable[..., None] | None = None,
                 environment: Callable[[], Environment] | None = None) -> None:
        from .ranks import launch_of, rank_dir

        self.launch = launch_of()  # one rank of several: its own profile, in its own folder
        if self.launch is not None:
            run_dir = rank_dir(run_dir, self.launch.rank)
            run_dir.mkdir(parents=True, exist_ok=True)
            if settings.trace_dir:
                settings = settings.model_copy(update={"trace_dir": str(Path(settings.trace_dir) / f"rank{self.launch.rank}")})
        self.run = RunInfo(settings, run_dir, script, args, environment,
                           rank=self.launch.rank if self.launch is not None else None)
        self.settings = settings
        self.run_dir = run_dir
        self.data = Collected()
        self.progress = progress  # progress(event, **fields): the parent's progress bar
        self.write_failed: OSError | None = None  # profile.json could not be written (the parent says why)
        self._compile_acc = 0.0
        self._compiled_in_step = False
        self._counter = None
        self._step_start = 0.0
        self._tracing = False
        self._step_mark = None  # the open jax.profiler.StepTraceAnnotation of the step under way, when tracing
        self._remove_listener = None
        self._seen_recompiles = 0
        self._seen_registered = 0
        self._launches_at_start: tuple[float, int] | None = None  # launch totals when a timed step began
        self._timed_step = False  # the step under way waits for every launch (host/device split)
        self._time_executables_was: bool | None = None  # STATE.time_executables before the profiler flipped it
        self.modules = None  # a modules.ModuleWatch: the sizes of the modules built
        self.collectives = None  # a ranks.CollectiveWatch: each step's collectives, timed
        self._peaks = None  # backend/core/memory.py's StepPeak: each step's in-step peak

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        """After `import torch` (the device is up), before the script: hooks in."""
        import jax
        import torch

        from tpu_agent.backend.core import steps

        from .flopcheck import TpuFlopCounter

        self._set_mode(torch)
        self._watch_shapes()
        from .ranks import CollectiveWatch

        try:
            self.collectives = CollectiveWatch()
        except Exception as exc:  # noqa: BLE001 - the profile goes on without collective times
            self.data.notes.append(f"collectives could not be timed: {exc}")
        jax.monitoring.register_event_duration_secs_listener(self._on_jax_event)
        from tpu_agent.backend.core.memory import watch_step_peaks

        self._peaks = watch_step_peaks()
        self._remove_listener = steps.add_step_listener(self._on_step)
        from .modules import ModuleWatch

        self.modules = ModuleWatch()
        self.modules.install()
        if self.settings.warmup == 0:
            self._start_trace()
        try:
            self._counter = TpuFlopCounter()
            self._counter.__enter__()
        except Exception as exc:  # noqa: BLE001 - the cross-check is optional; the profile is not
            self._counter = None
            self.data.notes.append(f"FlopCounterMode could not start: {exc}")
        self._time_launches(self._is_timed(1))
        self._progress("running")
        self._step_start = time.perf_counter()

    def _set_mode(self, torch) -> None:
        tpu = getattr(torch, "tpu", None)
        if tpu is None or not hasattr(tpu, "set_eager_mode"):
            self.data.notes.append("torch.tpu has no eager modes (not the bundled device?): mode left as is")
            return
        mode = self.settings.mode
        if mode == "compiled-if-available":
            if callable(getattr(tpu, "compile", None)):
                self.data.notes.append(
                    "compiled mode: torch.tpu.compile is available; the script's torch.compile / torch.tpu.compile "
                    "calls compile whole programs, everything else runs fused")
            else:
                self.data.notes.append(
                    "compiled mode is not available in this backend (no torch.tpu.compile): profiled in fused mode")
            mode = "fused"
        tpu.set_eager_mode(tpu.EagerMode.DEFER_AND_FUSE if mode == "fused" else tpu.EagerMode.DEFER_NEVER)

    def _watch_shapes(self) -> None:
        """Batches as loaders yield them, copies to the device by line: where a changing length comes from."""
        from tpu_agent.backend.core import transfer

        from .batches import BatchWatch
        from .shapes import TransferWatch

        self.data.batches = BatchWatch(lambda: len(self.data.steps) + 1)
        self.data.batches.install()
        self.data.transfers = transfer.h2d_watch = TransferWatch()

    def _unwatch_shapes(self) -> None:
        from tpu_agent.backend.core import transfer

        if self.data.batches is not None:
            self.data.batches.uninstall()
        transfer.h2d_watch = None

    # ------------------------------------------------------------------ hooks

    def _on_jax_event(self, event: str, duration: float, **_kw) -> None:
        if event.startswith("/jax/core/compile/"):
            self._compile_acc += duration
            self._compiled_in_step = True
            if event.endswith("backend_compile_duration"):
                self.data.compiles += 1

    @staticmethod
    def _sync() -> None:
        """Wait for the device (the backend already flushed pending fused work)."""
        import jax

        jax.block_until_ready(jax.live_arrays())

    def _live_and_peak(self) -> tuple[int, int | None]:
        """The bytes alive now and the step's in-step peak, counted after the step's time was taken; the peak
        watcher recounts the live arrays at the boundary, so they are walked once."""
        if self._peaks is None:  # the run ended before the profiler was installed
            import jax

            from tpu_agent.backend.core.memory import live_bytes

            return live_bytes(jax.live_arrays()), None
        peak = self._peaks.end_step()
        return self._peaks.current, max(peak, self._peaks.current)

    def _on_step(self, source: str) -> None:
        self._sync()
        now = time.perf_counter()
        self._end_step_mark()
        d = self.data
        k = len(d.steps) + 1
        if source not in d.markers:
            d.markers.append(source)
        device_s = launches = None
        if self._launches_at_start is not None:
            total_s, calls = _launch_totals()
            device_s, launches = total_s - self._launches_at_start[0], calls - self._launches_at_start[1]
        comm_s, ran = self._step_collectives()
        live_bytes, peak = self._live_and_peak()
        d.steps.append(Step.model_construct(  # no validation on the step path: the values are ours
            index=k, wall_s=now - self._step_start, compile_s=self._compile_acc,
            warmup=k <= self.settings.warmup, instrumented=self._counter is not None or self._timed_step,
            compiled=self._compiled_in_step, live_bytes=live_bytes, peak_bytes=peak, device_s=device_s,
            launches=launches, comm_s=comm_s, collectives=ran,
        ))
        self.data.compile_s += self._compile_acc
        self._compile_acc = 0.0
        self._compiled_in_step = False
        d.live_peak = max(d.live_peak or 0, live_bytes)
        d.step_peak = max(d.step_peak or 0, peak)
        self._stamp_compiles(k)
        if self._counter is not None:
            self._end_flop_count("step 1 (from the script's start to the first step marker)")
        d.window_end = _snapshot()
        if k == self.settings.warmup:
            d.window_start = d.window_end
            self._start_trace()
        self._progress("step", step=k, wall_s=d.steps[-1].wall_s, compile_s=d.steps[-1].compile_s)
        s = self.settings
        if s.steps is not None and k >= s.warmup + s.steps:
            self._stop_trace()  # the trace covers the measured steps only
            if k >= s.warmup + s.steps + self.settings.timed_steps():
                self._time_launches(False)
                d.stopped = True
                self._progress("stopping")
                raise StopProfiling()
        self._time_launches(self._is_timed(k + 1))
        self._begin_step_mark(k + 1)
        self._step_start = time.perf_counter()

    def _step_collectives(self) -> tuple[float | None, int | None]:
        """The collectives of the step that just ended: (seconds, calls), None when none ran."""
        if self.collectives is None:
            return None, None
        delta = self.collectives.step()
        self.data.collective_steps.append(delta)
        if not delta:
            return None, None
        return sum(s for _c, _b, s in delta.values()), sum(c for c, _b, _s in delta.values())

    # ------------------------------------------------------------------ host/device split

    def _is_timed(self, step: int) -> bool:
        """Whether step `step` waits for every launch: after the measured steps with --steps, else after warm-up."""
        s, n = self.settings, self.settings.timed_steps()
        first = s.warmup + s.steps if s.steps is not None else max(s.warmup, 1)  # step 1 runs under FlopCounterMode
        return first < step <= first + n

    def _time_launches(self, on: bool) -> None:
        """At a step boundary: wait for every launch in the next step (or stop), and count launches from here."""
        from tpu_agent.backend.core import modes  # loaded: its $TPU_AGENT_TIME_EXECUTABLES is applied

        if self._time_executables_was is None:
            self._time_executables_was = modes.STATE.time_executables
        self._timed_step = on
        modes.set_time_executables(on or self._time_executables_was)
        # FlopCounterMode's step is not timed: its dispatch is the counter's, not the script's.
        timed = modes.STATE.time_executables and self._counter is None
        self._launches_at_start = _launch_totals() if timed else None

    def _stamp_compiles(self, step: int | None) -> None:
        from tpu_agent.backend.core import executables
        from tpu_agent.backend.core.lazy import RECORDER

        new = len(RECORDER.recompiles) - self._seen_recompiles
        if new > 0:
            self.data.recompile_steps += [step] * new
            self._seen_recompiles = len(RECORDER.recompiles)
        self.data.break_steps += [step] * (len(RECORDER.breaks) - len(self.data.break_steps))
        registry = executables.all()
        for exe in registry[self._seen_registered:]:
            self.data.registered_steps[exe.id] = step
        self._seen_registered = len(registry)

    def _end_flop_count(self, region: str) -> None:
        counter, self._counter = self._counter, None
        try:
            counter.__exit__(None, None, None)
            self.data.counter_flops = float(counter.get_total_flops())
            self.data.counter_by_op = counter.by_op()
        except Exception as exc:  # noqa: BLE001
            self.data.notes.append(f"FlopCounterMode failed: {exc}")
            return
        self.data.region = region
        self.data.region_calls = _snapshot().calls

    def _start_trace(self) -> None:
        if not self.settings.trace_dir:
            return
        import jax

        try:
            jax.profiler.start_trace(self.settings.trace_dir, create_perfetto_trace=True)
            self._tracing = True
        except Exception as exc:  # noqa: BLE001
            self.data.notes.append(f"jax.profiler trace could not start: {exc}")
            return
        self._begin_step_mark(len(self.data.steps) + 1)

    def _begin_step_mark(self, step: int) -> None:
        """Each traced step as XProf's step marker (its overview's step-time graph, the trace viewer's Steps row)."""
        if not self._tracing or self._step_mark is not None:
            return
        import jax

        self._step_mark = jax.profiler.StepTraceAnnotation("train", step_num=step)
        self._step_mark.__enter__()

    def _end_step_mark(self) -> None:
        mark, self._step_mark = self._step_mark, None
        if mark is not None:
            mark.__exit__(None, None, None)

    def _stop_trace(self) -> None:
        if not self._tracing:
            return
        import jax

        self._end_step_mark()
        self._tracing = False
        try:
            jax.profiler.stop_trace()
            self.data.trace_dir = self.settings.trace_dir
        except Exception as exc:  # noqa: BLE001
            self.data.notes.append(f"jax.profiler trace could not be written: {exc}")

    def _progress(self, event: str, **fields) -> None:
        if self.progress is not None:
            self.progress(event, **fields)

    # ------------------------------------------------------------------ the end

    def is_stop(self, exc: BaseException) -> bool:
        return isinstance(exc, StopProfiling)

    def finish(self, exit_code: int, error: str | None) -> None:
        """Close the measurement and write profile.json; never raises (the script's result comes first)."""
        try:
            self._close_measurement()
        except Exception as exc:  # noqa: BLE001
            self.data.notes.append(f"profiler error while closing the measurement: {exc}")
        self._progress("analysing")
        try:
            from .build import build_profile
            from .schema import write_profile

            profile = build_profile(self.data, self.run, exit_code, error)
            profile.modules = self.modules.report() if self.modules is not None else None
            if self.launch is not None:
                profile.distributed = self._rank_section(profile)
            try:
                write_profile(profile, self.run_dir / PROFILE_FILE)  # first without the plot: kept if plotting fails
            except OSError as exc:  # the environment (a full disk, a read-only folder), not a bug: no traceback
                self.write_failed = exc
                return
            from .plot import step_plot
            from .schema import Refused

            try:
                plot = step_plot(profile, self.run_dir / PLOT_FILE)
            except OSError as exc:  # no room for the plot: the profile written above stands, without it
                plot = None
                profile.files.refused.append(Refused.of(exc, self.run_dir / PLOT_FILE, "the step-time plot"))
            if plot is not None or profile.files.refused:
                profile.files.plot = str(plot) if plot is not None else None
                try:  # the plot's path (or why it is missing) recorded
                    write_profile(profile, self.run_dir / PROFILE_FILE)
                except OSError:  # the profile written above stands: the plot goes unnamed
                    pass
        except OSError as exc:
            self.write_failed = exc
        except Exception:  # noqa: BLE001 - a profiler bug must not hide the script's outcome
            sys.stderr.write("tpu-agent: the profiler failed to write profile.json:\n")
            traceback.print_exc()
        finally:
            self._progress("done")

    def _rank_section(self, profile):
        """This rank's entry of a distributed run's profile (the parent gathers the ranks' after the job)."""
        from .ranks import METHOD, rank_profile
        from .schema import Distributed

        watch = self.collectives
        entry = rank_profile(self.launch.rank, profile.steps.items, self.data.collective_steps, status=profile.status,
                             exit_code=profile.exit_code, live_peak=profile.memory.live_peak_bytes,
                             step_peak=profile.memory.step_peak_bytes,
                             xla_peak=profile.memory.xla_peak_bytes,
                             runtime_peak=profile.memory.device_stats.get("peak_bytes_in_use"),
                             untimed=watch.untimed if watch else 0)
        return Distributed(world_size=self.launch.world_size, ranks=[entry], method=METHOD)

    def _close_measurement(self) -> None:
        import jax

        if self.modules is not None:
            self.modules.uninstall()
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        self._unwatch_shapes()
        if self._time_executables_was is not None:
            from tpu_agent.backend.core import modes

            modes.set_time_executables(self._time_executables_was)
        d = self.data
        if not d.steps:
            # No step marker: the whole run is one region, timed from the script's start.
            from tpu_agent.backend.core.lazy import RECORDER

            RECORDER.flush("end of run")
            self._sync()
            live, peak = self._live_and_peak()
            d.whole_run = True
            comm_s, ran = self._step_collectives()
            d.steps.append(Step(index=1, wall_s=time.perf_counter() - self._step_start, compile_s=self._compile_acc,
                                instrumented=self._counter is not None, compiled=self._compiled_in_step,
                                live_bytes=live, peak_bytes=peak, comm_s=comm_s, collectives=ran))
            d.compile_s += self._compile_acc
            d.live_peak, d.step_peak = live, peak
            d.window_start = None
            d.window_end = _snapshot()
            self._stamp_compiles(None)
            if self._counter is not None:
                self._end_flop_count("the whole run (no step markers)")
        else:
            d.compile_s += self._compile_acc
            self._stamp_compiles(None)
            if self._counter is not None:  # failed before the first step ended
                self._end_flop_count("the run up to the failure (no step completed)")
        self._compile_acc = 0.0
        if self.collectives is not None:
            self.collectives.stop()
        try:
            jax.monitoring.unregister_event_duration_listener(self._on_jax_event)
        except Exception:  # noqa: BLE001
            pass
        self._stop_trace()
        try:
            from tpu_agent.backend.core.memory import live_bytes

            d.live_end = live_bytes(jax.live_arrays())
        except Exception:  # noqa: BLE001
            pass
        try:
            stats = jax.local_devices()[0].memory_stats()  # this rank's (devices() lists every rank's)
            if stats:
                d.device_stats = {k: int(v) for k, v in stats.items() if isinstance(v, (int, float))}
        except Exception:  # noqa: BLE001
            pass

