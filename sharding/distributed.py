"""Several processes, one JAX program: `jax.distributed` start-up and agreed stop requests.

`initialize()` starts JAX's own runtime (coordination service + XLA collectives; gloo on CPU)
from explicit arguments, from the cluster environments JAX detects itself (SLURM, Open MPI,
Kubernetes, Cloud TPU), or does nothing for a single process. `StopRequest` turns SIGTERM /
SIGINT into one step at which every process stops, so that all of them take part in the final
checkpoint.
"""

from __future__ import annotations

import os
import signal

import jax

# Environment variables by which SLURM, Open MPI and JAX say "you are one of several processes".
_CLUSTER_SIZES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _in_a_cluster() -> bool:
    sizes = [os.environ.get(v, "") for v in _CLUSTER_SIZES]
    if any(size.isdigit() and int(size) > 1 for size in sizes) or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.environ.get("JOB_COMPLETION_INDEX") is not None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> bool:
    """Starts `jax.distributed` when this is one of several processes; True if it did.

    Explicit arguments win; otherwise JAX's cluster auto-detection reads the environment. Must
    run before anything asks JAX for devices.
    """
    explicit = (coordinator, num_processes, process_id)
    if any(v is not None for v in explicit) and None in explicit:
        raise ValueError("--coordinator, --num_processes and --process_id go together; give all three or none")
    if num_processes == 1 or (num_processes is None and not _in_a_cluster()):
        return False
    # CPU devices of different processes talk through gloo (the default CPU client has no
    # cross-process collectives); harmless on GPU and TPU, whose own collectives are used.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return True


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
