"""Needle in a haystack: can a model find one sentence hidden at a given depth of a long context?

A haystack is a window of a corpus (the built-in plays, or any `data.source` text), cut to a requested
length in tokens of the model's own tokenizer. A needle sentence with a random key and value is put at
a requested depth of it, and a question at the end asks for the value; the model answers by greedy
decoding through attnlab's engine, in batches, and an answer is correct when the first number it holds
is the value, exactly.

    cases = make_cases(tokenizer, "shakespeare", lengths=[1024, 2048], depths=[0, 0.5, 1], samples=10, seed=0)
    result = run_niah(model, tokenizer, cases)
    result.metrics["accuracy"], result.metrics["cells"]   # one cell per (length, depth): proportion correct

Two needle forms: `magic` (RULER's and the 2Mamba paper's "The special magic number for KEY is: VALUE.",
a 7-digit value) and `passkey` (Landmark Attention's "The pass key is VALUE. Remember it.", 5 digits).

Every case is built from its own generator, seeded by (seed, length, depth, sample): adding a length or
a depth to a run leaves the other cells' cases as they were. A prompt is exactly the requested number of
tokens: the tokenizer's leading special tokens (if it adds any), a one-line instruction, the haystack
with the needle inside, and the question. The needle goes at the requested depth of the haystack, moved
to the nearest line end (else sentence end) within 5% of the haystack (64 tokens at most), so that it
starts a line or a sentence; the depth it landed at is recorded with every prediction.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from attnlab.config import load_config
from attnlab.data import read_documents
from attnlab.data.prepare import encoder
from attnlab.errors import ConfigError, DataError
from attnlab.outputs import write_bytes_atomic

from .metrics import clean_prediction
from .runner import EvalResult, write_outputs

DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SNAP_FRACTION, SNAP_MAX = 0.05, 64  # how far the needle may move to start a line or sentence
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_NUMBER = re.compile(r"\d+")
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


@dataclass(frozen=True)
class NeedleForm:
    name: str
    header: str     # the instruction before the haystack
    needle: str     # the sentence hidden in it: {key} and {value}
    question: str   # after the haystack; the model's continuation is the answer
    digits: int     # of the value
    keyed: bool     # whether the needle names a key


NEEDLES = {
    "magic": NeedleForm(
        "magic",
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n",
        "The special magic number for {key} is: {value}.",
        "\nWhat is the special magic number for {key} mentioned in the provided text? "
        "The special magic number for {key} mentioned in the provided text is",
        7, True),
    "passkey": NeedleForm(
        "passkey",
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n",
        "The pass key is {value}. Remember it. {value} is the pass key.",
        "\nWhat is the pass key? The pass key is",
        5, False),
}


def parse_lengths(text: str) -> list[int]:
    """'1k,2k,4k' -> [1024, 2048, 4096] (k = 1024, m = 1024**2; plain numbers are tokens)."""
    out = []
    for part in [p for p in text.replace(" ", ",").split(",") if p]:
        match = _SIZE.match(part)
        if not match:
            raise ConfigError(f"--lengths takes token counts separated by commas, e.g. 1k,2k,4k or 500,1000; got {part!r}")
        scale = {"": 1, "k": 1024, "m": 1024 ** 2}[match.group(2).lower()]
        value = float(match.group(1)) * scale
        if value != int(value) or value < 1:
            raise ConfigError(f"--lengths: {part!r} is not a whole number of tokens")
        out.append(int(value))
    if not out:
        raise ConfigError("--lengths needs at least one length, e.g. --lengths 1k,2k,4k")
    return sorted(set(out))


def parse_depths(text: str) -> list[float]:
    """'0,0.25,0.5' -> [0.0, 0.25, 0.5]: fractions of the haystack (0 = its start, 1 = its end)."""
    out = []
    for part in [p for p in text.replace(" ", ",").split(",") if p]:
        try:
            value = float(part.rstrip("%")) / (100 if part.endswith("%") else 1)
        except ValueError:
            raise ConfigError(f"--depths takes fractions separated by commas, e.g. 0,0.25,0.5,0.75,1; got {part!r}") from None
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"--depths: {part!r} is outside 0..1 (0 = the haystack's start, 1 = its end)")
        out.append(value)
    if not out:
        raise ConfigError("--depths needs at least one depth, e.g. --depths 0,0.5,1")
    return sorted(set(out))


def needle_form(name: str) -> NeedleForm:
    if name not in NEEDLES:
        raise ConfigError(f"unknown needle {name!r}; choose one of {', '.join(NEEDLES)}")
    return NEEDLES[name]


# --- the haystack -------------------------------------------------------------------------------


def _lead_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text by default (a BOS), as a prompt would start."""
    try:
        full = list(tokenizer("a")["input_ids"])
        plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    except Exception:  # noqa: BLE001  (a tokenizer without the keyword: no lead)
        return []
    if plain and full[len(full) - len(plain):] == plain:
        return full[: len(full) - len(plain)]
    return []


