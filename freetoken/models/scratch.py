"""Work buffers a forward pass reuses, so that a decode step allocates (almost) nothing between its kernels."""

from __future__ import annotations

import numpy as np


class Scratch:
    """Named device buffers, one per name, remade only when a pass needs another shape (a prompt after decode
    steps, the next decode step after a prompt): every decode step runs on the same arrays.

    The layers of a decoder run one after the other and a buffer's contents never outlive the block call that wrote
    them, so one Scratch serves all of a decoder's blocks. What a block returns to its caller beyond that call (the
    router's ids and weights, kept as the routing record; the logits) is never a scratch buffer."""

    def __init__(self, device):
        self.dev = device
        self._bufs: dict[str, object] = {}

    def get(self, name: str, shape: tuple, dtype=np.float32):
        b = self._bufs.get(name)
        if b is None or b.shape != shape or b.dtype != dtype:
            b = self._bufs[name] = self.dev.empty(shape, dtype)
        return b
