"""Checkpoints with orbax: asynchronous saves of the train state plus the data iterator's position.

Parallelism: WORKDIR/checkpoints/<step>/{state, data, checksums}. Orbax writes each step into a
temporary directory and renames it when complete, so an unfinished save (a process killed
mid-write) is never taken as the latest. Every array's checksum (`checksums`: two sums of its
bits, equal on any mesh) is saved beside it and compared after a restore. A complete checkpoint
whose files were later damaged (unreadable, or bits flipped on disk) is reported, renamed
`<step>.unreadable` (kept for inspection, never deleted) and the previous one is used.
Restoring takes an abstract state carrying target shardings, so a checkpoint restores onto any
mesh and process count the arrays fit.

A save needs as many free bytes as the state holds (orbax stores arrays uncompressed): checked
before it starts, on every process. A save that fails anyway (no space left, also inside
orbax's asynchronous writer) ends the run with one line (`CheckpointNotWritten`): its temporary
directory is removed, the previous checkpoints stay as they are. Stopping rather than training
on is deliberate: work that cannot be saved is work lost, and orbax's writer does not recover
from a failed save (its next saves fail on a closed event loop, measured).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lm.config import UserError
from sharding.rules import path_name


class UnreadableCheckpoint(UserError):
    """A checkpoint whose files cannot be read back (truncated, corrupted)."""


class CheckpointNotWritten(UserError):
    """A save failed for lack of space (or another write error); the previous checkpoints are intact."""

    exit_code = 5


class Checkpointer:
    def __init__(self, directory: Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._in_flight: int | None = None  # the step whose asynchronous save may still be running
        self._failed = False
        _quiet_orbax_write_failures()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                    "checksums": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def saved_fields(self, step: int) -> set[str]:
        """The top-level entries of a step's state: {'params'} alone for imported weights."""
        try:
            return set(self.manager.item_metadata(step)["state"] or ())
        except Exception as e:
            raise UnreadableCheckpoint(f"checkpoint {self.directory / str(step)} has unreadable metadata: {_first_line(e)}") from None

    def save(self, step: int, state, data_state: dict | None = None) -> None:
        """Starts writing `state` for `step` (every process takes part); returns before the write
        is durable when async. A step already saved is left as it is."""
        if step in self.manager.all_steps():
            return
        self.wait()  # the previous save's bytes are on disk (orbax would wait for it anyway)
        tree = _as_tree(state)
        self._check_space(step, tree)
        args = {"state": ocp.args.StandardSave(tree), "checksums": ocp.args.JsonSave(checksums(tree))}
        if data_state is not None:
            args["data"] = ocp.args.JsonSave(data_state)
        self._in_flight = step
        try:
            self.manager.save(step, args=ocp.args.Composite(**args))
        except Exception as e:
            self._fail(step, e)

    def _check_space(self, step: int, tree) -> None:
        """Refuses to start a save that cannot fit, on every process if on any (orbax writes a
        multi-host checkpoint into one shared directory: each process checks what it sees)."""
        need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
        self.directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.directory).free
        fits = free >= need
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            fits = bool(np.all(multihost_utils.process_allgather(np.int32(fits))))
        if not fits:
            self._failed = True
            raise CheckpointNotWritten(
                f"no space for the checkpoint of step {step} in {self.directory}: it needs {need / 1e6:,.1f} MB, "
                f"{free / 1e6:,.1f} MB are free (on process {jax.process_index()}; all processes stop); {self._newest()}. Free space and run the same command to resume"
            )

    def _fail(self, step: int | None, error: Exception) -> None:
        """A failed save: its temporary directory removed (never a checkpoint), one line raised."""
        if not _is_write_failure(error):
            raise error
        self._failed, self._in_flight = True, None
        if jax.process_index() == 0 and step is not None:
            for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointNotWritten(
            f"the checkpoint of step {step} could not be written to {self.directory} ({_first_line(error)}); "
            f"{self._newest()}. Free space (or fix the cause) and run the same command to resume"
        ) from None

    def _newest(self) -> str:
        steps = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit()) if self.directory.is_dir() else []
        return f"the newest complete checkpoint is step {steps[-1]}" if steps else "no checkpoint is complete yet"

    def restore(self, abstract_state, step: int | None = None, need_data: bool = False) -> tuple[object, dict | None]:
        """(state placed as `abstract_state`'s shardings, data iterator state) at `step` (default
        latest). A `TrainState` comes back as one (it is stored as the dict of its fields).
        `need_data`: a checkpoint without the data iterator's position is damaged (training
        always saves it; resuming without it would replay the data from its start)."""
        step = self._step(step)
        path = self.directory / str(step)
        tree = _as_tree(abstract_state)
        self._check_layout(tree, step)
        items = {"state": ocp.args.StandardRestore(tree)}
        has_data = (path / "data").exists()
        if need_data and not has_data:
            raise UnreadableCheckpoint(f"checkpoint {path} has no data iterator position (its 'data' item is missing)")
        if has_data:
            items["data"] = ocp.args.JsonRestore()
        if (path / "checksums").exists():  # checkpoints written before checksums have none
            items["checksums"] = ocp.args.JsonRestore()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax / tensorstore raise many kinds; all mean "cannot read"
            raise UnreadableCheckpoint(f"checkpoint {path} cannot be read: {_first_line(e)}") from None
        state = restored["state"]
        if "checksums" in items:
            _verify(state, restored["checksums"], path)
        if hasattr(abstract_state, "from_dict"):
            state = type(abstract_state).from_dict(state)
        return state, (restored["data"] if has_data else None)

    def restore_part(self, abstract_part: dict, step: int | None = None) -> dict:
        """Only the named top-level entries of a step's state (e.g. `params`), read from disk
        alone: the rest (optimizer moments) is never loaded."""
        step = self._step(step)
        self._check_layout(abstract_part, step, partial=True)
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_part)
        args = ocp.args.PyTreeRestore(item=abstract_part, restore_args=restore_args, partial_restore=True)
        try:
            # Bytes in flight bounded near the largest array: the host holds little beyond the
            # restored arrays themselves (orbax's default lets 96 GB be read at once).
            largest = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_part))
            handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=math.ceil(largest / 1e9) + 1)
            with ocp.Checkpointer(handler) as reader:
                part = reader.restore(self.directory / str(step) / "state", args=args)
        except Exception as e:  # orbax / tensorstore raise many kinds; all mean "cannot read"
            raise UnreadableCheckpoint(f"checkpoint {self.directory / str(step)} cannot be read: {_first_line(e)}") from None
        saved = self.directory / str(step) / "checksums" / "metadata"
        if saved.is_file():
            _verify(part, json.loads(saved.read_text()), self.directory / str(step))
        return part

    def restore_latest(self, abstract_state, warn: Callable[[str], None]) -> tuple[int, object, dict | None] | None:
        """(step, state, data state) of the newest readable checkpoint, or None if there is none.

        Unreadable ones are reported through `warn` and renamed `<step>.unreadable`.
        """
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                return step, *self.restore(abstract_state, step, need_data=True)
            except UnreadableCheckpoint as e:
                warn(f"warning: {e}; it is kept as {step}.unreadable and the previous checkpoint is used")
                self.set_aside(step, "unreadable")
        return None

    def _step(self, step: int | None) -> int:
        """`step`, or the latest one; a UserError when there is no such checkpoint."""
        steps = sorted(self.manager.all_steps())
        if not steps:
            raise UserError(f"no checkpoint in {self.directory}; train first")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise UserError(f"no checkpoint of step {step} in {self.directory}; it holds steps {', '.join(map(str, steps))}")
        return step

    def _check_layout(self, abstract_state, step: int, partial: bool = False) -> None:
        """A checkpoint of another state layout (config or meshlm version) is a user error, not damage."""
        try:
            saved = self.manager.item_metadata(step)["state"]
        except Exception as e:
            raise UnreadableCheckpoint(f"checkpoint {self.directory / str(step)} has unreadable metadata: {_first_line(e)}") from None
        if saved is None:
            raise UnreadableCheckpoint(f"checkpoint {self.directory / str(step)} has no state metadata")
        ours, theirs = _paths(abstract_state), _paths(saved)
        if partial:
            theirs = {p for p in theirs if p.split("/")[0] in abstract_state}
        if ours != theirs:
            diff = sorted(ours ^ theirs)[:3]
            raise UserError(
                f"checkpoint {self.directory / str(step)} holds a different train state layout (e.g. {', '.join(diff)}); "
                "it was written by another config or meshlm version: use a new --workdir"
            )

    def set_aside(self, step: int, why: str) -> None:
        """Renames a step's checkpoint `<step>.<why>`: kept for inspection, never taken again."""
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(self.directory / f"{step}.{why}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"meshlm: checkpoint {step} set aside as {why}")
        self.manager.reload()

    def check(self) -> None:
        """CheckpointNotWritten if the save in flight has already failed; never waits."""
        if self._failed or self._in_flight is None:
            return
        try:
            self.manager.check_for_errors()
        except Exception as e:
            self._fail(self._in_flight, e)

    def wait(self) -> None:
        """Until the save in flight is durable; CheckpointNotWritten if it failed (said once)."""
        if self._failed:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._fail(self._in_flight, e)
        self._in_flight = None

    def close(self) -> None:
        if self._failed:  # orbax's writer is left broken by a failed save: nothing more to flush
            return
        self.manager.close()


def checksums(tree) -> dict[str, list[int]]:
    """Each array's [sum of its 32-bit words, sum of word x (1 + position)], modulo 2^32: any
    flipped bit changes the first, swapped words the second. Integer sums do not depend on the
    order of addition, so the values are the same on any mesh and process count, computed where
    the shards are (no gather)."""
    leaves = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "shape")}
    return {k: [int(v) for v in pair] for k, pair in jax.device_get(_checksums(leaves)).items()}


