"""The `sharding` package on a model of its own (not from `lm`): annotate, mesh, rules, train."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import sharding


class TwoLayerMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(64, 32, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x_bd):
        h_bf = sharding.constrain(jax.nn.gelu(self.up(x_bd)), ("batch", "mlp"))
        return self.down(h_bf)


def train_one_step(mesh):
    model = sharding.create_sharded(lambda: TwoLayerMlp(nnx.Rngs(0)), mesh)
    graphdef, params = nnx.split(model)
    placement = jax.tree.map(lambda a: a.sharding, params)  # as the rules laid them out
    tx = optax.adam(1e-2)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(16, 32)).astype(np.float32), sharding.named_sharding(mesh, ("batch", None)))
    y = jax.device_put(rng.normal(size=(16, 32)).astype(np.float32), sharding.named_sharding(mesh, ("batch", None)))

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), placement), opt_state, loss

    # The mesh and rules bound into the jitted step: its constraints apply wherever it is traced.
    params, _, loss = sharding.jit(step, mesh)(params, tx.init(params), x, y)
    return params, float(loss)


def test_a_foreign_nnx_model_shards_by_the_rules_and_trains_like_one_device():
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    params, loss = train_one_step(mesh)
    # `embed` is split over context x fsdp; context has size 1 here, which XLA leaves out
    assert params["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert params["down"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert params["up"]["bias"].sharding.spec == P(None)  # not annotated: replicated
    assert params["up"]["kernel"].addressable_shards[0].data.shape == (16, 32)

    ref_params, ref_loss = train_one_step(sharding.make_mesh(sharding.MeshConfig(data=1), jax.devices()[:1]))
    assert loss == np.float32(ref_loss) or abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, ref_params)
