"""Writing artifacts loses nothing stored: `--overwrite` replaces only an artifact (or an empty directory) and
never a folder holding the source; bad `quantize` inputs and destinations get one line, no traceback; a
writer's temp dir does not outlive it (SIGTERM cleans up, and a killed writer's is removed by the next)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_serve.artifact import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, save_artifact, sha256_file
from moe_serve.cli import main
from moe_serve.errors import ArtifactError
from moe_serve.output_dir import TEMP_MARK
from moe_serve.testing import random_state_dict
from moe_serve.tokenizer import Tokenizer, byte_level_tokenizer
from tests.conftest import edit_config, edit_weights, lm_config


@pytest.fixture
def src(tmp_path: Path, tiny_model) -> Path:
    """A float artifact in a folder with a neighbour (what a careless --overwrite of the folder would take)."""
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(tiny_model(), models / "float")
    (models / "notes.txt").write_text("a neighbour\n")
    return models / "float"


def quantize(capsys, *args: str) -> tuple[int, str]:
    code = main(["quantize", *args, "--weights", "int8", "--quiet"])
    return code, capsys.readouterr().err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_never_deletes_a_folder_that_holds_the_source(capsys, src: Path) -> None:
    before = snapshot(src.parent)
    code, err = quantize(capsys, str(src), str(src.parent), "--overwrite")
    assert code == 2 and "holds the source" in err and "Traceback" not in err
    assert snapshot(src.parent) == before


def test_overwrite_never_deletes_a_directory_that_is_not_an_artifact(capsys, src: Path, tmp_path: Path) -> None:
    other = tmp_path / "photos"
    (other / "2026").mkdir(parents=True)
    (other / "2026" / "a.jpg").write_bytes(b"\xff\xd8")
    (other / "config.json").write_text('{"format": "moe-serve"}')  # looks like one, but holds a folder
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.txt").write_text("x")
    for dst in (other, plain):
        before = snapshot(dst)
        code, err = quantize(capsys, str(src), str(dst), "--overwrite")
        assert code == 2 and "is not an artifact and not empty" in err, err
        assert snapshot(dst) == before


def test_overwrite_replaces_an_artifact_or_an_empty_directory(capsys, src: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert quantize(capsys, str(src), str(empty), "--overwrite")[0] == 0
    first = sha256_file(empty / WEIGHTS_FILE)
    assert quantize(capsys, str(src), str(empty))[0] == 2  # no --overwrite: kept
    shutil.copytree(src, tmp_path / "float-copy")  # an artifact of other weights in its place
    assert quantize(capsys, str(tmp_path / "float-copy"), str(empty), "--overwrite")[0] == 0
    assert sha256_file(empty / WEIGHTS_FILE) == first  # same weights, same bytes: replaced, not merged
    assert sorted(p.name for p in empty.iterdir()) == sorted([CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE])
    assert not [p for p in tmp_path.iterdir() if TEMP_MARK in p.name]


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def _retarget_tokenizer(src: Path, data: bytes) -> None:
    (src / TOKENIZER_FILE).write_bytes(data)
    edit_config(src, lambda m: m["checksums"].__setitem__(TOKENIZER_FILE, sha256_file(src / TOKENIZER_FILE)))


def _truncate_weights(src: Path) -> None:
    data = (src / WEIGHTS_FILE).read_bytes()
    (src / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    edit_config(src, lambda m: m["checksums"].__setitem__(WEIGHTS_FILE, sha256_file(src / WEIGHTS_FILE)))


def _nan_weight(src: Path) -> None:
    def edit(tensors: dict) -> None:
        name = "lm_head.weight"
        tensors[name][0, 0] = float("nan")

    edit_weights(src, edit)


BAD_INPUTS: dict[str, tuple[Callable[[Path], object], str]] = {
    "missing": (lambda src: shutil.rmtree(src), "no artifact directory"),
    "a file": (lambda src: (shutil.rmtree(src), _write(src, b"x")), "artifact directory"),
    "no config": (lambda src: (src / CONFIG_FILE).unlink(), "has no config.json"),
    "config not JSON": (lambda src: _write(src / CONFIG_FILE, b"{"), "is not valid JSON"),
    "config not UTF-8": (lambda src: _write(src / CONFIG_FILE, b"\xff\xfe"), "is not UTF-8"),
    "not moe-serve's": (lambda src: edit_config(src, format="gguf"), "is not a moe-serve artifact config"),
    "weights missing": (lambda src: (src / WEIGHTS_FILE).unlink(), "cannot read"),
    "weights changed": (lambda src: _write(src / WEIGHTS_FILE, b"garbage"), "checksum mismatch"),
    "weights truncated": (_truncate_weights, "cannot read"),
    "tokenizer missing": (lambda src: (src / TOKENIZER_FILE).unlink(), "cannot read"),
    "tokenizer garbage": (lambda src: _retarget_tokenizer(src, b"[1, 2"), "cannot be used"),
    "NaN weights": (_nan_weight, "NaN or infinite"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_a_bad_source_gets_one_line(capsys, src: Path, tmp_path: Path, case: str) -> None:
    edit, message = BAD_INPUTS[case]
    edit(src)
    code, err = quantize(capsys, str(src), str(tmp_path / "out"))
    assert code == 2 and message in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    assert not [p for p in src.parent.iterdir() if TEMP_MARK in p.name]


BAD_DESTINATIONS: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "exists": (lambda src, tmp: src.parent / "notes.txt", "already exists"),
    "a file, with --overwrite": (lambda src, tmp: src.parent / "notes.txt", "is not a directory"),
    "under a file": (lambda src, tmp: src.parent / "notes.txt" / "out", "is not a directory"),
    "inside the source": (lambda src, tmp: src / "int8", "is inside the source"),
    "the source": (lambda src, tmp: src, "holds the source"),
    "a name too long": (lambda src, tmp: tmp / ("x" * 300), "cannot write"),
}


@pytest.mark.parametrize("case", sorted(BAD_DESTINATIONS))
def test_a_bad_destination_gets_one_line_before_any_work(capsys, src: Path, tmp_path: Path, case: str) -> None:
    where, message = BAD_DESTINATIONS[case]
    before = snapshot(src.parent)
    flags = ["--overwrite"] if "overwrite" in case else []
    code, err = quantize(capsys, str(src), str(where(src, tmp_path)), *flags)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert snapshot(src.parent) == before


def test_nan_weights_are_refused_when_written() -> None:
    config = lm_config()
    state = random_state_dict(config, seed=0)
    name = "lm_head.weight"
    state[name][0, 0] = float("inf")
    with pytest.raises(ArtifactError, match=f"'{name}' has 1 non-finite"):
        save_artifact(Path("/nonexistent/never-written"), config, state, Tokenizer(byte_level_tokenizer()))


def test_a_killed_writers_temp_dir_is_removed_by_the_next_write(capsys, src: Path, tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out{TEMP_MARK}{int(dead.stdout)}-abc"
    live = tmp_path / f".out{TEMP_MARK}{os.getpid()}-def"  # a writer still running: left alone
    for folder in (stale, live):
        folder.mkdir()
        (folder / WEIGHTS_FILE).write_bytes(b"half")
    assert quantize(capsys, str(src), str(tmp_path / "out"))[0] == 0
    assert not stale.exists() and live.exists()


def test_sigterm_while_writing_leaves_nothing_behind(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from moe_serve.errors import ArtifactError
        from moe_serve.output_dir import written_aside
        with written_aside(Path({str(tmp_path / "out")!r}), ArtifactError) as tmp:
            (tmp / "part").write_bytes(b"x" * 1000)
            print("writing", flush=True)
            time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_export_checks_its_destination_before_converting(capsys, tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"")
    code = main(["export", "hf", str(checkpoint), str(tmp_path), "--overwrite", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "holds the source" in err and (checkpoint / "model.safetensors").exists()


def test_overwrite_checks_see_through_links(capsys, src: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(src.parent, target_is_directory=True)
    before = snapshot(src.parent)
    code, err = quantize(capsys, str(src), str(link), "--overwrite")
    assert code == 2 and "holds the source" in err
    assert snapshot(src.parent) == before
