"""How runs look in every figure of a report.

Runs whose curves coincide (two seeds that agree, a rerun) stay apart: each run has its own
colour, line style and marker, so that one line drawn over another still shows both.
"""

from __future__ import annotations

LINE_STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def run_colors(n: int):
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def run_styles(n: int) -> list[dict]:
    """Colour, line style and marker of each of `n` runs: no two runs share all three."""
    return [dict(color=c, linestyle=LINE_STYLES[i % len(LINE_STYLES)], marker=MARKERS[i % len(MARKERS)])
            for i, c in enumerate(run_colors(n))]
