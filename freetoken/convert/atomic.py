"""Output files that appear only when complete: written under a temporary name beside the target, fsynced, then
renamed over it; an error, an interrupt or SIGTERM removes the temporary file. SIGKILL cannot be caught: the
temporary name carries the writer's pid, and the next write to the same target removes the files of writers that
are gone (:func:`remove_stale_partials`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def partial_name(out: Path, pid: int) -> Path:
    return out.with_name(f".{out.name}.partial-{pid}")


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete the temporary files that killed earlier writes to ``out`` left (their process is gone)."""
    removed = []
    for p in out.parent.glob(f".{out.name}.partial-*"):
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


@contextlib.contextmanager
def atomic_output(out: Path, fsync: bool = True) -> Iterator[Path]:
    """Yield the temporary path to write ``out`` through; when the block ends without an error, fsync it and
    rename it over ``out`` (then fsync the directory, so the rename survives a crash)."""
    out = Path(out)
    if not out.parent.is_dir():
        raise ValueError(f"{out}: the directory {out.parent} does not exist")
    remove_stale_partials(out)
    tmp = partial_name(out, os.getpid())
    restore = sigterm_as_exit()
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, out)
        if fsync:
            with contextlib.suppress(OSError):  # some filesystems refuse to fsync a directory
                fd = os.open(out.parent, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    finally:
        restore()
        if tmp.exists():
            tmp.unlink()
