"""How much of the LRU-to-Belady gap can an online cache policy close on the synthetic traces at all?

``bench/policy_eval.py`` scores online policies by the fraction of the gap between LRU and ``belady_start`` (Belady
with free contents at the window start and bypass) they close. On the synthetic traces
(:mod:`freetoken.trace.synthetic`) the routing is a known random process: per segment and layer a popularity q, and
per decode step each of a row's k positions keeps its expert with probability ``locality`` or is redrawn from q.
Belady sees the draws; no online policy can. This script replays each synthetic configuration of policy_eval with
a **model oracle**: a policy told the generator's true per-segment probabilities and its locality (it regenerates
them from the seed), which keeps the experts of highest known probability of use. Per miss, every resident expert
not used in this call gets its expected time to next use (calls of its layer until its next use, from
P(next call) = locality + (1 - locality) p for an expert a row used at the layer's last call, p = 1 - (1 - q)^((1 -
locality) k) otherwise, as a geometric tail; times the layer count, plus the calls until its layer comes round);
the largest is evicted, unless the miss itself is expected back no sooner (then it is bypassed, as ``default``
does). Nothing is learnt. It is a reference, not a bound: evicting the largest expected time to next use is not
optimal for a random process (at 25% of the records it can miss more than ``default``), but the gap a policy told
the process closes shows how much of Belady's lead comes from draws no online policy sees.

Everything is scored as policy_eval scores it (second half of the decode steps, totals over the held-out or tuning
traces), without prefill borrowing for every row (this script's oracle does not model the borrowed slots):

    python bench/policy_bound.py [--seeds 0,1] [--fractions 0.25,0.5,0.75,0.9]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numba as nb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_eval import SYNTHETIC  # noqa: E402

from freetoken.sim.policies import POLICIES  # noqa: E402
from freetoken.trace import make_trace  # noqa: E402
from freetoken.trace.derived import window_steps  # noqa: E402
from freetoken.trace.synthetic import segment_popularity  # noqa: E402


@nb.njit(cache=True)
def _key(lo, o, layer, L, T, p_fresh, used_last, loc):
    """Expected time (in calls of any layer) until flat expert (lo, o) is next used, at a call of ``layer``: with u of
    the T rows using it at the layer's last call, P(next call) = 1 - (1 - (loc + (1 - loc) p))^u (1 - p)^(T - u);
    after a call without it, 1 - (1 - p)^T per call (a geometric tail)."""
    d = (lo - layer - 1 + L) % L + 1  # calls until layer lo comes round
    p = p_fresh[lo, o]
    u = used_last[lo, o]
    a = 1.0 - (1.0 - (loc + (1.0 - loc) * p)) ** u * (1.0 - p) ** (T - u)
    pa = 1.0 - (1.0 - p) ** T
    if pa <= 0.0:
        return 1e300
    n = a + (1.0 - a) * (1.0 + 1.0 / pa)
    return d + L * (n - 1.0)


@nb.njit(cache=True)
def replay(ids, seg_of_step, q, loc, k, slots, first_scored):
    """Misses of the model oracle over the steps from ``first_scored`` on. ``ids`` [steps, L, T, k]."""
    steps, L, T, _ = ids.shape
    E = q.shape[2]
    slot_of = np.full(L * E, -1, np.int64)
    owner = np.full(slots, -1, np.int64)
    used_last = np.zeros((L, E), np.int64)  # rows that used the expert at the layer's last call
    in_call = np.zeros(L * E, np.int64)
    misses = 0
    call = 0
    p_fresh = np.zeros((L, E))
    seg = -1
    for t in range(steps):
        if seg_of_step[t] != seg:
            seg = seg_of_step[t]
            for lo in range(L):
                for o in range(E):
                    p_fresh[lo, o] = 1.0 - (1.0 - q[seg, lo, o]) ** ((1.0 - loc) * k)
                    used_last[lo, o] = 0  # a segment's first step is all fresh
        for layer in range(L):
            call += 1
            act = np.unique(ids[t, layer].ravel())
            for e in act:
                in_call[layer * E + e] = call
            for e in act:
                f = layer * E + e
                if slot_of[f] >= 0:
                    continue
                if t >= first_scored:
                    misses += 1
                best, best_key = -1, -1.0
                for s in range(slots):
                    o = owner[s]
                    if o < 0:
                        best, best_key = s, 1e308
                        break
                    if in_call[o] == call:
                        continue
                    kk = _key(o // E, o % E, layer, L, T, p_fresh, used_last, loc)
                    if kk > best_key:
                        best, best_key = s, kk
                if best < 0:
                    continue
                if owner[best] >= 0:
                    # the miss's own expected return after this call (its rows use it now)
                    used_now = 0
                    for r in range(T):
                        for j in range(k):
                            if ids[t, layer, r, j] == e:
                                used_now += 1
                    saved = used_last[layer, e]
                    used_last[layer, e] = used_now
                    kin = _key(layer, e, layer, L, T, p_fresh, used_last, loc)
                    used_last[layer, e] = saved
                    if not kin < best_key:
                        continue  # bypassed
                    slot_of[owner[best]] = -1
                owner[best] = f
                slot_of[f] = best
            for o in range(E):
                used_last[layer, o] = 0
            for r in range(T):
                for j in range(k):
                    used_last[layer, ids[t, layer, r, j]] += 1
    return misses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1", help="policy_eval's seeds (0: tuning, 1: held-out)")
    ap.add_argument("--fractions", default="0.25,0.5,0.75,0.9", help="slots as fractions of the records")
    args = ap.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        for i, (L, E, k, loc, steps, segs, tokens) in enumerate(SYNTHETIC):
            s = 1000 * seed + i
            trace = make_trace(num_layers=L, num_experts=E, top_k=k, steps=steps, segments=segs, locality=loc,
                               seed=s, tokens=tokens)
            q = segment_popularity(L, E, segs, loc, s)
            ids = np.ascontiguousarray(trace.decode_ids, np.int64)
            t0, _ = window_steps(trace, "second_half")
            for frac in fractions:
                slots = max(1, int(round(frac * L * E)))
                got = {name: POLICIES[name](trace, slots, prefill_borrow=False).misses
                       for name in ("lru", "default")}
                got["belady_start"] = POLICIES["belady_start"](trace, slots).misses
                got["oracle"] = int(replay(ids, np.asarray(trace.step_segment, np.int64), q, loc, k, slots, t0))
                tot = rows.setdefault((seed, frac), {n: 0 for n in got})
                for n, v in got.items():
                    tot[n] += v
                print(f"seed {seed} {L}x{E} top-{k} loc {loc} @ {frac}: " +
                      ", ".join(f"{n} {v}" for n, v in got.items()), flush=True)
    print("\n| seeds | capacity | lru | belady_start | default | oracle | gap default | gap oracle |")
    print("|---|---|---|---|---|---|---|---|")
    for (seed, frac), t in sorted(rows.items()):
        span = t["lru"] - t["belady_start"]

        def gap(n, t=t, span=span):
            return (t["lru"] - t[n]) / span if span else 0.0

        print(f"| {seed} | {frac:.0%} | {t['lru']} | {t['belady_start']} | {t['default']} | {t['oracle']} | "
              f"{gap('default'):.3f} | {gap('oracle'):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
