#!/usr/bin/env python
"""Train freetoken's bundled default model: a tiny Qwen3-MoE trained on the
Python standard library.

Pipeline (fully reproducible with fixed seeds):

1. Collect the .py files of the running interpreter's stdlib
   (``sysconfig.get_paths()["stdlib"]``), skipping site-packages, caches and
   test directories; hold out ~2% of the files for validation.
2. Train a byte-level BPE tokenizer (vocab 4096) on the training files.
3. Train a ``Qwen3MoeForCausalLM`` (causal LM on the files concatenated with
   ``<|endoftext|>`` separators, context 256, AdamW with warmup + cosine
   decay, gradient clipping, router load-balancing aux loss) within a
   wall-clock budget (``--minutes``).
4. Save in bfloat16 with ``save_pretrained``, reload, re-evaluate, measure
   per-layer expert usage on the validation set, sample, and write the
   artifacts (config.json, model.safetensors, tokenizer.json,
   tokenizer_config.json, README.md) into ``freetoken/default_model/``.

Usage:  python scripts/train_default_model.py --minutes 20
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

EOS = "<|endoftext|>"
PAD = "<|pad|>"
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages",
                 "__pycache__", "lib2to3_tests"}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{{ '\n' }}{% endfor %}"
)


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------

def collect_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS
                             and not d.startswith("test_") and not d.endswith("_test"))
        # lib2to3/tests etc. are covered by "tests"; skip any test-ish path part
        if any(p in EXCLUDED_DIRS for p in rel.parts):
            continue
        for fn in sorted(filenames):
            if fn.endswith(".py") and not fn.startswith("test_"):
                files.append(Path(dirpath) / fn)
    return files


def read_text(p: Path) -> str | None:
    try:
        t = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return t if t.strip() else None


def split_files(files, val_frac, seed):
    rng = random.Random(seed)
    files = list(files)
    rng.shuffle(files)
    n_val = max(1, round(len(files) * val_frac))
    return files[n_val:], files[:n_val]


# ----------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(PAD) == 1
    return tok


def encode_stream(tok, texts) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    out = []
    for i in range(0, len(texts), 64):
        for enc in tok.encode_batch(texts[i:i + 64]):
            out.extend(enc.ids)
            out.append(eos)
    return np.asarray(out, dtype=np.int64)


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------

def make_config(args):
    from transformers import Qwen3MoeConfig

    assert args.hidden_size % 32 == 0 and args.moe_intermediate_size % 32 == 0
    cfg = Qwen3MoeConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        initializer_range=0.02,
    )
    return cfg


def make_optimizer(model, lr: float, weight_decay: float):
    """AdamW (betas 0.9/0.95) with weight decay on the matrices only (not on norms, biases, scalars)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)


