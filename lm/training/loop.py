"""The host loop of `python -m lm.train`: data, checkpoints, metrics, the verdicts on skipped
steps. The same workdir again resumes from its latest checkpoint. The compiled program the loop
drives (state layout, steps) is `lm.program.steps`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import jax
import numpy as np

import sharding
import sharding.distributed
from lm import config as lm_config
from lm import paths, progress
from lm.config import UserError
from lm.data import corpus as lm_data
from lm.evaluation.harness import DuringTraining
from lm.hf.checkpoint import initial_params, with_init_model
from lm.model.flops import flops_per_token, param_count
from lm.program.checkpoint import Checkpointer
from lm.program.faults import Faults
from lm.program.lora_base import checkpointed, keep_base, restore_target, with_base
from lm.program.spec import RunSpec
from lm.program.steps import Program, setup
from lm.training.metrics import (
    MetricsWriter,
    StepRate,
    peak_dtype,
    peak_flops,
    perplexity,
)
from lm.training.spikes import SKIPPED, SpikeWatch, record, skipped
from lm.training.tracking import WandbRun
from lm.training.watchdog import StepWatchdog


def check_workdir(config, workdir: Path) -> None:
    """A workdir trained with a different model shape is an error; nothing in it is touched."""
    saved = lm_config.load_run(workdir)
    if saved is None:
        return
    saved, now = lm_config.shape_fields(saved), lm_config.shape_fields(config)
    diffs = [f"{k}: {saved.get(k)!r} saved, {now.get(k)!r} now" for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diffs:
        raise UserError(
            f"workdir {workdir} holds a run of an incompatible config ({'; '.join(diffs)}); "
            "use a new --workdir or the saved settings"
        )


class TrainingHalted(UserError):
    """The run stopped itself (non-finite steps); its last good state is checkpointed."""

    exit_code = 3


def _kill_self(step: int, when: str) -> None:
    print(f"debug: SIGKILL at step {step} ({when})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _prepare_in_turn(config, workdir: Path) -> lm_data.Corpus:
    """Process 0 tokenises (and trains a BPE) first; the others then read what it cached."""
    if jax.process_count() == 1:
        return lm_data.open_corpus(config, workdir)
    from jax.experimental import multihost_utils

    prepared = lm_data.open_corpus(config, workdir) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("meshlm: data prepared")
    return prepared or lm_data.open_corpus(config, workdir, progress=False)


def _nonfinite_verdict(spec: RunSpec, first_step: int, host_metrics: list[dict], say) -> str | None:
    """Reports skipped steps; returns why the run must stop, or None.

    Under dynamic loss scaling, gradients overflowing from a finite loss are the scaler's
    business (it backs off), not a reason to stop."""
    t = spec.config.train
    skipped = [(first_step + i, m) for i, m in enumerate(host_metrics) if m["nonfinite_in_a_row"] > 0]
    dynamic = spec.loss_scaling.kind == "dynamic"
    overflows = [(step, m) for step, m in skipped if dynamic and np.isfinite(m["loss"])]
    for step, m in overflows:
        say(f"step {step}: gradients overflowed at loss scale {m['loss_scale']:g}, update skipped and the scale lowered ({m['skipped_steps']} skipped in all)")
    skipped = [s for s in skipped if s not in overflows]
    for step, m in skipped:
        say(f"step {step}: non-finite loss or gradients, update skipped ({m['nonfinite_in_a_row']} in a row, {m['skipped_steps']} in all)")
    if skipped and t.on_nonfinite == "stop":
        return f"step {skipped[0][0]}: non-finite loss or gradients (train.on_nonfinite=stop)"
    worst = max((int(m["nonfinite_in_a_row"]) for _, m in skipped), default=0)
    if worst >= t.max_consecutive_nonfinite:
        return f"{worst} steps in a row had non-finite loss or gradients (train.max_consecutive_nonfinite={t.max_consecutive_nonfinite})"
    return None


def train(config, workdir: str | os.PathLike, devices=None, *, faults: Faults = Faults()) -> dict:
    """Trains (or resumes) the run in `workdir` on `devices` (default: all); returns the last
    logged metrics (with `eval_loss`). SIGTERM / SIGINT end it after the current step with a
    durable checkpoint."""
    config = lm_config.checked(config)
    if config.init.from_hf:
        config = with_init_model(config)
    config = lm_data.with_store_tokenizer(config)
    workdir = paths.new_or_run_dir(workdir)
    check_workdir(config, workdir)
    # The mesh is checked before the corpus is read: a bad mesh fails fast.
    sharding.MeshConfig.from_mapping(config.mesh).resolve(len(devices or jax.devices()))
    corpus = _prepare_in_turn(config, workdir)
    program = setup(config, corpus.tokenizer.vocab_size, devices, faults)
    ckpt = Checkpointer(workdir / "checkpoints", config.checkpoint.keep, config.checkpoint.async_save)
    pi, pc, t = jax.process_index(), jax.process_count(), config.train
    batches = corpus.train_batches(t.batch_size, t.seed, pi, pc, config.data.prefetch)
    val_rows = corpus.eval_batches(t.batch_size, t.eval_batches, pi, pc)
    if pi == 0:
        lm_config.save_run(config, workdir)
    tracker = WandbRun(workdir, config.metrics.wandb_project, config.to_dict()) if config.metrics.wandb and pi == 0 else None
    writer = MetricsWriter(workdir, enabled=pi == 0, tracker=tracker)
    evaluation = DuringTraining(config, program, corpus.tokenizer) if config.eval.tasks.strip() else None
    stop = sharding.distributed.StopRequest()
    try:
        return _loop(program, ckpt, batches, val_rows, writer, stop, faults, workdir, evaluation)
    except Exception as e:
        if not isinstance(e, UserError):  # a failed collective: was a process lost?
            sharding.distributed.await_lost_peer()
        raise
    finally:
        stop.close()
        ckpt.wait()
        ckpt.close()
        writer.close()


def _say(text: str) -> None:
    """Console output from the lead process, around the progress bar."""
    if jax.process_index() == 0:
        progress.say(text)


def _start(program: Program, ckpt: Checkpointer):
    """(step, state, data iterator state) to begin from: the latest checkpoint; weights alone
    (an imported model's step-0 checkpoint, or `init.from_hf`) with a fresh optimizer; or a
    random initialisation."""
    config, layout = program.config, program.abstract_model
    latest = ckpt.latest_step()
    if latest is not None and ckpt.saved_fields(latest) == {"params"}:
        params = ckpt.restore_part({"params": layout.base_target()}, latest)["params"]  # (a LoRA run: its adapters are new)
        _say(f"starting from the weights in {ckpt.directory / str(latest)} (fresh optimizer state)")
        return latest, program.init_from(config.train.seed, params), None
    restored = ckpt.restore_latest(restore_target(program), _say)
    if restored is not None:
        _say(f"resuming from step {restored[0]} ({ckpt.directory / str(restored[0])})")
        step, state, data_state = restored
        return step, with_base(program, state, ckpt.directory.parent), data_state
    if config.init.from_hf:
        _say(f"starting from the weights of {config.init.from_hf}")
        return 0, program.init_from(config.train.seed, initial_params(config.init.from_hf, layout)), None
    return 0, program.init_state(config.train.seed), None


def _garbled(batch: dict, vocab_size: int, number: int) -> dict:
    """Fault injection (tests): a batch whose tokens are random, as a damaged shard would give."""
    rng = np.random.default_rng(number)
    return {**batch, "tokens": rng.integers(0, vocab_size, batch["tokens"].shape).astype(batch["tokens"].dtype)}


def _roll_back(program: Program, ckpt: Checkpointer, batches, spikes: SpikeWatch, spike, writer: MetricsWriter, count: int, workdir: Path):
    """(step, state) of the newest checkpoint before the spike, its batches recorded as skipped.

    Checkpoints written during the spike are set aside as `<step>.rolled_back` (kept, never
    deleted), so that a restart cannot resume from them either."""
    first_step, detected = spike[0][0], spike[-1][0]
    ckpt.wait()
    before = [s for s in ckpt.all_steps() if s < first_step]
    if not before:
        raise TrainingHalted(f"step {detected}: the loss spiked (steps {first_step}-{detected}) before any checkpoint was written; "
                             "nothing to roll back to: lower checkpoint.every_steps or train.spike_window")
    target = before[-1]
    for later in ckpt.all_steps():
        if later > target:
            ckpt.set_aside(later, "rolled_back")
    if jax.process_index() == 0:
        record(workdir, spike, target)
    restored, data_state = ckpt.restore(restore_target(program), target, need_data=True)
    restored = with_base(program, restored, workdir)
    batches.set_state(data_state)
    batches.skip |= {b for _, b, _ in spike}
    writer.write({"step": detected, "spike_rollbacks": count})
    _say(
        f"step {detected}: loss spike ({len(spike)} steps above {spikes.factor:g} x the recent mean {spikes.mean():.4f}: "
        f"{', '.join(f'{loss:.4f}' for _, _, loss in spike)}); rolled back to step {target}, skipping batches "
        f"{', '.join(str(b) for _, b, _ in spike)} (recorded in {workdir / SKIPPED})"
    )
    return target, restored


def _stall(seconds: float) -> None:
    """Fault injection (tests): a data read that blocks, the process staying alive."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(1.0, end - time.monotonic()))


def _loop(program: Program, ckpt: Checkpointer, batches, val_rows, writer: MetricsWriter, stop, faults: Faults, workdir: Path, evaluation=None) -> dict:
    config = program.config
    t, mesh, mcfg = config.train, program.mesh, program.model_cfg
    val_batches = [program.global_batch(rows) for rows in val_rows]  # on device once, reused
    start, state, data_state = _start(program, ckpt)
    keep_base(workdir, program, state)  # a LoRA run's frozen base, once: its checkpoints hold the adapters
    if data_state is not None:
        batches.set_state(data_state)
    tokens_per_step = t.batch_size * t.seq_len
    rate = StepRate(tokens_per_step, flops_per_token(mcfg, t.seq_len), peak_flops(peak_dtype(config.precision))[0] * mesh.size, mcfg.routed_layer_ids)
    _say(
        f"model: {param_count(state.params) / 1e6:.2f}M parameters, vocab {mcfg.vocab_size}, "
        f"mesh {dict(mesh.shape)}, {t.steps} steps of {tokens_per_step} tokens"
    )
    step_fn = None
    if start >= t.steps:
        _say(f"already trained to step {start}; raise --config.train.steps to continue")
    else:
        step_fn = program.train_step.lower(state, val_batches[0]).compile()
    bar = progress.bar(total=t.steps, initial=start, disable=jax.process_index() != 0, unit="step")
    watch = StepWatchdog(t.step_timeout_s, workdir)
    try:
        last = _steps(program, ckpt, batches, val_batches, writer, stop, faults, workdir, evaluation, start, state, step_fn, rate, bar, watch)
    finally:
        watch.close()
        bar.close()  # its line ended before whatever is said next, an error's included
    _say(f"checkpoints: {ckpt.directory}")
    _say(f"metrics:     {writer.path.absolute()} (TensorBoard: {writer.tb_dir.absolute()})")
    return last


def _steps(program: Program, ckpt: Checkpointer, batches, val_batches, writer: MetricsWriter, stop, faults: Faults, workdir: Path,
           evaluation, start: int, state, step_fn, rate: StepRate, bar, watch: StepWatchdog) -> dict:
    """Steps `start + 1 .. train.steps`; the last logged metrics. Each step is known complete
    (to the watchdog) when the next has been dispatched, so the device is never left idle."""
    config = program.config
    t, mcfg = config.train, program.model_cfg
    spikes = SpikeWatch(t.spike_factor, t.spike_window, t.spike_steps) if t.spike_rollback else None
    rollbacks = len(skipped(workdir))
    batches.skip = {b for row in skipped(workdir) for b in row["batches"]}
    pending, numbers, last, step, previous = [], [], {}, start, None
    while step < t.steps:
        step += 1
        watch.doing = f"reading the batch of step {step}"
        if faults.stall_at_step == step:
            _stall(faults.stall_s)
        batch = next(batches)
        numbers.append(batches.taken)
        if batches.taken in faults.garbled_batches:
            batch = _garbled(batch, mcfg.vocab_size, batches.taken)
        watch.doing = f"dispatching step {step}"
        state, metrics = step_fn(state, program.global_batch(batch))
        if previous is not None:
            watch.doing = f"waiting for step {step - 1} to complete (step {step} dispatched)"
            jax.block_until_ready(previous)
            watch.completed(step - 1)
        previous = metrics
        pending.append(metrics)
        if step % t.log_every == 0 or step == t.steps:
            watch.doing = f"waiting for step {step} to complete"
            host = jax.device_get(pending)  # the one device->host transfer
            watch.completed(step)
            previous = None
            last = {**rate.row(step, host), **batches.source_tokens()}
            writer.write(last)
            bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_sec']:,.0f}", refresh=False)
            ckpt.check()  # a save that failed in the background ends the run now, not at the next save
            first = step - len(host) + 1
            spike = next((found for i, m in enumerate(host) if spikes and (found := spikes.observe(first + i, numbers[i], float(m["loss"])))), None)
            pending, numbers = [], []
            if spike:
                rollbacks += 1
                if rollbacks > t.spike_max_rollbacks:
                    raise TrainingHalted(f"step {step}: the loss spiked again after {t.spike_max_rollbacks} rollbacks (train.spike_max_rollbacks); "
                                         f"the spiking batches are listed in {workdir / SKIPPED}")
                restore_start = time.perf_counter()
                with watch.paused(f"rolling back from step {step}"):
                    step, state = _roll_back(program, ckpt, batches, spikes, spike, writer, rollbacks, workdir)
                rate.exclude(time.perf_counter() - restore_start)
                bar.n = step
                bar.refresh()
                continue
            halt = _nonfinite_verdict(program.spec, first, host, _say)
            if halt:
                with watch.paused(f"checkpointing step {step}"):
                    ckpt.save(step, checkpointed(program, state), batches.get_state())
                    ckpt.wait()
                raise TrainingHalted(f"{halt}; no non-finite update was applied: the state is checkpointed at step {step} ({ckpt.directory / str(step)})")
        if step % t.eval_every == 0 or step == t.steps:
            eval_start = time.perf_counter()
            with watch.paused(f"evaluating at step {step}"):
                losses = jax.device_get([program.eval_step(state, b) for b in val_batches])
            last["eval_loss"] = float(np.mean(losses))
            writer.write({"step": step, "eval_loss": last["eval_loss"], "eval_perplexity": perplexity(last["eval_loss"])})
            _say(f"step {step}: eval loss {last['eval_loss']:.4f}")
            rate.exclude(time.perf_counter() - eval_start)  # evaluation time is not training time
        if evaluation is not None and (step % config.eval.every_steps == 0 or step == t.steps):
            # before the step's checkpoint: a run resumed from it has this evaluation already
            eval_start = time.perf_counter()
            with watch.paused(f"running lm-eval at step {step}"):
                scores = evaluation(state)
            writer.write({"step": step, **scores})
            _say(f"step {step}: lm-eval " + ", ".join(f"{k.removeprefix('lm_eval/')} {v:.4f}" for k, v in scores.items()))
            rate.exclude(time.perf_counter() - eval_start)
        if step % config.checkpoint.every_steps == 0 or step == t.steps:
            with watch.paused(f"checkpointing step {step}"):
                ckpt.save(step, checkpointed(program, state), batches.get_state())
            if faults.kill_during_save_at_step == step:
                _kill_self(step, "during the checkpoint write")
        bar.update(1)
        if faults.kill_at_step == step:
            ckpt.wait()
            _kill_self(step, "after the checkpoint is durable")
        if stop.reached(step):
            if pending:
                writer.write(rate.row(step, jax.device_get(pending)))
            with watch.paused(f"checkpointing step {step} to stop"):
                ckpt.save(step, checkpointed(program, state), batches.get_state())
                ckpt.wait()
            bar.close()
            _say(f"{stop.signal_name}: stopped after step {step}; checkpoint {ckpt.directory / str(step)} is written; run the same command to resume")
            break
    return last
