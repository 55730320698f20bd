"""Multi-query associative recall (MQAR, Zoology's synthetic recall task), generated on the fly.

Every sequence of `seq_len` tokens starts with `num_pairs` key-value pairs; the rest is filler in which
`num_queries` of the keys come back, each followed by its value:

    k1 v1 k2 v2 ... kP vP  x x k2 v2 x x x x k1 v1 x x ...
                                  ^^            ^^   labels (-100 everywhere else)

Token ids: 0 is the blank; keys are drawn from 1..K and values from K+1..vocab_size-1 (K = (vocab_size-1)//2),
distinct within a sequence; queries take distinct keys, at slots (even offsets after the pairs) drawn
uniformly. The filler (`x` above) is the blank, as in Zoology's default, or with filler='random' any id but
the sequence's keys (Zoology's random_non_queries), so that a key occurs only in its pair and in its query.
Labels hold the value at each query's answer position: the model (which shifts labels) learns to predict
the value from the query key, and nothing else. Accuracy is per query, exact: the
argmax of the logits at the key is the value.

Example `i` of a stream is made by its own generator seeded by (seed, stream, i): deterministic per seed,
in any order, and the evaluation stream never repeats the training stream's generators.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .packing import PackedData

TRAIN, EVAL = 0, 1
MQAR = "mqar"


def mqar_example(vocab_size: int, num_pairs: int, num_queries: int, seq_len: int, seed: int, index: int,
                 stream: int = TRAIN, filler: str = "blank") -> tuple[np.ndarray, np.ndarray]:
    """(input ids [seq_len], labels [seq_len]) of example `index` of `stream`; filler 'blank' (token 0) or 'random'."""
    rng = np.random.default_rng([seed, stream, index])
    n_keys = (vocab_size - 1) // 2
    n_values = vocab_size - 1 - n_keys
    keys = 1 + rng.choice(n_keys, size=num_pairs, replace=False)
    values = 1 + n_keys + rng.choice(n_values, size=num_pairs, replace=False)
    ids = np.empty(seq_len, dtype=np.int64)
    labels = np.full(seq_len, -100, dtype=np.int64)
    context = 2 * num_pairs
    ids[0:context:2], ids[1:context:2] = keys, values
    if filler == "random":
        rest = rng.integers(1, vocab_size, size=seq_len - context)
        key_ids = np.zeros(vocab_size, dtype=bool)
        key_ids[keys] = True
        is_key = key_ids[rest]
        rest[is_key] = 1 + n_keys + rng.integers(n_values, size=int(is_key.sum()))  # a key occurs only in its pair and query
        ids[context:] = rest
    elif filler == "blank":
        ids[context:] = 0
    else:
        raise ValueError(f"MQAR filler {filler!r} is not one of 'blank', 'random'")
    slots = rng.choice((seq_len - context) // 2, size=num_queries, replace=False)
    asked = rng.choice(num_pairs, size=num_queries, replace=False)
    at = context + 2 * slots
    ids[at], ids[at + 1] = keys[asked], values[asked]
    labels[at + 1] = values[asked]
    return ids, labels


class MqarDataset(Dataset):
    """`size` MQAR examples of one stream, made when asked for: {"input_ids", "labels"} as the Trainer wants them."""

    def __init__(self, options, seq_len: int, size: int, stream: int = TRAIN):
        self.options, self.seq_len, self.size, self.stream = options, seq_len, size, stream

    def __len__(self) -> int:
        return self.size

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= index < self.size:
            raise IndexError(f"MQAR example {index} is outside 0..{self.size - 1}")
        o = self.options
        return mqar_example(o.vocab_size, o.num_pairs, o.num_queries, self.seq_len, o.seed, index, self.stream, o.filler)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.example(int(index))
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}

    def batch(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels) of examples start..stop-1, stacked: [rows, seq_len] each."""
        pairs = [self.example(i) for i in range(start, min(stop, self.size))]
        return torch.from_numpy(np.stack([p[0] for p in pairs])), torch.from_numpy(np.stack([p[1] for p in pairs]))


def build_mqar(data_section, rows: int):
    """The training data of a run on data.source=mqar: `rows` fresh examples (one per sequence the run trains on),
    no validation split (the mqar eval task measures accuracy on the evaluation stream)."""
    train = MqarDataset(data_section.mqar, data_section.seq_len, rows, TRAIN)
    stats = {"seq_len": data_section.seq_len, "train_documents": rows, "train_tokens": rows * data_section.seq_len, "train_bytes": 0,
             "train_blocks": rows, "val_documents": 0, "val_tokens": 0, "val_bytes": 0, "val_blocks": 0, "val_bytes_per_token": None,
             "synthetic": MQAR}
    return PackedData(train=train, val=None, stats=stats)


@torch.no_grad()
def mqar_accuracy(model, dataset: MqarDataset, batch_size: int = 32) -> dict[str, float | int]:
    """Exact per-query accuracy (argmax at each query key is its value), the loss on the values (nats), and counts."""
    device = next(model.parameters()).device
    correct = queries = 0
    nll = 0.0
    for start in range(0, len(dataset), batch_size):
        ids, labels = dataset.batch(start, start + batch_size)
        ids, labels = ids.to(device), labels.to(device)
        logits = model(input_ids=ids).logits.float()  # [rows, time, vocab]
        target = labels[:, 1:]
        mask = target != -100
        scores = logits[:, :-1][mask]  # [answers, vocab]
        answers = target[mask]
        correct += int((scores.argmax(-1) == answers).sum())
        nll += float(torch.nn.functional.cross_entropy(scores, answers, reduction="sum"))
        queries += int(mask.sum())
    return {"accuracy": correct / queries, "loss": nll / queries, "queries": queries, "examples": len(dataset)}
