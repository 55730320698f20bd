"""Plots (matplotlib), a self-contained HTML page (images embedded as base64 PNG, no scripts,
no network), the PNG of the main loss plot and a Markdown table."""

from __future__ import annotations

import base64
import html
import io
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter, MaxNLocator  # noqa: E402

from attnlab.outputs import prepare_output_file, write_bytes_atomic, write_text_atomic  # noqa: E402

from . import recall  # noqa: E402
from .load import RunRecord, config_differences  # noqa: E402
from .style import run_colors, run_styles  # noqa: E402


def _fig_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _spaced_ticks(ax, engineering: bool = False) -> None:
    """At most four x ticks from 0 (steps, tokens, seconds and rates are never negative), large numbers
    as 2k / 1.5M: tick labels never run into each other, nor into the next panel's."""
    ax.xaxis.set_major_locator(MaxNLocator(nbins=4, min_n_ticks=2))
    if engineering:
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_xlim(left=0)


def _legend(fig, ax, n: int) -> None:
    """Inside the plot for a few runs; beside it, in columns, for many (it would hide the curves). None for a plot
    with nothing drawn (runs without a validation split, such as MQAR's, have no bits per byte)."""
    if not ax.get_legend_handles_labels()[0]:
        return
    if n <= 6:
        ax.legend(fontsize=8, loc="upper right")
    else:
        fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside right upper", ncols=1 + n // 25)


def loss_figure(runs: list[RunRecord]):
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    for run, style in zip(runs, run_styles(len(runs))):
        if run.train:
            ax.plot([r["step"] for r in run.train], [r["loss"] for r in run.train], color=style["color"],
                    linestyle=style["linestyle"], alpha=0.55, linewidth=1.2, zorder=1)
        if run.val:
            ax.plot([r["step"] for r in run.val], [r["val_loss"] for r in run.val], **style, markersize=4,
                    markerfacecolor="none", linewidth=1.8, label=run.name, zorder=2)
        elif run.train:
            ax.plot([], [], color=style["color"], linestyle=style["linestyle"], label=f"{run.name} (train only)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("validation loss (markers) and training loss (thin line)")
    ax.grid(alpha=0.3)
    _spaced_ticks(ax, engineering=True)
    _legend(fig, ax, len(runs))
    return fig


def loss_plot(runs: list[RunRecord]) -> bytes:
    """The main plot: validation loss (markers) over training loss (thin line, same colour) against steps."""
    return _fig_png(loss_figure(runs))


def bpb_figure(runs: list[RunRecord]):
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True, layout="constrained")
    fig.get_layout_engine().set(wspace=0.06)  # room between the panels for their outermost tick labels
    xs = (("step", lambda r, run: r["step"]), ("tokens", lambda r, run: r["step"] * run.tokens_per_step),
          ("wall time (s)", lambda r, run: r.get("elapsed_s") or 0.0))
    for ax, (label, fx) in zip(axes, xs):
        for run, style in zip(runs, run_styles(len(runs))):
            pts = [(fx(r, run), r["val_bpb"]) for r in run.val if r.get("val_bpb") is not None]
            if pts:
                ax.plot(*zip(*pts), **style, markersize=4, markerfacecolor="none", label=run.name)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        _spaced_ticks(ax, engineering=True)
    axes[0].set_ylabel("validation bits per byte")
    _legend(fig, axes[-1], len(runs))
    fig.suptitle("validation bits per byte")
    return fig


def bpb_plots(runs: list[RunRecord]) -> bytes:
    """Validation bits per byte against steps, tokens and wall time."""
    return _fig_png(bpb_figure(runs))


def throughput_figure(runs: list[RunRecord]):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, max(2.5, 0.35 * len(runs) + 1.2)), layout="constrained")
    names = [r.name for r in runs]
    colors = run_colors(len(runs))
    a1.barh(names, [r.tokens_per_s or 0 for r in runs], color=colors)
    a1.set_xlabel("training tokens/s (median)")
    gpu = [r.peak("gpu_mem_reserved_mib") for r in runs]
    if any(g is not None for g in gpu):
        a2.barh(names, [g or 0 for g in gpu], color=colors)
        a2.set_xlabel("peak GPU memory reserved (MiB)")
    else:
        a2.barh(names, [r.peak("cpu_rss_mib") or 0 for r in runs], color=colors)
        a2.set_xlabel("peak CPU resident memory (MiB)")
    a2.set_yticks(range(len(names)), [""] * len(names))
    for ax in (a1, a2):
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
        _spaced_ticks(ax, engineering=True)
    return fig


