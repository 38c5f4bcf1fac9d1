"""Where the decoder's weights come from: an HF safetensors checkpoint or a GGUF file, behind one interface.

The decoder asks for tensors by canonical key (``"embed"``, ``"q_proj"`` of layer 3, ...) as float32 and for a
MoE layer's routed experts as record banks in its expert format. Each source maps the keys to its own tensor
names and decodes its own storage types:

- :class:`HFWeights`: ``model.layers.N.*`` names (Mixtral's ``block_sparse_moe`` included); bf16/f16/f32 tensors
  and DeepSeek-style block FP8 (``weight`` e4m3 + ``weight_scale_inv`` per 128x128 block), whose routed experts
  move into ``fp8_block`` banks without re-quantization.
- :class:`GGUFWeights`: llama.cpp names (``token_embd``, ``blk.N.attn_q``, ``blk.N.ffn_gate_exps``...); any
  type gguf-py can dequantize for the non-expert tensors; Q4_0 / MXFP4 experts move into ``q4_0`` / ``mxfp4``
  banks bit for bit. llama.cpp's converter permutes the Q/K rows of ``llama``-architecture models (its RoPE
  rotates adjacent pairs, HF's rotates halves); those rows are put back in HF order here.

Experts in any other storage are decoded to float32 and quantized into the requested format.

``get_matrix`` serves the decoder's dense projections: GGUF Q8_0 / Q4_0 matrices as
:class:`freetoken.models.qmatrix.QuantizedMatrix` (their file blocks, never dequantized; llama Q/K rows un-permuted
as whole block rows), every other tensor as ``get`` returns it.
"""

from __future__ import annotations

import numpy as np

from freetoken.formats import MATRICES, RecordLayout
from freetoken.loaders.errors import LoadError
from freetoken.models.config import ModelConfig
from freetoken.models.qmatrix import QuantizedMatrix

#: Per-layer canonical keys -> HF names relative to ``model.layers.N.`` (``{moe}``: ``mlp.`` or Mixtral's
#: ``block_sparse_moe.``).
_HF_LAYER = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    **{f"{x}_proj": f"self_attn.{x}_proj.weight" for x in "qkvo"},
    **{f"{x}_bias": f"self_attn.{x}_proj.bias" for x in "qkv"},
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "router": "{moe}gate.weight",
    **{f"shared_{w}": f"mlp.shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")},
    "shared_sigmoid": "mlp.shared_expert_gate.weight",
    **{f"mlp_{w}": f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")},
}
_HF_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}

#: The same keys in llama.cpp's GGUF names (relative to ``blk.N.``).
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "q_proj": "attn_q.weight", "k_proj": "attn_k.weight", "v_proj": "attn_v.weight", "o_proj": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "router": "ffn_gate_inp.weight",
    **{f"shared_{w}": f"ffn_{w}_shexp.weight" for w in ("gate", "up", "down")},
    "shared_sigmoid": "ffn_gate_inp_shexp.weight",
    **{f"mlp_{w}": f"ffn_{w}.weight" for w in ("gate", "up", "down")},
}
_GGUF_GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF Q/K rows -> llama.cpp's order (what its converter does for ``llama`` models): within each head the
    first and second halves are interleaved, so that adjacent-pair RoPE equals HF's rotate-half RoPE."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of :func:`llama_permute`."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class Weights:
    """Interface: ``get(key, layer=None)`` float32 array, ``has(key, layer)``, ``expert_banks(layer, layout)``,
    ``native_expert_format`` (the format the experts are stored in, or None when they need quantizing)."""

    native_expert_format: str | None = None

    def name(self, key: str, layer: int | None = None) -> str:
        raise NotImplementedError

    def has(self, key: str, layer: int | None = None) -> bool:
        raise NotImplementedError

    def get(self, key: str, layer: int | None = None) -> np.ndarray:
        raise NotImplementedError

    def get_matrix(self, key: str, layer: int | None = None) -> np.ndarray | QuantizedMatrix:
        """A dense projection's matrix as the decoder's :class:`freetoken.models.linear.Linear` takes it: a
        :class:`QuantizedMatrix` when the source stores it in a block type Linear runs as is, else ``get``."""
        return self.get(key, layer)

    def quantized_kind(self, key: str, layer: int | None = None) -> str | None:
        """The :class:`QuantizedMatrix` kind :meth:`get_matrix` returns for ``key``, or None (a float array)."""
        return None

    def expert_banks(self, layer: int, layout: RecordLayout) -> dict[str, np.ndarray]:
        raise NotImplementedError


