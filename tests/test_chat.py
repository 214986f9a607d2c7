"""Chat fine-tuning data: templates rendered as `transformers` renders them, the loss mask of a
conversation, packing whole conversations, the loss a mean over the step's trained tokens, and
bad records in one line."""

import json

import jax
import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, fast_config, run_cli

from lm import prepare
from lm.data import chat, corpus
from lm.data.tokenizer import HFTokenizer
from lm.program.steps import setup

transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3's shape: a bos token, headers, contents trimmed, roles checked.
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
          "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
TEMPLATES = {
    "chatml": (CHATML, {"eos_token": "<|im_end|>"}, ["<|im_start|>", "<|im_end|>"]),
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a mesh?"},
    {"role": "assistant", "content": "Devices in a grid."},
    {"role": "user", "content": "And a shard?"},
    {"role": "assistant", "content": "One device's part of an array."},
]
# The same conversation as the templates write it, in pieces: (text, trained under loss_on=assistant).
HAND_MADE = {
    "chatml": [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is a mesh?<|im_end|>\n<|im_start|>assistant\n", 0),
               ("Devices in a grid.<|im_end|>", 1), ("\n<|im_start|>user\nAnd a shard?<|im_end|>\n<|im_start|>assistant\n", 0),
               ("One device's part of an array.<|im_end|>", 1), ("\n", 0)],
    "llama3": [("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>"
                "\n\nWhat is a mesh?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", 0),
               ("Devices in a grid.<|eot_id|>", 1),
               ("<|start_header_id|>user<|end_header_id|>\n\nAnd a shard?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", 0),
               ("One device's part of an array.<|eot_id|>", 1)],
}


