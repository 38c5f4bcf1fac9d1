"""llama.cpp (llama-cpp-python) as a logits oracle for the tests that compare with it on the same GGUF file."""

from __future__ import annotations

import numpy as np

from freetoken.testing.oracles import llama_cpp_without_repacking


def llama_logits(path, tokens, n_ctx: int = 64):
    """(float32 logits [T, vocab] of ``tokens`` evaluated by llama.cpp on ``path``, the ``Llama`` object), with
    llama.cpp's weight repacking off (:func:`llama_cpp_without_repacking`: it crashes on this project's test files
    on AVX-512 machines)."""
    import llama_cpp

    with llama_cpp_without_repacking():
        llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=n_ctx, n_threads=2, verbose=False)
    llm.eval(np.asarray(tokens).tolist())
    return np.array(llm.scores[: len(tokens)], np.float32), llm