def throughput_plots(runs: list[RunRecord]) -> bytes:
    return _fig_png(throughput_figure(runs))


def _num(x, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else ""


def parameters(n: int | None) -> str:
    """135M, 2.4M, 53.3k: a parameter count as people say it; "—" when unknown."""
    if n is None:
        return "—"
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def summary_rows(runs: list[RunRecord]) -> tuple[list[str], list[list[str]]]:
    """The summary table of the readable runs."""
    runs = [r for r in runs if r.error is None]
    gpu = any(r.peak("gpu_mem_reserved_mib") is not None for r in runs)
    header = ["run", "mixer", "status", "parameters", "steps", "val loss", "val bpb", "tokens/s",
              "peak GPU MiB" if gpu else "peak RSS MiB", "wall s"]
    rows = []
    for r in runs:
        vl = r.status.get("val_loss", r.val[-1]["val_loss"] if r.val else None)
        vb = r.status.get("val_bpb", r.val[-1].get("val_bpb") if r.val else None)
        mem = r.peak("gpu_mem_reserved_mib") if gpu else r.peak("cpu_rss_mib")
        rows.append([r.name, r.mixer, str(r.status.get("status", "?")), parameters(r.parameters), str(r.steps), _num(vl, ".4f"),
                     _num(vb, ".3f"), _num(r.tokens_per_s, ",.0f"), _num(mem, ",.0f"), _num(r.status.get("wall_s"), ".0f")])
    return header, rows


VAL_LOSS = 5  # column of the summary table the Markdown table is sorted by


def markdown_table(runs: list[RunRecord]) -> str:
    header, rows = summary_rows(runs)
    order = sorted(range(len(rows)), key=lambda i: float(rows[i][VAL_LOSS]) if rows[i][VAL_LOSS] else float("inf"))
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i >= 3 else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in rows[i]) + " |" for i in order]
    bad = [r for r in runs if r.error is not None]
    if bad:
        lines += ["", "Unreadable runs (left out above):", ""]
        lines += [f"- {r.name} ({r.path}): {r.error}" for r in bad]
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _img(png: bytes, alt: str) -> str:
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em;font-size:0.9em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3} img.plot{max-width:100%;display:block;margin:0.5em 0 1.5em}
pre{white-space:pre-wrap;margin:0;font-size:0.85em} h2{border-bottom:1px solid #ddd;padding-bottom:2px}
"""


def recall_sections(runs: list[RunRecord], niah: list, pngs: dict[str, bytes]) -> list[str]:
    """HTML of the recall sections: NIAH heatmaps side by side (pngs["niah"]), MQAR accuracy against length (pngs["mqar"])."""
    parts = []
    if "niah" in pngs:
        header, rows = recall.niah_rows(niah)
        parts += ["<h2>Needle in a haystack</h2>", "<p>Proportion of needles retrieved exactly (greedy decoding), per context length "
                  "and needle depth.</p>", _img(pngs["niah"], "needle-in-a-haystack heatmaps"), _table(header, rows)]
    series = recall.mqar_series(runs)
    if "mqar" in pngs:
        header, rows = recall.mqar_rows(series)
        parts += ["<h2>Associative recall (MQAR)</h2>", f"<p>Per-query accuracy of the newest evaluation, against the training "
                  f"sequence length{_best_of(recall.mqar_learning_rates(runs))}.</p>",
                  _img(pngs["mqar"], "MQAR accuracy against sequence length"), _table(header, rows)]
    return parts


def _best_of(rates: list[float]) -> str:
    return f" (the best of the runs at learning rates {', '.join(f'{lr:g}' for lr in rates)})" if len(rates) > 1 else ""


def recall_pngs(runs: list[RunRecord], niah: list) -> dict[str, bytes]:
    pngs = {}
    if niah:
        pngs["niah"] = _fig_png(recall.niah_figure(niah))
    series = recall.mqar_series([r for r in runs if r.error is None])
    if series:
        pngs["mqar"] = _fig_png(recall.mqar_figure(series))
    return pngs


def render_html(runs: list[RunRecord], main_png: bytes, title: str, niah: list | None = None, pngs: dict[str, bytes] | None = None) -> str:
    bad = [r for r in runs if r.error is not None]
    runs = [r for r in runs if r.error is None]
    header, rows = summary_rows(runs)
    counted = f"{len(runs)} runs" + (f" ({len(bad)} more could not be read)" if bad else "")
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>",
             f"<style>{CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             f"<p>{counted}, generated {html.escape(time.strftime('%Y-%m-%d %H:%M'))}.</p>"]
    parts += recall_sections(runs, niah or [], pngs if pngs is not None else recall_pngs(runs, niah or []))
    if not runs:
        parts.append("</body></html>\n")
        return "\n".join(parts)
    parts += ["<h2>Summary</h2>", _table(header, rows)]
    if bad:
        parts += ["<h2>Unreadable runs</h2>", "<p>Left out of the tables and plots; fix or remove the file named.</p>",
                  _table(["run", "directory", "reason"], [[r.name, str(r.path), r.error] for r in bad])]
    parts += ["<h2>Loss</h2>", _img(main_png, "validation and training loss against steps"),
              "<h2>Bits per byte</h2>", _img(bpb_plots(runs), "validation bits per byte against steps, tokens and wall time"),
              "<h2>Throughput and memory</h2>", _img(throughput_plots(runs), "tokens per second and peak memory")]
    metrics = {r.name: r.eval_metrics for r in runs if r.eval_metrics}
    if metrics:
        keys = sorted(set().union(*metrics.values()))
        parts += ["<h2>Eval metrics (newest evaluation)</h2>",
                  _table(["run", *keys], [[n, *(_num(m.get(k), ".4g") for k in keys)] for n, m in metrics.items()])]
    diffs = config_differences(runs)
    parts.append("<h2>Config differences</h2>")
    if diffs:
        parts.append(_table(["key", *(r.name for r in runs)], [[k, *(json.dumps(v) if not isinstance(v, str) else v for v in vals)] for k, vals in diffs.items()]))
    else:
        parts.append("<p>The resolved configs are identical.</p>")
    parts.append("<h2>Samples (newest)</h2>")
    sample_rows = []
    for r in runs:
        if r.samples:
            s = r.samples[-1]
            sample_rows.append([r.name, str(s.get("step", "")), f"<pre>{html.escape(str(s.get('prompt', '')) + str(s.get('text', '')))}</pre>"])
    if sample_rows:
        parts.append("<table><thead><tr><th>run</th><th>step</th><th>prompt + continuation</th></tr></thead><tbody>")
        parts += [f"<tr><td>{html.escape(a)}</td><td>{b}</td><td>{c}</td></tr>" for a, b, c in sample_rows]
        parts.append("</tbody></table>")
    else:
        parts.append("<p>No samples recorded.</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(runs: list[RunRecord], out: Path, title: str, niah: list | None = None) -> dict[str, Path]:
    """Write OUT.html, OUT.png (the main loss plot) and OUT.md (the summary table); with needle-in-a-haystack
    evaluations or MQAR runs, also OUT-niah.png (the heatmaps) and OUT-mqar.png (accuracy against length)."""
    out = prepare_output_file(Path(out), what="--out")
    readable = [r for r in runs if r.error is None]
    main_png = loss_plot(readable) if readable else b""
    pngs = recall_pngs(runs, niah or [])
    paths = {"html": out, "md": out.with_suffix(".md")}
    if readable:
        paths["png"] = out.with_suffix(".png")
        write_bytes_atomic(paths["png"], main_png, what="the report's plot")
    for kind, png in pngs.items():
        paths[f"{kind} png"] = out.with_name(f"{out.stem}-{kind}.png")
        write_bytes_atomic(paths[f"{kind} png"], png, what="the report's plot")
    md = markdown_table(runs) if readable else ""
    if niah:
        md += "\nNeedle in a haystack (proportion correct):\n\n" + recall.markdown(*recall.niah_rows(niah))
    series = recall.mqar_series(readable)
    if series:
        md += (f"\nMQAR accuracy by sequence length{_best_of(recall.mqar_learning_rates(readable))}:\n\n"
               + recall.markdown(*recall.mqar_rows(series)))
    write_text_atomic(paths["md"], md, what="the report's table")
    write_text_atomic(out, render_html(runs, main_png, title, niah or [], pngs), what="the report")
    return paths
