"""GPU readiness, checked on the real XLA GPU compiler with no GPU: the train step compiled for 8
H100s (lm/hardware) and its optimized HLO read (lm.compiler.hlo). Each detector has a negative
control that shows it can fail. Skipped, with the reason, where `make gpu-compiler` has not
installed the compiler."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, compiled_train_step, recipe, run_cli

from lm import layout as lm_layout
from lm.compiler import hlo, kernels, passes, targets
from lm.compiler.hlo_module import Module
from lm.data.corpus import nominal_vocab_size
from lm.errors import UserError
from lm.hardware import data_file
from lm.model import matmul
from lm.model import precision as precision_module
from lm.model.attention import attention_kernel, cudnn_available
from lm.program.steps import setup
from sharding import remat as remat_module
from sharding.pipeline_slots import put
from sharding.remat import BATCHED_MATMUL, MATMUL

pytestmark = pytest.mark.skipif(
    not targets.compiler_available(), reason="the XLA GPU compiler plugin is not installed (make gpu-compiler)"
)
# Small enough to compile in seconds; head dim 32 and bf16, which cuDNN attention takes.
SMALL = dict(model__num_layers=2, model__embed_dim=128, model__num_heads=4, model__num_kv_heads=2, model__mlp_dim=256,
             train__batch_size=16, train__seq_len=128, precision__compute_dtype="bfloat16")
BLOCK_SPEC = re.compile(r"(b[a-z]*,[a-z]+->[a-z]+)")  # the einsum of a model matmul, in its op_name


@pytest.fixture(scope="module")
def h100s():
    return targets.devices("h100", 8)


def needs_the_named_fp8_algorithm():
    if not matmul.fp8_algorithm_compiles(targets.devices("h100", 1)[0]):
        pytest.skip(f"this GPU plugin (jax {jax.__version__}) cannot take a dot naming the fp8 algorithm, so fp8 GEMMs "
                    "write float32, scaled and cast after (lm.model.matmul.fp8_algorithm_compiles)")


_COMPILED = {}  # resolved config -> its compiled step: several tests read the same program


def small_config(mesh: dict, **overrides):
    """The SMALL tiny model with `overrides` on `mesh` (its `data` 1 unless given)."""
    return recipe("tiny", **{**SMALL, **overrides}, **{f"mesh__{k}": v for k, v in {"data": 1, **mesh}.items()})


# Multi-head latent attention, small: queries and keys 24 wide (16 + 8 rotary), values 16.
LATENT = dict(model__kv_lora_rank=32, model__q_lora_rank=32, model__qk_nope_head_dim=16, model__qk_rope_head_dim=8, model__v_head_dim=16,
              model__num_heads=4, model__num_kv_heads=4)


def compiled_step(h100s, mesh: dict, fresh: bool = False, **overrides):
    """The train step of `small_config(mesh, **overrides)`, compiled for `h100s`; `fresh`:
    compiled again even if an earlier test compiled it (for what the compiler logs)."""
    c = small_config(mesh, **overrides)
    key = (c.to_json_best_effort(sort_keys=True), len(h100s))
    if fresh or key not in _COMPILED:
        _COMPILED[key] = compiled_train_step(setup(c, 256, h100s))
    return _COMPILED[key]


def compiled(h100s, mesh: dict, fresh: bool = False, **overrides) -> str:
    return compiled_step(h100s, mesh, fresh, **overrides).as_text()


def model_gemms(text: str) -> list[hlo.Gemm]:
    """The GEMMs of the model's own matmuls (not XLA's attention), forward and backward."""
    return [g for g in hlo.gemms(text) if BLOCK_SPEC.search(g.op_name)]


@pytest.mark.slow
def test_bf16_matmuls_are_bf16_gemms_accumulating_in_float32(h100s):
    gemms = model_gemms(compiled(h100s, {"fsdp": 8}))
    # Every model matmul is a GEMM (XLA may merge the q, k and v projections into one, named for
    # one of them).
    specs = {BLOCK_SPEC.search(g.op_name).group(1) for g in gemms}
    assert {"bthk,hkd->btd", "btd,df->btf", "btf,fd->btd", "btd,dv->btv"} <= specs
    assert {"btd,dhk->bthk", "btd,dgk->btgk"} & specs
    assert len(gemms) >= 3 * 7  # the layer loop's 7 matmuls, forward and two backward each
    assert {(g.lhs, g.rhs, g.accumulation) for g in gemms} == {("bf16", "bf16", "f32")}
    # Activations and their gradients leave the GEMM in bf16 (their partial sums, where tensor
    # parallelism splits the contraction, are reduced in bf16); weight gradients in float32.
    assert {g.out for g in gemms} == {"bf16", "f32"}
    # The detector: the same model in float32 runs float32 GEMMs.
    assert {(g.lhs, g.rhs) for g in model_gemms(compiled(h100s, {"fsdp": 8}, precision__compute_dtype="float32"))} == {("f32", "f32")}


def test_fp8_sites_run_fp8_gemms_forward_and_backward(h100s):
    gemms = model_gemms(compiled(h100s, {"fsdp": 8}, precision__fp8="delayed", precision__fp8_sites="all"))
    head = {"btd,dv->btv", "btv,dv->btd", "btd,btv->dv"}  # the output head stays in bf16 by design
    kinds = {(g.lhs, g.rhs) for g in gemms if BLOCK_SPEC.search(g.op_name).group(1) not in head}
    # e4m3 x e4m3 forward; the output gradient in e5m2 against e4m3 for dx, and for dw.
    assert kinds == {("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}
    assert sum(g.lhs.startswith("f8") for g in gemms) >= 3 * 7  # every block matmul, all three GEMMs
    # The detector: without fp8 no GEMM takes fp8 operands.
    assert not [g for g in hlo.gemms(compiled(h100s, {"fsdp": 8})) if "f8" in g.lhs + g.rhs]


def test_fp8_gemms_write_bf16_with_their_scales_folded_in(monkeypatch):
    """On the first real H100, cuBLAS's fp8 GEMMs wrote float32 results that a separate pass
    scaled and converted to bf16. The forward and dx GEMMs now write bf16 and apply the scale
    themselves (cuBLAS's own scale operand, not a constant 1); dw stays float32 for its
    reduction. One device: the test model's small GEMMs over 8 are split along K by XLA, whose
    partial products are float32 by design. Each site quantises x under its own scale here: with
    one x scale for q / k / v and for up / gate, XLA's dot merger joins this small model's forward
    GEMMs of each group (its threshold is 32 MB; `llama_1b`'s are far above), which then take a
    scale of 1 and scale their results after."""
    from lm.model.precision import Policy

    needs_the_named_fp8_algorithm()
    monkeypatch.setattr(Policy, "quantising_site", lambda self, *a: None)
    text = compiled_train_step(setup(small_config({}, precision__fp8="delayed", precision__fp8_sites="all"), 256, targets.devices("h100", 1))).as_text()
    gemms = [g for g in model_gemms(text) if g.lhs.startswith("f8")]

    def role(g):  # forward, dx or dw: a weight's gradient is the einsum whose result has no batch axis
        result = re.search(r"->([a-z]+)\)", g.op_name).group(1)
        return "dw" if "b" not in result else "dx" if "e5m2" in g.lhs + g.rhs else "forward"

    outputs = {r: {g.out for g in gemms if role(g) == r} for r in ("forward", "dx", "dw")}
    assert outputs == {"forward": {"bf16"}, "dx": {"bf16"}, "dw": {"f32"}}
    assert {g.lhs + g.rhs for g in gemms if role(g) == "forward"} == {"f8e4m3fnf8e4m3fn"}  # (XLA may take dx's and dw's either way round)
    calls = [line for line in text.splitlines() if 'custom_call_target="__cublas$lt$matmul$f8"' in line and BLOCK_SPEC.search(line)]
    assert len(calls) == sum(g.out == "bf16" for g in gemms) >= 2 * 7  # every forward and dx GEMM
    scale_operands = [re.search(r"custom-call\(([^)]*)\)", line).group(1).split(", ")[2] for line in calls]
    assert not [operand for operand in scale_operands if operand.startswith("%constant")]


@pytest.mark.skipif(not cudnn_available(), reason="cuDNN is not installed next to the compiler (make gpu-compiler)")
def test_compile_only_devices_warn_when_cudnn_cannot_load_and_stay_out_of_the_persistent_cache():
    """JAX imported before meshlm finds no cuDNN: attention would compile as XLA's, not as on a
    GPU (a 7x larger step for llama_1b), so asking for the target's devices says so. Programs for
    them cannot be read back from JAX's persistent cache, so that is turned off."""
    code = ("import sys, warnings; {first}import lm, jax; jax.config.update('jax_platforms', 'cpu'); from lm.compiler import targets\n"
            "with warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always'); targets.devices('h100', 1)\n"
            "print([str(x.message) for x in w], jax.config.jax_enable_compilation_cache)")
    said = {first: subprocess.run([sys.executable, "-c", code.format(first=first)], cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "MESHLM_GPU_COMPILER": "1"}, check=True).stdout
            for first in ("import jax; ", "")}
    assert "cuDNN cannot be loaded in this process" in said["import jax; "] and "MESHLM_GPU_COMPILER=1 before" in said["import jax; "]
    assert said[""].strip() == "[] False"


@pytest.mark.skipif(not cudnn_available(), reason="cuDNN is not installed next to the compiler (make gpu-compiler)")
def test_attention_runs_cudnn_fused_attention_forward_and_backward(h100s):
    calls = hlo.custom_calls(compiled(h100s, {"fsdp": 8}))
    assert calls["__cudnn$fmhaSoftmax"] == 2 and calls["__cudnn$fmhaSoftmaxBackward"] == 2  # per layer, under scan: 2 layers
    # The detector: XLA's own attention calls no cuDNN.
    assert not [k for k in hlo.custom_calls(compiled(h100s, {"fsdp": 8}, model__attention="xla")) if "cudnn" in k]


@pytest.mark.skipif(not cudnn_available(), reason="cuDNN is not installed next to the compiler (make gpu-compiler)")
def test_latent_attention_runs_cudnn_with_values_narrower_than_queries(h100s):
    """Multi-head latent attention's 24-wide queries and keys, 16-wide values: cuDNN's fused
    attention forward and backward on Hopper (jax.nn's checks want them equal; the cuDNN call
    beneath takes them), each layer's once."""
    text = compiled(h100s, {"fsdp": 8}, **LATENT)
    calls = hlo.custom_calls(text)
    assert calls["__cudnn$fmhaSoftmax"] == 2 and calls["__cudnn$fmhaSoftmaxBackward"] == 2
    forward = next(line for line in text.splitlines() if 'fmhaSoftmax"' in line)
    assert re.search(r"= \(bf16\[\d+,4,\d+,16\]", forward) and re.search(r"\{bf16\[\d+,\d+,4,24\]\S*, bf16\[\d+,\d+,4,24\]", forward)


@pytest.mark.slow
@pytest.mark.skipif(not cudnn_available(), reason="cuDNN is not installed next to the compiler (make gpu-compiler)")
def test_latent_attention_runs_cudnn_inside_a_pipelines_vmap_over_stages(h100s):
    """Under the lockstep pipelines' vmap over stages, jax's batching rule for cuDNN attention
    reshapes the values to the keys' width and fails for latent attention's narrower ones
    (jax 0.10.2 to 0.12); `attention.batched_as_one` runs the call with the stages merged into the
    batch instead. 1F1B on `{stage 2, fsdp 4}`: the fused forward and backward compile, values
    16 wide beside queries and keys 24 wide."""
    text = compiled(h100s, {"stage": 2, "fsdp": 4}, pipeline__schedule="1f1b", **LATENT)
    calls = hlo.custom_calls(text)
    assert calls["__cudnn$fmhaSoftmax"] >= 1 and calls["__cudnn$fmhaSoftmaxBackward"] >= 1
    forward = next(line for line in text.splitlines() if 'fmhaSoftmax"' in line)
    assert re.search(r"= \(bf16\[\d+,4,\d+,16\]", forward)


@pytest.mark.slow
@pytest.mark.skipif(not cudnn_available(), reason="cuDNN is not installed next to the compiler (make gpu-compiler)")
def test_remat_dots_keeps_flash_attention_so_its_forward_runs_once_a_layer(h100s):
    """cuDNN attention is no dot_general: `dots` saves its results by name, so the backward does
    not run each layer's attention forward again; `dots_no_batch` and `full` recompute it."""
    forwards = {remat: hlo.custom_calls(compiled(h100s, {"fsdp": 8}, model__remat=remat, model__scan_layers=False))
                for remat in ("dots", "dots_no_batch", "full")}
    assert forwards["dots"]["__cudnn$fmhaSoftmax"] == 2  # two layers, unrolled
    assert forwards["dots_no_batch"]["__cudnn$fmhaSoftmax"] == forwards["full"]["__cudnn$fmhaSoftmax"] == 4
    assert all(calls["__cudnn$fmhaSoftmaxBackward"] == 2 for calls in forwards.values())


def test_remat_dots_and_inputs_recomputes_no_norm_or_rotation_in_the_backward(h100s):
    """`dots` recomputes each layer's norm outputs and rotated queries and keys in the backward:
    kernels under `rematted_computation` writing activations (the negative control);
    `dots_and_inputs` keeps them, so no such kernel is left (the MLP's product, which it does not
    keep, is remade inside the backward's pass over gate and up; bf16, two layers unrolled,
    `{fsdp: 8}`)."""
    from lm.compiler import kernels

    def recomputed(remat):
        c = small_config({"fsdp": 8}, model__remat=remat, model__scan_layers=False, precision__compute_dtype="bfloat16")
        text = compiled(h100s, {"fsdp": 8}, model__remat=remat, model__scan_layers=False, precision__compute_dtype="bfloat16")
        shapes = {k.name: k.shape for k in kernels.table(text)}
        activation = f"[{c.train.batch_size // 8},{c.train.seq_len},"  # a device's rows: [batch, length, ...]
        return [(shapes[m.group(1)], m.group(2)) for m in re.finditer(r'%?([\w.\-]+) = [^\n]*op_name="[^"]*rematted_computation/([^"]*)"', text)
                if activation in shapes.get(m.group(1), "")]

    dots, kept = recomputed("dots"), recomputed("dots_and_inputs")
    assert len(dots) >= 2 * 2 and not kept, (dots, kept)  # per layer at least the rotated queries and keys


def test_attention_falls_back_where_cudnn_cannot_take_the_call(h100s):
    mesh = jax.sharding.Mesh(np.asarray(h100s).reshape(8), ("data",))
    q = lambda dtype, k=64: jax.ShapeDtypeStruct((2, 16, 4, k), dtype)  # noqa: E731
    from sharding import activate

    with activate(mesh):  # what the model sees inside a program compiled for H100s
        assert attention_kernel("auto", q(jax.numpy.bfloat16)) == ("cudnn" if cudnn_available() else "xla")
        assert attention_kernel("auto", q(jax.numpy.float32)) == "xla"  # cuDNN takes bf16 / fp16
        # Hopper takes head dims up to 256, and values narrower than queries and keys (latent attention).
        assert attention_kernel("auto", q(jax.numpy.bfloat16, k=256)) == ("cudnn" if cudnn_available() else "xla")
        assert attention_kernel("auto", q(jax.numpy.bfloat16, k=272)) == "xla"  # head dim over 256
        assert attention_kernel("auto", q(jax.numpy.bfloat16, k=192), value_dim=128) == ("cudnn" if cudnn_available() else "xla")
        assert attention_kernel("auto", q(jax.numpy.bfloat16), decoding=True) == "xla"  # a decoding mask
        # Asked for by name where it cannot run: what is missing, in one line (cuDNN itself first).
        if cudnn_available():
            with pytest.raises(UserError, match=r"cudnn needs bfloat16 or float16 inputs \(precision.compute_dtype gives float32\)"):
                attention_kernel("cudnn", q(jax.numpy.float32))
            with pytest.raises(UserError, match="cudnn needs a head dim that is a multiple of 8 up to 256 on this GPU .the model's is 272"):
                attention_kernel("cudnn", q(jax.numpy.bfloat16, k=272))
            assert attention_kernel("cudnn", q(jax.numpy.bfloat16), decoding=True) == "xla"
        else:
            with pytest.raises(UserError, match="cudnn needs cuDNN installed"):
                attention_kernel("cudnn", q(jax.numpy.bfloat16))
    assert attention_kernel("auto", q(jax.numpy.bfloat16)) == "einsum"  # on this CPU


@pytest.mark.slow
def test_fsdp_gathers_weights_per_layer_and_reduce_scatters_gradients(h100s):
    text = compiled(h100s, {"fsdp": 8}, model__num_layers=4)
    gathered = hlo.collective_shapes(text, "all-gather")
    assert (128, 256) in gathered or (256, 128) in gathered  # one layer's MLP weight, whole after the gather
    # Gathered one layer's weights at a time (XLA unrolls this short loop and combines the
    # gathers up to GPU_COMPILER_OPTIONS' threshold), never a whole stack [layers, ...].
    assert not [s for s in gathered if len(s) >= 3 and s[0] == 4]
    assert hlo.collective_shapes(text, "reduce-scatter")  # gradients leave reduced and sharded
    # All-reduced: scalars (loss, norms) only; every gradient, the embedding table's too, is
    # reduce-scattered (the table's because `layers.lookup` places its gradient as the parameter).
    largest = lambda t: max(np.prod(s) for s in hlo.collective_shapes(t, "all-reduce"))  # noqa: E731
    assert largest(text) <= 64
    # The detector: plain data parallelism all-reduces every gradient (XLA combines them into
    # one flat buffer) and scatters nothing.
    data = compiled(h100s, {"data": 8}, model__num_layers=4)
    assert not hlo.collective_shapes(data, "reduce-scatter") and largest(data) > 4 * 128 * 256
    # ZeRO-1 over the same replicas: the gradients reduce-scattered (no large all-reduce left),
    # each replica's updated share of the parameters all-gathered.
    zero = compiled(h100s, {"data": 8}, model__num_layers=4, sharding__optimizer_over_data=True)
    assert hlo.collective_shapes(zero, "reduce-scatter") and hlo.collective_shapes(zero, "all-gather")
    assert largest(zero) <= 64


@pytest.mark.parametrize("mesh, overrides", [
    ({"fsdp": 4, "tensor": 2}, {"sharding__sequence_parallel": True, "model__remat": "dots_no_batch"}),
    pytest.param({"fsdp": 4, "tensor": 2}, {"model__remat": "full", "train__grad_accum": 2}, marks=pytest.mark.slow),
    ({"fsdp": 8}, {"model__remat": "full"}),
])
def test_the_cost_models_collective_bytes_are_the_compiled_programs(h100s, mesh, overrides):
    """What lm.planner.cost times FSDP and tensor parallelism by, per step and device, against what the
    compiled program's collectives move (loop bodies counted per iteration): the weights gathered
    in bf16 and the gradients scattered in float32, each reduction's activation. Within 2% for
    the gathers; 6% for the scatters (the embedding's gradient leaves by an all-to-all of its
    rows); 10% for tensor parallelism (a few more around the head and loss on this small model;
    on llama_70b, 128 H100s, within 1.5%: PERFORMANCE.md)."""
    from lm.hardware.systems import System
    from lm.planner.cost import Cost
    from lm.planner.parallelism import Parallelism
    from lm.planner.run import run_of
    from lm.planner.search import collective_check

    overrides = {**overrides, "model__num_layers": 4}
    config = small_config(mesh, **overrides)
    parallelism = Parallelism(**mesh, sequence_parallel=config.sharding.sequence_parallel, remat=config.model.remat,
                              grad_accum=config.train.grad_accum)
    checked = collective_check(Cost(run_of(config), parallelism, System.load("h100")),
                               hlo.summary(compiled(h100s, mesh, **overrides))["collective_bytes"])
    assert set(checked) == ({"fsdp_gather", "fsdp_scatter", "tensor"} if parallelism.tensor > 1 else {"fsdp_gather", "fsdp_scatter"})
    for kind, tolerance in (("fsdp_gather", 0.02), ("fsdp_scatter", 0.06), ("tensor", 0.1)):
        model, moved = checked.get(kind, (0, 0))
        assert model == pytest.approx(moved, rel=tolerance), kind
    # The detector: the gradients counted in bf16, as the model did until 2026-11-26, are off by half.
    assert checked["fsdp_scatter"][0] / 2 != pytest.approx(checked["fsdp_scatter"][1], rel=0.3)


def test_tensor_parallel_loss_never_gathers_the_logits(h100s):
    text = compiled(h100s, {"fsdp": 4, "tensor": 2})
    per_device_tokens = 16 // 4 * 128
    assert hlo.collective_shapes(text, "all-gather")
    assert not [s for s in hlo.collective_shapes(text, "all-gather") if 256 in s and np.prod(s) >= per_device_tokens * 256]


def test_the_losss_backward_writes_the_vocabulary_wide_cotangent_once_in_bf16(h100s, monkeypatch):
    """Past the head GEMM (which writes the float32 logits), no kernel writes a float32 array of
    the per-device [2, 128, vocabulary 256]: the loss's backward (`lm.model.cross_entropy`) is one
    fusion writing the head's bf16 cotangent. Negative control: autodiff of optax's form adds
    two float32 passes (the softmax product and the labels' one-hot scattered in)."""
    import optax

    from lm.compiler import kernels
    from lm.program import steps

    def float32_vocab_passes(text):
        return [k.name for k in kernels.table(text) if k.kind in ("elementwise", "reduction", "fusion") and "f32[2,128,256]" in k.shape]

    assert not float32_vocab_passes(compiled(h100s, {"fsdp": 8}))
    monkeypatch.setattr(steps, "cross_entropy", lambda logits, targets: jax.numpy.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits.astype(jax.numpy.float32), targets)))
    autodiffed = compiled_train_step(setup(small_config({"fsdp": 8}), 256, h100s)).as_text()  # not kept for other tests
    assert len(float32_vocab_passes(autodiffed)) == 2


