"""Train state creation (born sharded), the train and eval steps, the loop, `python -m lm.train`.

    python -m lm.train --config=configs/tiny.py --workdir=runs/tiny [--config.train.steps=100]

Running the same command again with the same workdir resumes from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import sharding
import sharding.pipeline
from lm import cli
from lm import config as lm_config
from lm import data as lm_data
from lm.checkpoint import Checkpointer, abstract_like
from lm.cli import Parser
from lm.config import UserError
from lm.metrics import (
    MetricsWriter,
    StepRate,
    flops_per_token,
    param_count,
    peak_dtype,
    peak_flops,
    perplexity,
)
from lm.loss_scale import LossScaling
from lm.model import ModelConfig, PipelinePlan, Transformer
from lm.optim import optimizer, schedule
from lm.precision import Fp8Meta, Probe, update_fp8


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """Mean next-token cross entropy in float32."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits_btv.astype(jnp.float32), targets_bt)
    return jnp.mean(losses)


def rules_from(config) -> tuple:
    """The default rules, overridden by `sharding.rules`, then sequence parallelism if asked for."""
    overrides = [config.sharding.rules or ()]
    if config.sharding.sequence_parallel:
        overrides.append(sharding.SEQUENCE_PARALLEL_RULES)
    return sharding.merge_rules(sharding.DEFAULT_RULES, *overrides)


@dataclasses.dataclass(frozen=True)
class Faults:
    """Fault injection for tests: how a run should misbehave, and when."""

    kill_at_step: int | None = None  # SIGKILL once this step's checkpoint is durable
    kill_during_save_at_step: int | None = None  # SIGKILL as soon as this step's save has started
    nonfinite_steps: tuple[int, ...] = ()  # these steps' loss and gradients are NaN
    overflow_steps: tuple[int, ...] = ()  # these steps' gradients are 1e30 times too large


