"""The end-to-end half of the GPU check (``bench/gpu_check.py --model-check``): the runner on the device.

1. The bundled model's logits on the device against the cpu device (NMSE; a 32-token prompt then 8 decode steps
   through the KV cache) and greedy generation agreement.
2. Decode tokens/s on the device: all experts cached, then a small expert cache (misses copied in every step),
   in each --moe-mode (gpu, hybrid, cpu), with hit rates and what the oracle measured.
3. ``bench bw``'s two measurements at Qwen3-30B-A3B's record shape (q4_0): PCIe copy kernel and CPU executor.
4. With ``--synthetic FILE``: the same decode table on a synthetic Qwen3-MoE q4_0 GGUF
   (``bench/make_synthetic_gguf.py``), big enough that PCIe matters.

Prints one block of lines; returns the number of failed checks.
"""

from __future__ import annotations

import time

import numpy as np

# The device's prefill attention multiplies in bf16 on tensor cores (emu: the same data flow), the cpu device in
# float32: the bundled model's logits differ by 7.6e-5 NMSE on emu since its third context-extension stage (its
# activations grew; top-1 agreement stays 100%), 2.08e-4 since its tenth. tests/test_model_parity.py holds 5e-5 on
# small random checkpoints.
NMSE_BOUND = 5e-4


def _logits(model, tokens, prompt: int) -> np.ndarray:
    dec = model.decoder
    dec.reset()
    out = [dec.forward(tokens[:prompt])]
    out += [dec.forward(tokens[i:i + 1]) for i in range(prompt, tokens.size)]
    return np.concatenate(out)


def _decode_rate(model, prompt_ids, steps: int) -> float:
    from freetoken.engine.decoding.sampling import SamplingParams

    list(model.generate(prompt_ids, max_tokens=4, sampling=SamplingParams(temperature=0)))  # warm-up
    list(gen := model.generate(prompt_ids, max_tokens=steps, sampling=SamplingParams(temperature=0)))
    return gen.stats.decode_tps


def _decode_table(path, dev_kind: str, slots_list, steps: int, label: str) -> None:
    from freetoken.engine.loading.load import load
    prompt = list(np.random.default_rng(7).integers(2, 4000, 16))
    for slots in slots_list:
        for mode in ("gpu", "hybrid", "cpu"):
            model = load(path, device=dev_kind, cache_slots=slots, moe_mode=mode, ctx=256)
            rate = _decode_rate(model, prompt, steps)
            hit_rate, _, _ = model.experts.hit_stats()
            print(f"  {label:<10} slots {model.experts.cache.slots:>5}  {mode:<7} decode {rate:8.1f} tok/s  "
                  f"hit rate {hit_rate:6.1%}  [{model.experts.report()}]")
            model.experts.close()


def _anchor_check(model, ids: list[int]) -> int:
    """An anchor made on the device, spilled to (pinned) host memory, restored and verified: the logits after it
    equal a fresh prefill's. Returns 1 on failure."""
    from freetoken.engine.decoding.sampling import SamplingParams

    def last_logits(**kw):
        """(the prompt's last logits as the call's first forward pass (a step of the model's step loop) computed
        them, the call's stats)."""
        seen, forward_batch = [], model.decoder.forward_batch
        model.decoder.forward_batch = lambda work: seen.append(forward_batch(work)) or seen[-1]
        try:
            gen = model.generate(ids, max_tokens=1, sampling=SamplingParams(temperature=0), **kw)
            list(gen)
        finally:
            del model.decoder.forward_batch
        return seen[0][-1], gen.stats

    fresh, _ = last_logits()
    cut = len(ids) - 8
    list(gen := model.generate(ids, max_tokens=1, reuse_cache=True, boundaries=[cut]))
    anchor = model.anchors.get(gen.stats.anchors_made[0])
    model.anchors._to_host(anchor)
    model.prefix_cache.clear()
    model.decoder.reset()
    model.cached_ids = []
    t0 = time.perf_counter()
    got, st = last_logits(anchor=anchor.id)
    ms = (time.perf_counter() - t0) * 1e3
    # the last 8 tokens run as a pass of their own after the restore: bf16 tensor-core tiles of another shape than
    # the fresh 40-token pass's, so rounding apart (the NMSE bound of a chunked prefill, tests/test_kv_pool.py)
    nmse = float(((got - fresh) ** 2).sum() / (fresh ** 2).sum())
    ok = (st.anchor == anchor.id and st.cached_tokens == cut and nmse < 1e-5
          and got.argmax() == fresh.argmax())
    print(f"  anchor: {cut} tokens made on the device, spilled to host, restored and verified; logits NMSE "
          f"{nmse:.1e} (bound 1e-5), restore + 8-token prefill {ms:.1f} ms  {'ok' if ok else 'FAIL'}"
          + ("" if st.anchor else f" (refused: {st.anchor_refused})"))
    return 0 if ok else 1


def run(dev_kind: str, synthetic=None, steps: int = 32) -> int:
    from freetoken.engine.loading.load import load
    from freetoken.policy.measure import DEFAULT_SHAPE, layout_for, measure_cpu, measure_pcie
    from freetoken.policy.profile import recommend_mode

    failed = 0
    print("\nend to end: the bundled model on the device")
    ref = load(None, device="cpu", cpu_activations="f32")  # the float path: bf16 tokens would add their own rounding
    tokens = np.asarray(ref.encode("import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
                                   "description=__doc__)\n    parser.add_argument('--verbose')\n"))[:40]
    want = _logits(ref, tokens, tokens.size - 8)
    t0 = time.perf_counter()
    model = load(None, device=dev_kind)
    got = _logits(model, tokens, tokens.size - 8)
    nmse = float(((got - want) ** 2).sum() / (want**2).sum())
    top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
    status = "ok" if nmse < NMSE_BOUND and top1 >= 0.95 else "FAIL"
    failed += status != "ok"
    print(f"  logits vs cpu: NMSE {nmse:.2e} (bound {NMSE_BOUND:.0e}), top-1 agreement {top1:.1%}  {status}  "
          f"(load + {tokens.size} tokens: {time.perf_counter() - t0:.1f}s)")

    from freetoken.engine.decoding.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    a = list(ref.generate(tokens[:16].tolist(), max_tokens=24, sampling=greedy))
    b = list(model.generate(tokens[:16].tolist(), max_tokens=24, sampling=greedy))
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    print(f"  greedy generation: the first {agree} of {len(a)} tokens equal the cpu device's")
    failed += _anchor_check(model, tokens.tolist())

    print("\ndecode tokens/s by cache size and --moe-mode (bundled model, 96 expert records)")
    _decode_table(None, dev_kind, [None, 40], steps, "bundled")

    print("\nbench bw at Qwen3-30B-A3B's record shape (q4_0)")
    layout = layout_for("q4_0", *DEFAULT_SHAPE)
    from freetoken.device import get_device

    pcie = measure_pcie(get_device(dev_kind), layout, records=64 if dev_kind == "gpu" else 8)
    cpu = measure_cpu(layout)
    from freetoken.policy.profile import Profile

    mode = recommend_mode(Profile("", "", "q4_0", pcie, cpu, layout.record_bytes, 0.0))
    print(f"  PCIe copy kernel {pcie:.1f} GB/s, CPU executor {cpu:.1f} GB/s -> --moe-mode {mode}"
          + ("   [emu: a host memcpy]" if dev_kind == "emu" else ""))
    if synthetic is not None:
        print(f"\ndecode tokens/s on {synthetic}")
        _decode_table(synthetic, dev_kind, [None, 256], steps, "synthetic")
    return failed