def test_the_rotations_backward_and_fp8s_amax_of_its_gradient_read_it_once(h100s):
    """fp8 takes the amax of each projection's output gradient as it quantises it; for queries and
    keys that gradient comes out of the rotation's backward. Built by a reverse of the halves
    (`lm.model.rope.rope`), the rotation fuses with the amax and the quantising: the compiled
    program reads the incoming gradient once. Negative control: split and concatenated, as
    before, the concatenation ends XLA's fusion, and the amax reads it again (a pass more).
    Both forms give the same bits."""
    from lm.model.rope import rope

    def concatenated(x_bthk, positions_bt, freq_k):
        angle = positions_bt[..., None, None].astype(jnp.float32) * freq_k
        sin, cos = jnp.sin(angle), jnp.cos(angle)
        x1, x2 = jnp.split(x_bthk.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_bthk.dtype)

    freq = (1.0 / 10000 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)

    def gradient_quantised(rotate, x, dy, positions, scale):  # delayed scaling: this step's amax, last step's scale
        (dx,) = jax.vjp(lambda x: rotate(x, positions, freq), x)[1](dy)
        wide = dx.astype(jnp.float32)
        return (wide * scale).astype(jnp.float8_e5m2), jnp.max(jnp.abs(wide))

    on = jax.sharding.SingleDeviceSharding(h100s[0])
    args = [jax.ShapeDtypeStruct((8, 512, 16, 64), jnp.bfloat16, sharding=on)] * 2
    args += [jax.ShapeDtypeStruct((8, 512), jnp.int32, sharding=on), jax.ShapeDtypeStruct((), jnp.float32, sharding=on)]
    gradient_bytes = 8 * 512 * 16 * 64 * 2

    def hbm_bytes(rotate):
        text = jax.jit(lambda *a: gradient_quantised(rotate, *a)).lower(*args).compile().as_text()
        return sum(k.count * k.bytes for k in kernels.table(text))

    assert hbm_bytes(concatenated) - hbm_bytes(rope) >= gradient_bytes
    x, dy = (jax.random.normal(jax.random.PRNGKey(i), (2, 8, 4, 64), jnp.bfloat16) for i in (0, 1))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    for a, b in zip(gradient_quantised(rope, x, dy, positions, 3.0), gradient_quantised(concatenated, x, dy, positions, 3.0)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_the_chunked_loss_never_holds_the_float32_logits_whole(h100s):
    """`model.loss_chunks=4`: no float32 array as large as the per-device logits [2 x 128 tokens,
    vocabulary 640] (a vocabulary no other width shares) anywhere in the compiled step: the
    largest vocabulary-wide one is the head weight's float32 gradient [embed 128, 640]; and less
    temporary memory. The plain loss (the negative control) has them whole."""
    import re

    def largest_float32_vocab_array(text):  # elements of the largest f32 array whose last dimension is the vocabulary
        return max((int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"f32\[([0-9,]+)\]", text)
                    if dims.split(",")[-1] == "640"), default=0)

    plain, chunked = (compiled_train_step(setup(small_config({"fsdp": 8}, model__loss_chunks=chunks), 640, h100s)) for chunks in (1, 4))
    assert largest_float32_vocab_array(plain.as_text()) >= 2 * 128 * 640
    assert largest_float32_vocab_array(chunked.as_text()) == 128 * 640
    assert chunked.memory_analysis().temp_size_in_bytes < plain.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_tensor_parallel_partial_sums_are_reduce_scattered_in_bf16(h100s):
    """Under tensor + sequence parallelism the row-parallel matmuls' partial sums (and the input
    gradients') are reduce-scattered in the compute dtype, as Megatron does; no activation-sized
    all-reduce. (Until 2026-11-23 they left the GEMM in float32 and XLA all-reduced the
    recomputed forward's whole float32 outputs.)"""
    tokens = 16 // 4 * 128  # per fsdp shard, the whole sequence

    def activation_sized(text, op):  # element types of the buffers of at least half a [tokens, embed]
        return [t for t, s in hlo.collective_buffers(text, op) if np.prod(s, dtype=np.int64) >= tokens * 128 // 2]

    text = compiled(h100s, {"fsdp": 4, "tensor": 2}, sharding__sequence_parallel=True, model__remat="dots_no_batch")
    assert set(activation_sized(text, "reduce-scatter")) == {"bf16"}
    assert not activation_sized(text, "all-reduce")
    # The detector: in float32 the same reductions are float32.
    text = compiled(h100s, {"fsdp": 4, "tensor": 2}, sharding__sequence_parallel=True, model__remat="dots_no_batch",
                    precision__compute_dtype="float32")
    assert set(activation_sized(text, "reduce-scatter")) == {"f32"}


def test_gpu_compiles_get_meshlm_compiler_options(h100s):
    # The latency-hiding scheduler and collective combining (targets.GPU_COMPILER_OPTIONS) change
    # the schedule: asynchronous collective pairs appear. (Which ones varies: jax 0.11's XLA makes
    # a pair with nothing scheduled between its start and done synchronous again, as it did this
    # model's one combined all-gather.)
    text = compiled(h100s, {"fsdp": 8})
    options = targets.compiler_options(h100s[0])
    assert re.search(r"(all-gather|reduce-scatter|all-reduce)-start\(", text) and targets.GPU_COMPILER_OPTIONS.items() <= options.items()
    assert targets.compiler_options(jax.devices("cpu")[0]) == {}


@pytest.mark.slow
def test_elementwise_gemm_fusion_leaves_no_pass_over_the_mlps_activations():
    """`train.gemm_fusion=elementwise` (XLA's GEMM fusion v2): SwiGLU's product, its backward and
    the residual adds run inside the GEMMs' Triton kernels, so no kernel of its own reads or writes
    a [batch, length, mlp] activation, and the step moves fewer bytes, with the same GEMMs (none
    duplicated to take an epilogue twice). Negative control: XLA's own GEMM fusions (`operands`)
    make such passes. `auto` asks for it without fp8 and tensor parallelism only."""
    one = targets.devices("h100", 1)

    def step(gemm_fusion):
        text = compiled(one, {}, train__gemm_fusion=gemm_fusion)
        table = kernels.table(text)
        activation_passes = [k.name for k in table if k.kind in ("elementwise", "reduction", "fusion") and k.shape.endswith("[16,128,256]")]
        return activation_passes, passes.count(text)["pass_bytes"], sum(k.count * k.flops for k in table if k.kind == "gemm")

    fused, fused_bytes, fused_flops = step("elementwise")
    plain, plain_bytes, plain_flops = step("operands")
    if fused_bytes == plain_bytes and tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 12):
        pytest.skip(f"this XLA (jax {jax.__version__}) takes xla_gpu_experimental_gemm_fusion_v2 and fuses nothing more by it "
                    "(jax 0.12.0.1's, seen 2026-12-01; jax 0.10.2's fuses)")
    assert not fused and len(plain) >= 4, (fused, plain)
    assert fused_bytes < 0.85 * plain_bytes and fused_flops == plain_flops
    assert targets.elementwise_gemm_fusion("auto", fp8=False, tensor_parallel=False)
    assert not targets.elementwise_gemm_fusion("auto", fp8=True, tensor_parallel=False)
    assert not targets.elementwise_gemm_fusion("auto", fp8=False, tensor_parallel=True)
    assert targets.elementwise_gemm_fusion("elementwise", fp8=True, tensor_parallel=True)
    assert targets.ELEMENTWISE_GEMM_FUSION_OPTIONS.items() <= targets.compiler_options(one[0], elementwise_gemms=True).items()
    assert not targets.ELEMENTWISE_GEMM_FUSION_OPTIONS.items() <= targets.compiler_options(one[0]).items()


