"""LoRA: adapters that leave the base model as it was at initialisation, train alone (no
gradients or optimizer state for the frozen base), and leave as PEFT's format or merged."""

import jax
import numpy as np
import pytest
from conftest import ROOT, VOCAB, assert_one_line_error, run_cli, small_config

from lm.program.steps import setup

ADAPTED = ("lora_q", "lora_k", "lora_v", "lora_o", "lora_gate", "lora_up", "lora_down")


def flat(tree: dict, prefix: str = "") -> dict:
    from flax import traverse_util

    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


def logits(program, params, tokens):
    import sharding

    with sharding.activate(program.mesh, program.rules):
        return np.asarray(jax.jit(lambda m, t: m(t)[0])(program.abstract_model.model(params), tokens))


def test_lora_at_initialisation_is_the_base_model_and_trains_only_the_adapters():
    base = setup(small_config({"data": 1}), VOCAB, jax.devices()[:1])
    lora = setup(small_config({"data": 1}, lora__rank=4, lora__targets="all"), VOCAB, jax.devices()[:1])
    base_state = base.init_state(0)
    state = lora.init_from(0, jax.device_get(base_state.params))  # the base's weights, new adapters
    params = flat(jax.device_get(state.params))
    assert {p.split("/")[-2] for p in params if "/lora_" in p} == set(ADAPTED)
    assert all(not np.any(v) for p, v in params.items() if p.endswith("/b"))  # B starts at zero ...
    assert all(np.any(v) for p, v in params.items() if p.endswith("/a"))  # ... A does not
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16)).astype(np.int32)
    assert np.array_equal(logits(lora, state.params, tokens), logits(base, base_state.params, tokens))
    # the optimizer keeps moments for the adapters alone
    moments = [leaf.size for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim > 0]
    adapter_size = sum(v.size for p, v in params.items() if "/lora_" in p)
    assert sum(moments) == 2 * adapter_size
    rng = np.random.default_rng(1)
    for _ in range(3):
        batch = rng.integers(0, VOCAB, (16, 33)).astype(np.int32)
        state, metrics = lora.train_step(state, lora.global_batch(batch))
    after = flat(jax.device_get(state.params))
    changed = {p for p in params if not np.array_equal(params[p], after[p])}
    assert changed == {p for p in params if "/lora_" in p}  # every adapter moved, nothing else
    assert not np.array_equal(logits(lora, state.params, tokens), logits(base, base_state.params, tokens))


def test_lora_compiles_and_trains_under_fsdp_and_tensor_parallelism_as_on_one_device():
    """{fsdp 2, tensor 2}: the same losses as one device, the adapters split as their weights."""
    from conftest import run_steps

    one, _ = run_steps(small_config({"data": 1}, lora__rank=4), jax.devices()[:1], steps=3)
    split, _ = run_steps(small_config({"fsdp": 2, "tensor": 2}, lora__rank=4), jax.devices()[:4], steps=3)
    np.testing.assert_allclose(split, one, rtol=2e-5)
    program = setup(small_config({"fsdp": 2, "tensor": 2}, lora__rank=4), VOCAB, jax.devices()[:4])
    shardings = flat(program.abstract_model.param_shardings)
    wq, b = tuple(shardings["blocks/attn/wq"].spec), tuple(shardings["blocks/attn/lora_q/b"].spec)
    assert b == wq[:1] + (None,) + wq[2:] and "tensor" in str(b)  # B [layers, rank, heads, head_dim]: heads over tensor, as wq's


def test_lora_dropout_masks_each_tokens_adapter_inputs_by_its_own_key():
    """PEFT's lora_dropout: inputs zeroed at the rate, the rest scaled by 1 / (1 - rate); the mask
    is a function of the token's key, the layer and the target (the same again, another for each)."""
    import jax.numpy as jnp

    from lm.model import lora

    keys = lora.token_keys(lora.dropout_keys(0, 7, 4), 64)
    x = jnp.ones((4, 64, 256), jnp.float32)

    def dropped(layer, target="q", keys=keys):
        with lora.dropout(0.25, keys), lora.in_layer(layer):
            return np.asarray(lora._dropped(x, target))

    y = dropped(0)
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    assert abs((y == 0).mean() - 0.25) < 0.01
    np.testing.assert_array_equal(dropped(0), y)  # a function of the keys
    for other in (dropped(1), dropped(0, "v"), dropped(0, keys=lora.token_keys(lora.dropout_keys(0, 8, 4), 64))):
        assert 0.3 < ((other == 0) != (y == 0)).mean() < 0.45  # another layer, target, step: independent masks (2 p (1 - p))
    assert (y[0] != y[1]).any() and (y[:, 0] != y[:, 1]).any()  # rows and positions differ
    with lora.dropout(0.25, None):  # no keys (evaluation, generation): no dropout
        assert lora._dropped(x, "q") is x


