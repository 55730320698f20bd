"""Byte-level BPE tokenization several times faster than `tokenizers`' own batch encoder, with the same ids.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, the tokenizers `attnlab bench data` trains) spends most of
its time in `tokenizers` in the pre-tokenizer: the regex split and the mapping of each piece's UTF-8 bytes to
characters. The BPE model itself is cheap, its word cache holding the frequent words. `WordCachedEncoder`
splits with the same regular expressions (the `regex` package), encodes each distinct piece once with the
tokenizer's own model (`tokenizers.Tokenizer.model.tokenize`) and keeps the ids of every piece it has seen.

It takes only the pipelines it reproduces (`WordCachedEncoder.of` returns None for any other): no
normalizer; a pre-tokenizer that is ByteLevel with its GPT-2 regex, or a Sequence of Split(regex, isolated)
and Digits(individual) steps ending in ByteLevel. Two things stay with `tokenizers`, per document:
- a document holding an added token's text (`tokenizers` matches added tokens before pre-tokenizing);
- a document holding a character that the two regex engines classify differently (`tokenizers`' Oniguruma
  and `regex` may follow different Unicode versions). Each character is checked once, the first time it is
  met: a probe string puts it among letters, digits, punctuation, spaces, a newline and an apostrophe, and
  the tokenizer's own pre-tokenizer must split the probe into the same pieces as this module.
"""

from __future__ import annotations

import json
import re
from itertools import chain

import numpy as np

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CACHE_PIECES = 1 << 20  # distinct pieces whose ids a process keeps (the cache starts again when full)
PROBE = "{c}a{c}a 1{c}1 !{c}! {c} \n{c}\n'{c}'s {c}{c}\t{c}  {c}.{c}"


def _byte_table() -> dict[int, str]:
    """ByteLevel's (GPT-2's) byte -> character table, as a `str.translate` table over latin-1 characters."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TABLE = _byte_table()


def byte_chars(piece: str) -> str:
    """A piece as ByteLevel hands it to the model: one character per UTF-8 byte."""
    return piece.encode("utf-8").decode("latin-1").translate(BYTE_TABLE)


# What the Unicode classes of the split patterns hold among ASCII characters (\s: Unicode's White_Space)
_ASCII_CLASSES = {r"\p{L}": "A-Za-z", r"\p{N}": "0-9", r"\s": r"\t\n\x0b\x0c\r "}


def ascii_pattern(pattern: str) -> str | None:
    r"""`pattern` for text of ASCII characters only, in the syntax of Python's `re` (about twice as fast as
    `regex` with the Unicode classes): \p{L}, \p{N}, \s and \S become their ASCII members. None where the
    pattern holds another class escape (\p{..}, \w, \d, \b, ...)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            escape = pattern[i : i + 5] if pattern.startswith(("\\p{", "\\P{"), i) else pattern[i : i + 2]
            if escape in _ASCII_CLASSES:
                members = _ASCII_CLASSES[escape]
                out.append(members if in_class else f"[{members}]")
            elif escape == r"\S" and not in_class:
                out.append("[^" + _ASCII_CLASSES[r"\s"] + "]")
            elif len(escape) == 2 and escape[1] in "trnfv'\"\\.[](){}|?*+^$- ":
                out.append(escape)
            else:
                return None
            i += len(escape)
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            i += 1
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):  # a ] first in a class is a member
                out.append("\\]")
                i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def split_patterns(pre_tokenizer: dict | None) -> list[str] | None:
    """The regular expressions a pre-tokenizer (its JSON) splits with, in order, each isolating its matches;
    None where it is not a pipeline this module reproduces."""
    if not pre_tokenizer:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        steps = [pre_tokenizer]
    elif pre_tokenizer.get("type") == "Sequence":
        steps = pre_tokenizer.get("pretokenizers") or []
    else:
        return None
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return None
    patterns = []
    for step in steps[:-1]:
        pattern = step.get("pattern") or {}
        if step.get("type") == "Split" and step.get("behavior") == "Isolated" and not step.get("invert") and "Regex" in pattern:
            patterns.append(pattern["Regex"])
        elif step.get("type") == "Digits" and step.get("individual_digits"):
            patterns.append(r"\p{N}")
        else:
            return None
    if steps[-1].get("use_regex", True):
        patterns.append(GPT2_PATTERN)
    return patterns or None


