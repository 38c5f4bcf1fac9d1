"""A model's decoder with its expert runner, from a config and a weight source (what ``freetoken.load`` does after
reading the files; tests build in-memory checkpoints through it too)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

from freetoken.engine.experts import make_runner
from freetoken.engine.loading.context import plan_context
from freetoken.engine.options import ExpertOptions, LoadOptions
from freetoken.models import MoeDecoder
from freetoken.models.config import ModelConfig
from freetoken.models.kv import KVPool
from freetoken.models.weights import HFWeights, Weights, expert_layouts


def build_decoder(cfg: ModelConfig, weights: Weights | Callable[[str], np.ndarray], device,
                  options: LoadOptions | None = None, *, warm_up: bool = True, **experts) -> MoeDecoder:
    """The decoder of ``cfg`` on ``device``; ``weights`` a :class:`Weights` source or ``get(hf_name)``.
    ``experts``: :class:`ExpertOptions` fields (``cache_slots=..., mode=...``) when no ``options`` are given.

    ``warm_up``: compile (or load from the on-disk caches) every kernel a forward pass uses now, so no prefill or
    decode is ever timed with compilation in it (:func:`warm_up_kernels`).

    The KV pool and the context are sized once the weights and the expert slots are in place
    (:func:`freetoken.engine.loading.context.plan_context`); the plan is kept as ``decoder.context_plan`` (its ``why``
    is the line ``run`` and ``chat`` print)."""
    if options is None:
        options = LoadOptions(experts=ExpertOptions(**experts))
    elif experts:
        raise TypeError("pass expert options inside options.experts, or as keywords without options")
    if not isinstance(weights, Weights):
        weights = HFWeights(cfg, weights)
    layouts = expert_layouts(cfg, weights, options.expert_format)
    reader = host_tier_reader(cfg, weights, layouts, options)
    runner = make_runner(device, layouts, sum(cfg.moe_layers), cfg.num_experts, cfg.top_k, options.experts,
                         reader=reader)
    decoder = MoeDecoder(cfg, weights, device, runner, progress=options.progress)
    plan = plan_context(cfg, device, options)
    pool = KVPool(device, len(cfg.kv_layers), cfg.kv_cache_heads, cfg.kv_cache_dim, plan.num_blocks, plan.kind,
                  values=cfg.kv_cache_values)
    decoder.set_context(pool, plan.ctx, plan.prefill_chunk)
    decoder.context_plan = plan
    if hasattr(runner, "set_predictor"):
        runner.set_predictor(decoder.route)
    if warm_up:
        warm_up_kernels(decoder, options.experts.max_decode_tokens + 1, progress=options.progress)
    return decoder


def host_tier_reader(cfg: ModelConfig, weights: Weights, layouts, options: LoadOptions):
    """The record reader of a host tier when ``options.experts.host_memory`` is below the routed experts' bytes
    (None when they fit, or no budget is given). Refused (ValueError): a source other than an FTW file (its experts
    cannot be read one at a time cheaply), an ``expert_format`` other than the stored one (every read would
    re-quantize), a budget under two layers' records."""
    from freetoken.cache.host_tier import minimum_bytes
    from freetoken.formats.parts import as_parts
    from freetoken.loaders.memory import gib

    budget = options.experts.host_memory
    if budget is None or not layouts:
        return None
    parts = [as_parts(lay, cfg.num_experts) for lay in layouts]
    total = sum(p.host_bytes for p in parts)
    if budget >= total:
        return None  # everything fits: the host pool as always
    from freetoken.models.ftw_weights import FTWWeights

    what = f"--host-memory {gib(budget)} is less than the routed experts' {gib(total)}"
    if not isinstance(weights, FTWWeights):
        raise ValueError(f"{what}: only an FTW file's experts can be read from disk one at a time; convert the model "
                         "first (freetoken convert MODEL OUT.ftw) and load OUT.ftw")
    if layouts != expert_layouts(cfg, weights, None):
        raise ValueError(f"{what}: records are read from the file as stored, and --expert-format "
                         f"{options.expert_format} would re-quantize every read; convert the file with --expert-format "
                         f"{options.expert_format} instead")
    least = minimum_bytes(parts)
    if budget < least:
        raise ValueError(f"{what}, and a host tier needs at least {gib(least)} ({least} bytes): the routed experts of "
                         "two MoE layers (a prompt streams whole layers through host memory)")
    from freetoken.loaders.ftw_records import FTWRecordReader

    return FTWRecordReader(weights.ftw, [i for i in range(cfg.num_layers) if cfg.is_moe(i)])


#: A warm-up prompt longer than this runs every prompt path (expert prefill kernels, streamed layers, chunked dense
#: products, array attention): the decode kernels take up to 16 tokens.
_DECODE_PATH_TOKENS = 16


def warm_up_kernels(decoder: MoeDecoder, prompt_tokens: int = _DECODE_PATH_TOKENS + 1,
                    progress: bool = False) -> float:
    """Run the kernels of a decode step and of a prompt once on a scratch sequence, then forget it (KV length 0,
    the expert runner as freshly loaded). First use compiles (NVRTC, g++ for emu, Numba); later runs load the
    binaries from the on-disk caches. Returns the seconds it took."""
    t0 = time.perf_counter()
    if progress:
        print(f"freetoken: preparing kernels for the {decoder.dev.kind} device (compiled once, then cached) ...",
              file=sys.stderr, flush=True)
    prompt = min(decoder.ctx, max(prompt_tokens, _DECODE_PATH_TOKENS + 1))
    decoder.reset()
    decoder.forward(np.zeros(1, np.int64))  # a decode step
    decoder.reset()
    if prompt > 1:
        decoder.forward(np.zeros(prompt, np.int64))  # a prompt (the prefill paths)
    decoder.reset()
    decoder.experts.reset()
    seconds = time.perf_counter() - t0
    if progress:
        print(f"freetoken: kernels ready in {seconds:.1f} s", file=sys.stderr, flush=True)
    return seconds
