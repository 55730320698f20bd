"""PNG plots of `attnlab bench` results, written next to the JSON (`--out X.json` -> `X.png`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _bars(ax, labels: list[str], values: list[float | None], title: str, unit: str) -> None:
    heights = [v or 0.0 for v in values]
    bars = ax.bar(range(len(labels)), heights, color=["#4c72b0" if "attnlab" in lab else "#999999" for lab in labels])
    for bar, value in zip(bars, values):
        text = "n/a" if value is None else (f"{value:,.0f}" if value >= 100 else f"{value:.1f}")
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.grid(axis="y", alpha=0.3)


def plot_train(rows: list[dict], path: Path, device: str) -> Path:
    """Tokens/s and peak memory per model and shape, side by side."""
    labels = [f"{r['model']}\n{r['batch']}x{r['seq_len']}" for r in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) * 2), 4))
    _bars(speed, labels, [r.get("tok_per_s") for r in rows], "training tokens/s (higher is better)", "tokens/s")
    _bars(memory, labels, [r.get("reserved_gib", r.get("peak_gib")) for r in rows], "peak memory reserved (lower is better)", "GiB")
    fig.suptitle(f"attnlab bench train on {device}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_decode(rows: list[dict], path: Path, device: str) -> Path:
    """New tokens/s of the attnlab engine (and of HF generate when compared), per batch size."""
    labels, values = [], []
    for r in rows:
        labels.append(f"attnlab\nB={r['batch']}")
        values.append(r.get("attnlab_new_tok_per_s"))
        if r.get("hf_generate_new_tok_per_s") is not None:
            labels.append(f"HF generate\nB={r['batch']}")
            values.append(r["hf_generate_new_tok_per_s"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
    first = rows[0]
    _bars(ax, labels, values, f"new tokens/s, prompt {first['prompt_len']}, {first['new_tokens']} new (higher is better)", "new tokens/s")
    ax.set_yscale("log")
    fig.suptitle(f"attnlab bench decode on {device}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
