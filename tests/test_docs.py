"""The docs read as CleanRL's: short sentences. No sentence of the README, bench/README.md or a docs page runs past 50
words (tables and code blocks aside: a table's cells are not prose, a command is not a sentence)."""

import re
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = sorted(Path(ROOT, "docs").glob("*.md")) + [Path(ROOT, "README.md"), Path(ROOT, "bench", "README.md")]


def sentences(markdown: str) -> list[str]:
    """The prose of a page, sentence by sentence: code blocks and table rows dropped, each paragraph and list item on
    its own, split after a full stop (or ! ?) followed by a capital, a backquote or a bracket."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    text = "\n".join(line for line in text.split("\n") if not line.lstrip().startswith("|"))
    out = []
    for block in re.split(r"\n\s*\n|\n\s*[-*] |\n\s*\d+\. ", text):
        block = re.sub(r"^\s*([-*]|\d+\.)\s+", "", block)  # a list item's marker
        out += re.split(r"(?<=[.!?])\s+(?=[A-Z`(\[])", " ".join(block.split()))
    return out


def test_sentences_split_as_meant():
    page = "A first one. A second, with `code`.\n\n- an item. Another.\n\n| a table | cell |\n```\nno. Code.\n```"
    assert sentences(page) == ["A first one.", "A second, with `code`.", "an item.", "Another.", ""]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_sentence_over_50_words(page):
    long = [s for s in sentences(page.read_text()) if len(s.split()) > 50]
    assert not long, f"{len(long)} sentences over 50 words, the first: {long[0][:200]}"