@dataclasses.dataclass
class Trainer:
    """The compiled pieces of one training setup: state layout, train step, eval step.

    The train state: `step`, `params`, `opt_state`; `fp8` (scales and amax histories) with
    `precision.fp8`; `loss_scale` with dynamic loss scaling.
    """

    config: object
    model_cfg: ModelConfig
    mesh: jax.sharding.Mesh
    rules: tuple
    faults: Faults = Faults()

    def __post_init__(self):
        c = self.config
        abstract_model = sharding.abstract_module(lambda: Transformer(self.model_cfg, rngs=nnx.Rngs(0)))
        self.graphdef, abstract_params, abstract_fp8, abstract_probes = nnx.split(abstract_model, nnx.Param, Fp8Meta, Probe)
        self.logical_axes = sharding.logical_axes(abstract_params)
        self.policy = self.model_cfg.policy
        self.loss_scaling = LossScaling.from_config(c.precision)
        self.probes = nnx.to_pure_dict(abstract_probes)  # shapes: the probes are zeros each step
        self.zero_probes = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.probes)
        self.tx = optimizer(c)
        self.schedule = schedule(c)
        self.abstract_state = jax.eval_shape(lambda: self._init(0))
        replicated = NamedSharding(self.mesh, PartitionSpec())
        param_shardings = sharding.state_shardings(abstract_params, self.mesh, self.rules)
        sharding.check_rules(self.rules, self.mesh)  # also the rules no parameter uses
        opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, s: s,
            self.abstract_state["opt_state"],
            param_shardings,
            transform_non_params=lambda _: replicated,
        )
        self.state_shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}
        if "fp8" in self.abstract_state:
            self.state_shardings["fp8"] = sharding.state_shardings(abstract_fp8, self.mesh, self.rules)
        if "loss_scale" in self.abstract_state:
            self.state_shardings["loss_scale"] = jax.tree.map(lambda _: replicated, self.abstract_state["loss_scale"])
        batch_size, length = c.train.batch_size, c.train.seq_len + 1
        self.batch_sharding = sharding.named_sharding(
            self.mesh, ("batch", "length"), self.rules, shape=(batch_size, length), name="batch"
        )
        self.replicated = replicated
        self.init_state = jax.jit(self._init, static_argnums=0, out_shardings=self.state_shardings)
        self.train_step = jax.jit(
            self._train_step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            lambda state, tokens: self._loss(state["params"], tokens, state.get("fp8")),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=replicated,
        )

    # -- pure functions, traced under jit

    def _init(self, seed: int) -> dict:
        model = Transformer(self.model_cfg, rngs=nnx.Rngs(seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.tx.init(params)}
        if self.policy.fp8:
            state["fp8"] = nnx.to_pure_dict(nnx.state(model, Fp8Meta))
        if (loss_scale := self.loss_scaling.init()) is not None:
            state["loss_scale"] = loss_scale
        return state

    def model(self, params, fp8=None, probes=None) -> Transformer:
        """The model on these parameters (and fp8 state; probes default to zeros)."""
        return nnx.merge(self.graphdef, params, fp8 or {}, self.zero_probes() if probes is None else probes)

    def _loss(self, params, tokens_bl: jax.Array, fp8=None, probes=None) -> jax.Array:
        logits, _ = self.model(params, fp8, probes)(tokens_bl[:, :-1])
        return cross_entropy(logits, tokens_bl[:, 1:])

    def _grads(self, params, tokens_bl, fp8=None, loss_scale=1.0):
        """(mean loss, mean grads of `loss * loss_scale`, matmul statistics) over the batch,
        accumulated over `train.grad_accum` microbatches (statistics: amaxes, the maximum)."""
        accum = self.config.train.grad_accum

        def scaled_loss(params, probes, tokens):
            loss = self._loss(params, tokens, fp8, probes)
            return loss * loss_scale, loss

        grad_fn = jax.grad(scaled_loss, argnums=(0, 1), has_aux=True)

        def one(tokens):
            (grads, stats), loss = grad_fn(params, self.zero_probes(), tokens)
            return loss, grads, stats

        if accum == 1:
            return one(tokens_bl)
        b, l = tokens_bl.shape
        # Microbatch j takes rows j, j+accum, ...: every data-parallel shard holds part of each.
        micro = tokens_bl.reshape(b // accum, accum, l).swapaxes(0, 1)
        micro = sharding.constrain(micro, (None, "batch", "length"), "microbatches")

        def add(carry, tokens):
            loss, grads, stats = one(tokens)
            summed = jax.tree.map(jnp.add, carry[:2], (loss, grads))
            return (*summed, jax.tree.map(jnp.maximum, carry[2], stats)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), self.zero_probes())
        (loss, grads, stats), _ = jax.lax.scan(add, zeros, micro)
        return loss / accum, jax.tree.map(lambda g: g / accum, grads), stats

    def _train_step(self, state, tokens_bl):
        step = state["step"] + 1
        scale = self.loss_scaling.current(state.get("loss_scale"))
        applied_scale = scale
        if self.faults.overflow_steps:  # fault injection (tests): gradients far too large
            applied_scale = scale * jnp.where(jnp.isin(step, jnp.asarray(self.faults.overflow_steps)), 1e30, 1.0)
        loss, grads, stats = self._grads(state["params"], tokens_bl, state.get("fp8"), applied_scale)
        if self.loss_scaling.kind != "none":
            grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
        if self.faults.nonfinite_steps:  # fault injection (tests): these steps' loss and gradients are NaN
            poison = jnp.where(jnp.isin(step, jnp.asarray(self.faults.nonfinite_steps)), jnp.nan, 1.0)
            loss, grads = jax.tree.map(lambda x: x * poison.astype(x.dtype), (loss, grads))
        # A non-finite update is not applied (optax.apply_if_finite); the step still counts.
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "lr": self.schedule(state["step"]),
            "nonfinite_in_a_row": opt_state.notfinite_count,
            "skipped_steps": opt_state.total_notfinite,
        }
        new_state = {"step": step, "params": params, "opt_state": opt_state}
        if "fp8" in state:  # delayed scaling learns from applied steps only
            updated = update_fp8(state["fp8"], stats, self.policy.fp8)
            new_state["fp8"] = jax.tree.map(lambda n, o: jnp.where(opt_state.last_finite, n, o), updated, state["fp8"])
        if self.loss_scaling.kind != "none":
            metrics["loss_scale"] = scale
        if self.policy.observe:
            metrics["matmul_stats"] = stats
        if "loss_scale" in state:
            new_state["loss_scale"] = self.loss_scaling.update(state["loss_scale"], opt_state.last_finite)
        return new_state, metrics

    # -- host side

    def global_batch(self, local_rows: np.ndarray) -> jax.Array:
        """This process's rows -> one global array sharded over `batch`."""
        return jax.make_array_from_process_local_data(self.batch_sharding, local_rows)

    def abstract_sharded_state(self):
        return abstract_like(self.abstract_state, self.state_shardings)


