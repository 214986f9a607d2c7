"""Several processes, one JAX program: `jax.distributed` start-up and agreed stop requests.

`initialize()` starts JAX's own runtime (coordination service + XLA collectives; gloo on CPU)
from explicit arguments, from the cluster environments JAX detects itself (SLURM, Open MPI,
Kubernetes, Cloud TPU), or does nothing for a single process. `StopRequest` turns SIGTERM /
SIGINT into one step at which every process stops, so that all of them take part in the final
checkpoint. When a process is lost, JAX's heartbeats end every survivor; `stderr_guard.py` turns
the abort JAX prints into one line naming the lost process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax

from sharding import hosts

# Environment variables by which SLURM, Open MPI and JAX say "you are one of several processes".
_CLUSTER_SIZES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
_peer_timeout_s = 120
CONNECT_S = 60.0  # how long the processes' first collective may take to connect
START_S = 300  # how long a process waits for the coordinator and the others to start (JAX's default)


def _in_a_cluster() -> bool:
    sizes = [os.environ.get(v, "") for v in _CLUSTER_SIZES]
    if any(size.isdigit() and int(size) > 1 for size in sizes) or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.environ.get("JOB_COMPLETION_INDEX") is not None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    peer_timeout_s: int = 120,
    interface: str | None = None,
) -> bool:
    """Starts `jax.distributed` when this is one of several processes; True if it did.

    Explicit arguments win; otherwise JAX's cluster auto-detection reads the environment. Must
    run before anything asks JAX for devices. `peer_timeout_s`: the coordination service's
    heartbeat timeout, after which a process that stopped answering (hung, frozen, its host
    gone) ends the job. `interface`: the network interface (or address) the CPU collectives use
    (`hosts.advertised`); on CPUs they are connected here, and processes that cannot reach each
    other end in a ValueError naming every process's address.
    """
    if peer_timeout_s < 1:
        raise ValueError(f"--peer_timeout_s={peer_timeout_s}: give a whole number of seconds >= 1")
    explicit = (coordinator, num_processes, process_id)
    if any(v is not None for v in explicit) and None in explicit:
        raise ValueError("--coordinator, --num_processes and --process_id go together; give all three or none")
    if num_processes == 1 or (num_processes is None and not _in_a_cluster()):
        return False
    # CPU devices of different processes talk through gloo (the default CPU client has no
    # cross-process collectives); harmless on GPU and TPU, whose own collectives are used.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from jax._src import distributed

    if interface:
        hosts.interface_address(interface)  # a mistyped name fails before any waiting
    if coordinator is not None:  # the guard also turns an unreachable coordinator's abort into one line
        _guard_stderr(process_id, num_processes, coordinator)
    jax.distributed.initialize(coordinator, num_processes, process_id, heartbeat_timeout_seconds=peer_timeout_s,
                               initialization_timeout=START_S)
    global _peer_timeout_s
    _peer_timeout_s = peer_timeout_s
    if coordinator is None:  # the process's place is known only now
        state = distributed.global_state
        _guard_stderr(state.process_id, state.num_processes, state.coordinator_address)
    address, chosen = hosts.advertised(distributed.global_state.coordinator_address, interface)
    _gloo_on(address)
    if jax.default_backend() == "cpu":
        _connect_collectives(address, chosen)
    return True


def _gloo_on(address: str) -> None:
    """CPU clients made from now on run gloo bound to, and advertising, `address` (JAX's own
    factory lets gloo take the host name's address, often loopback)."""
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    def make_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=_client(), hostname=address)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


