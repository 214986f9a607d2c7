"""FLOPs per token, checked against the matmuls the model really runs (read off its jaxpr)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT
from flax import nnx

from lm.model.config import ModelConfig
from lm.model.flops import flops_per_token
from lm.model.transformer import Transformer


def dot_flops(jaxpr, length: int) -> tuple[int, int]:
    """(weight-matmul FLOPs, attention-matmul FLOPs) of every dot_general in a forward jaxpr,
    nested ones (scan bodies times their trip count, custom-VJP functions) included. Attention
    matmuls are the ones whose result and contraction carry the sequence length twice (T x T)."""
    weights = attention = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot_general"):  # (ragged: rows sorted by expert, each through its own)
            numbers = eqn.params.get("dimension_numbers") or eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
            (lhs_contracting, _), (lhs_batch, _) = numbers
            lhs = eqn.invars[0].aval.shape
            if any(lhs[d] == length for d in lhs_batch):  # per token: MoE's weighted sum of its experts, no weight
                continue
            flops = 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[d] for d in lhs_contracting]))
            out, contracted = eqn.outvars[0].aval.shape, [lhs[d] for d in lhs_contracting]
            if sum(d == length for d in (*out, *contracted)) >= 2:  # scores [.., t, s], or a sum over s into [.., t, ..]
                attention += flops
            else:
                weights += flops
        trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    w, a = dot_flops(inner, length)
                    weights, attention = weights + trips * w, attention + trips * a
    return weights, attention


@pytest.mark.parametrize("style", [dict(num_kv_heads=2), dict(mlp="gelu", num_kv_heads=4, tie_embeddings=True)], ids=["llama-gqa", "gpt2-tied"])
def test_flops_per_token_counts_the_matmuls_the_model_runs(style):
    # Sizes that differ from the context (128), so attention matmuls are told apart by shape.
    cfg = ModelConfig(vocab_size=512, max_len=128, num_layers=2, embed_dim=64, num_heads=4, head_dim=16, mlp_dim=256, **style)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    jaxpr = jax.make_jaxpr(lambda tokens: model(tokens)[0])(jnp.zeros((1, 128), jnp.int32))
    weights, attention = dot_flops(jaxpr.jaxpr, 128)
    assert weights > 0 and attention > 0
    # Training is forward + backward = 3x the forward; causal attention counts half the T x T work.
    assert flops_per_token(cfg, 128) == 3 * (weights + attention / 2) / 128


MOE = dict(num_experts=4, experts_per_token=2, expert_mlp_dim=96)


LATENT = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


@pytest.mark.parametrize("targets, moe", [(("q", "k", "v", "o", "gate", "up", "down"), {}), (("q", "v"), {}), (("q", "experts"), MOE),
                                          (("q_a", "q_b", "kv_a", "kv_b", "o", "gate"), LATENT)],
                         ids=["all", "q_v", "experts", "latent"])
def test_lora_flops_per_token_count_the_adapters_and_no_base_weight_gradients(targets, moe):
    """Under LoRA the base runs forward and input gradients (2x its forward), the adapters
    forward and backward (3x theirs): read off the two models' forward jaxprs (the experts' adapters
    by their ragged products over each token's chosen experts)."""
    import dataclasses

    base = ModelConfig(vocab_size=512, max_len=128, num_layers=2, embed_dim=64, num_heads=4, head_dim=16, mlp_dim=256, num_kv_heads=2, **moe)
    lora = dataclasses.replace(base, lora_rank=8, lora_alpha=16.0, lora_targets=targets)
    tokens = jnp.zeros((1, 128), jnp.int32)
    (plain, attention), (adapted, _) = (dot_flops(jax.make_jaxpr(lambda t, m=Transformer(c, rngs=nnx.Rngs(0)): m(t)[0])(tokens).jaxpr, 128)
                                        for c in (base, lora))
    assert adapted > plain
    assert flops_per_token(lora, 128) == (2 * plain + 3 * (adapted - plain) + 3 * attention / 2) / 128


def test_tensorboard_metrics_are_written_without_importing_pytorch(tmp_path):
    """tensorboardX imports torch where it is installed (1.2 s and 180 MB per run); meshlm's runs
    do not, and torch still imports afterwards."""
    pytest.importorskip("torch")  # installed with meshlm[test], for the Hugging Face checks
    code = ("import sys; from pathlib import Path; from lm.training.metrics import MetricsWriter\n"
            "w = MetricsWriter(Path(sys.argv[1])); w.write({'step': 1, 'loss': 2.5}); w.close()\n"
            "print('torch' in sys.modules); import torch; print(torch.ones(2).sum().item())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "2.0"]
    assert [p.name for p in (tmp_path / "tb").iterdir()][0].startswith("events.out.tfevents")
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.5}


