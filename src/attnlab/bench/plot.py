"""PNG plots of `attnlab bench` results, written next to the JSON (`--out X.json` -> `X.png`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from attnlab.bench.scale import parse_key  # noqa: E402
from attnlab.outputs import writing  # noqa: E402


def save_figure(fig, path: Path) -> Path:
    """`fig` as a PNG at `path`, written whole under a fresh temporary name and renamed into place (never
    through a link planted at `path`)."""
    with writing(path) as f:
        fig.savefig(f, format="png", dpi=110)
    return path


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
    save_figure(fig, path)
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
    save_figure(fig, path)
    plt.close(fig)
    return path


def _grouped(ax, section: dict, field: str, title: str, unit: str, log: bool = False, legend: str = "B x T") -> None:
    """One group of bars per name (peers' names in grey), one bar per shape (NAME@SHAPE keys; `legend`
    titles the shapes); a row without the value is marked at the foot of its bar: OOM, or n/a for any
    other error."""
    names = list(dict.fromkeys(key.rsplit("@", 1)[0] for key in section))
    shapes = list(dict.fromkeys(key.rsplit("@", 1)[1] for key in section))
    width = 0.8 / len(shapes)
    colors = plt.get_cmap("tab10").colors
    for s, shape in enumerate(shapes):
        label = shape  # in the legend once per shape
        for n, name in enumerate(names):
            row = section.get(f"{name}@{shape}")
            if row is None:
                continue
            x = n - 0.4 + width * (s + 0.5)
            value = row.get(field)
            if value is None:
                mark = "OOM" if row.get("error") == "out of memory" else "n/a"
                ax.annotate(mark, (x, 0.01), xycoords=("data", "axes fraction"), ha="center", va="bottom", rotation=90, fontsize=7,
                            color="#c44e52", fontweight="bold")
                continue
            ax.bar(x, value, width, color=colors[s % len(colors)], label=label)
            label = None
            text = f"{value:,.0f}" if value >= 100 else (f"{value:.1f}" if value >= 10 else f"{value:.2f}")
            ax.annotate(text, (x, value), ha="center", va="bottom", rotation=90, fontsize=6)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(names) - 0.4)
    for tick in ax.get_xticklabels():
        if not tick.get_text().startswith("attnlab-"):
            tick.set_color("#777777")
    if log:
        ax.set_yscale("log")
    else:
        ax.yaxis.set_major_formatter(lambda value, _: f"{value:,.0f}")
    ax.margins(y=0.25)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.grid(axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[1]:
        ax.legend(title=legend, fontsize=7, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_zoo(result: dict, path: Path) -> Path:
    """`attnlab bench zoo`: training tokens/s and peak memory per model, forward+backward time per op
    (log scale), each grouped by shape."""
    train, ops = result.get("train", {}), result.get("ops", {})
    panels = []
    if train:
        panels.append((train, "tokens_per_s", "training tokens/s (higher is better)", "tokens/s", False))
        if any(row.get("peak_reserved_gib") is not None for row in train.values()):
            panels.append((train, "peak_reserved_gib", "peak memory reserved (lower is better)", "GiB", False))
    if ops:
        panels.append((ops, "fwd_bwd_ms", "token mixing alone, forward + backward (lower is better)", "ms", True))
    bars = max((len(section) for section, *_ in panels), default=0)
    fig, axes = plt.subplots(max(1, len(panels)), 1, figsize=(min(40, max(9, 0.3 * bars)), 4 * max(1, len(panels))), squeeze=False)
    for ax, (section, field, title, unit, log) in zip(axes[:, 0], panels):
        _grouped(ax, section, field, title, unit, log)
    fig.suptitle(f"attnlab bench zoo on {result['env'].get('gpu') or 'cpu'}", fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot_scale(result: dict, path: Path) -> Path:
    """`attnlab bench scale`: per model and variant (strategy, checkpointing, eager), one bar per GPU count:
    efficiency against one GPU, tokens/s of all GPUs together, and peak memory when measured. A one-GPU run
    stands in every strategy's group (one process has no strategy)."""
    runs = result.get("runs", {})
    keys = [(parse_key(key), row) for key, row in runs.items()]
    models = list(dict.fromkeys(v.model for v, _ in keys))
    strategies = list(dict.fromkeys(v.strategy for v, _ in keys if v.gpus > 1)) or list(dict.fromkeys(v.strategy for v, _ in keys))
    bars = []  # (group order, group name, GPU count, row): a model's groups together, each group's GPU counts in order
    for v, row in keys:
        for strategy in strategies if v.gpus == 1 else [v.strategy]:
            variant = ":".join([strategy] + (["ckpt"] if v.ckpt else []) + (["eager"] if v.eager else []))
            order = (models.index(v.model), strategies.index(strategy) if strategy in strategies else len(strategies), v.ckpt, v.eager)
            bars.append((order, f"{v.model}:{variant}", v.gpus, row))
    section = {f"{group}@{gpus} GPU{'s' if gpus > 1 else ''}": row for _, group, gpus, row in sorted(bars, key=lambda b: (b[0], b[2]))}
    panels = [("efficiency", "efficiency: per-GPU tokens/s over one GPU's, captured, no checkpointing (higher is better)", "x one GPU", ".2f"),
              ("tokens_per_s", "training tokens/s, all GPUs together (higher is better)", "tokens/s", ",.0f")]
    if any(row.get("peak_allocated_gib") is not None for row in runs.values()):
        panels.append(("peak_allocated_gib", "peak memory allocated per GPU (lower is better)", "GiB", ".0f"))
    groups = len({key.rsplit("@", 1)[0] for key in section})
    fig, axes = plt.subplots(len(panels), 1, figsize=(min(40, max(9, 1.1 * groups)), 4 * len(panels)), squeeze=False)
    for ax, (field, title, unit, tick) in zip(axes[:, 0], panels):
        if section:
            _grouped(ax, section, field, title, unit, legend="GPUs")
        ax.yaxis.set_major_formatter(lambda value, _, tick=tick: f"{value:{tick}}")
        if field == "efficiency":
            ax.axhline(1.0, color="#555555", linewidth=0.8, linestyle="--")
    settings = result.get("settings", {})
    where = ", ".join(dict.fromkeys(result["env"].get("gpus") or [])) or "CPU processes"
    fig.suptitle(f"attnlab bench scale: {settings.get('batch_per_gpu')} x {settings.get('seq_len')} tokens per GPU, on {where}", fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
