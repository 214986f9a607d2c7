"""What one layout of a training run keeps on each GPU, from formulas (`Memory`; the step time
is `lm.planner.cost.Cost`'s, built on it).

The state (parameters, optimizer state, fp8 state) exactly, from the sharding rules and the
abstract state's shapes, as `lm.layout` reports it; the step's temporaries as a sum of modelled
terms (gradients and their accumulator, the activations each remat policy keeps, one layer's
working set, the weights' compute-dtype copies, the logits, the head's table whole under FSDP),
each weighted by a coefficient fitted once to XLA's memory analysis of small compiles
(`lm.calibrate --memory`). Its inputs (Parallelism, Run) are `lm.planner.run`'s.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from functools import cached_property

from lm.hardware import data_file
from lm.planner.parallelism import Parallelism
from lm.planner.run import Run, StateLeaf
from sharding.schedule_report import report
from sharding.schedules import PipelinePlan

MEMORY_TERMS = ("grads", "accumulator", "saved", "layer", "weights", "logits", "head")


@functools.cache
def mesh_state_bytes(state: tuple[StateLeaf, ...], mesh: tuple[tuple[str, int], ...], spread: bool) -> dict:
    """`Memory.state_bytes` of a mesh (its (axis, size) pairs), remembered: the planner costs many
    layouts of one mesh."""
    sizes = dict(mesh)
    out = {"params": 0, "opt_state": 0, "other": 0, "grads": 0}
    for leaf in state:
        out[leaf.kind] += leaf.device_bytes(sizes, spread and leaf.kind == "opt_state")
        if leaf.kind == "params" and leaf.trained:  # (frozen weights have no gradient)
            out["grads"] += leaf.device_bytes(sizes, spread)
    return out


@functools.cache
def pipeline_report(plan: PipelinePlan, layers: int, costs: tuple = ()) -> dict:
    """`sharding.schedule_report.report` of a plan (bubble, stash depth), remembered; `costs`:
    the split backward's F, B and W as (kind, cost) pairs."""
    return report(plan, layers, dict(costs) or None)


def calibration() -> dict:
    """The fitted constants: the matmul efficiency and each platform's memory coefficients."""
    return json.loads(data_file("calibration.json").read_text())


def compiler_key(jax_version: str | None = None) -> str:
    """Which XLA memory coefficients are fitted on: jax's minor version (`jax0.12`), of
    `jax_version` or else of the installed jax. XLA's memory use moves between releases (jax
    0.12's per-stage 1F1B temporaries: 37% below 0.10's)."""
    major, minor = (jax_version or installed_jax()).split(".")[:2]
    return f"jax{major}.{minor}"


@functools.cache
def installed_jax() -> str:
    """jax's version, read once: its metadata takes milliseconds to parse, and the planner asks
    for each of the up to 100,000 layouts it prices (most of `lm.plan --gpus=512`'s time)."""
    return importlib.metadata.version("jax")


def memory_coefficients(constants: dict, platform: str, jax_version: str | None = None) -> dict:
    """`platform`'s temporaries coefficients fitted on this jax's XLA (or `jax_version`'s), else
    on the nearest release fitted."""
    fitted = constants["memory"][platform]

    def release(key: str) -> tuple[int, int]:
        major, minor = key.removeprefix("jax").split(".")
        return int(major), int(minor)

    here = release(compiler_key(jax_version))
    return fitted[min(fitted, key=lambda key: (abs(release(key)[0] - here[0]), abs(release(key)[1] - here[1])))]


