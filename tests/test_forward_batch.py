"""One forward pass over several sequences (``MoeDecoder.forward_batch``) gives each sequence the logits it gets alone.

Three sequences of different prompt lengths, one joining while the others decode (a step that mixes a prompt with
decode tokens, as the continuous-batching scheduler builds them), then decode steps together; each item's logits
are compared with the same sequence run alone through ``forward``. The families cover every token mixer a batch
splits per sequence: attention with q/k norms (qwen3_moe), sliding windows and sinks (gpt_oss), latent attention
(deepseek_v3), Gated DeltaNet states (qwen3_next).
"""

import json

import numpy as np
import pytest
from tiny_models import make_checkpoint

from freetoken.engine.loading.build import build_decoder
from freetoken.engine.options import ExpertOptions, LoadOptions
from freetoken.models import from_hf
from freetoken.models.decoder import ContextExceeded

FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next")
PROMPTS = (9, 4, 6)  # prompt lengths; the third joins at the second step
STEPS = 4
#: float32 rounding between a product over the batch's rows and the same row alone: measured largest 1.3e-11 over
#: these families on cpu and emu
NMSE = 1e-9


def _nmse(got, want):
    return float(((got - want) ** 2).sum() / max((want**2).sum(), 1e-30))


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    from safetensors.numpy import load_file

    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    return path, load_file(str(path / "model.safetensors"))


def _decoder(checkpoint, device):
    """The tiny decoder with the CPU experts' float path: batched and alone then differ by float32 rounding only. The
    reduced paths (8-bit blocks, or bf16 tokens for these bf16 experts, the default with AVX2 or AVX-512) round each
    value at boundaries that a last-bit difference in a projection can cross (measured: NMSE 2.1e-6 batched against
    alone on qwen3_next with bf16 tokens), which says nothing about the batching."""
    path, tensors = checkpoint
    cfg = from_hf(json.loads((path / "config.json").read_text()))
    slots = 2 * cfg.num_experts + 4 if device.kind == "emu" else None
    experts = ExpertOptions(cache_slots=slots, cpu_activations="f32")
    return build_decoder(cfg, lambda name: tensors[name], device,
                         LoadOptions(ctx=48, kv_dtype="f32", kv_memory=1 << 22, experts=experts))


def _alone(dec, prompt, forced):
    """The logits of ``prompt``'s last token, then of each of ``forced`` fed one at a time, on the decoder's own
    sequence."""
    dec.reset()
    out = [dec.forward(prompt, last_only=True)[0]]
    for t in forced:
        out.append(dec.forward([t])[0])
    dec.reset()
    return out


def test_batch_equals_alone(checkpoint, device):
    dec = _decoder(checkpoint, device)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 128, n) for n in PROMPTS]
    forced = [rng.integers(0, 128, STEPS) for _ in PROMPTS]  # the decode tokens, the same alone and batched
    want = [_alone(dec, p, f) for p, f in zip(prompts, forced, strict=True)]
    free = dec.pool.free_blocks
    seqs = [dec.new_sequence() for _ in PROMPTS]
    got = [[] for _ in PROMPTS]
    fed = [0] * len(PROMPTS)  # decode tokens each sequence has taken
    for step in range(STEPS + 2):
        work, who = [], []
        for i, seq in enumerate(seqs):
            joins = 0 if i < 2 else 1  # the third sequence's prompt arrives at step 1, beside two decode tokens
            if step == joins:
                work.append((seq, prompts[i]))
            elif step > joins and fed[i] < STEPS:
                work.append((seq, [forced[i][fed[i]]]))
                fed[i] += 1
            else:
                continue
            who.append(i)
        if not work:
            break
        logits = dec.forward_batch(work)
        assert logits.shape == (len(work), dec.cfg.vocab_size)
        for row, i in enumerate(who):
            got[i].append(logits[row])
    for i in range(len(PROMPTS)):
        assert len(got[i]) == STEPS + 1
        assert seqs[i].length == PROMPTS[i] + STEPS
        for step, (g, w) in enumerate(zip(got[i], want[i], strict=True)):
            assert _nmse(g, w) < NMSE, (i, step, _nmse(g, w))
            assert int(np.argmax(g)) == int(np.argmax(w)), (i, step)
    for seq in seqs:
        seq.reset()
    assert dec.pool.free_blocks == free  # every block of the batch went back


def test_batch_refuses_before_work(checkpoint):
    from freetoken.device import get_device

    dec = _decoder(checkpoint, get_device("cpu"))
    a, b = dec.new_sequence(), dec.new_sequence(ctx=8)
    with pytest.raises(ContextExceeded, match="context of 8"):
        dec.forward_batch([(a, [1, 2, 3]), (b, list(range(9)))])
    assert a.length == 0 and b.length == 0 and not a.kv.blocks  # nothing ran, nothing allocated
    with pytest.raises(ValueError, match="two items"):
        dec.forward_batch([(a, [1]), (a, [2])])
    with pytest.raises(ValueError, match="at least one token"):
        dec.forward_batch([(a, [])])
    with pytest.raises(ValueError, match="token ids"):
        dec.forward_batch([(a, [10**6])])
    with pytest.raises(ValueError, match="context is 48"):
        dec.new_sequence(ctx=49)
