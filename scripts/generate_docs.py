"""Write the tables of attnlab's docs that are generated from code, so that they never drift from it.

    python scripts/generate_docs.py           rewrite every generated block in place
    python scripts/generate_docs.py --check   change nothing; exit 1 naming each block that differs

A generated block sits between `<!-- NAME -->` and `<!-- /NAME -->` in its page; tests/test_docs.py checks
that every block equals what its generator writes now.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _config_reference() -> str:
    from attnlab.config.reference import reference_markdown

    return reference_markdown()


def _mixer_presets() -> str:
    from attnlab.models.mixers import presets_markdown

    return presets_markdown()


# block name -> (page, generator): the config schema's keys, the registered mixer presets
BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "config-reference": ("docs/config.md", _config_reference),
    "mixer-presets": ("docs/mixers.md", _mixer_presets),
}


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- {re.escape(name)} -->\n)(.*?)(\n<!-- /{re.escape(name)} -->)", re.S)


def checked_in(name: str) -> str:
    """The text of block `name` as its page holds it now."""
    page, _ = BLOCKS[name]
    match = _pattern(name).search((ROOT / page).read_text())
    if match is None:
        raise SystemExit(f"{page} lacks the <!-- {name} --> ... <!-- /{name} --> block")
    return match.group(2)


def generated(name: str) -> str:
    """The text of block `name` as its generator writes it."""
    return BLOCKS[name][1]().strip("\n")


def write(name: str) -> bool:
    """Rewrite block `name` in its page; True when it changed."""
    page, _ = BLOCKS[name]
    path = ROOT / page
    text = path.read_text()
    checked_in(name)  # says which page lacks the block
    new = _pattern(name).sub(lambda m: m.group(1) + generated(name) + m.group(3), text, count=1)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str]) -> int:
    check = "--check" in argv
    drifted = []
    for name, (page, _) in BLOCKS.items():
        if check:
            if checked_in(name) != generated(name):
                drifted.append(f"{page}: <!-- {name} -->")
        elif write(name):
            print(f"rewrote {page}: <!-- {name} -->")
    if drifted:
        print("out of date (run: python scripts/generate_docs.py):\n  " + "\n  ".join(drifted))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