@pytest.mark.slow
def test_lora_dropout_drops_the_same_values_on_any_mesh_and_microbatching():
    """With dropout 0.1 the losses of {fsdp 2, tensor 2, data 2}, of {context 2, data 2} (the
    sequence reordered: the keys with it) and of 2 accumulated microbatches equal one device's
    (each token's mask comes from its place in the global batch); dropout 0 gives other losses
    (negative control)."""
    from conftest import run_steps

    options = dict(lora__rank=4, lora__dropout=0.1, optim__lr=0.03)
    one, _ = run_steps(small_config({"data": 1}, **options), jax.devices()[:1], steps=3)
    split, _ = run_steps(small_config({"fsdp": 2, "tensor": 2, "data": 2}, **options), jax.devices()[:8], steps=3)
    accumulated, _ = run_steps(small_config({"data": 1}, train__grad_accum=2, **options), jax.devices()[:1], steps=3)
    context, _ = run_steps(small_config({"context": 2, "data": 2}, **options), jax.devices()[:4], steps=3)
    np.testing.assert_allclose(split, one, rtol=2e-5)
    np.testing.assert_allclose(context, one, rtol=2e-5)
    np.testing.assert_allclose(accumulated, one, rtol=2e-5)
    plain, _ = run_steps(small_config({"data": 1}, **dict(options, lora__dropout=0.0)), jax.devices()[:1], steps=3)
    assert plain[0] == one[0] and np.abs(plain - one).max() > 3e-4  # (B starts at 0: the first step's loss is the base's)


MOE = dict(model__num_experts=4, model__experts_per_token=2, model__expert_mlp_dim=64, lora__rank=4, lora__targets="all")


@pytest.mark.slow
@pytest.mark.parametrize("factor", [0.0, 2.0], ids=["dropless", "capacity"])
def test_expert_adapters_train_alone_and_split_over_experts_as_on_one_device(factor):
    """`lora.targets=experts`: every expert's gate / up (one A for both) and down adapted, dropless
    and with a capacity; {expert 2, fsdp 2, tensor 2} (the adapters split as their experts, gathered
    along embed, the rank-wide products summed over tensor) gives one device's losses, and only
    the adapters move."""
    from conftest import run_steps

    moe = dict(MOE, model__expert_capacity_factor=factor, optim__lr=0.03)
    program = setup(small_config({"data": 1}, **moe), VOCAB, jax.devices()[:1])
    params = flat(jax.device_get(program.init_state(0).params))
    assert {p.rpartition("/")[0] for p in params if "/lora_" in p} >= {"blocks/mlp/lora_experts", "blocks/attn/lora_q"}
    assert params["blocks/mlp/lora_experts/a_in"].shape == (2, 4, 64, 4)  # [layers, experts, embed, rank]
    one, after = run_steps(small_config({"data": 1}, **moe), jax.devices()[:1], steps=3)
    split, _ = run_steps(small_config({"expert": 2, "fsdp": 2, "tensor": 2}, **moe), jax.devices()[:8], steps=3)
    np.testing.assert_allclose(split, one, rtol=2e-5)
    changed = {p for p in params if not np.array_equal(params[p], flat(after)[p])}
    assert changed == {p for p in params if "/lora_" in p}  # every adapter moved (the experts' too), nothing else
    frozen, _ = run_steps(small_config({"data": 1}, **dict(moe, lora__targets="q,k,v,o")), jax.devices()[:1], steps=3)
    assert np.abs(frozen - one).max() > 1e-4  # negative control: the experts' adapters change the losses


V = dict(model__num_layers=4)  # two chunks a stage of 2


@pytest.mark.parametrize("schedule, extra", [
    pytest.param("gpipe", {}, marks=pytest.mark.slow), ("1f1b", {}), pytest.param("1f1b_per_stage", {}, marks=pytest.mark.slow),
    pytest.param("zero_bubble", {}, marks=pytest.mark.slow), pytest.param("zbv", V, marks=pytest.mark.slow)])
def test_expert_adapters_train_under_each_pipeline_program_as_on_one_device(schedule, extra):
    """LoRA on attention and every expert through the pipeline programs on {stage 2, expert 2,
    data 2}: GPipe, lockstep 1F1B, per stage, zero-bubble (the adapters' weight gradients in W,
    from B's taps) and the V (DualPipeV's code too): one device's losses."""
    from conftest import run_steps

    moe = dict(MOE, optim__lr=0.03, **extra)
    one, _ = run_steps(small_config({"data": 1}, train__grad_accum=2, **moe), jax.devices()[:1], steps=3)
    staged, _ = run_steps(small_config({"stage": 2, "expert": 2, "data": 2}, pipeline__schedule=schedule, **moe), jax.devices()[:8], steps=3)
    np.testing.assert_allclose(staged, one, rtol=2e-5)


