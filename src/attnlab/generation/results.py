"""What decoding returns: a candidate continuation per beam or sample, the result per prompt, and
the stop strings that cut a candidate's text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

FinishReason = Literal["eos", "stop", "length"]


@dataclass
class Candidate:
    """One generated continuation (the prompt is never included)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    score: float | None = None  # beam search: length-normalised log-prob; otherwise sum of log-probs (output_scores)


@dataclass
class GenerationResult:
    """What one prompt produced: its candidates, best first."""

    prompt: str | list[int]
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.candidates[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.candidates[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        return self.candidates[0].finish_reason

    @property
    def score(self) -> float | None:
        return self.candidates[0].score


class StopStrings:
    """Finds the first stop string in the decoded continuation, wherever token boundaries fall."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, list(stops)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def cut(self, text: str) -> int | None:
        """Index where the text ends (the start of the earliest stop string), or None."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None


def finish_candidate(stops: StopStrings, token_ids: list[int], reason: FinishReason, score: float | None) -> Candidate:
    text = stops.decode(token_ids)
    cut = stops.cut(text) if stops.stops else None
    if cut is not None:
        text, reason = text[:cut], "stop"
    return Candidate(text, token_ids, reason, score)
