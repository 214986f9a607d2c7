"""A config's train step timed on synthetic tokens or the real input pipeline (`bench`), and
the pipeline alone (`data_bench`): step time, tokens/s, MFU, memory, as a dict.
`python -m lm.bench` is its command, and its docstring says what each field means.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from lm.compiler import hlo, profile
from lm.data import corpus as lm_data
from lm.model.flops import flops_per_token, param_count, split_backward_flops
from lm.program.steps import setup
from lm.training.metrics import (
    cpu_bf16_units,
    peak_dtype,
    peak_flops,
    peak_memory_bytes,
    reference_peak_flops,
)
from sharding.schedule_report import report as pipeline_report


def _corpus_batches(config, workdir: Path):
    """The config's training batches through the real pipeline (prepared first), as lm.train
    reads them, and the corpus's vocabulary size."""
    t = config.train
    corpus = lm_data.open_corpus(config, workdir, progress=jax.process_index() == 0)
    return corpus.train_batches(t.batch_size, t.seed, jax.process_index(), jax.process_count(), config.data.prefetch), corpus.tokenizer.vocab_size


def _time_batches(batches, count: int) -> dict:
    """The pipeline's time per global batch, pulled back to back (after one to start it)."""
    next(batches)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        next(batches)
        times.append(time.perf_counter() - start)
    return {"data_time_s": statistics.median(times), "data_time_max_s": max(times)}


def data_bench(config, batches: int = 50) -> dict:
    """Host time to produce a global batch of this config's shape, without a model."""
    with tempfile.TemporaryDirectory() as workdir:
        iterator, _ = _corpus_batches(config, Path(workdir))
        timing = _time_batches(iterator, batches)
    t = config.train
    return {"batch_size": t.batch_size, "seq_len": t.seq_len, "document_masking": config.data.document_masking, **timing}


def bench(config, steps: int = 20, warmup: int = 2, devices=None, save_hlo: str | None = None, with_data: bool = False,
          profile: str | None = None) -> dict:
    if with_data:
        with tempfile.TemporaryDirectory() as workdir:
            return _bench(config, steps, warmup, devices, save_hlo, profile, *_corpus_batches(config, Path(workdir)))
    return _bench(config, steps, warmup, devices, save_hlo, profile, None, lm_data.nominal_vocab_size(config.data))


def _profiled(compiled, state, batches, directory: str, steps: int) -> dict:
    """`steps` more steps under JAX's profiler (trace in `directory`), summed by `lm.compiler.profile`."""
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for i in range(steps):
            state, metrics = compiled(state, batches[i % len(batches)])
        jax.block_until_ready(metrics)
    try:
        return profile.summary(profile.trace_file(directory), compiled.as_text(), steps)
    except Exception as e:  # noqa: BLE001 - a trace this reader does not know loses the profile, not the timing
        return {"error": f"{type(e).__name__}: {e}"}


def _bench(config, steps, warmup, devices, save_hlo, profile_dir, data_batches, vocab_size) -> dict:
    program = setup(config, vocab_size, devices)
    mesh, mcfg = program.mesh, program.model_cfg
    rng = np.random.default_rng(config.train.seed)
    local_rows = config.train.batch_size // jax.process_count()
    if data_batches is None:
        make_batch = lambda: program.global_batch(  # noqa: E731
            rng.integers(0, mcfg.vocab_size, (local_rows, config.train.seq_len + 1), dtype=np.int32)
        )
    else:
        make_batch = lambda: program.global_batch(next(data_batches))  # noqa: E731
    state = program.init_state(config.train.seed)
    start = time.perf_counter()
    compiled = program.train_step.lower(state, make_batch()).compile()
    compile_s = time.perf_counter() - start
    if save_hlo:
        hlo.save(compiled.as_text(), save_hlo)
    batches = [make_batch() for _ in range(4)]
    for i in range(warmup):
        state, metrics = compiled(state, batches[i % 4])
    jax.block_until_ready(metrics)
    times, waits = [], []
    for i in range(steps):
        start = time.perf_counter()
        batch = batches[i % 4] if data_batches is None else make_batch()  # the real pipeline: a fresh batch each step
        waits.append(time.perf_counter() - start)
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    data = {} if data_batches is None else {"data_wait_s": statistics.median(waits), **_time_batches(data_batches, 20)}
    if profile_dir:  # after the timed steps, so tracing does not slow them
        data["profile"] = _profiled(compiled, state, batches, profile_dir, min(steps, 3))
    tokens = config.train.batch_size * config.train.seq_len
    fpt = flops_per_token(mcfg, config.train.seq_len)
    peak, source = peak_flops(peak_dtype(config.precision))
    reference, reference_source = reference_peak_flops(peak_dtype(config.precision), peak)
    memory = compiled.memory_analysis()
    plan = program.spec.pipeline
    pipelined = pipeline_report(plan, mcfg.num_layers, split_backward_flops(mcfg, config.train.seq_len, mcfg.remat))  # schedule, bubble, stash
    return {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "devices": mesh.size,
        "mesh": dict(mesh.shape),
        "params": param_count(state.params),
        "tokens_per_step": tokens,
        "compute_dtype": config.precision.compute_dtype,
        "fp8": config.precision.fp8,
        "loss_scale": program.loss_scaling.kind,
        "compile_time_s": round(compile_s, 3),
        "step_time_s": step_time,
        "step_time_min_s": min(times),
        "tokens_per_sec": tokens / step_time,
        "flops_per_token": fpt,
        "mfu": fpt * tokens / step_time / (peak * mesh.size),
        "peak_flops": peak,
        "peak_flops_source": source,
        # A measured peak moves with the machine's load; MFU against the best peak this machine
        # has measured (or the table's) is the figure to compare between runs.
        "mfu_at_reference_peak": fpt * tokens / step_time / (reference * mesh.size),
        "reference_peak_flops": reference,
        "reference_peak_flops_source": reference_source,
        **({"cpu_bf16_units": cpu_bf16_units()} if jax.default_backend() == "cpu" else {}),
        "peak_memory_bytes": peak_memory_bytes(),
        "compiled_temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "compiled_argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        # The loss after cycling 4 fixed synthetic batches: a check that the step ran, not training progress.
        "synthetic_batches_loss": float(metrics["loss"]),
        "pipeline": dataclasses.asdict(plan) if plan.stages > 1 else None,
        "remat": config.model.remat,
        "pipeline_schedule": pipelined["schedule"],
        "pipeline_bubble": pipelined["bubble"],
        "pipeline_stash_depth": pipelined["stash_depth"],
        "pipeline_stash": pipelined["stash"],
        **{f"pipeline_{k}": pipelined[k] for k in ("slot_bubble", "w_stash_depth") if k in pipelined},  # zero-bubble's
        **data,
    }