def _connect_collectives(address: str, chosen: str, wait_s: float = CONNECT_S) -> None:
    """A first collective over every device, so that processes that cannot reach each other
    find out now, within `wait_s`, each in one line naming every process's address, not in the
    first step. (gloo's own retries can take minutes; a connection that is stuck stays behind in
    a thread that ends with the process.)"""
    from jax.experimental import multihost_utils

    raise_flag("address", f"{address} ({chosen})")
    failure: list[str] = []

    def connect():
        try:
            multihost_utils.sync_global_devices("meshlm: collectives connected")
        except jax.errors.JaxRuntimeError as e:
            failure.append(" ".join(str(e).split())[:200])

    connecting = threading.Thread(target=connect, name="meshlm-connect", daemon=True)
    connecting.start()
    connecting.join(wait_s)
    if connecting.is_alive():
        failure.append(f"no connection within {wait_s:.0f} s")
    if not failure:
        return
    roll_call("collectives_failed", 15.0)  # the others fail too: each says so before any exits
    seen = raised_flags("address")
    addresses = "; ".join(f"process {i} at {seen[i]}" for i in sorted(seen))
    raise ValueError(
        f"process {jax.process_index()} of {jax.process_count()} could not connect to the others' CPU collectives (gloo: {failure[0]}); "
        f"addresses tried: {addresses}. Give each process the network interface that reaches the other hosts: "
        f"--interface=NAME (or {hosts.INTERFACE_ENV}=NAME; for NCCL on GPUs, NCCL_SOCKET_IFNAME)"
    )


def _client():
    """JAX's coordination-service client (orbax uses the same; jax has no public handle)."""
    from jax._src import distributed

    return distributed.global_state.client


def _guard_stderr(process_id: int, num_processes: int, coordinator: str) -> None:
    """Runs this process's stderr through `stderr_guard.py`, which outlives it: when JAX's
    coordination client aborts the process because a peer was lost (or the coordinator never
    answered), the guard replaces JAX's fatal record and stack trace with one line saying so."""
    guard = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("stderr_guard.py")), str(process_id), str(num_processes), coordinator, str(START_S)],
        stdin=subprocess.PIPE, stdout=sys.stderr.fileno(), close_fds=True,
    )
    sys.stderr.flush()
    os.dup2(guard.stdin.fileno(), 2)
    guard.stdin.close()  # fd 2 is now the one writer; the guard sees EOF when this process ends


def raise_flag(name: str, value: str = "1") -> None:
    """Marks this process in the coordination service's key-value store under `name` (nothing
    with one process)."""
    client = _client()
    if client is not None:
        client.key_value_set(f"meshlm/{name}/{jax.process_index()}", value, allow_overwrite=True)


def raised_flags(name: str) -> dict[int, str]:
    """The processes that raised flag `name`, with their values."""
    client = _client()
    if client is None:
        return {}
    return {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(f"meshlm/{name}/")}


def roll_call(name: str, wait_s: float) -> bool:
    """Raises flag `name` and waits up to `wait_s` for every process to raise it; whether all did."""
    if _client() is None or jax.process_count() == 1:
        return True
    raise_flag(name)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if len(raised_flags(name)) == jax.process_count():
            return True
        time.sleep(0.2)
    return False


def await_lost_peer(wait_s: float = 10.0) -> None:
    """After an error caught on this process: if another process is gone, wait for JAX's
    heartbeat check to end this one (the guarded stderr then names the lost process) instead of
    printing a traceback first; a collective whose peer died often fails at once, long before.

    A roll call tells which: every process that caught an error answers; if all do within
    `wait_s`, the error is everyone's own and this returns at once. Otherwise it returns only if
    JAX has not ended the process within twice its timeout.
    """
    if _client() is None or jax.process_count() == 1:
        return
    try:
        if roll_call("roll_call", wait_s):
            return
    except Exception:  # the service is unreachable: process 0 is gone, and JAX is ending this one
        pass
    time.sleep(2 * _peer_timeout_s + 10)


class StopRequest:
    """SIGTERM or SIGINT, seen by any process, becomes a step at which all processes stop.

    One process: a flag set by the signal handler. Several: SIGINT is turned into SIGTERM, which
    JAX's preemption notifier (started by `jax.distributed.initialize`) broadcasts through the
    coordination service; `reached(step)` is then True on every process at the same step.
    A second SIGINT interrupts at once, as usual.
    """

    def __init__(self):
        self.signal_name: str | None = None
        self._multi = jax.process_count() > 1
        self._previous = {}
        signals = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # a second one is not caught
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)

    def reached(self, step: int) -> bool:
        """Whether to stop after `step`; collective across processes, call it at every step."""
        if not self._multi:
            return self.signal_name is not None
        from jax.experimental import multihost_utils

        if multihost_utils.reached_preemption_sync_point(step):
            self.signal_name = self.signal_name or "SIGTERM"
            return True
        return False

    def close(self) -> None:
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler)