class Memory:
    """One layout of one run: what each device's passes hold (`local_tokens`, `layers`, `passes`)
    and its memory per device (bytes). `platform` picks the memory coefficients: `gpu` (flash
    attention) or `cpu` (einsum)."""

    def __init__(self, run: Run, parallelism: Parallelism, platform: str = "gpu", constants: dict | None = None):
        self.run, self.parallelism, self.platform = run, parallelism, platform
        self.constants = constants or calibration()
        m, lay = run.model, parallelism
        self.replica_batch = run.batch // (lay.data * lay.expert * lay.fsdp)
        self.passes = lay.microbatches if lay.stage > 1 else lay.grad_accum  # forward-backward passes per step
        self.microbatch = self.replica_batch // self.passes
        self.local_tokens = self.microbatch * run.seq_len // lay.context  # per pass, on each device
        # The busiest stage's: DeepSeek's leading dense layers run on the first (with the
        # embedding), multi-token prediction's modules on the last (with the head).
        self.layers = m.pipelined_layers // lay.stage + max(m.dense_prefix, m.mtp_trained) if lay.stage > 1 else m.num_layers


    @cached_property
    def state_bytes(self) -> dict:
        """Per device: the state's parameters, optimizer state and the rest (`other`), and the
        gradients as the update takes them (`grads`: the parameters' placement, or with ZeRO-1
        the optimizer state's)."""
        return dict(mesh_state_bytes(self.run.state, tuple(self.parallelism.mesh.items()), self.parallelism.optimizer_over_data))

    def _tap_bytes(self) -> float:
        """Bytes per local token and layer of a split backward's taps (`lm.model.split_backward`):
        each weight matmul's input and output gradient in the compute dtype, per tensor shard
        where the matmul is split, an input several matmuls read once (q / k / v's, gate / up's);
        a mixture of experts' grouped matmuls keep none (their weight gradients come in B)."""
        m, e = self.run.model, self.run.compute_bytes
        d, q, kv, f = m.embed_dim, m.q_width, m.kv_width, m.mlp_dim
        attention = (d + q) + (q + 2 * kv + d)  # q / k / v's input and o's, then q, k, v, o's output gradients
        up = 2 if m.mlp == "swiglu" else 1
        mlp = 0.0 if m.moe else (d + f) + (up * f + d)
        return (attention + mlp) * e / self.parallelism.tensor

    def _kept_bytes(self, sequence_parallel: bool | None = None) -> dict:
        """Bytes per local token of what one block keeps for its backward pass, by remat policy,
        re-derived for this block (Korthikanti et al. 2022's accounting; checked against
        `jax.ad_checkpoint` residuals): q / k / v and attention widths are per tensor shard, the
        residual stream per sequence-parallel shard; cuDNN attention keeps only its output and
        softmax statistics, einsum attention (CPU) its float32 scores."""
        m, lay, e = self.run.model, self.parallelism, self.run.compute_bytes
        sequence_parallel = lay.sequence_parallel if sequence_parallel is None else sequence_parallel
        t, sp, cpu = lay.tensor, lay.tensor if sequence_parallel else 1, self.platform == "cpu"
        d, q, kv, f = m.embed_dim, m.q_width / t, m.kv_width / t, m.mlp_dim / t
        routed = 0.0  # a mixture of experts: each token's rows for its experts, copied as the grouped GEMMs take them
        if m.moe:  # the MLP a token goes through: its experts' widths (and the shared ones'), averaged over the layers
            sparse = m.sparse_layers / m.num_layers
            slots = m.expert_capacity_factor or 1.0  # capacity mode: every slot of the fixed buffers, used or not
            f = ((1 - sparse) * m.mlp_dim + sparse * (slots * m.experts_per_token + m.shared_experts) * m.expert_width) / t
            routed = sparse * slots * m.experts_per_token * d * e
        hidden = 4 if cpu else e  # the MLP's up projections leave the matmul in float32 on CPU
        up = 2 if m.mlp == "swiglu" else 1
        residual = d * e / sp
        projections = (q + 2 * kv) * e
        # The other context shards' keys and values (latent attention: their latents, expanded here).
        gathered_kv = (2 * kv + (m.kv_gathered_width / t if m.latent_attention else 0)) * (lay.context - 1) * e
        scores = m.num_heads / t * self.run.seq_len * 4 if cpu else 0.0  # einsum attention only
        statistics = m.num_heads / t * 4  # flash attention's float32 softmax statistics, per query
        # The attention and MLP output projections are kept as their reduced results: split along
        # the sequence under sequence parallelism (reduce-scattered), else whole.
        matmul_outputs = residual + projections + 2 * d * e / sp + up * f * hidden + routed
        return {
            "full": residual,
            "qkv_proj": residual + projections,
            "dots_no_batch": matmul_outputs,
            # Attention's output too: einsum attention's matmuls, or flash attention's results by name.
            "dots": matmul_outputs + q * e + (scores if cpu else statistics),
            # And the matmuls' computed inputs: both norms' outputs (the rotated queries and keys
            # replace the projections).
            "dots_and_inputs": matmul_outputs + q * e + (scores if cpu else statistics) + 2 * d * e / sp,
            # Both norms' float32 input, normalised and scaled copies and their output; queries,
            # keys, values and the attention output; the MLP's projections, activation internals
            # and product.
            "none": 2 * (12 + e) * d / sp + (2 * q + 2 * kv) * e + gathered_kv + (up + 3) * f * hidden + f * e + scores,
        }

    @property
    def _recomputes_ticks(self) -> bool:
        """Whether a pipeline recomputes each tick's forward in its backward (pipeline.remat full)."""
        return self.parallelism.stage > 1 and self.parallelism.pipeline_remat == "full"

    def memory_terms(self) -> dict:
        """Bytes per device of each modelled term of the step's temporaries (before coefficients)."""
        lay, kept = self.parallelism, self._kept_bytes()
        saved = self.layers * kept[lay.remat] * self.local_tokens
        if lay.stage > 1:
            pipelined = pipeline_report(lay.plan, self.run.model.num_layers)
            stash, share = pipelined["stash_depth"], pipelined.get("chunk_share", 1.0)  # ZB-V's depths count half-stage chunks
            # B's taps until W, for every microbatch between its B and its W, and two more sets:
            # the one B has just made and the one its branch's select writes (measured: `llama_8b`
            # {stage 4, fsdp 2} M = 8 on H100s, ZB-H1's temporaries 59.8 GiB here, 58.9 compiled).
            depth = pipelined.get("w_stash_depth", 0)
            taps = (depth + 2 * (depth > 0)) * share * self._tap_bytes() * self.layers * self.local_tokens
            if self._recomputes_ticks:  # every stage input the schedule keeps, plus one tick's layers on recompute
                saved += stash * kept["full"] * self.local_tokens
            else:  # what a chunk's layers keep, for every chunk in flight (1F1B's residual stash),
                # and the set a forward has just made or a backward is using, apart from the ring
                saved *= (stash + 1) * share / lay.repeats
            saved += taps
        # The gradients as the update takes them (spread over the replicas with ZeRO-1). Several
        # passes per step (accumulation, pipeline microbatches): a float32 accumulator too. With
        # ZeRO-1, XLA carries the update's placement back into the accumulation loop (each pass's
        # gradients reduce-scattered, the accumulator spread), but not into a pipeline's loop.
        grads = self.state_bytes["grads"]
        accumulator = grads if lay.stage == 1 else self.state_bytes["params"]
        return {
            "grads": grads,
            "accumulator": accumulator if self.passes > 1 else 0.0,
            "saved": saved,
            # One block's intermediates, alive in its backward; the compiled working set does not
            # shrink with sequence parallelism (measured: tensor 8 with and without it).
            "layer": self._kept_bytes(sequence_parallel=False)["none"] * self.local_tokens,
            "weights": self._weight_copies(),
            "logits": self._logits_bytes(),
            "head": self._gathered_head_bytes(),
        }

    def _gathered_head_bytes(self) -> float:
        """Under FSDP the head is gathered whole for its matmul (its vocabulary split over `stage` x
        `tensor`), in the parameters' dtype, and its gradient computed whole before the
        reduce-scatter: seen in XLA's buffer assignment, a large share of small models' memory."""
        lay, m = self.parallelism, self.run.model
        if lay.fsdp * lay.context == 1:
            return 0.0
        return m.vocab_size * m.embed_dim / (lay.stage * lay.tensor) * self.run.param_bytes

    def _logits_bytes(self) -> float:
        """The float32 logits alive at once, split over `stage` x `tensor` (the vocabulary rule): a
        microbatch's (every pipeline runs the head one microbatch at a time); in `model.loss_chunks`
        pieces, one piece's beside the float32 head gradient the pieces add into."""
        lay, m = self.parallelism, self.run.model
        logits = self.local_tokens * m.vocab_size / (lay.stage * lay.tensor) * 4
        if m.loss_chunks == 1:
            return logits
        return logits / m.loss_chunks + m.vocab_size * m.embed_dim / (lay.stage * lay.tensor) * 4

    def _weight_copies(self) -> float:
        """The blocks' weights in the compute dtype (every local shard cast), plus under FSDP a
        gathered layer in use and the next one arriving (gathered in the parameters' dtype)."""
        lay = self.parallelism
        layer = self.run.layer_weights(lay.tensor, lay.expert)
        fsdp = lay.fsdp * lay.context
        gathered = 2 * layer * self.run.param_bytes if fsdp > 1 else 0.0
        return self.layers * layer / fsdp * self.run.compute_bytes + gathered

    @cached_property
    def memory(self) -> dict:
        """Per-device bytes: state (exact), temporaries (modelled), and their sum."""
        state = self.state_bytes
        coefficients = memory_coefficients(self.constants, self.platform)
        terms = self.memory_terms()
        temporaries = coefficients.get("constant", 0.0) + sum(coefficients[k] * terms[k] for k in MEMORY_TERMS)
        out = {"params": state["params"], "opt_state": state["opt_state"] + state["other"], "temporaries": int(temporaries)}
        out["total"] = sum(out.values())
        return out
