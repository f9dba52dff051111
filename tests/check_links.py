"""Relative links in README.md and docs/*.md: every link and image must name a file or folder that exists
and, with `#anchor`, a heading of the target whose GitHub slug is that anchor. `python -m tests.check_links`
(part of `make lint`) prints each broken link as `file:line: ...` and exits 1.

Slugs as GitHub writes them: lowercase, every character that is not a letter, digit, space, hyphen or
underscore dropped, spaces turned into hyphens; a repeated heading gets -1, -2, ... Links inside fenced
code blocks and inline code are not links; absolute URLs (http:, mailto:, ...) are not checked.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# [text](target) and ![alt](target), target up to the first space or closing parenthesis; an optional title.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (inline code marks and link targets removed first)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text only
    text = text.replace("`", "").strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def _lines_outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            out.append((number, line))
    return out


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _lines_outside_code(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code."""
    out = []
    for number, line in _lines_outside_code(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            out.append((number, match.group(1)))
    return out


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """`file:line: target: why` for every relative link among files that does not resolve (an anchor is
    checked only in a Markdown target: GitHub's `#L10` line anchors on code are left alone)."""
    problems = []
    for path in files:
        for number, target in links(path):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
                continue  # http:, https:, mailto:, ...: not checked
            name, _, anchor = target.partition("#")
            where = f"{path.relative_to(root)}:{number}: {target}"
            dest = (path.parent / name).resolve() if name else path
            if name.startswith("/"):
                dest = (root / name.lstrip("/")).resolve()
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md."""
    readme = root / "README.md"
    return ([readme] if readme.is_file() else []) + sorted((root / "docs").glob("*.md"))


def main() -> int:
    problems = broken_links(doc_files())
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{len(problems)} broken link(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