@pytest.mark.slow
def test_compile_only_programs_take_their_kernels_from_xlas_kernel_cache(h100s):
    """XLA rewrites the cache file only when it compiled a kernel the file lacked: the same program
    compiled again leaves it untouched. (The first recompile still adds a kernel or two: XLA's
    names for them differ between a process's first compile and the next.)"""
    path = Path(targets.compiler_options(h100s[0])["xla_gpu_kernel_cache_file"])
    for _ in range(2):
        compiled_step(h100s, {"fsdp": 8}, fresh=True)
    written = path.stat().st_mtime_ns
    compiled_step(h100s, {"fsdp": 8}, fresh=True)
    assert path.stat().st_mtime_ns == written
    # The detector: a program with new shapes needs new kernels, and they are written.
    compiled_step(h100s, {"fsdp": 8}, fresh=True, model__mlp_dim=320)
    assert path.stat().st_mtime_ns != written


def test_a_process_puts_its_kernel_cache_in_place_of_the_shared_one_at_exit(tmp_path):
    code = ("import jax, numpy as np, lm; jax.config.update('jax_platforms', 'cpu'); from lm.compiler import targets\n"
            "(device,) = targets.devices('h100', 1); options = targets.compiler_options(device)\n"
            "x = jax.ShapeDtypeStruct((1024,), np.float32, sharding=jax.sharding.SingleDeviceSharding(device))\n"
            "jax.jit(lambda x: x * 2 + 1).lower(x).compile(compiler_options=options)\n"
            "print(options.get('xla_gpu_kernel_cache_file'))")

    def run(**env) -> str:
        env = {**os.environ, "MESHLM_GPU_COMPILER": "1", "XDG_CACHE_HOME": str(tmp_path), **env}
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, check=True).stdout.strip()

    working = Path(run())
    (shared,) = (tmp_path / "meshlm" / "gpu_kernels").iterdir()  # its copy gone, in the shared file's place
    assert working.parent == shared.parent and not working.exists() and shared.stat().st_size > 0
    assert shared.name.startswith("h100-jaxlib")
    assert run(MESHLM_GPU_KERNEL_CACHE="0") == "None"


