"""One JAX runtime across the ranks of a torchrun job.

PyTorch's launcher (`torchrun`, `python -m torch.distributed.run`, and `tpu-agent run --nproc N`, which starts
it) gives each rank RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Before JAX starts its backends (the first
tpu op: jax_setup.configure), a rank of a job of two or more joins `jax.distributed` with them: the
coordinator on MASTER_ADDR, process id RANK. Its port: under torchrun (TORCHELASTIC_USE_AGENT_STORE), rank 0
takes a free one and tells the other ranks through the launcher's own store at MASTER_PORT, since a fixed port
next to MASTER_PORT may be any other process's (two jobs on one host, a test suite on two workers); launched
otherwise, MASTER_PORT + 1. Where a host runs several ranks, each opens only its own chips or GPUs
(topology.py). Several nodes (`torchrun --nnodes N --node-rank k`) join the same way: RANK and WORLD_SIZE
are the job's. On a CPU host the processes' collectives go through gloo
(`jax_cpu_collectives_implementation`); on TPUs, ICI. A process launched without those variables, or alone,
stays a single-process runtime. Torch only for the launcher's store.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass

from ..core.state import STATE
from . import faults

PORT_OFFSET = 1  # the coordinator's port without torchrun's store: MASTER_PORT + 1 (MASTER_PORT is the store's)
STORE_WAIT_S = 300  # how long a rank waits for rank 0's coordinator port (JAX waits as long for every rank)


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    coordinator: str  # host:port of JAX's coordination service


def from_environment(environ=os.environ) -> Launch | None:
    """The job this process is a rank of, from the launcher's variables; None outside a job of two or more."""
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
        rank = int(environ.get("RANK", "0"))
    except ValueError:
        return None
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if world < 2 or not addr or not port or not port.isdigit():
        return None
    coordinator_port = int(port) + PORT_OFFSET
    if coordinator_port > 65535:
        coordinator_port = int(port) - PORT_OFFSET
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
    return Launch(rank, world, f"{host}:{coordinator_port}")


def join() -> Launch | None:
    """Join the job's JAX runtime (once; before any JAX computation). Called by jax_setup.configure."""
    if STATE.distributed.joined is not None:
        return STATE.distributed.joined
    launch = from_environment()
    if launch is None:
        return None
    launch = _through_the_store(launch)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM)
    # Joining waits, in C++, for every rank (up to JAX's 5 minutes): Python's Ctrl-C would wait as long, so
    # Ctrl-C there ends the process as it would a C program.
    _coordinator_port_free(launch)  # before JAX: its service, failing to bind, sometimes crashes (SIGSEGV)
    interrupt = signal.signal(signal.SIGINT, signal.SIG_DFL) if main else None
    try:
        jax.distributed.initialize(coordinator_address=launch.coordinator, num_processes=launch.world_size,
                                   process_id=launch.rank, local_device_ids=_local_device_ids())
    except Exception:
        _coordinator_port_free(launch)  # taken since
        raise
    finally:
        if main:
            signal.signal(signal.SIGINT, interrupt)
    # JAX's preemption notifier takes SIGTERM (and the process then ignores it): torchrun stops the other
    # ranks of a failed job with SIGTERM, so a rank must still die of it, as it would without JAX.
    if main:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
    _exit_promptly_after_a_failure()
    STATE.distributed.joined = launch
    return launch


def _local_device_ids() -> list[int] | None:
    """This rank's GPUs where a host runs several ranks (topology.py); None elsewhere: TPU ranks are limited
    by TPU_VISIBLE_CHIPS (set before JAX, jax_setup.configure_environment), CPU ranks by their own devices."""
    from . import topology

    share = topology.rank_share()
    return share.local_device_ids if share is not None else None


def _through_the_store(launch: Launch, environ=os.environ) -> Launch:
    """The launch with its coordinator on a port rank 0 found free, shared through torchrun's store; as it was
    where no launcher's store is (a job started by hand with its variables)."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return launch
    from datetime import timedelta

    from torch.distributed import TCPStore

    host = launch.coordinator.rpartition(":")[0]
    store = TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=STORE_WAIT_S))
    key = f"tpu_agent/jax_coordinator/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # a restarted job's own
    if launch.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        store.set(key, str(port))
    else:
        port = int(store.get(key))
    return Launch(launch.rank, launch.world_size, f"{host}:{port}")


def _exit_promptly_after_a_failure() -> None:
    """A rank whose script raised leaves at once, with its traceback printed and exit status 1 (130 for
    Ctrl-C), as it would without JAX. At exit JAX waits (up to 5 minutes) for every rank at a shutdown
    barrier, which ranks still blocked in a collective with the failed one never reach: torchrun, which stops
    the job when a rank exits, would never hear of the failure. Registered after JAX's own exit handler, so
    it runs first; a clean exit still waits at the barrier (the coordinator must outlive the other ranks)."""
    failed: list[type] = []
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        failed.append(kind)
        previous(kind, value, tb)
        _ctrl_c_ends_the_process()  # the traceback is out: a second Ctrl-C (torchrun sends one) must not stop the exit

    def leave() -> None:
        _ctrl_c_ends_the_process()  # JAX's exit barrier below waits in C++, where Python's Ctrl-C is never seen
        if failed:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(130 if issubclass(failed[0], KeyboardInterrupt) else 1)

    sys.excepthook = excepthook
    atexit.register(leave)


def _coordinator_port_free(launch: Launch) -> None:
    """Rank 0 starts JAX's coordinator: its port taken is one `error:` line and exit 2 (faults.usage_error)."""
    port = int(launch.coordinator.rpartition(":")[2])
    if launch.rank == 0 and port_in_use(port):
        faults.usage_error(f"port {port} (where rank 0 starts JAX's coordinator for this job: MASTER_PORT + "
                           f"{PORT_OFFSET} without torchrun's store) is in use; launch with another --master-port")


def _ctrl_c_ends_the_process() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def port_in_use(port: int) -> bool:
    """Whether a process listens on `port` here (a port a finished job's connections still hold, in TIME_WAIT,
    is free: JAX's server reuses it, as this probe does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def joined() -> Launch | None:
    return STATE.distributed.joined


def devices_of(ranks) -> list:
    """The JAX device of each given rank (a process's first device: one device per rank), in the order given."""
    import jax

    first: dict[int, object] = {}
    for device in jax.devices():
        first.setdefault(device.process_index, device)
    missing = [r for r in ranks if r not in first]
    if missing:
        raise RuntimeError(f"tpu: ranks {missing} have no device in this JAX runtime ({jax.process_count()} "
                           "processes joined); was the job launched with torchrun?")
    return [first[r] for r in ranks]
