"""Running a loaded model: load (files -> options -> decoder + expert runner, kernels warmed), the expert runners
(:mod:`freetoken.engine.experts`), sampling, generation and chat."""