SCHEDULED = """ENTRY %main (p: bf16[64]) -> bf16[512] {
  %p = bf16[64]{0} parameter(0)
  %all-gather-start = (bf16[64]{0}, bf16[512]{0}) all-gather-start(%p), dimensions={0}
  %cublas-gemm.1 = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"
  %all-gather-done = bf16[512]{0} all-gather-done(%all-gather-start)
  %reduce-scatter-start = ((bf16[512]{0}), bf16[64]{0}) reduce-scatter-start(%all-gather-done), dimensions={0}
  %loop_add_fusion = bf16[64]{0} fusion(%p, %p), kind=kLoop, calls=%fused_add
  %reduce-scatter-done = bf16[64]{0} reduce-scatter-done(%reduce-scatter-start)
  %all-reduce = bf16[64]{0} all-reduce(%reduce-scatter-done), to_apply=%add
  ROOT %all-gather = bf16[512]{0} all-gather(%all-reduce), dimensions={0}
}
"""


def test_overlap_counts_the_collectives_with_a_gemm_between_start_and_done():
    # A GEMM between the all-gather's start and done hides it; an elementwise fusion does not
    # hide the reduce-scatter; synchronous ones hide behind nothing.
    assert hlo.collectives(SCHEDULED) == {"all-gather": 2, "reduce-scatter": 1, "all-reduce": 1}
    assert hlo.overlapped_collectives(SCHEDULED) == {"all-gather": 1}


@pytest.mark.slow
def test_a_step_near_the_memory_limit_keeps_its_collectives_beside_compute(monkeypatch):
    """XLA:GPU schedules for 80% of the device unless told otherwise: the train step of MaxText's
    llama_70b layout on 128 H100s needs 70 GiB, more than that, and left most of its all-gathers
    with nothing beside them. Given JAX's 95% pool (the slop factor) XLA overlaps more of them."""
    c = recipe("llama_70b", mesh__data=1, mesh__fsdp=128, model__remat="qkv_proj")
    devices = targets.devices("h100", 128, hosts=16)

    def overlapped(options: dict) -> int:
        monkeypatch.setattr(targets, "GPU_COMPILER_OPTIONS", options)
        return hlo.overlapped_collectives(compiled_train_step(setup(c, nominal_vocab_size(c.data), devices)).as_text())["all-gather"]

    at_80_percent = {k: v for k, v in targets.GPU_COMPILER_OPTIONS.items() if k != "xla_gpu_memory_limit_slop_factor"}
    assert overlapped(dict(targets.GPU_COMPILER_OPTIONS)) > overlapped(at_80_percent) + 2  # seen: 10 and 6 of 19


def test_layout_target_reports_the_compiled_memory(h100s, capsys):
    import json

    result = run_cli(capsys, lm_layout.main, "--config=configs/tiny.py", "--target=h100", "--devices=8",
                     "--config.mesh.data=1", "--config.mesh.fsdp=8")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    c = recipe("tiny", mesh__data=1, mesh__fsdp=8)
    program = setup(c, 256, h100s)
    memory = compiled_train_step(program).memory_analysis()
    reported = summary["compiled_train_step_per_device"]
    assert reported["temp_bytes"] == memory.temp_size_in_bytes and reported["argument_bytes"] == memory.argument_size_in_bytes
    assert summary["per_device"]["params_bytes"] == sum(
        int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize for s in jax.tree.leaves(program.abstract_sharded_state().params)
    )
    assert summary["target"] == "h100" and summary["fits"] and summary["device_memory_bytes"] == 85017493504
    assert data_file("h200.txtpb").exists()
    # FSDP over all 8: the weights gathered and the gradients reduce-scattered, per step.
    moved = summary["hlo"]["collective_bytes"]
    assert moved["all-gather over 8"] > 0 and moved["reduce-scatter over 8"] > 0
    assert "collective bytes per step and device (by replica group size): " in result.stdout


def test_bench_compile_only_for_a_target(capsys):
    import json

    from lm import bench as lm_bench

    result = run_cli(capsys, lm_bench.main, "--config=configs/tiny.py", "--compile_only", "--target=h200", "--devices=8")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["target"] == "h200" and summary["devices"] == 8 and summary["device_memory_bytes"] == 150109880320
    assert summary["compiled_train_step_per_device"]["temp_bytes"] > 0 and summary["compile_wall_s"] > 0


@pytest.mark.slow
def test_no_involuntary_full_rematerialization(h100s, capfd):
    # XLA's SPMD partitioner logs (from C++, to the process's stderr) each tensor it can only
    # reshard by replicating it whole; the training steps must cause none.
    capfd.readouterr()
    meshes = ({"fsdp": 8}, {"data": 2, "fsdp": 4}, {"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2},
              {"context": 2, "fsdp": 2, "tensor": 2}, {"data": 2, "context": 2, "tensor": 2}, {"context": 2, "fsdp": 4})
    for mesh in meshes:
        compiled(h100s, mesh, fresh=True, sharding__sequence_parallel=mesh.get("tensor", 1) > 1)
    compiled(h100s, {"context": 2, "fsdp": 2, "tensor": 2}, fresh=True)  # tensor parallelism without sequence parallelism
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    # The detector: a transpose whose result is asked for in an interleaved layout is one.
    mesh = jax.sharding.Mesh(np.asarray(h100s).reshape(2, 4), ("a", "b"))
    x = jax.ShapeDtypeStruct((8, 8, 8), np.float32, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b", None)))
    out = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("b", "a"), None))
    jax.jit(lambda x: jax.numpy.transpose(x, (2, 0, 1)).reshape(64, 8) * 2, out_shardings=out).lower(x).compile()
    assert "Involuntary full rematerialization" in capfd.readouterr().err


