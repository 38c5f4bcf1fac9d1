"""Expert records read from an FTW file on demand (the host tier's file side, :mod:`freetoken.cache.host_tier`).

:class:`FTWRecordReader` reads a layer's records with ``pread`` on the file (each shard's), one call per run of
records that lie back to back in the file (the writer puts a layer's records in expert order, so a prefill's whole
layer is a few large reads), into a reused buffer, and checks each as :meth:`FTWFile.record_payload` does: the
header against the index, the header's checksum against the index's, and the xxh3-128 of the header and payload as
the file's ``verify`` says ("full": every read; "sample": the records :meth:`FTWFile.record_payload` samples;
"none"). A damaged record is the same :class:`LoadError`, naming the file (shard) and the record. Nothing is mapped:
the bytes read are the bytes counted.
"""

from __future__ import annotations

import os
import time

import numpy as np

from freetoken.loaders.errors import LoadError
from freetoken.loaders.ftw_file import ALIGN, RECORD_HEADER_BYTES, SAMPLE_EVERY, FTWFile, checksum, record_header

#: The longest single read: a run of adjacent records is split into reads of at most this many bytes (a record
#: larger than it is read whole).
MAX_READ = 64 << 20
_CHECKSUM_AT = 48  # the record header's checksum field (docs/ftw.md, "Expert records")


class FTWRecordReader:
    """Reads ``ftw``'s expert records into callers' memory; the callers number MoE layers 0 .. n - 1, which are the
    model's layers ``moe_layers`` (default: the same numbers). Counters: ``bytes_read``, ``seconds`` (in reads and
    checks), ``reads`` (system calls) and ``records``."""

    def __init__(self, ftw: FTWFile, moe_layers: list[int] | None = None):
        self.ftw = ftw
        self.moe_layers = list(moe_layers) if moe_layers is not None else None
        self._fds: dict[int, int] = {}
        self._buf = np.empty(0, np.uint8)
        self.bytes_read = 0
        self.seconds = 0.0
        self.reads = 0
        self.records = 0

    def _fd(self, shard: int, path) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise LoadError(str(path), f"cannot open the file to read expert records ({e.strerror or e})") \
                    from None
            self._fds[shard] = fd
        return fd

    def _pread(self, path, fd: int, offset: int, n: int) -> np.ndarray:
        if self._buf.size < n:
            self._buf = np.empty(n, np.uint8)
        view = memoryview(self._buf)[:n]
        got = 0
        while got < n:
            try:
                k = os.preadv(fd, [view[got:]], offset + got)
            except OSError as e:
                raise LoadError(str(path), f"reading {n} bytes at {offset}: {e.strerror or e}") from None
            if k <= 0:
                raise LoadError(str(path), f"the file ends before byte {offset + n} (truncated since it was opened?)")
            got += k
            self.reads += 1
        self.bytes_read += n
        return self._buf[:n]

    def read(self, layer: int, experts, sink) -> None:
        """Read the records of ``experts`` (expert ids) of MoE layer ``layer``, calling ``sink(expert, payload)``
        with each one's payload (uint8, valid only during the call) once it is checked."""
        t0 = time.perf_counter()
        layer = self.moe_layers[layer] if self.moe_layers is not None else int(layer)
        try:
            entries = sorted((self.ftw.records[(layer, int(e))] for e in experts), key=lambda r: (r.shard, r.offset))
            run: list = []
            for r in entries:
                if run and (r.shard != run[-1].shard or r.offset != run[-1].offset + -(-run[-1].nbytes // ALIGN) * ALIGN
                            or r.offset + r.nbytes - run[0].offset > MAX_READ):
                    self._read_run(layer, run, sink)
                    run = []
                run.append(r)
            if run:
                self._read_run(layer, run, sink)
        finally:
            self.seconds += time.perf_counter() - t0

    def _read_run(self, layer: int, run: list, sink) -> None:
        ftw = self.ftw
        path = ftw.file_of(run[0])
        fd = self._fd(run[0].shard, path)
        base = run[0].offset
        data = self._pread(path, fd, base, run[-1].offset + run[-1].nbytes - base)
        where = str(path)
        for r in run:
            rec = data[r.offset - base:r.offset - base + r.nbytes]
            head = bytes(rec[:RECORD_HEADER_BYTES])
            want = record_header(r.fmt, r.down_fmt, ftw.bias, layer, r.expert, r.nbytes - RECORD_HEADER_BYTES)
            if head[:_CHECKSUM_AT] != want:
                raise LoadError(where, f"{r.what}: its header does not match the index (damaged or misplaced)", r.what)
            if head[_CHECKSUM_AT:] != bytes.fromhex(r.xxh3):
                raise LoadError(where, f"{r.what}: the checksum in its header differs from the index's", r.what)
            payload = rec[RECORD_HEADER_BYTES:]
            # the sampled records are the ones FTWFile.record_payload samples
            sampled = (layer * 1_000_003 + r.expert) % SAMPLE_EVERY == 0
            if ftw.verify == "full" or (ftw.verify == "sample" and sampled):
                if checksum(head[:_CHECKSUM_AT], payload) != r.xxh3:
                    raise LoadError(where, f"{r.what}: checksum mismatch (the file is damaged)", r.what)
            self.records += 1
            sink(r.expert, payload)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass
