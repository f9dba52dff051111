"""The tree speaks for itself: code, comments and documents never cite the project's issue tracker by number (the
word "issue" and a number), which a reader of the repository cannot see, and the README stays a front page."""

from __future__ import annotations

import re
import subprocess

from tests.check_links import ROOT

ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
TEXT_SUFFIXES = (".py", ".md", ".cpp", ".h", ".toml", ".txt", ".yml", ".yaml", ".sh", ".cfg")
README_MAX_LINES = 120


def tracked_text_files() -> list[str]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [n for n in names if n.endswith(TEXT_SUFFIXES) or n in ("Makefile", "Dockerfile")]


def test_no_file_cites_an_issue_by_number() -> None:
    hits = [
        f"{name}:{number}: {line.strip()}"
        for name in tracked_text_files()
        if (ROOT / name).is_file()
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), start=1)
        if ISSUE_NUMBER.search(line) and "github.com" not in line
    ]
    assert hits == []


def test_the_readme_fits_on_two_screens() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES
