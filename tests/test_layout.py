import json

from conftest import run_module


def test_layout_prints_every_parameter_and_per_device_memory_on_fake_devices():
    out = run_module("lm.layout", "--config=configs/tiny.py", "--devices=8", "--config.mesh.fsdp=4", "--config.mesh.tensor=2")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["mesh"] == {"data": 1, "stage": 1, "context": 1, "expert": 1, "fsdp": 4, "tensor": 2} and summary["devices"] == 8
    per_device = summary["per_device"]
    # Every tiny-model parameter is split 8 ways (embed over fsdp and heads/mlp/vocab over tensor)
    # except the norm scales, which carry only `embed`: a little over an eighth per device.
    assert summary["param_bytes_total"] / 8 <= per_device["params_bytes"] <= summary["param_bytes_total"] / 8 * 1.01
    assert per_device["opt_state_bytes"] >= 2 * per_device["params_bytes"]  # Adam's two moments
    compiled = summary["compiled_train_step_per_device"]
    assert compiled["temp_bytes"] > 0 and compiled["argument_bytes"] >= per_device["params_bytes"] + per_device["opt_state_bytes"]
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith("blocks/mlp/w_in "))
    assert "(stage, context+fsdp, tensor)" in " ".join(row) and "(4, 32, 192)" in " ".join(row)


def test_layout_reports_a_bad_rule_in_one_line():
    out = run_module("lm.layout", "--config=configs/tiny.py", "--devices=2", "--no_compile", "--config.sharding.rules=(('mlp', 'experts'),)")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: blocks/mlp/w_gate (shape (4, 128, 384), logical axes ('layers', 'embed', 'mlp'), mesh data=2 stage=1 context=1 expert=1 fsdp=1 tensor=1): "
        "rule 'mlp' -> 'experts' names a mesh axis that does not exist (mesh axes: data, stage, context, expert, fsdp, tensor)"
    ]
