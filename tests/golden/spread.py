"""How far the golden model runs move between builds of the same code: the numbers behind test_golden's tolerance.

Runs each model run of ``behaviour.MODEL_RUNS`` in a fresh subprocess under several builds of the CPU kernels (this
machine's SIMD level, AVX2 only, portable code, one Numba thread, one emulator thread) and prints, against the golden
files, the logits' NMSE and largest absolute difference and whether the greedy tokens, the decode routing and the
counters are equal. Nothing is written. ``python tests/golden/spread.py [RUN ...] [--configs a,b]``; a run takes
10-30 s on 2 cores (plus the kernels' first compilation for each SIMD level).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name -> extra environment (``{avx2}`` / ``{none}`` become this host's feature strings for those levels)
CONFIGS = {
    "native": {},
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "{avx2}"},
    "portable": {"NUMBA_CPU_NAME": "ivybridge", "NUMBA_CPU_FEATURES": "{none}"},
    "1thread": {"NUMBA_NUM_THREADS": "1", "FREETOKEN_EMU_THREADS": "1"},
}

_CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import behaviour
name = sys.argv[2]
got = behaviour.run_model(name)
want = dict(np.load(behaviour.HERE / f"model_{name}.npz"))
ref = want["logits"].astype(np.float64)
diff = got["logits"].astype(np.float64) - ref
stats = lambda d: {k: int(v) for k, v in d.items() if k.startswith("stat_")}
from freetoken.device.simd import simd_level
print(json.dumps({"nmse": float((diff ** 2).mean() / (ref ** 2).mean()), "max_abs": float(np.abs(diff).max()),
                  "tokens": bool(np.array_equal(got["tokens"], want["tokens"])),
                  "routing": bool(np.array_equal(got["decode_routing"], want["decode_routing"])),
                  "counters": stats(got) == stats(want), "simd": simd_level()}))
"""


def _features(level: str) -> str:
    from freetoken.device.simd import avx2_only_features

    if level == "avx2":
        return avx2_only_features()
    # the portable level: without AVX2/FMA as well (F16C stays, as on an Ivy Bridge)
    feats = avx2_only_features().split(",")
    return ",".join("-" + f[1:] if f[1:] in ("avx2", "fma") else f for f in feats)


def measure(name: str, config: str) -> dict:
    env = dict(os.environ)
    for k, v in CONFIGS[config].items():
        env[k] = v.format(avx2=_features("avx2") if "{avx2}" in v else "",
                          none=_features("none") if "{none}" in v else "")
    r = subprocess.run([sys.executable, "-c", _CHILD, str(HERE), name], env=env, capture_output=True, text=True)
    if r.returncode:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(HERE))
    import behaviour

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", default=list(behaviour.MODEL_RUNS), help="model runs (default: all)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"builds to run (default: {','.join(CONFIGS)})")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS] + [r for r in args.runs if r not in behaviour.MODEL_RUNS]
    if unknown:
        ap.error(f"unknown run or config: {', '.join(unknown)}")
    print("| run | build | SIMD | logits NMSE | max abs diff | tokens | routing | counters |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.runs:
        for config in configs:
            m = measure(name, config)
            if "error" in m:
                print(f"| {name} | {config} | - | error: {m['error']} | | | | |", flush=True)
                continue
            print(f"| {name} | {config} | {m['simd']} | {m['nmse']:.3g} | {m['max_abs']:.3g} | {m['tokens']} "
                  f"| {m['routing']} | {m['counters']} |", flush=True)


if __name__ == "__main__":
    main()
