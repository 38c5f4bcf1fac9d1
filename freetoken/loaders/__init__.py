"""Checkpoint readers: Hugging Face safetensors directories and GGUF files, lazy (memory-mapped) and validated.

- :class:`SafetensorsDir`: ``config.json`` + ``model.safetensors`` or ``model.safetensors.index.json`` and its
  shards; zero-copy NumPy views of tensors (BF16 / FP8 / E8M0 through ``ml_dtypes``); :func:`quantization`
  normalizes ``quantization_config`` / ``hf_quant_config.json``.
- :class:`GGUFFile`: metadata, tensors in NumPy order, raw quantized bytes, Q4_0 / MXFP4 expert banks for
  :class:`freetoken.cache.host_pool.HostPool`, the embedded tokenizer.
- :func:`tokenizer_from_gguf` / :func:`gguf_tokenizer_fields`: tokenizers from and to a GGUF's embedded
  vocabulary (``tokenizers.Tokenizer`` <-> ``tokenizer.ggml.*``): byte-level BPE (``gpt2``) both ways, and
  SentencePiece-style BPE (``llama``: Mixtral, Mistral, Llama-2 files) when loading.

Every failure caused by the files themselves is a :class:`LoadError` naming the file (and tensor).
"""

from freetoken.loaders.errors import LoadError
from freetoken.loaders.gguf_file import GGUFFile, GGUFTensorInfo, field_value
from freetoken.loaders.gguf_tokenizer import gguf_tokenizer_fields, tokenizer_from_gguf
from freetoken.loaders.safetensors_dir import (
    DTYPES,
    Quantization,
    SafetensorsDir,
    TensorInfo,
    parse_header,
    quantization,
)

__all__ = [
    "DTYPES",
    "GGUFFile",
    "GGUFTensorInfo",
    "LoadError",
    "Quantization",
    "SafetensorsDir",
    "TensorInfo",
    "field_value",
    "gguf_tokenizer_fields",
    "parse_header",
    "quantization",
    "tokenizer_from_gguf",
]
