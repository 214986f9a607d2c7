"""lm-eval on a meshlm run (`python -m lm.evaluate`): the three request kinds against the model
computed directly on one device, on the run's own sharded mesh; local tasks end to end; a task
whose data is not on this machine, and an unknown one, in one line."""

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import assert_one_line_error, fast_config, run_cli

from lm.program.restore import load
from lm.training.loop import train

pytest.importorskip("lm_eval", reason="lm-eval (the test extra; on Python 3.11 only: it needs torch) is not installed")

DOCS = [
    {"question": "def ", "choices": ["main():", "zzzz%%%"], "label": 0, "text": "import json\nimport logging\n"},
    {"question": "import ", "choices": ["json", "\u00e9\u00e9\u00e9"], "label": 0, "text": "class Foo(object):\n    pass\n"},
    {"question": "return ", "choices": ["None", "}}}{"], "label": 0, "text": "def f(x):\n    return x\n"},
]
TASKS = {
    "local_choice": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
                    "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n",
    "local_text": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                  "metric_list:\n  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n",
    "local_generate": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{choices[0]}}'\n"
                      "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n"
                      "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n",
}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, small_corpus):
    """A run trained on {fsdp 2, tensor 2} (4 devices), and local task files for it."""
    root = tmp_path_factory.mktemp("eval")
    train(fast_config(small_corpus, train__steps=20, mesh__fsdp=2, mesh__tensor=2), root / "run", jax.devices()[:4])
    (root / "tasks").mkdir()
    (root / "tasks" / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, body in TASKS.items():
        data = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'tasks' / 'docs.jsonl'}\ntest_split: test\n"
        (root / "tasks" / f"{name}.yaml").write_text(f"task: {name}\n{data}{body}")
    return root