class Haystack:
    """The token ids of a corpus, its documents joined by a blank line, read as a ring: the text of every haystack."""

    def __init__(self, tokenizer, documents: Sequence[str], min_tokens: int):
        self.tokenizer = tokenizer
        self.encode = encoder(tokenizer)
        gap = self.ids_of("\n\n")
        pieces, total = [], 0
        for start in range(0, len(documents), 64):  # tokenize only as much of a large corpus as is needed
            for ids in self.encode(list(documents[start:start + 64])):
                pieces += [np.asarray(ids, dtype=np.int64), gap]
                total += len(ids) + len(gap)
            if total >= min_tokens:
                break
        self.ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        if len(self.ids) < 64:
            raise DataError(f"the haystack corpus holds only {len(self.ids)} tokens; give a text source with more")

    def ids_of(self, text: str) -> np.ndarray:
        return np.asarray(self.encode([text])[0], dtype=np.int64)

    def window(self, start: int, n: int) -> np.ndarray:
        """`n` tokens from `start`, wrapping round to the corpus's start."""
        idx = (start + np.arange(n)) % len(self.ids)
        return self.ids[idx]

    def ends_sentence(self, token_id: int) -> bool:
        piece = self.tokenizer.decode([int(token_id)])
        return "\n" in piece or piece.rstrip().endswith((".", "!", "?"))

    def line_start(self, start: int, reach: int = 256) -> int:
        """The first position at or after `start` (within `reach`) that follows a line or sentence end."""
        for k in range(reach):
            if self.ends_sentence(self.ids[(start + k - 1) % len(self.ids)]):
                return (start + k) % len(self.ids)
        return start


@dataclass
class NeedleCase:
    """One prompt: a haystack of `length` tokens (in all) with the needle at `depth`."""

    id: str
    length: int            # requested prompt length in tokens
    depth: float           # requested depth, 0..1 of the haystack
    sample: int
    key: str
    value: str
    prompt_ids: list[int]
    needle_start: int      # index in prompt_ids of the needle's first token
    needle_tokens: int
    haystack_start: int    # index in prompt_ids of the haystack's first token
    haystack_tokens: int
    haystack_offset: int   # where in the corpus the haystack was taken from
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def needle_depth(self) -> float:
        """The depth the needle landed at: tokens of haystack before it / haystack tokens."""
        before = self.needle_start - self.haystack_start
        return before / self.haystack_tokens if self.haystack_tokens else 0.0


def _key(rng: np.random.Generator) -> str:
    return "".join(_SYLLABLES[i] for i in rng.integers(len(_SYLLABLES), size=4))


