"""Perplexity and bits per byte of a model on a text file or on a training config's validation split.

The text is tokenised as training does (each document followed by EOS). Windows of `seq_len`
tokens overlap by one token, so every token after the first is predicted exactly once, from
the tokens before it in its window. With N tokens, B UTF-8 bytes of text and P = N - 1
predicted tokens of total negative log-likelihood NLL (nats):

    loss = NLL / P            perplexity = exp(loss)            bits_per_byte = loss / ln 2 * N / B

(bits per byte as in training: loss per token in bits, times tokens per byte).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from attnlab.config import load_config
from attnlab.data import read_documents, split_documents, tokenize_documents
from attnlab.errors import DataError

LAYOUT = "a text file (or a .jsonl/.parquet file or directory that data.source accepts), or a training config .yaml (its validation split)"


def load_texts(data: Path, split: str = "dev") -> tuple[list[str], str]:
    """(documents, description): the file's documents, or a training config's validation documents."""
    data = Path(data)
    if not data.exists():
        raise DataError(f"perplexity data not found: {data}. Pass {LAYOUT}.")
    if data.suffix in (".yaml", ".yml"):
        cfg = load_config(data)
        if cfg.data.val_source:
            return read_documents(cfg.data.val_source, cfg.data.text_field), f"{cfg.data.val_source} (validation source of {data})"
        docs = read_documents(cfg.data.source, cfg.data.text_field)
        train, val = split_documents(docs, cfg.data.val_fraction, cfg.train.seed)
        if not val:
            raise DataError(f"{data} has no validation split (data.val_fraction is 0 and no data.val_source)")
        if split == "train":
            return train, f"training split of {data}"
        return val, f"validation split of {data}"
    return read_documents(str(data)), str(data)


def windows(n_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """[start, end) of windows of at most seq_len tokens, each starting on the previous one's last token."""
    if seq_len < 2:
        raise DataError(f"seq_len must be at least 2, got {seq_len}")
    spans, start = [], 0
    while start < n_tokens - 1:
        spans.append((start, min(start + seq_len, n_tokens)))
        start += seq_len - 1
    return spans


@torch.no_grad()
def perplexity(model, tokenizer, texts: list[str], seq_len: int = 1024, batch_size: int = 8, limit: int | None = None,
               progress: Callable[[int], None] | None = None) -> dict[str, float | int | None]:
    """loss (nats/token), perplexity and bits per byte of `model` on `texts` (see the module docstring).

    `limit` caps the number of windows scored; bytes per token are those of the whole text.
    """
    ids = tokenize_documents(texts, tokenizer)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    spans = windows(len(ids), seq_len)
    if limit is not None:
        spans = spans[:limit]
    if not spans:
        raise DataError("the text is too short to score: it needs at least two tokens")
    device = next(model.parameters()).device
    nll, predicted = 0.0, 0
    for b in range(0, len(spans), batch_size):
        group = spans[b:b + batch_size]
        longest = max(e - s for s, e in group)
        input_ids = torch.full((len(group), longest), 0, dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for i, (s, e) in enumerate(group):  # right padding: positions of real tokens start at 0
            input_ids[i, : e - s] = torch.from_numpy(np.asarray(ids[s:e]))
            mask[i, : e - s] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        logits = model(input_ids=input_ids, attention_mask=mask).logits.float()  # [rows, time, vocab]
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        target = input_ids[:, 1:]
        token_nll = -logp.gather(-1, target[..., None])[..., 0]  # [rows, time - 1]
        valid = mask[:, 1:].bool()
        nll += float(token_nll[valid].sum())
        predicted += int(valid.sum())
        if progress is not None:
            progress(len(group))
    bytes_per_token = n_bytes / len(ids)
    loss = nll / predicted
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "bits_per_byte": loss / math.log(2) / bytes_per_token,
        "tokens": len(ids),
        "predicted_tokens": predicted,
        "bytes": n_bytes,
        "windows": len(spans),
    }
