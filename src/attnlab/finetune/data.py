"""Prompt–completion and chat datasets with exact label masks.

A training example is `prompt_ids + completion_ids`, each tokenised on its own, so the
prompt tokens the model trains on are exactly those it sees at generation time, whether or
not the tokenizer's split of prompt+completion starts with its split of the prompt. Labels
are -100 on every prompt token and on padding, and the token id everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from attnlab.data.corpus import jsonl_records
from attnlab.errors import DataError

IGNORE = -100


def resolve_data_path(spec: str) -> Path:
    """A file path, or builtin:NAME for a dataset shipped with attnlab."""
    if spec.startswith("builtin:"):
        return Path(str(resources.files("attnlab") / "configs" / spec.removeprefix("builtin:")))
    return Path(spec).expanduser()


def read_rows(spec: str) -> list[dict[str, Any]]:
    """The rows of a JSONL file; each must be {prompt, completion} or {messages}."""
    path = resolve_data_path(spec)
    if not path.is_file():
        raise DataError(f"dataset not found: {path}. Point data.train / data.val at a JSONL file of "
                        '{"prompt": ..., "completion": ...} or {"messages": [...]} rows.')
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}, line {line}: {e.reason}); re-encode it as UTF-8, e.g. "
                        f"iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    rows = []
    for n, row in jsonl_records(text, path):
        if not isinstance(row, dict):
            raise DataError(f"{path}, line {n}: expected a JSON object, got {type(row).__name__}")
        if "messages" in row:
            msgs = row["messages"]
            if (not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                                   and isinstance(m.get("content"), str) for m in msgs)):
                raise DataError(f'{path}, line {n}: "messages" must be a list of {{"role": ..., "content": ...}} objects')
            if msgs[-1]["role"] != "assistant":
                raise DataError(f'{path}, line {n}: the last message must be the assistant\'s (it is what is trained on)')
        else:
            for key in ("prompt", "completion"):
                if key not in row:
                    raise DataError(f'{path}, line {n}: the row has no "{key}" field; every row needs "prompt" and '
                                    f'"completion" strings (or a "messages" list)')
                if not isinstance(row[key], str):
                    raise DataError(f'{path}, line {n}: "{key}" must be a string, got {type(row[key]).__name__}')
        rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no examples")
    return rows


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _chat_text(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def split_example(tokenizer, row: dict[str, Any], chat_template: bool, add_eos: bool) -> tuple[list[int], list[int]]:
    """(prompt_ids, completion_ids) of one row, each tokenised separately."""
    if "messages" in row or chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("chat data (a \"messages\" row, or data.chat_template: true) needs a tokenizer with a chat template; this one has none")
        messages = row["messages"] if "messages" in row else [
            {"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
        prompt_text = _chat_text(tokenizer, messages[:-1], True)
        full_text = _chat_text(tokenizer, messages, False)
        if not full_text.startswith(prompt_text):
            raise DataError("the chat template renders the conversation without the assistant turn as a text that is not a "
                            "prefix of the whole conversation; attnlab cannot tell prompt from completion for this template")
        # the template writes BOS etc. itself: no special tokens added here
        return _ids(tokenizer, prompt_text, False), _ids(tokenizer, full_text[len(prompt_text):], False)
    prompt_ids = _ids(tokenizer, row["prompt"], True)
    completion_ids = _ids(tokenizer, row["completion"], False)
    if add_eos and tokenizer.eos_token_id is not None:
        completion_ids.append(tokenizer.eos_token_id)
    return prompt_ids, completion_ids


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids a chat-trained model is prompted with for a user message `prompt`."""
    return _ids(tokenizer, _chat_text(tokenizer, [{"role": "user", "content": prompt}], True), False)


@dataclass
class Encoded:
    examples: list[dict[str, list[int]]]
    dropped: list[int] = field(default_factory=list)  # row numbers (0-based) whose completion was truncated away
    truncated: int = 0  # examples whose completion was cut short
    completion_tokens: int = 0
    completion_bytes: int = 0

    def summary(self, name: str) -> str:
        return (f"{name}: {len(self.examples)} examples, {self.truncated} truncated to fit data.max_len, "
                f"{len(self.dropped)} dropped (no completion token left within data.max_len)")


def encode_rows(tokenizer, rows: list[dict], max_len: int, chat_template: bool = False, add_eos: bool = True) -> Encoded:
    """Tokenise rows into {input_ids, labels}; report truncated and dropped examples."""
    out = Encoded([])
    for i, row in enumerate(rows):
        prompt_ids, completion_ids = split_example(tokenizer, row, chat_template, add_eos)
        room = max_len - len(prompt_ids)
        if room <= 0 or not completion_ids:
            out.dropped.append(i)
            continue
        if len(completion_ids) > room:
            completion_ids = completion_ids[:room]
            out.truncated += 1
        out.examples.append({"input_ids": prompt_ids + completion_ids, "labels": [IGNORE] * len(prompt_ids) + completion_ids})
        out.completion_tokens += len(completion_ids)
        out.completion_bytes += len(tokenizer.decode(completion_ids).encode("utf-8"))
    return out


def pack_examples(examples: list[dict[str, list[int]]], max_len: int) -> list[dict[str, list[int]]]:
    """Concatenate examples, in order, into rows of at most `max_len` tokens. Labels stay exactly as each
    example had them (-100 on its prompt), so no token is trained on that was not trained on unpacked; an
    example attends to the examples before it in its row."""
    rows: list[dict[str, list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    for e in examples:
        if ids and len(ids) + len(e["input_ids"]) > max_len:
            rows.append({"input_ids": ids, "labels": labels})
            ids, labels = [], []
        ids = ids + e["input_ids"]
        labels = labels + e["labels"]
    if ids:
        rows.append({"input_ids": ids, "labels": labels})
    return rows


class ExampleDataset(torch.utils.data.Dataset):
    def __init__(self, examples: list[dict[str, list[int]]]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.examples[i]


class PadCollator:
    """Right-pads a batch: pad id in input_ids, 0 in attention_mask, -100 in labels."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[r, :n] = torch.tensor(b["input_ids"])
            labels[r, :n] = torch.tensor(b["labels"])
            mask[r, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
