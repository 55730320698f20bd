"""Recall in a report: needle-in-a-haystack heatmaps side by side, and MQAR accuracy against sequence length per mixer.

Needle-in-a-haystack results are the directories `attnlab eval MODEL --task niah` writes (metrics.json with
task "niah"), passed to `attnlab report` themselves, inside a directory passed to it, or inside a run
directory (`RUN/niah*/` or `RUN/eval/niah*/`). MQAR points are the runs trained on `data.source: mqar`:
their sequence length (data.seq_len) and the newest `mqar/accuracy` their evaluation recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab.eval.niah import draw_heatmap

from .load import RunRecord, _section, niah_dirs_in, read_niah
from .style import run_styles


@dataclass
class NiahRecord:
    name: str
    path: Path
    payload: dict[str, Any]

    @property
    def cells(self) -> list[dict]:
        return self.payload["metrics"]["cells"]

    @property
    def accuracy(self) -> float | None:
        return self.payload["metrics"].get("accuracy")


def find_niah(paths: list[Path]) -> list[NiahRecord]:
    dirs: list[Path] = []
    for p in paths:
        for d in niah_dirs_in(Path(p)):
            if d not in dirs:
                dirs.append(d)
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):  # niah/ in several runs: name them by their run
        names = [f"{d.parent.parent.name}/{d.name}" if d.parent.name == "eval" else f"{d.parent.name}/{d.name}" for d in dirs]
    return [NiahRecord(n, d, read_niah(d)) for n, d in zip(names, dirs)]


def niah_figure(records: list[NiahRecord]):
    """One heatmap per eval, side by side (four to a row), one colour scale."""
    import matplotlib.pyplot as plt

    cols = min(4, len(records))
    rows = math.ceil(len(records) / cols)
    n_depths = max(len({c["depth"] for c in r.cells}) for r in records)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1.0, (1.4 + 0.42 * n_depths) * rows), squeeze=False,
                             layout="constrained")
    image = None
    for ax, rec in zip(axes.flat, records):
        needle, model = rec.payload.get("needle", ""), rec.payload.get("model_name")
        title = rec.name + (f": {model}" if isinstance(model, str) and model != rec.name else "") + (f" ({needle})" if needle else "")
        image = draw_heatmap(ax, rec.cells, title)
    for ax in list(axes.flat)[len(records):]:
        ax.axis("off")
    for ax in axes[:, 1:].flat:  # depth labels once per row
        ax.set_ylabel("")
    fig.colorbar(image, ax=axes, label="proportion correct", shrink=0.9)
    return fig


def niah_rows(records: list[NiahRecord]) -> tuple[list[str], list[list[str]]]:
    """Accuracy per eval and length (all depths together), and overall."""
    lengths = sorted({int(c["length"]) for r in records for c in r.cells})
    header = ["eval", "needle", "samples", *(f"{n} tokens" for n in lengths), "all"]
    rows = []
    for r in records:
        by_length = {}
        for n in lengths:
            cells = [c for c in r.cells if int(c["length"]) == n]
            correct = sum(c.get("correct", c["accuracy"] * c.get("samples", 1)) for c in cells)
            total = sum(c.get("samples", 1) for c in cells)
            by_length[n] = f"{correct / total:.2f}" if total else ""
        acc = r.accuracy
        rows.append([r.name, str(r.payload.get("needle", "")), str(r.payload.get("samples", "")),
                     *(by_length[n] for n in lengths), f"{acc:.3f}" if isinstance(acc, (int, float)) else ""])
    return header, rows


# --- MQAR -----------------------------------------------------------------------------------------


def mqar_runs(runs: list[RunRecord]) -> list[RunRecord]:
    return [r for r in runs if r.error is None and _section(r.config, "data").get("source") == "mqar"]


def mqar_accuracy(run: RunRecord) -> float | None:
    value = run.eval_metrics.get("mqar/accuracy")
    return float(value) if isinstance(value, (int, float)) else None


def _label(run: RunRecord, widths: set) -> str:
    hidden = _section(run.config, "model").get("hidden_size")
    return f"{run.mixer} (d={hidden})" if len(widths) > 1 else run.mixer


def mqar_series(runs: list[RunRecord]) -> dict[str, list[tuple[int, float]]]:
    """Mixer (and width, where widths differ) -> [(sequence length, accuracy)], lengths ascending. Runs of the same
    mixer, width and length that differ otherwise (the learning rates a suite tries) count by their best accuracy,
    as Zoology reports MQAR."""
    runs = mqar_runs(runs)
    widths = {_section(r.config, "model").get("hidden_size") for r in runs}
    best: dict[str, dict[int, float]] = {}
    for r in runs:
        acc, seq_len = mqar_accuracy(r), _section(r.config, "data").get("seq_len")
        if acc is not None and isinstance(seq_len, int):
            by_length = best.setdefault(_label(r, widths), {})
            by_length[seq_len] = max(acc, by_length.get(seq_len, acc))
    return {k: sorted(v.items()) for k, v in best.items()}


def mqar_learning_rates(runs: list[RunRecord]) -> list[float]:
    """The learning rates the MQAR runs trained with, ascending."""
    return sorted({lr for r in mqar_runs(runs) if isinstance(lr := _section(r.config, "train").get("lr"), (int, float))})


def mqar_figure(series: dict[str, list[tuple[int, float]]]):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2), layout="constrained")
    for (label, points), style in zip(sorted(series.items()), run_styles(len(series))):
        ax.plot(*zip(*points), **style, markersize=5, label=label)
    lengths = sorted({n for pts in series.values() for n, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("MQAR accuracy (per query)")
    ax.set_title("multi-query associative recall")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def mqar_rows(series: dict[str, list[tuple[int, float]]]) -> tuple[list[str], list[list[str]]]:
    lengths = sorted({n for pts in series.values() for n, _ in pts})
    header = ["mixer", *(str(n) for n in lengths)]
    rows = []
    for label, points in sorted(series.items()):
        acc = dict(points)
        rows.append([label, *(f"{acc[n]:.3f}" if n in acc else "" for n in lengths)])
    return header, rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
