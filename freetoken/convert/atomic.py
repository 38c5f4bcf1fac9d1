"""Output files that appear only when complete: written under temporary names beside the target, fsynced, then
renamed into place; an error, an interrupt or SIGTERM removes the temporary files. SIGKILL cannot be caught: the
temporary names carry the writer's pid, and the next write to the same target removes the files of writers that
are gone (:func:`remove_stale_partials`).

A set of files (a sharded FTW model) is written the same way as a whole (:func:`atomic_set`): every file under a
temporary name until all are complete, then renamed, the first file last."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def partial_name(out: Path, pid: int, number: int | None = None) -> Path:
    """The temporary name of ``out`` (or of the ``number``-th file of the set written as ``out``)."""
    if number is None:
        return out.with_name(f".{out.name}.partial-{pid}")
    return out.with_name(f".{out.name}.shard-{number:05d}.partial-{pid}")


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete the temporary files that killed earlier writes to ``out`` left (their process is gone)."""
    removed = []
    for pattern in (f".{out.name}.partial-*", f".{out.name}.shard-*.partial-*"):
        for p in out.parent.glob(pattern):
            pid = p.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
                continue  # a live writer's file
            except ProcessLookupError:
                pass
            except PermissionError:
                continue  # another user's live process
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    return removed


def sigterm_as_exit():
    """While a file is written, SIGTERM raises SystemExit so the ``finally`` that removes the temporary file runs
    (the main thread only). Returns the function that restores the previous handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    return lambda: signal.signal(signal.SIGTERM, previous)


class PartialSet:
    """The temporary files of one write, and the names they take once complete (set by the writer when it knows
    them: a sharded set's names hold its shard count)."""

    def __init__(self, out: Path):
        self.out = out
        self.temps: list[Path] = []
        self.targets: list[Path] | None = None

    def new(self, numbered: bool = True) -> Path:
        """The temporary name of the next file."""
        tmp = partial_name(self.out, os.getpid(), len(self.temps) + 1 if numbered else None)
        self.temps.append(tmp)
        return tmp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_set(out: Path, fsync: bool = True) -> Iterator[PartialSet]:
    """Yield a :class:`PartialSet` to write files through (``files.new()`` for each; ``files.targets`` set before
    the block ends, one per file, in order); when the block ends without an error, fsync every file and rename
    each to its target, the first last (a reader opens a set by its first file, so that appears only once the
    others are in place), then fsync the directory. An error, SIGTERM included, at any point removes every
    temporary file and whatever was already renamed."""
    out = Path(out)
    if not out.parent.is_dir():
        raise ValueError(f"{out}: the directory {out.parent} does not exist")
    remove_stale_partials(out)
    files = PartialSet(out)
    restore = sigterm_as_exit()
    renamed: list[Path] = []
    try:
        yield files
        if files.targets is None or len(files.targets) != len(files.temps):
            raise RuntimeError(f"{out}: {len(files.temps)} files written, targets {files.targets}")
        if fsync:
            for tmp in files.temps:
                _fsync(tmp)
        for tmp, target in reversed(list(zip(files.temps, files.targets, strict=True))):
            os.replace(tmp, target)
            renamed.append(target)
        if fsync:
            with contextlib.suppress(OSError):  # some filesystems refuse to fsync a directory
                _fsync(out.parent)
    except BaseException:
        for p in renamed:  # a set that is not whole is no set: take back what was renamed
            with contextlib.suppress(OSError):
                p.unlink()
        raise
    finally:
        restore()
        for tmp in files.temps:
            if tmp.exists():
                tmp.unlink()


@contextlib.contextmanager
def atomic_output(out: Path, fsync: bool = True) -> Iterator[Path]:
    """Yield the temporary path to write ``out`` through; when the block ends without an error, fsync it and
    rename it over ``out`` (then fsync the directory, so the rename survives a crash)."""
    with atomic_set(out, fsync) as files:
        tmp = files.new(numbered=False)
        files.targets = [Path(out)]
        yield tmp
