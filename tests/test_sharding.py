import re
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import sharding
from sharding import (
    DEFAULT_RULES,
    MeshConfig,
    ShardingError,
    logical_to_spec,
    make_mesh,
)


def test_mesh_fills_minus_one_and_orders_axes():
    mesh = make_mesh(MeshConfig(data=-1, tensor=2))
    assert mesh.axis_names == ("data", "stage", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 4, "stage": 1, "fsdp": 1, "tensor": 2}


@pytest.mark.parametrize(
    "cfg, message",
    [
        (MeshConfig(data=16), "needs 16 devices but 8 are available"),
        (MeshConfig(data=-1, fsdp=-1), "at most one mesh axis may be -1"),
        (MeshConfig(data=2, fsdp=2), "uses 4 of 8 devices"),
        (MeshConfig(data=0), "must be positive"),
    ],
)
def test_mesh_errors(cfg, message):
    with pytest.raises(ShardingError, match=message):
        make_mesh(cfg)


def test_default_rules():
    assert logical_to_spec(("batch", "length", "act_embed")) == P(("data", "fsdp"), None, None)
    assert logical_to_spec(("layers", "embed", "mlp")) == P(None, "fsdp", "tensor")


def test_unknown_logical_name_is_an_error():
    with pytest.raises(ShardingError, match=r"w \(shape \(4, 8\).*logical axis 'hidden' has no rule"):
        logical_to_spec(("embed", "hidden"), name="w", shape=(4, 8))


def test_indivisible_dimension_names_parameter_dimension_and_axes():
    mesh = make_mesh(MeshConfig(data=1, tensor=8))
    with pytest.raises(ShardingError) as e:
        sharding.named_sharding(mesh, ("embed", "mlp"), shape=(16, 12), name="blocks/mlp/w_in")
    assert re.search(r"blocks/mlp/w_in .*dimension 1 \('mlp', size 12\).*\('tensor',\) of total size 8", str(e.value))


def test_rule_naming_a_missing_mesh_axis_and_reused_axis():
    mesh = make_mesh(MeshConfig())
    with pytest.raises(ShardingError, match="names a mesh axis that does not exist"):
        sharding.named_sharding(mesh, ("embed",), (("embed", "model"),), shape=(8,))
    with pytest.raises(ShardingError, match="mesh axis 'tensor' is used by both 'mlp' and 'heads'"):
        logical_to_spec(("mlp", "heads"), DEFAULT_RULES)


def test_model_state_shardings_follow_rules():
    from lm.model import ModelConfig, Transformer

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    abstract = nnx.eval_shape(lambda: Transformer(ModelConfig(vocab_size=256, max_len=16), rngs=nnx.Rngs(0)))
    state = nnx.state(abstract)
    shardings = sharding.tree_shardings(nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.get_partition_spec(state)), mesh)
    assert shardings["blocks"]["attn"]["wq"].spec == P(None, "fsdp", "tensor", None)
    assert shardings["embedding"].spec == P("tensor", "fsdp")


def test_activation_constraint_is_noop_outside_and_applied_inside():
    x = jax.numpy.ones((8, 4))
    assert sharding.constrain(x, ("batch", "act_embed")) is x
    mesh = make_mesh(MeshConfig(data=8))
    with sharding.activate(mesh):
        y = jax.jit(lambda a: sharding.constrain(a * 2, ("batch", "act_embed")))(x)
    assert y.sharding.spec == P(("data", "fsdp"), None) or y.sharding.is_equivalent_to(
        sharding.named_sharding(mesh, ("batch", "act_embed")), 2
    )


def test_sharding_never_imports_lm():
    for path in (Path(sharding.__file__).parent).glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+lm\b", path.read_text(), re.M), path
