"""llama.cpp (llama-cpp-python) as a logits oracle for the tests that compare with it on the same GGUF file."""

from __future__ import annotations

import numpy as np


def llama_logits(path, tokens, n_ctx: int = 64):
    """(float32 logits [T, vocab] of ``tokens`` evaluated by llama.cpp on ``path``, the ``Llama`` object).

    llama.cpp's weight repacking (the CPU backend's extra buffer types) is off: llama-cpp-python 0.3.36 on AVX-512
    machines aborts in its scheduler (``GGML_ASSERT(*cur_backend_id != -1)``, ggml-backend.cpp) on the deepseek2
    graph with repacked Q4_0 experts, and crashes (SIGSEGV) on Q4_K_M files with repacked k-quants, killing the
    test process; the values it computes do not depend on the layout it keeps the weights in."""
    import llama_cpp

    lib = llama_cpp.llama_cpp
    defaults = lib.llama_model_default_params

    def no_repack():
        params = defaults()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = no_repack
    try:
        llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=n_ctx, n_threads=2, verbose=False)
    finally:
        lib.llama_model_default_params = defaults
    llm.eval(np.asarray(tokens).tolist())
    return np.array(llm.scores[: len(tokens)], np.float32), llm
