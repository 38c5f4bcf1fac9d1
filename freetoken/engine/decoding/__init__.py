"""One sequence's decoding, token by token: sampling (:mod:`.sampling`), output grammars (:mod:`.grammar`), the
text of a token stream with its stop strings (:mod:`.text_stream`), and what a generation returns
(:mod:`.stats`). The step loop (``batching``) and the generation front (``generation``) both build on it."""