@pytest.mark.slow
def test_document_masking_context_parallelism_and_sliding_windows_compile_for_h100s(h100s):
    """Packed documents and context parallelism's reordered sequence reach cuDNN's attention as a
    mask (a bias); a sliding window stays on cuDNN's own causal mask."""
    c = small_config({"fsdp": 8}, data__document_masking=True)
    program = setup(c, 256, h100s)
    shape = (c.train.batch_size, c.train.seq_len + 1)
    batch = {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=program.batch_sharding) for k in ("tokens", "segments")}
    documents = hlo.custom_calls(program.train_step.lower(program.abstract_sharded_state(), batch).compile().as_text())
    context = compiled(h100s, {"context": 4, "fsdp": 2})
    windowed = hlo.custom_calls(compiled(h100s, {"fsdp": 8}, model__sliding_window=32))
    if not cudnn_available():
        return
    assert documents["__cudnn$fmhaScaleBiasSoftmax"] == 2 and documents["__cudnn$fmhaScaleBiasSoftmaxBackward"] == 2
    calls = hlo.custom_calls(context)
    assert calls["__cudnn$fmhaScaleBiasSoftmax"] == 2 and calls["__cudnn$fmhaScaleBiasSoftmaxBackward"] == 2
    # Keys and values gathered over context (4 ways): per device 16 / 2 rows, 128 positions, 2 kv heads of 32.
    assert (8, 128, 2, 32) in hlo.collective_shapes(context, "all-gather")
    assert windowed["__cudnn$fmhaSoftmax"] == 2 and windowed["__cudnn$fmhaSoftmaxBackward"] == 2


@pytest.mark.slow
def test_every_pipeline_schedule_compiles_for_h100s(h100s):
    # Circular once crashed the XLA GPU compiler ("Failed after batched_gather_scatter_normalizer":
    # a gather indexed per stage); 1F1B runs vjps inside its scan; the per-stage 1F1B runs cuDNN
    # attention inside a shard_map manual over `stage` (its partitioner cannot take that: per_shard).
    for extra in ({}, {"pipeline__repeats": 2}, {"pipeline__schedule": "1f1b"}, {"pipeline__schedule": "1f1b", "pipeline__repeats": 2},
                  {"pipeline__schedule": "1f1b_per_stage"}):
        text = compiled(h100s, {"stage": 2, "fsdp": 4}, model__num_layers=4, train__batch_size=32, pipeline__microbatches=4, **extra)
        assert hlo.collectives(text)["collective-permute"] >= 2  # activations on, and (gradients) back
        if extra.get("pipeline__schedule") == "1f1b_per_stage":
            assert " conditional(" in text
            if cudnn_available():
                assert hlo.custom_calls(text)["__cudnn$fmhaSoftmaxBackward"] >= 1


@pytest.mark.slow
def test_1f1b_keeping_residuals_compiles_for_h100s_with_cudnn_attention_under_context_parallelism(h100s):
    # The context-parallel attention mask depends on no input of the stage: kept once, it reaches
    # the backward unbatched (stashed per stage, cuDNN's batching rule failed on it).
    text = compiled(h100s, {"stage": 2, "context": 2, "fsdp": 2}, model__num_layers=4, pipeline__microbatches=4,
                    pipeline__schedule="1f1b", pipeline__remat="none", model__remat="dots")
    assert hlo.custom_calls(text)["__cudnn$fmhaScaleBiasSoftmaxBackward"] >= 1


def slot_loop_bytes(text: str) -> float:
    """HBM bytes a per-stage pipeline's step moves in its slot loop outside the slot's switch (the
    conditional of four or more branches): the rings' reads and writes around each slot's op."""
    module = Module(text)
    switches = [(name, re.search(r"branch_computations=\{([^}]*)\}", i.rest)) for name, body in module.bodies.items()
                for i in body if i.op == "conditional"]
    loops = {name for name, listed in switches if listed and listed.group(1).count(",") >= 3}
    assert loops, "no slot switch found"
    return sum(k.bytes * k.count for k in kernels.table(text) if k.computation in loops)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, module", [("zero_bubble", "pipeline_zero_bubble"), ("zbv", "pipeline_zbv")])  # (the per-stage 1F1B: 0.48)
def test_a_pipeline_slot_writes_each_ring_entry_once_in_place(h100s, monkeypatch, schedule, module):
    """After each slot's op every ring (residuals, taps) is written at its entry, whatever the op:
    the op's branch gives the entry it made, or back the one already there. So the slot loop moves
    each ring's entry twice (read the switch's result, write it in place), where a select between
    the new entry and the old after the switch (the negative control, as it ran until 2026-12-01)
    moved it five times."""
    def loop_bytes() -> float:
        c = small_config({"stage": 2, "fsdp": 4}, model__num_layers=4, train__batch_size=32, pipeline__microbatches=4,
                         pipeline__schedule=schedule, pipeline__remat="none")
        return slot_loop_bytes(compiled_train_step(setup(c, 256, h100s)).as_text())

    written = loop_bytes()
    monkeypatch.setattr(f"sharding.{module}.put_entry", put)  # the select: the entry if its slot is >= 0, else the old
    selected = loop_bytes()
    assert written < 0.6 * selected, (written, selected)


@pytest.mark.slow
def test_a_zero_bubble_pipelines_slot_loop_is_not_double_buffered_under_fsdp(h100s):
    """With FSDP, XLA unrolls loops by two to alternate buffers (`SHARDED_WEIGHTS_OPTIONS`), but
    not a split-backward pipeline's slot loop, where it costs (`lm.compiler.targets`): no
    double-buffered clone in ZB-H1's program; the per-stage 1F1B's (the control) has them."""
    def clones(schedule: str) -> int:
        c = small_config({"stage": 2, "fsdp": 4}, model__num_layers=4, train__batch_size=32, pipeline__microbatches=4,
                         pipeline__schedule=schedule, pipeline__remat="none")
        return compiled_train_step(setup(c, 256, h100s)).as_text().count(".double_buffer")

    assert clones("zero_bubble") == 0
    assert clones("1f1b_per_stage") > 0


@pytest.mark.slow
def test_1f1b_temporaries_stay_flat_in_the_microbatches_on_h100s(h100s):
    def temporaries(microbatches: int, **schedule) -> int:  # microbatches of 2 sequences per FSDP shard
        step = compiled_step(h100s, {"stage": 2, "fsdp": 4}, model__num_layers=4, train__batch_size=8 * microbatches,
                             pipeline__microbatches=microbatches, **schedule)
        return step.memory_analysis().temp_size_in_bytes

    gpipe = [temporaries(m) for m in (4, 32)]
    one_f_one_b = [temporaries(m, pipeline__schedule="1f1b") for m in (4, 32)]
    per_stage = [temporaries(m, pipeline__schedule="1f1b_per_stage") for m in (4, 32)]
    assert gpipe[1] > 2 * gpipe[0]  # every microbatch's stage inputs
    assert max(one_f_one_b) <= 1.1 * min(one_f_one_b)  # the stages' in-flight inputs only
    assert max(per_stage) <= 1.1 * min(per_stage)


@pytest.mark.slow
@pytest.mark.skipif(not cudnn_available(), reason="cuDNN is not installed next to the compiler (make gpu-compiler)")
def test_the_step_time_model_predicts_the_real_h100_run_from_a_deviceless_compile():
    """`llama_1b` bf16 on one H100 as the GPU run kit ran it (batch 8, remat `full` and `dots`),
    compiled here for the stored `h100` target: the step-time model, fitted on another GPU (the
    H200 run), predicts the measured steps (benchmarks/results/h100_2026-11-26.json) within 10%."""
    from lm.compiler import steptime
    from lm.recipe import load

    measured = json.loads((ROOT / "benchmarks" / "results" / "h100_2026-11-26.json").read_text())
    device = targets.devices("h100", 1)
    for case, remat in (("bf16_cudnn_b8", "full"), ("bf16_cudnn_b8_remat_dots", "dots")):
        config = load(str(ROOT / "configs" / "llama_1b.py"), {
            "precision.compute_dtype": "bfloat16", "model.attention": "cudnn", "train.batch_size": "8", "train.grad_accum": "1",
            "model.remat": remat, "model.scan_layers": "True", "train.gemm_fusion": "operands"})  # as the kit ran it then
        text = compiled_train_step(setup(config, nominal_vocab_size(config.data), device)).as_text()
        predicted = steptime.predict(text, "h100").step_s
        assert abs(predicted / measured[case]["step_time_s"] - 1) < 0.10, (case, predicted, measured[case]["step_time_s"])


