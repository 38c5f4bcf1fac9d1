"""Expert-cache policies against LRU and Belady on real and synthetic routing traces: the evidence behind the
hyperparameters of freetoken.policy.next_use (DEFAULT_PARAMS, RECOMMENDED) and freetoken.policy.lfu_decay.

The traces (cached under --cache, default /tmp/freetoken-policy-eval, so reruns only simulate):

* prompts: the bundled model (cpu) continues 12 openings of standard-library modules (code) and 12 entries of the
  Python documentation's pydoc topics (prose), --tokens sampled tokens each, one trace per prompt (the recorder of
  bench/qstar_sweep.py, one segment per prompt). A **workload** concatenates 4 of them (code, prose, code, prose)
  as 4 segments, the way an agent session sends one prompt after another: 6 workloads.
* chats: --chats conversations of --turns user turns. Each turn renders the whole conversation so far with the
  model's chat template and generates with ``reuse_cache=True``: the K/V rows of the earlier turns are reused, so
  the turn's prefill (its segment's prefill counts) is only the new tail, and its decode steps are one segment.
  User turns are short prose/code snippets, replies up to --reply-tokens.
* synthetic: ``freetoken.trace.make_trace`` at 24-60 layers x 64-256 experts, top-4..8, locality 0.3..0.9, one
  config with a decode batch of 2; two seeds each.

Split: tuning = workloads 0, 2, 4, chats 0, 2, ..., synthetic seed 0; held-out = workloads 1, 3, 5, chats 1, 3,
..., synthetic seed 1. Every policy replays the whole trace with prefill borrowing; the second half of the decode
steps is scored (LRU and the others warm up on the first half; belady_start gets its contents free at the window
start). Capacities: --fractions of the trace's records (L x E) as slots.

Tuning (tuning set only): lfu_decay's half-life by grid; next_use (with bypass) by coordinate search over its
hyperparameters, then the prefill prior; the objective per configuration is the mean over the groups (prompts,
chats, synthetic) of the fraction of the LRU-to-belady_start gap closed (sums of misses over the group's traces)
at 50% and 75%, plus a quarter of it at the other capacities, minus 10 x the excess over 2% of the worst relative
excess over LRU (traces with at least 100 LRU misses). Then every table for the tuning and held-out sets. The row
``default`` is the runtime's recommendation as the module defines it (freetoken.policy.next_use.RECOMMENDED: the
prior plus the long memory, whose half-lives and weight were chosen on the tuning set by a small grid, not by this
script's coordinate search); ``default+trans`` adds next_use's transition predictor
(freetoken.policy.next_use.RECOMMENDED_TRANS, its three values chosen on the tuning set by a small grid, not by this
script); the ``gap`` columns are next_use+bypass+prior's, default's and default+trans's.

    python bench/policy_eval.py [--plot /tmp/policy.png] [--no-tune] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from freetoken.policy.lfu_decay import DEFAULT_HALF_LIFE  # noqa: E402
from freetoken.policy.next_use import DEFAULT_PARAMS, DEFAULT_PRIOR  # noqa: E402
from freetoken.sim import policies as P  # noqa: E402
from freetoken.trace import Trace, load_trace, make_trace, prepare  # noqa: E402

FRACTIONS = (0.125, 0.25, 0.5, 0.75, 0.9)
HEADLINE = (0.5, 0.75)
POLICY_NAMES = ("lru", "lfu_decay", "lfu_decay+bypass", "next_use", "next_use+bypass", "next_use+bypass+prior",
                "default", "default+trans", "belady_start")
GROUPS = ("prompts", "chats", "synthetic")
#: synthetic configurations: (layers, experts, top_k, locality, steps, segments, tokens)
SYNTHETIC = ((24, 64, 4, 0.3, 800, 4, 1), (24, 128, 6, 0.7, 800, 4, 1), (32, 64, 8, 0.5, 800, 4, 1),
             (48, 128, 8, 0.9, 600, 4, 1), (60, 256, 8, 0.5, 500, 4, 1), (48, 256, 4, 0.6, 500, 5, 2))
SYNTHETIC_QUICK = ((24, 64, 4, 0.3, 400, 4, 1), (24, 128, 6, 0.7, 400, 4, 1), (32, 64, 8, 0.9, 400, 4, 1))
CHAT_USER = (
    "Explain what a context manager is and when to use one.",
    "def pairwise(xs):\n    return zip(xs, xs[1:])\nWhat does this return for an empty list?",
    "Why does this loop never end?\nwhile i < 10:\n    print(i)",
    "Write a function that reverses the words of a sentence.",
    "What is the difference between a list and a tuple?",
    "Summarise the last answer in one sentence.",
    "import json\ndata = json.loads(text)\nHow do I handle a decode error here?",
    "Give an example of a generator expression.",
    "How would you test the function above?",
    "class Stack:\n    def __init__(self):\n        self.items = []\nAdd push and pop methods.",
    "What does the with statement do with exceptions?",
    "Rewrite that more briefly.",
)


# ---------------------------------------------------------------------------------------------------- recording


class Recorder:
    """The bundled model (cpu) and a trace recorder per trace, loaded on first use (cached traces need neither)."""

    def __init__(self):
        self._model = None

    @property
    def model(self):
        if self._model is None:
            from freetoken.engine.loading.load import load

            self._model = load(None, device="cpu", ctx=4096)
        return self._model

    def new(self):
        from freetoken.trace.format import TraceRecorder

        m = self.model
        cfg = m.config
        return TraceRecorder(sum(cfg.moe_layers), cfg.num_experts, cfg.top_k, m.experts.layout.record_bytes,
                             model="bundled qwen3_moe")

    def segment(self, rec, prompt, tokens: int, seed: int, reuse: bool = False) -> list[int]:
        """Generate from ``prompt`` (text or ids) and record it as one segment (as bench/qstar_sweep.py's record()
        does: the prefill's routing counts, then every decode step); returns the generated ids."""
        from freetoken.engine.decoding.sampling import SamplingParams

        m = self.model
        out = list(gen := m.generate(prompt, tokens, SamplingParams(temperature=0.8, top_p=0.95, seed=seed),
                              record_routing=True, reuse_cache=reuse))
        rec.add_segment(gen.stats.prefill_routing, gen.stats.routing)
        return out


def prompt_texts() -> list[tuple[str, str]]:
    """(kind, text): 12 code prompts (openings of standard-library modules) and 12 prose ones (pydoc topics),
    interleaved code, prose, code, prose..."""
    import pydoc_data.topics as topics

    root = Path(os.__file__).parent
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)
    code = [f.read_text(errors="replace")[:600] for f in files[::max(1, len(files) // 12)][:12]]
    keys = sorted(topics.topics)
    prose = [topics.topics[k][:600] for k in keys[::max(1, len(keys) // 12)][:12]]
    return [x for pair in zip((("code", c) for c in code), (("prose", p) for p in prose), strict=True) for x in pair]


def record_prompts(rec: Recorder, cache: Path, tokens: int, count: int) -> list[Trace]:
    out = []
    for i, (kind, text) in enumerate(prompt_texts()[:count]):
        path = cache / f"prompt-{i:02d}-{kind}-{tokens}.npz"
        if not path.exists():
            r = rec.new()
            rec.segment(r, text, tokens, seed=i)
            r.save(path)
        out.append(load_trace(path))
    return out


def record_chat(rec: Recorder, cache: Path, index: int, turns: int, reply_tokens: int) -> Trace:
    """One conversation of ``turns`` user turns, every turn a segment generated with ``reuse_cache=True``."""
    path = cache / f"chat-{index:02d}-{turns}x{reply_tokens}.npz"
    if not path.exists():
        from freetoken.engine.generation.chat import model_template

        m = rec.model
        template = model_template(m)
        r = rec.new()
        messages: list[dict] = []
        for turn in range(turns):
            messages.append({"role": "user", "content": CHAT_USER[(index * 5 + turn * 7) % len(CHAT_USER)]})
            ids = m.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)
            reply = rec.segment(r, ids, reply_tokens, seed=1000 + 100 * index + turn, reuse=turn > 0)
            text = m.decode([t for t in reply if t not in m.eos_ids])
            messages.append({"role": "assistant", "content": text})
        r.save(path)
    return load_trace(path)


def synthetic(cache: Path, configs, seed: int) -> list[Trace]:
    out = []
    for i, (L, E, k, loc, steps, segs, tokens) in enumerate(configs):
        path = cache / f"synth-{L}x{E}-k{k}-loc{loc}-s{steps}-g{segs}-t{tokens}-seed{seed}.npz"
        if not path.exists():
            from freetoken.trace.format import save_trace

            save_trace(path, make_trace(num_layers=L, num_experts=E, top_k=k, steps=steps, segments=segs,
                                        locality=loc, seed=1000 * seed + i, tokens=tokens,
                                        model=f"synthetic {L}x{E} top-{k} loc {loc}"))
        out.append(load_trace(path))
    return out


def concat(traces: list[Trace], model: str) -> Trace:
    """The traces one after another, each segment its own (the decode batch size must agree)."""
    segs, off = [], 0
    for t in traces:
        segs.append(t.step_segment + off)
        off += t.num_segments
    t0 = traces[0]
    return Trace(decode_ids=np.concatenate([t.decode_ids for t in traces]),
                 step_segment=np.concatenate(segs).astype(np.int32),
                 prefill_counts=np.concatenate([t.prefill_counts for t in traces]), num_experts=t0.num_experts,
                 num_layers=t0.num_layers, top_k=t0.top_k, record_bytes=t0.record_bytes, model=model).validate()


def workloads(args) -> dict[str, dict[str, list[tuple[str, Trace]]]]:
    """{split: {group: [(name, trace)]}}."""
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    rec = Recorder()
    t0 = time.perf_counter()
    prompts = record_prompts(rec, cache, args.tokens, args.prompts)
    chats = [record_chat(rec, cache, i, args.turns, args.reply_tokens) for i in range(args.chats)]
    configs = SYNTHETIC_QUICK if args.quick else SYNTHETIC
    syn = {0: synthetic(cache, configs, 0), 1: synthetic(cache, configs, 1)}
    print(f"# traces ready in {time.perf_counter() - t0:.1f}s (cache {cache})")
    work = [concat(prompts[i:i + 4], f"bundled: prompts {i}-{i + 3}") for i in range(0, len(prompts) - 3, 4)]
    split: dict[str, dict[str, list]] = {"tuning": {g: [] for g in GROUPS}, "held-out": {g: [] for g in GROUPS}}
    for i, w in enumerate(work):
        split["tuning" if i % 2 == 0 else "held-out"]["prompts"].append((f"prompts{i}", w))
    for i, c in enumerate(chats):
        split["tuning" if i % 2 == 0 else "held-out"]["chats"].append((f"chat{i}", c))
    for seed, name in ((0, "tuning"), (1, "held-out")):
        for t in syn[seed]:
            split[name]["synthetic"].append((t.model.replace("synthetic ", "").replace(" ", "") + f"/s{seed}", t))
    return split


# --------------------------------------------------------------------------------------------------- simulating


def capacities(trace: Trace, fractions) -> list[int]:
    lo = max(prepare(trace).max_active, 1)
    return [max(lo, int(round(f * trace.num_flat))) for f in fractions]


class Runs:
    """Misses per (policy config, trace, slots), memoised (lru and belady_start once per trace and capacity)."""

    def __init__(self):
        self.memo: dict = {}

    def misses(self, key: str, fn, trace_name: str, trace: Trace, slots: int) -> int:
        k = (key, trace_name, slots)
        if k not in self.memo:
            self.memo[k] = fn(trace, slots).misses
        return self.memo[k]


def policy_fns(lfu_half_life: float, nu: dict, prior: dict) -> dict:
    """The compared policies as ``fn(trace, slots)``, with the given hyperparameters."""
    return {
        "lru": lambda t, s: P.lru(t, s),
        "lfu_decay": lambda t, s: P.lfu_decay(t, s, half_life=lfu_half_life),
        "lfu_decay+bypass": lambda t, s: P.lfu_decay(t, s, half_life=lfu_half_life, bypass=True),
        "next_use": lambda t, s: P.next_use(t, s, **nu),
        "next_use+bypass": lambda t, s: P.next_use(t, s, bypass=True, **nu),
        "next_use+bypass+prior": lambda t, s: P.next_use(t, s, bypass=True, name="next_use+bypass+prior", **nu,
                                                         **prior),
        "default": lambda t, s: P.recommended_policy(t, s),
        "default+trans": lambda t, s: P.recommended_trans(t, s),
        "belady_start": lambda t, s: P.belady_start(t, s),
    }


def evaluate(runs: Runs, groups: dict, fns: dict, names, fractions, keys: dict | None = None) -> dict:
    """{group: {fraction: {policy: (misses, accesses)}}} summed over the group's traces, and per (trace, fraction)
    the misses in ``out["per_trace"]``."""
    keys = keys or {}
    out: dict = {"per_trace": {}}
    for group, traces in groups.items():
        agg = out.setdefault(group, {})
        for name, t in traces:
            p = prepare(t)
            h = t.steps // 2
            acc = int(p.step_offsets[-1] - p.step_offsets[h])
            for f, s in zip(fractions, capacities(t, fractions), strict=True):
                row = agg.setdefault(f, {})
                for pol in names:
                    m = runs.misses(keys.get(pol, pol), fns[pol], name, t, s)
                    mm, aa = row.get(pol, (0, 0))
                    row[pol] = (mm + m, aa + acc)
                    out["per_trace"].setdefault((group, name, f), {})[pol] = (m, acc, s)
    return out


def gap_closed(row: dict, pol: str) -> float:
    lru, bel = row["lru"][0], row["belady_start"][0]
    return (lru - row[pol][0]) / (lru - bel) if lru > bel else 0.0


def worst_excess(res: dict, pol: str, fractions=None, min_lru: int = 100) -> tuple[float, str]:
    """The largest relative excess of ``pol``'s misses over LRU's, over (trace, capacity) with at least ``min_lru``
    LRU misses; and where."""
    worst, where = -np.inf, ""
    for (_group, name, f), row in res["per_trace"].items():
        if fractions is not None and f not in fractions:
            continue
        lru = row["lru"][0]
        if pol not in row or lru < min_lru:
            continue
        x = row[pol][0] / lru - 1
        if x > worst:
            worst, where = x, f"{name} @ {f:g} ({row['lru'][2]} slots)"
    return float(worst), where


def objective(res: dict, pol: str, fractions) -> float:
    vals = []
    for g in GROUPS:
        if g not in res:
            continue
        head = [gap_closed(res[g][f], pol) for f in fractions if f in HEADLINE]
        rest = [gap_closed(res[g][f], pol) for f in fractions if f not in HEADLINE]
        vals.append(np.mean(head) + 0.25 * (np.mean(rest) if rest else 0.0))
    worst, _ = worst_excess(res, pol)
    return float(np.mean(vals)) - 10.0 * max(0.0, worst - 0.02)


# ------------------------------------------------------------------------------------------------------- tuning

NU_GRID = {"half_life": (16.0, 32.0, 64.0), "rho": (0.0, 0.15, 0.3, 0.6), "kappa": (2.0, 8.0, 32.0),
           "id_decay": (0.8, 0.9, 0.97), "load_half_life": (8.0, 32.0, 128.0)}
PRIOR_GRID = {"prior_weight": (0.0, 0.1, 0.3, 1.0), "prior_keep": (0.25, 0.5, 1.0)}
LFU_GRID = (2.0, 4.0, 8.0, 16.0, 32.0)


def _cfg_key(d: dict) -> str:
    return json.dumps(d, sort_keys=True)


def tune(runs: Runs, groups: dict, fractions, log) -> tuple[float, dict, dict]:
    """(lfu_decay half-life, next_use params, prior params) chosen on ``groups`` (the tuning set)."""
    # lfu_decay: grid
    best_h, best_v = None, -np.inf
    for h in LFU_GRID:
        res = evaluate(runs, groups, {**policy_fns(h, {}, {}), "x": lambda t, s, h=h: P.lfu_decay(t, s, half_life=h)},
                       ("lru", "belady_start", "x"), fractions, keys={"x": f"lfu {h}"})
        v = objective(res, "x", fractions)
        log(f"| lfu_decay | half_life={h:g} | {v:.4f} |")
        if v > best_v:
            best_h, best_v = h, v

    def score(nu: dict, prior: dict) -> float:
        cfg = {**nu, **prior}
        fn = lambda t, s: P.next_use(t, s, bypass=True, **cfg)  # noqa: E731
        res = evaluate(runs, groups, {**policy_fns(best_h, {}, {}), "x": fn}, ("lru", "belady_start", "x"),
                       fractions, keys={"x": "nu " + _cfg_key(cfg)})
        return objective(res, "x", fractions)

    def coordinate(start: dict, grid: dict, fixed: dict, label: str) -> dict:
        cur = dict(start)
        cur_v = score(cur, fixed) if label == "next_use+bypass" else score(fixed, cur)
        log(f"| {label} | start {_fmt(cur)} | {cur_v:.4f} |")
        for _ in range(2):
            changed = False
            for name, values in grid.items():
                for v in values:
                    if v == cur[name]:
                        continue
                    cand = {**cur, name: v}
                    val = score(cand, fixed) if label == "next_use+bypass" else score(fixed, cand)
                    log(f"| {label} | {name}={v:g} | {val:.4f} |")
                    if val > cur_v + 1e-9:
                        cur, cur_v, changed = cand, val, True
            if not changed:
                break
        log(f"| {label} | **chosen** {_fmt(cur)} | **{cur_v:.4f}** |")
        return cur

    nu0 = {k: DEFAULT_PARAMS[k] for k in NU_GRID}
    nu = coordinate(nu0, NU_GRID, {}, "next_use+bypass")
    prior = coordinate(dict(DEFAULT_PRIOR), PRIOR_GRID, nu, "prior")
    return best_h, nu, prior


def _fmt(d: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in d.items())


# ------------------------------------------------------------------------------------------------------- report


def report(res: dict, names, fractions, title: str) -> str:
    lines = [f"### {title}", ""]
    for g in GROUPS:
        if g not in res:
            continue
        lines += [f"**{g}** (miss rate %, second half; gap = fraction of the LRU-to-belady_start gap closed)", "",
                  "| capacity | " + " | ".join(names) +
                  " | gap next_use+bypass+prior | gap default | gap default+trans |", "|---" * (len(names) + 4) + "|"]
        for f in fractions:
            row = res[g][f]
            cells = [f"{100.0 * row[p][0] / row[p][1]:.2f}" for p in names]
            lines.append(f"| {100 * f:g}% | " + " | ".join(cells) +
                         f" | {gap_closed(row, 'next_use+bypass+prior'):.3f} | {gap_closed(row, 'default'):.3f} |"
                         f" {gap_closed(row, 'default+trans'):.3f} |")
        lines.append("")
    lines += ["**worst cases** (the largest relative excesses of misses over LRU, traces and capacities with at "
              "least 100 LRU misses)", "", "| policy | trace @ capacity (slots) | LRU misses | misses | excess |",
              "|---|---|---|---|---|"]
    for p in ("next_use+bypass+prior", "default", "default+trans"):
        if p not in names:
            continue
        rows = sorted(((row[p][0] / row["lru"][0] - 1, name, f, row) for (_g, name, f), row in res["per_trace"].items()
                       if row["lru"][0] >= 100), key=lambda x: -x[0])[:4]
        for x, name, f, row in rows:
            lines.append(f"| {p} | {name} @ {100 * f:g}% ({row['lru'][2]}) | {row['lru'][0]:,} | {row[p][0]:,} | "
                         f"{100 * x:+.1f}% |")
    lines += ["", "**summary** (gap closed: the group's summed misses; worst: the largest relative excess of misses "
              "over LRU over every trace and capacity with at least 100 LRU misses)", "",
              "| policy | " + " | ".join(f"gap {g} @{100 * f:g}%" for g in GROUPS if g in res for f in HEADLINE) +
              " | worst vs LRU | where |", "|---" * (2 + sum(len(HEADLINE) for g in GROUPS if g in res)) + "|"]
    for p in names:
        if p in ("lru", "belady_start"):
            continue
        gaps = [f"{gap_closed(res[g][f], p):.3f}" for g in GROUPS if g in res for f in HEADLINE]
        w, where = worst_excess(res, p)
        lines.append(f"| {p} | " + " | ".join(gaps) + f" | {100 * w:+.1f}% | {where} |")
    return "\n".join(lines)


def plot(res_by_slots: dict, path: Path, title: str) -> None:
    from freetoken.sim.plot import plot_miss_rates

    rows = [{"policy": p, "window": "second_half", "slots": s, "miss_rate": m / a}
            for (p, s), (m, a) in res_by_slots.items()]
    plot_miss_rates(rows, path, title=title)
    print(f"plot written to {path}")


def by_slots(res: dict, groups: list[str], names) -> dict:
    """{(policy, slots): (misses, accesses)} summed over the per-trace results of ``groups``."""
    out: dict = {}
    for (group, _name, _f), row in res["per_trace"].items():
        if group not in groups:
            continue
        for p in names:
            m, a, s = row[p]
            mm, aa = out.get((p, s), (0, 0))
            out[(p, s)] = (mm + m, aa + a)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default="/tmp/freetoken-policy-eval", help="trace cache directory")
    ap.add_argument("--prompts", type=int, default=24, help="prompts recorded (multiple of 4; default 24)")
    ap.add_argument("--tokens", type=int, default=256, help="decode tokens per prompt (default 256)")
    ap.add_argument("--chats", type=int, default=4, help="conversations (default 4)")
    ap.add_argument("--turns", type=int, default=5, help="user turns per conversation (default 5)")
    ap.add_argument("--reply-tokens", type=int, default=128, help="tokens per reply (default 128)")
    ap.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS),
                    help="capacities as fractions of the records (default 0.125,0.25,0.5,0.75,0.9)")
    ap.add_argument("--no-tune", action="store_true", help="use the modules' defaults instead of tuning")
    ap.add_argument("--quick", action="store_true", help="smaller synthetic traces (a fast smoke run)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="miss rate against slots per policy, held-out prompts (FILE), chats (FILE-chats), "
                         "and the first held-out synthetic trace (FILE-synthetic)")
    args = ap.parse_args(argv)
    fractions = tuple(float(x) for x in args.fractions.split(","))
    split = workloads(args)
    for s, groups in split.items():
        for g, traces in groups.items():
            desc = ", ".join(f"{n} ({t.steps} steps, {t.num_segments} seg, {t.num_layers}x{t.num_experts} "
                             f"top-{t.top_k}{' x' + str(t.tokens) + ' tokens' if t.tokens > 1 else ''})"
                             for n, t in traces)
            print(f"# {s} / {g}: {desc}")
    runs = Runs()
    t0 = time.perf_counter()
    if args.no_tune:
        lfu_h = DEFAULT_HALF_LIFE
        nu = {k: DEFAULT_PARAMS[k] for k in NU_GRID}
        prior = dict(DEFAULT_PRIOR)
    else:
        print("\n### tuning (tuning set only)\n\n| what | configuration | objective |\n|---|---|---|")
        lfu_h, nu, prior = tune(runs, split["tuning"], fractions, lambda s: print(s, flush=True))
        print(f"\n# tuned in {time.perf_counter() - t0:.0f}s: lfu_decay half_life={lfu_h:g}; next_use {_fmt(nu)}; "
              f"prior {_fmt(prior)}")
        same = nu == {k: DEFAULT_PARAMS[k] for k in NU_GRID} and prior == DEFAULT_PRIOR and lfu_h == DEFAULT_HALF_LIFE
        print(f"# the modules' defaults {'match' if same else 'DIFFER from'} the tuned values")
    nu_full = {**nu, "cycle": DEFAULT_PARAMS["cycle"], "global_half_life": DEFAULT_PARAMS["global_half_life"]}
    fns = policy_fns(lfu_h, nu_full, prior)
    results = {}
    for s in ("tuning", "held-out"):
        results[s] = evaluate(runs, split[s], fns, POLICY_NAMES, fractions)
        print()
        print(report(results[s], POLICY_NAMES, fractions, f"{s} set"))
    print(f"\n# simulated in {time.perf_counter() - t0:.0f}s")
    if args.plot:
        held = results["held-out"]
        plot(by_slots(held, ["prompts"], POLICY_NAMES), args.plot, "bundled model, held-out prompt workloads")
        stem, suffix = os.path.splitext(str(args.plot))
        plot(by_slots(held, ["chats"], POLICY_NAMES), Path(f"{stem}-chats{suffix}"),
             "bundled model, held-out multi-turn chats")
        first = split["held-out"]["synthetic"][0][0]
        one = {"per_trace": {k: v for k, v in held["per_trace"].items() if k[1] == first}}
        plot(by_slots(one, ["synthetic"], POLICY_NAMES), Path(f"{stem}-synthetic{suffix}"),
             f"synthetic {first}, held-out seed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
