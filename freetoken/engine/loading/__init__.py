"""Loading: model files (HF safetensors, GGUF, FTW) -> load options -> the decoder and its expert runner, with the
context and KV pool sized from memory (:mod:`.context`), kernels warmed, as a
:class:`freetoken.engine.generation.generate.Model`."""
