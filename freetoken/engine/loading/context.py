"""How long a context a loaded model gets, how big its KV pool is, and how many prompt tokens one forward pass takes.

The pool is sized after the weights and the expert slots are in place (:func:`plan_context`, called by
:func:`freetoken.engine.loading.build.build_decoder`), from a memory budget:

* ``--kv-memory SIZE`` (``LoadOptions.kv_memory``): that many bytes, on any device;
* gpu, by default: the device memory still free after the weights and the expert slots, less
  :data:`GPU_MARGIN_BYTES` (activations of a prefill chunk, the expert runner's prefill buffers, library
  workspaces), but never more than the context needs;
* cpu/emu, by default: what the context needs (``--ctx``, else ``max_position_embeddings``), capped at
  :data:`HOST_KV_FRACTION` of the host memory still available after the weights loaded (the rest is left for
  prefill activations, the OS and other processes: a pool the OS has to swap out is worse than a shorter context).
  Pool pages are touched only as the sequence grows, so a large context costs nothing until it is used.

A batching server (``--max-seqs N``, ``LoadOptions.kv_sequences``) wants room for N whole contexts: the need is N
times the context's, under the same budget, and the context itself is sized as for one sequence (the pool's other
contexts are best effort: when the requests together outgrow the pool the scheduler preempts the newest).

The context is ``--ctx`` when given (a clear error when the budget cannot hold it; beyond the model's
``max_position_embeddings`` it is allowed, and said), else ``max_position_embeddings`` capped by what the pool
holds.

The prefill chunk (``--prefill-chunk``, default :func:`default_prefill_chunk`): the largest power of two in
[:data:`MIN_PREFILL_CHUNK`, :data:`MAX_PREFILL_CHUNK`] whose activations (an estimate per token from the config) fit
in :data:`PREFILL_ACTIVATION_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.device.constants import LINEAR_CHUNK, LINEAR_CHUNK_RECORD
from freetoken.engine.options import LoadOptions
from freetoken.loaders.memory import available_bytes, gib
from freetoken.models.config import ModelConfig
from freetoken.models.kv import KV_BLOCK_TOKENS, kv_block_bytes, kv_token_bytes

#: GPU memory left free beside the KV pool by default.
GPU_MARGIN_BYTES = 1 << 30
#: Share of the available host memory the default pool of the cpu/emu devices may take.
HOST_KV_FRACTION = 0.5
#: Activation budget of one forward pass over a prompt chunk, and the bounds of the default chunk.
PREFILL_ACTIVATION_BYTES = 256 << 20
MIN_PREFILL_CHUNK, MAX_PREFILL_CHUNK = 512, 2048


@dataclass(frozen=True)
class ContextPlan:
    """The outcome: ``ctx`` tokens in a pool of ``num_blocks`` blocks of kind ``kind``; ``why`` says in words."""

    ctx: int
    kind: str
    num_blocks: int
    pool_bytes: int
    prefill_chunk: int
    why: str


def activation_bytes_per_token(cfg: ModelConfig) -> int:
    """An upper estimate of the float32 activations one prompt token carries through a layer at once: the residual
    stream and its norms, q/k/v and the attention output, the MLP's widest intermediate (gate and up of the routed
    experts of one token, or the dense/shared MLP), the router logits; for a Gated DeltaNet layer, its projections
    and the chunked rule's scratch on gpu/emu (a record of ``LINEAR_CHUNK_RECORD`` floats per value head and
    ``LINEAR_CHUNK`` tokens)."""
    qkv = (cfg.num_heads * (2 if cfg.attn_output_gate else 1) + 2 * cfg.num_kv_heads) * cfg.head_dim
    # a Gated DeltaNet layer's projections: q|k|v channels, z, b and a
    qkv = max(qkv, cfg.linear_conv_dim + cfg.linear_v_heads * (cfg.linear_v_dim + 2))
    scratch = -(-cfg.linear_v_heads * LINEAR_CHUNK_RECORD // LINEAR_CHUNK)  # 0 without linear layers
    mlp = max(cfg.dense_inter, cfg.top_k * cfg.moe_inter, cfg.shared_inter)
    return 4 * (8 * cfg.hidden + 2 * qkv + cfg.num_heads * cfg.head_dim + 3 * mlp + cfg.num_experts + scratch)


def default_prefill_chunk(cfg: ModelConfig) -> int:
    per_token = activation_bytes_per_token(cfg)
    chunk = MAX_PREFILL_CHUNK
    while chunk > MIN_PREFILL_CHUNK and chunk * per_token > PREFILL_ACTIVATION_BYTES:
        chunk //= 2
    return chunk


def gpu_free_bytes(device) -> tuple[int, int]:
    """(bytes free on the GPU, counting what CuPy's pool holds unused; total bytes)."""
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return int(free) + int(cupy.get_default_memory_pool().free_bytes()), int(total)


def _budget(cfg: ModelConfig, device, options: LoadOptions, need: int) -> tuple[int, str]:
    """(bytes the pool may take, where that figure comes from)."""
    if options.kv_memory is not None:
        return options.kv_memory, f"--kv-memory {gib(options.kv_memory)}"
    if device.kind == "gpu":
        free, _ = gpu_free_bytes(device)
        room = free - GPU_MARGIN_BYTES
        if room <= 0:
            raise ValueError(f"no GPU memory is left for the KV cache: {gib(free)} free after the weights and the "
                             f"expert slots, {gib(GPU_MARGIN_BYTES)} kept as a margin (fewer --cache-slots, or "
                             "--kv-memory SIZE)")
        return min(room, need), (f"{gib(free)} GPU memory free after weights and expert slots, less a "
                                 f"{gib(GPU_MARGIN_BYTES)} margin")
    avail, source = available_bytes()
    if avail is None:
        return need, "the context's need (available host memory unknown)"
    cap = int(avail * HOST_KV_FRACTION)
    return min(need, cap), f"{HOST_KV_FRACTION:g} of the available host memory ({source}: {gib(avail)})"


def plan_context(cfg: ModelConfig, device, options: LoadOptions) -> ContextPlan:
    """The context and KV pool of ``cfg`` on ``device`` as ``options`` ask (see the module doc); ValueError naming
    the flag when they cannot be met."""
    kind = options.kv_dtype
    block = kv_block_bytes(len(cfg.kv_layers), cfg.kv_cache_heads, cfg.kv_cache_dim, kind, values=cfg.kv_cache_values)
    want = options.ctx or cfg.max_position
    want_blocks = -(-want // KV_BLOCK_TOKENS)
    seqs = options.kv_sequences
    budget, source = _budget(cfg, device, options, seqs * want_blocks * block)
    blocks = budget // block
    if options.kv_memory is None:
        blocks = min(blocks, seqs * want_blocks)
    if blocks < 1:
        raise ValueError(f"the KV budget ({source}) holds no block of {KV_BLOCK_TOKENS} tokens: one takes "
                         f"{gib(block)} as {kind}")
    held = blocks * KV_BLOCK_TOKENS
    if options.ctx is not None:
        if options.ctx > held:
            raise ValueError(f"--ctx {options.ctx} needs a KV pool of {gib(want_blocks * block)} ({kind}); the budget "
                             f"({source}) holds {held} tokens (--kv-memory SIZE or --kv-dtype fp8 give more)")
        ctx, reason = options.ctx, "--ctx"
        if ctx > cfg.max_position:
            reason += (f", beyond the model's max_position_embeddings {cfg.max_position}: later positions are "
                       "untrained")
    elif held >= cfg.max_position:
        ctx, reason = cfg.max_position, "the model's max_position_embeddings"
    else:
        ctx, reason = held, f"max_position_embeddings {cfg.max_position} capped by the KV budget: {source}"
    chunk = options.prefill_chunk or default_prefill_chunk(cfg)
    chunk_why = "--prefill-chunk" if options.prefill_chunk else "default"
    pool = blocks * block
    holds = f", room for {blocks * KV_BLOCK_TOKENS / ctx:.1f} of {seqs} sequences' whole contexts" if seqs > 1 else ""
    why = (f"context {ctx} tokens ({reason}); KV pool {kind} {gib(pool)}, {blocks} blocks of {KV_BLOCK_TOKENS} "
           f"tokens{holds}; prefill chunk {chunk} tokens ({chunk_why})")
    return ContextPlan(ctx=ctx, kind=kind, num_blocks=blocks, pool_bytes=pool, prefill_chunk=chunk, why=why)


def kv_load_bytes(cfg: ModelConfig, device_kind: str, options: LoadOptions) -> int:
    """Host bytes the KV pool will take, for the load's memory check before the weights load: the explicit
    ``kv_memory`` or ``ctx`` on the host devices; 0 when the pool is sized later from what is left (it never takes
    more than :data:`HOST_KV_FRACTION` of that) or lives on the GPU."""
    if device_kind == "gpu":
        return 0
    if options.kv_memory is not None:
        return options.kv_memory
    if options.ctx is not None:
        return options.ctx * kv_token_bytes(len(cfg.kv_layers), cfg.kv_cache_heads, cfg.kv_cache_dim, options.kv_dtype,
                                            values=cfg.kv_cache_values)
    return 0
