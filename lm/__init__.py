"""meshlm's models and training. See README.md and ARCHITECTURE.md."""

import os
import re
import sys


def _tune_xla_cpu() -> None:
    """XLA:CPU flags measured to speed up training (see PERFORMANCE.md).

    Set before JAX starts its backend, only for the jaxlib versions they were measured on
    (an unknown flag aborts XLA), and never over a value the user gave.
    """
    try:
        from jaxlib import version
    except ImportError:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    # YNNPACK-fused reductions (softmax and layer-norm backward) are slower than XLA's own here
    # (jaxlib 0.12, shakespeare_char in bf16: 33.8k tokens/s with them, 53.3k without).
    if version.__version__.startswith(("0.10.", "0.12.")) and "xla_cpu_experimental_ynn_fusion_type" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_experimental_ynn_fusion_type=-reduce".strip()


def _size_cpu_thread_pools() -> None:
    """With N fake CPU devices (`--xla_force_host_platform_device_count`, or JAX_NUM_CPU_DEVICES),
    XLA:CPU's two thread pools get max(cores, N) threads, shared by all N devices. A device's
    thunks run concurrently on them, and a collective holds its thread until every device
    arrives: with one thread per device, a device whose part of that collective (or whose
    matmul's pool tasks) waits queued behind threads blocked in another collective never
    arrives, and the process hangs (seen in the test suite's 1F1B steps on 2 cores).
    `PJRT_NPROC` (XLA's own knob) sizes both pools: 8 threads per device, unless the user set it.
    """
    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    counts = (flag.group(1) if flag else "1", os.environ.get("JAX_NUM_CPU_DEVICES", "1"))
    devices = max(int(n) for n in counts if n.isdigit())
    if devices > 1:
        os.environ.setdefault("PJRT_NPROC", str(8 * devices))


def cache_home() -> str:
    """Where meshlm keeps what it can make again (compiled programs, GPU kernels, tokenised
    corpora): $XDG_CACHE_HOME/meshlm, by default ~/.cache/meshlm."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser(os.path.join("~", ".cache")), "meshlm")


# The share of each GPU's memory JAX takes for meshlm's runs. JAX's default pool is 75% of the
# device (59 GiB of an H100's 79), below what `lm.plan` admits (90%: a layout it lists would run
# out of memory there). The rest stays for the CUDA context, NCCL and cuDNN / cuBLAS workspaces.
GPU_MEMORY_FRACTION = 0.95


def _size_gpu_memory_pool() -> None:
    """JAX's GPU memory pool at GPU_MEMORY_FRACTION of the device, unless the user chose one
    (under either name: jaxlib refuses both at once)."""
    if not (os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")):
        os.environ["XLA_CLIENT_MEM_FRACTION"] = str(GPU_MEMORY_FRACTION)


_tune_xla_cpu()
_size_cpu_thread_pools()
_size_gpu_memory_pool()

# The XLA GPU compiler (JAX's CUDA plugin, with cuDNN), installed apart by `make gpu-compiler` so
# that CPU runs never load it. With MESHLM_GPU_COMPILER=1 it is put on the path here, before JAX
# is imported (JAX looks for its CUDA libraries once, at import): `lm.layout --target` sets it and
# starts again; tests/conftest.py sets it for the suite.
GPU_COMPILER_DIR = os.path.join(sys.prefix, "gpu-compiler")
if os.environ.get("MESHLM_GPU_COMPILER") == "1" and os.path.isdir(GPU_COMPILER_DIR) and GPU_COMPILER_DIR not in sys.path:
    sys.path.append(GPU_COMPILER_DIR)
