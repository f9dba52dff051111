"""The documents that list the Hugging Face families list the importer's registry
(moe_serve.exporters.hf.family_names(): each family's display name and its aliases, in that order), between the
markers `<!-- hf-families -->` and `<!-- /hf-families -->`: README.md and docs/architecture.md as a
comma-separated list ("and" before the last allowed), docs/hf-import.md as a table whose first column names
them. A family registered without its documents, or a document naming one the importer does not convert,
fails here by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_serve.exporters.hf import family_names

ROOT = Path(__file__).resolve().parents[2]
OPEN, CLOSE = "<!-- hf-families -->", "<!-- /hf-families -->"
DOCUMENTS = {"README.md": "list", "docs/architecture.md": "list", "docs/hf-import.md": "table"}


def marked_block(document: str, text: str) -> str:
    """The text between the document's one pair of markers."""
    opened, closed = text.count(OPEN), text.count(CLOSE)
    if (opened, closed) != (1, 1) or text.index(OPEN) > text.index(CLOSE):
        pytest.fail(
            f"{document} needs one {OPEN} ... {CLOSE} block listing {', '.join(family_names())}; found {opened} "
            f"opening and {closed} closing markers"
        )
    return text[text.index(OPEN) + len(OPEN) : text.index(CLOSE)]


def listed(block: str) -> list[str]:
    """A comma-separated list of names, "and" allowed before the last, over any number of lines."""
    text = " ".join(block.split()).removesuffix(".")
    return [name for name in re.split(r",\s*(?:and\s+)?|\s+and\s+", text) if name]


def tabled(document: str, block: str) -> list[str]:
    """The first column of a Markdown table's rows (after its header and separator)."""
    rows = [line.strip() for line in block.splitlines() if line.strip().startswith("|")]
    if len(rows) < 2 or not set(rows[1]) <= set("|-: "):
        pytest.fail(f"{document}: the {OPEN} block must hold a Markdown table (a header, then its separator row)")
    return [row.strip("|").split("|")[0].strip() for row in rows[2:]]


def mismatch(document: str, names: list[str]) -> str | None:
    """What is wrong with a document's list, each family named; None when it lists exactly the registry."""
    expected = list(family_names())
    problems = []
    if missing := [n for n in expected if n not in names]:
        problems.append(f"missing {', '.join(missing)}")
    if extra := [n for n in names if n not in expected]:
        problems.append(f"not a registered family: {', '.join(extra)}")
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"listed twice: {', '.join(repeated)}")
    if not problems and names != expected:
        problems.append(f"out of order: the registry's order is {', '.join(expected)}")
    return f"{document} ({OPEN} block): {'; '.join(problems)}" if problems else None


@pytest.mark.parametrize("document", list(DOCUMENTS))
def test_the_document_lists_exactly_the_registered_families(document: str) -> None:
    block = marked_block(document, (ROOT / document).read_text())
    names = listed(block) if DOCUMENTS[document] == "list" else tabled(document, block)
    problem = mismatch(document, names)
    assert problem is None, problem


def test_a_missing_or_unknown_family_is_named() -> None:
    everyone = list(family_names())
    text = f"intro {OPEN}{', '.join(everyone[1:-1])}, Falcon-MoE and {everyone[-1]}.{CLOSE} outro"
    assert mismatch("X.md", listed(marked_block("X.md", text))) == (
        f"X.md ({OPEN} block): missing {everyone[0]}; not a registered family: Falcon-MoE"
    )
    table = f"{OPEN}\n| family | architectures |\n|---|---|\n" + "".join(f"| {n} | x |\n" for n in everyone) + CLOSE
    assert mismatch("X.md", tabled("X.md", marked_block("X.md", table))) is None
    assert "out of order" in (mismatch("X.md", everyone[::-1]) or "")
    with pytest.raises(pytest.fail.Exception, match="X.md needs one"):
        marked_block("X.md", "no markers")
