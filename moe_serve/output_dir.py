"""Writing an output directory (an artifact, an ONNX export) so that nothing stored is lost: DST is checked
before any work starts, written aside in a temp dir beside it and renamed into place; `--overwrite` replaces
only a directory such a write made (or an empty one), never one that holds a source; a temp dir that a killed
writer left behind is removed by the next write beside it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from moe_serve.errors import MoEServeError

TEMP_MARK = ".tmp-"  # `.<DST name>.tmp-<pid>-<random>`: the pid tells a live writer from a killed one


def check_destination(
    dst: Path,
    *,
    overwrite: bool,
    is_ours: Callable[[Path], bool],
    sources: Sequence[Path] = (),
    what: str = "an artifact",
    error: type[MoEServeError],
) -> None:
    """Refuse, before any work, a DST that cannot be written or must not be replaced: one that exists (without
    `overwrite`), a file, a directory that is not `what` (by `is_ours`) and not empty, one that is or holds a
    source, one inside a source, or a parent that is not a writable directory."""
    try:
        _check_destination(dst, overwrite, is_ours, sources, what, error)
    except OSError as exc:  # a name too long, a loop of links, a folder that cannot be read
        raise error(f"cannot write {dst}: {exc.strerror or exc}") from None


def _check_destination(
    dst: Path,
    overwrite: bool,
    is_ours: Callable[[Path], bool],
    sources: Sequence[Path],
    what: str,
    error: type[MoEServeError],
) -> None:
    target = dst.resolve()
    for src in sources:
        src = src.resolve()
        if target == src or target in src.parents:
            raise error(f"{dst} holds the source {src}: writing it would delete the source; choose another DST")
        if src in target.parents:
            raise error(f"{dst} is inside the source {src}: the source is never changed; choose a DST outside it")
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise error(f"{dst} already exists (pass --overwrite to replace it)")
        if not dst.is_dir() or dst.is_symlink():
            raise error(f"{dst} is not a directory: --overwrite replaces only {what} directory; remove it yourself")
        if any(dst.iterdir()) and not is_ours(dst):
            raise error(
                f"{dst} is not {what} and not empty: --overwrite replaces only {what} (or an empty directory); "
                "choose another DST or remove it yourself"
            )
    parent = _existing_ancestor(target)
    if not parent.is_dir():
        raise error(f"cannot write {dst}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"cannot write {dst}: {parent} is not writable")


def _existing_ancestor(path: Path) -> Path:
    for parent in path.parents:
        if parent.exists():
            return parent
    return Path("/")


@contextlib.contextmanager
def written_aside(dst: Path, error: type[MoEServeError]) -> Iterator[Path]:
    """A temp dir beside DST to write into; when the block ends without an exception it replaces DST (the old DST
    is moved aside first and removed last, so a kill at any point leaves the old DST or the new one); when it
    fails, or SIGTERM stops the process, nothing is left behind. The OS's errors become `error` naming DST."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_dirs(dst)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}{TEMP_MARK}{os.getpid()}-", dir=dst.parent))
    except OSError as exc:
        raise error(f"cannot write {dst}: {exc.strerror or exc}") from None
    try:
        with _sigterm_as_exit():
            yield tmp
            old = None
            if dst.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{dst.name}{TEMP_MARK}{os.getpid()}-", dir=dst.parent))
                os.replace(dst, old / dst.name)
            os.replace(tmp, dst)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise error(f"cannot write {dst}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temp_dirs(dst: Path) -> None:
    """Remove the temp dirs beside DST whose writer is no longer running (killed, so its cleanup never ran)."""
    for path in dst.parent.glob(f".{dst.name}{TEMP_MARK}*-*"):
        pid = path.name.removeprefix(f".{dst.name}{TEMP_MARK}").partition("-")[0]
        if pid.isdigit() and not _is_running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM (a `kill`, a container stopping) as SystemExit while the block runs, so that its cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
