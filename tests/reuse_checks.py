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


def assert_reuse_close(got, want) -> None:
    """Logits after a reused prefix against a fresh run's. The reused K/V rows were written by other passes (decode
    steps, other chunk boundaries): float32 rounding apart, which bf16 storage can turn into a neighbouring bf16
    value (2^-8 relative) for a few elements; through six layers that moves a logit by up to a few 1e-4 of the
    logits' scale (2.5e-4 seen with the bundled model). A wrong block moves them by the scale itself."""
    import numpy as np

    np.testing.assert_allclose(got, want, rtol=1e-3, atol=5e-4 * float(np.abs(want).max()))
