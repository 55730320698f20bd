"""Evaluation: text-to-SQL (Spider), data-to-text (DART), summarisation (SAMSum), perplexity; metrics and predictions.

    from attnlab.eval import evaluate, score
    result = evaluate(model, tokenizer, "spider", "data/spider", limit=100)
"""

from __future__ import annotations

__all__ = ["EvalResult", "evaluate", "evaluate_perplexity", "score"]


def __getattr__(name: str):  # imported on first use, so that `attnlab --help` stays fast
    if name in __all__:
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'attnlab.eval' has no attribute {name!r}")