def chat_tokenizer(directory, name: str):
    """A byte-level BPE with the template's special tokens, and a tokenizer_config.json holding
    the template (as a Hugging Face checkpoint has them); returns the tokenizer.json's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    template, special, added = TEMPLATES[name]
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for m in CONVERSATION] * 20 + ["the devices of a mesh hold shards of arrays"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=added, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **special}))
    return directory / "tokenizer.json"


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_rendering_equals_apply_chat_template_and_the_mask_a_hand_made_one(tmp_path, name):
    path = chat_tokenizer(tmp_path, name)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), **TEMPLATES[name][1])
    template = chat.load_template(None, str(path))
    for messages in (CONVERSATION, CONVERSATION[1:3], CONVERSATION[:2]):
        for prompt in (False, True):
            assert template.render(messages, add_generation_prompt=prompt) == theirs.apply_chat_template(
                messages, chat_template=TEMPLATES[name][0], tokenize=False, add_generation_prompt=prompt)
    tokenizer = HFTokenizer(path)
    ids, mask = chat.encode(CONVERSATION, template, tokenizer, "assistant", "test")
    pieces = [(tokenizer.encode_with_offsets(text)[0], trained) for text, trained in HAND_MADE[name]]
    assert ids.tolist() == [i for piece, _ in pieces for i in piece.tolist()]
    assert mask.tolist() == [trained for piece, trained in pieces for _ in piece]
    assert ids.tolist() == theirs.apply_chat_template(CONVERSATION, chat_template=TEMPLATES[name][0], tokenize=True, return_dict=False)
    # completion: the last answer only; all: every token
    _, last = chat.encode(CONVERSATION, template, tokenizer, "completion", "test")
    first_answer = len(pieces[0][0])
    assert last.sum() == len(pieces[3][0]) and last[first_answer] == 0 and mask[first_answer] == 1
    assert chat.encode(CONVERSATION, template, tokenizer, "all", "test")[1].all()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def conversations(n: int, seed: int = 0) -> list[dict]:
    """n conversations of 1 to 3 turns with answers of varied lengths; every third a prompt /
    completion pair."""
    rng = np.random.default_rng(seed)
    words = "mesh shard device array axis rule layer token batch step".split()
    say = lambda k: " ".join(rng.choice(words, k))  # noqa: E731
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append({"prompt": say(3), "completion": say(int(rng.integers(2, 12)))})
            continue
        messages = [{"role": "system", "content": "Be brief."}]
        for _ in range(int(rng.integers(1, 4))):
            messages += [{"role": "user", "content": say(int(rng.integers(2, 6)))}, {"role": "assistant", "content": say(int(rng.integers(2, 15)))}]
        out.append({"messages": messages})
    return out


def chat_corpus(tmp_path, seq_len: int = 64, **data):
    """(the opened corpus, its store) of 60 conversations under the ChatML tokenizer."""
    tok = chat_tokenizer(tmp_path / "tok", "chatml")
    path = write_jsonl(tmp_path / "chat.jsonl", conversations(60))
    config = fast_config(path, data__format="chat", data__tokenizer=str(tok), data__cache_dir=str(tmp_path / "cache"), train__seq_len=seq_len,
                         **{f"data__{k}": v for k, v in data.items()})
    opened = corpus.open_corpus(config, tmp_path / "run", progress=False)
    return opened, opened.splits[0][0].store


def test_packed_rows_hold_whole_conversations_with_their_masks(tmp_path):
    opened, store = chat_corpus(tmp_path, seq_len=256)
    train, val = opened.splits[0]
    assert train.count < len(train.docs)  # packed: fewer rows than conversations
    seen = []
    batch = train.batch(np.arange(train.count), document_masking=True)
    for r in range(train.count):
        segments, tokens, mask = batch["segments"][r], batch["tokens"][r], batch["mask"][r]
        docs = train.docs[train.firsts[r] : train.firsts[r + 1]]
        assert np.all(np.diff(segments) >= 0) and segments[-1] <= len(docs)
        for k, d in enumerate(docs):  # each conversation whole, in order, its mask the store's
            a, n = store.doc_starts[d], store.doc_lengths[d]
            at = np.flatnonzero(segments == k)
            assert len(at) == n and np.array_equal(tokens[at], store.read(a, a + n)) and np.array_equal(mask[at], store.read_mask(a, a + n))
        assert not mask[segments == len(docs)].any()  # padding is never trained
        seen += docs.tolist()
    assert sorted(seen + val.docs.tolist()) == list(range(store.num_documents))
    # one a row without packing, no segments
    opened, _ = chat_corpus(tmp_path / "unpacked", seq_len=256, packing=False)
    unpacked = opened.splits[0][0]
    assert unpacked.count == len(unpacked.docs) and "segments" not in unpacked.batch([0, 1], document_masking=False)


def test_truncate_drop_counts_conversations_in_the_manifest(tmp_path):
    _, cut = chat_corpus(tmp_path / "cut", seq_len=128)
    _, dropped = chat_corpus(tmp_path / "drop", seq_len=128, truncate="drop")
    counts = dropped.manifest["counts"]
    assert counts["conversations_dropped"] == cut.manifest["counts"]["conversations_truncated"] > 0
    assert dropped.num_documents == cut.num_documents - counts["conversations_dropped"]
    assert cut.doc_lengths.max() == 129 and dropped.doc_lengths.max() <= 129


def packed_and_one_a_row(conversations_ids, seq_len: int):
    """(packed batch: the conversations in two rows, with segments; one a row, padded), as the
    corpus makes them; masks included."""
    width, half = seq_len + 1, (len(conversations_ids) + 1) // 2
    packed = {k: np.zeros((2, width), dtype) for k, dtype in (("tokens", np.int32), ("mask", np.uint8), ("segments", np.int32))}
    rows = {k: np.zeros((len(conversations_ids), width), dtype) for k, dtype in (("tokens", np.int32), ("mask", np.uint8))}
    for r, part in enumerate((conversations_ids[:half], conversations_ids[half:])):
        at = 0
        for k, (ids, mask) in enumerate(part):
            n = len(ids)
            packed["tokens"][r, at : at + n], packed["mask"][r, at : at + n], packed["segments"][r, at : at + n] = ids, mask, k
            at += n
        packed["segments"][r, at:] = len(part)
    for k, (ids, mask) in enumerate(conversations_ids):
        rows["tokens"][k, : len(ids)], rows["mask"][k, : len(ids)] = ids, mask
    return packed, rows


def reference_loss(model, conversations_ids) -> float:
    """transformers' loss, labels -100 outside the answers, summed over conversations run
    separately and divided by the trained tokens of all."""
    import torch

    total, count = 0.0, 0
    for ids, mask in conversations_ids:
        labels = torch.as_tensor(np.where(mask.astype(bool), ids, -100), dtype=torch.long)[None]
        trained = int((labels[0, 1:] != -100).sum())
        with torch.no_grad():
            loss = model(torch.as_tensor(ids, dtype=torch.long)[None], labels=labels).loss.item()
        total, count = total + loss * trained, count + trained
    return total / count


@pytest.mark.parametrize("mesh", [{"data": 1}, {"fsdp": 2, "tensor": 2}], ids=["one_device", "fsdp2_tensor2"])
def test_sft_loss_equals_transformers_with_labels_outside_the_answers(tmp_path, mesh):
    pytest.importorskip("torch", reason="torch (the test extra; Python 3.11 only) is not installed")
    from hf_models import make_hf_model

    from lm import config as lm_config
    from lm.hf import checkpoint as hf_checkpoint

    model = make_hf_model(tmp_path / "hf", "llama", std=0.5)
    tok = chat_tokenizer(tmp_path / "tok", "chatml")
    template, tokenizer = chat.load_template(None, str(tok)), HFTokenizer(tok)
    encoded = [chat.encode(chat.messages_of(r, "test")[0], template, tokenizer, "assistant", "test") for r in conversations(6, seed=1)]
    seq_len = max(sum(len(ids) for ids, _ in encoded[:3]), sum(len(ids) for ids, _ in encoded[3:])) + 3
    packed, rows = packed_and_one_a_row(encoded, seq_len)
    ref = reference_loss(model, encoded)
    hf_dir, hf_config = hf_checkpoint.read_hf_config(tmp_path / "hf")
    for batch in (packed, rows):
        overrides = {**{f"mesh.{k}": v for k, v in mesh.items()}, "train.batch_size": len(batch["tokens"]), "train.seq_len": seq_len,
                     "model.attention": "einsum", "data.document_masking": "segments" in batch, "model.max_positions": 4096}
        program = setup(hf_checkpoint.config_from_hf(lm_config.default_config(), hf_dir, hf_config, overrides), 0,
                        jax.devices()[: int(np.prod(list(mesh.values())))])
        state = program.init_from(0, hf_checkpoint.load_params(hf_checkpoint.Reader(hf_dir), program.abstract_model))
        _, metrics = program.train_step(state, program.global_batch(batch))
        assert abs(float(metrics["loss"]) - ref) <= 1e-5 * max(1.0, ref), (sorted(batch), float(metrics["loss"]), ref)
        assert int(metrics["trained_tokens"]) == sum(int(m[1:].sum()) for _, m in encoded)


def test_accumulation_averages_over_the_steps_trained_tokens_not_each_microbatchs_mean():
    """Two microbatches with very different numbers of trained tokens: one step of accumulation 2
    on 2 data replicas has the one big batch's loss and gradients, where a mean of the two means
    would not."""
    from conftest import VOCAB, small_config, step_and_gradients

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (4, SMALL_SEQ + 1)).astype(np.int32)
    mask = np.zeros_like(tokens, np.uint8)
    mask[:2, 1:] = 1  # the first microbatch trains every target
    mask[2:, -3:] = 1  # the second two each
    results = []
    for accum in (1, 2):
        program = setup(small_config({"data": 2}, train__batch_size=4, train__grad_accum=accum, train__seq_len=SMALL_SEQ), VOCAB, jax.devices()[:2])
        state = program.init_state(0)
        _, (loss, grads) = step_and_gradients(program)(state, program.global_batch({"tokens": tokens, "mask": mask}))
        results.append((float(loss), jax.device_get(grads)))
        if accum == 1:  # each microbatch's own mean, for the negative control
            halves = [float(program.eval_step(state, program.global_batch({"tokens": tokens[s], "mask": mask[s]}))) for s in (slice(0, 2), slice(2, 4))]
    (whole, g1), (accumulated, g2) = results
    assert abs(whole - accumulated) <= 1e-6 * whole
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max())
    assert abs(np.mean(halves) - whole) > 1e-3  # the mean of means is another number


SMALL_SEQ = 32


def test_bad_chat_input_is_one_line_and_leaves_nothing(tmp_path, capsys):
    tok = chat_tokenizer(tmp_path / "tok", "llama3")
    chat_tokenizer(tmp_path / "bare", "chatml")
    (tmp_path / "bare" / "tokenizer_config.json").unlink()  # a tokenizer without a template
    good = conversations(3)
    cases = {
        "no_assistant": ([good[0], {"messages": [{"role": "user", "content": "hi"}]}], str(tok), "chat.jsonl:2", "no assistant turn"),
        "role": ([{"messages": [{"role": "critic", "content": "no"}, {"role": "assistant", "content": "yes"}]}], str(tok),
                 "chat.jsonl:1", "unknown role critic"),
        "fields": ([{"text": "plain"}], str(tok), "chat.jsonl:1", "no field 'messages'"),
        "template": (good, str(tmp_path / "bare" / "tokenizer.json"), "needs a chat template", "data.chat_template"),
    }
    for name, (records, tokenizer, *fragments) in cases.items():
        (tmp_path / name).mkdir()
        path = write_jsonl(tmp_path / name / "chat.jsonl", records)
        out = tmp_path / name / "store"
        result = run_cli(capsys, prepare.main, "--config=configs/tiny.py", f"--out={out}", f"--config.data.path={path}",
                         "--config.data.format=chat", f"--config.data.tokenizer={tokenizer}")
        assert_one_line_error(result, *fragments)
        assert not out.exists(), name  # nothing written


@pytest.mark.parametrize("mesh,kw,packed", [
    ({"stage": 2, "data": 2}, {"pipeline__microbatches": 2, "pipeline__schedule": "1f1b"}, False),
    ({"stage": 2}, {"pipeline__microbatches": 2, "pipeline__schedule": "gpipe"}, False),
    ({"context": 2, "data": 2}, {"data__document_masking": True}, True),
], ids=["1f1b_stage2_data2", "gpipe_stage2", "context2_data2_packed"])
def test_the_loss_mask_through_pipelines_and_context_parallelism_equals_one_device(mesh, kw, packed):
    """A step's loss and gradients with a loss mask (and packed segments) on a pipeline or a
    context-parallel mesh equal one device's."""
    from conftest import VOCAB, small_config, step_and_gradients

    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, (4, SMALL_SEQ + 1)).astype(np.int32)
    mask = (rng.random(tokens.shape) < 0.3).astype(np.uint8)
    batch = {"tokens": tokens, "mask": mask}
    if packed:
        batch["segments"] = np.cumsum(rng.random(tokens.shape) < 0.1, axis=1).astype(np.int32)
    results = []
    for m, extra in (({"data": 1}, {k: v for k, v in kw.items() if k.startswith("data__")}), (mesh, kw)):
        program = setup(small_config(m, train__batch_size=4, **extra), VOCAB, jax.devices()[: int(np.prod(list(m.values())))])
        state = program.init_state(0)
        _, (loss, grads) = step_and_gradients(program)(state, program.global_batch(batch))
        results.append((float(loss), jax.device_get(grads)))
    (one, g1), (split, g2) = results
    assert abs(one - split) <= 1e-5 * one, (one, split)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(a).max())


