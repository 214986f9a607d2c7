"""Mixture of experts: the grouped path against a dense reference, capacity dropping by hand,
expert parallelism against one device, balancing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, small_config

from lm.model import moe

MOE = dict(model__num_experts=4, model__experts_per_token=2, model__expert_mlp_dim=64)


@pytest.fixture(scope="module")
def one_device():
    return run_steps(small_config({}, **MOE), jax.devices()[:1])


@pytest.mark.parametrize("mesh", [{"expert": 4, "data": 2}, {"expert": 2, "fsdp": 2, "tensor": 2}], ids=["expert4-data2", "expert2-fsdp2-tensor2"])
def test_expert_parallel_training_matches_one_device(one_device, mesh):
    losses, params = run_steps(small_config(mesh, **MOE))
    ref_losses, ref_params = one_device
    print(losses, ref_losses)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), params, ref_params)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_expert_parallel_pipeline_matches_one_device_accumulating_alike(schedule):
    """The balancing losses are taken per microbatch (as Megatron does), so the reference
    accumulates over as many microbatches as the pipeline runs."""
    aux = dict(MOE, model__router_aux_loss_coef=0.1, model__router_z_loss_coef=0.01)
    ref_losses, ref_params = run_steps(small_config({}, train__grad_accum=2, **aux), jax.devices()[:1])
    losses, params = run_steps(small_config({"expert": 2, "stage": 2, "data": 2}, pipeline__schedule=schedule, **aux))
    print(losses, ref_losses)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), params, ref_params)
