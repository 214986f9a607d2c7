"""GPU compile targets as data, and compiling for them on a machine without the GPU.

A target is a `GpuTargetConfigProto` in `lm/hardware/` (see its README), selected by name.
The XLA GPU compiler comes as JAX's CUDA plugin (with cuDNN, for its fused attention);
`make gpu-compiler` (run by `make test`) installs it into `.venv/gpu-compiler`, apart from the
environment's packages, so CPU runs never load it. A process that compiles for a GPU target
needs MESHLM_GPU_COMPILER=1 before it imports meshlm (`lm/__init__.py` then puts the plugin on
the path before JAX is imported; JAX imported first finds no cuDNN, and `devices` warns that
attention would then not compile as on a GPU); `with_compiler` starts a command again that way. On a GPU
host with `pip install -e '.[gpu]'` the plugin is importable already.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import warnings

from lm import GPU_COMPILER_DIR, GPU_MEMORY_FRACTION
from lm.compiler import kernel_cache
from lm.config import UserError
from lm.hardware import data_file
from lm.model.attention import cudnn_available

TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}


def compiler_available() -> bool:
    """Whether JAX's CUDA plugin (the XLA GPU compiler) is importable in this process."""
    return any(importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def with_compiler(module: str, argv: list[str]) -> None:
    """Starts `python -m module argv` again with the GPU compiler on the path, unless it is there."""
    if compiler_available() or os.environ.get("MESHLM_GPU_COMPILER") == "1":
        return
    if not os.path.isdir(GPU_COMPILER_DIR):
        raise UserError("the XLA GPU compiler plugin is not installed; run `make gpu-compiler` (or install meshlm[gpu] on a GPU host)")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], {**os.environ, "MESHLM_GPU_COMPILER": "1"})


def command_devices(module: str, argv: list[str], name: str, count: int, hosts: int = 1) -> list:
    """For a command (`python -m module argv`) compiling for target `name`: started again with
    the compiler if need be, this host's backend kept to the CPU, then `devices(...)`. Call it
    before anything asks JAX for devices."""
    import jax

    check_counts(count, hosts)  # before starting again with the compiler, or finding it missing
    with_compiler(module, argv)
    jax.config.update("jax_platforms", "cpu")
    return devices(name, count, hosts)


def target_config(name: str) -> str:
    if name not in TARGETS:
        raise UserError(f"--target={name!r} is not a known GPU target; choose one of {', '.join(TARGETS)}")
    return data_file(TARGETS[name]).read_text()


def memory_bytes(name: str) -> int:
    """The device memory a target describes."""
    return int(re.search(r"device_memory_size:\s*(\d+)", target_config(name)).group(1))


def check_counts(count: int, hosts: int) -> None:
    """The UserError for compile-only device and host counts that cannot be laid out."""
    if count < 1 or hosts < 1:
        raise UserError(f"--devices={count} --hosts={hosts}: both must be at least 1")
    if count % hosts:
        raise UserError(f"--devices={count} does not split evenly over --hosts={hosts}")


_COMPILE_ONLY_TARGET: dict = {}  # device made by `devices` -> its target's name (`compiler_options`)


def devices(name: str, count: int, hosts: int = 1) -> list:
    """`count` compile-only devices of target `name` over `hosts` hosts (`count // hosts` each)."""
    check_counts(count, hosts)
    text = target_config(name)
    if not compiler_available():
        raise UserError(
            "the XLA GPU compiler plugin is not on the path: run `make gpu-compiler`, then set "
            "MESHLM_GPU_COMPILER=1 before importing meshlm (the lm.* commands do this themselves)"
        )
    import jax
    from jax.experimental import topologies

    if not cudnn_available():  # `model.attention=auto` would then compile XLA's attention, unlike a GPU run
        warnings.warn(
            "cuDNN cannot be loaded in this process, so attention compiles as XLA's own (its scores held in "
            "memory), not as the cuDNN flash attention a GPU run uses: run `make gpu-compiler`, and set "
            "MESHLM_GPU_COMPILER=1 before anything imports jax",
            stacklevel=2,
        )
    # What is compiled for these devices cannot be read back from JAX's persistent cache (jaxlib:
    # "PjRtCompiler must be constructed with a Client"; a warning on every re-run): not written.
    # XLA's kernel cache stands in for it (`compiler_options`).
    jax.config.update("jax_enable_compilation_cache", False)
    topology = topologies.get_topology_desc(
        platform="cuda", topology_name=name, topology=f"1x{hosts}x{count // hosts}", target_config=text
    )
    found = list(topology.devices)
    _COMPILE_ONLY_TARGET.update(dict.fromkeys(found, name))
    _cudnn_checks_against(found[0])
    return found