class _FakeWandb:
    """A stand-in for the `wandb` module that records what meshlm asks of it."""

    def __init__(self, fail_at: str = ""):
        self.inits, self.logged, self.finished, self.fail_at = [], [], 0, fail_at

    def init(self, **kwargs):
        if self.fail_at == "init":
            raise RuntimeError("no network")
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, row, step):
                if fake.fail_at == "log":
                    raise RuntimeError("the service went away")
                fake.logged.append((step, row))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_logs_what_tensorboard_logs_and_a_resumed_run_continues_the_same_run(tmp_path, small_corpus, monkeypatch):
    from conftest import fast_config, metrics_rows

    from lm.training.loop import train
    from lm.training.tracking import RUN_ID_FILE

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    workdir = tmp_path / "run"
    c = fast_config(small_corpus, train__steps=4, train__log_every=2, checkpoint__every_steps=2, metrics__wandb=True,
                    metrics__wandb_project="meshlm-test")
    train(c, workdir, jax.devices()[:1])
    run_id = (workdir / RUN_ID_FILE).read_text().strip()
    (first,) = fake.inits
    assert first["id"] == run_id and first["resume"] == "allow" and first["project"] == "meshlm-test" and first["name"] == "run"
    assert first["config"]["model"]["embed_dim"] == c.model.embed_dim and first["config"]["metrics"]["wandb"] is True
    # Every row of metrics.jsonl, its numbers as logged (TensorBoard gets the same scalars).
    rows = metrics_rows(workdir)
    assert [step for step, _ in fake.logged] == [r["step"] for r in rows]
    for (_, logged), row in zip(fake.logged, rows):
        assert logged == {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
    assert fake.finished == 1
    # Resumed: the same W&B run, going on from the next logged step.
    train(fast_config(small_corpus, train__steps=6, train__log_every=2, checkpoint__every_steps=2, metrics__wandb=True,
                      metrics__wandb_project="meshlm-test"), workdir, jax.devices()[:1])
    assert [i["id"] for i in fake.inits] == [run_id, run_id]
    assert max(step for step, _ in fake.logged) == 6


@pytest.mark.parametrize("fail_at", ["init", "log", "missing"])
def test_a_wandb_failure_is_one_warning_and_training_goes_on(tmp_path, small_corpus, monkeypatch, capsys, fail_at):
    from conftest import fast_config, metrics_rows

    from lm.training.loop import train

    monkeypatch.setitem(sys.modules, "wandb", None if fail_at == "missing" else _FakeWandb(fail_at))
    workdir = tmp_path / "run"
    train(fast_config(small_corpus, train__steps=4, train__log_every=2, metrics__wandb=True), workdir, jax.devices()[:1])
    assert [r["step"] for r in metrics_rows(workdir) if "loss" in r][-1] == 4  # trained to the end
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: W&B")]
    expected = {"init": "could not start: RuntimeError: no network", "log": "stopped logging: RuntimeError: the service went away",
                "missing": "is not installed"}[fail_at]
    assert len(warnings) == 1 and expected in warnings[0] and warnings[0].endswith("training goes on without it")


@pytest.mark.slow
def test_wandb_offline_writes_its_run_under_the_workdir(tmp_path):
    pytest.importorskip("wandb")
    from conftest import run_module

    from lm.training.tracking import RUN_ID_FILE

    workdir = tmp_path / "run"
    for steps in (2, 4):  # and resumed
        result = run_module("lm.train", "--config=configs/tiny.py", f"--workdir={workdir}", f"--config.train.steps={steps}",
                            "--config.train.log_every=2", "--config.metrics.wandb=True",
                            env_extra={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
    run_id = (workdir / RUN_ID_FILE).read_text().strip()
    offline = sorted(p.name for p in (workdir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(run_id) for name in offline)  # one W&B run, resumed


def test_a_list_in_a_metrics_row_is_one_histogram_in_tensorboard(tmp_path):
    """Per-expert loads come as one list per layer: metrics.jsonl keeps the list, TensorBoard gets
    one histogram of it (its count and sum), not a scalar per expert."""
    import struct

    from tensorboardX.proto import event_pb2

    from lm.training.metrics import MetricsWriter

    loads = [0.5, 0.25, 0.125, 0.125]
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 3, "moe/layer0/load": loads, "moe/max_over_mean_load": 2.0})
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["moe/layer0/load"] == loads
    data = next((tmp_path / "tb").iterdir()).read_bytes()
    values = []
    while data:  # TFRecord: length, its CRC, the event, its CRC
        (length,) = struct.unpack("<Q", data[:8])
        event = event_pb2.Event.FromString(data[12 : 12 + length])
        values += [(v.tag, v) for v in event.summary.value]
        data = data[16 + length :]
    tags = {tag: v for tag, v in values}
    assert set(tags) == {"moe/layer0/load", "moe/max_over_mean_load"}
    assert tags["moe/layer0/load"].histo.num == 4 and tags["moe/layer0/load"].histo.sum == 1.0
    assert tags["moe/max_over_mean_load"].simple_value == 2.0
