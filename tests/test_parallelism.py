"""Data, FSDP, tensor and sequence parallelism: same losses and parameters as one device."""

import os
import re

import jax
import numpy as np
import pytest
from conftest import VOCAB, run_steps, small_config

import sharding
from lm.hlo import collective_shapes
from lm.program import setup
from sharding import report


@pytest.fixture(scope="module")
def one_device():
    return run_steps(small_config({}), jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh, sequence_parallel",
    [
        ({"data": 8}, False),
        ({"fsdp": 8}, False),
        ({"data": 2, "tensor": 4}, False),
        ({"data": 2, "fsdp": 2, "tensor": 2}, False),
        ({"fsdp": 4, "tensor": 2}, True),
    ],
    ids=["data8", "fsdp8", "data2-tensor4", "data2-fsdp2-tensor2", "fsdp4-tensor2-sp"],
)
def test_sharded_training_matches_one_device(one_device, mesh, sequence_parallel):
    losses, params = run_steps(small_config(mesh, sharding__sequence_parallel=sequence_parallel))
    ref_losses, ref_params = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] != losses[0]  # the parameters did move
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), params, ref_params)


def test_fsdp_holds_an_eighth_of_parameters_and_optimizer_state_per_device():
    trainer = setup(small_config({"fsdp": 8}), VOCAB)
    state = trainer.init_state(0)
    held = {"params": state.params, "opt_state": state.opt_state}
    total = report.total_bytes(held)
    for device in trainer.mesh.devices.flat:
        assert report.addressable_bytes(held, device) <= total / 8 * 1.01
    # and the shards add up to at least the whole: nothing was dropped from the count
    assert sum(report.addressable_bytes(held, d) for d in trainer.mesh.devices.flat) >= total


def compiled_hlo(c) -> str:
    trainer = setup(c, VOCAB)
    batch = jax.ShapeDtypeStruct((c.train.batch_size, c.train.seq_len + 1), np.int32, sharding=trainer.batch_sharding)
    return trainer.train_step.lower(trainer.abstract_sharded_state(), batch).compile().as_text()


def full_logits_gathers(hlo: str, c, data_parallel: int) -> list[tuple[int, ...]]:
    tokens = c.train.batch_size // data_parallel * c.train.seq_len
    return [s for s in collective_shapes(hlo, "all-gather") if VOCAB in s and np.prod(s) >= tokens * VOCAB]


def test_tensor_parallel_loss_never_gathers_the_logits():
    c = small_config({"data": 2, "fsdp": 2, "tensor": 2}, model__mlp_dim=192)  # only vocab is 256
    hlo = compiled_hlo(c)
    assert collective_shapes(hlo, "all-gather")  # FSDP weights are gathered; logits must not be
    assert not full_logits_gathers(hlo, c, data_parallel=4)
    # The check does catch a gather: replicating vocab-sharded logits over `tensor` is one.
    trainer = setup(c, VOCAB)
    logits = jax.ShapeDtypeStruct((16, 32, VOCAB), np.float32, sharding=sharding.named_sharding(trainer.mesh, ("batch", "length", "vocab")))
    gather = jax.jit(lambda x: x * 2, out_shardings=sharding.named_sharding(trainer.mesh, ("batch", "length", None)))
    assert full_logits_gathers(gather.lower(logits).compile().as_text(), c, data_parallel=4)


def test_fsdp_gathers_weights_one_layer_at_a_time_inside_the_scan():
    c = small_config({"fsdp": 8}, model__num_layers=4, model__scan_layers=True)
    hlo = compiled_hlo(c)
    # Split the module into computations; the layer scan's bodies are while-loop bodies.
    bodies = {m.group(1) for m in re.finditer(r"body=%?([\w.\-]+)", hlo)}
    computations = re.split(r"\n(?=\S)", hlo)
    per_computation = {block.split(" ", 1)[0].lstrip("%"): collective_shapes(block, "all-gather") for block in computations}
    stacked = [s for shapes in per_computation.values() for s in shapes if len(s) >= 2 and s[0] == 4]
    assert not stacked, f"whole layer stacks gathered at once: {stacked}"
    in_loop = [s for name, shapes in per_computation.items() if name in bodies for s in shapes]
    assert (64, 128) in in_loop and (128, 64) in in_loop  # w_in / w_gate, w_out of one layer


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from Linux's /proc")
def test_xla_cpu_thread_pools_hold_eight_threads_per_fake_device():
    """`import lm` sizes XLA:CPU's pools (PJRT_NPROC) for the 8 fake devices: with one thread per
    device, threads blocked in one collective left another's parts queued, and the suite hung."""
    mesh = sharding.make_mesh(sharding.MeshConfig(data=8))
    x = jax.device_put(np.ones((8, 4), np.float32), sharding.named_sharding(mesh, ("batch", None)))
    assert float(jax.jit(lambda a: a.sum())(x)) == 32.0  # a collective ran
    names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    assert sum("XLAEigen" in name for name in names) >= 8 * 8
