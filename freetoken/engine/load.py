"""``freetoken.load(path)``: a model directory (HF safetensors) -> a ready :class:`Model`."""

from __future__ import annotations

import json
from pathlib import Path

from freetoken.device import get_device
from freetoken.engine.generate import Model
from freetoken.loaders import LoadError, SafetensorsDir, quantization
from freetoken.models import MoeDecoder, from_hf

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "default_model"


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


def load(path: str | Path | None = None, device="auto", expert_format: str = "bf16", max_len: int = 2048,
         progress: bool = False, cache_slots: int | None = None) -> Model:
    """Load a model directory (HF ``config.json`` + safetensors + ``tokenizer.json``); None: the bundled model.

    On gpu/emu the routed experts go through an expert cache of ``cache_slots`` slots (default: room for all)."""
    p = Path(path) if path is not None else DEFAULT_MODEL
    if not p.exists():
        raise LoadError(str(p), "no such model directory or file")
    if p.is_file():
        raise LoadError(str(p), "loading single-file models (GGUF) is not supported yet; pass an HF model directory")
    sd = SafetensorsDir(p)
    q = quantization(sd.config, sd.hf_quant_config)
    if q.method != "none":
        raise LoadError(str(p / "config.json"), f"{q.method} checkpoints are not supported by the runner yet "
                        "(their experts load through freetoken.formats, the non-expert linears do not)")
    cfg = from_hf(sd.config)
    dev = get_device(device)
    decoder = MoeDecoder(cfg, sd.get_f32, dev, expert_format=expert_format, max_len=max_len, progress=progress,
                         cache_slots=cache_slots)
    tokenizer = None
    if (p / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(p / "tokenizer.json"))
    return Model(decoder, tokenizer, _eos_ids(sd.config, p, tokenizer))
