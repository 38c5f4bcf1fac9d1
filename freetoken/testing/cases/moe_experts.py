"""Parity cases of ``ops.moe_experts`` (``cuda/moe_plan.cu`` with ``cuda/moe_decode.cu`` / ``cuda/moe_prefill.cu``)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from freetoken import formats, ops
from freetoken.device.constants import NO_ROUTE
from freetoken.formats import RecordLayout
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.compare import random_record
from freetoken.testing.reference.moe_experts import moe_forward_reference, moe_prefill_reference

# ---- moe_decode.cu / moe_prefill.cu (with moe_plan.cu) ----------------------------------------------------
#: Records whose down matrix has its own format ("<gate/up>+<down>"): GGUF Q4_K_M files keep down in Q6_K; Q5_K
#: gate/up with a Q8_0 down mixes block sizes (256 and 32) and header layouts in one record.
MIXED_RECORDS = ("q4_k+q6_k", "q5_k+q8_0")


def record_layout(name: str, size: str, bias: bool = False) -> tuple[RecordLayout, int]:
    """The case layout of record ``name`` (a format, or "<gate/up format>+<down format>") and its expert count. Small
    shapes: hidden 96, inter 160, 6 experts; formats of super-blocks (K a multiple of 256): hidden 256, inter 512, 5
    experts. Large: Qwen3-30B-A3B's experts (hidden 2048, inter 768, 8 experts)."""
    gate_up, _, down = name.partition("+")
    fmt, down_fmt = formats.get(gate_up), formats.get(down) if down else None
    if size == "large":
        hidden, inter, experts = 2048, 768, 8
    elif max(f.k_multiple for f in (fmt, down_fmt) if f) > 32:
        hidden, inter, experts = 256, 512, 5
    else:
        hidden, inter, experts = 96, 160, 6
    return RecordLayout(fmt, hidden, inter, bias, down_fmt=down_fmt), experts


@lru_cache(maxsize=4)
def _moe_record(name: str, size: str, bias: bool = False):
    """A quantized record set shared by the decode and prefill cases of one record layout (quantizing is slow)."""
    layout, experts = record_layout(name, size, bias)
    seed = formats.NAMES.index(name) if name in formats.NAMES else len(formats.NAMES) + MIXED_RECORDS.index(name)
    return layout, random_record(layout, experts, seed=seed, scale=0.05), experts


#: Tolerance (of max|y|) of the cpu int8 path against the reference with the same 8-bit rounding: the kernel rounds
#: its float32 h where the reference rounds float64 h cast to float32, so a value at a rounding boundary may land one
#: step (max|h| / 127 of its block) apart: ~|w| * weight * max|h| / 127 in an output, ~1e-4 of max|y| at the case
#: sizes (a wrongly decoded weight: ~1e-2).
Q8_REL_ATOL = 5e-4
#: Tolerance (of max|y|) of the prefill kernels (bf16 x, weights and h, as the reference rounds them): the kernel's
#: float32 h and the reference's float64 h may round to bf16 apart where h lies at a rounding boundary, one bf16 step
#: (2^-8 |h|) in every output of that pair's token; so may a super-block weight (d * scale * q - dmin * m in float32
#: against float64). Seen: 1.7e-4 of max|y| in one token of moe_prefill_q5_k on emu; on an H200 with tensor cores,
#: 7.7e-4 in 20 of 524288 outputs of the large moe_prefill_q5_k and 7.9e-4 in 2 of 10240 of moe_prefill_q5_k+q8_0
#: (the portable twin: 2.5e-4). A wrongly decoded weight or a lost route is ~1e-2 and more.
PREFILL_REL_ATOL = 2e-3
#: The formats whose cpu reduced path ("q8") takes bf16 tokens (x and h rounded to bf16, cpu_kernels/moe_bf16act.py)
#: rather than 8-bit blocks: checked against the reference with bf16 inputs, within :data:`PREFILL_REL_ATOL` (the
#: same h rounding boundaries; seen on the cpu: 3.3e-4 of max|y| in one of 40 random calls, most below 1e-6).
BF16_TOKEN_FORMATS = ("bf16", "fp8_block")


