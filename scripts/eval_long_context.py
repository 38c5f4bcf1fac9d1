#!/usr/bin/env python
"""Does the bundled model get better or worse deeper into a long file? Held-out loss by position within documents.

``scripts/extend_default_model.py`` scores positions on windows cut from the held-out stream, where the files are
concatenated: every token is scored at every position, so a difference between positions is the position's own
effect, but a window's context is mostly other, unrelated files. What a coding agent needs is the other question:
with more of the *same* file (or conversation) before it, is the next token predicted at least as well?

This scores whole documents the first stage never trained on: the CPython standard library's own test modules
(``Lib/test/**/test_*.py``; ``scripts/train_default_model.py`` excludes test code from its training files), which
ship with every CPython build. Every module with at least ``--ctx + 1`` tokens takes part (``--files`` of them at
most, in path order), scored two ways:

* **from the start**: the module's first ``ctx + 1`` tokens, position p predicted from the p tokens before it;
* **from inside**: a window of ``ctx + 1`` tokens starting at a seeded random offset in a module long enough for one
  (so position 0 is mid-file code too, not a file header);
* with ``--cyclic N``: extend_default_model's measure on these modules instead of its 15 held-out files: the first N
  tokens of the modules joined by ``<|endoftext|>``, windows every ``--eval-stride`` tokens around that stream, so
  every token is scored at every position and the buckets differ by position alone.

The tables give the mean next-token NLL (nats) per position bucket (0-1k, 1k-4k, 4k-8k by default) and per 1,024
positions; the last line says whether the loss rises with position anywhere.

    python scripts/eval_long_context.py [--model DIR] [--ctx 8192] [--files 64]
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extend_default_model import DEFAULT_DIR, bucket_table, loss_by_position, parse_buckets  # noqa: E402
from hf_attn_temperature import patch, set_temperature  # noqa: E402


def held_out_modules(tok, ctx: int, limit: int) -> list[tuple[Path, np.ndarray]]:
    """(path, token ids) of the stdlib test modules with at least ``ctx + 1`` tokens, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"]) / "test"
    if not root.is_dir():
        raise SystemExit(f"{root} is missing: this Python was built without its test package")
    out = []
    for path in sorted(root.rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if len(text) < ctx:  # fewer characters than tokens needed: skip without encoding
            continue
        ids = np.asarray(tok.encode(text).ids, np.int64)
        if ids.size >= ctx + 1:
            out.append((path, ids))
            if len(out) == limit:
                break
    return out


def training_held_out(tok, seed: int = 1234, val_frac: float = 0.02) -> np.ndarray:
    """The token stream of the first stage's held-out stdlib files (its seed and split)."""
    from train_default_model import collect_files, encode_stream, read_text, split_files

    pairs = [(f, read_text(f)) for f in collect_files(Path(sysconfig.get_paths()["stdlib"]))]
    _, val = split_files([(f, t) for f, t in pairs if t is not None], val_frac, seed)
    return encode_stream(tok, [t for _, t in val])


@torch.no_grad()
def nll_at_positions(model, windows: list[np.ndarray]) -> np.ndarray:
    """Mean next-token NLL at each position over ``windows`` (each ``ctx + 1`` token ids)."""
    total = None
    for w in windows:
        x = torch.from_numpy(w)[None]
        logits = model(input_ids=x[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="none").double().numpy()
        total = nll if total is None else total + nll
    return total / len(windows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_DIR, help="a Qwen3-MoE checkpoint (default: the bundled)")
    ap.add_argument("--ctx", type=int, default=8192, help="positions scored per document")
    ap.add_argument("--files", type=int, default=64, help="the most modules scored")
    ap.add_argument("--buckets", default="1024,4096", help="inner edges of the position buckets")
    ap.add_argument("--seed", type=int, default=0, help="the inside windows' offsets")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cyclic", type=int, default=0, metavar="N", help="also the cyclic measure over the first N "
                    "tokens of the modules' stream (0: not)")
    ap.add_argument("--eval-stride", type=int, default=1024, help="the cyclic windows' spacing (divides --ctx)")
    ap.add_argument("--training-held-out", action="store_true", help="also the cyclic measure over the first "
                    "stage's held-out files (extend_default_model's own measure)")
    ap.add_argument("--no-docs", action="store_true", help="skip the from-the-start and from-inside measures")
    ap.add_argument("--attn-scale", type=float, default=None, help="the query temperature's scale (0: off; "
                    "default: the model config's attn_scale)")
    ap.add_argument("--floor-scale", type=int, default=None, help="the query temperature's floor_scale (default: "
                    "the model config's, else 1024)")
    args = ap.parse_args(argv)
    buckets = parse_buckets(args.buckets, args.ctx)

    from tokenizers import Tokenizer
    from transformers import Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    docs = held_out_modules(tok, args.ctx, args.files)
    if not docs:
        raise SystemExit(f"no stdlib test module has {args.ctx + 1} tokens")
    patch()  # the engine's query temperature at far positions, when the config has it
    model = Qwen3MoeForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    if args.attn_scale is not None or args.floor_scale is not None:
        cfg = model.config
        on = getattr(cfg, "attn_temperature_tuning", False)
        scale = args.attn_scale if args.attn_scale is not None else (cfg.attn_scale if on else 0.0)
        set_temperature(cfg, args.floor_scale or getattr(cfg, "floor_scale", 1024), scale)
    if getattr(model.config, "attn_temperature_tuning", False):
        print(f"# query temperature: attn_scale {model.config.attn_scale:g}, floor_scale {model.config.floor_scale}")
    if model.config.max_position_embeddings < args.ctx:
        print(f"note: the model's max_position_embeddings is {model.config.max_position_embeddings}, "
              f"less than --ctx {args.ctx}")
    rng = np.random.default_rng(args.seed)
    starts = [ids[:args.ctx + 1] for _, ids in docs]
    inside = []
    for _, ids in docs:
        room = ids.size - (args.ctx + 1)
        if room >= 1024:  # a window that does not start at the file's head
            o = int(rng.integers(1024, room + 1))
            inside.append(ids[o:o + args.ctx + 1])
    tokens = sum(int(ids.size) for _, ids in docs)
    print(f"# {args.model}: {len(docs)} stdlib test modules of >= {args.ctx + 1:,} tokens ({tokens:,} tokens in "
          f"all); {len(inside)} long enough for a window from inside")
    t0 = time.time()
    rows = {}
    if args.training_held_out:
        rows["first stage's held-out files, cyclic"] = loss_by_position(model, training_held_out(tok), args.ctx,
                                                                        args.eval_stride)
    if not args.no_docs:
        rows[f"from the start ({len(starts)} modules)"] = nll_at_positions(model, starts)
        if inside:
            rows[f"from inside ({len(inside)} modules)"] = nll_at_positions(model, inside)
    if args.cyclic:
        eot = tok.token_to_id("<|endoftext|>")
        stream = np.concatenate([np.append(ids, eot) for _, ids in docs])[:args.cyclic]
        rows[f"cyclic over {stream.size:,} tokens"] = loss_by_position(model, stream, args.ctx, args.eval_stride)
    table, numbers = bucket_table(rows, buckets)
    print(table)
    print()
    k = args.ctx // 1024
    print("| per 1,024 positions | " + " | ".join(f"{i}k" for i in range(k)) + " |")
    print("|---" * (k + 1) + "|")
    for name, per_pos in rows.items():
        per_k = per_pos[:k * 1024].reshape(k, 1024).mean(axis=1)
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in per_k) + " |")
    print()
    for name, vals in numbers.items():
        rises = [f"{a:,}-{b:,}" for (a, b), (prev, cur) in zip(buckets[1:], pairwise(vals), strict=True)
                 if cur > prev]
        print(f"{name}: " + (f"loss RISES in bucket(s) {', '.join(rises)}" if rises else
                             "loss does not rise with position"))
    print(f"(scored in {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