def _value(rng: np.random.Generator, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def build_case(haystack: Haystack, form: NeedleForm, length: int, depth: float, sample: int, seed: int) -> NeedleCase:
    """The prompt of one (length, depth, sample), from its own seeded generator (see the module docstring)."""
    rng = np.random.default_rng([seed, length, int(round(depth * 1_000_000)), sample])
    lead = _lead_ids(haystack.tokenizer)
    header = haystack.ids_of(form.header)
    offset = haystack.line_start(int(rng.integers(len(haystack.ids))))
    for _ in range(100):
        key, value = _key(rng), _value(rng, form.digits)
        sentence = form.needle.format(key=key, value=value)
        question = haystack.ids_of(form.question.format(key=key))
        # the needle starts a line where a line ends near the depth asked for, else it follows a sentence end (or, in
        # text with neither nearby, any token) after a space
        for needle, ends in ((haystack.ids_of(sentence + "\n"), ("\n",)), (haystack.ids_of(" " + sentence + "\n"), None)):
            n_hay = length - len(lead) - len(header) - len(needle) - len(question)
            if n_hay < 1:
                need = length - n_hay + 1
                raise ConfigError(f"a {form.name} prompt of {length} tokens has no room for a haystack: the instruction, needle and "
                                  f"question alone take {need - 1} tokens of this tokenizer. Ask for lengths of at least {need}.")
            hay = haystack.window(offset, n_hay)
            at = _needle_position(haystack, hay, depth, ends)
            if at is not None:
                break
        text = haystack.tokenizer.decode(hay.tolist()).lower()
        if value not in text and (not form.keyed or key not in text):
            break
    else:
        raise DataError("the haystack text holds every random needle value tried (100 of them); use another text source")
    hay_start = len(lead) + len(header)
    prompt = np.concatenate([np.asarray(lead, dtype=np.int64), header, hay[:at], needle, hay[at:], question])
    return NeedleCase(
        id=f"L{length}-d{depth:g}-s{sample}", length=length, depth=depth, sample=sample, key=key, value=value,
        prompt_ids=prompt.tolist(), needle_start=hay_start + at, needle_tokens=len(needle), haystack_start=hay_start,
        haystack_tokens=n_hay, haystack_offset=offset, meta={"needle": form.name})


def _needle_position(haystack: Haystack, hay: np.ndarray, depth: float, ends: tuple[str, ...] | None) -> int | None:
    """Where the needle goes: at `depth` of `hay`, moved (5% of it, 64 tokens at most, either way) to the nearest
    position after a token ending with one of `ends` (None: a line or sentence end, else `depth` itself); None when
    `ends` has none in reach."""
    n_hay = len(hay)
    at = int(round(depth * n_hay))
    reach = min(SNAP_MAX, int(SNAP_FRACTION * n_hay))
    for q in sorted(range(max(0, at - reach), min(n_hay, at + reach) + 1), key=lambda q: (abs(q - at), q)):
        if q == 0:
            return 0
        piece = haystack.tokenizer.decode([int(hay[q - 1])])
        if (ends is not None and piece.endswith(ends)) or (ends is None and haystack.ends_sentence(hay[q - 1])):
            return q
    return None if ends is not None else at


def haystack_documents(source: str, text_field: str = "text") -> tuple[list[str], str]:
    """(documents, description) of a haystack source: any `data.source`, or a training config's data.source."""
    if str(source).endswith((".yaml", ".yml")) and Path(source).is_file():
        cfg = load_config(source)
        if cfg.data.source == "mqar":
            raise ConfigError(f"{source} trains on data.source=mqar, which has no text to build haystacks from; pass a text source")
        return read_documents(cfg.data.source, cfg.data.text_field), f"{cfg.data.source} (data.source of {source})"
    return read_documents(str(source), text_field), str(source)


def make_cases(tokenizer, source: str | Sequence[str] = "shakespeare", lengths: Sequence[int] = DEFAULT_LENGTHS,
               depths: Sequence[float] = DEFAULT_DEPTHS, samples: int = 10, seed: int = 0, needle: str = "magic",
               text_field: str = "text") -> list[NeedleCase]:
    """Every (length, depth, sample) case, lengths slowest. `source`: a data.source (or config .yaml), or documents."""
    form = needle_form(needle)
    if samples < 1:
        raise ConfigError(f"--samples must be at least 1, got {samples}")
    documents = haystack_documents(source, text_field)[0] if isinstance(source, str) else list(source)
    haystack = Haystack(tokenizer, documents, min_tokens=max(256 * 1024, 16 * max(lengths)))
    return [build_case(haystack, form, length, float(depth), sample, seed)
            for length in lengths for depth in depths for sample in range(samples)]


# --- scoring ----------------------------------------------------------------------------------


def is_correct(prediction: str, value: str) -> bool:
    """Exact: the first number in the prediction is the value (a longer or shorter number is wrong)."""
    match = _NUMBER.search(prediction)
    return match is not None and match.group() == value


def cell_metrics(cases: Sequence[NeedleCase], correct: Sequence[bool]) -> dict[str, Any]:
    """accuracy (all cases), examples, and one cell per (length, depth): samples, correct, accuracy."""
    cells: dict[tuple[int, float], list[bool]] = {}
    for case, ok in zip(cases, correct):
        cells.setdefault((case.length, case.depth), []).append(bool(ok))
    return {
        "accuracy": sum(map(bool, correct)) / len(correct) if correct else None,
        "examples": len(correct),
        "cells": [{"length": length, "depth": depth, "samples": len(v), "correct": sum(v), "accuracy": sum(v) / len(v)}
                  for (length, depth), v in sorted(cells.items())],
    }


def answer_tokens(tokenizer, cases: Sequence[NeedleCase]) -> int:
    """Tokens to generate: enough for the longest value after a space, and two more."""
    encode = encoder(tokenizer)
    return max(len(ids) for ids in encode([" " + c.value for c in cases])) + 2


def run_niah(model, tokenizer, cases: Sequence[NeedleCase], batch_size: int = 8, max_new_tokens: int | None = None,
             progress: Callable[[int], None] | None = None):
    """Greedy answers for every case through the engine, scored; an `EvalResult` of task 'niah'."""
    from attnlab.generation import generate

    if not cases:
        raise ConfigError("no needle-in-a-haystack cases to evaluate")
    cfg = {"max_new_tokens": max_new_tokens or answer_tokens(tokenizer, cases), "batch_size": batch_size}
    t0 = time.perf_counter()
    results = generate(model, tokenizer, [c.prompt_ids for c in cases], cfg, progress=progress)
    wall_s = time.perf_counter() - t0
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    predictions = [clean_prediction(r.text, None, specials) for r in results]
    correct = [is_correct(p, c.value) for p, c in zip(predictions, cases)]
    metrics = cell_metrics(cases, correct)
    metrics["generation_s"] = round(wall_s, 2)
    records = [{"id": c.id, "length": c.length, "depth": c.depth, "sample": c.sample, "prompt_tokens": len(c.prompt_ids),
                "needle_depth": round(c.needle_depth, 4), "needle_start": c.needle_start, "haystack_offset": c.haystack_offset,
                "key": c.key, "value": c.value, "prediction": p, "correct": ok, "finish_reason": r.finish_reason}
               for c, p, ok, r in zip(cases, predictions, correct, results)]
    return EvalResult("niah", metrics, records)


# --- the heatmap --------------------------------------------------------------------------------


def grid(cells: Sequence[dict]) -> tuple[list[int], list[float], np.ndarray]:
    """(lengths, depths, accuracy[depth, length]) of metrics cells; NaN where a cell is missing."""
    lengths = sorted({int(c["length"]) for c in cells})
    depths = sorted({float(c["depth"]) for c in cells})
    acc = np.full((len(depths), len(lengths)), np.nan)
    for c in cells:
        acc[depths.index(float(c["depth"])), lengths.index(int(c["length"]))] = c["accuracy"]
    return lengths, depths, acc


def length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else (f"{n / 1024:.1f}k" if n >= 1024 else str(n))


def draw_heatmap(ax, cells: Sequence[dict], title: str = "", colorbar: bool = False):
    """Proportion correct per (depth, length) on `ax`: depth down the side (0 at the top), length along the bottom."""
    lengths, depths, acc = grid(cells)
    image = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not math.isnan(acc[i, j]):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="black" if 0.25 < acc[i, j] < 0.85 else "white")
    if title:
        ax.set_title(title, fontsize=10)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, label="proportion correct")
    return image


