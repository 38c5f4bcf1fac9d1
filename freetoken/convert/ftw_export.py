"""Write an FTW file (docs/ftw.md) from any weight source the decoder reads: an HF directory, a GGUF file or
another FTW file (:func:`freetoken.engine.loading.sources.open_source` opens them).

Tensors are stored under the decoder's canonical keys: a matrix the source keeps in a block type the decoder runs
(a GGUF Q4_K attention matrix, a block-FP8 projection) as those blocks, bit for bit; every other tensor as float,
in the narrowest of bf16, f16 and f32 that holds its values exactly (an HF bf16 checkpoint stays bf16). Routed
experts are written one record per expert, in the formats the source stores them in, or quantized to
``expert_format`` (with :mod:`freetoken.formats`), or each in the format an ``expert_plan`` names for it
(:mod:`.expert_plan`). With ``shard_bytes`` the model is written as a set of shards of about that size
(:mod:`.ftw_output`). The file, or every shard of the set, appears only when all are complete (:mod:`.atomic`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from freetoken.convert.atomic import atomic_set
from freetoken.convert.ftw_output import FTWOutput, check_shard_bytes
from freetoken.formats import RecordLayout
from freetoken.formats.parts import ExpertParts
from freetoken.loaders.ftw_file import RECORD_HEADER_BYTES, VERSION, checksum, record_header
from freetoken.loaders.ftw_shards import set_files
from freetoken.models.config import ModelConfig
from freetoken.models.ftw_weights import config_to_json, tensor_name
from freetoken.models.qmatrix import QuantizedMatrix
from freetoken.models.weights import Weights, expert_layouts, global_shapes, layer_shapes
from freetoken.version import __version__


@dataclass
class FTWSource:
    """What an FTW file is written from: the decoder's config and weights, and the tokenizer side."""

    cfg: ModelConfig
    weights: Weights
    tokenizer_json: str | None = None
    eos_ids: list[int] = field(default_factory=list)
    chat_template: dict | None = None  # {"source": ..., "special_tokens": {...}}
    name: str = ""  # where it came from (recorded in the index)


def decoder_keys(cfg: ModelConfig, layer: int | None) -> list[str]:
    """The weight keys the decoder reads (of ``layer``, or the global ones), routed experts aside."""
    if layer is None:
        return list(global_shapes(cfg))
    keys = list(layer_shapes(cfg, layer))
    if "lin_ba" in keys:  # Qwen3-Next stores b and a fused; the decoder reads them apart
        i = keys.index("lin_ba")
        keys[i:i + 1] = ["lin_b", "lin_a"]
    return keys


