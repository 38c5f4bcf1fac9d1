#!/usr/bin/env python
"""Extend the bundled default model's context: continued training at a long context with a raised RoPE base.

``scripts/train_default_model.py`` trains the model at context 256; its positions beyond that were never seen.
A coding agent's conversation is thousands of tokens, so this second stage

1. loads the bundled model and keeps its tokenizer (the token ids, and so every test prompt, stay the same);
2. raises ``rope_theta`` (default 10,000 -> 500,000: the slow rotary dimensions then turn less than a radian
   over the new context, so long distances look like the short ones the model learned, not like angles it has
   never seen) and sets ``max_position_embeddings`` to the new context;
3. trains on random windows of that length from the same stdlib training files (the held-out files are the
   same ones: same seed and split as the first stage), AdamW with warmup and cosine decay over ``--max-steps``;
4. measures held-out loss by position bucket (0-1k, 1k-4k, 4k-8k by default) before and after. Every held-out
   token is scored at every bucket: windows start every ``--eval-stride`` tokens around the held-out stream
   (cyclically), so each bucket sees the same tokens and a difference between buckets is the position's
   effect, not the files';
5. saves bfloat16 into ``--out`` (the bundled directory by default) and adds a "Context extension" section,
   with those tables, to its README.md.

Usage:  python scripts/extend_default_model.py --max-steps 150
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_attn_temperature import patch as patch_attn_temperature  # noqa: E402
from hf_attn_temperature import set_temperature  # noqa: E402
from train_default_model import (  # noqa: E402 - the first stage's data pipeline, so the split is the same
    collect_files,
    encode_stream,
    log,
    make_optimizer,
    patch_artifacts,
    read_text,
    set_lr,
    split_files,
    train_step,
)

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "freetoken" / "default_model"
SECTION = "## Context extension"


def parse_buckets(text: str, ctx: int) -> list[tuple[int, int]]:
    """"1024,4096" -> [(0, 1024), (1024, 4096), (4096, ctx)]."""
    edges = [0, *(int(v) for v in text.split(",") if v.strip()), ctx]
    if any(b <= a for a, b in pairwise(edges)):
        raise SystemExit(f"--buckets {text!r}: edges must rise strictly inside (0, --ctx {ctx})")
    return list(pairwise(edges))


@torch.no_grad()
def loss_by_position(model, ids: np.ndarray, ctx: int, stride: int) -> np.ndarray:
    """Mean next-token NLL at each position 0..ctx-1 over windows starting every ``stride`` tokens of the
    cyclic held-out stream: with ctx a multiple of stride every token is scored once in each stride-long span."""
    model.eval()
    n = len(ids)
    ring = np.concatenate([ids, ids[:ctx + 1]])
    total = np.zeros(ctx, np.float64)
    count = 0
    for start in range(0, n, stride):
        w = torch.from_numpy(ring[start:start + ctx + 1].astype(np.int64))[None]
        logits = model(input_ids=w[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="none")
        total += nll.double().numpy()
        count += 1
    model.train()
    return total / count


def bucket_table(rows: dict[str, np.ndarray], buckets: list[tuple[int, int]]) -> tuple[str, dict]:
    """A markdown table of the mean loss per bucket, one row per model, and the numbers."""
    head = "| model | " + " | ".join(f"positions {a:,}-{b:,}" for a, b in buckets) + " |"
    lines = [head, "|---" * (len(buckets) + 1) + "|"]
    numbers = {}
    for name, per_pos in rows.items():
        vals = [float(per_pos[a:b].mean()) for a, b in buckets]
        numbers[name] = vals
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in vals) + " |")
    return "\n".join(lines), numbers


def set_rope(config, theta: float, ctx: int) -> None:
    config.max_position_embeddings = ctx
    config.rope_parameters = {"rope_type": "default", "rope_theta": float(theta)}
    if hasattr(config, "rope_theta"):
        config.rope_theta = float(theta)


def write_section(readme: Path, text: str) -> None:
    """Replace README.md's section (up to the next ``## `` heading, which is kept) or add it at the end."""
    old = readme.read_text() if readme.exists() else ""
    parts = re.split(rf"\n{re.escape(SECTION)}\n", old, maxsplit=1)
    before = parts[0].rstrip("\n")
    after = ""
    if len(parts) == 2:
        nxt = re.search(r"^## ", parts[1], flags=re.M)
        after = "\n" + parts[1][nxt.start():] if nxt else ""
    readme.write_text(before + "\n\n" + text.rstrip("\n") + "\n" + after)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=str(DEFAULT_DIR), help="the model to extend (default: the bundled one)")
    ap.add_argument("--out", default=str(DEFAULT_DIR), help="where the extended model goes")
    ap.add_argument("--seed", type=int, default=1234, help="the first stage's seed: it fixes the held-out files")
    ap.add_argument("--val-frac", type=float, default=0.02, help="the first stage's held-out fraction")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192, help="the new context (training window and max positions)")
    ap.add_argument("--train-ctx", type=int, default=None, help="training window, when longer than --ctx (default "
                    "--ctx): a window of 8,192 holds a distance near 8k only a few times, so the model's last "
                    "positions see rarely trained distances and more keys than it learned to share attention over; "
                    "training on longer windows covers them as well as the middle ones")
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--attn-scale", type=float, default=None, help="set the query temperature's attn_scale (Llama 4's "
                    "attention temperature tuning, kept at the base's floor_scale) before training; default: as the "
                    "base has it. Measured on the stage 6 model (4 held-out windows of 32,768): 0.1 lowered the "
                    "16k-32k bucket by 0.021 nats against 0.06, 0.15 raised every bucket")
    ap.add_argument("--far-weight", type=float, default=1.0, help="weigh the training loss by position: 1 up to "
                    "--far-from, rising linearly to this at the window's end, normalised to mean 1 (default 1: "
                    "every position alike). The windows string unrelated files together, so far context mostly is "
                    "not the document: this makes learning to ignore it worth more than the early positions")
    ap.add_argument("--far-from", type=int, default=4096, help="where --far-weight's ramp starts")
    ap.add_argument("--batch", type=int, default=1, help="windows per step")
    ap.add_argument("--max-steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--buckets", default="1024,4096", help="inner edges of the position buckets")
    ap.add_argument("--eval-stride", type=int, default=1024, help="start of a held-out window every this many "
                    "tokens (must divide --ctx)")
    ap.add_argument("--skip-base-eval", action="store_true", help="do not score the base model first")
    ap.add_argument("--data-seed", type=int, default=None, help="the training windows' seed (default --seed + 1; "
                    "another one for a further stage, so that it sees other windows)")
    ap.add_argument("--label", default=None, help="the extended model's name in the loss table")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="leave the result in a temporary directory")
    args = ap.parse_args()
    if args.ctx % args.eval_stride:
        raise SystemExit(f"--eval-stride {args.eval_stride} must divide --ctx {args.ctx}")
    buckets = parse_buckets(args.buckets, args.ctx)
    train_ctx = args.ctx if args.train_ctx is None else args.train_ctx
    if train_ctx < args.ctx:
        raise SystemExit(f"--train-ctx {train_ctx} is shorter than --ctx {args.ctx}")

    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

    # train and score with the query temperature the engine applies when the config turns it on (the bundled
    # config does, from position floor_scale - 1): otherwise training would fit attention the engine never runs
    patch_attn_temperature()
    t_start = time.time()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    base = Path(args.base)

    # ---- data: the first stage's files and split, the bundled tokenizer -------------------------------
    pairs = [(f, read_text(f)) for f in collect_files(Path(sysconfig.get_paths()["stdlib"]))]
    pairs = [(f, t) for f, t in pairs if t is not None]
    train_pairs, val_pairs = split_files(pairs, args.val_frac, args.seed)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    train_ids = encode_stream(tok, [t for _, t in train_pairs])
    val_ids = encode_stream(tok, [t for _, t in val_pairs])
    log(f"stdlib files: train {len(train_pairs)} ({len(train_ids):,} tokens), held out {len(val_pairs)} "
        f"({len(val_ids):,} tokens)")
    if len(train_ids) <= train_ctx + 1 or len(val_ids) < args.eval_stride:
        raise SystemExit(f"not enough text for context {args.ctx}")

    # ---- model ---------------------------------------------------------------------------------------
    model = Qwen3MoeForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    base_cfg = {"rope_theta": (model.config.rope_parameters or {}).get("rope_theta"),
                "max_position_embeddings": model.config.max_position_embeddings}
    rows = {}
    if not args.skip_base_eval:
        t0 = time.time()
        rows[f"base (rope_theta {base_cfg['rope_theta']:g}, trained at 256)"] = loss_by_position(
            model, val_ids, args.ctx, args.eval_stride)
        log(f"base model scored in {time.time() - t0:.0f}s:\n{bucket_table(rows, buckets)[0]}")

    set_rope(model.config, args.rope_theta, args.ctx)
    if args.attn_scale is not None:
        set_temperature(model.config, int(getattr(model.config, "floor_scale", 8192) or 8192), args.attn_scale)
    # the rotary tables are built from the config at construction: rebuild them for the new base
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = args.aux_coef
    model.train()

    opt = make_optimizer(model, args.lr, args.weight_decay)
    gen = np.random.default_rng(args.seed + 1 if args.data_seed is None else args.data_seed)
    n_starts = len(train_ids) - train_ctx - 1
    weights = None
    if args.far_weight != 1.0:
        ramp = np.clip((np.arange(train_ctx) - args.far_from) / max(1, train_ctx - args.far_from), 0.0, 1.0)
        w = 1.0 + (args.far_weight - 1.0) * ramp
        weights = torch.from_numpy((w / w.mean()).astype(np.float32))[None]
    t_train = time.time()
    ema = None
    for step in range(args.max_steps):
        progress = max(0, step - args.warmup) / max(1, args.max_steps - args.warmup)
        lr = set_lr(opt, args.lr, step, args.warmup, progress, args.min_lr_ratio)
        starts = gen.integers(0, n_starts, size=args.batch)
        x = torch.from_numpy(np.stack([train_ids[s:s + train_ctx] for s in starts]))
        y = torch.from_numpy(np.stack([train_ids[s + 1:s + train_ctx + 1] for s in starts]))
        lm, aux, gn = train_step(model, opt, x, y, args.aux_coef, args.clip, weights)
        ema = lm.item() if ema is None else 0.9 * ema + 0.1 * lm.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.max_steps:
            el = time.time() - t_train
            log(f"step {step + 1}/{args.max_steps} lm {lm.item():.3f} (ema {ema:.3f}) aux {aux.item():.3f} "
                f"gnorm {gn.item():.2f} lr {lr:.2e} {el / 60:.1f} min, {(step + 1) * x.numel() / el:.0f} tok/s")
    train_time = time.time() - t_train
    tokens_seen = args.max_steps * args.batch * train_ctx

    # ---- save bf16, reload, score ----------------------------------------------------------------------
    work = Path(tempfile.mkdtemp(prefix="ft_extend_"))
    model.to(torch.bfloat16)
    model.config.output_router_logits = False
    model.save_pretrained(work)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / fn, work / fn)
    # the saved bf16 weights, computed in float32 as freetoken computes them (and several times faster on a CPU
    # without bf16 arithmetic than transformers' bf16 path)
    re_model = Qwen3MoeForCausalLM.from_pretrained(work, dtype=torch.float32, attn_implementation="sdpa")
    label = f"{args.label or 'extended'} (rope_theta {args.rope_theta:g}, {args.max_steps} steps at {train_ctx})"
    rows[label] = loss_by_position(re_model, val_ids, args.ctx, args.eval_stride)
    table, numbers = bucket_table(rows, buckets)
    log(table)
    per_k = rows[label][:args.ctx - args.ctx % 1024].reshape(-1, 1024).mean(axis=1)
    log("held-out loss per 1,024 positions: " + " ".join(f"{v:.3f}" for v in per_k))
    ext = list(numbers.values())[-1]
    rises = [f"{a:,}-{b:,}" for (a, b), (prev, cur) in zip(buckets[1:], pairwise(ext), strict=True) if cur > prev]
    if rises:
        log(f"WARNING: held-out loss rises with position in bucket(s) {', '.join(rises)}")

    tok2 = PreTrainedTokenizerFast.from_pretrained(work)
    enc = tok2("def fibonacci(n):", return_tensors="pt")
    with torch.no_grad():
        sample = tok2.decode(re_model.generate(**enc, max_new_tokens=60, do_sample=False, pad_token_id=1)[0])
    log(f"--- greedy sample ---\n{sample}")
    if args.no_write:
        log(f"--no-write: the extended checkpoint is in {work}")
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != base.resolve():
        for p in base.iterdir():
            if p.is_file():
                shutil.copy(p, out / p.name)
    for fn in ("config.json", "model.safetensors"):
        shutil.copy(work / fn, out / fn)
    patch_artifacts(out, ctx_max=args.ctx)
    c = json.loads((out / "config.json").read_text())
    c["rope_theta"] = float(args.rope_theta)  # the canonical key, beside transformers-5's rope_parameters
    (out / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    ticks = "`" * 3
    section = f"""{SECTION}

The model above was trained at context 256. `scripts/extend_default_model.py` then extended it to
**{args.ctx:,} positions** (`max_position_embeddings`): `rope_theta` {base_cfg['rope_theta']:g} -> {args.rope_theta:g},
then {args.max_steps} steps of continued training on random {train_ctx:,}-token windows of the same training files
({args.batch} window(s) a step, {tokens_seen:,} tokens), AdamW peak lr {args.lr:g} ({args.warmup} warmup steps,
cosine to {args.min_lr_ratio:g}x), router aux loss {args.aux_coef:g}; {train_time / 60:.1f} min on {args.threads}
CPU threads (torch {torch.__version__}, SDPA attention, fp32 training, saved in bfloat16). Re-create with:

    python scripts/train_default_model.py --minutes 20
    python scripts/extend_default_model.py --max-steps {args.max_steps}

Held-out loss (nats/token; the bfloat16 weights computed in float32) by position in a {args.ctx:,}-token window.
Windows start every {args.eval_stride:,}
tokens around the held-out stream ({len(val_ids):,} tokens of {len(val_pairs)} files, taken cyclically), so every
held-out token is scored in every bucket and the buckets differ only by position:

{table}

Greedy continuation of `def fibonacci(n):` (60 tokens, `transformers`):

{ticks}python
{sample}
{ticks}
"""
    write_section(out / "README.md", section)
    log(f"wrote {out} ({(time.time() - t_start) / 60:.1f} min in all)")


if __name__ == "__main__":
    main()