def _make_moe(fmt_name: str, mode: str, act: str = "swiglu", activations: str = "f32", prompt: bool = False,
              routes: int | None = None, skip: bool = False):
    """``fmt_name``: a format, or a mixed record of :data:`MIXED_RECORDS`. ``act`` "gpt_oss": records with biases,
    and routes with the same expert twice in a row, cancelling weights (+w and -w on one expert) and many tokens on
    one expert (token groups of 4, 2 and 1 in the cpu kernels). ``activations`` "q8": the cpu device's reduced path
    (x and h in 8-bit blocks, or in bf16 for :data:`BF16_TOKEN_FORMATS`) against the reference with the same
    rounding; "f32": the float path on every device.
    ``prompt``: 40 tokens of top-2 with skewed routing (experts with tens of tokens take the cpu int8 path's panel
    micro-kernel with a partial token tile, the rarest ones its row dots). ``routes``: the small shape's k (experts
    per token; more than the experts: some drawn twice) instead of the default. ``skip``: about a third of the pairs
    ``NO_ROUTE`` (a mixed-format layer's pairs of the other formats), the first token's all of them."""
    bias = act == "gpt_oss"

    def make(rng, size):
        layout, banks, experts = _moe_record(fmt_name, size, bias)
        if size == "small":
            tokens, k = ((3, 2) if not bias else (17, 8)) if mode == "decode" else (40, 2)
            if prompt:
                tokens, k = 40, 2
            k = routes or k
        else:
            tokens, k = (1, 8) if mode == "decode" else (256, 8)
        if bias or k > experts:
            ids = rng.integers(0, experts, (tokens, k)).astype(np.int32)
        elif prompt:
            p = np.array([0.3, 0.3, 0.2, 0.1, 0.07, 0.03])[:experts]
            ids = np.stack([rng.choice(experts, k, replace=False, p=p / p.sum()) for _ in range(tokens)])
            ids = ids.astype(np.int32)
        else:
            ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
        x = rng.standard_normal((tokens, layout.hidden)).astype(np.float32)
        weights = rng.random((tokens, k)).astype(np.float32)
        if bias and tokens >= 2 and k >= 2:
            ids[0, 1] = ids[0, 0]  # the same expert twice in one token's row: both contributions count
            ids[1, 1] = ids[1, 0]
            weights[1, :] = 0.0
            weights[1, :2] = [0.75, -0.75]  # cancelling weights on one expert
        if skip:
            ids[rng.random(ids.shape) < 0.35] = NO_ROUTE
            ids[0] = NO_ROUTE
        return {"layout": layout, "banks": banks, "x": x, "ids": ids, "weights": weights}

    def setup(dev, inp):
        return {"layout": inp["layout"], "banks": {n: dev.asarray(a) for n, a in inp["banks"].items()},
                "x": dev.asarray(inp["x"]), "ids": dev.asarray(inp["ids"]), "weights": dev.asarray(inp["weights"]),
                "out_y": poisoned(dev, inp["x"].shape, np.float32)}

    def launch(dev, st):
        ops.moe_experts(st["x"], st["ids"], st["weights"], st["banks"], st["layout"], act=act, mode=mode,
                        out=st["out_y"], device=dev, validate=False, activations=activations)

    def reference(inp):
        args = inp["x"], inp["ids"], inp["weights"]
        if mode == "prefill":
            return {"y": moe_prefill_reference(*args, inp["layout"], inp["banks"], act)}
        bf16_tokens = activations == "q8" and fmt_name in BF16_TOKEN_FORMATS
        return {"y": moe_forward_reference(*args, inp["layout"].dequantize(inp["banks"]), act,
                                           q8_inputs=activations == "q8" and not bf16_tokens,
                                           bf16_inputs=bf16_tokens)}

    def bytes_moved(inp):
        return len(np.unique(inp["ids"][inp["ids"] != NO_ROUTE])) * inp["layout"].record_bytes

    def flops(inp):
        return 6 * inp["ids"].size * inp["layout"].hidden * inp["layout"].inter

    name = (f"moe_{mode}_{fmt_name}" + ("_gpt_oss" if bias else "") + ("_q8" if activations == "q8" else "")
            + ("_prompt" if prompt else "") + (f"_k{routes}" if routes else "") + ("_skip" if skip else ""))
    if mode == "prefill" or (activations == "q8" and fmt_name in BF16_TOKEN_FORMATS):
        rel_atol = PREFILL_REL_ATOL  # bf16 tokens: the same rounding boundaries as the prefill kernels' h
    else:
        rel_atol = 2e-6 if activations == "f32" else Q8_REL_ATOL
    return KernelCase(name, f"moe_{mode}.cu", make, setup, launch, reference,
                      rtol=1e-5 if mode == "decode" else 1e-4, rel_atol=rel_atol, bytes_moved=bytes_moved,
                      flops=flops, cuda_only=mode == "prefill", cpu_only=activations == "q8", op="moe_experts")


SWIGLU_CASES = [_make_moe(f, m) for m in ("decode", "prefill") for f in formats.NAMES]
GPT_OSS_CASES = [_make_moe(f, m, "gpt_oss") for m in ("decode", "prefill") for f in formats.NAMES]
#: The cpu reduced path: row dots (swiglu: 1-2 tokens per expert, the two-row T = 1 path), the 4-bit formats' panel
#: micro-kernel (gpt_oss: ~22 tokens per expert, biases, repeated experts; the GGUF block formats, which have no
#: panel, run their row dots in groups of 4 tokens there) and both in one call (prompt); a Q4_K_M-style mixed record;
#: bf16 and fp8_block's bf16 dots.
Q8_FORMATS = ("q4_0", "mxfp4", "ds_fp4", "nvfp4", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs", "q4_k+q6_k",
              *BF16_TOKEN_FORMATS)
Q8_CASES = [_make_moe(f, "decode", a, "q8") for f in Q8_FORMATS for a in ("swiglu", "gpt_oss")] + [
    _make_moe(f, "decode", "swiglu", "q8", prompt=True) for f in Q8_FORMATS]
#: Mixed records (gate/up and down in different kernel families); they and the GGUF Q8_0 / K-quant formats also at
#: 1 and 8 routes per token (the default cases: 2 for swiglu, 8 with biases for gpt_oss).
MIXED_CASES = [_make_moe(r, m) for m in ("decode", "prefill") for r in MIXED_RECORDS]
ROUTES_CASES = [_make_moe(f, m, routes=k) for m in ("decode", "prefill") for k in (1, 8)
                for f in ("q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs", *MIXED_RECORDS)]
#: Pairs marked NO_ROUTE (skipped: a layer whose experts are in several formats runs once per format), on the float
#: paths of every device and the cpu int8 path.
SKIP_CASES = [_make_moe(f, m, routes=4, skip=True) for m in ("decode", "prefill") for f in ("q4_0", "mxfp4", "bf16")] \
    + [_make_moe("q4_0", "decode", "swiglu", "q8", prompt=True, skip=True)]
CASES = SWIGLU_CASES + GPT_OSS_CASES + Q8_CASES + MIXED_CASES + ROUTES_CASES + SKIP_CASES
