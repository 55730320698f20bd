"""Metric implementations shared by the tasks.

Corpus metrics are computed by the libraries the field reports with (sacrebleu for BLEU and
chrF, rouge-score for ROUGE, sqlglot for SQL normalisation), so attnlab's numbers compare
with other systems'. Every ratio goes through `ratio`, which returns None for 0/0: a metric
over no scorable examples is reported as missing, never as 1 (or 0).
"""

from __future__ import annotations

import re
from typing import Sequence

# Special-token spellings of common tokenizers, removed from predictions made elsewhere.
_SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?s>|<(?:eos|bos|pad|unk|mask|sep|cls)>|\[(?:PAD|CLS|SEP|UNK|MASK)\]")


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when there is nothing to divide by."""
    return None if denominator == 0 else numerator / denominator


def mean(values: Sequence[float]) -> float | None:
    return ratio(sum(values), len(values))


def clean_prediction(text: str, prompt: str | None = None, special_tokens: Sequence[str] = ()) -> str:
    """A prediction without the prompt (if it was echoed) and without special tokens, stripped."""
    if prompt and text.startswith(prompt):
        text = text[len(prompt):]
    for token in special_tokens:
        if token:
            text = text.replace(token, "")
    text = _SPECIAL_TOKEN.sub("", text)
    return text.strip()


def bleu_chrf(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float | None]:
    """Corpus BLEU (all references of each example) and chrF, both 0-100, by sacrebleu.

    Examples may have different numbers of references. Call only with examples that have at
    least one non-empty reference; with none, both are None.
    """
    from sacrebleu.metrics import BLEU, CHRF

    if not predictions:
        return {"bleu": None, "chrf": None}
    width = max(len(r) for r in references)
    streams = [[refs[i] if i < len(refs) else None for refs in references] for i in range(width)]
    bleu = BLEU().corpus_score(list(predictions), streams)
    chrf = CHRF().corpus_score(list(predictions), streams)
    return {"bleu": bleu.score, "chrf": chrf.score}


def sentence_bleu_chrf(prediction: str, references: Sequence[str]) -> dict[str, float]:
    from sacrebleu.metrics import BLEU, CHRF

    return {
        "bleu": BLEU(effective_order=True).sentence_score(prediction, list(references)).score,
        "chrf": CHRF().sentence_score(prediction, list(references)).score,
    }


_ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
_rouge_scorer = None


def rouge(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F1 (0-100) of one prediction against one reference, Porter-stemmed (rouge-score)."""
    global _rouge_scorer
    if _rouge_scorer is None:
        from rouge_score.rouge_scorer import RougeScorer

        _rouge_scorer = RougeScorer(list(_ROUGE_TYPES), use_stemmer=True)
    scores = _rouge_scorer.score(reference, prediction)
    return {name: 100.0 * scores[name].fmeasure for name in _ROUGE_TYPES}


def normalize_sql(sql: str) -> str | None:
    """A canonical spelling of a query (sqlglot, SQLite dialect), or None if it does not parse."""
    import sqlglot
    from sqlglot.errors import SqlglotError

    sql = sql.strip().rstrip(";").strip()
    if not sql:
        return None
    try:
        statements = sqlglot.parse(sql, read="sqlite")
        if len(statements) != 1 or statements[0] is None:
            return None
        return statements[0].sql(dialect="sqlite", normalize=True, pretty=False)
    except (SqlglotError, ValueError, RecursionError):
        return None


def sql_orders_rows(sql: str) -> bool:
    """True when the outermost query has ORDER BY, so that the order of its rows is part of the answer."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    try:
        tree = sqlglot.parse_one(sql.strip().rstrip(";"), read="sqlite")
    except (SqlglotError, ValueError, RecursionError):
        return bool(re.search(r"\border\s+by\b", sql, re.IGNORECASE))
    if isinstance(tree, (exp.Select, exp.Union, exp.Intersect, exp.Except, exp.Subquery)):
        return tree.args.get("order") is not None
    return False