def compact_float(a: np.ndarray) -> tuple[str, np.ndarray]:
    """(storage, stored array): float32 values in bf16 or f16 when that holds them exactly, else f32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = (a.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    if np.array_equal((bits.astype(np.uint32) << np.uint32(16)).view(np.float32), a, equal_nan=True):
        return "bf16", bits
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    if np.array_equal(h.astype(np.float32), a, equal_nan=True):
        return "f16", h
    return "f32", a


def _tensor_plan(cfg: ModelConfig, weights: Weights) -> list[tuple[str, Callable]]:
    plan = []
    for layer in (None, *range(cfg.num_layers)):
        for key in decoder_keys(cfg, layer):
            if key == "lm_head" and cfg.tie_word_embeddings:
                continue

            def fetch(key=key, layer=layer):
                if weights.quantized_kind(key, layer):
                    return weights.get_matrix(key, layer)
                return weights.get(key, layer)

            plan.append((tensor_name(key, layer), fetch))
    return plan


def existing_outputs(out: Path) -> list[Path]:
    """What a conversion to ``out`` would replace: the file itself and the shards of any set written as ``out``."""
    return ([out] if out.exists() else []) + set_files(out)


def write_ftw(source: FTWSource, out: str | Path, expert_format: str | None = None, progress: bool = False,
              force: bool = False, expert_plan: list[list[str]] | None = None,
              shard_bytes: int | None = None) -> Path:
    """Write ``source`` as the FTW file ``out``; returns its path. ``expert_plan`` (one list of E format names per
    MoE layer, in MoE-layer order; see :mod:`freetoken.convert.expert_plan`) writes each expert's record in its
    planned format instead of one format for all. ``shard_bytes``: write a set of shards ``NAME-00001-of-0000N.ftw``
    (``out`` is ``NAME.ftw``) of at most that many bytes of tensors and records each (the index comes on top; an
    item larger than that gets a shard of its own), and return shard 1's path; one file when all fits in one."""
    out = Path(out)
    check_shard_bytes(shard_bytes)
    replaced = existing_outputs(out)
    if replaced and not force:
        raise ValueError(f"{replaced[0]}: exists; pass --force to replace it")
    if expert_format is not None and expert_plan is not None:
        raise ValueError("give an expert format or an expert plan, not both")
    cfg, weights = source.cfg, source.weights
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    if expert_plan is None:
        # a source layer that mixes formats (an FTW file) keeps each expert's own
        per_expert = [[lay.layouts[lay.part_of(int(lay.local_of[e]))] for e in range(cfg.num_experts)]
                      if isinstance(lay, ExpertParts) else [lay] * cfg.num_experts
                      for lay in expert_layouts(cfg, weights, expert_format)]
    else:
        from freetoken.convert.expert_plan import check_plan, format_layouts

        check_plan(expert_plan, len(moe), cfg.num_experts)
        by_name = format_layouts(cfg, [f for row in expert_plan for f in row])
        per_expert = [[by_name[f] for f in row] for row in expert_plan]
    plan = _tensor_plan(cfg, weights)
    steps = [("tensor", p) for p in plan] + [("layer", (i, lay)) for i, lay in zip(moe, per_expert, strict=True)]
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"writing {out.name}", unit="step", leave=False)
    with atomic_set(out) as files:
        w = FTWOutput(files, shard_bytes)
        try:
            for kind, item in steps:
                if kind == "tensor":
                    name, fetch = item
                    _write_tensor(w, name, fetch())
                else:
                    _write_layer(w, weights, *item)
                if progress and shard_bytes is not None:
                    steps.set_postfix_str(f"shard {len(w.shards)}", refresh=False)
        finally:
            w.abandon()
        head = {"format": "ftw", "version": VERSION, "writer": f"freetoken {__version__}"}
        model = {"source": source.name, "model_config": config_to_json(cfg),
                 "tokenizer": source.tokenizer_json, "eos_ids": [int(i) for i in source.eos_ids],
                 "chat_template": source.chat_template,
                 "record_layout": {"hidden": cfg.hidden, "inter": cfg.moe_inter, "bias": cfg.expert_bias,
                                   "act": cfg.expert_act}}
        written = w.finish(head, model, out)
    for old in set(replaced) - set(written):  # --force: a set of another shard count, or a single file, goes
        old.unlink(missing_ok=True)
    return written[0]


def _write_tensor(w: FTWOutput, name: str, value) -> None:
    if isinstance(value, QuantizedMatrix):
        storage, data, shape = value.kind, value.blocks, value.shape
    else:
        storage, data = compact_float(value)
        shape = tuple(value.shape)
    shard, offset, n = w.put(data)
    shard.tensors.append({"name": name, "storage": storage, "shape": [int(d) for d in shape], "offset": offset,
                          "bytes": n, "xxh3": checksum(np.ascontiguousarray(data))})


def _write_layer(w: FTWOutput, weights: Weights, layer: int, layouts: list[RecordLayout]) -> None:
    """Write ``layer``'s expert records, expert ``e`` in ``layouts[e]``: the source's banks are fetched (and
    quantized) once per distinct layout, and each record takes its expert's rows of its own layout's banks."""
    from freetoken.formats.base import ALIGNMENT

    banks, specs = {}, {}
    for layout in dict.fromkeys(layouts):  # distinct layouts, first-use order
        banks[layout] = weights.expert_banks(layer, layout)
        layout.check(banks[layout])
        specs[layout] = layout.bank_specs()
    for e, layout in enumerate(layouts):
        parts = []
        for s in specs[layout]:
            row = np.ascontiguousarray(banks[layout][s.name][e])
            parts.append(row)
            pad = -row.nbytes % ALIGNMENT
            if pad:
                parts.append(b"\0" * pad)
        payload = b"".join(memoryview(p).cast("B") if isinstance(p, np.ndarray) else p for p in parts)
        head = record_header(layout.fmt.name, layout.format_of("down").name, layout.bias, layer, e, len(payload))
        sum_ = checksum(head, payload)
        shard, offset, n = w.put(head, bytes.fromhex(sum_), payload)
        assert n == RECORD_HEADER_BYTES + layout.record_bytes
        shard.records.append({"layer": layer, "expert": e, "format": layout.fmt.name,
                              "down_format": layout.format_of("down").name, "offset": offset, "bytes": n,
                              "xxh3": sum_})