def _cudnn_checks_against(device) -> None:
    """JAX checks what cuDNN attention may run (head dims up to 256, value heads narrower than
    query heads: multi-head latent attention) against the compute capability of its default
    backend's GPU, which a deviceless compile lacks (its backend is the CPU): it then refuses
    what the target's GPU runs. Here the check asks the compile-only `device` instead."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    except ImportError:
        return
    original = getattr(cudnn_attention, "check_compute_capability", None)
    if original is None or getattr(original, "compile_only_device", None) is not None:
        return
    have = tuple(int(x) for x in str(device.compute_capability).split("."))

    def check_compute_capability(capability: str) -> bool:
        return original(capability) or have >= tuple(int(x) for x in capability.split("."))

    check_compute_capability.compile_only_device = device
    cudnn_attention.check_compute_capability = check_compute_capability


# Compiler options for programs compiled for NVIDIA GPUs (passed per jit, never process-wide).
# From NVIDIA's JAX GPU performance guide and MaxText's GPU recipes: the latency-hiding scheduler
# overlaps collectives (FSDP all-gathers, reduce-scatters) with compute; the thresholds let XLA
# combine the many small per-parameter collectives into few large ones. XLA:GPU schedules a
# step's temporaries into (80% of the device - its inputs and outputs) x slop factor / 100, the
# factor 95 by default (60.4 GiB of an H100), and runs the collectives of a step above that with
# nothing beside them; a factor of 100 x JAX's pool / 80% keeps the whole step within that pool
# (`lm.GPU_MEMORY_FRACTION`) and lets the scheduler use it. Measured on llama_70b over 128 H100s
# (PERFORMANCE.md): MaxText's layout (70 GiB) had 6 of its 19 all-gathers beside a GEMM, now 10
# (72 GiB); the planner's first choice (67 GiB) 1 of its 37 collectives, now 9.
XLA_SCHEDULING_FRACTION = 0.8  # of the device's memory: XLA:GPU's base (GetSchedulerMemoryLimit)
GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_all_gather_combine_threshold_bytes": 134217728,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 67108864,
    "xla_gpu_all_reduce_combine_threshold_bytes": 134217728,
    "xla_gpu_memory_limit_slop_factor": int(100 * GPU_MEMORY_FRACTION / XLA_SCHEDULING_FRACTION),
}


def target_of(device) -> str | None:
    """The target a device is, or compiles for: a compile-only device's own, a real GPU's by its
    name (`device_description_str`); None for a CPU or a GPU meshlm has no description of."""
    if device in _COMPILE_ONLY_TARGET:
        return _COMPILE_ONLY_TARGET[device]
    if getattr(device, "platform", "") != "gpu":
        return None
    kind = getattr(device, "device_kind", "")
    for name in TARGETS:
        described = re.search(r'device_description_str:\s*"([^"]+)"', target_config(name)).group(1)
        if described == kind:
            return name
    return None


# With the weights sharded (FSDP), XLA pipelines the layer loop's reduce-scatters into the next
# iteration and copies each one's operand, a float32 gradient, every iteration (three 805 MB
# copies a layer for Qwen3-30B-A3B's experts on 64 H100s: 87 ms of a 1.45 s step); unrolling
# the loop by two (MaxText's GPU flag) lets the iterations alternate buffers instead. Without
# FSDP it only costs (llama_1b on one H100: 47.0% -> 45.2% MFU), so it is set with FSDP only.
SHARDED_WEIGHTS_OPTIONS = {"xla_gpu_enable_while_loop_double_buffering": True}
# Not for a split-backward pipeline's slot loop (`pipeline.schedule` zero_bubble / zbv / dualpipev),
# where it measured slower (why, not looked into). `llama_8b` `{stage 4, fsdp 2}` M = 8 on 8 H100s
# by the kernel model: ZB-H1 3,717.1 -> 3,560.1 ms, ZB-V 4,198.0 -> 4,088.8, DualPipeV 3,585.7 ->
# 3,530.9 without it (1F1B's lockstep and per-stage loops lose 13 and 26 ms without it).


# `train.gemm_fusion=elementwise`: XLA's GEMM fusion v2 takes every elementwise producer and
# consumer it can tile into the GEMM's Triton kernel (prologues and epilogues), where its default
# takes only layout changes and converts. Deviceless, the `llama_1b` recipe on one H100 by the
# kernel model: 1,678.7 -> 1,523.5 ms (SwiGLU's forward and backward passes, 118 ms, inside the
# GEMMs); with fp8, whose GEMMs are cuBLAS calls, 1,197.3 -> 1,212.3; `llama_1b` under
# `{data 2, tensor 4}` 330 -> 409 ms (its GEMMs' kernels 184 -> 310 ms; PERFORMANCE.md). XLA calls
# it experimental: the GPU kit measures the recipe both ways.
ELEMENTWISE_GEMM_FUSION_OPTIONS = {"xla_gpu_experimental_gemm_fusion_v2": True}


def elementwise_gemm_fusion(choice: str, fp8: bool, tensor_parallel: bool) -> bool:
    """Whether `train.gemm_fusion` (operands | elementwise | auto) asks for XLA's GEMM fusion v2:
    `auto` does without fp8 and without tensor parallelism, where the kernel model finds it slower."""
    return choice == "elementwise" or (choice == "auto" and not fp8 and not tensor_parallel)


def compiler_options(device, sharded_weights: bool = False, elementwise_gemms: bool = False, split_backward_slots: bool = False) -> dict:
    """The compiler options meshlm sets for programs compiled for `device` (one of a mesh's),
    `sharded_weights` where FSDP splits the weights, `elementwise_gemms` where the GEMMs take
    their elementwise neighbours in (`elementwise_gemm_fusion`), `split_backward_slots` where a
    zero-bubble pipeline's slots loop; for a compile-only GPU, XLA's kernel cache too
    (`lm.compiler.kernel_cache`)."""
    if device.platform != "gpu":
        return {}
    options = GPU_COMPILER_OPTIONS | (SHARDED_WEIGHTS_OPTIONS if sharded_weights and not split_backward_slots else {})
    options |= ELEMENTWISE_GEMM_FUSION_OPTIONS if elementwise_gemms else {}
    target = _COMPILE_ONLY_TARGET.get(device)
    if target and (path := kernel_cache.working_file(target)):
        options["xla_gpu_kernel_cache_file"] = path
    return options
