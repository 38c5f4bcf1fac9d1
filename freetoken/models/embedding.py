"""The token embedding kept in its file's block type (a GGUF Q4_K / Q6_K / Q8_0 ... ``token_embd``): a lookup
dequantizes only the rows of the tokens it gathers, so the table costs the file's bytes in host memory instead of
4 bytes a weight (DeepSeek-V3's 129,280 x 7,168 table: 3.7 GB as float32, 0.5 GB as Q4_K)."""

from __future__ import annotations

import numpy as np

from freetoken.models.qmatrix import QuantizedMatrix


class BlockEmbedding:
    """``table[token_ids]`` -> float32 [T, hidden] from the rows of a :class:`QuantizedMatrix` [vocab, hidden]
    (exactly the values :meth:`QuantizedMatrix.dequantize` gives)."""

    dtype = np.dtype(np.float32)

    def __init__(self, matrix: QuantizedMatrix):
        self.matrix = matrix
        self.shape = matrix.shape

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, tokens) -> np.ndarray:
        rows = np.atleast_1d(np.asarray(tokens, np.int64))
        out = self.matrix.rows(rows).dequantize()
        return out if np.ndim(tokens) else out[0]

    def fingerprint_bytes(self) -> np.ndarray:
        """The table's stored bytes (what identifies it, without widening it)."""
        return self.matrix.blocks.reshape(-1)
