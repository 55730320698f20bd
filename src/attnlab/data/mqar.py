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
in any order, and the evaluation stream never repeats the training stream's generators. `mqar_batch` makes many
examples at once: each generator draws, example by example, the keys, the values, the filler, the keys found in the
filler, the query slots and the keys asked, in that order; the placing is done once for all rows (a training step
of a small model must not wait milliseconds for its data). `mqar_example` is one row of it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .packing import PackedData

TRAIN, EVAL = 0, 1
MQAR = "mqar"
KEEP_TOKENS = 1 << 24  # the most tokens a kept stream holds (ids and labels: 256 MiB); a larger one is made when read


def mqar_example(vocab_size: int, num_pairs: int, num_queries: int, seq_len: int, seed: int, index: int,
                 stream: int = TRAIN, filler: str = "blank") -> tuple[np.ndarray, np.ndarray]:
    """(input ids [seq_len], labels [seq_len]) of example `index` of `stream`; filler 'blank' (token 0) or 'random'."""
    ids, labels = mqar_batch(vocab_size, num_pairs, num_queries, seq_len, seed, [index], stream, filler)
    return ids[0], labels[0]


def mqar_batch(vocab_size: int, num_pairs: int, num_queries: int, seq_len: int, seed: int, indices,
               stream: int = TRAIN, filler: str = "blank") -> tuple[np.ndarray, np.ndarray]:
    """(input ids [rows, seq_len], labels [rows, seq_len]) of examples `indices` of `stream`: row r is exactly
    `mqar_example(..., indices[r], stream, filler)`. Each example's generator makes the same draws in the same order as
    there; placing the pairs, the filler and the queries is done once for all rows."""
    if filler not in ("blank", "random"):
        raise ValueError(f"MQAR filler {filler!r} is not one of 'blank', 'random'")
    rows = len(indices)
    if rows == 0:
        return np.empty((0, seq_len), dtype=np.int64), np.empty((0, seq_len), dtype=np.int64)
    n_keys = (vocab_size - 1) // 2
    n_values = vocab_size - 1 - n_keys
    context = 2 * num_pairs
    n_slots = (seq_len - context) // 2
    keys = np.empty((rows, num_pairs), dtype=np.int64)
    values = np.empty((rows, num_pairs), dtype=np.int64)
    ids = np.zeros((rows, seq_len), dtype=np.int64)  # the blank filler, where nothing else is written
    rest = ids[:, context:]  # the filler, a view
    rngs = []
    for r, index in enumerate(indices):  # draws up to the filler, example by example
        rng = np.random.default_rng([seed, stream, int(index)])
        keys[r] = rng.choice(n_keys, size=num_pairs, replace=False)
        values[r] = rng.choice(n_values, size=num_pairs, replace=False)
        if filler == "random":
            rest[r] = rng.integers(1, vocab_size, size=seq_len - context)
        rngs.append(rng)
    keys += 1
    values += 1 + n_keys
    ids[:, 0:context:2], ids[:, 1:context:2] = keys, values
    is_key = None
    if filler == "random":
        key_ids = np.zeros((rows, vocab_size), dtype=bool)
        key_ids[np.arange(rows)[:, None], keys] = True
        is_key = np.take_along_axis(key_ids, rest, axis=1)
        counts = is_key.sum(axis=1).tolist()
    slots = np.empty((rows, num_queries), dtype=np.int64)
    asked = np.empty((rows, num_queries), dtype=np.int64)
    replaced = []
    for r, rng in enumerate(rngs):  # the draws after the filler, example by example
        if is_key is not None:
            replaced.append(rng.integers(n_values, size=counts[r]))
        slots[r] = rng.choice(n_slots, size=num_queries, replace=False)
        asked[r] = rng.choice(num_pairs, size=num_queries, replace=False)
    if is_key is not None:
        rest[is_key] = 1 + n_keys + np.concatenate(replaced)  # row by row, in the order each row's mask lists them
    rows_at = np.arange(rows)[:, None]
    at = context + 2 * slots
    asked_values = np.take_along_axis(values, asked, axis=1)
    ids[rows_at, at], ids[rows_at, at + 1] = np.take_along_axis(keys, asked, axis=1), asked_values
    labels = np.full((rows, seq_len), -100, dtype=np.int64)
    labels[rows_at, at + 1] = asked_values
    return ids, labels


class MqarDataset(Dataset):
    """`size` MQAR examples of one stream, made when asked for: {"input_ids", "labels"} as the Trainer wants them.

    A DataLoader asks for a whole batch at once (`__getitems__`), which `mqar_batch` makes. `keep`: hold the examples
    once made (up to KEEP_TOKENS), for a stream read again and again (the evaluation stream, at every evaluation of a run)."""

    def __init__(self, options, seq_len: int, size: int, stream: int = TRAIN, keep: bool = False):
        self.options, self.seq_len, self.size, self.stream = options, seq_len, size, stream
        self.keep = keep
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None  # every example, [size, seq_len] each, once made

    def __len__(self) -> int:
        return self.size

    def _check(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(f"MQAR example {index} is outside 0..{self.size - 1}")
        return index

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        o = self.options
        return mqar_example(o.vocab_size, o.num_pairs, o.num_queries, self.seq_len, o.seed, self._check(index), self.stream, o.filler)

    def rows(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels) of the examples `indices`, in that order: [rows, seq_len] each."""
        indices = [self._check(int(i)) for i in indices]
        if self.keep and self.kept is None and self.size * self.seq_len <= KEEP_TOKENS:
            self.kept = self._make(range(self.size))
        if self.kept is not None:
            at = torch.tensor(indices, dtype=torch.long)
            return self.kept[0][at], self.kept[1][at]
        return self._make(indices)

    def _make(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.options
        ids, labels = mqar_batch(o.vocab_size, o.num_pairs, o.num_queries, self.seq_len, o.seed, indices, self.stream, o.filler)
        return torch.from_numpy(ids), torch.from_numpy(labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.rows([index])
        return {"input_ids": ids[0], "labels": labels[0]}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The examples of one batch, made together; the collator stacks them again."""
        ids, labels = self.rows(indices)
        return [{"input_ids": i, "labels": l} for i, l in zip(ids.unbind(), labels.unbind())]

    def batch(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels) of examples start..stop-1, stacked: [rows, seq_len] each."""
        return self.rows(range(start, min(stop, self.size)))


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
    # summed on the device and read once at the end: the host does not wait for the device batch by batch
    correct = torch.zeros((), dtype=torch.int64, device=device)
    queries = torch.zeros((), dtype=torch.int64, device=device)
    nll = torch.zeros((), dtype=torch.float64, device=device)  # each batch's float32 sum, added in double precision
    for start in range(0, len(dataset), batch_size):
        ids, labels = dataset.batch(start, start + batch_size)
        ids, labels = ids.to(device), labels.to(device)
        logits = model(input_ids=ids).logits.float()  # [rows, time, vocab]
        target = labels[:, 1:]
        mask = target != -100
        scores = logits[:, :-1][mask]  # [answers, vocab]
        answers = target[mask]
        correct += (scores.argmax(-1) == answers).sum()
        nll += torch.nn.functional.cross_entropy(scores, answers, reduction="sum").double()
        queries += mask.sum()
    correct, queries, nll = int(correct), int(queries), float(nll)
    return {"accuracy": correct / queries, "loss": nll / queries, "queries": queries, "examples": len(dataset)}
