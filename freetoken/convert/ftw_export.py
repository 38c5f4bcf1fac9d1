"""Write an FTW file (docs/ftw.md) from any weight source the decoder reads: an HF directory, a GGUF file or
another FTW file (:func:`freetoken.engine.sources.open_source` opens them).

Tensors are stored under the decoder's canonical keys: a matrix the source keeps in a block type the decoder runs
(a GGUF Q4_K attention matrix, a block-FP8 projection) as those blocks, bit for bit; every other tensor as float,
in the narrowest of bf16, f16 and f32 that holds its values exactly (an HF bf16 checkpoint stays bf16). Routed
experts are written one record per expert, in the formats the source stores them in, or quantized to
``expert_format`` (with :mod:`freetoken.formats`), or each in the format an ``expert_plan`` names for it
(:mod:`.expert_plan`). The file appears only when complete (:mod:`.atomic`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from freetoken.convert.atomic import atomic_output
from freetoken.formats import RecordLayout
from freetoken.formats.parts import ExpertParts
from freetoken.loaders.ftw_file import (
    ALIGN,
    RECORD_HEADER_BYTES,
    VERSION,
    aligned,
    checksum,
    record_header,
    write_preamble,
)
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


class _Writer:
    def __init__(self, f):
        self.f, self.at = f, ALIGN

    def put(self, *parts: bytes | np.ndarray) -> tuple[int, int]:
        """Write ``parts`` at the next aligned offset; (offset, bytes)."""
        self.f.seek(self.at)
        n = 0
        for p in parts:
            b = memoryview(np.ascontiguousarray(p)).cast("B") if isinstance(p, np.ndarray) else p
            self.f.write(b)
            n += len(b)
        offset, self.at = self.at, aligned(self.at + n)
        return offset, n


def write_ftw(source: FTWSource, out: str | Path, expert_format: str | None = None, progress: bool = False,
              force: bool = False, expert_plan: list[list[str]] | None = None) -> Path:
    """Write ``source`` as the FTW file ``out``; returns its path. ``expert_plan`` (one list of E format names per
    MoE layer, in MoE-layer order; see :mod:`freetoken.convert.expert_plan`) writes each expert's record in its
    planned format instead of one format for all."""
    out = Path(out)
    if out.exists() and not force:
        raise ValueError(f"{out}: exists; pass --force to replace it")
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
    tensors, records = [], []
    with atomic_output(out) as tmp, open(tmp, "w+b") as f:
        w = _Writer(f)
        for kind, item in steps:
            if kind == "tensor":
                name, fetch = item
                tensors.append(_write_tensor(w, name, fetch()))
            else:
                records += _write_layer(w, weights, *item)
        index = {"format": "ftw", "version": VERSION, "writer": f"freetoken {__version__}",
                 "source": source.name, "model_config": config_to_json(cfg),
                 "tokenizer": source.tokenizer_json, "eos_ids": [int(i) for i in source.eos_ids],
                 "chat_template": source.chat_template,
                 "record_layout": {"hidden": cfg.hidden, "inter": cfg.moe_inter, "bias": cfg.expert_bias,
                                   "act": cfg.expert_act},
                 "tensors": tensors, "records": records}
        raw = json.dumps(index, separators=(",", ":")).encode()
        index_offset, index_bytes = w.put(raw)
        end = index_offset + index_bytes
        f.truncate(end)
        write_preamble(f, index_offset, index_bytes, checksum(raw), end)
        f.flush()
    return out


def _write_tensor(w: _Writer, name: str, value) -> dict:
    if isinstance(value, QuantizedMatrix):
        storage, data, shape = value.kind, value.blocks, value.shape
    else:
        storage, data = compact_float(value)
        shape = tuple(value.shape)
    offset, n = w.put(data)
    return {"name": name, "storage": storage, "shape": [int(d) for d in shape], "offset": offset, "bytes": n,
            "xxh3": checksum(np.ascontiguousarray(data))}


def _write_layer(w: _Writer, weights: Weights, layer: int, layouts: list[RecordLayout]) -> list[dict]:
    """Write ``layer``'s expert records, expert ``e`` in ``layouts[e]``: the source's banks are fetched (and
    quantized) once per distinct layout, and each record takes its expert's rows of its own layout's banks."""
    from freetoken.formats.base import ALIGNMENT

    banks, specs = {}, {}
    for layout in dict.fromkeys(layouts):  # distinct layouts, first-use order
        banks[layout] = weights.expert_banks(layer, layout)
        layout.check(banks[layout])
        specs[layout] = layout.bank_specs()
    out = []
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
        offset, n = w.put(head, bytes.fromhex(sum_), payload)
        assert n == RECORD_HEADER_BYTES + layout.record_bytes
        out.append({"layer": layer, "expert": e, "format": layout.fmt.name,
                    "down_format": layout.format_of("down").name, "offset": offset, "bytes": n, "xxh3": sum_})
    return out
