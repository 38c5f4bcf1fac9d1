"""The one error every loader raises for a bad checkpoint: :class:`LoadError`."""

from __future__ import annotations

import os


class LoadError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or not what the caller needs.

    The message always starts with the file (and, where one is involved, the tensor), e.g.
    ``/m/model-00002-of-00003.safetensors: tensor 'model.layers.3.mlp.gate.weight': expected shape [64, 2048],
    got [64, 1024]``. ``file`` and ``tensor`` are kept as attributes.
    """

    def __init__(self, file: str | os.PathLike, message: str, tensor: str | None = None):
        self.file = os.fspath(file)
        self.tensor = tensor
        self.detail = message
        where = self.file if tensor is None else f"{self.file}: tensor {tensor!r}"
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # picklable (multiprocessing, pytest-xdist) despite the custom __init__
        return (type(self), (self.file, self.detail, self.tensor))
