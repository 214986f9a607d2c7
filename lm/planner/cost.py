"""What one layout of a training run costs each GPU, from formulas: its step time, on top of its
memory (`lm.planner.memory.Memory`, whose shares of the work it uses).

Step time: the matmuls' FLOPs (`lm.model.flops.flops_per_token`, plus what remat recomputes) and
attention's, each at a fitted share of the target's dense peak (fp8 peak for the block matmuls
with `precision.fp8`), and the memory-bound passes over what the layers keep (fewer with `train.gemm_fusion`), over the logits
and under tensor parallelism, their counts fitted (`compute_terms`; the six constants fitted to the kernel model's
predictions of compiled programs: `lm.planner.calibration.fit_step_time`), the
pipeline bubble (a per-stage 1F1B slot lasts its longest piece of work: the wait counted with it) and its
stash's memory traffic, a mixture of experts' GEMMs as the grouped matmul or capacity buffers run
them (`_expert_work`), its dropless receive buffers' passes and its all-to-alls over `expert`, and the exposed time of each collective from ring formulas over the link its
group spans (NVLink inside a host, the network across hosts: one NIC per GPU, as many at once as
the group has GPUs on a host). FSDP's gathers and
reduce-scatters overlap the layer they feed (XLA's latency-hiding scheduler); tensor, context,
pipeline and data-parallel collectives are counted as exposed.
"""

from __future__ import annotations

from functools import cached_property

from lm.compiler import steptime, targets
from lm.hardware.systems import System
from lm.model import grouped_gemm
from lm.model.flops import attention_flops, qkv_params, split_backward_flops
from lm.planner.memory import Memory, pipeline_report
from lm.planner.network import ring_seconds, send_bandwidth
from lm.planner.parallelism import Parallelism
from lm.planner.run import Run
from sharding.mesh import MESH_AXES
from sharding.schedules import SPLIT_BACKWARD, balanced_slots

# A dropless layer's busiest device over the mean under expert parallelism: moe_tiny with the
# balancing loss at 0.05 measured 1.2-1.3 max / mean load (PERFORMANCE.md).
DROPLESS_IMBALANCE = 1.25
# The cost model's fitted step-time constants (`lm/hardware/calibration.json`), in the order of
# `Cost.compute_terms`: the matmuls' and attention's shares of peak, and the memory-bound passes
# over what each layer keeps (with the elementwise work inside the GEMMs, `train.gemm_fusion`,
# fewer: a count of their own), over the float32 logits and (tensor parallelism) the residual stream.
STEP_TIME_CONSTANTS = ("matmul_efficiency", "attention_efficiency", "saved_passes", "fused_saved_passes", "logits_passes", "tensor_passes")


# The step-time terms of collectives over links, which `with_network` puts in place of the kernel
# model's collective kernels.
NETWORK_TERMS = ("fsdp", "tensor", "context", "data", "pipeline")


def step_time_factors(constants: dict) -> tuple[float, ...]:
    """What each of `Cost.compute_terms` is multiplied by: 1 / efficiency, or a count of passes."""
    fitted = constants["step_time"]
    return tuple(1 / fitted[k] if k.endswith("efficiency") else fitted[k] for k in STEP_TIME_CONSTANTS)


# Passes over a dropless exchange's receive buffer (room for every assignment of every expert
# device) per MoE layer: its fill forward; the cotangent buffer's fill and the sum of the two
# input gradients backward (read twice, written once); the fill again where the layer is
# recomputed (the deviceless Mixtral compile's kernel table).
BUFFER_PASSES, RECOMPUTED_BUFFER_PASSES = 5, 1


