"""What the golden behaviour test compares: the bundled model's logits, greedy tokens and cache statistics per
device and expert mode, and the simulator's tables on a fixed synthetic trace.

``python tests/golden/behaviour.py`` rewrites the golden files from the code as it is; do that only when a change
of behaviour is intended, and say so in the commit: before it overwrites a model file it prints how the new run
compares with the old one (logits NMSE, greedy tokens that agree, decode routing that agrees), for the commit
message. ``--dry-run`` prints the comparison and writes nothing; names of model runs (``cpu``, ``emu_gpu_slots40``,
...) limit the rewrite to those runs.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description="
DECODE_TOKENS = 16
LOGIT_COLUMNS = 512  # the first columns of every prompt position's logits (enough to see any drift)

#: name -> (device, freetoken.load keywords)
#: The runs whose experts are computed on the CPU take its reduced path explicitly ("q8": for the bundled model's bf16
#: experts, bf16 tokens and bf16 dots): "auto" takes it where the CPU has vector code and the float path elsewhere,
#: and a golden file must hold on every machine (the portable code does the same arithmetic).
_CPU_EXPERTS = {"cpu_activations": "q8"}
MODEL_RUNS = {
    "cpu": ("cpu", _CPU_EXPERTS),
    "emu_gpu_slots40": ("emu", {"cache_slots": 40}),  # the default cache policy, next_use
    "emu_gpu_slots40_lru": ("emu", {"cache_slots": 40, "cache_policy": "lru"}),
    "emu_gpu_slots40_prefetch": ("emu", {"cache_slots": 40, "prefetch": True}),
    "emu_cpu_slots40": ("emu", {"cache_slots": 40, "moe_mode": "cpu", **_CPU_EXPERTS}),
    "emu_hybrid_slots40": ("emu", {"cache_slots": 40, "moe_mode": "hybrid", "pcie_gbps": 2.0, "cpu_gbps": 20.0,
                                   **_CPU_EXPERTS}),
}
#: runs whose split depends on timing measured while running (the hand-off): compared by tokens and logits only
TIMING_DEPENDENT = {"emu_hybrid_slots40"}

SYNTH = ["--layers", "4", "--experts", "16", "--top-k", "2", "--steps", "300", "--segments", "3", "--seed", "1",
         "--record-bytes", "262144"]
SIMULATIONS = {
    "policies": ["--slots", "12,24,40"],
    "policies_all_window": ["--slots", "16", "--window", "all", "--policies",
                            "lru,static_frequency,prefill_placement,routing_blind,belady,belady_start"],
    "timing": ["--slots", "16,32", "--pcie", "16", "--cpu", "32"],
    "timing_global": ["--slots", "16", "--pcie", "8", "--cpu", "32", "--future-value", "global", "--layer-us", "20"],
    "timing_fixed_prev": ["--slots", "24", "--pcie", "16", "--cpu", "16", "--future-value", "0.0001",
                          "--predictor", "prev"],
    "sweep": ["--slots", "16", "--pcie", "16", "--cpu", "32", "--sweep"],
}


def run_model(name: str) -> dict:
    """Prompt logits, greedy tokens, decode routing and expert statistics of one run."""
    import freetoken
    from freetoken.engine.decoding.sampling import SamplingParams

    device, kw = MODEL_RUNS[name]
    model = freetoken.load(None, device=device, **kw)
    ids = model.encode(PROMPT)
    logits = model.logits(ids)
    tokens = list(gen := model.generate(ids, DECODE_TOKENS, SamplingParams(temperature=0.0), record_routing=True))
    out = {"prompt_ids": np.asarray(ids, np.int64), "logits": logits[:, :LOGIT_COLUMNS].copy(),
           "tokens": np.asarray(tokens, np.int64),
           "decode_routing": np.asarray(gen.stats.routing, np.int32)}
    # the counters a run reports: cache hits/misses (gpu/emu), the split's counts, prefetch precision
    out.update({f"stat_{k}": np.asarray(v, np.int64) for k, v in model.experts.counters().items()})
    if device == "cpu":  # the cpu kernels' sums follow the SIMD level they compiled for (bit-exact within a level)
        from freetoken.device.simd import simd_level

        out["simd"] = np.asarray(simd_level())
    return out


def run_simulation(trace_path: Path, name: str) -> str:
    from freetoken.cli import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["trace", "simulate", str(trace_path), *SIMULATIONS[name]])
    assert rc in (0, None), rc
    return buf.getvalue()


def make_trace(path: Path) -> None:
    from freetoken.cli import main

    with redirect_stdout(io.StringIO()):
        main(["trace", "synth", str(path), *SYNTH])


def compare(old: dict, new: dict) -> str:
    """One line: how a new run of a model differs from the golden file's."""
    if not np.array_equal(old["prompt_ids"], new["prompt_ids"]):
        return "prompt ids differ (the tokenizer changed): nothing else is comparable"
    ref = old["logits"].astype(np.float64)
    nmse = float(((new["logits"] - ref) ** 2).mean() / (ref ** 2).mean())
    tokens = int((old["tokens"] == new["tokens"]).sum()) if old["tokens"].shape == new["tokens"].shape else 0
    first = next((i for i, (a, b) in enumerate(zip(old["tokens"], new["tokens"], strict=False)) if a != b), None)
    same_routing = (old["decode_routing"].shape == new["decode_routing"].shape
                    and float((old["decode_routing"] == new["decode_routing"]).mean()))
    return (f"logits NMSE {nmse:.3g}; greedy tokens {tokens}/{len(old['tokens'])} agree"
            + ("" if first is None else f" (first difference at token {first})")
            + f"; decode routing {float(same_routing):.1%} agrees")


def write_all(dry_run: bool = False, only: list[str] | None = None) -> None:
    """Rewrite the golden files (``only``: just these model runs, and not the simulator tables)."""
    import tempfile

    for name in only or MODEL_RUNS:
        new = run_model(name)
        path = HERE / f"model_{name}.npz"
        if path.exists():
            print(f"{name}: {compare(dict(np.load(path)), new)}", flush=True)
        if not dry_run:
            np.savez_compressed(path, **new)
    if dry_run or only:
        return
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "t.npz"
        make_trace(trace)
        tables = {name: run_simulation(trace, name) for name in SIMULATIONS}
    (HERE / "simulations.json").write_text(json.dumps(tables, indent=1) + "\n")


if __name__ == "__main__":
    import sys

    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    write_all(dry_run="--dry-run" in sys.argv[1:], only=only or None)