def short_name(model: str) -> str:
    """A model's name for a plot title: its directory, with the run's name for a run's final model or checkpoint."""
    path = Path(str(model).rstrip("/"))
    if path.name == "final" or path.name.startswith("step-"):
        parent = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return f"{parent.name}/{path.name}"
    return path.name or str(model)


def heatmap_png(cells: Sequence[dict], title: str) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths, _ = grid(cells)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 + 0.8 * len(lengths)), 1.4 + 0.45 * len(depths)), layout="constrained")
    draw_heatmap(ax, cells, title, colorbar=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_niah_outputs(result, out_dir: Path, extra: dict[str, Any], title: str) -> dict[str, Path]:
    """metrics.json, predictions.jsonl and heatmap.png in `out_dir`, each written whole or not at all."""
    metrics_path, predictions_path = write_outputs(result, out_dir, extra)
    heatmap = write_bytes_atomic(Path(out_dir) / "heatmap.png", heatmap_png(result.metrics["cells"], title), what="the eval output")
    return {"metrics": metrics_path, "predictions": predictions_path, "heatmap": heatmap}


def read_niah(directory: Path) -> dict[str, Any] | None:
    """The metrics.json of a needle-in-a-haystack eval directory, or None if `directory` holds none."""
    import json

    path = Path(directory) / "metrics.json"
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(payload, dict) or payload.get("task") != "niah":
        return None
    cells = (payload.get("metrics") or {}).get("cells")
    if not isinstance(cells, list) or not all(isinstance(c, dict) and {"length", "depth", "accuracy"} <= set(c) for c in cells):
        return None
    return payload
