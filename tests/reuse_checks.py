"""What the prefix-reuse tests share: the logits a generate call's prefill gave, whatever it reused."""

from __future__ import annotations

from freetoken.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def prefill_logits(model, ids, **generate_kwargs):
    """``model.generate(ids, 1 token, **generate_kwargs)``; the logits of the prompt's last token, as the prefill
    of what was not reused computed them (the first ``decoder.forward`` of the call)."""
    seen = []
    forward = model.decoder.forward

    def spy(tokens, **kw):
        out = forward(tokens, **kw)
        seen.append(out)
        return out

    model.decoder.forward = spy
    try:
        list(model.generate(ids, max_tokens=1, sampling=GREEDY, **generate_kwargs))
    finally:
        del model.decoder.forward  # back to the class's method
    return seen[0][-1]