@pytest.mark.slow
def test_fp8_sites_auto_runs_fp8_only_where_the_step_time_model_says_it_pays():
    """precision.fp8_sites=auto (the default) on an H100 target: a model of width 128 loses at
    every site (its GEMMs are too small for fp8's extra passes), so no GEMM takes fp8 operands;
    with fp8_sites=all (the negative control) they do. One layer at Llama-3-8B's width over 1024
    tokens: its MLP, q and output projections win, its k / v projections (N = 1024) do not, and
    the HLO has the fp8 GEMMs of the winning sites only."""
    one = targets.devices("h100", 1)
    small = dict(precision__fp8="delayed")
    assert not [g for g in model_gemms(compiled(one, {}, **small)) if "f8" in g.lhs + g.rhs]
    assert [g for g in model_gemms(compiled(one, {}, **small, precision__fp8_sites="all")) if "f8" in g.lhs + g.rhs]
    wide = recipe("tiny", model__num_layers=1, model__embed_dim=4096, model__num_heads=32, model__num_kv_heads=8,
                  model__mlp_dim=14336, train__batch_size=1, train__seq_len=1024, precision__compute_dtype="bfloat16",
                  precision__fp8="delayed", mesh__data=1)
    program = setup(wide, 256, one)
    text = compiled_train_step(program).as_text()
    chosen = {site.split()[0]: d["fp8"] for site, d in program.spec.policy.fp8_choice.decisions.items()}
    assert chosen == {"btd,dhk->bthk": True, "btd,dgk->btgk": False, "bthk,hkd->btd": True, "btd,df->btf": True, "btf,fd->btd": True}
    fp8_specs = {BLOCK_SPEC.search(g.op_name).group(1) for g in model_gemms(text) if g.lhs.startswith("f8")}
    assert {"btd,df->btf", "btf,fd->btd", "bthk,hkd->btd"} <= fp8_specs and "btd,dgk->btgk" not in fp8_specs


@pytest.mark.slow
def test_fp8_sites_auto_prices_an_input_the_sites_share_once_and_the_kernels_agree(monkeypatch):
    """At `llama_1b`'s widths (a microbatch of 16 x 2048) the k and v projections read q's input,
    whose fp8 copies XLA writes for all three from one pass: priced so, they run in fp8, and the
    kernel model of the compiled two-layer step agrees it is faster than with them in bf16 (the
    negative control: each input priced as quantised alone keeps k / v bf16)."""
    from lm.compiler import steptime

    def step(**overrides):
        c = recipe("llama_1b", model__num_layers=2, train__batch_size=16, train__grad_accum=1, precision__fp8="delayed", **overrides)
        program = setup(c, 32768, targets.devices("h100", 1))
        text = compiled_train_step(program).as_text()
        chosen = {site: d["fp8"] for site, d in program.spec.policy.fp8_choice.decisions.items()}
        return steptime.predict(text, "h100").step_s, chosen

    shared, shared_sites = step()
    assert all(shared_sites.values()) and any("(input shared)" in site for site in shared_sites)
    _kv_sites_in_bf16(monkeypatch)
    alone, alone_sites = step()
    assert [site.split()[0] for site, fp8 in alone_sites.items() if not fp8] == ["btd,dgk->btgk"]
    assert shared < alone, (shared, alone)


def test_fsdp_gathers_the_weights_fp8_sites_quantise_as_their_fp8_copies(h100s):
    """Under FSDP a site's weight is quantised on each device's shard and all-gathered as fp8
    (Megatron's --fp8-param-gather): the layer loop's gathers move half the bytes of bf16's.
    Negative control: the same model without fp8 gathers bf16."""
    def gathered(**overrides):
        text = compiled(h100s, {"fsdp": 8}, **overrides)
        return {shape: dtype for dtype, shape in hlo.collective_buffers(text, "all-gather")}, \
            sum(b for (op, _), b in hlo.collective_traffic(text).items() if op == "all-gather")

    bf16_types, bf16_bytes = gathered()
    fp8_types, fp8_bytes = gathered(precision__fp8="delayed", precision__fp8_sites="all")
    assert "f8e4m3fn" in fp8_types.values() and "f8e4m3fn" not in bf16_types.values()
    # The blocks' weights are most of what is gathered; the embedding table stays bf16.
    assert fp8_bytes < 0.6 * bf16_bytes, (fp8_bytes, bf16_bytes)


def _llama_1b_layers(layers: int = 2, **overrides) -> str:
    """The optimized HLO of `llama_1b`'s GEMM shapes (one microbatch of 16 x 2048, `layers`
    layers, remat `dots`) on one H100: where the kernel cache has XLA's real choices (the
    weight-gradient GEMMs as Triton fusions that read either layout). XLA's own GEMM fusions in
    bf16 as under fp8 (`train.gemm_fusion=auto` differs between them), so their passes compare."""
    return compiled_train_step(setup(recipe("llama_1b", model__num_layers=layers, train__batch_size=16, train__grad_accum=1,
                                            **{"train__gemm_fusion": "operands", **overrides}), 32768, targets.devices("h100", 1))).as_text()


@pytest.mark.slow
def test_swiglus_backward_writes_both_fp8_gradients_in_the_pass_that_makes_them(monkeypatch):
    """fp8 delayed, `llama_1b`'s GEMM shapes (2 layers, one microbatch of 16 x 2048): with SwiGLU's
    backward written by hand (`lm.model.swiglu`) XLA writes the gate's and up's output gradients
    as e5m2 in the kernel that computes them. Negative control: autodiff's backward of
    `jax.nn.silu(g) * u`, where one of them leaves that kernel in bf16 and is read again to be
    quantised: its bf16 bytes twice more a layer."""
    from lm.model import layers as layers_module

    def hbm_bytes():
        text = _llama_1b_layers(2, precision__fp8="delayed")
        return sum(k.count * k.bytes for k in kernels.table(text))

    by_hand = hbm_bytes()
    monkeypatch.setattr(layers_module, "swiglu", lambda g, u: jax.nn.silu(g) * u)
    gradient = 16 * 2048 * 8192 * 2  # one layer's [16, 2048, 8192] bf16 gradient
    assert hbm_bytes() - by_hand >= 0.9 * 2 * 2 * gradient  # 2 layers, written and read again (2.15 GB more seen)


@pytest.mark.slow
def test_an_input_several_fp8_sites_read_is_quantised_once(monkeypatch):
    """fp8 delayed, `llama_1b`'s GEMM shapes (2 layers, one microbatch of 16 x 2048): k and v
    quantise the attention's input under q's scale, gate the MLP's under up's
    (`Policy.matmul(shares_input=...)`), so XLA writes each input's fp8 copy once: the step moves
    at least those 3 copies a layer less ([16, 2048, 2048] e4m3 each; 1.8 GB less seen). Negative
    control: each site its own scale."""
    from lm.model.precision import Policy

    def hbm_bytes():
        return passes.count(_llama_1b_layers(2, precision__fp8="delayed"))["hbm_bytes"]

    shared = hbm_bytes()
    monkeypatch.setattr(Policy, "quantising_site", lambda self, *a: None)
    assert hbm_bytes() - shared >= 2 * 3 * 16 * 2048 * 2048


def _kv_sites_in_bf16(monkeypatch):
    """`fp8_sites=auto` as it chose before shared inputs were priced: q, o and the MLP in fp8, the
    narrow k / v projections bf16 (in fp8 their [2048, 512] weights are transposed as fp8 data,
    0.27 GB a `llama_1b` step, PERFORMANCE.md), for the tests of that structure."""
    from lm.compiler import steptime

    monkeypatch.setattr(steptime, "FP8_SHARED_INPUT_BYTES", steptime.FP8_PASS_BYTES)


@pytest.mark.slow
def test_fp8_current_scaling_reduces_each_tensor_once_and_never_transposes_fp8_data(monkeypatch):
    """Point 3 of the fp8 issue, counted on the compiled step (`lm.compiler.passes`), the sites
    `fp8_sites=auto` picks at `llama_1b`'s widths (q, o and the MLP; k / v stay bf16). Per layer
    the forward quantises 9 tensors once each (the attention and MLP inputs, the attention
    output, the SwiGLU product, 5 weights), each fp8 copy written from wider data in the layout
    its GEMM reads: no transpose of fp8 data, and no transposed copy of the float32 weights
    either (the weights' layout is pinned: XLA transposes each as it quantises it). The scales
    are kept through remat, so the backward pass reduces only the 5 output gradients: the
    step's max-reductions are one amax per quantised tensor (XLA splits a large one in two
    kernels). Negative control: remat that keeps no scales (the structure before) reduces x and
    w again in the backward."""
    _kv_sites_in_bf16(monkeypatch)
    layers, tensors, gradients = 2, 9, 5
    bf16 = passes.count(_llama_1b_layers(layers))
    current = passes.count(_llama_1b_layers(layers, precision__fp8="current"))
    assert current["fp8_transposes"] == 0 and current["quantising"]["forward"] == tensors * layers
    forward_amaxes = current["amax_reductions"]["forward"] - bf16["amax_reductions"]["forward"]
    assert forward_amaxes <= 2 * tensors * layers and current["amax_reductions"]["backward"] <= 2 * gradients * layers
    # Beyond the amaxes, XLA may recompute a layer's two RMS norms once more to feed their amaxes.
    extra = current["reduction_fusions"] - bf16["reduction_fusions"]
    assert extra <= forward_amaxes + current["amax_reductions"]["backward"] + 2 * layers
    assert current["hbm_bytes"] < 1.1 * bf16["hbm_bytes"]

    dots = remat_module._SAVEABLE["dots"]
    monkeypatch.setitem(remat_module._SAVEABLE, "dots", jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.checkpoint_dots, jax.checkpoint_policies.save_only_these_names(MATMUL, BATCHED_MATMUL)),
        remat_module._saves_flash_attention))
    assert remat_module._SAVEABLE["dots"] is not dots
    before = passes.count(_llama_1b_layers(layers, precision__fp8="current"))
    assert before["amax_reductions"]["backward"] > 2 * gradients * layers
    assert before["reduction_fusions"] > current["reduction_fusions"] and before["hbm_bytes"] > current["hbm_bytes"]


