"""XLA's GPU kernel cache for programs compiled for compile-only GPUs (`lm.compiler.targets.devices`).

JAX's persistent cache cannot hold such programs (`lm.compiler.targets`), and most of a compile's time
goes to ptxas, run once per kernel (a small train step has about 120). XLA can keep compiled
kernels in a file (`xla_gpu_kernel_cache_file`), keyed by each fusion's fingerprint, and link
them into any later program that has the same fusion: a model's layouts share many, a re-run all
(`lm.plan --verify` of llama_70b's top 5 on 128 GPUs: 23 s, 16 s with the cache, 9 s re-run).

XLA reads and rewrites that file at every compile, not atomically, so a process works on a copy
of its own (taken at its first compile) and puts it in place of the shared file when it exits,
atomically: of two processes at once the last to exit wins, and the kernels only the other
compiled are compiled again next time. MESHLM_GPU_KERNEL_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

from lm import cache_home

MAX_SEED_BYTES = 512 * 2**20  # a shared file grown past this is not copied: the process starts afresh
STALE_AFTER_S = 24 * 3600  # copies left by processes that were killed

_working: dict[str, Path] = {}  # target -> this process's copy


def shared_path(target: str) -> Path:
    """The kernels kept for `target`, per jaxlib version (its compiler made them)."""
    from jaxlib import version

    return Path(cache_home()) / "gpu_kernels" / f"{target}-jaxlib{version.__version__}.bin"


def working_file(target: str) -> str | None:
    """The kernel cache file this process's compiles for `target` use (a copy of the shared one,
    made at the first call), or None where the cache is off or its directory is not writable."""
    if os.environ.get("MESHLM_GPU_KERNEL_CACHE", "1") == "0":
        return None
    if target not in _working:
        shared = shared_path(target)
        try:
            shared.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_copies(shared)
            fd, name = tempfile.mkstemp(prefix=f"{shared.name}.", suffix=".tmp", dir=shared.parent)
            os.close(fd)
            if shared.exists() and shared.stat().st_size <= MAX_SEED_BYTES:
                shutil.copyfile(shared, name)
        except OSError:
            return None
        _working[target] = Path(name)
        atexit.register(_publish, Path(name), shared)
    return str(_working[target])


def _publish(working: Path, shared: Path) -> None:
    """This process's copy in place of the shared file (if XLA wrote anything to it)."""
    try:
        if working.stat().st_size:
            os.replace(working, shared)
    except OSError:
        pass
    finally:
        working.unlink(missing_ok=True)


def _remove_stale_copies(shared: Path) -> None:
    for copy in shared.parent.glob(f"{shared.name}.*.tmp"):
        try:
            if time.time() - copy.stat().st_mtime > STALE_AFTER_S:
                copy.unlink()
        except OSError:
            pass
