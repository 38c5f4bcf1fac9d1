"""A model's fingerprint: what a saved KV state (an anchor) must match to be used with this model.

K/V rows are only meaningful to the very weights that computed them, so the fingerprint hashes (BLAKE3, 256 bits)
what tells two checkpoints apart without reading a whole multi-hundred-gigabyte file set:

* the parsed config (every field of :class:`freetoken.models.config.ModelConfig`) and the expert format;
* the embedding table's bytes (on the host; a fine-tune changes it, and it is at most a few GB, hashed once);
* for a model loaded from files, each weight file's name and size and 1 MiB samples from 16 places in it.

Two checkpoints that differ only in tensors the samples miss and with the same embedding would collide; that is
the price of not hashing every byte, and it is stated here rather than hidden.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

#: Samples taken from each weight file, and their size.
FILE_SAMPLES, SAMPLE_BYTES = 16, 1 << 20


def _file_digest(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size};".encode())
    with open(path, "rb") as f:
        for i in range(FILE_SAMPLES):
            f.seek(max(0, (size - SAMPLE_BYTES) * i // max(1, FILE_SAMPLES - 1)))
            h.update(f.read(SAMPLE_BYTES))


def model_fingerprint(cfg, embed: np.ndarray, expert_format: str, files: Iterable[str | os.PathLike] = ()) -> str:
    """Hex BLAKE3 of the config, the expert format, the embedding table and samples of ``files``."""
    import blake3

    h = blake3.blake3()
    fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))
    h.update(json.dumps(fields, sort_keys=True, default=repr).encode())
    h.update(f"experts:{expert_format};".encode())
    if hasattr(embed, "fingerprint_bytes"):  # a table kept in its file's blocks: its stored bytes
        h.update(f"embed:{embed.matrix.kind}:{embed.shape};".encode())
        h.update(embed.fingerprint_bytes())
    else:
        table = np.ascontiguousarray(embed)
        h.update(f"embed:{table.dtype}:{table.shape};".encode())
        h.update(table.view(np.uint8).reshape(-1))
    for f in sorted(Path(p) for p in files):
        _file_digest(h, f)
    return h.hexdigest()