class WordCachedEncoder:
    """`encode(docs)` -> one int64 array of ids per document, the ids `backend.encode_batch(docs,
    add_special_tokens=False)` gives (see the module's docstring for what it takes and what it leaves)."""

    def __init__(self, backend, patterns: list[str]):
        import regex

        self.backend = backend
        self.model = backend.model
        self.patterns = [regex.compile(p) for p in patterns]
        ascii_patterns = [ascii_pattern(p) for p in patterns]
        self.ascii_patterns = [re.compile(p) for p in ascii_patterns] if None not in ascii_patterns else None
        added = sorted({t.content for t in backend.get_added_tokens_decoder().values() if t.content}, key=len, reverse=True)
        self.added = regex.compile("|".join(regex.escape(t) for t in added)) if added else None
        self.cache: dict[str, tuple[int, ...]] = {}
        self.checked: set[str] = set()
        self.differs: set[str] = set()

    @classmethod
    def of(cls, backend) -> WordCachedEncoder | None:
        try:
            import regex
        except ImportError:
            return None
        spec = json.loads(backend.to_str())
        patterns = split_patterns(spec.get("pre_tokenizer"))
        if spec.get("normalizer") is not None or patterns is None or not hasattr(backend.model, "tokenize"):
            return None
        try:
            return cls(backend, patterns)
        except regex.error:  # Oniguruma syntax that `regex` does not read
            return None

    def split(self, text: str, unicode: bool = False) -> list[str]:
        """The pieces of `text`: each pattern in turn splits every piece, keeping the matches and the text
        between them (the Isolated behaviour), dropping empty pieces. ASCII text goes through the ASCII
        patterns (`ascii_pattern`) unless `unicode`."""
        pieces = [text]
        ascii_only = self.ascii_patterns is not None and not unicode and text.isascii()
        for pattern in self.ascii_patterns if ascii_only else self.patterns:
            out = []
            for piece in pieces:
                found = pattern.findall(piece)
                if sum(map(len, found)) == len(piece):  # the matches cover the piece: nothing lies between them
                    out.extend(found if all(found) else filter(None, found))
                    continue
                pos = 0
                for m in pattern.finditer(piece):
                    start, end = m.span()
                    if start > pos:
                        out.append(piece[pos:start])
                    if end > start:
                        out.append(piece[start:end])
                    pos = end
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces

    def _check(self, chars: set[str]) -> None:
        """Each character's probe split by the tokenizer's pre-tokenizer and by `split`: the characters where
        the two differ go to `differs`."""
        pre = self.backend.pre_tokenizer
        for c in chars:
            probe = PROBE.format(c=c)
            try:
                expected = [p for p, _ in pre.pre_tokenize_str(probe)]
                # both ways of splitting: an ASCII character also meets the Unicode patterns, beside other scripts
                same = all(expected == [byte_chars(w) for w in self.split(probe, unicode)] for unicode in (False, True))
            except Exception:  # a lone surrogate, which neither side encodes
                same = False
            if not same:
                self.differs.add(c)
        self.checked |= chars

    def _encode(self, doc: str) -> np.ndarray:
        pieces = self.split(doc)
        cache = self.cache
        missing = set(pieces).difference(cache)
        if missing:
            if len(cache) + len(missing) > CACHE_PIECES:
                cache.clear()
                missing = set(pieces)
            for piece in missing:
                cache[piece] = tuple(token.id for token in self.model.tokenize(byte_chars(piece)))
        return np.fromiter(chain.from_iterable(map(cache.__getitem__, pieces)), dtype=np.int64)

    def __call__(self, docs: list[str]) -> list[np.ndarray]:
        joined = "".join(docs)
        chars = set(joined)
        new = chars - self.checked
        if new:
            self._check(new)
        differs = chars & self.differs
        added = self.added
        slow: set[int] = set()
        if differs or (added is not None and added.search(joined)):
            slow = {i for i, d in enumerate(docs) if any(c in d for c in differs) or (added is not None and added.search(d))}
        out = [None if i in slow else self._encode(d) for i, d in enumerate(docs)]
        if slow:
            order = sorted(slow)
            encode = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
            for i, e in zip(order, encode([docs[i] for i in order], add_special_tokens=False)):
                out[i] = np.asarray(e.ids, dtype=np.int64)
        return out