@pytest.mark.slow
def test_fp8_weights_are_written_in_both_layouts_by_one_pass_not_copied_transposed_in_float32(monkeypatch):
    """An fp8 GEMM reads its weight with the contracted axes minor, the input-gradient GEMM with
    the free axes minor (as stored). Left to itself, XLA met the forward's need by giving the layer
    loop the float32 weight stacks in that layout: a transposed float32 copy of every weight, each
    step (8 bytes a parameter moved, 4 kept: 10.5 GiB on the wide proxy, which then did not fit
    an H100). Pinned to its stored layout (`Policy.pin_weight_layouts`, where each device holds
    whole weights), each of the 5 fp8 weights a layer is written in both layouts by one kernel
    (remat `none`: nothing recomputed) and the step moves no byte through a transpose, as in
    bf16. Negative control: without the pin the transposed copies are back and no kernel writes
    both layouts."""
    needs_the_named_fp8_algorithm()
    _kv_sites_in_bf16(monkeypatch)
    layers, weights = 2, 5
    fp8 = passes.count(_llama_1b_layers(layers, precision__fp8="delayed", model__remat="none"))
    assert fp8["both_layouts"] >= weights * layers and fp8["fp8_transposes"] == 0
    assert fp8["transpose_bytes"] == 0 == passes.count(_llama_1b_layers(layers))["transpose_bytes"]
    monkeypatch.setattr(precision_module, "with_layout_constraint", lambda x, layout: x)
    unpinned = passes.count(_llama_1b_layers(layers, precision__fp8="delayed", model__remat="none"))
    assert unpinned["transpose_bytes"] > 0 and unpinned["both_layouts"] < weights * layers


@pytest.mark.slow
def test_fp8_weights_are_quantised_once_a_step_not_once_per_microbatch(monkeypatch):
    """With gradient accumulation the step quantises each fp8 weight stack once, before the
    microbatch loop (`lm.model.fp8_weights`), and reduces its amaxes once; the activations are
    still quantised per microbatch. Counted on the compiled step of `llama_1b`'s GEMM shapes (2
    layers scanned, 2 microbatches of 8; `fp8_sites=auto` runs all 7 weights a layer in fp8) as
    the weights' elements the forward's quantising kernels write in fp8: every weight once.
    Negative control: quantising inside the passes (as before) writes them once per microbatch.
    (Elements, not kernels: inside the passes XLA's dot merger may join q, k and v's GEMMs at this
    microbatch and quantise their three weights in one kernel.)"""
    from lm.compiler.hlo import buffers
    from lm.compiler.hlo_module import Module
    from lm.program.steps import Program

    layers, accum, microbatch, seq = 2, 2, 8, 2048
    d, kv, f = 2048, 512, 8192
    weight_elements = layers * (2 * d * d + 2 * d * kv + 3 * d * f)  # q, o; k, v; up, gate, down

    def quantised_weight_elements():
        c = recipe("llama_1b", model__num_layers=layers, model__scan_layers=True, train__batch_size=16, train__grad_accum=accum,
                   precision__fp8="delayed")
        text = compiled_train_step(setup(c, 32768, targets.devices("h100", 1))).as_text()
        module = Module(text)
        rows = {(k, r.name): r for k, body in module.bodies.items() for r in body}
        total, counted = 0, passes.count(text)
        for k in kernels.table(text):
            i = rows[(k.computation, k.name)]
            if passes.BACKWARD in i.rest or k.kind == "gemm_fp8" or any(passes._fp8(module.types.get(o, "")) for o in i.operands):
                continue  # the backward's, a GEMM, or reading fp8 (a slice or transpose of a copy)
            for t, dims in buffers(i.type):
                if t.startswith("f8") and dims[:2] != (microbatch, seq):  # a weight's copy, not an activation's
                    total += k.count * math.prod(dims)
        return total, counted

    once, once_passes = quantised_weight_elements()
    monkeypatch.setattr(Program, "_fp8_weights_once", lambda self: False)
    per_microbatch, per_microbatch_passes = quantised_weight_elements()
    assert once == weight_elements and per_microbatch == accum * weight_elements, (once, per_microbatch, weight_elements)
    assert once_passes["amax_reductions"]["backward"] < per_microbatch_passes["amax_reductions"]["backward"]


@pytest.mark.slow
def test_bf16_weights_are_cast_once_a_step_not_once_per_microbatch(monkeypatch):
    """With gradient accumulation in bf16 the step casts each block matmul's float32 weights
    before the microbatch loop (`lm.model.cast_weights`): kernels writing a weight's bf16 copy
    run once a step per weight, not per layer per microbatch (and again in remat's recomputed
    forward). Counted on the compiled step of `llama_1b`'s shapes (2 layers, scanned, 2
    microbatches of 8, remat `dots`), with XLA's own GEMM fusions (`train.gemm_fusion=elementwise`
    takes each cast into the GEMM that reads it, and no cast is a kernel). Negative control:
    casting inside the passes."""
    from lm.compiler import kernels
    from lm.program.steps import Program

    layers, accum = 2, 2
    weights = {(2048, 32, 64), (2048, 8, 64), (32, 64, 2048), (2048, 8192), (8192, 2048)}  # q; k and v; o; gate and up; down

    def cast_runs():
        c = recipe("llama_1b", model__num_layers=layers, model__scan_layers=True, train__batch_size=16, train__grad_accum=accum,
                   train__gemm_fusion="operands")
        text = compiled_train_step(setup(c, 32768, targets.devices("h100", 1))).as_text()
        runs = 0
        for k in kernels.table(text):
            m = re.match(r"\(?bf16\[([\d,]+)\]", k.shape)
            dims = tuple(int(d) for d in m.group(1).split(",")) if m else ()
            op_name = re.search(rf'%?{re.escape(k.name)} = [^\n]*op_name="([^"]*)"', text)
            if dims[:1] in ((1,), (layers,)) and dims[1:] in weights and op_name and op_name.group(1).endswith("convert_element_type"):
                runs += k.count  # one layer's weight or the stack's, cast to bf16
        return runs

    once = cast_runs()
    monkeypatch.setattr(Program, "_weights_cast_once", lambda self: False)
    per_microbatch = cast_runs()
    assert 0 < once <= 7, once  # a run per weight stack: q, k, v, o, gate, up, down
    assert per_microbatch >= 7 * layers * accum, per_microbatch


@pytest.mark.slow
def test_the_optimizer_update_is_one_pass_over_parameters_gradients_and_moments(monkeypatch):
    """AdamW after gradient accumulation, counted on the compiled step of `llama_1b`'s shapes (2
    layers, 2 microbatches of 8): the kernels writing parameter-shaped float32 arrays once a step
    (zero fills aside) move 32 bytes a parameter within 10%, the hand count of one fused pass
    (read the parameter, both moments and the gradient, which XLA adds from the accumulated sum
    and the last microbatch's inside the pass; write the parameter and both moments). Negative
    control: the updates materialised before they are applied (an optimisation barrier) cost a
    second pass, 40 and more."""
    import optax

    from lm.compiler import kernels

    def bytes_per_parameter():
        c = recipe("llama_1b", model__num_layers=2, train__batch_size=16, train__grad_accum=2)
        program = setup(c, 32768, targets.devices("h100", 1))
        params = jax.tree.leaves(program.abstract_sharded_state().params)
        shapes = {"f32[" + ",".join(map(str, a.shape)) + "]" for a in params}
        moved = 0.0
        for k in kernels.table(compiled_train_step(program).as_text()):
            first = re.match(r"\(?(f32\[[\d,]*\])", k.shape)
            if k.count == 1 and k.kind == "elementwise" and first and first.group(1) in shapes and "broadcast" not in k.name:
                moved += k.bytes
        return moved / sum(a.size for a in params)

    fused = bytes_per_parameter()
    apply = optax.apply_updates
    monkeypatch.setattr(optax, "apply_updates", lambda p, u: apply(p, jax.lax.optimization_barrier(u)))
    split = bytes_per_parameter()
    assert abs(fused / 32 - 1) < 0.10 and split > 1.25 * 32, (fused, split)


def test_the_fp8_transpose_count_sees_a_transposed_fp8_operand():
    """The detector above can fail: an fp8 array written again transposed is one transpose of
    fp8 data."""
    one = targets.devices("h100", 1)[0]
    q = jax.ShapeDtypeStruct((512, 256), jnp.float8_e4m3fn, sharding=jax.sharding.SingleDeviceSharding(one))
    text = jax.jit(jnp.transpose).lower(q).compile().as_text()
    assert passes.count(text)["fp8_transposes"] >= 1


MOE = dict(model__num_experts=16, model__experts_per_token=2, model__expert_mlp_dim=128)


