"""Conversations -> tokens and a loss mask, rendered by the checkpoint's own chat template.

A record holds `messages` (a list of `{role, content}`) or a `prompt` / `completion` pair (a
user turn and the assistant's answer). It is rendered with the template exactly as
`transformers`' `apply_chat_template` renders it (the same sandboxed Jinja environment, its
globals and the tokenizer's special tokens), tokenised whole, and each token marked trained or
not by `loss_on`:

    assistant    every assistant turn: its content through the template's end-of-turn marker
    completion   the last assistant turn only (the completion of a prompt / completion pair)
    all          every token

An assistant turn starts where the template's generation prompt for it ends (found by rendering
the conversation before it with `add_generation_prompt=True`, a prefix of the whole), so what a
template puts before the content (e.g. an empty thinking block) is trained as the model would
generate it; it ends after the end-of-turn marker (`<|im_end|>`, `<|eot_id|>`, `</s>`: the first
word the template writes after an assistant message), which is what `lm.generate --chat` stops at.

Light on purpose, as `lm.data.tokenizer`: `lm.prepare`'s worker processes import it, never JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from datetime import datetime
from pathlib import Path

import numpy as np

from lm.errors import UserError

LOSS_ON = ("assistant", "completion", "all")
TEMPLATE_FILE = "chat_template.json"  # a run's own copy: the template and its special tokens
_PROBE = "meshlm probe 7431"  # an assistant message whose rendering shows the end-of-turn marker
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _environment():
    """The Jinja environment `apply_chat_template` renders in: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and an unescaped `tojson`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template's Jinja source and the special tokens it is rendered with."""

    source: str
    special_tokens: dict = dataclasses.field(default_factory=dict)
    where: str = "the chat template"

    def __post_init__(self):
        import jinja2

        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise UserError(f"{self.where} is not a Jinja template ({e})") from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "a conversation") -> str:
        import jinja2

        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise UserError(f"{where}: {self.where} rejects the conversation ({str(e).splitlines()[0]})") from None

    @functools.cached_property
    def end_of_turn(self) -> str:
        """The marker the template writes after an assistant message (its eos token if none)."""
        user = {"role": "user", "content": "Hi"}
        text = self.render([user, {"role": "assistant", "content": _PROBE}], where="an end-of-turn probe")
        after = text[text.rfind(_PROBE) + len(_PROBE):].split()
        marker = after[0] if after else self.special_tokens.get("eos_token") or ""
        if not marker:
            raise UserError(f"{self.where} writes nothing after an assistant message and names no eos_token: no end of turn to train or stop at")
        return marker

    def to_json(self) -> str:
        return json.dumps({"chat_template": self.source, **self.special_tokens}, sort_keys=True)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {'content': ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _from_tokenizer_config(path: Path) -> ChatTemplate | None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read as JSON ({e})") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    special = {k: _token_text(config[k]) for k in _SPECIAL if _token_text(config.get(k)) is not None}
    if source is None:
        jinja = path.parent / "chat_template.jinja"
        if not jinja.is_file():
            return None
        source, path = jinja.read_text(), jinja
    return ChatTemplate(source, special, str(path))


def load_template(setting: str | None, tokenizer_path: str | None, workdir: Path | None = None) -> ChatTemplate:
    """The run's chat template: `data.chat_template` (a .jinja file, or a tokenizer_config.json /
    chat_template.json holding one), else the run's own copy in `workdir`, else the one beside
    the tokenizer (its tokenizer_config.json's `chat_template`, or chat_template.jinja)."""
    candidates = []
    if setting:
        path = Path(setting).expanduser()
        if not path.is_file():
            raise UserError(f"data.chat_template={setting!r} is not a file; name a .jinja template or a tokenizer_config.json holding one")
        if path.suffix == ".json":
            found = _from_tokenizer_config(path)
            if found is None:
                raise UserError(f"data.chat_template={setting}: the file holds no chat_template")
            return found
        special = {}
        config = path.parent / "tokenizer_config.json"
        if config.is_file() and (beside := _from_tokenizer_config(config)) is not None:
            special = beside.special_tokens
        return ChatTemplate(path.read_text(), special, str(path))
    if workdir is not None:
        candidates.append(Path(workdir) / TEMPLATE_FILE)
    if tokenizer_path and tokenizer_path not in ("byte", "bpe", "none"):
        here = Path(tokenizer_path).expanduser().parent
        candidates += [here / TEMPLATE_FILE, here / "tokenizer_config.json", here / "chat_template.jinja"]  # (a chat store keeps its own)
    for path in candidates:
        if path.is_file():
            found = _from_tokenizer_config(path) if path.suffix == ".json" else ChatTemplate(path.read_text(), {}, str(path))
            if found is not None:
                return found
    beside = f" beside {tokenizer_path}" if tokenizer_path and tokenizer_path not in ("byte", "bpe", "none") else ""
    raise UserError(f"data.format=chat needs a chat template: none found{beside} (tokenizer_config.json's chat_template, "
                    "chat_template.jinja); name one with --config.data.chat_template=FILE")


def keep_template(template: ChatTemplate, workdir: Path) -> None:
    """The template saved in the run directory (resume, `lm.generate --chat`, export)."""
    path = Path(workdir) / TEMPLATE_FILE
    if not path.is_file() or path.read_text() != template.to_json():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(template.to_json())
        tmp.replace(path)


# ---------------------------------------------------------------------------- records


def messages_of(record, where: str) -> tuple[list[dict], bool]:
    """(the conversation's messages, whether it was a prompt / completion pair) of a record."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: a chat record is a JSON object with 'messages' or 'prompt' and 'completion', not {type(record).__name__}")
    if record.get("messages") is not None:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise UserError(f"{where}: field 'messages[{i}]' is not a {{role, content}} object with text in both")
        return [dict(m) for m in messages], False
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}], True
    raise UserError(f"{where}: no field 'messages' (a list of {{role, content}}) nor text fields 'prompt' and 'completion'")


def trained_spans(messages: list[dict], template: ChatTemplate, loss_on: str, where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans the loss is on)."""
    text = template.render(messages, where=where)
    if loss_on == "all":
        return text, [(0, len(text))]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise UserError(f"{where}: field 'messages' has no assistant turn, so data.loss_on={loss_on} trains nothing; "
                        "add one, or use data.loss_on=all")
    if loss_on == "completion":
        turns = turns[-1:]
    marker, spans = template.end_of_turn, []
    for i in turns:
        prompt = template.render(messages[:i], add_generation_prompt=True, where=where)
        if not text.startswith(prompt):
            raise UserError(f"{where}: {template.where} renders the conversation before message {i} differently on its own "
                            "than as part of the whole, so its assistant turns cannot be told apart; use data.loss_on=all")
        content = messages[i]["content"].strip()
        found = text.find(content, len(prompt)) if content else -1
        end = found + len(content) if found >= 0 else len(prompt)  # (a template may rewrite the content)
        close = text.find(marker, end)
        spans.append((len(prompt), close + len(marker) if close >= 0 else len(text)))
    return text, spans


def encode(messages: list[dict], template: ChatTemplate, tokenizer, loss_on: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32, loss mask uint8) of one conversation, tokenised whole (no special
    tokens added: the template writes its own); a token is trained when it starts in a span."""
    text, spans = trained_spans(messages, template, loss_on, where)
    trained_c = np.zeros(len(text) + 1, bool)
    for a, b in spans:
        trained_c[a:b] = True
    if hasattr(tokenizer, "encode_with_offsets"):
        ids, starts = tokenizer.encode_with_offsets(text)
        return ids, trained_c[np.minimum(starts, len(text))].astype(np.uint8)
    ids = tokenizer.encode(text)  # bytes: each character's mark repeated over its UTF-8 bytes
    widths = np.asarray([len(ch.encode("utf-8")) for ch in text], np.int64)
    return ids, np.repeat(trained_c[: len(text)], widths).astype(np.uint8)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """How a chat corpus is prepared: the template, what is trained, the longest conversation
    kept (`seq_len + 1` tokens: a training row) and what happens to longer ones."""

    template: ChatTemplate
    loss_on: str
    max_tokens: int
    truncate: str  # right | drop

    def to_dict(self) -> dict:
        return {"template": json.loads(self.template.to_json()), "loss_on": self.loss_on, "max_tokens": self.max_tokens, "truncate": self.truncate}

    @classmethod
    def from_dict(cls, d: dict) -> ChatFormat:
        template = dict(d["template"])
        return cls(ChatTemplate(template.pop("chat_template"), template), d["loss_on"], d["max_tokens"], d["truncate"])

    def encode_record(self, record, tokenizer, where: str, counts) -> tuple[np.ndarray, np.ndarray] | None:
        """One record's (ids, mask), cut to `max_tokens` (None when dropped), counted."""
        messages, pair = messages_of(record, where)
        ids, mask = encode(messages, self.template, tokenizer, self.loss_on, where)
        if len(ids) > self.max_tokens:
            if self.truncate == "drop":
                counts["conversations_dropped"] += 1
                return None
            counts["conversations_truncated"] += 1
            ids, mask = ids[: self.max_tokens], mask[: self.max_tokens]
        counts["trained_tokens"] += int(mask.sum())
        return ids, mask


def chat_format(data_config, seq_len: int, tokenizer_setting: str | None, workdir: Path | None = None) -> ChatFormat | None:
    """The config's ChatFormat (None unless `data.format=chat`)."""
    if data_config.get("format", "text") != "chat":  # (partial data configs: text)
        return None
    loss_on = "assistant" if data_config.loss_on == "auto" else data_config.loss_on
    template = load_template(data_config.chat_template, tokenizer_setting, workdir)
    return ChatFormat(template, loss_on, seq_len + 1, data_config.truncate)
