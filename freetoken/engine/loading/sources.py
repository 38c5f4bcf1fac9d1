"""Open a model's files as the decoder's weight source without building the decoder: what ``freetoken convert``
writes an FTW file from (:class:`freetoken.convert.ftw_export.FTWSource`), and how ``freetoken.load`` reads an
FTW file."""

from __future__ import annotations

from pathlib import Path

from freetoken.convert.ftw_export import FTWSource
from freetoken.loaders import LoadError
from freetoken.loaders.ftw_file import FTWFile, is_ftw
from freetoken.models.ftw_weights import FTWWeights, config_from_json


def open_ftw(path: Path, verify: str = "full") -> tuple[FTWFile, FTWSource]:
    """(the file, its source: config, weights and tokenizer side) of an FTW file or sharded set, its index (every
    shard's) checked."""
    ftw = FTWFile(path, verify=verify)
    cfg = config_from_json(ftw.index["model_config"], str(path))
    ix = ftw.index
    return ftw, FTWSource(cfg, FTWWeights(cfg, ftw), ix.get("tokenizer"), list(ix.get("eos_ids") or []),
                          ix.get("chat_template"), ix.get("source") or "")


def ftw_tokenizer_side(src: FTWSource, path: Path):
    """(tokenizer or None, eos ids, chat template or None) of an FTW file's index."""
    tokenizer = None
    if src.tokenizer_json is not None:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_str(src.tokenizer_json)
        except Exception as e:
            raise LoadError(str(path), f"its tokenizer does not load ({e})", "index") from None
    template = None
    if src.chat_template:
        from freetoken.engine.generation.chat import ChatTemplate

        template = ChatTemplate(src.chat_template["source"], src.chat_template.get("special_tokens"),
                                name=f"{path.name}: chat template")
    return tokenizer, list(src.eos_ids), template


def open_source(path: str | Path, allow_widen: bool = False) -> FTWSource:
    """An HF directory, a GGUF file or an FTW file as an :class:`FTWSource` (what ``freetoken convert`` reads)."""
    from freetoken.engine.loading.load import DEFAULT_MODEL, _eos_ids

    p = Path(path) if path is not None else DEFAULT_MODEL
    ftw_model = is_ftw(p)  # a file, or a sharded set by the name it was written as (which is no file)
    if not p.exists() and not ftw_model:
        raise LoadError(str(p), "no such model directory or file")
    if ftw_model:
        src = open_ftw(p)[1]
        src.name = f"{p.name}, from {src.name}" if src.name else p.name  # the chain of conversions
        return src
    if p.is_file():
        from freetoken.engine.loading.load_gguf import open_gguf

        cfg, weights, tokenizer, eos, template = open_gguf(p, kv_bytes=0, expert_format=None, allow_widen=allow_widen)
        return FTWSource(cfg, weights, tokenizer.to_str() if tokenizer is not None else None, eos,
                         _template_json(template), p.name)
    from freetoken.engine.loading.load import open_hf_dir

    cfg, weights, sd = open_hf_dir(p, kv_bytes=0, expert_format=None)
    tokenizer_json = (p / "tokenizer.json").read_text() if (p / "tokenizer.json").is_file() else None
    if tokenizer_json is None:
        from freetoken.loaders.tiktoken_tokenizer import is_tiktoken_dir, tokenizer_from_tiktoken

        if is_tiktoken_dir(p):
            tokenizer_json = tokenizer_from_tiktoken(p).to_str()
    template = None
    if tokenizer_json is not None:
        from freetoken.engine.generation.chat import ChatTemplate

        template = ChatTemplate.from_dir(p)
    tok = None
    if tokenizer_json is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tokenizer_json)
    return FTWSource(cfg, weights, tokenizer_json, _eos_ids(sd.config, p, tok), _template_json(template), p.name)


def _template_json(template) -> dict | None:
    return None if template is None else {"source": template.source, "special_tokens": template.special_tokens}
