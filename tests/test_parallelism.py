"""Data, FSDP, tensor and sequence parallelism: same losses and parameters as one device."""

import os
import re

import jax
import numpy as np
import pytest
from conftest import VOCAB, compiled_train_step, fast_config, run_steps, small_config

import sharding
from lm.compiler.hlo import collective_shapes, collective_traffic
from lm.program.checkpoint import Checkpointer
from lm.program.steps import setup
from lm.training.loop import train
from sharding import report


@pytest.fixture(scope="module")
def one_device():
    return run_steps(small_config({}), jax.devices()[:1])


ZERO1 = {"sharding__optimizer_over_data": True}


@pytest.mark.parametrize(
    "mesh, options",
    [
        ({"data": 8}, {}),
        ({"fsdp": 8}, {}),
        ({"data": 2, "tensor": 4}, {}),
        ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
        ({"fsdp": 4, "tensor": 2}, {"sharding__sequence_parallel": True}),
        ({"data": 8}, ZERO1),
        ({"data": 2, "fsdp": 2, "tensor": 2}, {**ZERO1, "sharding__sequence_parallel": True, "train__grad_accum": 2}),
    ],
    ids=["data8", "fsdp8", "data2-tensor4", "data2-fsdp2-tensor2", "fsdp4-tensor2-sp", "data8-zero1", "data2-fsdp2-tensor2-sp-accum2-zero1"],
)
def test_sharded_training_matches_one_device(one_device, mesh, options):
    losses, params = run_steps(small_config(mesh, **options))
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


def test_zero1_spreads_the_optimizer_state_over_the_replicas_and_keeps_the_parameters_whole():
    """ZeRO-1 on {data 4, tensor 2}: each device holds a quarter of the optimizer state it holds
    without it (scalars aside) and the same parameters, which the step all-gathers after each
    replica updated its share (on GPUs the gradients are reduce-scattered: test_gpu_compile)."""
    held = {}
    for zero in (False, True):
        c = small_config({"data": 4, "tensor": 2}, sharding__optimizer_over_data=zero)
        state = setup(c, VOCAB).init_state(0)
        device = jax.devices()[0]
        held[zero] = {k: report.addressable_bytes(getattr(state, k), device) for k in ("params", "opt_state")}
        gathered = collective_shapes(compiled_hlo(c), "all-gather")
        assert ((64, 128) in gathered) == zero, gathered  # an MLP weight (tensor-split), whole over `data`
    assert held[True]["params"] == held[False]["params"]
    assert held[False]["opt_state"] / 4 <= held[True]["opt_state"] <= held[False]["opt_state"] / 4 + 64


def test_a_zero1_checkpoint_restores_on_one_device_equal(tmp_path, small_corpus):
    zero = dict(mesh__data=4, sharding__optimizer_over_data=True)
    train(fast_config(small_corpus, train__steps=2, **zero), tmp_path, jax.devices()[:4])
    ckpt = Checkpointer(tmp_path / "checkpoints")
    saved = setup(fast_config(small_corpus, **zero), 256, jax.devices()[:4])
    flat = setup(fast_config(small_corpus, mesh__data=1), 256, jax.devices()[:1])
    a = jax.device_get(ckpt.restore(saved.abstract_sharded_state(), 2)[0])
    b = jax.device_get(ckpt.restore(flat.abstract_sharded_state(), 2)[0])
    assert any("data" in str(s.spec) for s in jax.tree.leaves(saved.state_shardings.opt_state))  # the moments were spread
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_spread_axes_takes_the_largest_dimension_the_replicas_divide():
    sizes = {"data": 4, "tensor": 2, "fsdp": 2}
    assert sharding.spread_axes((8, 64, 128), ((), ("fsdp",), ("tensor",)), sizes) == ((), ("fsdp",), ("tensor", "data"))
    assert sharding.spread_axes((8, 64, 6), ((), (), ("tensor",)), sizes) == ((), ("data",), ("tensor",))
    assert sharding.spread_axes((6, 2), ((), ()), sizes) == ((), ())  # indivisible: left as it was
    assert sharding.spread_axes((), (), sizes) == ()  # a scalar
    assert sharding.spread_axes((8,), ((),), {"data": 1}) == ((),)


def compiled_hlo(c) -> str:
    return compiled_train_step(setup(c, VOCAB)).as_text()


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


@pytest.mark.parametrize("mesh, options", [
    ({"data": 4, "fsdp": 2}, {"train__grad_accum": 2}),
    ({"data": 4, "stage": 2}, {"pipeline__microbatches": 4}),
    ({"data": 4, "stage": 2}, {"pipeline__schedule": "1f1b", "pipeline__microbatches": 4}),
    ({"data": 4, "stage": 2}, {"pipeline__schedule": "1f1b", "pipeline__microbatches": 4, **ZERO1}),
], ids=["accum2", "gpipe", "1f1b", "1f1b-zero1"])
def test_replicas_combine_their_gradients_once_a_step_whatever_its_passes(mesh, options):
    """A step of several passes (accumulation, pipeline microbatches) over 4 data replicas moves
    the gradients' bytes over `data` once (an all-reduce; with ZeRO-1 a reduce-scatter), not once
    a pass, as XLA does with the replicas automatic (until 2026-11-26). (ZeRO-1 with plain
    accumulation still reduce-scatters each pass: its accumulator stays a replica's share.)"""
    c = small_config(mesh, **options)
    program = setup(c, VOCAB, jax.devices()[:8])
    compiled = compiled_train_step(program).as_text()
    over_data = sum(b for (op, n), b in collective_traffic(compiled).items() if n == 4 and op != "all-gather")  # ZeRO-1's parameters
    grads = report.device_bytes(program.abstract_sharded_state().params)
    assert 0.9 * grads < over_data < 1.1 * grads
