"""The link check of `make lint` (tests/check_links.py): the repository's documents pass it, and it reports
what it exists to catch."""

from __future__ import annotations

from pathlib import Path

from tests.check_links import ROOT, broken_links, doc_files, slug


def test_readme_and_docs_have_no_broken_relative_links() -> None:
    files = doc_files(ROOT)
    assert ROOT / "README.md" in files and len(files) > 1
    assert broken_links(files, ROOT) == []


def test_slugs_follow_github() -> None:
    assert slug("3. Routers and what k means") == "3-routers-and-what-k-means"
    assert slug("What `experts_per_token` means") == "what-experts_per_token-means"
    assert slug("Batch API (HTTP)") == "batch-api-http"
    assert (
        slug("Serving with onnxruntime (`--backend onnxruntime`)") == "serving-with-onnxruntime---backend-onnxruntime"
    )


def test_broken_files_and_anchors_are_reported_with_their_line(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Two words\n\n## Two words\n")
    (tmp_path / "docs" / "figure.png").write_bytes(b"")
    (tmp_path / "README.md").write_text(
        "# Front\n"
        "[ok](docs/guide.md#two-words) [ok too](docs/guide.md#two-words-1) ![img](docs/figure.png)\n"
        "[web](https://example.com/missing.md) [self](#front)\n"
        "```\n[in code](nowhere.md)\n```\n"
        "`[inline](nowhere.md)`\n"
        "[gone](docs/missing.md)\n"
        "![gone image](docs/missing.png) [bad anchor](docs/guide.md#three-words)\n"
        "[bad self](#back)\n"
    )
    problems = broken_links([tmp_path / "README.md", tmp_path / "docs" / "guide.md"], tmp_path)
    assert problems == [
        "README.md:8: docs/missing.md: no such file",
        "README.md:9: docs/missing.png: no such file",
        "README.md:9: docs/guide.md#three-words: no heading with anchor #three-words in guide.md",
        "README.md:10: #back: no heading with anchor #back in README.md",
    ]
