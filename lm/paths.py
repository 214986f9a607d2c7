"""The boundary for paths a user names: each kind is checked where it enters, in one place, so
every command (and every new one) gives the same one-line `UserError` for the same mistake.

Recipe files are `lm.recipe.load_file`'s; data paths `lm.data.sources.corpus_files`'; checkpoints
`lm.program.checkpoint`'s. Here: work directories (a new or resumed run, an existing run to read),
output directories, and readable files (tokenizers, and anything else read whole). Only the
mistakes listed are caught; anything else is a bug and keeps its traceback.

A directory a command writes is *held* while it writes (`held`): one writer at a time.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from lm.errors import UserError


def new_or_run_dir(path: str | os.PathLike, flag: str = "--workdir") -> Path:
    """A directory a run writes into: absent (it is created later), or a writable directory."""
    p = Path(path).expanduser()
    for parent in [p, *p.parents]:
        if parent.exists():
            if not parent.is_dir():
                what = "is a file" if parent == p else f"lies under {parent}, which is a file"
                raise UserError(f"{flag}={path} {what}; pass a directory (a new one for a new run)")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"{flag}={path}: {parent} is not writable; pass a directory you can write to")
            return p
    return p


def new_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """A directory a command creates and fills: absent or empty, never one holding anything."""
    p = new_or_run_dir(path, flag)
    if p.exists() and any(f.name != LOCK_FILE for f in p.iterdir()):
        raise UserError(f"{flag}={path} exists and is not empty; nothing was written: pass a new directory")
    return p


def existing_run_dir(path: str | os.PathLike, flag: str = "--workdir") -> Path:
    """A directory a finished or running meshlm run wrote (it holds config.json)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{flag}={path} does not exist; pass the --workdir you trained in")
    if not p.is_dir():
        raise UserError(f"{flag}={path} is a file, not a run directory; pass the --workdir you trained in")
    if not (p / "config.json").is_file():
        raise UserError(f"{flag}={path} is not a meshlm run (no config.json); pass the --workdir you trained in")
    return p


def readable_file(path: str | os.PathLike, what: str) -> Path:
    """An existing, readable regular file; `what` names it in the message (e.g. data.tokenizer)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{what}={path} does not exist")
    if not p.is_file():
        raise UserError(f"{what}={path} is a directory, not a file")
    if not os.access(p, os.R_OK):
        raise UserError(f"{what}={path} is not readable (permissions)")
    return p


def existing_dir(path: str | os.PathLike, flag: str) -> Path:
    """A directory a command reads from (e.g. lm-eval task files)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"{flag}={path} {'is a file' if p.exists() else 'does not exist'}; pass a directory")
    return p


def fresh_file(path: Path) -> Path:
    """`path`, or `name-2`, `name-3` ... if it exists: an output never written over an earlier one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


LOCK_FILE = ".meshlm.lock"
HEARTBEAT_S = 30.0  # how often a holder refreshes its lock
STALE_S = 300.0  # a lock not refreshed for this long is a dead holder's (one on another host, say)


def _holder(lock: Path) -> dict:
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):  # half-written by a holder killed while writing it
        return {}


def _alive(pid: int) -> bool:
    """Whether process `pid` on this host is running: a zombie (exited, not yet reaped by a
    parent that died or never waits, as in containers whose PID 1 does not reap) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):  # no /proc (macOS): the signal's answer stands
        return True
    return state not in ("Z", "X")


def _gone(holder: dict, lock: Path, kernel_lock_free: bool | None) -> bool:
    """Whether a lock's holder is dead. `kernel_lock_free`: whether the kernel's lock on the file
    (which it drops when its holder exits, zombie or not) was free; None where the file system has
    no such locks. A holder on this host is gone if the kernel's lock was free or its process is
    not running; anywhere, if it stopped refreshing the lock (`STALE_S`: network file systems may
    keep kernel locks per host)."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_S:
            return True
    except FileNotFoundError:
        return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return bool(kernel_lock_free) or not _alive(holder["pid"])
    return not holder and time.time() - lock.stat().st_mtime > HEARTBEAT_S


def _kernel_lock(lock: Path) -> tuple[int, bool | None]:
    """An open descriptor of `lock` (created if absent) and whether this process now holds the
    kernel's exclusive lock on it: True; False, a live process holds it; None, the file system
    has no such locks."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return fd, False
        except OSError:  # ENOLCK, EOPNOTSUPP: no locks here
            return fd, None
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                return fd, True
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder removed the file as it ended, after this opened it: again


def _refuse(holder: dict, path, flag: str) -> UserError:
    return UserError(f"{flag}={path} is in use by {holder.get('command', 'another process')} (pid {holder.get('pid', '?')} "
                     f"on {holder.get('host', '?')}, since {holder.get('since', '?')}); wait for it to end, or stop it")


def _take_over(holder: dict, path, flag: str) -> None:
    print(f"{flag}={path}: taking over the lock of {holder.get('command', 'a process')} (pid {holder.get('pid', '?')} on "
          f"{holder.get('host', '?')}, since {holder.get('since', '?')}), which is gone", flush=True)


def _acquire(lock: Path, me: dict, path, flag: str) -> int | None:
    """Takes `lock` for `me`; the descriptor holding the kernel's lock (None without one)."""
    fd, free = _kernel_lock(lock)
    holder = _holder(lock)
    if free is False or (holder and not _gone(holder, lock, free)):
        os.close(fd)
        raise _refuse(holder, path, flag)
    if free:
        if holder:
            _take_over(holder, path, flag)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        return fd
    os.close(fd)  # no kernel locks: the record alone, created exclusively
    with contextlib.suppress(FileNotFoundError):
        if lock.stat().st_size == 0:  # the empty file opened above, or a half-written record
            lock.unlink()
    while True:
        try:
            with open(lock, "x") as f:
                json.dump(me, f)
            return None
        except FileExistsError:
            holder = _holder(lock)
            if not _gone(holder, lock, None):
                raise _refuse(holder, path, flag) from None
            _take_over(holder, path, flag)
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()


@contextlib.contextmanager
def held(path: str | os.PathLike, flag: str, command: str, leader: bool = True):
    """Holds directory `path` for `command` while the block runs: a second writer is refused in
    one line naming the holder (host, pid, since when). The kernel's lock on the lock file
    (`flock`) says whether a holder on this host lives: it is dropped when the holder exits,
    whatever killed it, so a run killed together with its launcher restarts at once; the record
    in the file (host, pid, since; refreshed every `HEARTBEAT_S`) names the holder, and serves
    where the file system has no kernel locks (a holder gone from this host, zombie included,
    or not refreshed for `STALE_S` is taken over, said in one line). Of a multi-process run
    only the `leader` (process 0) holds it, for all of them."""
    directory = new_or_run_dir(path, flag)
    if not leader:
        yield
        return
    created = not directory.exists()  # then removed again if the command leaves it empty
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / LOCK_FILE
    me = {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
          "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    try:
        fd = _acquire(lock, me, path, flag)
    except UserError:
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    stop = threading.Event()

    def heartbeat():
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(lock)

    beating = threading.Thread(target=heartbeat, name="meshlm-lock", daemon=True)
    beating.start()
    try:
        yield
    finally:
        stop.set()
        holder = _holder(lock)
        if (holder.get("pid"), holder.get("host")) == (me["pid"], me["host"]):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
        if fd is not None:
            os.close(fd)  # after the unlink: a starter that opened the old file sees it replaced
        if created:  # a command refused its input before writing: nothing is left behind
            with contextlib.suppress(OSError):
                directory.rmdir()
