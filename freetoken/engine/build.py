"""A model's decoder with its expert runner, from a config and a weight source (what ``freetoken.load`` does after
reading the files; tests build in-memory checkpoints through it too)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

from freetoken.engine.context import plan_context
from freetoken.engine.experts import make_runner
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
    (:func:`freetoken.engine.context.plan_context`); the plan is kept as ``decoder.context_plan`` (its ``why``
    is the line ``run`` and ``chat`` print)."""
    if options is None:
        options = LoadOptions(experts=ExpertOptions(**experts))
    elif experts:
        raise TypeError("pass expert options inside options.experts, or as keywords without options")
    if not isinstance(weights, Weights):
        weights = HFWeights(cfg, weights)
    layouts = expert_layouts(cfg, weights, options.expert_format)
    runner = make_runner(device, layouts, sum(cfg.moe_layers), cfg.num_experts, cfg.top_k, options.experts)
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
