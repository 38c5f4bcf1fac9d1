"""The generation front on a loaded model: :class:`.generate.Model` (a client of the step loop for its own
sequence, with KV reuse from request to request), chat templates (:mod:`.chat`) and perplexity."""
