"""One generation on a loaded model: :class:`.generate.Model` (prefill, decode, KV reuse for its own sequence),
sampling, output grammars, chat templates and the text of a token stream (stop strings)."""