class Cost(Memory):
    """One layout of one run on one system: memory per device (bytes, `Memory`'s) and step time
    (seconds)."""

    def __init__(self, run: Run, parallelism: Parallelism, system: System, platform: str = "gpu", constants: dict | None = None):
        super().__init__(run, parallelism, platform, constants)
        self.system = system


    def _ring(self, axes: tuple[str, ...], gathered_bytes: float, kind: str = "gather") -> float:
        """`lm.planner.network.ring_seconds` over this layout's mesh."""
        return ring_seconds(self.system, self._mesh_sizes, axes, gathered_bytes, kind)

    @property
    def _mesh_sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self.parallelism, a) for a in MESH_AXES)

    def _forward_flops(self) -> tuple[float, float]:
        """Forward FLOPs per token of the blocks' matmuls and of their attention."""
        run, m = self.run, self.run.model
        # Causal: cuDNN skips the masked half. Under context parallelism the reordered sequence's
        # mask reaches cuDNN as a bias (lm.model.attention) and every (query, key) pair is computed:
        # twice the work.
        attention = attention_flops(m, run.seq_len) * (2 if self.parallelism.context > 1 else 1)
        return 2 * run.layer_params * m.num_layers, attention

    def flops(self) -> dict:
        """FLOPs per device per step: block matmuls, the head, attention, each with recompute."""
        run, lay, m = self.run, self.parallelism, self.run.model
        tokens = run.batch * run.seq_len / lay.gpus
        block, attention = self._forward_flops()
        qkv = 2 * m.num_layers * qkv_params(m)
        recompute = {"none": 0.0, "dots": 0.0, "dots_and_inputs": 0.0, "dots_no_batch": 0.0, "qkv_proj": block - qkv, "full": block}[lay.remat]
        recompute_attention = attention if lay.remat in ("full", "qkv_proj", "dots_no_batch") else 0.0
        if self._recomputes_ticks:  # each tick is recomputed whole in the backward
            recompute, recompute_attention = recompute + block, recompute_attention + attention
        # The experts' GEMMs cost `expert_work` times their active FLOPs (the busiest device's
        # share, or what the grouped matmul computes: `_expert_work`).
        experts = 2 * m.num_layers * run.expert_active_params * (self._expert_work() - 1)
        recomputed_experts = experts if lay.remat not in ("none", "dots", "dots_and_inputs") else 0.0
        return {
            "block": tokens * (3 * (block + experts) + recompute + recomputed_experts),
            "head": tokens * 6 * m.embed_dim * m.vocab_size,
            "attention": tokens * (3 * attention + recompute_attention),
        }

    def grouped_gemm(self) -> str:
        """The grouped GEMM a dropless layer of this layout runs on a GPU (`lm.model.grouped_gemm`:
        meshlm's Pallas kernels where dtype and widths allow, else XLA's dense rewrite)."""
        m = self.run.model
        return grouped_gemm.resolve(m.grouped_gemm, "gpu", m.embed_dim, m.expert_width // self.parallelism.tensor, self.run.compute_dtype)

    def grouped_gemm_pricing(self) -> str:
        """How this layout's dropless experts are priced, in a sentence ('' for other models)."""
        m = self.run.model
        if not m.moe or m.expert_capacity_factor > 0:
            return ""
        if self.grouped_gemm() == "xla":
            return f"grouped GEMM (model.grouped_gemm={m.grouped_gemm}): XLA's ragged_dot, priced as its dense rewrite ({m.num_experts} x the work)"
        c = steptime.constants()
        why = steptime.unfitted().get("grouped_gemm", "fitted to a GPU run's profile")
        return (f"grouped GEMM (model.grouped_gemm={m.grouped_gemm}): meshlm's Pallas kernels over the real rows at "
                f"{c['grouped_gemm']:.2f} of peak ({why})")

    def _expert_work(self) -> float:
        """The experts' GEMM time over their active FLOPs' at the dense GEMM's efficiency.
        Capacity mode: the fixed buffers, the capacity factor. Dropless with the Pallas grouped
        GEMM: the real rows, on the busiest device under expert parallelism (`DROPLESS_IMBALANCE`
        x the mean), at the grouped GEMM's efficiency (`lm.compiler.steptime`'s, the dense GEMM's
        until a GPU run fits it). With XLA's `ragged_dot`: one masked GEMM per expert over every
        row of the receive buffer, num_experts x."""
        m = self.run.model
        if not m.moe:
            return 1.0
        if m.expert_capacity_factor > 0:
            return m.expert_capacity_factor
        if self.grouped_gemm() == "xla":
            return float(m.num_experts)
        c = steptime.constants()
        return (DROPLESS_IMBALANCE if self.parallelism.expert > 1 else 1.0) * c["gemm"] / c["grouped_gemm"]

    def _dispatch_traffic(self) -> float:
        """HBM bytes a step's dropless exchanges move through their receive buffers on each device
        (`BUFFER_PASSES`): none without expert parallelism or with a capacity factor."""
        m, lay = self.run.model, self.parallelism
        if not m.moe or m.expert_capacity_factor > 0 or lay.expert == 1:
            return 0.0
        recomputed = lay.remat in ("full", "qkv_proj") or self._recomputes_ticks
        passes = BUFFER_PASSES + (RECOMPUTED_BUFFER_PASSES if recomputed else 0)
        buffer = lay.expert * self.local_tokens * m.experts_per_token * m.embed_dim * self.run.compute_bytes
        return self.passes * self.layers * m.sparse_layers / m.num_layers * passes * buffer

    def expert_exchange_bytes(self) -> float:
        """Bytes one exchange sends from each device per pass and MoE layer (0 without expert
        parallelism): dropless, its assignments (`ragged_all_to_all` on GPUs); capacity mode,
        every expert's slots."""
        m, lay = self.run.model, self.parallelism
        if lay.expert == 1:
            return 0.0
        rows = self.local_tokens * m.experts_per_token * (m.expert_capacity_factor if m.expert_capacity_factor > 0 else 1.0)
        return rows * m.embed_dim * self.run.compute_bytes

    def _exchanges_per_layer(self) -> int:
        """All-to-alls per MoE layer and pass: dispatch and combine, forward and backward, and
        the forward's again when the layer is recomputed."""
        recomputed = self.parallelism.remat in ("full", "qkv_proj") or self._recomputes_ticks
        return 4 + (2 if recomputed else 0)

    def bubble_fraction(self) -> float:
        """The idle share of the pipeline's work slots (0 without one); zero-bubble slots costed
        by their ops' FLOPs."""
        lay = self.parallelism
        if lay.stage == 1:
            return 0.0
        costs = tuple(split_backward_flops(self.run.model, self.run.seq_len, lay.remat).items()) if lay.schedule in SPLIT_BACKWARD else ()
        pipelined = pipeline_report(lay.plan, self.run.model.num_layers, costs)
        # The one program's slots last their longest op on any stage, as the kernel model charges them.
        return pipelined.get("slot_bubble", pipelined["bubble"])

    def compute_terms(self) -> dict:
        """The busiest device's compute per step, in seconds before the fitted constants
        (`STEP_TIME_CONSTANTS`, `lm.planner.calibration.fit_step_time`): the matmuls' FLOPs and
        attention's at peak, and the bytes of the memory-bound passes at the HBM bandwidth
        (what each layer keeps for its backward, written and read around the layer's
        elementwise work, its own count where that work runs inside the GEMMs,
        `lm.compiler.targets.elementwise_gemm_fusion`; the float32 logits, which the loss passes over; under tensor parallelism,
        the residual stream once more per pass of a layer: the kernel model finds XLA's
        tensor-parallel programs doing more memory-bound work than the same layers unsplit)."""
        run, lay, m, s = self.run, self.parallelism, self.run.model, self.system
        flops = self.flops()
        pace = self.layers * lay.stage / m.num_layers  # the busiest stage's (1 when the stages are alike)
        block_peak, other_peak = s.peak("float8" if run.fp8 else run.compute_dtype), s.peak(run.compute_dtype)
        saved = self.passes * self.layers * self.local_tokens * self._kept_bytes()[lay.remat]
        fused = targets.elementwise_gemm_fusion(run.gemm_fusion, run.fp8, lay.tensor > 1)
        logits = self.passes * self.local_tokens * m.vocab_size / (lay.stage * lay.tensor) * 4
        return {
            "matmul": (flops["block"] / block_peak + flops["head"] / other_peak) * pace,
            "attention": flops["attention"] / other_peak * pace,
            "saved": (not fused) * saved / s.hbm_bytes_per_s,
            "saved_fused": fused * saved / s.hbm_bytes_per_s,
            "logits": logits / s.hbm_bytes_per_s,
            "tensor": (lay.tensor > 1) * self.passes * self.layers * self.local_tokens * m.embed_dim * run.compute_bytes / s.hbm_bytes_per_s,
        }

    @cached_property
    def step_time(self) -> dict:
        """Seconds per step: compute, bubble and each collective's exposed time, and their sum."""
        run, lay, m, s = self.run, self.parallelism, self.run.model, self.system
        flops = self.flops()
        block_peak = s.peak("float8" if run.fp8 else run.compute_dtype)
        other_peak = s.peak(run.compute_dtype)
        matmul, attention = step_time_factors(self.constants)[:2]
        compute = sum(seconds * factor for seconds, factor in zip(self.compute_terms().values(), step_time_factors(self.constants)))
        fraction = self.bubble_fraction()
        bubble = compute * fraction / (1 - fraction)
        if lay.schedule == "1f1b_per_stage":
            block_forward, attention_forward = self._forward_flops()
            forward = run.batch * run.seq_len / lay.gpus * (block_forward / block_peak + attention_forward / other_peak)
            layers = flops["block"] / block_peak + flops["attention"] / other_peak
            # Its slots run one piece of work, a forward or a backward, on every stage in step (one
            # SPMD program), so a slot lasts the longest: each microbatch's F + B takes 2 max(F, B),
            # or in balanced slots (the backward in two parts) 3 max(F, B / 2).
            backward, parts = layers - forward, 2 if balanced_slots(lay.plan, m.num_layers) else 1
            bubble = (compute + bubble) * (1 + parts) * max(forward, backward / parts) / layers - compute
        e = run.compute_bytes
        per_layer_compute = (flops["block"] / block_peak * matmul + flops["attention"] / other_peak * attention) / (self.layers * self.passes)
        volume = self._collective_volume()
        fsdp_axes = ("context", "fsdp")
        fsdp_layer = 2 * self._ring(fsdp_axes, volume["fsdp_gather"]) + self._ring(fsdp_axes, volume["fsdp_scatter"])
        tables = self._ring(fsdp_axes, volume["table_gather"]) + self._ring(fsdp_axes, volume["table_scatter"])
        fsdp = self.passes * (self.layers * max(0.0, fsdp_layer - per_layer_compute) + tables)
        tp_per_layer = volume["tensor_reductions"] * self._ring(("tensor",), volume["tensor"], "reduce")
        kv = self.microbatch * run.seq_len * m.kv_gathered_width / (1 if m.latent_attention else lay.tensor) * e
        cp_per_layer = 3 * self._ring(("context",), kv)
        # The gradients' all-reduce over the replicas; with ZeRO-1 a reduce-scatter and the new
        # parameters' all-gather: in a ring, the same bytes. Gradients already split over fsdp
        # XLA all-reduces over the replicas and then slices (its H100 compile): the gather is extra.
        data = self._ring(("data",), self.state_bytes["params"], "reduce")
        if lay.optimizer_over_data and lay.fsdp * lay.context > 1:
            data += self._ring(("data",), self.state_bytes["params"])
        expert = 0.0
        if lay.expert > 1:
            exchange = self.expert_exchange_bytes() * (lay.expert - 1) / lay.expert
            # Dispatched in chunks (dropless), one chunk's exchange runs beside another's expert
            # GEMMs (XLA's schedule, seen in the H100 compile): one chunk's is left exposed.
            chunks = m.expert_dispatch_chunks if m.expert_capacity_factor == 0 else 1
            per_exchange = exchange / chunks / send_bandwidth(s, self._mesh_sizes, ("expert",)) + s.nvlink_latency_s
            expert = self.passes * self.layers * self._exchanges_per_layer() * per_exchange
        pipeline = 0.0
        if lay.stage > 1:
            bandwidth = send_bandwidth(s, self._mesh_sizes, ("stage",))
            ticks = 2 * (lay.repeats * lay.microbatches + lay.stage - 1)
            pipeline = ticks * (volume["tensor"] / (lay.tensor if lay.sequence_parallel else 1) / bandwidth + s.nvlink_latency_s)
        out = {
            "compute": compute,
            "bubble": bubble,
            "stash": self._stash_traffic() / s.hbm_bytes_per_s,
            "update": self._update_traffic() / s.hbm_bytes_per_s,
            "dispatch": self._dispatch_traffic() / s.hbm_bytes_per_s,
            "fsdp": fsdp,
            "tensor": self.passes * self.layers * tp_per_layer,
            "context": self.passes * self.layers * cp_per_layer,
            "data": data,
            "expert": expert,
            "pipeline": pipeline,
        }
        out["total"] = sum(out.values())
        return out

    def _collective_volume(self) -> dict:
        """What FSDP and tensor parallelism move per pass, in bytes per device (each collective's
        whole, gathered buffer): one layer's weights gathered (twice: forward and backward) and
        gradients scattered, the embedding and head tables' likewise, once; the activation each
        tensor-parallel reduction carries and how many a layer runs."""
        run, lay, m = self.run, self.parallelism, self.run.model
        layer, e = run.layer_weights(lay.tensor, lay.expert), run.compute_bytes
        tables = m.embed_dim * m.vocab_size / (lay.stage * lay.tensor) * (1 if m.tie_embeddings else 2)
        # All-reduce equivalents per layer (an all-gather plus a reduce-scatter under sequence
        # parallelism): one per sublayer forward, one per sublayer backward (plus the gathered
        # output gradient under sequence parallelism), and the forward again when recomputed.
        recomputed = lay.remat in ("full", "qkv_proj") or self._recomputes_ticks
        return {
            # Weights are gathered in the compute dtype (XLA casts before the all-gather), gradients
            # reduce-scattered in the parameters' (float32): both seen in the H100 compile.
            "fsdp_gather": layer * e,
            "fsdp_scatter": layer * run.param_bytes,
            "table_gather": tables * e,
            "table_scatter": tables * run.param_bytes,
            "tensor": self.local_tokens * m.embed_dim * e,
            "tensor_reductions": 4 + (1 if lay.sequence_parallel else 0) + (2 if recomputed else 0),
        }

    def collective_bytes(self) -> dict:
        """Bytes per step each device's FSDP and tensor-parallel collectives carry (whole buffers,
        all-reduces as an all-gather plus a reduce-scatter), as `step_time` counts them: what
        `lm.compiler.hlo.collective_traffic` reads from the compiled program (tests/test_gpu_compile.py)."""
        v, layer_passes = self._collective_volume(), self.passes * self.layers
        fsdp = self.parallelism.fsdp * self.parallelism.context > 1
        return {
            "fsdp_gather": fsdp * self.passes * (2 * self.layers * v["fsdp_gather"] + v["table_gather"]),
            "fsdp_scatter": fsdp * self.passes * (self.layers * v["fsdp_scatter"] + v["table_scatter"]),
            "tensor": (self.parallelism.tensor > 1) * 2 * layer_passes * v["tensor_reductions"] * v["tensor"],
            "expert": layer_passes * self._exchanges_per_layer() * self.expert_exchange_bytes(),
        }

    def _update_traffic(self) -> float:
        """Bytes the step moves through HBM outside its passes, on each device: the optimizer
        update reads the gradients and reads and writes the parameters and the optimizer state
        where the update runs (3 x the gradients' bytes, which are in that placement, + 2 x the
        state's); with several passes each adds its gradients into the float32 accumulator (a read
        and a write). On one H100 it was part of the gap between batch 8 and larger batches of
        `llama_1b` that the matmul model missed (PERFORMANCE.md, "On a real H100")."""
        state = self.state_bytes
        accumulation = 2 * state["grads"] * self.passes if self.passes > 1 else 0.0
        return 3 * state["grads"] + 2 * state["opt_state"] + accumulation

    def _stash_traffic(self) -> float:
        """Bytes a pipeline's stash moves per step on each device: every forward writes its chunk's
        stash entry (a select reads the slot first) and its backward reads it. With the update's,
        memory traffic the model counts apart from the fitted passes (`compute_terms`)."""
        lay, kept = self.parallelism, self._kept_bytes()
        if lay.stage == 1:
            return 0.0
        # Per forward (R x M of them): the chunk's input when the tick is recomputed, else what
        # the chunk's layers keep.
        entry = kept["full"] if self._recomputes_ticks else self.layers / lay.repeats * kept[lay.remat]
        return 3 * lay.microbatches * lay.repeats * entry * self.local_tokens

    def network_seconds(self) -> float:
        """The exposed time of the collectives that cross links (`NETWORK_TERMS`)."""
        return sum(self.step_time[k] for k in NETWORK_TERMS)

    def with_network(self, kernels_step_s: float, kernels_by_kind_s: dict) -> float:
        """A compiled step's time by the kernel model with its collectives' replaced by this
        layout's network terms (the kernel model times them as on one host's links): what
        `lm.plan --verify` ranks by and the step-time constants are fitted to."""
        return kernels_step_s - kernels_by_kind_s.get("collective", 0.0) + self.network_seconds()

    def tokens_per_s_per_gpu(self) -> float:
        return self.run.batch * self.run.seq_len / self.step_time["total"] / self.parallelism.gpus
