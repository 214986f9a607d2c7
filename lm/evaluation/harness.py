"""A meshlm model as EleutherAI lm-eval's `LM`: standard benchmarks on a run, without exporting.

`MeshLM` answers lm-eval's three kinds of request with the run's tokenizer and its model on the
run's own devices and tensor / FSDP split (pipeline stages and context shards folded into data
parallelism: evaluation is one plain forward pass):

- `loglikelihood`: batches of (context, continuation) token rows, right-padded to a power of two
  (few compiled shapes), split over the batch axis; the log-probability of each continuation and
  whether greedy decoding would produce it are reduced on the devices: only [b, t] comes back.
- `loglikelihood_rolling`: a document cut into disjoint windows of the trained context length
  (lm-eval's own windowing), each scored as above.
- `generate_until`: the KV-cached sampling loop of `lm.generate`, cut at the first stop string.

`evaluate()` runs tasks by name (lm-eval's registry plus `include_path` for local YAML tasks) and
turns a task lm-eval cannot load (no such task, its data not on this machine) into one line.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

import sharding
from lm import paths
from lm.config import UserError
from lm.model.sampling import generate_ids
from lm.program.checkpoint import Checkpointer
from lm.program.restore import restore


def _target_logprobs(model, tokens_bt, targets_bt):
    """log p(target) and whether it is the argmax, per position (float32 [b, t], bool [b, t])."""
    logits_btv, _ = model(tokens_bt)
    logprobs_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logprobs_btv, targets_bt[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits_btv, axis=-1) == targets_bt


class Scorer:
    """Log-probabilities of token rows on a mesh: the one forward pass behind all requests."""

    def __init__(self, model, mesh, rules, max_length: int, batch_size: int):
        self.model, self.mesh, self.rules = model, mesh, rules
        self.max_length = max_length
        self.split = sharding.axis_size(mesh, rules, "batch")
        self.batch_size = math.ceil(batch_size / self.split) * self.split  # rows divide over the batch axis
        self._forward = sharding.jit(_target_logprobs, mesh, rules)

    def score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation), greedy) for each (context ids, continuation ids): the
        context is cut from the left to fit `max_length`."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]) - len(rows[i][1]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            seqs = [(rows[i][0] + rows[i][1])[-(self.max_length + 1) :] for i in chunk]
            length = min(self.max_length, 1 << max(3, (max(len(s) for s in seqs) - 2).bit_length()))
            tokens = np.zeros((self.batch_size, length), np.int32)
            targets = np.zeros((self.batch_size, length), np.int32)
            for r, s in enumerate(seqs):
                tokens[r, : len(s) - 1], targets[r, : len(s) - 1] = s[:-1], s[1:]
            placed = sharding.named_sharding(self.mesh, ("batch", None), self.rules, shape=tokens.shape, name="eval tokens")
            with sharding.activate(self.mesh, self.rules):
                logp, greedy = jax.device_get(self._forward(self.model, jax.device_put(tokens, placed), jax.device_put(targets, placed)))
            for r, i in enumerate(chunk):
                n, k = len(seqs[r]) - 1, len(rows[i][1])  # predicted positions, continuation tokens
                out[i] = (float(logp[r, n - k : n].sum()), bool(greedy[r, n - k : n].all()))
        return out


def _lm_class():
    """`MeshLM`, defined on first use: lm-eval is an optional dependency (the `eval` extra)."""
    try:
        from lm_eval import utils
        from lm_eval.api.model import LM
    except ImportError:
        raise UserError("evaluation needs EleutherAI's lm-eval: pip install 'meshlm[eval]' (or pip install lm-eval)") from None

    class MeshLM(LM):
        def __init__(self, scorer: Scorer, tokenizer, max_gen_toks: int = 256):
            super().__init__()
            self.scorer, self.tokenizer, self.max_gen_toks = scorer, tokenizer, max_gen_toks
            # Before a document's first token: the end-of-text token where the tokenizer has one.
            self.prefix = [tokenizer.eos_id if tokenizer.eos_id is not None else 0]

        def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            """lm-eval's convention: the context's trailing spaces go with the continuation, and
            the continuation's ids are those of the whole text after the context's."""
            spaces = len(context) - len(context.rstrip(" "))
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = list(self.tokenizer.encode(context + continuation))
            ctx = list(self.tokenizer.encode(context)) if context else []
            return (ctx or self.prefix), whole[len(ctx):]

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self.scorer.score([self._split(*r.args) for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            totals = []
            for request in requests:
                ids = list(self.tokenizer.encode(request.args[0]))
                windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix[0], max_seq_len=self.scorer.max_length, context_len=1)]
                totals.append(sum(logp for logp, _ in self.scorer.score([(list(c), list(t)) for c, t in windows])))
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for request in requests:
                context, kwargs = request.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
                temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
                ids = list(self.tokenizer.encode(context)) or self.prefix
                ids = ids[-max(self.scorer.max_length - new, 1) :]
                with sharding.activate(self.scorer.mesh, self.scorer.rules):
                    generated = generate_ids(self.scorer.model, ids, new, temperature, 0, 0, rows=self.scorer.split)
                text = self.tokenizer.decode(generated)
                cut = min((text.find(s) for s in until if s and s in text), default=len(text))
                out.append(text[:cut])
            return out

    return MeshLM


def for_run(workdir, step: int | None = None, batch_size: int = 16):
    """(MeshLM on the run's latest or given checkpoint, that step): weights only, on the run's
    devices split as it trained (stages and context folded into data)."""
    config, tokenizer, layout, restored = restore(workdir, step, own_mesh=True, unstaged=True)
    if step is None:
        ckpt = Checkpointer(paths.existing_run_dir(workdir) / "checkpoints")
        step = ckpt.latest_step()
        ckpt.close()
    model = layout.model(restored["params"], restored.get("fp8"))
    max_length = config.train.seq_len if config.model.position != "learned" else min(config.train.seq_len, model.cfg.max_len)
    scorer = Scorer(model, layout.mesh, layout.rules, max_length, batch_size)
    return _lm_class()(scorer, tokenizer), step


def evaluate(lm, tasks: list[str], include_path: str | None = None, limit: float | None = None) -> dict:
    """lm-eval's results for `tasks` on `lm` (a `MeshLM`): its `results`, `versions`, `n-shot`
    ... as its own CLI writes them, minus the per-sample logs."""
    manager, loaded = load_tasks(tasks, include_path)
    return _run(lm, manager, loaded, limit)


def _run(lm, manager, loaded: dict, limit) -> dict:
    """lm-eval's evaluation of the loaded tasks, minus the per-sample logs and the task configs."""
    import lm_eval

    results = lm_eval.simple_evaluate(model=lm, tasks=list(loaded.values()), limit=limit, task_manager=manager,
                                      log_samples=False, bootstrap_iters=0)
    return {k: v for k, v in results.items() if k not in ("samples", "config")}


def load_tasks(tasks: list[str], include_path: str | None = None):
    """(lm-eval's task manager, {name: task} with its data loaded); a task lm-eval does not know,
    or whose data is not on this machine, is one line naming it."""
    _lm_class()  # lm-eval is there
    from lm_eval.tasks import TaskManager, get_task_dict

    # Local tasks alone first: indexing lm-eval's thousands of task files takes 7-10 s.
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"lm-eval knows no task {', '.join(unknown)}" + ("" if include_path else " (local tasks: --include_path=DIR of YAML files)"))
    for name in ("huggingface_hub", "datasets", "fsspec"):  # their retries' warnings: the one line below says it
        logging.getLogger(name).setLevel(logging.ERROR)
    loaded = {}
    for task in tasks:  # each task's data loaded on its own: a failure names its task
        try:
            loaded.update(_load(manager, task, get_task_dict))
        except Exception as e:  # datasets / fsspec raise many kinds when the data is not here
            if not _missing_data(e):
                raise
            raise UserError(f"task {task}: its dataset could not be loaded ({_first_line(e)}); on a machine without "
                            "a network only local tasks run (a YAML with dataset_path: json and local data_files)") from None
    return manager, loaded