@jax.jit
def _checksums(leaves: dict) -> dict:
    return {k: _sums(x) for k, x in leaves.items()}


def _sums(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32)
    else:
        bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        words = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)  # 8-byte items: a trailing pair
    position = jnp.zeros(words.shape, jnp.uint32)
    for axis in range(words.ndim):  # the row-major index, built from iotas (a sharded array is never flattened)
        stride = int(np.prod(words.shape[axis + 1 :], dtype=np.int64)) % (1 << 32)
        position = position + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride)
    return jnp.stack([words.sum(dtype=jnp.uint32), (words * (position + 1)).sum(dtype=jnp.uint32)])


def _verify(tree, saved: dict, path: Path) -> None:
    """A restored tree's arrays against the checksums saved with them (only those present:
    a partial restore checks its part)."""
    found = checksums(tree)
    bad = sorted(k for k, v in found.items() if k in saved and list(saved[k]) != v)
    if bad:
        raise UnreadableCheckpoint(f"checkpoint {path}: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} "
                                   "read back with other bits than were saved (changed on disk)")


def _is_write_failure(error: BaseException) -> bool:
    """An OS-level write error (no space, quota, I/O) anywhere in the chain, as Python or tensorstore reports it."""
    while error is not None:
        if isinstance(error, OSError) or any(t in str(error) for t in ("RESOURCE_EXHAUSTED", "No space left", "os_error_code")):
            return True
        error = error.__cause__ or error.__context__
    return False


class _WriteFailureFilter(logging.Filter):
    """Drops what orbax's threads log while a save fails (a traceback per array and task): the
    failure is reported once, as CheckpointNotWritten."""

    MARKS = ("No space left on device", "RESOURCE_EXHAUSTED", "Event loop is closed", f"Errno {errno.ENOSPC}")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() + (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")
        return not any(mark in text for mark in self.MARKS)


def _quiet_orbax_write_failures() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _WriteFailureFilter) for f in logger.filters):
            logger.addFilter(_WriteFailureFilter())


def _paths(tree) -> set[str]:
    """Paths of the arrays in a state tree, the same for its abstract form and orbax's metadata
    (which also lists empty optimizer states: those hold no array and are left out)."""
    return {path_name(path) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(leaf, "shape")}


def _first_line(error: BaseException) -> str:
    """The innermost cause's first line: tensorstore's message says what is wrong with which file."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _as_tree(state):
    """What is written: a `TrainState` as the dict of its fields in use, anything else as it is."""
    return state.to_dict() if hasattr(state, "to_dict") else state
