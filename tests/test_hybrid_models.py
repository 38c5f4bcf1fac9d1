"""Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet linear-attention layers mixed with gated full attention.

Against transformers with the experts rounded to bf16 in the oracle too, so that the only differences left are
float32 rounding: prompts longer than one prefill chunk, decode through the recurrent state, a small expert cache
on emu. Then what a recurrent state changes for the engine: a chunked prompt equals the token-by-token recurrence,
resuming from a state snapshot equals recomputing, rollback is refused where no state was kept, replaced
sequences resume from the state cache, anchors keep the states,
and the checkpoint layouts the releases use (fused experts, the image-text wrapper) load.
"""

import json

import numpy as np
import pytest
from tiny_models import FAMILIES, make_checkpoint

from freetoken.engine.decoding.sampling import SamplingParams
from freetoken.engine.generation.generate import Model
from freetoken.engine.loading.build import build_decoder
from freetoken.engine.options import ExpertOptions, LoadOptions
from freetoken.models import from_hf
from freetoken.testing.oracles import need

HYBRID = ("qwen3_next", "qwen3_5_moe")
PROMPT, STEPS = 20, 8


def _nmse(got, want):
    return float(((got - want) ** 2).sum() / (want**2).sum())


@pytest.fixture(scope="module", params=HYBRID)
def hybrid(request, tmp_path_factory):
    """(family, checkpoint dir, tokens, transformers' logits with bf16-rounded experts, HF safetensors dict)."""
    torch = need("torch")
    from safetensors.numpy import load_file

    path = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(request.param, path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:  # what the bf16 expert banks hold: the oracle computes with the same values
                p.copy_(p.to(torch.bfloat16).float())
        tokens = torch.randint(0, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
        want = model(tokens).logits[0].float().numpy()
    return request.param, path, tokens[0].numpy(), want, load_file(str(path / "model.safetensors"))


def _decoder(hybrid, device, ctx=64, **options):
    """The hybrid's decoder; the CPU experts' float path unless ``experts`` says otherwise (on the cpu device these
    tests check the model's arithmetic to float32 rounding, which the reduced paths' bf16 or 8-bit tokens are not:
    tests/test_model_parity.py bounds the default path)."""
    family, path, _, _, tensors = hybrid
    options.setdefault("experts", ExpertOptions(cpu_activations="f32"))
    cfg = from_hf(json.loads((path / "config.json").read_text()))
    assert cfg.family == family and {"linear_attention", "full_attention"} <= set(cfg.layer_types)
    return build_decoder(cfg, lambda name: tensors[name], device, LoadOptions(ctx=ctx, kv_dtype="f32", **options))


def test_matches_transformers(hybrid, device):
    """A prompt in chunks of 7 (the states carry across chunks), then decode steps; on emu 18 expert slots for 8
    experts x 4 layers, so experts are copied in and evicted."""
    _, _, tokens, want, _ = hybrid
    experts = ExpertOptions(cache_slots=18 if device.kind == "emu" else None, cpu_activations="f32")
    dec = _decoder(hybrid, device, prefill_chunk=7, experts=experts)
    got = np.concatenate([dec.forward(tokens[:PROMPT])] +
                         [dec.forward(tokens[PROMPT + t:PROMPT + t + 1]) for t in range(STEPS)])
    prompt, decode = _nmse(got[:PROMPT], want[:PROMPT]), _nmse(got[PROMPT:], want[PROMPT:])
    # measured on cpu: 4e-12 / 4e-12 (float32 rounding only); emu's tensor-core prefill takes bf16 inputs
    bound = 1e-9 if device.kind == "cpu" else 5e-5
    assert prompt < bound and decode < bound, (prompt, decode)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_chunked_prompt_equals_token_by_token(hybrid, device):
    _, _, tokens, _, _ = hybrid
    dec = _decoder(hybrid, device)
    whole = dec.forward(tokens)
    dec.reset()
    steps = np.concatenate([dec.forward(tokens[i:i + 1]) for i in range(len(tokens))])
    if device.kind == "cpu":
        np.testing.assert_allclose(steps, whole, rtol=0, atol=2e-4 * float(np.abs(whole).max()))
    else:  # emu's prompt path rounds the dense and expert inputs to bf16 for the tensor cores, decode does not
        assert _nmse(steps, whole) < 5e-5


def test_long_prompt_takes_the_chunked_rule(hybrid, device, monkeypatch):
    """A prompt of 150 tokens on gpu/emu: the Gated DeltaNet layers run the rule's chunked form (two whole chunks
    and a partial one); the logits, and the decode steps after it (from the state the chunked form left), equal a run
    with the recurrent kernel forced. (Against cpu the emu prompt path differs by its bf16 tensor-core inputs, which
    this tiny Qwen3-Next's state amplifies to 1e-2 NMSE by token 150 with either kernel: measured, both ways.)"""
    import freetoken.ops.linear_attention as linear_attention

    if device.kind == "cpu":
        pytest.skip("the cpu device runs the recurrence at every length")
    ids = np.random.default_rng(3).integers(0, 128, 154)
    assert 150 > 2 * linear_attention.LINEAR_CHUNKED_MIN_TOKENS

    def run():
        dec = _decoder(hybrid, device, ctx=256)
        return np.concatenate([dec.forward(ids[:150])] + [dec.forward(ids[i:i + 1]) for i in range(150, 154)])

    chunked = run()
    monkeypatch.setattr(linear_attention, "LINEAR_CHUNKED_MIN_TOKENS", 1 << 30)
    recurrent = run()
    # the two forms sum in other orders (1e-7 of the outputs apart, the registry's cases); the next layer's bf16
    # tensor-core inputs can round that differently, and this Qwen3-Next amplifies it: measured 9e-8 and 1.6e-6
    err = _nmse(chunked, recurrent)
    assert err < 1e-5, err


def test_resume_from_snapshot_equals_recompute(hybrid, device):
    """A second prompt that extends the first resumes from the state kept at the first prompt's end (not from the
    longer sequence decode left behind, which the new prompt does not repeat), and its tokens equal a fresh run."""
    _, _, tokens, _, _ = hybrid
    greedy = SamplingParams(temperature=0)
    model = Model(_decoder(hybrid, device))
    first = tokens[:12].tolist()
    list(model.generate(first, max_tokens=5, sampling=greedy, reuse_cache=True))
    second = first + [int(t) for t in tokens[12:20]]  # not the generated tokens: the decode states do not apply
    got = list(gen := model.generate(second, max_tokens=6, sampling=greedy, reuse_cache=True))
    assert gen.stats.cached_tokens == len(first) and gen.stats.prompt_tokens == len(second) - len(first)
    fresh = Model(_decoder(hybrid, device))
    assert got == list(fresh.generate(second, max_tokens=6, sampling=greedy))
    # the same prompt again: everything but its last token resumes (the snapshot at the prompt's end is one token
    # too long, so the state at the first prompt's end serves)
    again = list(gen := model.generate(second, max_tokens=6, sampling=greedy, reuse_cache=True))
    assert again == got and gen.stats.cached_tokens == len(first)


def test_rollback_drops_later_snapshots(hybrid):
    """Resuming at an earlier length forgets the snapshots after it: they hold tokens the new sequence replaces, so a
    later prompt that matches the new sequence that far must not resume from them."""
    from freetoken.device import get_device

    _, _, tokens, _, _ = hybrid
    greedy = SamplingParams(temperature=0)
    model = Model(_decoder(hybrid, get_device("cpu")))
    p, x, y = tokens[:12].tolist(), tokens[12:20].tolist(), [(t + 3) % 128 for t in tokens[12:20]]
    for prompt in (p, p + x, p + y + tokens[20:24].tolist()):
        list(model.generate(prompt, max_tokens=2, sampling=greedy, reuse_cache=True))
    assert 20 not in model.decoder.resume_points()  # p + x's state at 20 went with the rollback to 12
    last = p + y + tokens[24:28].tolist()
    got = list(gen := model.generate(last, max_tokens=4, sampling=greedy, reuse_cache=True))
    assert gen.stats.cached_tokens == 12
    assert got == list(Model(_decoder(hybrid, get_device("cpu"))).generate(last, max_tokens=4, sampling=greedy))


def test_long_prompt_keeps_periodic_states(hybrid):
    """A prompt of several chunks leaves a state every snapshot_every tokens (the step loop ends a chunk at each
    multiple); a later prompt that departs from it midway resumes from the last one before it. Periodic snapshots go
    first when the budget is full."""
    from freetoken.device import get_device

    _, _, tokens, _, _ = hybrid
    greedy = SamplingParams(temperature=0)
    dec = _decoder(hybrid, get_device("cpu"), prefill_chunk=3)
    dec.snapshot_every = 8
    model = Model(dec)
    ids = tokens[:22].tolist()
    list(model.generate(ids, max_tokens=1, sampling=greedy, reuse_cache=True))
    assert dec.resume_points() == [0, 8, 16, 22]  # chunks 0-3, 3-6, 6-8, 8-11, ..., 14-16, 16-19, 19-22
    other = ids[:17] + [(t + 5) % 128 for t in ids[17:]]
    got = list(gen := model.generate(other, max_tokens=3, sampling=greedy, reuse_cache=True))
    assert gen.stats.cached_tokens == 16
    assert got == list(Model(_decoder(hybrid, get_device("cpu"))).generate(other, max_tokens=3, sampling=greedy))
    dec.max_snapshots = 2
    dec.reset()
    list(model.generate(ids, max_tokens=1, sampling=greedy))
    assert dec.resume_points() == [0, 16, 22]  # 8 dropped first, the prompt's end kept


def test_message_boundaries_keep_states(hybrid):
    """generate(boundaries=...) keeps the states at each boundary, so a later prompt that shares only the first
    message resumes there."""
    from freetoken.device import get_device

    _, _, tokens, _, _ = hybrid
    greedy = SamplingParams(temperature=0)
    model = Model(_decoder(hybrid, get_device("cpu")))
    ids = tokens[:24].tolist()
    list(model.generate(ids, max_tokens=2, sampling=greedy, reuse_cache=True, boundaries=[10, 18]))
    assert {10, 18, 24} <= set(model.decoder.resume_points())
    other = ids[:10] + [(t + 1) % 128 for t in ids[10:16]]
    got = list(gen := model.generate(other, max_tokens=4, sampling=greedy, reuse_cache=True))
    assert gen.stats.cached_tokens == 10
    assert got == list(Model(_decoder(hybrid, get_device("cpu"))).generate(other, max_tokens=4, sampling=greedy))


def test_rollback_needs_a_kept_state(hybrid):
    from freetoken.device import get_device

    _, _, tokens, _, _ = hybrid
    dec = _decoder(hybrid, get_device("cpu"))
    dec.forward(tokens[:10])
    dec.forward(tokens[10:11])
    assert dec.resume_points() == [0, 10, 11]
    with pytest.raises(ValueError, match="state at 5 tokens is not kept"):
        dec.length = 5
    dec.length = 10
    assert dec.length == 10 and dec.kv.length == 10
    dec.length = 0
    assert dec.length == 0 and not np.asarray(dec.states[0].rec).any()


def _fresh(hybrid, ids, n=4):
    from freetoken.device import get_device

    return list(Model(_decoder(hybrid, get_device("cpu"))).generate(ids, max_tokens=n,
                                                                    sampling=SamplingParams(temperature=0)))


def test_replaced_sequences_resume_from_the_state_cache(hybrid):
    """Two conversations in turn: each return to the first resumes from the states its sequence left in the state
    cache (with its KV rows from the radix prefix cache), and generates what a fresh run does."""
    from freetoken.device import get_device

    _, _, tokens, _, _ = hybrid
    greedy = SamplingParams(temperature=0)
    model = Model(_decoder(hybrid, get_device("cpu"), ctx=256))  # room for the sequences the caches keep
    a, b = tokens[:14].tolist(), [(t + 7) % 128 for t in tokens[:12]]
    list(model.generate(a, max_tokens=3, sampling=greedy, reuse_cache=True, boundaries=[9]))
    list(gen := model.generate(b, max_tokens=3, sampling=greedy, reuse_cache=True))  # replaces a's sequence
    assert gen.stats.cached_tokens == 0 and {9, 14} <= set(model.state_cache.lengths())
    longer = a + [5, 6, 7]
    got = list(gen := model.generate(longer, max_tokens=4, sampling=greedy, reuse_cache=True))
    assert gen.stats.cached_tokens == 14  # a's prompt end: not the decoder's own sequence any more
    assert got == _fresh(hybrid, longer)
    branch = a[:9] + [1, 2, 3]
    got = list(gen := model.generate(branch, max_tokens=4, sampling=greedy, reuse_cache=True))
    assert gen.stats.cached_tokens == 9 and got == _fresh(hybrid, branch)  # the boundary's state
    model.state_cache.clear()
    model.prefix_cache.clear()
    list(model.generate(b, max_tokens=1, sampling=greedy, reuse_cache=True))
    list(gen := model.generate(longer, max_tokens=1, sampling=greedy, reuse_cache=True))
    assert gen.stats.cached_tokens == 0  # nothing kept: recomputed


def test_state_cache_needs_the_kv_rows_too(hybrid):
    """A state whose KV blocks the radix cache has let go of is not used (the full-attention layers need them)."""
    from freetoken.device import get_device

    _, _, tokens, _, _ = hybrid
    greedy = SamplingParams(temperature=0)
    model = Model(_decoder(hybrid, get_device("cpu"), ctx=256))
    a = tokens[:14].tolist()
    list(model.generate(a, max_tokens=1, sampling=greedy, reuse_cache=True))
    list(model.generate([3] * 12, max_tokens=1, sampling=greedy, reuse_cache=True))
    model.prefix_cache.clear()
    list(gen := model.generate(a + [4], max_tokens=1, sampling=greedy, reuse_cache=True))
    assert gen.stats.cached_tokens == 0 and 14 in model.state_cache.lengths()


def test_anchors_keep_the_states(hybrid, tmp_path):
    """Anchors of a hybrid model carry the linear-attention states: a rollback, a request naming the anchor and a
    restarted store (read from disk) all resume at the anchor and generate what a fresh run does; a damaged state
    file refuses the anchor, which is then recomputed."""
    from freetoken.device import get_device

    _, _, tokens, _, _ = hybrid
    greedy = SamplingParams(temperature=0)
    model = Model(_decoder(hybrid, get_device("cpu"), ctx=256))
    model.use_anchor_dir(tmp_path)
    ids = tokens[:16].tolist()
    list(gen := model.generate(ids, max_tokens=2, sampling=greedy, boundaries=[11, 16]))
    made = gen.stats.anchors_made
    assert len(made) == 2 and all(model.anchors.get(m).info()["linear_states"] for m in made)
    with pytest.raises(ValueError, match="state at 5 tokens is not kept"):
        model.anchor(5)
    assert model.rollback(made[0]) == 11 and model.decoder.length == 11
    later = ids[:11] + [9, 8, 7]
    assert list(gen := model.generate(later, max_tokens=4, sampling=greedy, reuse_cache=True)) == _fresh(hybrid, later)
    assert gen.stats.cached_tokens == 11
    list(model.generate([2] * 9, max_tokens=1, sampling=greedy))  # another sequence in between
    longer = ids + [1, 2]
    assert list(gen := model.generate(longer, max_tokens=4, sampling=greedy, anchor=made[1])) == _fresh(hybrid, longer)
    assert gen.stats.anchor == made[1] and gen.stats.cached_tokens == 16

    restarted = Model(_decoder(hybrid, get_device("cpu"), ctx=256))
    restarted.use_anchor_dir(tmp_path)
    assert restarted.anchors.get(made[1]).tier == "disk"
    gen = restarted.generate(longer, max_tokens=4, sampling=greedy, anchor=made[1])
    assert list(gen) == _fresh(hybrid, longer)
    assert gen.stats.cached_tokens == 16 and gen.stats.anchor_refused is None

    state_file = next((tmp_path / "blocks").glob("*.lss"))
    raw = bytearray(state_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state_file.write_bytes(bytes(raw))
    damaged = Model(_decoder(hybrid, get_device("cpu"), ctx=256))
    damaged.use_anchor_dir(tmp_path)
    aid = next(a.id for a in damaged.anchors.list() if damaged.anchors.get(a.id).state_sum ==
               state_file.stem)
    n = len(damaged.anchors.get(aid).tokens)
    got = list(gen := damaged.generate(ids[:n] + [1], max_tokens=2, sampling=greedy, anchor=aid))
    assert gen.stats.cached_tokens == 0 and "linear-attention states" in gen.stats.anchor_refused
    assert got == _fresh(hybrid, ids[:n] + [1], 2) and damaged.anchors.get(aid) is None


@pytest.mark.parametrize("on_disk", [True, False])
def test_anchor_states_count_against_host_memory(hybrid, tmp_path, on_disk):
    """An anchor's linear-attention states are host memory: past ``host_bytes`` the least recently used anchor
    leaves the device for its files (then restores from them) or, without a directory, is deleted."""
    from freetoken.device import get_device

    _, _, tokens, _, _ = hybrid
    greedy = SamplingParams(temperature=0)
    model = Model(_decoder(hybrid, get_device("cpu"), ctx=256))
    store = model.use_anchor_dir(tmp_path if on_disk else None, host_bytes=model.decoder.state_bytes() * 3 // 2)
    ids = tokens[:14].tolist()
    list(gen := model.generate(ids, max_tokens=1, sampling=greedy, boundaries=[8, 14]))
    first, second = gen.stats.anchors_made
    assert store.get(second).tier == "device" and store.host_bytes_held() <= store.host_bytes
    if not on_disk:
        assert store.get(first) is None
        return
    assert store.get(first).tier == "disk"
    later = ids[:8] + [5, 6]
    assert list(gen := model.generate(later, max_tokens=3, sampling=greedy, anchor=first)) == _fresh(hybrid, later, 3)
    assert gen.stats.anchor == first and gen.stats.cached_tokens == 8


def test_state_bytes(hybrid):
    from freetoken.device import get_device

    family, _, _, _, _ = hybrid
    dec = _decoder(hybrid, get_device("cpu"))
    cfg = dec.cfg
    per_layer = 4 * ((cfg.linear_conv - 1) * cfg.linear_conv_dim
                     + cfg.linear_v_heads * cfg.linear_k_dim * cfg.linear_v_dim)
    linear = cfg.layer_types.count("linear_attention")
    assert dec.state_bytes() == linear * per_layer
    assert dec.pool.num_layers == cfg.num_layers - linear  # KV rows for the full-attention layers only
    from freetoken.engine.loading.memory_report import memory_breakdown, memory_line

    model = Model(dec)
    list(model.generate(list(range(5, 17)), max_tokens=2, sampling=SamplingParams(temperature=0)))
    assert dec.kept_snapshots == 1  # the prompt's end
    # the sequences' pools (every slot, taken or free) and the current sequence's one snapshot
    slots = dec.state_slots.capacity
    assert slots >= 1 and dec.state_slots.nbytes == slots * linear * per_layer
    assert memory_breakdown(model)["linear-attention states"] == (slots + 1) * linear * per_layer
    assert ", linear-attention states " in memory_line(model)


def _release_layout(src, dst, tensors):
    """The tiny Qwen3.5 checkpoint as the releases store it: the image-text wrapper's config (text_config), the
    language model under model.language_model., experts fused into gate_up_proj / down_proj, a vision tower and
    multi-token-prediction tensors that are never read."""
    from safetensors.numpy import save_file

    cfg = json.loads((src / "config.json").read_text())
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    text["model_type"] = "qwen3_5_moe_text"
    wrapper = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(wrapper))
    out = {}
    e = cfg["num_experts"]
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate = np.stack([tensors[f"{p}{j}.gate_proj.weight"] for j in range(e)])
        up = np.stack([tensors[f"{p}{j}.up_proj.weight"] for j in range(e)])
        q = f"model.language_model.layers.{i}.mlp.experts."
        out[q + "gate_up_proj"] = np.ascontiguousarray(np.concatenate([gate, up], axis=1))
        out[q + "down_proj"] = np.stack([tensors[f"{p}{j}.down_proj.weight"] for j in range(e)])
    out["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((6, 2), np.float32)
    out["mtp.layers.0.mlp.gate.weight"] = np.zeros((2, 2), np.float32)
    save_file(out, str(dst / "model.safetensors"))


def test_release_layout_loads(tmp_path):
    from freetoken.engine.loading.load import load

    need("torch")
    src = tmp_path / "hf"
    make_checkpoint("qwen3_5_moe", src)
    from safetensors.numpy import load_file

    _release_layout(src, tmp_path / "release", load_file(str(src / "model.safetensors")))
    tokens = np.arange(3, 19)
    want = load(src, device="cpu").logits(tokens)
    got = load(tmp_path / "release", device="cpu").logits(tokens)
    np.testing.assert_array_equal(got, want)


def test_hybrid_config_refusals():
    from freetoken.models import ConfigError

    base = dict(model_type="qwen3_5_moe_text", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                vocab_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16)
    assert from_hf(base).layer_types == ("linear_attention",) * 3 + ("full_attention",)
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        from_hf({**base, "linear_num_value_heads": 0})
    with pytest.raises(ConfigError, match="multiple of 3 key heads"):
        from_hf({**base, "linear_num_key_heads": 3})
    with pytest.raises(ConfigError, match="layer_types"):
        from_hf({**base, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ConfigError, match="at least one full_attention"):
        from_hf({**base, "layer_types": ["linear_attention"] * 4})
    with pytest.raises(ConfigError, match="linear attention head dims 512"):
        from_hf({**base, "linear_key_head_dim": 512})
    with pytest.raises(ConfigError, match="attention_bias"):
        from_hf({**base, "attention_bias": True})
    assert set(HYBRID) <= set(FAMILIES)
