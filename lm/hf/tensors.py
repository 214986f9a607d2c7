"""Each Hugging Face checkpoint tensor of a family meshlm represents (`lm.hf.format`) and the
meshlm parameters it holds: a `Link` with the conversions both ways, per layer (and per expert
of a mixture of experts). No I/O here: `lm.hf.checkpoint` moves the tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from lm.hf.format import family_of
from lm.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Link:
    """One checkpoint tensor and the meshlm parameters it holds (several for GPT-2's fused q/k/v).

    `ours` are parameter paths ('blocks/attn/wq'); those under `blocks/` are stacked over layers
    and `theirs` then has an `{i}` for the layer. `to_ours(tensor)` gives one array per path, as
    one layer's slice; `to_theirs(*arrays)` inverts it."""

    ours: tuple[str, ...]
    theirs: str
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_theirs: Callable[..., np.ndarray]
    per_expert: bool = False  # ours are [layers, experts, ...]; theirs has a `{j}` for the expert too
    # Of a stack: the model's layer each of its entries holds (the `{i}` is the model's index).
    layer_ids: tuple[int, ...] = ()
    # A copy, in each of the layers `layer_ids`, of a parameter the model shares (DeepSeek's
    # multi-token prediction layers store the embedding and head again): written on export, the
    # model's own one read on import.
    copy: bool = False

    @property
    def stacked(self) -> bool:
        return self.ours[0].startswith(("blocks/", "dense_blocks/", "mtp/")) and not self.copy


def _same(path: str, name: str) -> Link:
    return Link((path,), name, lambda w: (w,), lambda x: x)


# A (out, in) torch Linear weight <-> meshlm's (in, *out) / (*in, out) layouts.
def _columns(*shape):
    return lambda w: (w.T.reshape(shape),), lambda x: x.reshape(shape[0], -1).T


def _rows(*shape):
    return lambda w: (w.T.reshape(shape),), lambda x: x.reshape(-1, shape[-1]).T


def links(cfg: ModelConfig) -> list[Link]:
    """Every checkpoint tensor of `cfg`'s family, each with the parameters it maps onto."""
    kind = family_of(cfg)
    d, h, k, v, vp = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.used_vocab, cfg.vocab_size

    def pad_rows(w):  # padding ids get zero rows; export drops them
        return np.pad(w, ((0, vp - w.shape[0]), (0, 0)))

    embedding = lambda name: Link(("embedding",), name, lambda w: (pad_rows(w),), lambda x: x[:v])  # noqa: E731
    head = Link(("head",), "lm_head.weight", lambda w: (pad_rows(w).T,), lambda x: x[:, :v].T)
    if kind == "gpt2":
        p = "transformer."
        layer = p + "h.{i}."
        # Conv1D stores (in, out): c_attn's columns are q, k, v one after another, each head-major.
        fused = Link(
            ("blocks/attn/wq", "blocks/attn/wk", "blocks/attn/wv"), layer + "attn.c_attn.weight",
            lambda w: tuple(x.reshape(d, h, k) for x in np.split(w, 3, axis=1)),
            lambda *qkv: np.concatenate([x.reshape(d, h * k) for x in qkv], axis=1),
        )
        fused_bias = Link(
            ("blocks/attn/bq", "blocks/attn/bk", "blocks/attn/bv"), layer + "attn.c_attn.bias",
            lambda b: tuple(x.reshape(h, k) for x in np.split(b, 3)),
            lambda *qkv: np.concatenate([x.reshape(-1) for x in qkv]),
        )
        out = [
            embedding(p + "wte.weight"),
            _same("pos_embedding", p + "wpe.weight"),
            _same("final_norm/scale", p + "ln_f.weight"),
            _same("final_norm/bias", p + "ln_f.bias"),
            _same("blocks/attn_norm/scale", layer + "ln_1.weight"),
            _same("blocks/attn_norm/bias", layer + "ln_1.bias"),
            _same("blocks/mlp_norm/scale", layer + "ln_2.weight"),
            _same("blocks/mlp_norm/bias", layer + "ln_2.bias"),
            fused,
            fused_bias,
            Link(("blocks/attn/wo",), layer + "attn.c_proj.weight", lambda w: (w.reshape(h, k, d),), lambda x: x.reshape(h * k, d)),
            _same("blocks/attn/bo", layer + "attn.c_proj.bias"),
            _same("blocks/mlp/w_in", layer + "mlp.c_fc.weight"),
            _same("blocks/mlp/b_in", layer + "mlp.c_fc.bias"),
            _same("blocks/mlp/w_out", layer + "mlp.c_proj.weight"),
            _same("blocks/mlp/b_out", layer + "mlp.c_proj.bias"),
        ]
        out = [dataclasses.replace(link, layer_ids=tuple(range(cfg.num_layers))) if link.stacked else link for link in out]
        return out if cfg.tie_embeddings else [*out, head]
    out = [embedding("model.embed_tokens.weight"), _same("final_norm/scale", "model.norm.weight")]
    if cfg.moe and cfg.dense_layers:  # a stack of the dense layers (DeepSeek's first, Qwen3-MoE's mlp_only_layers)
        out += _layer_links(dataclasses.replace(cfg, num_experts=0), kind, "dense_blocks/", cfg.dense_layer_ids)
    out += _layer_links(cfg, kind, "blocks/", cfg.sparse_layer_ids if cfg.moe else tuple(range(cfg.num_layers)))
    out = out if cfg.tie_embeddings else [*out, head]
    return [*out, *_mtp_links(cfg, kind, embedding, head)] if cfg.mtp_depth else out


def _mtp_links(cfg: ModelConfig, kind: str, embedding, head: Link) -> list[Link]:
    """DeepSeek-V3's multi-token prediction layers, numbered after the model's: a block like the
    last layer's, its norms and projection, and copies of the shared embedding and head."""
    ids, d = cfg.mtp_layer_ids, cfg.embed_dim
    layer = "model.layers.{i}."

    def link(ours, theirs, to_ours=lambda w: (w,), to_theirs=lambda x: x):
        return Link(("mtp/" + ours,), layer + theirs, to_ours, to_theirs, layer_ids=ids)

    shared_head = layer + "shared_head.head.weight"
    return [
        *_layer_links(cfg.mtp_block, kind, "mtp/block/", ids),
        link("enorm/scale", "enorm.weight"),
        link("hnorm/scale", "hnorm.weight"),
        link("eh_proj", "eh_proj.weight", *_columns(2 * d, d)),
        link("head_norm/scale", "shared_head.norm.weight"),
        dataclasses.replace(embedding(layer + "embed_tokens.weight"), layer_ids=ids, copy=True),
        dataclasses.replace(embedding(shared_head) if cfg.tie_embeddings else dataclasses.replace(head, theirs=shared_head), layer_ids=ids, copy=True),
    ]


def _layer_links(cfg: ModelConfig, kind: str, stack: str, layer_ids: tuple[int, ...]) -> list[Link]:
    """The Llama-like per-layer tensors of the model's layers `layer_ids`, held in that order by
    the stacked parameters under `stack`."""
    d, h, g, k = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    columns, rows = _columns, _rows
    layer = "model.layers.{i}."

    def link(ours, theirs, to_ours, to_theirs, per_expert=False):
        return Link((stack + ours,), theirs, to_ours, to_theirs, per_expert, layer_ids)

    same = lambda ours, theirs: link(ours, theirs, lambda w: (w,), lambda x: x)  # noqa: E731
    out = [
        same("attn_norm/scale", layer + "input_layernorm.weight"),
        same("mlp_norm/scale", layer + "post_attention_layernorm.weight"),
    ]
    if cfg.latent_attention:
        out += _latent_links(cfg, stack, layer_ids)
    else:
        out += [
            link("attn/wq", layer + "self_attn.q_proj.weight", *columns(d, h, k)),
            link("attn/wk", layer + "self_attn.k_proj.weight", *columns(d, g, k)),
            link("attn/wv", layer + "self_attn.v_proj.weight", *columns(d, g, k)),
            link("attn/wo", layer + "self_attn.o_proj.weight", *rows(h, k, d)),
        ]
    if not cfg.moe:
        out += [
            link("mlp/w_gate", layer + "mlp.gate_proj.weight", *columns(d, cfg.mlp_dim)),
            link("mlp/w_in", layer + "mlp.up_proj.weight", *columns(d, cfg.mlp_dim)),
            link("mlp/w_out", layer + "mlp.down_proj.weight", *rows(cfg.mlp_dim, d)),
        ]
    else:
        prefix, names = (layer + "block_sparse_moe.", ("w1", "w3", "w2")) if kind == "mixtral" else (layer + "mlp.", ("gate_proj", "up_proj", "down_proj"))
        expert = prefix + "experts.{j}.%s.weight"
        f = cfg.expert_width
        out += [
            link("mlp/router", prefix + "gate.weight", *columns(d, cfg.num_experts)),
            link("mlp/w_gate", expert % names[0], *columns(d, f), per_expert=True),
            link("mlp/w_in", expert % names[1], *columns(d, f), per_expert=True),
            link("mlp/w_out", expert % names[2], *rows(f, d), per_expert=True),
        ]
        if kind == "deepseek_v3":
            shared, width = prefix + "shared_experts.%s.weight", cfg.shared_experts * f
            out.append(same("mlp/router_bias", prefix + "gate.e_score_correction_bias"))
            if cfg.shared_experts:
                out += [
                    link("mlp/shared/w_gate", shared % "gate_proj", *columns(d, width)),
                    link("mlp/shared/w_in", shared % "up_proj", *columns(d, width)),
                    link("mlp/shared/w_out", shared % "down_proj", *rows(width, d)),
                ]
    if cfg.qk_norm:
        out += [same("attn/q_norm", layer + "self_attn.q_norm.weight"), same("attn/k_norm", layer + "self_attn.k_norm.weight")]
    if cfg.qkv_bias:
        for name, heads in (("q", h), ("k", g), ("v", g)):
            out.append(link(f"attn/b{name}", layer + f"self_attn.{name}_proj.bias", lambda b, n=heads: (b.reshape(n, k),), lambda x: x.reshape(-1)))
    return out


def _latent_links(cfg: ModelConfig, stack: str, layer_ids: tuple[int, ...]) -> list[Link]:
    """DeepSeek-V3's multi-head latent attention tensors of a layer. Their rotary rows are in
    interleaved pairs where `rope_interleave` says so: put in rotate-half order on import (evens
    first, then odds), back on export."""
    d, h, nope, rot, v, r = cfg.embed_dim, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    order = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2)]) if cfg.rope_interleave else np.arange(rot)
    back = np.argsort(order)
    attn = "model.layers.{i}.self_attn."

    def link(ours, theirs, to_ours, to_theirs):
        return Link(tuple(stack + "attn/" + o for o in ours), attn + theirs, to_ours, to_theirs, False, layer_ids)

    def query(rank):  # (h * (nope + rot), rank) -> (rank, h, nope + rot), each head's rotary part reordered
        def to_ours(w):
            q = w.T.reshape(rank, h, nope + rot)
            return (np.concatenate([q[..., :nope], q[..., nope:][..., order]], axis=-1),)

        def to_theirs(q):
            return np.concatenate([q[..., :nope], q[..., nope:][..., back]], axis=-1).reshape(rank, -1).T

        return to_ours, to_theirs

    def latent(w):  # (r + rot, d) -> the latent's (d, r) and the rotary key's (d, rot), reordered
        return w[:r].T, w[r:][order].T

    def key_value(w):  # (h * (nope + v), r) -> (r, h, nope), (r, h, v)
        kv = w.T.reshape(r, h, nope + v)
        return kv[..., :nope], kv[..., nope:]

    same = lambda ours, theirs: link((ours,), theirs, lambda w: (w,), lambda x: x)  # noqa: E731
    out = [
        link(("wkv_a", "wk_rope"), "kv_a_proj_with_mqa.weight", latent, lambda c, k: np.concatenate([c.T, k.T[back]])),
        same("kv_norm", "kv_a_layernorm.weight"),
        link(("wk_b", "wv_b"), "kv_b_proj.weight", key_value, lambda k, v: np.concatenate([k, v], axis=-1).reshape(r, -1).T),
        link(("wo",), "o_proj.weight", *_rows(h, v, d)),
    ]
    if cfg.q_lora_rank:
        out += [link(("wq_a",), "q_a_proj.weight", *_columns(d, cfg.q_lora_rank)), same("q_norm", "q_a_layernorm.weight"),
                link(("wq_b",), "q_b_proj.weight", *query(cfg.q_lora_rank))]
    else:
        out.append(link(("wq",), "q_proj.weight", *query(d)))
    return out


def tensor_name(link: Link, layer: int | tuple[int, int] | None) -> str:
    """The checkpoint name of `link`'s tensor of a layer, or of (layer, expert)."""
    if link.per_expert:
        return link.theirs.format(i=layer[0], j=layer[1])
    return link.theirs.format(i=layer) if link.layer_ids else link.theirs


def expected_shapes(link: Link, our_shapes: dict[str, tuple]) -> tuple:
    """The checkpoint tensor's shape implied by one layer's slices of `link.ours` (computed on
    zero-stride views: no memory)."""
    skip = 2 if link.per_expert else 1 if link.stacked else 0
    views = [np.broadcast_to(np.zeros((), np.float32), our_shapes[p][skip:]) for p in link.ours]
    return link.to_theirs(*views).shape