def _ragged_gemm_shapes(text: str) -> list[tuple[int, ...]]:
    """Result shapes of the GEMMs XLA made of `jax.lax.ragged_dot` (by their op_name)."""
    out = []
    for line in text.splitlines():
        if "ragged_dot_general" in line and (m := re.search(r"= (\w+)\[([\d,]+)\]\S* dot\(", line)):
            out.append(tuple(int(d) for d in m.group(2).split(",")))
    return out


@pytest.mark.slow
def test_an_expert_parallel_mixture_of_experts_compiles_with_ragged_all_to_alls_and_grouped_gemms(h100s):
    """16 experts on {expert: 8}: 2 per GPU, each GPU's 256 tokens x 2 choices sent by
    `ragged_all_to_all` (only the real rows, one slice per device and expert; received into room
    for 8 x 512) and brought back the same way, per MoE layer and direction (the per-expert counts
    all-gathered). `grouped_gemm=auto` in bf16 runs meshlm's Pallas grouped GEMMs: no dense GEMM
    over every received row, and the kernel table counts each grouped GEMM's FLOPs as its expected
    rows' (the even share, 512 of the 4096: 2 x 512 x 128 x 128 per product; per layer and step
    3 matmuls x forward, input and weight gradients, gate's and up's input gradients summed in one
    kernel: 8 kernels, 9 products). Negative controls: `grouped_gemm=xla` runs every received row through both local
    experts (their weights concatenated: 256 = 2 x 128 columns, jax <= 0.11's XLA:GPU); capacity
    mode runs batched GEMMs, no ragged_dot, and fixed all-to-alls."""
    from lm.compiler import kernels

    text = compiled(h100s, {"expert": 8}, **MOE)
    ops = hlo.collectives(text)
    assert ops["ragged-all-to-all"] >= 2 * 2 * 2, ops  # 2 layers x (dispatch, combine) x (forward, backward) at least
    exchanged = {n: b for (op, n), b in hlo.collective_traffic(text).items() if op == "all-to-all"}
    assert not exchanged or (list(exchanged) == [8] and exchanged[8] < 2**16), exchanged  # counts and offsets only
    assert not _ragged_gemm_shapes(text)
    grouped = [k for k in kernels.table(text) if k.kind == "grouped_gemm"]
    product = 2.0 * 512 * 128 * 128
    assert sum(k.count for k in grouped) == 2 * 8, grouped  # 2 layers
    assert sum(k.count * k.flops for k in grouped) == 2 * 9 * product and {k.flops for k in grouped} == {product, 2 * product}
    dense = compiled(h100s, {"expert": 8}, model__grouped_gemm="xla", **MOE)
    shapes = _ragged_gemm_shapes(dense)
    assert (256, 4096) in shapes or (4096, 256) in shapes, shapes  # all 4096 rows x both local experts
    assert not [k for k in kernels.table(dense) if k.kind == "grouped_gemm"]
    # Dispatched in 2 chunks, XLA's schedule runs one chunk's exchanges beside the other's grouped
    # GEMMs (Pallas kernels between a ragged all-to-all's start and done): more of them hidden.
    overlapped = hlo.overlapped_collectives(text)["ragged-all-to-all"]
    chunked = compiled(h100s, {"expert": 8}, model__expert_dispatch_chunks=2, **MOE)
    assert hlo.collectives(chunked)["ragged-all-to-all"] == 2 * ops["ragged-all-to-all"]
    assert hlo.overlapped_collectives(chunked)["ragged-all-to-all"] > max(overlapped, ops["ragged-all-to-all"] // 2), (overlapped, hlo.overlapped_collectives(chunked))
    capacity = compiled(h100s, {"expert": 8}, model__expert_capacity_factor=1.25, **MOE)
    assert not _ragged_gemm_shapes(capacity) and not hlo.collectives(capacity)["ragged-all-to-all"]
    assert sum(b for (op, _), b in hlo.collective_traffic(capacity).items() if op == "all-to-all") > 2**20


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pallas_grouped_gemms_compile_inside_the_lockstep_pipelines_vmap_over_stages(h100s, schedule):
    """Dropless experts on {stage: 2, expert: 4} under GPipe and 1F1B: the experts' `shard_map`
    runs inside the pipelines' vmap over stages, and so do meshlm's Pallas kernels and their
    kernels, batched over the stages (jax 0.10 to 0.12 failed to trace this where the shard_map
    checked its mesh-axis types: `sharding.per_shard`). 4 layers, 2 a stage, each device's
    microbatch 128 tokens x 2 choices: each grouped GEMM's FLOPs its 256 expected rows', the
    batched kernels read as such. GPipe: 5 ticks (4 microbatches, 2 stages) x 2 layers x 12
    products (the forward's 3 twice, remat; the input gradients' 3 in 2 kernels; the weights' 3)."""
    from lm.compiler import kernels

    text = compiled(h100s, {"stage": 2, "expert": 4}, model__num_layers=4, train__batch_size=16, pipeline__microbatches=4,
                    pipeline__schedule=schedule, **MOE)
    grouped = [k for k in kernels.table(text) if k.kind == "grouped_gemm"]
    product = 2.0 * 256 * 128 * 128
    assert grouped and {k.flops for k in grouped} == {product, 2 * product} and not _ragged_gemm_shapes(text), grouped
    if schedule == "gpipe":
        assert sum(k.count * k.flops for k in grouped) == 5 * 2 * 12 * product
    assert hlo.collectives(text)["ragged-all-to-all"] >= 2 * 2 * 2 and hlo.collectives(text)["collective-permute"] >= 2


# The negative controls of the two tests below show what jax 0.10.2's XLA does to these programs;
# XLA 0.11 and 0.12 do neither (Python 3.12 with jax 0.11.2 or 0.12.0.1), so there they have nothing to show.
XLA_0_10 = jax.__version_info__ < (0, 11)


def _transposed_expert_stacks(text):
    from lm.compiler import kernels

    return [k for k in kernels.table(text) if k.kind in ("transpose", "copy") and "16,128,128" in k.shape.replace("128,16,128", "16,128,128")]


@pytest.mark.slow
def test_fsdp_gathers_the_experts_for_the_grouped_gemm_without_transposing_them(h100s):
    """{fsdp: 8}, dropless, bf16: each expert weight gathered along its first axis as [d, e, f]
    and its float32 gradient reduce-scattered so, each GPU's 256 tokens x 2 rows through the
    grouped GEMMs (FLOPs of its 512 rows), no kernel transposing a whole expert weight stack."""
    from lm.compiler import kernels

    text = compiled(h100s, {"fsdp": 8}, **MOE)
    grouped = [k for k in kernels.table(text) if k.kind == "grouped_gemm"]
    assert sum(k.count for k in grouped) == 2 * 8 and sum(k.count * k.flops for k in grouped) == 2 * 9 * 2.0 * 512 * 128 * 128
    assert not _transposed_expert_stacks(text), _transposed_expert_stacks(text)


@pytest.mark.skipif(not XLA_0_10, reason="XLA 0.11 and later do not transpose the experts gathered along embed: no negative control")
def test_experts_gathered_along_embed_are_transposed_by_xla(h100s):
    """The negative control of the test above: `grouped_gemm=xla` gathers along embed, the
    experts' second axis, and XLA 0.10.2 transposes every gathered stack."""
    assert _transposed_expert_stacks(compiled(h100s, {"fsdp": 8}, model__grouped_gemm="xla", **MOE))


def _qwen3_width_layers():
    """Four Qwen3-30B-A3B-width layers (16 experts of 2048 x 768) on {fsdp: 8}."""
    from lm.recipe import load_file

    c = load_file(str(ROOT / "configs" / "qwen3_30b_a3b.py"))
    c.model.update(num_layers=4, num_experts=16, experts_per_token=2)
    c.data.vocab_size = 1024
    c.train.update(batch_size=8, seq_len=512, grad_accum=1)
    c.mesh.update(data=1, fsdp=8, expert=1)
    return c


def _expert_gradient_copies(h100s) -> int:
    from lm.compiler import kernels

    text = compiled_train_step(setup(_qwen3_width_layers(), 1024, h100s)).as_text()
    return sum(k.count for k in kernels.table(text) if k.kind == "copy" and k.shape == "f32[2048,16,768]")


@pytest.mark.slow
def test_fsdp_programs_double_buffer_the_layer_loop_so_pipelined_gradients_are_not_copied(h100s):
    """With the weights split by FSDP, XLA pipelines the layer loop's reduce-scatters into the
    next iteration; unrolled by two (targets.SHARDED_WEIGHTS_OPTIONS) the iterations alternate
    buffers: four Qwen3-30B-A3B-width layers on {fsdp: 8} copy none of the expert gradients."""
    assert targets.SHARDED_WEIGHTS_OPTIONS.items() <= targets.compiler_options(h100s[0], sharded_weights=True).items()
    assert not targets.SHARDED_WEIGHTS_OPTIONS.items() <= targets.compiler_options(h100s[0]).items()
    assert _expert_gradient_copies(h100s) == 0


@pytest.mark.skipif(not XLA_0_10, reason="XLA 0.11 and later do not copy the pipelined gradients: no negative control")
def test_without_double_buffering_xla_copies_each_pipelined_gradient(h100s, monkeypatch):
    """The negative control of the test above: without the option, XLA 0.10.2 copies the three
    expert weights' float32 gradients in 3 of the 4 iterations."""
    monkeypatch.setattr(targets, "SHARDED_WEIGHTS_OPTIONS", {})
    assert _expert_gradient_copies(h100s) == 3 * 3
