"""Evaluation: text-to-SQL (Spider), data-to-text (DART), summarisation (SAMSum), perplexity; metrics and predictions.

    from attnlab.eval import evaluate, score
    result = evaluate(model, tokenizer, "spider", "data/spider", limit=100)
"""

from __future__ import annotations

from .runner import EvalResult, evaluate, evaluate_perplexity, score

__all__ = ["EvalResult", "evaluate", "evaluate_perplexity", "score"]