def set_lr(opt, peak: float, step: int, warmup: int, progress: float, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay from ``peak`` to ``min_ratio * peak`` as ``progress``
    goes from 0 to 1; sets it on every parameter group and returns it."""
    if step < warmup:
        lr = peak * (step + 1) / warmup
    else:
        lr = peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


def train_step(model, opt, x, y, aux_coef: float, clip: float, position_weights=None):
    """One optimizer step on the causal LM loss of explicit targets plus the router load-balancing loss; returns
    (LM loss, aux loss, gradient norm before clipping). ``position_weights`` ([T], mean 1): the loss of position
    p weighs that much (the reported LM loss stays the plain mean)."""
    out = model(input_ids=x, output_router_logits=True)
    nll = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), y.reshape(-1),
                                          reduction="none").view(y.shape)
    lm = nll.mean()
    objective = lm if position_weights is None else (nll * position_weights).mean()
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros(())
    opt.zero_grad(set_to_none=True)
    (objective + aux_coef * aux).backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return lm, aux, gn


@torch.no_grad()
def evaluate(model, data: np.ndarray, ctx: int, batch: int, usage=False):
    """Mean next-token NLL (nats/token) over non-overlapping windows of the
    validation stream; optionally per-layer expert usage fractions."""
    model.eval()
    cfg = model.config
    n_win = (len(data) - 1) // ctx
    tot_loss, tot_tok = 0.0, 0
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.float64)
    for s in range(0, n_win, batch):
        idx = range(s, min(s + batch, n_win))
        x = torch.from_numpy(np.stack([data[i * ctx:(i + 1) * ctx] for i in idx]))
        y = torch.from_numpy(np.stack([data[i * ctx + 1:(i + 1) * ctx + 1] for i in idx]))
        out = model(input_ids=x, output_router_logits=usage)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        tot_loss += loss.item()
        tot_tok += y.numel()
        if usage:
            for li, rl in enumerate(out.router_logits):
                top = rl.float().topk(cfg.num_experts_per_tok, dim=-1).indices
                counts[li] += torch.bincount(top.reshape(-1), minlength=cfg.num_experts).double()
    model.train()
    if usage:
        # fraction of tokens routed to each expert (each token picks top_k, so
        # rows sum to top_k); normalise to share of routing slots as well
        frac = counts / (tot_tok)
        return tot_loss / tot_tok, frac
    return tot_loss / tot_tok


def patch_artifacts(out: Path, ctx_max: int = 1024):
    """Make the copied config/tokenizer files friendlier to other loaders:
    config.json gets the canonical Qwen3-MoE keys ``num_experts`` and
    ``rope_theta`` next to transformers-5's ``num_local_experts`` /
    ``rope_parameters``; tokenizer_config.json gets an inline chat template, a
    generic tokenizer class and a sane model_max_length."""
    cp = out / "config.json"
    c = json.loads(cp.read_text())
    if "num_local_experts" in c:
        c.setdefault("num_experts", c["num_local_experts"])
    rp = c.get("rope_parameters") or {}
    if "rope_theta" in rp:
        c.setdefault("rope_theta", rp["rope_theta"])
    cp.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    tp = out / "tokenizer_config.json"
    t = json.loads(tp.read_text())
    t["chat_template"] = CHAT_TEMPLATE
    t["tokenizer_class"] = "PreTrainedTokenizerFast"
    t["model_max_length"] = ctx_max
    t["eos_token"] = EOS
    t["pad_token"] = PAD
    tp.write_text(json.dumps(t, indent=2, sort_keys=True) + "\n")
    return c


@torch.no_grad()
def verify_out(out: Path, val_ids: np.ndarray, ctx: int, batch: int):
    """Load the bundled directory with the Auto* classes and re-evaluate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    t = AutoTokenizer.from_pretrained(out)
    assert t.eos_token_id == 0, t.eos_token_id
    assert next(m.parameters()).dtype == torch.bfloat16
    return evaluate(m, val_ids, ctx, batch)


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "freetoken" / "default_model"))
    ap.add_argument("--workdir", default=None, help="scratch dir for checkpoints (default: temp dir)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--val-frac", type=float, default=0.02)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=192)
    ap.add_argument("--intermediate-size", type=int, default=384)
    ap.add_argument("--moe-intermediate-size", type=int, default=96)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="fixed number of steps (0: train for --minutes, schedule by wall-clock fraction)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--experts-impl", default="eager", help="transformers experts implementation")
    ap.add_argument("--no-write", action="store_true", help="do not write into --out")
    args = ap.parse_args()

    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)  # noqa: NPY002 - also seeds libraries that use the legacy global generator
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

    # ---- data -------------------------------------------------------------
    root = Path(sysconfig.get_paths()["stdlib"])
    files = collect_files(root)
    pairs = [(f, read_text(f)) for f in files]
    pairs = [(f, t) for f, t in pairs if t is not None]
    train_pairs, val_pairs = split_files(pairs, args.val_frac, args.seed)
    train_texts = [t for _, t in train_pairs]
    val_texts = [t for _, t in val_pairs]
    log(f"stdlib: {root}  files: {len(pairs)} (train {len(train_pairs)}, val {len(val_pairs)}), "
        f"chars train {sum(map(len, train_texts)):,} val {sum(map(len, val_texts)):,}")

    # ---- tokenizer ----------------------------------------------------------
    t0 = time.time()
    tok = train_tokenizer(train_texts, args.vocab_size)
    train_ids = encode_stream(tok, train_texts)
    val_ids = encode_stream(tok, val_texts)
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained+encoded in {time.time() - t0:.1f}s; "
        f"train tokens {len(train_ids):,} val tokens {len(val_ids):,} "
        f"({sum(map(len, train_texts)) / len(train_ids):.2f} chars/token)")

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="ft_default_model_"))
    work.mkdir(parents=True, exist_ok=True)
    tok_path = work / "tokenizer.json"
    tok.save(str(tok_path))
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token=EOS, pad_token=PAD,
                                     bos_token=None, unk_token=None)
    hf_tok.chat_template = CHAT_TEMPLATE

    # ---- model --------------------------------------------------------------
    cfg = make_config(args)
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(cfg)
    try:
        model.set_experts_implementation(args.experts_impl)
    except Exception as e:  # older/newer transformers
        log(f"(could not set experts implementation {args.experts_impl!r}: {e})")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} params ({n_params * 2 / 1e6:.2f} MB in bf16)")
    model.train()

    opt = make_optimizer(model, args.lr, args.weight_decay)

    gen = np.random.default_rng(args.seed)
    n_starts = len(train_ids) - args.ctx - 1

    def get_batch():
        starts = gen.integers(0, n_starts, size=args.batch)
        x = np.stack([train_ids[s:s + args.ctx] for s in starts])
        y = np.stack([train_ids[s + 1:s + args.ctx + 1] for s in starts])
        return torch.from_numpy(x), torch.from_numpy(y)

    budget = args.minutes * 60.0
    # With --max-steps the cosine schedule runs over a fixed number of steps
    # (bit-reproducible). Otherwise the schedule follows the wall-clock
    # fraction of the --minutes budget, which is robust to throughput changes
    # on a shared machine (the data order and init are still seeded).
    step = 0
    tokens_seen = 0
    t_train = time.time()
    ema = None
    while True:
        elapsed = time.time() - t_train
        if args.max_steps:
            if step >= args.max_steps:
                break
            progress = step / args.max_steps
        else:
            if elapsed >= budget:
                break
            progress = elapsed / budget
        lr = set_lr(opt, args.lr, step, args.warmup, progress, args.min_lr_ratio)
        x, y = get_batch()
        lm, aux, gn = train_step(model, opt, x, y, args.aux_coef, args.clip)
        step += 1
        tokens_seen += x.numel()
        ema = lm.item() if ema is None else 0.95 * ema + 0.05 * lm.item()
        if step % args.log_every == 0:
            el = time.time() - t_train
            log(f"step {step} ({progress:.0%}) lm {lm.item():.3f} "
                f"(ema {ema:.3f}) aux {aux.item():.3f} gnorm {gn.item():.2f} lr {lr:.2e} "
                f"tokens {tokens_seen:,} {el / 60:.1f}min {tokens_seen / el:.0f} tok/s")
    train_time = time.time() - t_train
    log(f"training done: {step} steps, {tokens_seen:,} tokens, {train_time / 60:.1f} min")

    val_fp32 = evaluate(model, val_ids, args.ctx, args.eval_batch)
    log(f"val loss (fp32 weights): {val_fp32:.4f} nats/token")

    # ---- save bf16, reload, re-evaluate ---------------------------------------
    ckpt = work / "ckpt"
    model.to(torch.bfloat16)
    model.config.output_router_logits = False
    model.save_pretrained(ckpt)
    hf_tok.save_pretrained(ckpt)
    shutil.copy(tok_path, ckpt / "tokenizer.json")  # keep the exact tokenizers file

    re = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    re.eval()
    val_bf16, usage = evaluate(re, val_ids, args.ctx, args.eval_batch, usage=True)
    log(f"val loss (reloaded bf16 checkpoint): {val_bf16:.4f} nats/token")
    cfg_json = json.loads((ckpt / "config.json").read_text())
    size = (ckpt / "model.safetensors").stat().st_size
    log(f"checkpoint dtype {cfg_json.get('dtype', cfg_json.get('torch_dtype'))}, "
        f"model.safetensors {size / 1e6:.2f} MB")
    assert size <= 16 * 1024 * 1024, "model.safetensors over 16 MB"

    usage_lines = []
    for li in range(usage.shape[0]):
        row = usage[li]
        share = row / row.sum()
        ent = -(share * share.clamp_min(1e-12).log()).sum().item() / math.log(len(share))
        usage_lines.append(
            f"layer {li}: " + " ".join(f"{v:.2f}" for v in row.tolist())
            + f"  | min {row.min():.2f} max {row.max():.2f} norm-entropy {ent:.3f}")
    log("expert usage (fraction of validation tokens routed to each expert; rows sum to top_k="
        f"{cfg.num_experts_per_tok}):")
    for line in usage_lines:
        log("  " + line)

    # ---- samples --------------------------------------------------------------
    tok2 = PreTrainedTokenizerFast.from_pretrained(ckpt)
    prompt = "def fibonacci(n):"
    enc = tok2(prompt, return_tensors="pt")
    samples = {}
    with torch.no_grad():
        g = re.generate(**enc, max_new_tokens=80, do_sample=False, pad_token_id=1)
        samples["greedy"] = tok2.decode(g[0], skip_special_tokens=False)
        torch.manual_seed(args.seed)
        g = re.generate(**enc, max_new_tokens=80, do_sample=True, temperature=0.8, top_k=0,
                        top_p=1.0, pad_token_id=1)
        samples[f"temperature 0.8 (seed {args.seed})"] = tok2.decode(g[0], skip_special_tokens=False)
    for k, v in samples.items():
        log(f"--- sample ({k}) ---\n{v}\n")

    total_time = time.time() - t_start
    if args.no_write:
        log(f"--no-write: checkpoint left in {ckpt}")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fn in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / fn, out / fn)
    cfg_json = patch_artifacts(out)
    val_out = verify_out(out, val_ids, args.ctx, args.eval_batch)
    log(f"val loss (bundled dir reloaded via AutoModelForCausalLM): {val_out:.4f} nats/token")
    assert abs(val_out - val_bf16) < 1e-3, (val_out, val_bf16)
    init = out / "__init__.py"
    if not init.exists():
        init.write_text('"""Bundled default model for freetoken (tiny Qwen3-MoE trained on the '
                        'Python stdlib)."""\n')

    cfg_keys = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "intermediate_size", "decoder_sparse_step",
                "norm_topk_prob", "tie_word_embeddings", "max_position_embeddings",
                "rms_norm_eps", "router_aux_loss_coef"]
    cfg_table = "\n".join(f"| `{k}` | `{cfg_json.get(k)}` |" for k in cfg_keys)
    ticks = "`" * 3
    readme = f"""# freetoken default model

A tiny **Mixture-of-Experts** language model in the **Qwen3-MoE** architecture
(`Qwen3MoeForCausalLM`), bundled with freetoken so that e.g.
`freetoken run "def fibonacci(n):"` works on a fresh machine with no download.
It was trained from scratch on the Python standard library, so it writes
Python-looking code (it is not a useful assistant). Its routing is trained
with the load-balancing auxiliary loss, so the experts are all used and the
per-layer routing has structure.

Generated by `scripts/train_default_model.py` (reproducible: fixed seed
{args.seed}). Re-create with:

    python scripts/train_default_model.py --minutes {args.minutes:g}

## Files

| file | size |
|---|---|
| `config.json` | {(out / 'config.json').stat().st_size:,} B |
| `model.safetensors` (bfloat16) | {size:,} B |
| `tokenizer.json` | {tok_path.stat().st_size:,} B |
| `tokenizer_config.json` | {(out / 'tokenizer_config.json').stat().st_size:,} B |

## Model

{n_params:,} parameters, all decoder layers are sparse MoE blocks
({cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, SwiGLU experts), tied embeddings, weights in bfloat16.

| key | value |
|---|---|
{cfg_table}

## Data

All `.py` files of the CPython {sys.version.split()[0]} standard library
(`sysconfig.get_paths()["stdlib"]`), excluding `site-packages`, `__pycache__`
and test code (directories `test`, `tests`, `idle_test`, files `test_*.py`):
{len(pairs)} files, {sum(map(len, train_texts)) + sum(map(len, val_texts)):,} characters.
A random {args.val_frac:.0%} of the files ({len(val_pairs)} files, {len(val_ids):,} tokens)
is held out for validation; the rest ({len(train_ids):,} tokens) is used for training.
Files are concatenated, separated by `<|endoftext|>`.

## Tokenizer

Byte-level BPE (`tokenizers`; ByteLevel pre-tokenizer and decoder, no prefix
space), vocabulary {tok.get_vocab_size()}, trained on the training files. Special
tokens: `<|endoftext|>` (id 0, EOS) and `<|pad|>` (id 1).
About {sum(map(len, train_texts)) / len(train_ids):.2f} characters per token on the training data.

## Training

Causal LM, context {args.ctx}, batch {args.batch} random windows
({args.batch * args.ctx} tokens/step), AdamW (betas 0.9/0.95, weight decay
{args.weight_decay} on matrices), peak lr {args.lr:g} with {args.warmup} warmup steps and
cosine decay to {args.min_lr_ratio:g}x, gradient clipping {args.clip:g}, router
load-balancing aux loss with coefficient {args.aux_coef:g}. CPU only
(torch {torch.__version__}, {args.threads} threads), fp32 training.

- steps: {step}
- tokens seen: {tokens_seen:,} (~{tokens_seen / len(train_ids):.2f} epochs)
- training time: {train_time / 60:.1f} min (whole pipeline {total_time / 60:.1f} min)
- final train loss (EMA): {ema:.3f} nats/token

## Validation

Mean next-token cross-entropy on the held-out files (non-overlapping
windows of {args.ctx}):

- fp32 weights at end of training: **{val_fp32:.4f} nats/token**
- bf16 checkpoint reloaded with `transformers`: **{val_bf16:.4f} nats/token**
  (same from this directory via `AutoModelForCausalLM`: {val_out:.4f})

## Expert usage on the validation set

Fraction of validation tokens routed to each expert (each token selects
{cfg.num_experts_per_tok} experts, so a row sums to {cfg.num_experts_per_tok}; uniform would be
{cfg.num_experts_per_tok / cfg.num_experts:.2f} each). "norm-entropy" is the entropy of the
routing-slot distribution divided by log({cfg.num_experts}) (1.0 = perfectly uniform).

{ticks}
""" + "\n".join(usage_lines) + f"""
{ticks}

## Samples

Prompt `def fibonacci(n):`, 80 new tokens, `transformers` `generate`.

""" + "\n".join(f"{k}:\n\n{ticks}python\n{v}\n{ticks}\n" for k, v in samples.items())
    (out / "README.md").write_text(readme)
    log(f"wrote {out}")
    for p in sorted(out.iterdir()):
        if p.is_file():
            log(f"  {p.name}: {p.stat().st_size:,} B")


if __name__ == "__main__":
    main()
