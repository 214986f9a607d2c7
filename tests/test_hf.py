"""Hugging Face checkpoints in and out (`lm.convert`, `lm.hf`): logits parity with `transformers`
on tiny random models of every family, exact round trips, sharded import, training after import,
greedy generation, and the one-line errors. Offline: every model is made here."""

import json
import shutil
import sys

import jax
import numpy as np
import pytest
from conftest import assert_one_line_error, fast_config, run_cli, run_module
from hf_models import VOCAB, add_mtp_layers, hf_logits, imported, make_hf_model, meshlm_logits

pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
torch = pytest.importorskip("torch", reason="torch (the test extra; on Python 3.11 only: 3.12 has only CUDA builds) is not installed")

from safetensors.numpy import load_file  # noqa: E402

from lm import config as lm_config  # noqa: E402
from lm import convert  # noqa: E402
from lm.hf import checkpoint as hf_checkpoint  # noqa: E402
from lm.model.sampling import generate_ids  # noqa: E402
from lm.program.restore import load  # noqa: E402
from lm.program.steps import setup  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
CASES = {
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa2-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mqa-untied": ("llama", dict(num_key_value_heads=1)),
    "llama-head_dim": ("llama", dict(head_dim=8)),
    "llama3-rope": ("llama", dict(rope_scaling=LLAMA3)),
    "qwen2-qkv-bias": ("qwen2", {}),
    "mistral-window": ("mistral", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-unnormalised": ("qwen3_moe", dict(norm_topk_prob=False)),
    "qwen3-moe-dense-first": ("qwen3_moe", dict(mlp_only_layers=[0])),
    "qwen3-moe-every-2": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2)),  # dense, sparse, dense, sparse: one scan
    "qwen3-moe-dense-middle": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),  # sparse, dense, sparse: three runs
    "gpt2": ("gpt2", {}),
    "deepseek-v3": ("deepseek_v3", {}),
    # Full-rank queries (DeepSeek-V2-Lite's shape), rotary rows already in halves, YaRN with both mscales, every layer sparse.
    "deepseek-v3-yarn": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, first_k_dense_replace=0, max_position_embeddings=32,
                                            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=1.0,
                                                              mscale_all_dim=0.8, beta_fast=32, beta_slow=1))),
}
STD = 0.4  # logits reach |12..18|: far from uniform
DEEPSEEK = {"model_type": "deepseek_v3", "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _parity(ref, ours):
    return float(np.abs(ref - ours).max()), bool((ref.argmax(-1) == ours.argmax(-1)).all())


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each case's (directory, torch model), made once."""
    made = {}
    for name, (family, kw) in CASES.items():
        path = tmp_path_factory.mktemp(name)
        made[name] = (path, make_hf_model(path, family, std=STD, **kw))
    return made


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(hf_dirs, case):
    path, model = hf_dirs[case]
    layout, params = imported(path)
    ours_full = np.asarray(jax.jit(lambda m, t: m(t)[0])(layout.model(params), TOKENS))
    ref = hf_logits(model, TOKENS)
    err, same_argmax = _parity(ref, ours_full[..., :VOCAB])
    print(f"{case}: max |logit difference| {err:.2e}, max |logit| {np.abs(ref).max():.1f}")
    assert err <= 1e-4 and same_argmax
    assert np.abs(ref).max() > 5  # far from uniform: the check has teeth
    # The padding ids (301 -> 384 rows) are never predicted.
    assert ours_full.shape[-1] == 384 and (ours_full[..., VOCAB:] == np.finfo(np.float32).min).all()


def _permuted(params, path, fn):
    params = jax.tree.map(lambda a: a, params)
    node = params
    *groups, key = path.split("/")
    for g in groups:
        node = node[g]
    node[key] = fn(node[key])
    return params


@pytest.mark.parametrize(
    "control",
    [
        # What an import into an interleaved-RoPE model applies (HF's rows permuted back to
        # pairs (0, 1), (2, 3), ...): wrong for meshlm's rotate-half form.
        "interleaved_rotary",
        # Query heads grouped (r, g) instead of (g, r) over the kv heads.
        "wrong_kv_grouping",
    ],
)
def test_negative_controls_fail_the_parity_check(hf_dirs, control):
    path, model = hf_dirs["llama-gqa2-tied"]
    layout, params = imported(path)
    k = layout.spec.model.head_dim
    if control == "interleaved_rotary":
        order = np.stack([np.arange(k // 2), np.arange(k // 2) + k // 2], axis=1).reshape(-1)
        for name in ("wq", "wk"):
            params = _permuted(params, f"blocks/attn/{name}", lambda w: w[..., order])
    else:
        h, g = layout.spec.model.num_heads, layout.spec.model.num_kv_heads
        order = np.arange(h).reshape(g, h // g).T.reshape(-1)
        params = _permuted(params, "blocks/attn/wq", lambda w: w[:, :, order])
    err, same_argmax = _parity(hf_logits(model, TOKENS), meshlm_logits(layout, params, TOKENS))
    assert err > 1e-1 and not same_argmax


@pytest.mark.parametrize("case", ["qwen3-moe", "qwen3-moe-unnormalised"])
def test_the_other_top_k_normalisation_fails_the_parity_check(hf_dirs, case):
    path, model = hf_dirs[case]
    renormalised = case == "qwen3-moe"
    layout, params = imported(path, **{"model.router_renormalize": not renormalised})
    err, _ = _parity(hf_logits(model, TOKENS), meshlm_logits(layout, params, TOKENS))
    assert err > 1e-1


@pytest.mark.parametrize("change", [{"model.router_groups": 1}, {"model.router_scale": 1.0}, {"model.rope_interleave": False}, "no_bias"])
def test_each_deepseek_routing_and_rotary_setting_fails_the_parity_check_when_dropped(hf_dirs, change):
    """Negative controls: routing without the group limit, the routed scaling or the selection
    bias, or rotary rows left interleaved, each moves the logits."""
    path, model = hf_dirs["deepseek-v3"]
    layout, params = imported(path, **({} if change == "no_bias" else change))
    if change == "no_bias":
        params = _permuted(params, "blocks/mlp/router_bias", lambda b: b * 0)
    err, _ = _parity(hf_logits(model, TOKENS), meshlm_logits(layout, params, TOKENS))
    print(f"{change}: max |logit difference| {err:.2e}")
    assert err > 1e-1


@pytest.mark.parametrize("case", ["mixtral", "qwen3-moe"])
def test_load_balancing_loss_equals_transformers(hf_dirs, case):
    """transformers' aux_loss (output_router_logits) from meshlm's routing statistics of the same
    batch, and the training step's gradient carrying router_aux_loss_coef x each layer's own."""
    from lm.model import moe

    path, model = hf_dirs[case]
    layout, params = imported(path)
    hf_dir, hf_config = hf_checkpoint.read_hf_config(path)
    overrides = {"mesh.data": 1, "train.batch_size": 2, "train.seq_len": 23, "model.attention": "einsum"}
    program = setup(hf_checkpoint.config_from_hf(lm_config.default_config(), hf_dir, hf_config, overrides), 0, jax.devices()[:1])
    tokens = TOKENS.astype(np.int32)
    _, _, stats = program.grads(params, tokens)
    _, routing = moe.split_stats(jax.device_get(stats))
    with torch.no_grad():
        out = model(torch.as_tensor(tokens[:, :-1], dtype=torch.long), output_router_logits=True)
    ours, theirs = moe.transformers_aux_loss(routing, model.config.num_experts_per_tok), float(out.aux_loss)
    print(f"{case}: aux loss {ours:.6f} (transformers {theirs:.6f})")
    assert abs(ours - theirs) <= 1e-5 * theirs and theirs > 1.0
    assert program.spec.model.router_aux_loss_coef == model.config.router_aux_loss_coef


@pytest.mark.parametrize("mesh", [{"fsdp": 4, "tensor": 2}, {"stage": 2, "data": 4}])
def test_sharded_import_gives_the_same_logits(hf_dirs, mesh):
    path, _ = hf_dirs["llama-gqa2-tied"]
    tokens = np.random.default_rng(1).integers(0, VOCAB, (8, 16))
    one = meshlm_logits(*imported(path), tokens)
    layout, params = imported(path, mesh, jax.devices())
    leaf = params["blocks"]["attn"]["wq"]
    assert len(leaf.sharding.device_set) == 8 and leaf.addressable_shards[0].data.size < leaf.size
    # Equal up to the order of the tensor-parallel sums (logits of |5| with weights of std 0.4).
    np.testing.assert_allclose(meshlm_logits(layout, params, tokens), one, atol=1e-4, rtol=1e-5)


def test_sharded_safetensors_import_identically(tmp_path):
    make_hf_model(tmp_path / "one", "llama", std=STD)
    make_hf_model(tmp_path / "many", "llama", std=STD, max_shard_size="20KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "many").glob("model-*.safetensors"))) > 3
    a, b = imported(tmp_path / "one")[1], imported(tmp_path / "many")[1]
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _state_dict(directory):
    out = {}
    for file in directory.glob("*.safetensors"):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("case", ["llama-gqa2-tied", "qwen2-qkv-bias", "mistral-window", "gpt2", "llama3-rope", "qwen3-qk-norm", "mixtral", "qwen3-moe",
                                  "qwen3-moe-dense-first", "qwen3-moe-every-2", "qwen3-moe-dense-middle", "deepseek-v3", "deepseek-v3-yarn"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_meshlm_hf_round_trip_is_bit_identical(tmp_path, case, dtype):
    family, kw = CASES[case]
    make_hf_model(tmp_path / "hf", family, std=STD, dtype=dtype, **kw)
    hf_checkpoint.import_hf(tmp_path / "hf", tmp_path / "run", lm_config.default_config(), {}, jax.devices()[:1])
    hf_checkpoint.export_hf(tmp_path / "run", tmp_path / "out", dtype=dtype, max_shard_size="30KB")
    before, after = _state_dict(tmp_path / "hf"), _state_dict(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and before[name].tobytes() == after[name].tobytes(), name
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert str(model.dtype) == f"torch.{dtype}"
    for name in ("tokenizer.json", "generation_config.json"):
        assert (tmp_path / "out" / name).exists()


def test_multi_token_prediction_layers_import_and_export_bit_identical(tmp_path, capsys):
    """DeepSeek-V3's extra layer (`num_nextn_predict_layers`; `transformers` has no module for it
    and drops it) becomes meshlm's multi-token prediction module and is exported back bit for bit,
    the shared embedding and head written again into it; the model's logits still equal
    transformers'. A checkpoint whose config names the layer but whose tensors lack it imports
    without it, with a warning."""
    model = make_hf_model(tmp_path / "hf", "deepseek_v3", std=STD)
    added = add_mtp_layers(tmp_path / "hf", std=STD)
    layout, params = imported(tmp_path / "hf")
    assert layout.spec.model.mtp_depth == 1 and layout.spec.model.mtp_sparse
    np.testing.assert_array_equal(params["mtp"]["eh_proj"][0], added["model.layers.3.eh_proj.weight"].T)  # rows: the embedding's half first
    err, same_argmax = _parity(hf_logits(model, TOKENS), meshlm_logits(layout, params, TOKENS)[..., :VOCAB])
    assert err <= 1e-4 and same_argmax
    hf_checkpoint.import_hf(tmp_path / "hf", tmp_path / "run", lm_config.default_config(), {}, jax.devices()[:1])
    hf_checkpoint.export_hf(tmp_path / "run", tmp_path / "out", dtype="float32", max_shard_size="30KB")
    before, after = _state_dict(tmp_path / "hf"), _state_dict(tmp_path / "out")
    assert sorted(before) == sorted(after) and "model.layers.3.shared_head.head.weight" in after
    for name in before:
        assert before[name].tobytes() == after[name].tobytes(), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    import transformers

    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and {k.split(".")[2] for k in info["unexpected_keys"]} == {"3"}  # (it ignores layer 61 only)
    # Its tensors dropped, as transformers' own save_pretrained would.
    shutil.copytree(tmp_path / "hf", tmp_path / "dropped")
    (tmp_path / "dropped" / "model-00002-of-00002.safetensors").unlink()
    index = json.loads((tmp_path / "dropped" / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not v.startswith("model-00002")}
    (tmp_path / "dropped" / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()
    layout, _ = imported(tmp_path / "dropped")
    assert layout.spec.model.mtp_depth == 0 and "num_nextn_predict_layers" in capsys.readouterr().out


def test_a_float8_block_scaled_checkpoint_imports_dequantised(tmp_path):
    """DeepSeek-V3's released form: every projection weight float8 e4m3 with one scale per block
    (16 x 16 here, ragged at the edges; 128 x 128 in the release), `weight_scale_inv` beside it.
    The import equals transformers on the weights dequantised by hand."""
    import ml_dtypes
    from safetensors.torch import save_file

    make_hf_model(tmp_path / "hf", "deepseek_v3", std=STD)
    block, quantised, dequantised = 16, {}, {}
    for name, w in _state_dict(tmp_path / "hf").items():
        if not (name.endswith("proj.weight") or "mqa" in name) or "layers" not in name:
            quantised[name] = torch.from_numpy(w)
            continue
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = np.pad(w, ((0, rows * block - w.shape[0]), (0, cols * block - w.shape[1])))
        amax = np.abs(padded.reshape(rows, block, cols, block)).max(axis=(1, 3))
        scale = (amax / 448.0).astype(np.float32)
        scales = np.repeat(np.repeat(scale, block, 0), block, 1)[: w.shape[0], : w.shape[1]]
        q = (w / scales).astype(ml_dtypes.float8_e4m3fn)
        quantised[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        quantised[name + "_scale_inv"] = torch.from_numpy(scale)
        dequantised[name] = torch.from_numpy(q.astype(np.float32) * scales)
    save_file(quantised, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    # The reference: transformers loading the dequantised weights (its live experts are fused, so through a directory).
    shutil.copytree(tmp_path / "hf", tmp_path / "dense")
    save_file({**{k: v for k, v in quantised.items() if k not in dequantised and not k.endswith("_scale_inv")}, **dequantised},
              tmp_path / "dense" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "dense" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", attn_implementation="eager").eval()
    layout, params = imported(tmp_path / "hf")
    err, same_argmax = _parity(hf_logits(model, TOKENS), meshlm_logits(layout, params, TOKENS))
    assert err <= 1e-4 and same_argmax
    # Exported dense: transformers loads it as an ordinary checkpoint.
    hf_checkpoint.import_hf(tmp_path / "hf", tmp_path / "run", lm_config.default_config(), {}, jax.devices()[:1])
    hf_checkpoint.export_hf(tmp_path / "run", tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    back = _state_dict(tmp_path / "out")
    np.testing.assert_array_equal(back["model.layers.1.self_attn.o_proj.weight"], dequantised["model.layers.1.self_attn.o_proj.weight"].numpy())


def test_meshlm_hf_meshlm_round_trip_is_bit_identical(tmp_path, small_corpus):
    from lm.program.checkpoint import Checkpointer
    from lm.training.loop import train

    train(fast_config(small_corpus, train__steps=3), tmp_path / "run", jax.devices()[:1])
    hf_checkpoint.export_hf(tmp_path / "run", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    hf_checkpoint.import_hf(tmp_path / "hf", tmp_path / "back", lm_config.default_config(), {}, jax.devices()[:1])
    trained = Checkpointer(tmp_path / "run" / "checkpoints").restore_part({"params": _abstract(tmp_path / "run")})["params"]
    back = Checkpointer(tmp_path / "back" / "checkpoints").restore_part({"params": _abstract(tmp_path / "back")})["params"]
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), trained, back)
    # The byte tokenizer went out as a tokenizer.json that encodes text to the same ids.
    from tokenizers import Tokenizer

    text = "def f(x):\n    return 'é'"
    assert Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode(text).ids == list(text.encode())


def _abstract(workdir):
    from lm.program.restore import restore

    _, _, layout, restored = restore(workdir)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), restored["params"])


@pytest.mark.parametrize("case", ["llama-gqa2-tied", "qwen2-qkv-bias", "mistral-window", "gpt2", "qwen3-qk-norm", "mixtral", "qwen3-moe-dense-first",
                                  "qwen3-moe-every-2", "qwen3-moe-dense-middle", "deepseek-v3", "deepseek-v3-yarn"])
def test_greedy_generation_matches_transformers(hf_dirs, tmp_path, case):
    path, model = hf_dirs[case]
    hf_checkpoint.import_hf(path, tmp_path / "run", lm_config.default_config(), {"model.attention": "einsum"}, jax.devices()[:1])
    _, _, ours = load(tmp_path / "run")
    prompt = [5, 17, 42, 7]
    mine = generate_ids(ours, prompt, max_new_tokens=32, temperature=0.0)
    model.generation_config.eos_token_id = None  # 32 tokens, no early stop
    model.generation_config.pad_token_id = 0
    theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=0)[0, len(prompt) :].numpy()
    assert mine.tolist() == theirs.tolist()


def test_one_train_step_after_import_matches_transformers_loss(hf_dirs):
    path, model = hf_dirs["llama-gqa2-tied"]
    hf_dir, hf_config = hf_checkpoint.read_hf_config(path)
    overrides = {"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 2, "train.batch_size": 4, "train.seq_len": 16, "model.attention": "einsum"}
    config = hf_checkpoint.config_from_hf(lm_config.default_config(), hf_dir, hf_config, overrides)
    program = setup(config, 0, jax.devices()[:4])
    params = hf_checkpoint.load_params(hf_checkpoint.Reader(hf_dir), program.abstract_model)
    state = program.init_from(0, params)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (4, 17)).astype(np.int32)
    state, metrics = program.train_step(state, program.global_batch(tokens))
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens, dtype=torch.long), labels=torch.as_tensor(tokens, dtype=torch.long)).loss.item()
    assert abs(float(metrics["loss"]) - ref) <= 1e-5 * max(1.0, abs(ref)), (float(metrics["loss"]), ref)


@pytest.mark.slow  # (it needs torch: the first stack runs it in any case)
def test_cli_import_train_generate_export(tmp_path, hf_dirs, small_corpus):
    path, model = hf_dirs["llama-gqa2-tied"]
    run, out = tmp_path / "run", tmp_path / "out"
    result = run_module("lm.convert", "from_hf", f"--hf={path}", f"--workdir={run}", "--config.train.seq_len=32")
    assert result.returncode == 0, result.stderr
    assert {"config.json", "tokenizer.json", "hf_config.json", "checkpoints"} <= {p.name for p in run.iterdir()}
    result = run_module("lm.generate", f"--workdir={run}", "--prompt_ids=5,17,42", "--temperature=0", "--max_new_tokens=8", "--print_ids")
    assert result.returncode == 0, result.stderr
    ids = [int(i) for i in result.stdout.strip().splitlines()[-1].split()]
    model.generation_config.eos_token_id = None
    theirs = model.generate(torch.tensor([[5, 17, 42]]), do_sample=False, max_new_tokens=8)[0, 3:].tolist()
    assert ids == theirs
    # lm.train resumes the imported run (its own config; the data path and steps overridden).
    result = run_module("lm.train", f"--workdir={run}", f"--config.data.path={small_corpus}", "--config.train.steps=4",
                        "--config.train.batch_size=4", "--config.train.log_every=1", "--config.checkpoint.every_steps=4")
    assert result.returncode == 0, result.stderr
    assert "starting from the weights" in result.stdout and (run / "checkpoints" / "4").exists()
    result = run_module("lm.convert", "to_hf", f"--workdir={run}", f"--out={out}", "--dtype=bfloat16")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_finetune_from_hf_equals_training_the_imported_run(tmp_path, hf_dirs, small_corpus):
    from conftest import losses

    from lm.training.loop import train

    path, _ = hf_dirs["llama-gqa2-tied"]
    kw = dict(train__steps=4, train__seq_len=32, train__batch_size=4, train__log_every=1, model__attention="einsum")
    train(fast_config(small_corpus, init__from_hf=str(path), **kw), tmp_path / "direct", jax.devices()[:1])
    hf_checkpoint.import_hf(path, tmp_path / "imported", lm_config.default_config(), {"model.attention": "einsum"}, jax.devices()[:1])
    train(fast_config(small_corpus, init__from_hf=str(tmp_path / "imported"), **kw), tmp_path / "via_run", jax.devices()[:1])
    a, b = losses(tmp_path / "direct"), losses(tmp_path / "via_run")
    assert a == b and a[4] < a[1]
    saved = lm_config.load_run(tmp_path / "direct")
    assert saved.model.num_layers == 2 and saved.model.vocab_size == VOCAB  # the checkpoint's architecture


def test_import_without_tokenizer_works_on_ids(tmp_path, capsys):
    make_hf_model(tmp_path / "hf", "gpt2", std=STD, tokenizer=False)
    result = run_cli(capsys, convert.main, "from_hf", f"--hf={tmp_path / 'hf'}", f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    assert "warning:" in result.stdout and "tokenizer.json" in result.stdout
    from lm import generate

    result = run_cli(capsys, generate.main, f"--workdir={tmp_path / 'run'}", "--prompt_ids=1,2,3", "--temperature=0", "--max_new_tokens=5")
    assert result.returncode == 0 and len(result.stdout.split()) == 5
    result = run_cli(capsys, generate.main, f"--workdir={tmp_path / 'run'}", "--prompt=hello")
    assert_one_line_error(result, "no tokenizer")


def _without(src, dst, drop=None, reshape=None):
    import shutil

    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, hf_dirs):
    good, _ = hf_dirs["llama-gqa2-tied"]
    (tmp_path / "empty").mkdir()
    unsupported = tmp_path / "bert"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"model_type": "bert"}))
    partial = tmp_path / "partial"  # a config.json cut short: a KeyError traceback before
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    mistyped = shutil.copytree(good, tmp_path / "mistyped")
    (mistyped / "config.json").write_text(json.dumps({**json.loads((good / "config.json").read_text()), "num_attention_heads": "four", "head_dim": None}))
    bad_index = tmp_path / "bad_index"  # its weight_map not a map: a TypeError traceback before
    bad_index.mkdir()
    shutil.copy(good / "config.json", bad_index)
    (bad_index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": 5}))
    act = tmp_path / "act"
    act.mkdir()
    (act / "config.json").write_text(json.dumps({**json.loads((good / "config.json").read_text()), "hidden_act": "gelu"}))
    cases = [
        (tmp_path / "empty", "has no config.json"),
        (unsupported, "model_type='bert' is not supported"),
        (partial, "a gpt2 config needs 'vocab_size', which this one lacks"),
        (mistyped, "a llama field has a value of the wrong kind"),
        (bad_index, "model.safetensors.index.json is not a safetensors index"),
        (act, "hidden_act='gelu'"),
        (_without(good, tmp_path / "missing", drop="model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight is missing"),
        (_without(good, tmp_path / "shape", reshape="model.layers.0.self_attn.k_proj.weight"), "has shape (31, 64), but config.json implies (32, 64)"),
    ]
    for hf_dir, fragment in cases:
        result = run_cli(capsys, convert.main, "from_hf", f"--hf={hf_dir}", f"--workdir={tmp_path / 'run'}")
        assert_one_line_error(result, fragment)
        assert not (tmp_path / "run").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    result = run_cli(capsys, convert.main, "from_hf", f"--hf={good}", f"--workdir={tmp_path / 'taken'}")
    assert_one_line_error(result, "exists and is not empty")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]


# A process of a 2-process cluster importing on {stage: 2, fsdp: 4}: the tensor names it read.
_WORKER = """
import json, sys
flags = dict(a[2:].split("=", 1) for a in sys.argv[3:])
import lm, sharding.distributed
sharding.distributed.initialize(flags["coordinator"], int(flags["num_processes"]), int(flags["process_id"]))
from lm import config

from lm.hf import checkpoint as hf_checkpoint
from lm.hf.safetensors_dir import Reader
reads, read = [], Reader.read
Reader.read = lambda self, name: reads.append(name) or read(self, name)
hf_checkpoint.import_hf(sys.argv[1], sys.argv[2], config.default_config(), {"mesh.data": 1, "mesh.stage": 2, "mesh.fsdp": 4})
print("READ " + json.dumps(sorted(set(reads))))
hf_checkpoint.export_hf(sys.argv[2], sys.argv[2] + "-exported", max_shard_size="40KB")
"""


def test_multi_process_import_and_export(tmp_path, hf_dirs):
    """Each process reads only its slices on import; export gathers them (process 0 writes)."""
    path, _ = hf_dirs["llama-mha-untied"]
    result = run_module(
        "lm.launch", "--processes=2", "--devices_per_process=4", "--",
        sys.executable, "-c", _WORKER, str(path), str(tmp_path / "run"), timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    reads = {int(line[1]): set(json.loads(line.split("READ ", 1)[1])) for line in result.stdout.splitlines() if "READ " in line}
    layer_reads = [{name.split(".")[2] for name in reads[p] if name.startswith("model.layers.")} for p in (0, 1)]
    assert layer_reads == [{"0"}, {"1"}]  # each stage's process read its own layer only
    # The same weights as a one-process import.
    hf_checkpoint.import_hf(path, tmp_path / "one", lm_config.default_config(), {}, jax.devices()[:1])
    from lm.program.restore import restore

    a, b = restore(tmp_path / "run")[3]["params"], restore(tmp_path / "one")[3]["params"]
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    exported, original = _state_dict(tmp_path / "run-exported"), _state_dict(path)
    assert sorted(exported) == sorted(original) and len(list((tmp_path / "run-exported").glob("model-*"))) > 1
    for name in original:
        assert exported[name].tobytes() == original[name].tobytes(), name


@pytest.mark.slow  # (it needs torch: the first stack runs it in any case)
def test_lm_convert_to_hf_over_two_processes_writes_what_one_process_writes(tmp_path, capsys):
    """A LoRA run whose weights an FSDP mesh splits over two processes' devices: `lm.convert
    to_hf` under `lm.launch` gathers them, process 0 writes, the other finds no directory in its
    way; the adapters and the merged model are the files one process writes."""
    from lm import train

    run = tmp_path / "run"
    result = run_cli(capsys, train.main, "--config=configs/tiny.py", f"--workdir={run}", "--config.train.steps=2", "--config.lora.rank=4",
                     "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.model.num_layers=2")
    assert result.returncode == 0, result.stderr
    for name, extra in (("adapter", ["--adapter"]), ("merged", [])):
        one = run_cli(capsys, convert.main, "to_hf", f"--workdir={run}", f"--out={tmp_path / name}-one", *extra)
        assert one.returncode == 0, one.stderr
        two = run_module("lm.launch", "--processes=2", "--devices_per_process=2", "--", sys.executable, "-m", "lm.convert", "to_hf",
                         f"--workdir={run}", f"--out={tmp_path / name}", *extra, timeout=300)
        assert two.returncode == 0, two.stdout[-3000:]
        written = sorted(f.name for f in (tmp_path / name).iterdir())
        assert written == sorted(f.name for f in (tmp_path / f"{name}-one").iterdir()) and len(written) >= 2
        for f in written:
            assert (tmp_path / name / f).read_bytes() == (tmp_path / f"{name}-one" / f).read_bytes(), f


def test_rope_settings_read_in_both_spellings_and_written_for_the_installed_version(monkeypatch):
    from lm.hf import export_config
    from lm.hf import format as hf
    from lm.model.config import ModelConfig

    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB}
    v4 = {**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}}
    v4_old_key = {**base, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}}
    v5 = {**base, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}
    keys = hf.model_keys(v5)
    assert hf.model_keys(v4) == keys == hf.model_keys(v4_old_key)
    assert keys["model.rope_scaling"] == "llama3" and keys["model.rope_theta"] == 500000.0 and keys["model.rope_original_max_len"] == 8
    cfg = ModelConfig(vocab_size=384, real_vocab_size=VOCAB, max_len=128, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=4,
                      head_dim=16, mlp_dim=96, rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=8)
    monkeypatch.setattr(export_config, "_transformers_major", lambda: 4)
    written = export_config.hf_config(cfg, "float32")
    assert written["rope_scaling"]["rope_type"] == "llama3" and written["rope_theta"] == 500000.0 and "rope_parameters" not in written
    assert written["torch_dtype"] == "float32"
    monkeypatch.setattr(export_config, "_transformers_major", lambda: 5)
    written = export_config.hf_config(cfg, "float32")
    assert written["rope_parameters"] == {**LLAMA3, "rope_theta": 500000.0} and "rope_scaling" not in written
    assert hf.model_keys(written) == {**keys, "model.num_kv_heads": 4, "model.head_dim": 16, "model.norm_eps": 1e-5}


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters.rope_type='dynamic'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 8, "attention_factor": 2.0}},
         "rope_parameters.attention_factor=2.0"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"model_type": "deepseek_v2", "topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
        ({**DEEPSEEK, "scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({**DEEPSEEK, "quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config='bitsandbytes'"),
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0, 1]},
         "mlp_only_layers=[0, 1]"),
    ],
)
def test_configs_meshlm_cannot_represent_are_refused(change, fragment):
    from lm.config import UserError
    from lm.hf import format as hf

    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB}
    with pytest.raises(UserError, match="cannot be represented exactly") as error:
        hf.model_keys({**base, **change})
    assert fragment in str(error.value)