def test_bad_lora_settings_are_one_line(capsys, tmp_path):
    from lm import train

    cases = {
        "lora.rank=-1": ("lora.rank=-1",),
        "lora.targets=q,attn": ("no matmul named attn",),
        "lora.dropout=1.0": ("lora.dropout=1.0 must be in [0, 1)",),
        "mesh.stage=2 --config.lora.dropout=0.1": ("pipeline stages", "no per-token randomness"),
    }
    for setting, fragments in cases.items():
        result = run_cli(capsys, train.main, "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", *f"--config.{setting}".split(),
                         "--config.lora.rank=4" if not setting.startswith("lora.rank") else "--config.train.steps=1")
        assert_one_line_error(result, *fragments)
    moe = run_cli(capsys, train.main, "--config=configs/moe_tiny.py", f"--workdir={tmp_path / 'run'}", "--config.lora.rank=4")
    assert_one_line_error(moe, "gate, up, down match(es) no matmul", "adapted here: q, k, v, o, experts")
    dense = run_cli(capsys, train.main, "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", "--config.lora.rank=4",
                    "--config.lora.targets=q,experts")
    assert_one_line_error(dense, "experts match(es) no matmul")
    dropped = run_cli(capsys, train.main, "--config=configs/moe_tiny.py", f"--workdir={tmp_path / 'run'}", "--config.lora.rank=4",
                      "--config.lora.targets=q,experts", "--config.lora.dropout=0.05")
    assert_one_line_error(dropped, "lora.dropout=0.05 with lora.targets naming experts")
    assert not (tmp_path / "run").exists()


TARGETS = {"llama": "all", "mixtral": "all", "qwen3_moe": "all", "deepseek_v3": "q_a,q_b,kv_a,kv_b,o,experts"}  # (all: DeepSeek's dense MLPs too, which PEFT cannot take)


@pytest.fixture(scope="module", params=list(TARGETS))
def lora_run(tmp_path_factory, request):
    """A tiny HF model imported, then fine-tuned with LoRA (rank 4, every target the model has:
    Mixtral's and Qwen3-MoE's attention and experts; DeepSeek-V3's latent attention and experts)
    for 3 steps on random text, in float32: (the HF directory, the torch model, the run directory)."""
    pytest.importorskip("torch", reason="torch (the test extra; Python 3.11 only) is not installed")
    from hf_models import make_hf_model

    from lm import convert, train

    root = tmp_path_factory.mktemp("lora")
    model = make_hf_model(root / "hf", request.param, std=0.4 if request.param == "llama" else 0.2)
    corpus = root / "text.txt"
    corpus.write_text(" ".join(str(i) for i in range(3000)))
    run = root / "run"
    for main, argv in ((convert.main, ["from_hf", f"--hf={root / 'hf'}", f"--workdir={run}", "--config.train.seq_len=32",
                                       "--config.precision.compute_dtype=float32"]),
                       (train.main, [f"--workdir={run}", f"--config.data.path={corpus}", "--config.train.steps=3", "--config.train.batch_size=8",
                                     "--config.lora.rank=4", f"--config.lora.targets={TARGETS[request.param]}", "--config.optim.lr=0.01", "--config.optim.warmup_steps=0"])):
        from lm import cli

        try:
            cli.run(main, argv)
        except SystemExit as e:
            assert not e.code, (main, argv)
    return root / "hf", model, run


