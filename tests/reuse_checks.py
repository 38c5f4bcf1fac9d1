"""What the prefix-reuse tests share: the logits a generate call's prefill gave, whatever it reused."""

from __future__ import annotations

from freetoken.engine.decoding.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def prefill_logits(model, ids, **generate_kwargs):
    """``model.generate(ids, 1 token, **generate_kwargs)``: (the logits of the prompt's last token, as the prefill
    of what was not reused computed them (the first forward pass of the call, a step of the model's step loop); the
    call's stats)."""
    seen = []
    forward_batch = model.decoder.forward_batch

    def spy(work):
        out = forward_batch(work)
        seen.append(out)
        return out

    model.decoder.forward_batch = spy
    try:
        gen = model.generate(ids, max_tokens=1, sampling=GREEDY, **generate_kwargs)
        list(gen)
    finally:
        del model.decoder.forward_batch  # back to the class's method
    return seen[0][-1], gen.stats


def assert_reuse_close(got, want) -> None:
    """Logits after a reused prefix against a fresh run's. The reused K/V rows were written by other passes (decode
    steps, other chunk boundaries): float32 rounding apart, which bf16 storage can turn into a neighbouring bf16
    value (2^-8 relative) for a few elements; through six layers that moves a logit by up to a few 1e-4 of the
    logits' scale (2.5e-4 seen with the bundled model; 5.6e-4 once its cpu experts took bf16 tokens, a second place
    where such a difference rounds to the next bf16 step). A wrong block moves them by the scale itself."""
    import numpy as np

    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1.5e-3 * float(np.abs(want).max()))


def _prefix_rows(model, n: int) -> list[dict]:
    """The K/V rows of the decoder sequence's first ``n`` positions, block by block (pool storage)."""
    bs, seq = model.decoder.pool.block_size, model.decoder.kv
    blocks = seq.blocks[:-(-n // bs)]
    return model.decoder.pool.read_rows(blocks, [min(bs, n - j * bs) for j in range(len(blocks))])


def assert_reused_exactly(model, ref, ids, got, n: int) -> None:
    """The logits ``got`` of a call that reused ``n`` prompt tokens, checked twice:

    1. the reused K/V rows are the rows a fresh prefill of those tokens writes, up to one rounding of the storage
       (they were written by other passes: decode steps, other chunk boundaries; rows of other tokens or positions
       differ by the values themselves);
    2. ``ref`` (same weights, never reusing), given those very rows and run on the rest of the prompt, gives
       ``got`` to float32 rounding: reuse changes nothing else.

    (A comparison with a fresh run alone must allow the rounding of (1) as amplified through the layers, which for
    the bundled model reaches ~2e-3 of the logits' scale in rare prompts.)"""
    import numpy as np

    ref.decoder.reset()
    if n:
        ref.decoder.forward(np.asarray(ids[:n], np.int64))
        mine, fresh = _prefix_rows(model, n), _prefix_rows(ref, n)
        for a, b in zip(mine, fresh, strict=True):
            for name in a:
                x, y = _as_float(a[name]), _as_float(b[name])
                np.testing.assert_allclose(x, y, rtol=2 ** -7, atol=1e-3 * float(np.abs(y).max()), err_msg=name)
        bs = ref.decoder.pool.block_size
        for j, rows in enumerate(mine):  # the reused rows in place of the fresh ones
            ref.decoder.pool.write_rows(ref.decoder.kv.blocks[j], rows)
        assert ref.decoder.length == n and j == (n - 1) // bs
    want = ref.decoder.forward(np.asarray(ids[n:], np.int64), last_only=True)[-1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def _as_float(stored):
    """Pool storage as float32: bf16 bits (uint16) widened, float kinds as they are."""
    import numpy as np

    if stored.dtype == np.uint16:
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32)