def data_parallel_size(mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_batch_split(config, mesh) -> None:
    b, dp, accum = config.train.batch_size, data_parallel_size(mesh), config.train.grad_accum
    if b % (dp * accum):
        raise UserError(
            f"train.batch_size={b} is not divisible by the data-parallel size {dp} (mesh data x fsdp)"
            + (f" times train.grad_accum={accum}" if accum > 1 else "")
            + f"; use a multiple of {dp * accum} or change the mesh"
        )
    tensor = mesh.shape["tensor"]
    if config.sharding.sequence_parallel and config.train.seq_len % tensor:
        raise UserError(
            f"sharding.sequence_parallel splits the sequence over mesh.tensor={tensor}, which does not "
            f"divide train.seq_len={config.train.seq_len}; change one of them"
        )
    if mesh.shape["stage"] > 1:
        plan = PipelinePlan.from_config(config)
        per_replica = b // (dp * accum)
        sharding.pipeline.check(plan.stages, plan.microbatches, plan.repeats, config.model.num_layers, per_replica)
    if b % jax.process_count():
        raise UserError(f"train.batch_size={b} is not divisible by the {jax.process_count()} processes")


def check_workdir(config, workdir: Path) -> None:
    """A workdir trained with a different model shape is an error; nothing in it is touched."""
    saved_path = workdir / "config.json"
    if not saved_path.exists():
        return
    saved = lm_config.shape_fields(lm_config.from_json(saved_path.read_text()))
    now = lm_config.shape_fields(config)
    diffs = [f"{k}: {saved.get(k)!r} saved, {now.get(k)!r} now" for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diffs:
        raise UserError(
            f"workdir {workdir} holds a run of an incompatible config ({'; '.join(diffs)}); "
            "use a new --workdir or the saved settings"
        )


def setup(config, vocab_size: int, devices=None, faults: Faults = Faults(), observe: bool = False) -> Trainer:
    """Validated config -> mesh (checked against the batch) -> the compiled training pieces.

    `observe`: every step also returns the block matmuls' statistics (`lm.numerics`)."""
    lm_config.validate(config)
    mesh = sharding.make_mesh(sharding.MeshConfig.from_mapping(config.mesh), devices)
    check_batch_split(config, mesh)
    model_cfg = ModelConfig.from_config(config, vocab_size)
    if observe:
        model_cfg = dataclasses.replace(model_cfg, policy=dataclasses.replace(model_cfg.policy, observe=True))
    return Trainer(config, model_cfg, mesh, rules_from(config), faults)


class TrainingHalted(UserError):
    """The run stopped itself (non-finite steps); its last good state is checkpointed."""

    exit_code = 3


def _kill_self(step: int, when: str) -> None:
    print(f"debug: SIGKILL at step {step} ({when})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _prepare_in_turn(config, workdir: Path):
    """Process 0 tokenises (and trains a BPE) first; the others then read what it cached."""
    if jax.process_count() == 1:
        return lm_data.prepare(config, workdir)
    from jax.experimental import multihost_utils

    prepared = lm_data.prepare(config, workdir) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("meshlm: data prepared")
    return prepared or lm_data.prepare(config, workdir)


def _nonfinite_verdict(config, first_step: int, host_metrics: list[dict], say) -> str | None:
    """Reports skipped steps; returns why the run must stop, or None.

    Under dynamic loss scaling, gradients overflowing from a finite loss are the scaler's
    business (it backs off), not a reason to stop."""
    t = config.train
    skipped = [(first_step + i, m) for i, m in enumerate(host_metrics) if m["nonfinite_in_a_row"] > 0]
    dynamic = LossScaling.from_config(config.precision).kind == "dynamic"
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
    lm_config.validate(config)
    workdir = Path(workdir)
    check_workdir(config, workdir)
    # The mesh is checked before the corpus is read: a bad mesh fails fast.
    sharding.MeshConfig.from_mapping(config.mesh).resolve(len(devices or jax.devices()))
    tokenizer, train_windows, val_windows = _prepare_in_turn(config, workdir)
    trainer = setup(config, tokenizer.vocab_size, devices, faults)
    ckpt = Checkpointer(workdir / "checkpoints", config.checkpoint.keep, config.checkpoint.async_save)
    pi, pc, t = jax.process_index(), jax.process_count(), config.train
    batches = lm_data.train_batches(train_windows, t.batch_size, t.seed, pi, pc, config.data.prefetch)
    val_rows = lm_data.eval_batches(val_windows, t.batch_size, t.eval_batches, pi, pc)
    if pi == 0:
        (workdir / "config.json").write_text(lm_config.to_json(config))
    writer = MetricsWriter(workdir, enabled=pi == 0)
    stop = sharding.distributed.StopRequest()
    try:
        with sharding.activate(trainer.mesh, trainer.rules):
            return _loop(config, trainer, ckpt, batches, val_rows, writer, stop, faults)
    finally:
        stop.close()
        ckpt.wait()
        ckpt.close()
        writer.close()


def _say(text: str) -> None:
    """Console output from the lead process, around the progress bar."""
    from tqdm import tqdm

    if jax.process_index() == 0:
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()


def _loop(config, trainer: Trainer, ckpt: Checkpointer, batches, val_rows, writer: MetricsWriter, stop, faults: Faults) -> dict:
    from tqdm import tqdm

    t, mesh, mcfg = config.train, trainer.mesh, trainer.model_cfg
    val_batches = [trainer.global_batch(rows) for rows in val_rows]  # on device once, reused
    restored = ckpt.restore_latest(trainer.abstract_sharded_state(), _say)
    if restored is None:
        state, start = trainer.init_state(t.seed), 0
    else:
        start, state, data_state = restored
        if data_state is not None:
            batches.set_state(data_state)
        _say(f"resuming from step {start} ({ckpt.directory / str(start)})")
    tokens_per_step = t.batch_size * t.seq_len
    rate = StepRate(tokens_per_step, flops_per_token(mcfg, t.seq_len), peak_flops(peak_dtype(config.precision))[0] * mesh.size)
    _say(
        f"model: {param_count(state['params']) / 1e6:.2f}M parameters, vocab {mcfg.vocab_size}, "
        f"mesh {dict(mesh.shape)}, {t.steps} steps of {tokens_per_step} tokens"
    )
    if start >= t.steps:
        _say(f"already trained to step {start}; raise --config.train.steps to continue")
    else:
        step_fn = trainer.train_step.lower(state, val_batches[0]).compile()
    bar = tqdm(total=t.steps, initial=start, disable=jax.process_index() != 0, unit="step", dynamic_ncols=True, file=sys.stdout)
    pending, last = [], {}
    for step in range(start + 1, t.steps + 1):
        state, metrics = step_fn(state, trainer.global_batch(next(batches)))
        pending.append(metrics)
        if step % t.log_every == 0 or step == t.steps:
            host = jax.device_get(pending)  # the one device->host transfer
            last = rate.row(step, host)
            writer.write(last)
            bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_sec']:,.0f}", refresh=False)
            halt = _nonfinite_verdict(config, step - len(host) + 1, host, _say)
            pending = []
            if halt:
                ckpt.save(step, state, batches.get_state())
                ckpt.wait()
                bar.close()
                raise TrainingHalted(f"{halt}; no non-finite update was applied: the state is checkpointed at step {step} ({ckpt.directory / str(step)})")
        if step % t.eval_every == 0 or step == t.steps:
            eval_start = time.perf_counter()
            losses = jax.device_get([trainer.eval_step(state, b) for b in val_batches])
            last["eval_loss"] = float(np.mean(losses))
            writer.write({"step": step, "eval_loss": last["eval_loss"], "eval_perplexity": perplexity(last["eval_loss"])})
            _say(f"step {step}: eval loss {last['eval_loss']:.4f}")
            rate.exclude(time.perf_counter() - eval_start)  # evaluation time is not training time
        if step % config.checkpoint.every_steps == 0 or step == t.steps:
            ckpt.save(step, state, batches.get_state())
            if faults.kill_during_save_at_step == step:
                _kill_self(step, "during the checkpoint write")
        bar.update(1)
        if faults.kill_at_step == step:
            ckpt.wait()
            _kill_self(step, "after the checkpoint is durable")
        if stop.reached(step):
            if pending:
                writer.write(rate.row(step, jax.device_get(pending)))
            ckpt.save(step, state, batches.get_state())
            ckpt.wait()
            bar.close()
            _say(f"{stop.signal_name}: stopped after step {step}; checkpoint {ckpt.directory / str(step)} is written; run the same command to resume")
            break
    bar.close()
    _say(f"checkpoints: {ckpt.directory}")
    _say(f"metrics:     {writer.path.absolute()} (TensorBoard: {writer.tb_dir.absolute()})")
    return last


def main(argv: list[str]) -> None:
    parser = Parser(prog="python -m lm.train", description="Train (or resume) a language model.", distributed=True)
    parser.add_argument("--workdir", required=True, help="run directory: checkpoints, metrics, tokenizer")
    for flag in ("kill_at_step", "kill_during_save_at_step"):
        parser.add_argument(f"--debug_{flag}", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug_nonfinite_steps", default="", help=argparse.SUPPRESS)
    args = parser.parse(argv)
    faults = Faults(
        kill_at_step=args.debug_kill_at_step,
        kill_during_save_at_step=args.debug_kill_during_save_at_step,
        nonfinite_steps=tuple(int(s) for s in args.debug_nonfinite_steps.split(",") if s),
    )
    train(args.config, args.workdir, faults=faults)


if __name__ == "__main__":
    cli.run(main)
