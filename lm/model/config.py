"""What a model *is*: its architecture, and how its layers are run (remat, scan, attention
kernel). One source for the `model` group of the config schema (`lm.config`) and for the
Transformer (`lm.model.transformer`), so neither needs the other."""

from __future__ import annotations

import dataclasses


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
    sliding_window: int = 0  # > 0: each query attends to its latest this many keys, itself included (Mistral)
    norm_eps: float = 1e-5
    # How the layers run (the same maths): remat (sharding.remat.REMAT: what a layer keeps); scan_layers
    # False unrolls the layer loop (faster on CPU, slower to compile); attention auto (cudnn on
    # GPU where it applies, einsum on CPU) | cudnn | xla | einsum.
    remat: str = "none"
    scan_layers: bool = True
    attention: str = "auto"
    real_vocab_size: int = 0  # ids from here to vocab_size are padding, never predicted; 0: none

    @property
    def used_vocab(self) -> int:
        """How many token ids are real (the rest of the `vocab_size` rows are padding)."""
        return self.real_vocab_size or self.vocab_size

    @classmethod
    def from_config(cls, c, vocab_size: int) -> ModelConfig:
        """From the `model` group of a meshlm config and the tokenizer's vocabulary size."""
        m = c.model
        real = m.vocab_size or vocab_size
        fields = {f.name for f in dataclasses.fields(cls)} - {"vocab_size", "max_len", "head_dim", "real_vocab_size"}
        return cls(
            vocab_size=-(-real // m.vocab_multiple) * m.vocab_multiple,
            real_vocab_size=real,
            max_len=m.max_positions or c.train.seq_len,
            head_dim=m.head_dim or m.embed_dim // m.num_heads,
            **{k: m[k] for k in fields},
        )


def config_defaults() -> dict:
    """The `model` group's keys and defaults, from `ModelConfig` (one source). Zero means derived:
    `head_dim` embed_dim // num_heads, `vocab_size` the tokenizer's, `max_positions` (rows of
    the learned position table) train.seq_len."""
    skip = {"vocab_size", "max_len", "real_vocab_size"}
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name not in skip}
    return {**defaults, "head_dim": 0, "vocab_multiple": 128, "vocab_size": 0, "max_positions": 0}
