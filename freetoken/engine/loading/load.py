"""``freetoken.load(path)``: a model directory (HF safetensors) or a GGUF file -> a ready :class:`Model`."""

from __future__ import annotations

import json
from pathlib import Path

from freetoken.device import get_device
from freetoken.engine.generation.chat import ChatTemplate
from freetoken.engine.generation.generate import Model
from freetoken.engine.loading.build import build_decoder
from freetoken.engine.loading.context import kv_load_bytes
from freetoken.engine.options import ExpertOptions, LoadOptions
from freetoken.loaders import LoadError, SafetensorsDir
from freetoken.loaders.ftw_file import is_ftw
from freetoken.models import from_hf
from freetoken.models.families import BY_NAME as FAMILIES
from freetoken.models.weights import HFWeights, check_hf_tensors

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "default_model"


def _eos_ids(config: dict, path: Path, tokenizer) -> list[int]:
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    tc = path / "tokenizer_config.json"
    if tokenizer is not None and tc.is_file():
        tok = json.loads(tc.read_text()).get("eos_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if isinstance(tok, str) and tokenizer.token_to_id(tok) is not None:
            ids.append(tokenizer.token_to_id(tok))
    return sorted(set(ids))


def load(path: str | Path | None = None, device="auto", expert_format: str | None = None, ctx: int | None = None,
         kv_dtype: str = "bf16", kv_memory: int | None = None, prefill_chunk: int | None = None,
         progress: bool = False, cache_slots: int | None = None, moe_mode: str = "gpu",
         pcie_gbps: float | None = None, cpu_gbps: float | None = None, future_value: float = 0.0,
         prefetch: bool = False, cpu_activations: str = "auto", allow_widen: bool = False, verify: str = "full",
         host_memory: int | None = None, cache_policy: str = "auto", kv_sequences: int = 1,
         options: LoadOptions | None = None) -> Model:
    """Load a model: an HF directory (``config.json`` + safetensors + ``tokenizer.json``, or Kimi-K2's
    ``tiktoken.model``; bf16/f16/f32 or block FP8), a GGUF file or an FTW file (docs/ftw.md; a sharded set by any
    shard or the name it was written as; ``verify``: its checksums, "full", "sample" or "none"); None: the
    bundled model.

    ``expert_format``: the :mod:`freetoken.formats` name the routed experts run in; default: as stored (bf16 for
    unquantized HF checkpoints, fp8_block for block-FP8 ones, q4_0/mxfp4 for such GGUF files). On gpu/emu the
    routed experts go through an expert cache of ``cache_slots`` slots (default: room for all).

    Context: ``ctx`` tokens at most (prompt and generated; default the model's ``max_position_embeddings`` capped
    by the KV pool), keys and values stored as ``kv_dtype`` (bf16, f16, f32 or fp8) in a paged pool of
    ``kv_memory`` bytes (default: sized from free memory, see :mod:`freetoken.engine.loading.context`); prompts run in
    forward passes of ``prefill_chunk`` tokens (default sized from the model's activations). ``kv_sequences``: the
    default pool makes room for that many whole contexts as far as the budget allows (a batching server's).

    Miss policy (gpu/emu): ``moe_mode`` ``gpu`` (copy every miss in), ``cpu`` (compute misses on the CPU),
    ``hybrid`` (q*: split by measured bandwidths) or ``auto`` (the stored ``freetoken bench bw`` profile's
    choice); ``pcie_gbps`` / ``cpu_gbps`` pin the oracle's figures; ``future_value``: seconds a fetched expert
    is worth beyond its step; ``prefetch``: copy the next layer's predicted experts while a layer computes;
    ``cache_policy``: how the cache picks victims (``auto``: ``next_use`` with ``moe_mode`` gpu and fewer slots than
    experts, else ``lru``; see :func:`freetoken.policy.runtime.resolve_cache_policy`).
    ``cpu_activations``: experts on the CPU with reduced activations ("q8": 8-bit blocks and int8 dots for the
    4-bit, q8_0 and k-quant formats, bf16 and bf16 dots for bf16 and fp8_block) or float32 ("f32"); "auto": q8
    where it is the fast path (AVX2 or AVX-512; AVX512-BF16 for fp8_block).
    ``allow_widen``: a GGUF file's non-expert matrices in a block
    type no dense storage keeps (Q5_0, Q3_K, ...) are widened to float32 instead of refused. ``host_memory``: bytes
    of host memory for the routed experts (default: all of them); below what they take, an FTW file's records are
    read from the file as steps need them into a host tier of that size (other sources are refused: convert first).

    ``options``: all of the above as one :class:`freetoken.engine.options.LoadOptions` (then the keywords are not
    used). Every kernel is compiled (or loaded from the on-disk caches) before this returns."""
    if options is None:
        options = LoadOptions(expert_format=expert_format, ctx=ctx, kv_dtype=kv_dtype, kv_memory=kv_memory,
                              kv_sequences=kv_sequences, prefill_chunk=prefill_chunk, progress=progress,
                              allow_widen=allow_widen, verify=verify,
                              experts=ExpertOptions(mode=moe_mode, cache_slots=cache_slots, pcie_gbps=pcie_gbps,
                                                    cpu_gbps=cpu_gbps, future_value=future_value,
                                                    prefetch=prefetch, cpu_activations=cpu_activations,
                                                    host_memory=host_memory, cache_policy=cache_policy))
    p = Path(path) if path is not None else DEFAULT_MODEL
    ftw_model = is_ftw(p)  # a file, or a sharded set by the name it was written as (which is no file)
    if not p.exists() and not ftw_model:
        raise LoadError(str(p), "no such model directory or file")
    dev = get_device(device)
    if ftw_model:
        from freetoken.engine.loading.sources import ftw_tokenizer_side, open_ftw

        ftw, src = open_ftw(p, options.verify)
        check_ftw_memory(ftw, src, kv_load_bytes(src.cfg, dev.kind, options), options.expert_format,
                         options.experts.host_memory)
        decoder = build_decoder(src.cfg, src.weights, dev, options)
        tokenizer, eos, template = ftw_tokenizer_side(src, p)
        return Model(decoder, tokenizer, eos, chat_template=template, weight_files=ftw.shards)
    if p.is_file():
        from freetoken.engine.loading.load_gguf import load_gguf

        decoder, tokenizer, eos, template = load_gguf(p, dev, options)
        return Model(decoder, tokenizer, eos, chat_template=template, weight_files=[p])
    cfg, weights, sd = open_hf_dir(p, kv_load_bytes_for(dev.kind, options), options.expert_format)
    decoder = build_decoder(cfg, weights, dev, options)
    tokenizer = None
    if (p / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(p / "tokenizer.json"))
    else:
        from freetoken.loaders.tiktoken_tokenizer import is_tiktoken_dir, tokenizer_from_tiktoken

        if is_tiktoken_dir(p):  # Kimi-K2 ships tiktoken.model instead
            tokenizer = tokenizer_from_tiktoken(p)
    chat_template = ChatTemplate.from_dir(p) if tokenizer is not None else None
    return Model(decoder, tokenizer, _eos_ids(sd.config, p, tokenizer), chat_template=chat_template,
                 weight_files=sd.files())


def kv_load_bytes_for(kind: str, options: LoadOptions):
    """The KV pool bytes a load on a ``kind`` device counts in its host-memory check (a function of the config)."""
    return lambda cfg: kv_load_bytes(cfg, kind, options)


def open_hf_dir(p: Path, kv_bytes, expert_format: str | None):
    """(config, weights, its :class:`SafetensorsDir`) of an HF checkpoint directory, its tensors checked by name
    and shape (``kv_bytes``: the KV pool bytes the host-memory check counts, or a function of the config giving
    them)."""
    sd = SafetensorsDir(p)
    q = sd.quantization()
    cfg = from_hf(sd.config, str(p / "config.json"))
    mxfp4 = q.method == "mxfp4" and FAMILIES[cfg.family].hf_experts_interleaved  # gpt-oss' release: MXFP4 experts
    if not mxfp4 and (q.method not in ("none", "fp8_block") or q.expert_format not in ("bf16", "fp8_block")):
        raise LoadError(str(p / "config.json"), f"{q.method} checkpoints are not supported by the runner yet "
                        "(bf16/f16/f32, block-FP8 and gpt-oss MXFP4 checkpoints are; their experts load through "
                        "freetoken.formats)")
    check_hf_tensors(cfg, sd, q.method == "fp8_block", kv_bytes(cfg) if callable(kv_bytes) else kv_bytes,
                     expert_format, mxfp4=mxfp4)
    weights = HFWeights(cfg, sd.get, sd.has, fp8_block=q.method == "fp8_block", where=str(p), mxfp4=mxfp4)
    return cfg, weights, sd


def check_ftw_memory(ftw, src, kv_bytes: int, expert_format: str | None, host_memory: int | None = None) -> int:
    """Refuse an FTW load whose host allocations exceed the memory available (as the HF and GGUF loads do);
    ``host_memory``: the routed experts take at most that much (a host tier over the file)."""
    from freetoken.loaders.ftw_file import FLOAT_STORAGES
    from freetoken.loaders.memory import check_load_bytes
    from freetoken.models.weights import expert_layouts, load_bytes

    dense = sum(4 * t.nbytes // FLOAT_STORAGES[t.storage].itemsize if t.storage in FLOAT_STORAGES else t.nbytes
                for t in ftw.tensors.values())
    need = load_bytes(src.cfg, dense, expert_format, kv_bytes, expert_layouts(src.cfg, src.weights, expert_format))
    if expert_format is None:
        need["float32 experts of one layer while quantized"] = 0  # the records move as stored
    if host_memory is not None:
        need["expert banks"] = min(need["expert banks"], int(host_memory))
    return check_load_bytes(ftw.path, need)
