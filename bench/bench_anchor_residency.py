"""Does re-admitting an anchor's expert residency pay? (issue 14: the default of ``Model.restore_residency``.)

An anchor records which experts sat in the expert cache's slots when it was made. Restoring it could also copy
those experts back in, betting that the resumed conversation routes to them again. This measures the bet on the
bundled model, in records copied over PCIe (device-independent: every copy is one expert record of the same size;
on the emu device, where wall time means nothing, it is the figure that transfers to a GPU):

1. conversation A: a prompt, then ``--decode`` greedy tokens (the slots fill with A's experts); an anchor of A;
2. a side request B on other text with as many decode tokens (its experts evict A's);
3. A resumed from the anchor and decoded for ``--decode`` tokens, twice: without re-admission (the misses of the
   decode) and with it (the records the re-admission copies plus the misses of the decode).

Re-admission pays when the second figure is below the first. ``--slots`` should be well below all the records
(the bundled model has 6 MoE layers x 16 experts = 96) for eviction to matter.

Usage:  python bench/bench_anchor_residency.py --device emu --slots 48 --decode 24
"""

from __future__ import annotations

import argparse
import sys

PROMPT_A = "".join(f"def handler_{i}(request):\n    return respond(request, status={200 + i})\n\n" for i in range(12))
PROMPT_B = "The quick brown fox jumps over the lazy dog. " * 12


def _misses(model) -> int:
    return int(model.experts.cache.stats()["misses"])


def _run(model, ids, decode: int, **kw):
    """(the greedy tokens of ``ids``, reusing what the caches hold; the call's stats)."""
    from freetoken.engine.decoding.sampling import SamplingParams

    gen = model.generate(ids, decode, SamplingParams(temperature=0), reuse_cache=True, **kw)
    return list(gen), gen.stats


def measure(device: str, slots: int, decode: int, readmit: bool) -> dict:
    import freetoken

    model = freetoken.load(device=device, cache_slots=slots)
    if not hasattr(model.experts, "residency"):
        raise SystemExit(f"the {device} device has no expert cache: use --device emu (or gpu)")
    model.restore_residency = readmit
    a = model.encode(PROMPT_A, add_special_tokens=False)
    b = model.encode(PROMPT_B, add_special_tokens=False)
    out_a, _ = _run(model, a, decode)
    anchor = model.anchor(len(a) + len(out_a) - 1)
    _run(model, b, decode)
    model.prefix_cache.clear()  # only the anchor can give A back
    before = _misses(model)
    copied = [0]
    restore = model.experts.restore_residency

    def counted(records):
        copied[0] += restore(records)
        return copied[0]

    model.experts.restore_residency = counted
    resumed = anchor.tokens.tolist()
    out, st = _run(model, resumed, decode, anchor=anchor)
    assert st.anchor == anchor.id, st.anchor_refused
    return {"readmit": readmit, "readmitted": copied[0], "decode_misses": _misses(model) - before,
            "total": copied[0] + _misses(model) - before, "tokens": out, "residency": len(anchor.residency or [])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="emu")
    ap.add_argument("--slots", type=int, default=48)
    ap.add_argument("--decode", type=int, default=24, help="greedy tokens decoded per request")
    args = ap.parse_args(argv)
    rows = [measure(args.device, args.slots, args.decode, r) for r in (False, True)]
    print(f"bundled model, {args.device}, {args.slots} slots, {args.decode} decode tokens; an anchor recorded "
          f"{rows[0]['residency']} resident records")
    print("| resume | records re-admitted | decode misses | records copied in all |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {'with re-admission' if r['readmit'] else 'without'} | {r['readmitted']} | {r['decode_misses']} | "
              f"{r['total']} |")
    same = rows[0]["tokens"] == rows[1]["tokens"]
    verdict = "pays" if rows[1]["total"] < rows[0]["total"] else "does not pay"
    print(f"same tokens both ways: {same}; re-admission {verdict} ({rows[1]['total']} vs {rows[0]['total']} records)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