@pytest.mark.slow  # (it needs torch: the first stack runs it in any case)
def test_peft_loads_the_exported_adapters_and_the_merged_export_equals_them(tmp_path, lora_run, capsys):
    peft = pytest.importorskip("peft", reason="peft (the test extra; Python 3.11 only) is not installed")
    import torch
    import transformers

    from lm import convert
    from lm.program.restore import load

    from hf_models import VOCAB as HF_VOCAB

    hf_dir, _, run = lora_run
    result = run_cli(capsys, convert.main, "to_hf", f"--workdir={run}", f"--out={tmp_path / 'adapter'}", "--adapter")
    assert result.returncode == 0, result.stderr
    result = run_cli(capsys, convert.main, "to_hf", f"--workdir={run}", f"--out={tmp_path / 'merged'}", "--dtype=float32")
    assert result.returncode == 0, result.stderr
    tokens = np.random.default_rng(0).integers(0, HF_VOCAB, (2, 24))
    _, _, ours = load(run)
    mine = np.asarray(jax.jit(lambda m, t: m(t)[0])(ours, tokens))[..., :HF_VOCAB]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(torch.as_tensor(tokens)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(torch.as_tensor(tokens)).logits.numpy()
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(adapted - plain).max() > 1e-2  # the adapters changed the model
    scale = np.abs(mine).max()  # logits up to ~14: float32 sums in another order differ by ~2e-5
    assert np.abs(adapted - mine).max() <= 1e-5 * scale
    assert np.abs(merged - adapted).max() <= 1e-5 * scale


def test_the_planner_gives_frozen_weights_no_gradients_or_optimizer_state():
    """The cost model's state of a LoRA run: the base in the compute dtype without gradients or
    moments, the adapters with both (float32); against the full fine-tune's."""
    from conftest import recipe

    from lm.planner.memory import mesh_state_bytes
    from lm.planner.run import run_of

    mesh = tuple((a, 1) for a in ("data", "stage", "context", "expert", "fsdp", "tensor"))
    full = run_of(recipe("tiny", precision__compute_dtype="bfloat16"))
    lora = run_of(recipe("tiny", precision__compute_dtype="bfloat16", lora__rank=4))
    f, lo = mesh_state_bytes(full.state, mesh, False), mesh_state_bytes(lora.state, mesh, False)
    adapters = [leaf for leaf in lora.state if leaf.kind == "params" and leaf.trained]
    adapter_bytes = sum(leaf.device_bytes(dict(mesh)) for leaf in adapters)
    assert adapters and all("lora_" in leaf.path and leaf.itemsize == 4 for leaf in adapters)
    assert lo["grads"] == adapter_bytes
    assert 2 * adapter_bytes <= lo["opt_state"] < 2 * adapter_bytes + 1024  # the moments (and a few counters)
    assert lo["params"] == f["params"] // 2 + adapter_bytes  # the base in bf16: half its float32 bytes
    assert f["grads"] == f["params"]


@pytest.mark.slow
def test_a_lora_runs_checkpoints_hold_its_adapters_and_it_resumes_exactly(tmp_path, small_corpus):
    """Each step's checkpoint holds the adapters and their moments, the frozen base is kept once
    (`lora_base`); stopped at step 2 and resumed, the run's losses equal an unbroken run's (with
    LoRA dropout: a step's masks are the step's, restarted or not)."""
    from conftest import losses

    from lm import cli, train
    from lm.program.checkpoint import Checkpointer

    flags = [f"--config={ROOT}/configs/tiny.py", f"--config.data.path={small_corpus}", "--config.lora.rank=4", "--config.lora.dropout=0.1", "--config.train.log_every=1",
             "--config.checkpoint.every_steps=2", "--config.train.batch_size=8", "--config.train.seq_len=32", "--config.model.num_layers=2",
             "--config.precision.compute_dtype=float32", "--config.optim.decay_steps=4"]  # (the schedule independent of train.steps)
    for workdir, stops in ((tmp_path / "whole", (4,)), (tmp_path / "resumed", (2, 4))):
        for steps in stops:
            try:
                cli.run(train.main, [*flags, f"--workdir={workdir}", f"--config.train.steps={steps}"])
            except SystemExit as e:
                assert not e.code
    assert losses(tmp_path / "whole") == losses(tmp_path / "resumed")
    ckpt = Checkpointer(tmp_path / "resumed" / "checkpoints")
    saved = ckpt.manager.item_metadata(4)["state"]
    ckpt.close()
    params = flat(dict(saved["params"]))
    assert params and all("/lora_" in p for p in params)  # the adapters alone
    assert (tmp_path / "resumed" / "lora_base" / "0").is_dir()


def test_a_deepseek_runs_dense_mlp_adapters_are_refused_in_peft_format(tmp_path):
    """PEFT takes DeepSeek-V3's (and Qwen3-MoE's) gate / up / down targets for the experts', so
    adapters on the dense first layers and shared experts are refused before anything is written;
    the experts' alone are not."""
    from conftest import recipe

    from lm.errors import UserError
    from lm.hf.adapters import write_adapter
    from lm.model.config import ModelConfig

    cfg = ModelConfig.from_config(recipe("deepseek_tiny", lora__rank=4, lora__targets="all"), VOCAB)
    with pytest.raises(UserError, match="PEFT reads gate/up/down adapters of a deepseek_v3 model"):
        write_adapter({}, cfg, tmp_path / "adapter", None)
    assert not (tmp_path / "adapter").exists()
    experts_only = ModelConfig.from_config(recipe("deepseek_tiny", lora__rank=4, lora__targets="experts"), VOCAB)
    write_adapter({}, experts_only, tmp_path / "adapter", None)  # (no tensors given: an empty adapter)
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
