"""What a model *is*: its architecture, and how its layers are run (remat, scan, attention
kernel). One source for the `model` group of the config schema (`lm.config`) and for the
Transformer (`lm.model.transformer`), so neither needs the other."""

from __future__ import annotations

import dataclasses

from sharding.schedules import SPLIT_BACKWARD, V_SHAPED


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture; these defaults are also the `model` group's in `lm.config`."""

    vocab_size: int  # rows of the embedding: the tokenizer's vocabulary padded (see `vocab_multiple`)
    max_len: int  # rows of the learned position table
    num_layers: int = 2
    embed_dim: int = 128
    num_heads: int = 4
    num_kv_heads: int = 4  # < num_heads: grouped-query attention
    head_dim: int = 32  # config: 0 means embed_dim // num_heads
    mlp_dim: int = 512
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    position: str = "rope"  # rope | learned
    mlp: str = "swiglu"  # swiglu | gelu
    use_bias: bool = False
    tie_embeddings: bool = False
    qkv_bias: bool = False  # biases on the q / k / v projections only (Qwen2); use_bias: everywhere
    rope_theta: float = 10_000.0
    # RoPE frequency scaling: none | linear (positions / factor) | llama3 (Llama 3.1's rule: low
    # frequencies / factor, high ones kept, a smooth ramp between, set by the other three).
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    # YaRN (`rope_scaling='yarn'`, with rope_factor and rope_original_max_len): the ramp's bounds
    # in turns over the original context, and the temperatures' multipliers (0: unset).
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    # Multi-head latent attention (DeepSeek-V2 / V3) when kv_lora_rank > 0: keys and values from
    # one compressed latent per token, queries through a rank-q_lora_rank path (0: full rank),
    # each head's query and key a non-rotary part and a rotary part shared by the heads (head_dim
    # and num_kv_heads unused). lm.model.latent_attention says how.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # The checkpoint's rotary features in interleaved pairs (DeepSeek's `rope_interleave`): meshlm
    # rotates halves, so conversion permutes the rotary weight rows (the maths is the same).
    rope_interleave: bool = False
    sliding_window: int = 0  # > 0: each query attends to its latest this many keys, itself included (Mistral)
    norm_eps: float = 1e-5
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    # A mixture of experts (0: a dense MLP): each token's MLP is `experts_per_token` of `num_experts`
    # SwiGLU experts of width `expert_mlp_dim` (0: mlp_dim), chosen by a float32 router, plus
    # `shared_experts` always-on ones (DeepSeek / Qwen2-MoE), in the layers `moe_layers` names
    # (MOE_LAYERS: 'all', 'from:K' as DeepSeek-V3, 'every:N', 'dense:i,j'). lm.model.moe says how.
    num_experts: int = 0
    experts_per_token: int = 2
    expert_mlp_dim: int = 0
    shared_experts: int = 0
    moe_layers: str = "all"
    router_renormalize: bool = True  # the selected experts' weights sum to 1 (Mixtral; Qwen3's norm_topk_prob)
    # DeepSeek-V3's router: scores sigmoid (not softmax); experts chosen within the
    # `router_groups_chosen` best of `router_groups` groups (a group scored by its best two); the
    # chosen weights times `router_scale` (routed_scaling_factor).
    router_score: str = "softmax"
    router_groups: int = 1
    router_groups_chosen: int = 1
    router_scale: float = 1.0
    # 0: dropless (tokens sorted by expert, one grouped matmul); > 0: each expert takes at most
    # factor x its even share of a device's tokens, the rest dropped (counted).
    expert_capacity_factor: float = 0.0
    router_aux_loss_coef: float = 0.01  # Switch / Mixtral load-balancing loss
    # Over the layer's tokens at once (`batch`), or DeepSeek-V3's per `sequence`, averaged (lm.model.moe.balancing_losses).
    router_aux_loss_per: str = "batch"
    router_z_loss_coef: float = 0.0  # ST-MoE's router z-loss
    # > 0: DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the selection scores,
    # moved by this much each step toward an even load (a parameter no gradient reaches).
    expert_bias_rate: float = 0.0
    # DeepSeek-V3's multi-token prediction (lm.model.multi_token): this many modules after the
    # last layer, module d predicting the token d + 2 places ahead; their mean loss times
    # `mtp_loss_weight` joins the training loss (weight 0: kept, imported and exported, but not run).
    # Training only: generation and evaluation ignore them.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.1
    # The dropless experts' grouped GEMM (lm.model.grouped_gemm): auto (Pallas kernels on GPUs
    # where dtype and widths allow, else XLA's ragged_dot) | xla | pallas.
    grouped_gemm: str = "auto"
    # Under expert parallelism, dropless: each device's tokens dispatched in this many chunks, one
    # chunk's exchange free to overlap another's expert GEMMs (Megatron's and DeepSeek's way).
    expert_dispatch_chunks: int = 1
    # How the layers run (the same maths): remat (sharding.remat.REMAT: what a layer keeps); scan_layers
    # False unrolls the layer loop (faster on CPU, slower to compile); attention auto (cudnn on
    # GPU where it applies, einsum on CPU) | cudnn | xla | einsum.
    remat: str = "none"
    scan_layers: bool = True
    # > 1: the head and its loss run over this many pieces of each sequence, each piece's
    # gradients made in its forward (lm.model.cross_entropy.chunked_cross_entropy): the float32
    # [batch, length, vocabulary] logits never exist whole. The same loss and gradients.
    loss_chunks: int = 1
    attention: str = "auto"
    real_vocab_size: int = 0  # ids from here to vocab_size are padding, never predicted; 0: none
    # LoRA adapters (lm.model.lora), from the `lora` group: rank 0 is none.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = ()
    lora_dropout: float = 0.0

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def latent_attention(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key width."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.latent_attention else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.latent_attention else self.head_dim

    @property
    def q_width(self) -> int:
        """A token's queries, all heads."""
        return self.num_heads * self.qk_head_dim

    @property
    def kv_width(self) -> float:
        """The mean of a token's keys' and values' widths as attention takes them (grouped-query
        heads; latent attention's expanded per head): 2 x this is what keys and values hold."""
        if self.latent_attention:
            return self.num_heads * (self.qk_head_dim + self.v_head_dim) / 2
        return self.num_kv_heads * self.head_dim

    @property
    def kv_gathered_width(self) -> int:
        """What context parallelism gathers per token: keys and values, or latent attention's
        latent and rotary key (expanded after the gather)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.latent_attention else 2 * self.num_kv_heads * self.head_dim

    @property
    def expert_width(self) -> int:
        return self.expert_mlp_dim or self.mlp_dim

    @property
    def sparse_layer_ids(self) -> tuple[int, ...]:
        """The layers (model indices) that are a mixture of experts (none in a dense model)."""
        return sparse_layer_ids(self.moe_layers, self.num_layers) if self.moe else ()

    @property
    def mtp_layer_ids(self) -> tuple[int, ...]:
        """Multi-token prediction's modules numbered after the model's layers (as DeepSeek's
        checkpoints store them)."""
        return tuple(range(self.num_layers, self.num_layers + self.mtp_depth))

    @property
    def mtp_trained(self) -> int:
        """How many multi-token prediction modules training runs (none at weight 0)."""
        return self.mtp_depth if self.mtp_loss_weight else 0

    @property
    def mtp_sparse(self) -> bool:
        """Whether multi-token prediction's blocks are a mixture of experts: as the last layer is."""
        return self.moe and self.num_layers - 1 in self.sparse_layer_ids

    @property
    def mtp_block(self) -> ModelConfig:
        """Multi-token prediction's block: as the last layer is (a mixture of experts in DeepSeek-V3)."""
        return self if self.mtp_sparse or not self.moe else dataclasses.replace(self, num_experts=0)

    @property
    def routed_layer_ids(self) -> tuple[int, ...]:
        """Every layer with a router, in the order the routing statistics come (`moe.split_stats`)."""
        return self.sparse_layer_ids + (self.mtp_layer_ids if self.mtp_sparse else ())

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        sparse = set(self.sparse_layer_ids)
        return tuple(i for i in range(self.num_layers) if i not in sparse)

    @property
    def dense_prefix(self) -> int:
        """How many dense layers lead a mixture of experts whose other layers are all sparse
        (DeepSeek's first K dense, `moe_layers='from:K'`); 0 for any other pattern."""
        return dense_prefix(self.sparse_layer_ids, self.num_layers) if self.moe else 0

    @property
    def pipelined_layers(self) -> int:
        """How many layers a pipeline splits over its stages (the leading dense ones run with the embedding)."""
        return self.num_layers - self.dense_prefix

    @property
    def dense_layers(self) -> int:
        """How many layers have a dense MLP: all of a dense model's."""
        return len(self.dense_layer_ids)

    @property
    def sparse_layers(self) -> int:
        """How many layers are a mixture of experts."""
        return self.num_layers - self.dense_layers

    @property
    def used_vocab(self) -> int:
        """How many token ids are real (the rest of the `vocab_size` rows are padding)."""
        return self.real_vocab_size or self.vocab_size

    @classmethod
    def from_config(cls, c, vocab_size: int) -> ModelConfig:
        """From the `model` group of a meshlm config and the tokenizer's vocabulary size."""
        m = c.model
        real = m.vocab_size or vocab_size
        fields = {f.name for f in dataclasses.fields(cls)} - {"vocab_size", "max_len", "head_dim", "real_vocab_size", *LORA_FIELDS}
        lora = c.get("lora") or {"rank": 0}
        return cls(
            vocab_size=-(-real // m.vocab_multiple) * m.vocab_multiple,
            real_vocab_size=real,
            max_len=m.max_positions or c.train.seq_len,
            head_dim=m.head_dim or m.embed_dim // m.num_heads,
            **{k: m[k] for k in fields},
            **({"lora_rank": lora["rank"], "lora_alpha": lora["alpha"], "lora_targets": parse_targets(lora["targets"]),
                "lora_dropout": lora["dropout"]} if lora["rank"] else {}),
        )


LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")
# lm.model.lora: attention's (latent attention's q_a .. kv_b), the MLP's, the experts' matmuls
LORA_TARGETS = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b", "gate", "up", "down", "experts")


def parse_targets(text: str) -> tuple[str, ...]:
    """`lora.targets` ('q,k,v,o' or 'all') as a tuple of LORA_TARGETS; ValueError naming a wrong one."""
    names = LORA_TARGETS if text.strip() == "all" else tuple(t.strip() for t in text.split(",") if t.strip())
    wrong = [t for t in names if t not in LORA_TARGETS]
    if wrong or not names:
        raise ValueError(f"{', '.join(wrong) or 'nothing'} (the model's matmuls: {', '.join(LORA_TARGETS)}, or 'all')")
    return names


MOE_LAYERS = ("'all', 'from:K' (the first K layers dense), 'every:N' (every N-th layer sparse: layers N-1, 2N-1, ..., as "
              "Qwen3-MoE's decoder_sparse_step and Llama 4's interleave step) or 'dense:i,j,..' (those layers dense)")


def sparse_layer_ids(spec: str, num_layers: int) -> tuple[int, ...]:
    """The sparse layers `model.moe_layers` names among `num_layers` (MOE_LAYERS); ValueError
    where it names none or is not of that form."""
    kind, _, arg = spec.partition(":")
    if spec == "all":
        return tuple(range(num_layers))
    numbers = [int(x) for x in arg.split(",")] if arg and all(x.strip().isdigit() for x in arg.split(",")) else None
    if kind == "from" and numbers and len(numbers) == 1:
        sparse = tuple(range(numbers[0], num_layers))
    elif kind == "every" and numbers and len(numbers) == 1 and numbers[0] > 0:
        sparse = tuple(i for i in range(num_layers) if (i + 1) % numbers[0] == 0)
    elif kind == "dense" and numbers and all(i < num_layers for i in numbers):
        sparse = tuple(i for i in range(num_layers) if i not in set(numbers))
    else:
        raise ValueError(f"model.moe_layers={spec!r} is not {MOE_LAYERS}")
    if not sparse:
        raise ValueError(f"model.moe_layers={spec!r} leaves none of the {num_layers} layers a mixture of experts")
    return sparse


def dense_prefix(sparse: tuple[int, ...], num_layers: int) -> int:
    """K where the layers not in `sparse` are exactly the first K (0 < K < num_layers), else 0."""
    k = num_layers - len(sparse)
    return k if 0 < k < num_layers and tuple(sparse) == tuple(range(k, num_layers)) else 0


def layer_period(sparse: tuple[int, ...], num_layers: int) -> int:
    """The length of the shortest run of dense and sparse layers the model repeats whole
    (`num_layers` when it repeats none shorter): 'every:2' -> 2, 'from:3' -> num_layers."""
    return shortest_period([i in set(sparse) for i in range(num_layers)])


def shortest_period(kinds: list) -> int:
    """The length of the shortest prefix of `kinds` that repeats whole to make it."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))


def moe_problem(m, expert_ways: int, stages: int = 1, repeats: int = 1, schedule: str = "gpipe") -> str | None:
    """What is wrong with the `model` group's mixture of experts on `expert_ways` expert devices
    and `stages` pipeline stages (each `repeats` chunks, run by `schedule`), in one line (None:
    nothing)."""
    if not m.num_experts:
        if expert_ways > 1:
            return f"mesh.expert={expert_ways} splits a mixture of experts' experts, but the model is dense (model.num_experts=0); set mesh.expert=1"
        if m.expert_bias_rate or m.shared_experts:
            return "model.expert_bias_rate and model.shared_experts apply to a mixture of experts; set model.num_experts too"
        return None
    if not 1 <= m.experts_per_token <= m.num_experts:
        return f"model.experts_per_token={m.experts_per_token} must be between 1 and model.num_experts={m.num_experts}"
    if expert_ways > 0 and m.num_experts % expert_ways:
        return f"model.num_experts={m.num_experts} is not divisible by mesh.expert={expert_ways}; each expert device holds an equal share"
    try:
        sparse = sparse_layer_ids(m.moe_layers, m.num_layers)
    except ValueError as e:
        return str(e)
    v_shaped = schedule in V_SHAPED
    chunks, prefix = max(1, stages * repeats) * (2 if v_shaped else 1), dense_prefix(sparse, m.num_layers)  # ZB-V, DualPipeV: two a stage
    if prefix and stages > 1 and len(sparse) % chunks:
        return (f"model.moe_layers={m.moe_layers!r}: under a pipeline the {prefix} leading dense layers run with the embedding and the "
                f"{len(sparse)} sparse ones are split into {f'2 x mesh.stage ({schedule})' if v_shaped else 'mesh.stage x pipeline.repeats'} = {chunks} equal chunks, which they are not; "
                "choose a stage count that divides them")
    chunk = m.num_layers // chunks
    if not prefix and len(sparse) < m.num_layers and stages > 1 and (chunk % layer_period(sparse, m.num_layers) or schedule in SPLIT_BACKWARD):
        return (f"model.moe_layers={m.moe_layers!r} mixes dense and sparse layers, which a pipeline (mesh.stage={stages}) stages alike only "
                f"where they lead ('from:K': they run with the embedding) or where each chunk of {chunk} layers holds whole repeats of "
                f"the pattern ({layer_period(sparse, m.num_layers)} layers), and not under pipeline.schedule={' / '.join(SPLIT_BACKWARD)}; "
                "use mesh.stage=1, or moe_layers='from:K', 'all' or 'every:N'")
    if m.router_groups > 1 and (m.num_experts % m.router_groups or not m.router_groups_chosen <= m.router_groups
                                or m.experts_per_token > m.router_groups_chosen * (m.num_experts // m.router_groups)):
        return (f"model.router_groups={m.router_groups} must divide model.num_experts={m.num_experts}, with model.router_groups_chosen="
                f"{m.router_groups_chosen} of them (at most router_groups) holding at least model.experts_per_token={m.experts_per_token} experts")
    if m.mlp != "swiglu" or m.use_bias:
        return "a mixture of experts' experts are SwiGLU without biases: set model.mlp=swiglu and model.use_bias=False"
    return None


def config_defaults() -> dict:
    """The `model` group's keys and defaults, from `ModelConfig` (one source). Zero means derived:
    `head_dim` embed_dim // num_heads, `vocab_size` the tokenizer's, `max_positions` (rows of
    the learned position table) train.seq_len."""
    skip = {"vocab_size", "max_len", "real_vocab_size", *LORA_FIELDS}
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name not in skip}
    return {**defaults, "head_dim": 0, "vocab_multiple": 128, "vocab_size": 0, "max_positions": 0}
