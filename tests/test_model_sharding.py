"""The model's parameters and steps under the sharding rules (`sharding` applied to `lm`)."""


import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import sharding
from sharding import (
    DEFAULT_RULES,
    MeshConfig,
    ShardingError,
    make_mesh,
)


def test_model_state_shardings_follow_rules():
    from lm.model.config import ModelConfig
    from lm.model.transformer import Transformer

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    abstract = nnx.eval_shape(lambda: Transformer(ModelConfig(vocab_size=256, max_len=16), rngs=nnx.Rngs(0)))
    state = nnx.state(abstract)
    shardings = sharding.tree_shardings(nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.get_partition_spec(state)), mesh)
    assert shardings["blocks"]["attn"]["wq"].spec == P("stage", ("context", "fsdp"), "tensor", None)
    assert shardings["embedding"].spec == P(("stage", "tensor"), ("context", "fsdp"))


def test_train_step_cannot_be_traced_without_its_rules():
    program = _setup(mesh__data=1, mesh__fsdp=4, mesh__tensor=2, sharding__sequence_parallel=True)
    batch = jax.ShapeDtypeStruct((16, 129), np.int32, sharding=program.batch_sharding)
    state = program.abstract_sharded_state()
    bound = program.train_step.lower(state, batch).as_text()  # no context set by this caller
    assert bound.count("sharding_constraint") >= 2 * 4 * program.model_cfg.num_layers  # residual, norm outputs, q/k/v, ...
    unbound = jax.jit(program._train_step).lower(state, batch).as_text()
    assert "sharding_constraint" not in unbound  # the same function jitted without binding loses them all


def _setup(**overrides):
    from conftest import recipe

    from lm.program.steps import setup

    c = recipe("tiny", model__num_layers=2, model__embed_dim=64, model__mlp_dim=128, **overrides)
    return setup(c, 256)


def test_config_rules_are_validated_naming_parameter_shape_logical_and_mesh_axes():
    mesh = r"mesh data=1 stage=1 context=1 expert=1 fsdp=8 tensor=1"
    with pytest.raises(ShardingError, match=rf"blocks/attn/wk \(shape \(2, 64, 2, 16\), logical axes \('layers', 'embed', 'kv_heads', 'head_dim'\), {mesh}\): rule 'embed' -> 'model' names a mesh axis that does not exist"):
        _setup(mesh__data=1, mesh__fsdp=8, sharding__rules="(('embed', 'model'),)")
    with pytest.raises(ShardingError, match=r"rule \('experts', 'moe'\) names mesh axis 'moe', which does not exist"):
        _setup(sharding__rules="(('experts', 'moe'),)")  # no parameter uses it: still an error
    with pytest.raises(ShardingError, match=rf"blocks/mlp/w_gate \(shape \(2, 64, 128\), logical axes \('layers', 'embed', 'mlp'\), {mesh}\): mesh axis 'fsdp' is used by both 'embed' and 'mlp'"):
        _setup(mesh__data=1, mesh__fsdp=8, sharding__rules="(('mlp', 'fsdp'),)")
    with pytest.raises(ShardingError, match=r"blocks/attn/wk \(shape \(2, 64, 2, 16\), .*mesh data=1 stage=1 context=1 expert=1 fsdp=1 tensor=8\): dimension 2 \('kv_heads', size 2\) is not divisible by mesh axes \('tensor',\) of total size 8"):
        _setup(mesh__data=1, mesh__tensor=8)


def test_a_logical_name_without_a_rule_names_the_parameter():
    from lm.model.config import ModelConfig
    from lm.model.transformer import Transformer

    state = nnx.state(nnx.eval_shape(lambda: Transformer(ModelConfig(vocab_size=256, max_len=16), rngs=nnx.Rngs(0))))
    rules = [r for r in DEFAULT_RULES if r[0] != "mlp"]
    with pytest.raises(ShardingError, match=r"blocks/mlp/w_gate \(shape \(2, 128, 512\), logical axes \('layers', 'embed', 'mlp'\), mesh data=8 stage=1 context=1 expert=1 fsdp=1 tensor=1\): logical axis 'mlp' has no rule"):
        sharding.tree_shardings(nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.get_partition_spec(state)), make_mesh(MeshConfig()), rules)


def test_sequence_parallelism_needs_the_sequence_to_divide():
    from lm.config import UserError

    with pytest.raises(UserError, match=r"mesh.tensor=8, which does not divide train.seq_len=12"):
        _setup(mesh__data=1, mesh__tensor=8, model__num_heads=8, model__num_kv_heads=8, train__seq_len=12, sharding__sequence_parallel=True)
