"""`sharding` on its own: meshes, logical-axis rules, constraints, resharding, reports (no `lm`)."""

import re

import jax
import numpy as np
import pytest
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
    assert mesh.axis_names == ("data", "stage", "context", "expert", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 4, "stage": 1, "context": 1, "expert": 1, "fsdp": 1, "tensor": 2}


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
    assert logical_to_spec(("batch", "length", "act_embed")) == P(("data", "expert", "fsdp"), "context", None)
    assert logical_to_spec(("batch", "kv_length", "kv_heads")) == P(("data", "expert", "fsdp"), None, "tensor")
    assert logical_to_spec(("experts", "embed", "mlp")) == P("expert", ("context", "fsdp"), "tensor")
    assert logical_to_spec(("layers", "embed", "mlp")) == P("stage", ("context", "fsdp"), "tensor")


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


def test_activation_constraint_is_noop_outside_and_applied_inside():
    x = jax.numpy.ones((8, 4))
    assert sharding.constrain(x, ("batch", "act_embed")) is x
    mesh = make_mesh(MeshConfig(data=8))
    with sharding.activate(mesh):
        y = jax.jit(lambda a: sharding.constrain(a * 2, ("batch", "act_embed")))(x)
    assert y.sharding.spec == P(("data", "fsdp"), None) or y.sharding.is_equivalent_to(
        sharding.named_sharding(mesh, ("batch", "act_embed")), 2
    )


def test_move_reshards_one_mesh_axis_at_a_time(capfd):
    """The embedding gradient's rows, from the sequence split over context x tensor (sequence
    parallelism) and the batch over data, to `embed` over context: the tensor split gathered, then
    context moved on its own; the values unchanged, and XLA replicates nothing whole."""
    source, target = P("data", ("context", "tensor"), None), P("data", None, "context")
    steps = sharding.constraints.resharding_steps(source, target)
    assert steps == [P("data", "context", None), P("data", None, "context")]
    assert sharding.constraints.resharding_steps(P(("data", "fsdp"), "context"), P("data", ("context", "fsdp"))) == [
        P(("data", "fsdp"), "context"), P("data", ("context", "fsdp"))]  # fsdp moves after context, as the target orders them
    assert sharding.constraints.resharding_steps(P("data", None), P("data", None)) == [P("data", None)]
    mesh = make_mesh(MeshConfig(data=2, context=2, tensor=2))
    rules = sharding.merge_rules(sharding.DEFAULT_RULES, sharding.SEQUENCE_PARALLEL_RULES)
    x = jax.numpy.arange(8 * 16 * 8, dtype=np.float32).reshape(8, 16, 8)
    rows = sharding.named_sharding(mesh, ("batch", "norm_length", None), rules)
    with sharding.activate(mesh, rules):
        step = jax.jit(lambda a: sharding.move(a, ("batch", "norm_length", None), ("replica_batch", None, "embed")) * 2, in_shardings=rows)
        capfd.readouterr()
        y = step(x)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
    assert y.sharding.is_equivalent_to(sharding.named_sharding(mesh, ("replica_batch", None, "embed"), rules), 3)
    with sharding.activate(mesh, rules):  # the detector: asked in one constraint, XLA replicates it
        jax.jit(lambda a: sharding.constrain(a, ("replica_batch", None, "embed")) * 2, in_shardings=rows)(x)
    assert "Involuntary full rematerialization" in capfd.readouterr().err


def test_a_bound_jit_keeps_its_rules_wherever_it_is_traced():
    x = jax.numpy.ones((8, 4))
    mesh = make_mesh(MeshConfig(data=8))
    double = lambda a: sharding.constrain(a * 2, ("batch", "act_embed"))  # noqa: E731
    bound = sharding.jit(double, mesh)
    assert "sharding_constraint" in bound.lower(x).as_text()  # traced with no `activate` around it
    assert bound(x).sharding.is_equivalent_to(sharding.named_sharding(mesh, ("batch", "act_embed")), 2)
    assert "sharding_constraint" not in jax.jit(double).lower(x).as_text()  # the detector: unbound, nothing applies


def test_hosts_take_the_outermost_axes_first():
    from sharding.mesh import split_over_granules

    assert split_over_granules((2, 1, 2, 2), 2) == ((1, 1, 2, 2), (2, 1, 1, 1))
    assert split_over_granules((2, 1, 4, 1), 4) == ((1, 1, 2, 1), (2, 1, 2, 1))
    assert split_over_granules((1, 1, 8, 2), 1) == ((1, 1, 8, 2), (1, 1, 1, 1))
    with pytest.raises(ShardingError, match="cannot be split over 4 hosts"):
        split_over_granules((3, 1, 1, 2), 4)


def test_rule_overrides_replace_defaults_and_sequence_parallelism_splits_norm_length():
    rules = sharding.merge_rules(DEFAULT_RULES, [("embed", None), ("experts", ["data"])], sharding.SEQUENCE_PARALLEL_RULES)
    table = dict(rules)
    assert table["embed"] is None and table["experts"] == ("data",) and table["norm_length"] == ("context", "tensor")
    assert [name for name, _ in rules][: len(DEFAULT_RULES)] == [name for name, _ in DEFAULT_RULES]
    with pytest.raises(ShardingError, match=r"rule 'embed' is not \(logical_name, mesh_axes\)"):
        sharding.check_rules(["embed"])


def test_report_counts_bytes_per_device_from_shardings():
    from sharding import report

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    tree = {
        "w": jax.ShapeDtypeStruct((64, 32), jax.numpy.float32, sharding=sharding.named_sharding(mesh, ("embed", "mlp"))),
        "b": jax.ShapeDtypeStruct((32,), jax.numpy.bfloat16, sharding=sharding.named_sharding(mesh, (None,))),
    }
    rows = {r.path: r for r in report.rows(tree, {"w": ("embed", "mlp"), "b": (None,)})}
    assert rows["w"].device_shape == (32, 16) and rows["w"].device_bytes == 32 * 16 * 4 and rows["w"].total_bytes == 64 * 32 * 4
    assert rows["b"].device_shape == (32,) and rows["b"].device_bytes == 64
    assert report.device_bytes(tree) == 32 * 16 * 4 + 64
    text = report.table(list(rows.values()))
    assert "(embed, mlp)" in text and "(context+fsdp, tensor)" in text and "2.00 KiB" in text


def test_constrain_inside_a_shard_map_manual_over_one_axis():
    """Inside a `shard_map` manual over `stage` (the per-stage pipeline), logical constraints
    place the other axes and leave out the manual one (`vocab` maps to stage x tensor)."""
    mesh = make_mesh(MeshConfig(data=1, stage=2, fsdp=2, tensor=2))

    def body(x_sbv):  # one stage's [1, batch, vocab]
        assert sharding.manual_axes() == {"stage"}
        return sharding.constrain(x_sbv[0] * 2, ("batch", "vocab"))[None]

    x = np.arange(2 * 8 * 16, dtype=np.float32).reshape(2, 8, 16)
    with sharding.activate(mesh):
        run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"), axis_names={"stage"}))
        y = run(x)
    assert sharding.manual_axes() == set()
    np.testing.assert_array_equal(np.asarray(y), 2 * x)
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("stage", "fsdp", "tensor")), y.ndim)