class HFWeights(Weights):
    """An HF checkpoint. ``get_tensor(name)`` returns the stored array (any dtype, may be e4m3);
    ``has_tensor(name)`` says whether it exists. With ``fp8_block=True`` every tensor that has a
    ``<name>_scale_inv`` companion is block-FP8 and is dequantized (or moved as is into fp8_block banks)."""

    def __init__(self, cfg: ModelConfig, get_tensor, has_tensor=None, fp8_block: bool = False, where: str = ""):
        self.cfg, self._get, self._fp8, self.where = cfg, get_tensor, fp8_block, where
        self._has = has_tensor
        self.native_expert_format = "fp8_block" if fp8_block else None

    def name(self, key: str, layer: int | None = None) -> str:
        if layer is None:
            return _HF_GLOBAL[key]
        moe = "block_sparse_moe." if self.cfg.family == "mixtral" else "mlp."
        return f"model.layers.{layer}." + _HF_LAYER[key].format(moe=moe)

    def _exists(self, name: str) -> bool:
        if self._has is not None:
            return bool(self._has(name))
        try:
            self._get(name)
        except (KeyError, LoadError):
            return False
        return True

    def has(self, key: str, layer: int | None = None) -> bool:
        return self._exists(self.name(key, layer))

    def _scale_name(self, name: str) -> str | None:
        if not self._fp8 or not name.endswith(".weight"):
            return None
        scale = name + "_scale_inv"
        return scale if self._exists(scale) else None

    def tensor_f32(self, name: str) -> np.ndarray:
        """One stored tensor as float32, block-FP8 dequantized."""
        w = self._get(name)
        scale = self._scale_name(name)
        if scale is None:
            return np.asarray(w, dtype=np.float32)
        from freetoken.formats import fp8_block

        s = np.asarray(self._get(scale), np.float32)
        n, k = w.shape
        want = (-(-n // 128), -(-k // 128))
        if s.shape != want:
            raise LoadError(self.where, f"expected a weight_scale_inv of shape {list(want)} for weight "
                                        f"{[n, k]}, got {list(s.shape)}", scale)
        return fp8_block.FORMAT.dequantize(fp8_block.from_hf(np.asarray(w)[None], s[None]))[0]

    def get(self, key: str, layer: int | None = None) -> np.ndarray:
        if key == "lm_head" and self.cfg.tie_word_embeddings:
            key = "embed"
        return self.tensor_f32(self.name(key, layer))

    def _expert_names(self, layer: int) -> dict[str, list[str]]:
        prefix = self.name("router", layer).removesuffix("gate.weight") + "experts."
        names = ("w1", "w3", "w2") if self.cfg.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        return {m: [f"{prefix}{j}.{n}.weight" for j in range(self.cfg.num_experts)]
                for m, n in zip(MATRICES, names, strict=True)}

    def expert_stack(self, layer: int, matrix: str) -> np.ndarray:
        """float32 [E, N, K] of one matrix ("gate", "up", "down") of every routed expert of ``layer``."""
        return np.stack([self.tensor_f32(n) for n in self._expert_names(layer)[matrix]])

    def expert_banks(self, layer: int, layout: RecordLayout) -> dict[str, np.ndarray]:
        names = self._expert_names(layer)
        if layout.fmt.name == "fp8_block" and self._fp8 and all(self._scale_name(n) for n in names["gate"][:1]):
            from freetoken.formats import fp8_block

            out = {}
            for m in MATRICES:
                w = np.stack([np.asarray(self._get(n)) for n in names[m]])
                s = np.stack([np.asarray(self._get(n + "_scale_inv"), np.float32) for n in names[m]])
                try:
                    banks = fp8_block.from_hf(w, s)
                except ValueError as e:
                    raise LoadError(self.where, f"layer {layer} {m} experts: {e}", names[m][0]) from e
                out.update({f"{m}.{k}": v for k, v in banks.items()})
            return out
        return layout.quantize(*(self.expert_stack(layer, m) for m in MATRICES))


class GGUFWeights(Weights):
    """A :class:`freetoken.loaders.GGUFFile` as decoder weights."""

    def __init__(self, cfg: ModelConfig, gguf):
        self.cfg, self.gguf = cfg, gguf
        first_moe = next((i for i in range(cfg.num_layers) if cfg.is_moe(i)), None)
        self.native_expert_format = None
        if first_moe is not None:
            try:
                self.native_expert_format = gguf.expert_format(first_moe)
            except LoadError:
                self.native_expert_format = None  # f16/bf16/q8_0... experts: decoded and quantized on load

    def name(self, key: str, layer: int | None = None) -> str:
        return _GGUF_GLOBAL[key] if layer is None else f"blk.{layer}." + _GGUF_LAYER[key]

    def has(self, key: str, layer: int | None = None) -> bool:
        return self.gguf.has(self.name(key, layer))

    def get(self, key: str, layer: int | None = None) -> np.ndarray:
        if key == "lm_head" and not self.has("lm_head"):
            key = "embed"  # tied embeddings: llama.cpp files simply omit output.weight
        w = self.gguf.get_f32(self.name(key, layer))
        if key == "shared_sigmoid":
            w = w.reshape(1, -1)  # stored as a vector [hidden]; the decoder wants HF's [1, hidden]
        if self.gguf.arch == "llama" and key in ("q_proj", "k_proj", "q_bias", "k_bias"):
            heads = self.cfg.num_heads if key[0] == "q" else self.cfg.num_kv_heads
            w = llama_unpermute(w, heads)
        return w

    #: ggml type -> QuantizedMatrix kind of the matrices kept quantized.
    _QUANTIZED = {"Q8_0": "q8_0", "Q4_0": "q4_0"}

    def _stored(self, key: str, layer: int | None) -> tuple[str, str]:
        if key == "lm_head" and not self.has("lm_head"):
            key = "embed"
        return key, self.name(key, layer)

    def quantized_kind(self, key: str, layer: int | None = None) -> str | None:
        key, name = self._stored(key, layer)
        info = self.gguf.info(name)
        if len(info.shape) != 2 or info.shape[1] % 32:
            return None  # vectors (shared_sigmoid) and partial blocks: float32
        return self._QUANTIZED.get(info.type)

    def get_matrix(self, key: str, layer: int | None = None) -> np.ndarray | QuantizedMatrix:
        kind = self.quantized_kind(key, layer)
        if kind is None:
            return self.get(key, layer)
        key, name = self._stored(key, layer)
        raw, _, shape = self.gguf.get_raw(name)
        blocks = np.array(raw)  # a host copy of the file's bytes (as get_f32 makes one)
        if self.gguf.arch == "llama" and key in ("q_proj", "k_proj"):
            heads = self.cfg.num_heads if key[0] == "q" else self.cfg.num_kv_heads
            blocks = np.ascontiguousarray(llama_unpermute(blocks, heads))  # whole rows move: exact on block rows
        return QuantizedMatrix(kind, blocks, shape)

    def expert_banks(self, layer: int, layout: RecordLayout) -> dict[str, np.ndarray]:
        fmt = layout.fmt.name
        names = self.gguf.expert_names(layer)
        if fmt == self.native_expert_format and self.gguf.expert_format(layer) == fmt:
            banks = self.gguf.expert_banks(layer)
            if layout.bias != any(k.endswith(".b") for k in banks):
                raise LoadError(self.gguf.path, f"layer {layer}: expert biases do not match the record layout",
                                names["gate"])
            return banks
        return layout.quantize(*(self.gguf.get_f32(names[m]) for m in MATRICES))