@pytest.mark.slow
def test_generate_chat_renders_one_user_turn_and_stops_at_the_end_of_turn(tmp_path, capsys, monkeypatch):
    """`lm.generate --chat`: the prompt is the template's rendering of one user turn with its
    generation prompt; the answer printed ends before the end-of-turn token the model sampled."""
    from lm import cli, generate, train

    chat_corpus(tmp_path, seq_len=256)  # the conversations and tokenizer
    run = tmp_path / "run"
    tok = tmp_path / "tok" / "tokenizer.json"
    try:
        cli.run(train.main, [f"--config={ROOT}/configs/tiny.py",
                             f"--workdir={run}", f"--config.data.path={tmp_path / 'chat.jsonl'}", "--config.data.format=chat",
                             f"--config.data.tokenizer={tok}", f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.train.steps=1",
                             "--config.train.seq_len=256", "--config.train.batch_size=8"])
    except SystemExit as e:
        assert not e.code
    capsys.readouterr()
    tokenizer = HFTokenizer(tok)
    answer = tokenizer.encode_with_offsets("Devices in a grid.<|im_end|>\nmore text")[0]
    seen = {}

    def sampled(model, prompt_ids, *args, **kwargs):
        seen["prompt"] = list(prompt_ids)
        return answer

    monkeypatch.setattr(generate, "generate_ids", sampled)
    result = run_cli(capsys, generate.main, f"--workdir={run}", "--chat=What is a mesh?", "--print_ids")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "Devices in a grid."
    assert [int(i) for i in lines[1].split()] == answer.tolist()[: answer.tolist().index(tokenizer.tokenizer.token_to_id("<|im_end|>"))]
    expected = "<|im_start|>user\nWhat is a mesh?<|im_end|>\n<|im_start|>assistant\n"
    assert seen["prompt"] == tokenizer.encode_with_offsets(expected)[0].tolist()


def test_jsonl_parquet_and_datasets_conversations_make_the_same_store(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [r for r in conversations(30) if "messages" in r]  # one schema per table
    jsonl = write_jsonl(tmp_path / "c.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet", row_group_size=7)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    tok = chat_tokenizer(tmp_path / "tok", "chatml")
    stores = []
    for path in (jsonl, tmp_path / "c.parquet", tmp_path / "ds"):
        config = fast_config(path, data__format="chat", data__tokenizer=str(tok), data__cache_dir=str(tmp_path / "cache"), train__seq_len=256)
        store = corpus.open_corpus(config, tmp_path / f"run-{path.name}", progress=False).splits[0][0].store
        stores.append((store.read(0, store.num_tokens), store.read_mask(0, store.num_tokens), store.doc_lengths))
    for other in stores[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(stores[0], other))
    assert len(stores[0][2]) == len(records) and stores[0][1].any()