def _direct_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, on one device, by the plain forward pass."""
    logits, _ = model(np.asarray(ids, np.int32)[None])
    logp = jax.nn.log_softmax(np.asarray(logits[0], np.float32), axis=-1)
    return np.asarray([logp[i - 1, ids[i]] for i in range(1, len(ids))])


@pytest.mark.slow
def test_requests_on_the_runs_mesh_equal_the_model_on_one_device(sharded_run):
    from lm.evaluation.harness import for_run
    from lm.model.sampling import generate_ids

    lm, step = for_run(sharded_run / "run", batch_size=3)
    assert step == 20 and dict(lm.scorer.mesh.shape)["fsdp"] == 2 and dict(lm.scorer.mesh.shape)["tensor"] == 2
    _, tokenizer, model = load(sharded_run / "run")  # one device
    asks = [("def ", "main():"), ("import ", "json"), ("x = ", "1"), ("return", " None")]  # 4 rows: two batches of 3 (padded)
    got = lm.loglikelihood([SimpleNamespace(args=a) for a in asks])
    for (context, continuation), (logp, greedy) in zip(asks, got):
        ctx_ids, cont_ids = lm._split(context, continuation)
        direct = _direct_logprobs(model, ctx_ids + cont_ids)[-len(cont_ids):]
        np.testing.assert_allclose(logp, direct.sum(), rtol=1e-5)
        logits, _ = model(np.asarray(ctx_ids + cont_ids, np.int32)[None])
        argmax = np.asarray(logits[0]).argmax(-1)[len(ctx_ids) - 1 : -1]
        assert greedy == bool((argmax == np.asarray(cont_ids)).all())

    text = DOCS[0]["text"]
    (rolling,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    ids = list(tokenizer.encode(text))
    np.testing.assert_allclose(rolling, _direct_logprobs(model, lm.prefix + ids).sum(), rtol=1e-5)

    (generated,) = lm.generate_until([SimpleNamespace(args=("def ", {"until": ["\n"], "max_gen_toks": 12}))])
    reference = tokenizer.decode(generate_ids(model, list(tokenizer.encode("def ")), 12, 0.0, 0))
    assert generated == reference.split("\n")[0]


@pytest.mark.slow
def test_local_tasks_end_to_end_and_bad_tasks_in_one_line(sharded_run, capsys):
    from lm import evaluate as lm_evaluate

    run, tasks = sharded_run / "run", sharded_run / "tasks"
    result = run_cli(capsys, lm_evaluate.main, f"--workdir={run}", "--tasks=local_choice,local_text,local_generate", f"--include_path={tasks}")
    assert result.returncode == 0, result.stderr
    assert "|local_choice" in result.stdout and "bits_per_byte" in result.stdout
    written = json.loads((run / "lm_eval" / "step20-local_choice+local_text+local_generate.json").read_text())
    assert set(written["results"]) == {"local_choice", "local_text", "local_generate"}
    # acc is the share of documents whose right choice has the highest log-likelihood
    from lm.evaluation.harness import for_run

    lm, _ = for_run(run)
    picks = [int(np.argmax([lp for lp, _ in lm.loglikelihood([SimpleNamespace(args=(d["question"], c)) for c in d["choices"]])]))
             for d in DOCS]
    assert written["results"]["local_choice"]["acc,none"] == pytest.approx(np.mean([p == d["label"] for p, d in zip(picks, DOCS)]))
    # a second evaluation of the same step and tasks never writes over the first
    first = (run / "lm_eval" / "step20-local_choice+local_text+local_generate.json").read_text()
    again = run_cli(capsys, lm_evaluate.main, f"--workdir={run}", "--tasks=local_choice,local_text,local_generate",
                    f"--include_path={tasks}", "--limit=2")
    assert again.returncode == 0 and (run / "lm_eval" / "step20-local_choice+local_text+local_generate.json").read_text() == first
    assert json.loads((run / "lm_eval" / "step20-local_choice+local_text+local_generate-2.json").read_text())["results"]["local_choice"]["alias"] == "local_choice"

    missing = tasks / "missing"
    missing.mkdir()
    (missing / "gone.yaml").write_text((tasks / "local_choice.yaml").read_text().replace("local_choice", "local_gone").replace("docs.jsonl", "absent.jsonl"))
    assert_one_line_error(run_cli(capsys, lm_evaluate.main, f"--workdir={run}", "--tasks=local_gone", f"--include_path={missing}"),
                          "task local_gone: its dataset could not be loaded")
    assert_one_line_error(run_cli(capsys, lm_evaluate.main, f"--workdir={run}", "--tasks=no_such_task"), "lm-eval knows no task no_such_task")
    assert_one_line_error(run_cli(capsys, lm_evaluate.main, f"--workdir={run}", "--tasks=local_choice", "--limit=-3"), "--limit=-3")


@pytest.mark.slow
def test_evaluation_during_training_logs_and_resumes_its_schedule(sharded_run, small_corpus, tmp_path):
    """eval.tasks every 5 steps: lm-eval rows in metrics.jsonl at steps 5, 10 and the last, each
    once although the run was killed at step 7 and resumed; the value logged at step 5 is what
    lm.evaluate's harness finds on that step's checkpoint."""
    from conftest import FAST, run_module

    tasks = sharded_run / "tasks"
    args = ["--config=configs/tiny.py", f"--config.data.path={small_corpus}", f"--workdir={tmp_path / 'run'}",
            *[f"--config.{k.replace('__', '.')}={v}" for k, v in FAST.items()],
            "--config.train.steps=12", "--config.checkpoint.every_steps=5", "--config.eval.tasks=local_text",
            "--config.eval.every_steps=5", f"--config.eval.include_path={tasks}"]
    killed = run_module("lm.train", *args, "--debug_kill_at_step=7")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_module("lm.train", *args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step 5: lm-eval local_text/bits_per_byte " in killed.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["lm_eval/local_text/bits_per_byte"]) for r in rows if "lm_eval/local_text/bits_per_byte" in r]
    assert [s for s, _ in logged] == [5, 10, 12]
    from lm.evaluation.harness import evaluate, for_run

    lm, _ = for_run(tmp_path / "run", step=5)
    found = evaluate(lm, ["local_text"], str(tasks))["results"]["local_text"]["bits_per_byte,none"]
    assert found == pytest.approx(logged[0][1], rel=1e-5)