def _load(manager, task: str, get_task_dict) -> dict:
    """{name: task or group} of one task name: `TaskManager.load` (lm-eval >= 0.4.10; the older
    `get_task_dict` is deprecated there), a group kept whole so that lm-eval aggregates it."""
    if not hasattr(manager, "load"):
        return get_task_dict([task], manager)
    got = manager.load([task])
    return {task: got["groups"][task]} if task in got["groups"] else got["tasks"]


class DuringTraining:
    """`eval.tasks` inside `lm.train`: the tasks checked and their data loaded when the run
    starts (a bad task fails it before any step), then run on the live parameters on the
    training mesh. Rows for metrics.jsonl: `lm_eval/TASK/METRIC`."""

    def __init__(self, config, program, tokenizer):
        e = config.eval
        if program.mesh.shape["stage"] > 1 or program.mesh.shape["context"] > 1:
            raise UserError("eval.tasks runs inside training on meshes without pipeline stages or context shards; "
                            "evaluate the checkpoints with python -m lm.evaluate instead")
        tasks = [t.strip() for t in e.tasks.split(",") if t.strip()]
        include = str(paths.existing_dir(e.include_path, "eval.include_path")) if e.include_path else None
        self.manager, self.loaded = load_tasks(tasks, include)
        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notes would interleave with training's lines
        self.limit = e.limit or None
        self.program = program
        # One scorer for the run (its forward pass compiled once); each evaluation swaps in the weights.
        self.scorer = Scorer(None, program.mesh, program.rules, config.train.seq_len, e.batch_size)
        self.lm = _lm_class()(self.scorer, tokenizer)

    def __call__(self, state) -> dict[str, float]:
        self.scorer.model = self.program.abstract_model.model(state.params, state.fp8)
        results = _run(self.lm, self.manager, self.loaded, self.limit)
        return {f"lm_eval/{task}/{name.split(',')[0]}": float(value)
                for task, metrics in results["results"].items() for name, value in metrics.items()
                if isinstance(value, (int, float)) and "_stderr" not in name and name != "sample_len"}


def _missing_data(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}"
    marks = ("ConnectionError", "ConnectError", "couldn't reach", "Couldn't reach", "offline", "OfflineModeIsEnabled",
             "FileNotFoundError", "DatasetNotFoundError", "Unable to find", "doesn't exist on the Hub", "LocalEntryNotFoundError")
    return any(m in text for m in marks) or (error.__cause__ is not None and _missing_data(error.__cause__))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]
