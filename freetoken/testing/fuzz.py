"""Mutation fuzzing of every file freetoken reads: safetensors files, GGUF files, config.json, routing traces.

Shared by ``tests/test_fuzz_inputs.py`` (hypothesis, about a minute) and ``bench/fuzz_loaders.py`` (thousands of
inputs in forked children with a timeout and an address-space limit, a table of outcomes).

- :func:`make_seeds` writes small valid seed files: a 2-layer Qwen3-MoE checkpoint with tiny dimensions (one MoE
  layer, one dense layer, bf16 weights and f32 norms, the bundled model's tokenizer), its GGUF export (Q4_0
  experts, F16 matrices, the tokenizer embedded) and a routing trace.
- :func:`mutate` turns a seed into one mutated input of a kind, deterministically from an integer: structure-aware
  mutations (a header field, a length, an offset, a dtype, a shape, a JSON value, a trace array, a declared
  array shape) so that mutated inputs reach the checks behind the parsers, plus plain byte flips and cuts.
- :func:`load_input` does what a user does with such a file: ``freetoken.load(path, device="cpu")`` (config
  parse, tensor checks, the actual load of the tiny model) or ``load_trace`` and the trace summary.
- :func:`run_forked` runs one input in a forked child under a time and memory limit and classifies the outcome:
  ``ok``, ``clear`` (a LoadError / ConfigError / TraceError whose message names the file), ``other`` (any other
  exception, or a clear type that does not name the file), ``hang``, ``memory`` (MemoryError) or ``crash``.
"""

from __future__ import annotations

import json
import os
import random
import resource
import select
import shutil
import signal
import struct
import time
import traceback
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Children are forked from a process that has run Numba's parallel kernels: GNU OpenMP (Numba's default layer where
# present) aborts a forked child ("fork() called from a process already using GNU OpenMP"); workqueue is fork-safe.
# Takes effect when this module is imported before the first parallel kernel runs (bench/fuzz_loaders.py, the
# fork server below).
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

KINDS = ("safetensors", "gguf", "config", "trace", "ftw")
OUTCOMES = ("ok", "clear", "other", "hang", "memory", "crash")

#: The tiny checkpoint's config: layer 0 MoE (4 experts, top-2), layer 1 dense; q/k norms per head.
TINY_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 64,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1], "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True, "eos_token_id": 0,
    "bos_token_id": 0, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
}


@dataclass(frozen=True)
class Seeds:
    root: Path
    hf_dir: Path  # config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    gguf: Path
    trace: Path
    ftw: Path


def _tiny_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    h, hd, nh, kv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, mi, di, v = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"], cfg["vocab_size"]

    def mat(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(ml_dtypes.bfloat16)

    out = {"model.embed_tokens.weight": mat(v, h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": np.ones(h, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                    p + "self_attn.q_proj.weight": mat(nh * hd, h), p + "self_attn.k_proj.weight": mat(kv * hd, h),
                    p + "self_attn.v_proj.weight": mat(kv * hd, h), p + "self_attn.o_proj.weight": mat(h, nh * hd),
                    p + "self_attn.q_norm.weight": np.ones(hd, np.float32),
                    p + "self_attn.k_norm.weight": np.ones(hd, np.float32)})
        if i in cfg["mlp_only_layers"]:
            out.update({p + "mlp.gate_proj.weight": mat(di, h), p + "mlp.up_proj.weight": mat(di, h),
                        p + "mlp.down_proj.weight": mat(h, di)})
        else:
            out[p + "mlp.gate.weight"] = mat(e, h)
            for j in range(e):
                q = f"{p}mlp.experts.{j}."
                out.update({q + "gate_proj.weight": mat(mi, h), q + "up_proj.weight": mat(mi, h),
                            q + "down_proj.weight": mat(h, mi)})
    return out


def make_seeds(root: str | os.PathLike) -> Seeds:
    """Write the seed files under ``root`` (once; reused when present)."""
    import warnings

    from safetensors.numpy import save_file

    from freetoken.convert.gguf_export import export_gguf
    from freetoken.engine.loading.load import DEFAULT_MODEL
    from freetoken.trace.format import TraceRecorder

    root = Path(root)
    hf = root / "tiny-qwen3moe"
    gguf = root / "tiny-qwen3moe.gguf"
    trace = root / "tiny.trace.npz"
    ftw = root / "tiny-qwen3moe.ftw"
    if not (hf / "model.safetensors").is_file():
        hf.mkdir(parents=True, exist_ok=True)
        (hf / "config.json").write_text(json.dumps(TINY_CONFIG, indent=1))
        save_file(_tiny_tensors(TINY_CONFIG), str(hf / "model.safetensors"), metadata={"format": "pt"})
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEFAULT_MODEL / name, hf / name)
    if not gguf.is_file():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_gguf(hf, gguf, experts="q4_0", other="f16")
    if not trace.is_file():
        rng = np.random.default_rng(0)
        rec = TraceRecorder(num_layers=2, num_experts=8, top_k=2, record_bytes=4096, model="tiny")
        for _ in range(3):
            rec.begin_segment()
            for layer in range(2):
                rec.add_prefill(layer, np.argsort(rng.random((5, 8)), axis=1)[:, :2])
            for _ in range(6):
                rec.add_decode_step([np.argsort(rng.random((1, 8)), axis=1)[:, :2] for _ in range(2)])
        rec.save(trace)
    if not ftw.is_file():
        from freetoken.convert.ftw_export import write_ftw
        from freetoken.engine.loading.sources import open_source

        write_ftw(open_source(hf), ftw)
    return Seeds(root, hf, gguf, trace, ftw)


# ---- mutations ---------------------------------------------------------------------------------------------

INTERESTING_INTS = [0, 1, 2, 3, 7, 8, 31, 32, 33, 63, 64, 127, 128, 255, 256, 1023, 1024, 4095, 4096, 65535, 65536,
                    2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -2,
                    -(2**31), -(2**63)]
INTERESTING_JSON = [0, 1, -1, 2, 3, 1.5, 0.5, -0.5, 1e-300, 1e308, -1e308, 2**31, 2**63, 2**64, -(2**63), 10**30,
                    "__BIG__", float("nan"), float("inf"), float("-inf"), True, False, None, "", "12", "abc",
                    "\x00", [], [1], [1, 2, 3], [None], {}, {"a": 1}, [[[[[[[[1]]]]]]]]]


def dumps(obj) -> str:
    """json.dumps, with ``"__BIG__"`` written as a 5000-digit integer (Python will not print one itself)."""
    return json.dumps(obj).replace('"__BIG__"', "9" * 5000)


def _deep(n: int, leaf=1):
    text = "[" * n + json.dumps(leaf) + "]" * n
    return text


def _byte_mutation(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    op = rng.randrange(7)
    if not b:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if op == 0:  # flip bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # truncate
        b = b[:rng.randrange(len(b))]
    elif op == 2:  # an interesting 1/2/4/8-byte integer
        width = rng.choice((1, 2, 4, 8))
        i = rng.randrange(max(1, len(b) - width))
        v = rng.choice(INTERESTING_INTS) % (1 << (8 * width))
        b[i:i + width] = v.to_bytes(width, "little")
    elif op == 3:  # random bytes
        i = rng.randrange(len(b))
        n = rng.randint(1, 32)
        b[i:i + n] = bytes(rng.randrange(256) for _ in range(n))
    elif op == 4:  # delete a chunk
        i = rng.randrange(len(b))
        del b[i:i + rng.randint(1, 256)]
    elif op == 5:  # duplicate a chunk
        i = rng.randrange(len(b))
        b[i:i] = b[i:i + rng.randint(1, 256)]
    else:  # zero or 0xff a chunk
        i = rng.randrange(len(b))
        n = rng.randint(1, 64)
        b[i:i + n] = bytes([rng.choice((0, 255))]) * len(b[i:i + n])
    return bytes(b)


# -- safetensors


def _st_split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _st_join(header, blob: bytes, rng: random.Random, raw_text: str | None = None) -> bytes:
    text = (raw_text if raw_text is not None else dumps(header)).encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)
    n = len(text)
    if rng.random() < 0.05:
        n = rng.choice(INTERESTING_INTS) % 2**64
    return struct.pack("<Q", n) + text + blob


def mutate_safetensors(data: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.2:
        return _byte_mutation(data, rng)
    header, blob = _st_split(data)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    spec = header[name]
    op = rng.randrange(14)
    if op == 0:  # dtype relabelled (the same bytes as another type) or nonsense
        spec["dtype"] = rng.choice(["U16", "I16", "F16", "BF16", "F32", "I32", "U8", "I8", "F8_E4M3", "F8_E5M2",
                                    "F8_E8M0", "BOOL", "F64", "I64", "U64", "Q4", "", 5, None, ["BF16"], {"a": 1}])
    elif op == 1:  # a shape dimension
        shape = list(spec["shape"])
        if shape:
            i = rng.randrange(len(shape))
            shape[i] = rng.choice(INTERESTING_JSON + [shape[i] * 2, shape[i] // 2, shape[i] + 1])
        spec["shape"] = shape
    elif op == 2:  # shape swapped / reshaped with the same element count
        shape = list(spec["shape"])
        if len(shape) == 2 and rng.random() < 0.5:
            spec["shape"] = shape[::-1]
        else:
            spec["shape"] = [int(np.prod(shape))] if rng.random() < 0.5 else shape + [1]
    elif op == 3:  # offsets moved (overlap, out of bounds, reversed, wrong span)
        a, b = spec["data_offsets"]
        other = header[rng.choice(names)]["data_offsets"]
        spec["data_offsets"] = rng.choice([[b, a], [a + 2, b + 2], [a - 2, b - 2], list(other), [a, b + 8],
                                           [a, rng.choice(INTERESTING_INTS)], [rng.choice(INTERESTING_INTS), b],
                                           [a], [a, b, b], "0-1", [float(a), float(b)]])
    elif op == 4:  # a tensor removed
        del header[name]
    elif op == 5:  # a tensor renamed (a layer or expert index changed, a suffix dropped)
        new = name.replace("layers.0", rng.choice(["layers.1", "layers.2", "layers.7"])) \
            .replace("experts.1", rng.choice(["experts.4", "experts.9"]))
        if new == name:
            new = name + rng.choice(["_x", ".bias", "_scale_inv"])
        header[new] = header.pop(name)
    elif op == 6:  # a spec that is not an object / missing keys / extra keys
        header[name] = rng.choice([None, 1, "x", [], {"dtype": spec["dtype"]},
                                   {**spec, "extra": [[[[1]]]]}, {**spec, "shape": None}])
    elif op == 7:  # deep nesting
        raw = dumps(header)[:-1] + ', "deep": ' + _deep(rng.choice([50, 500, 5000, 100000])) + "}"
        return _st_join(None, blob, rng, raw)
    elif op == 8:  # metadata nonsense
        header["__metadata__"] = rng.choice([None, 1, "x", [], {"format": 1}, {"format": "pt", "k": [1]},
                                             {"format": "pt" * 1000}])
    elif op == 9:  # a huge number in the shape
        spec["shape"] = [rng.choice([10**19, 10**400, "__BIG__"])] + list(spec["shape"])[1:]
    elif op == 10:  # a duplicated tensor pointing at another's data
        other = rng.choice(names)
        header[name + ".dup"] = dict(header[other])
    elif op == 11:  # header JSON that is not an object
        return _st_join(None, blob, rng, rng.choice(["[]", "1", "null", '"x"', "{", "{}", "NaN", "[" * 3000]))
    elif op == 12:  # the data blob truncated or grown
        blob = blob[:rng.randrange(len(blob) + 1)] if rng.random() < 0.7 else blob + b"\0" * 64
    else:  # an interesting value anywhere in the spec
        key = rng.choice(["dtype", "shape", "data_offsets"])
        spec[key] = rng.choice(INTERESTING_JSON)
    return _st_join(header, blob, rng)


# -- config.json

CONFIG_KEYS = list(TINY_CONFIG) + ["num_local_experts", "rope_scaling", "rope_parameters", "quantization_config",
                                   "shared_expert_intermediate_size", "expert_dtype", "max_position_embeddings"]
ROPE_VARIANTS = [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
                 {"type": "linear", "factor": 2.0}, {"rope_type": "llama3", "factor": 8.0},
                 {"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "yarn"}, {"rope_type": "default"},
                 {"rope_type": "linear", "factor": float("nan")}, {"rope_type": "yarn", "factor": -1},
                 {"rope_theta": 0, "rope_type": "default"}, {"rope_theta": "x"}]
QUANT_VARIANTS = [{"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"},
                  {"quant_method": "fp8"}, {"quant_method": "fp8", "weight_block_size": 128},
                  {"quant_method": "fp8", "weight_block_size": [64, 64]}, {"quant_method": "mxfp4"},
                  {"quant_method": "modelopt"}, {"quant_method": "compressed-tensors", "config_groups": []},
                  {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8}}}},
                  {"quant_method": "gptq"}, {"quant_method": 5}, [], "fp8",
                  {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": 7}]


def mutate_config(data: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.1:
        return _byte_mutation(data, rng)
    cfg = json.loads(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        key = rng.choice(CONFIG_KEYS)
        op = rng.randrange(10)
        if op == 0:
            cfg.pop(key, None)
        elif op == 1 and key in ("rope_scaling", "rope_parameters"):
            cfg[key] = rng.choice(ROPE_VARIANTS)
        elif op == 1 and key == "quantization_config":
            cfg[key] = rng.choice(QUANT_VARIANTS)
        elif op == 2 and isinstance(cfg.get(key), (int, float)) and not isinstance(cfg.get(key), bool):
            v = cfg[key]
            cfg[key] = rng.choice([v * 2, v // 2 if isinstance(v, int) else v / 2, v + 1, v - 1, -v, v * 1.5,
                                   float(v)])
        elif op == 3:
            cfg["model_type"] = rng.choice(["qwen2_moe", "mixtral", "olmoe", "llama", "deepseek_v3", "", None, 3])
        elif op == 4:
            return (dumps(cfg)[:-1] + f', "deep": {_deep(rng.choice([100, 1000, 100000]))}}}').encode()
        elif op == 5:
            return rng.choice([b"[]", b"1", b"null", b"", b"{", b'{"model_type": "qwen3_moe"}', b"\xff\xfe",
                               b'{"a": NaN}', b"[" * 5000])
        elif op == 6:
            cfg[key] = rng.choice(QUANT_VARIANTS + ROPE_VARIANTS)
        else:
            cfg[key] = rng.choice(INTERESTING_JSON)
    try:
        return dumps(cfg).encode()
    except (ValueError, OverflowError):
        return data


# -- GGUF


@dataclass
class _Slot:
    """A place in a GGUF header a mutation can write: offset, width in bytes, what it is."""

    off: int
    width: int
    what: str
    vtype: int = -1


def gguf_slots(data: bytes) -> list[_Slot]:
    """Every length, count, type, scalar value, dimension and offset of a (valid) GGUF header, by position."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    slots = [_Slot(4, 4, "version"), _Slot(8, 8, "tensor count"), _Slot(16, 8, "kv count")]
    u = lambda off, n: int.from_bytes(data[off:off + n], "little")  # noqa: E731
    n_tensors, n_kv = u(8, 8), u(16, 8)
    off = 24

    def value(off, vtype, key):
        if vtype in sizes:
            slots.append(_Slot(off, sizes[vtype], f"{key} value", vtype))
            return off + sizes[vtype]
        if vtype == 8:
            slots.append(_Slot(off, 8, f"{key} string length"))
            return off + 8 + u(off, 8)
        item, count = u(off, 4), u(off + 4, 8)
        slots.append(_Slot(off, 4, f"{key} item type"))
        slots.append(_Slot(off + 4, 8, f"{key} array length"))
        off += 12
        for j in range(count):
            if j < 3 or j == count - 1:
                off = value(off, item, f"{key}[{j}]")
            elif item in sizes:
                off += sizes[item]
            else:
                off = off + 8 + u(off, 8) if item == 8 else value(off, item, key)
        return off

    for _ in range(n_kv):
        slots.append(_Slot(off, 8, "key length"))
        slots.append(_Slot(off + 8, u(off, 8), "key name"))
        key = data[off + 8:off + 8 + u(off, 8)].decode()
        off += 8 + u(off, 8)
        slots.append(_Slot(off, 4, f"{key} type"))
        off = value(off + 4, u(off, 4), key)
    for _ in range(n_tensors):
        name_len = u(off, 8)
        slots.append(_Slot(off, 8, "tensor name length"))
        slots.append(_Slot(off + 8, name_len, "tensor name"))
        name = data[off + 8:off + 8 + name_len].decode()
        off += 8 + name_len
        nd = u(off, 4)
        slots.append(_Slot(off, 4, f"{name} n_dims"))
        for j in range(nd):
            slots.append(_Slot(off + 4 + 8 * j, 8, f"{name} dim {j}"))
        off += 4 + 8 * nd
        slots.append(_Slot(off, 4, f"{name} type"))
        slots.append(_Slot(off + 4, 8, f"{name} offset"))
        off += 12
    return slots


_FLOATS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, 1e-45, 1e38, -(2.0**63), 2.0**63, 0.5, 2.0]


def mutate_gguf(data: bytes, rng: random.Random, slots: list[_Slot] | None = None) -> bytes:
    if rng.random() < 0.15:
        return _byte_mutation(data, rng)
    slots = slots if slots is not None else gguf_slots(data)
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2))):
        s = rng.choice(slots)
        if s.what == "key name" and s.width:  # a key renamed: missing, unknown or duplicated metadata
            i = rng.randrange(s.width)
            b[s.off + i] = rng.choice(b"._0123abcxyz")
            continue
        if s.what == "tensor name":
            name = bytes(b[s.off:s.off + s.width])
            # another layer's index, a kind swapped for a sibling, or a byte changed: tensors go missing/stray
            subs = [(b"blk.0.", b"blk.1."), (b"blk.1.", b"blk.0."), (b"blk.1.", b"blk.9."), (b"attn_q", b"attn_k"),
                    (b"norm", b"nurm"), (b"gate", b"gat3"), (b"_exps", b"_shxp")]
            for old, new in rng.sample(subs, len(subs)):
                if old in name:
                    name = name.replace(old, new, 1)
                    break
            else:
                name = bytes([name[0] ^ 1]) + name[1:]
            b[s.off:s.off + s.width] = name[:s.width].ljust(s.width, b"_")
            continue
        if s.vtype in (6, 12) and rng.random() < 0.7:  # a float value
            v = rng.choice(_FLOATS)
            b[s.off:s.off + s.width] = struct.pack("<f" if s.width == 4 else "<d", v)
            continue
        if s.what.endswith(" type") and rng.random() < 0.5:  # a value type / ggml type swapped
            v = rng.choice([0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 30, 31, 39, 2**31])
        elif s.what.endswith("offset") and rng.random() < 0.5:
            old = int.from_bytes(b[s.off:s.off + 8], "little")
            v = rng.choice([old + 1, old + 32, old - 32, old + 64, 0, old * 2, old + 4096])
        elif "dim" in s.what and rng.random() < 0.5:
            old = int.from_bytes(b[s.off:s.off + 8], "little")
            v = rng.choice([old * 2, old // 2, old + 1, old - 1, 0, 1, old * 32])
        else:
            v = rng.choice(INTERESTING_INTS)
        b[s.off:s.off + s.width] = (v % (1 << (8 * s.width))).to_bytes(s.width, "little")
    return bytes(b)


# -- traces


def _npy_bytes(arr: np.ndarray, shape=None) -> bytes:
    """.npy bytes of ``arr``, with its header declaring ``shape`` when given (a lie about the size)."""
    import io

    fh = io.BytesIO()
    np.lib.format.write_array_header_1_0(fh, {"descr": np.lib.format.dtype_to_descr(arr.dtype),
                                              "fortran_order": False,
                                              "shape": tuple(arr.shape if shape is None else shape)})
    return fh.getvalue() + np.ascontiguousarray(arr).tobytes()


def mutate_trace(data_path: Path, rng: random.Random, out: Path) -> None:
    if rng.random() < 0.15:
        out.write_bytes(_byte_mutation(data_path.read_bytes(), rng))
        return
    with np.load(data_path) as z:
        arrays = {k: z[k] for k in z.files}
    names = list(arrays)
    op = rng.randrange(9)
    name = rng.choice(names)
    a = arrays[name]
    lie: dict[str, tuple] = {}
    if op == 0:  # a value
        if a.size:
            flat = a.reshape(-1).copy()
            flat[rng.randrange(flat.size)] = rng.choice([-1, 0, 1, 7, 8, 9, 2**15 - 1, -(2**15), 2**31 - 1])\
                % (1 << (8 * a.dtype.itemsize)) if a.dtype.kind == "u" else np.array(
                    rng.choice([-1, 0, 1, 7, 8, 9, 100, -100, 2**15 - 1])).astype(a.dtype)
            arrays[name] = flat.reshape(a.shape)
        else:
            arrays[name] = np.array(rng.choice(INTERESTING_INTS[:20] + [-1]))
    elif op == 1:  # dtype
        try:
            arrays[name] = a.astype(rng.choice([np.float32, np.float64, np.bool_, np.uint64, np.int8, np.uint8,
                                                np.complex64, "U3", "S2"]))
        except ValueError:  # the model string as a number
            arrays[name] = np.array(7.5)
    elif op == 2:  # shape
        arrays[name] = rng.choice([a.reshape(-1), a.reshape(1, *a.shape), np.zeros((0,) * max(a.ndim, 1), a.dtype),
                                   np.repeat(a, 2, axis=0) if a.ndim else np.array([a, a])])
    elif op == 3:  # a field removed or renamed
        del arrays[name]
        if rng.random() < 0.5:
            arrays[name + "_x"] = a
    elif op == 4:  # a scalar changed
        key = rng.choice(["num_experts", "num_layers", "top_k", "record_bytes", "version"])
        arrays[key] = np.array((rng.choice(INTERESTING_INTS) + 2**63) % 2**64 - 2**63, dtype=np.int64) \
            if rng.random() < 0.8 else \
            np.array(rng.choice([1.5, float("nan"), "x"]))
    elif op == 5:  # a declared shape far larger than the data (what a 10 KB file claiming 100M steps is)
        if a.ndim:
            big = list(a.shape)
            big[0] = rng.choice([10**8, 2**31, 2**40, a.shape[0] + 1, 10**6])
            lie[name] = tuple(big)
    elif op == 6:  # huge but constant content: compresses well, so it is small on disk
        steps = rng.choice([10**4, 10**5, 10**6])
        arrays["decode_ids"] = np.zeros((steps, 2, 1, 2), np.int16)
        arrays["decode_ids"][..., 1] = 1
        arrays["step_segment"] = np.zeros(steps, np.int32)
    elif op == 7:  # the model string
        arrays["model"] = rng.choice([np.array("x" * 1000), np.array(["a", "b"]), np.array(5), np.array(b"ab")])
    else:  # segments out of order / prefill negative
        if "step_segment" in arrays and arrays["step_segment"].size:
            arrays["step_segment"] = arrays["step_segment"][::-1].copy()
        if "prefill_counts" in arrays:
            arrays["prefill_counts"] = -arrays["prefill_counts"]
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for k, v in arrays.items():
            zf.writestr(k + ".npy", _npy_bytes(np.asarray(v), lie.get(k)))


def mutate_ftw(data: bytes, rng: random.Random) -> bytes:
    """An FTW file (docs/ftw.md) damaged as a disk or a buggy writer would: bytes flipped or cut anywhere (the
    checksums must catch them), a preamble field changed, or an index value changed with the index checksum and
    the file length made consistent again (so the structural checks, not the checksum, must refuse it)."""
    from freetoken.loaders.ftw_file import PREAMBLE, checksum

    op = rng.random()
    if op < 0.25:
        return _byte_mutation(data, rng)
    magic, version, off, n, isum, size, align = PREAMBLE.unpack(data[:PREAMBLE.size])
    if op < 0.4:
        fields = [magic, version, off, n, isum, size, align]
        i = rng.choice((1, 2, 3, 5, 6))
        width = 32 if i in (1, 6) else 64
        fields[i] = rng.choice([v for v in INTERESTING_INTS if 0 <= v < 2**width])
        return PREAMBLE.pack(*fields) + data[PREAMBLE.size:]
    index = json.loads(data[off:off + n])
    for _ in range(rng.choice((1, 1, 2, 3))):
        _mutate_json_leaf(index, rng)
    try:
        raw = dumps(index).encode()
    except (ValueError, OverflowError):
        raw = json.dumps(index, allow_nan=True).encode()
    return (PREAMBLE.pack(magic, version, off, len(raw), bytes.fromhex(checksum(raw)), off + len(raw), align)
            + data[PREAMBLE.size:off] + raw)


def _mutate_json_leaf(obj, rng: random.Random) -> None:
    """Change, drop or duplicate one value somewhere inside ``obj`` (a dict or list), in place."""
    path = []
    node = obj
    while isinstance(node, (dict, list)) and node and rng.random() < 0.85:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if not path:
        return
    parent, key = path[-1]
    op = rng.randrange(6)
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 0:
        parent.pop(key)
    elif op == 1 and isinstance(parent, list):
        parent.insert(key, json.loads(json.dumps(parent[key])))  # a duplicate: two records or tensors alike
    elif op == 2 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        v = parent[key]
        parent[key] = rng.choice([v + 1, v - 1, v + 4096, v - 4096, v * 2, v // 2, -v])
    elif op == 3:
        parent[key] = rng.choice(INTERESTING_INTS)
    else:
        parent[key] = rng.choice(INTERESTING_JSON)


# ---- inputs and loads --------------------------------------------------------------------------------------


class Mutator:
    """Mutated inputs of every kind from one set of seeds; :meth:`make` writes input ``n`` of a kind under
    ``workdir`` and returns the path to load."""

    def __init__(self, seeds: Seeds):
        self.seeds = seeds
        self.st = (seeds.hf_dir / "model.safetensors").read_bytes()
        self.config = (seeds.hf_dir / "config.json").read_bytes()
        self.gguf = seeds.gguf.read_bytes()
        self.slots = gguf_slots(self.gguf)
        self.ftw = seeds.ftw.read_bytes()

    def _hf_copy(self, workdir: Path) -> Path:
        d = workdir / "model"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            os.symlink(self.seeds.hf_dir / name, d / name)
        return d

    def make(self, kind: str, n: int, seed: int, workdir: Path) -> Path:
        rng = random.Random(f"{kind}:{seed}:{n}")
        workdir.mkdir(parents=True, exist_ok=True)
        if kind == "safetensors":
            d = self._hf_copy(workdir)
            (d / "config.json").write_bytes(self.config)
            (d / "model.safetensors").write_bytes(mutate_safetensors(self.st, rng))
            return d
        if kind == "config":
            d = self._hf_copy(workdir)
            (d / "config.json").write_bytes(mutate_config(self.config, rng))
            os.symlink(self.seeds.hf_dir / "model.safetensors", d / "model.safetensors")
            return d
        if kind == "gguf":
            p = workdir / "model.gguf"
            p.write_bytes(mutate_gguf(self.gguf, rng, self.slots))
            return p
        if kind == "ftw":
            p = workdir / "model.ftw"
            p.write_bytes(mutate_ftw(self.ftw, rng))
            return p
        if kind == "trace":
            p = workdir / "trace.npz"
            mutate_trace(self.seeds.trace, rng, p)
            return p
        raise ValueError(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")


def load_input(kind: str, path: Path) -> str:
    """Load ``path`` as a user would; returns a one-line description of what loaded."""
    if kind == "trace":
        from freetoken.trace.format import load_trace

        t = load_trace(path)
        try:
            from freetoken.trace.simulate import summarize
        except ImportError:  # the trace package moved things: loading is what is fuzzed
            summarize = None
        if summarize is not None:
            summarize(t)
        return f"trace {t.steps} steps"
    from freetoken.engine.loading.load import load

    m = load(path, device="cpu", ctx=64)
    m.decoder.forward(np.arange(3))
    return f"model {m.decoder.cfg.family} {m.decoder.cfg.num_layers} layers"


def clear_error_types() -> tuple[type, ...]:
    from freetoken.loaders import LoadError
    from freetoken.models.fields import ConfigError
    from freetoken.trace.format import TraceError

    return (LoadError, ConfigError, TraceError)


def classify(kind: str, path: Path, exc: BaseException | None) -> tuple[str, str]:
    """(outcome, detail) of one load: ``ok``, ``clear`` (a clear error naming the input) or ``other``/``memory``."""
    if exc is None:
        return "ok", ""
    line = f"{type(exc).__name__}: {str(exc)[:300]}"
    if isinstance(exc, MemoryError):
        return "memory", line
    if isinstance(exc, clear_error_types()) and str(path) in str(exc):
        return "clear", line
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" [{Path(tb[-1].filename).name}:{tb[-1].lineno}]" if tb else ""
    return "other", line + where


def _child(kind: str, path: Path, mem_bytes: int | None, wfd: int) -> None:
    import warnings

    warnings.simplefilter("ignore")  # overflow in a mutated model's arithmetic is not what is fuzzed
    np.seterr(all="ignore")
    if mem_bytes:  # on top of what the fork maps already: the fork server's own address space grows with the
        # core count (a thread stack and a malloc arena per Numba thread: 0.6 GB at 2 threads, 5 GB at 64)
        base = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (base + mem_bytes, base + mem_bytes))
    try:
        load_input(kind, path)
        res = classify(kind, path, None)
    except BaseException as e:  # noqa: BLE001 - classifying is the point
        res = classify(kind, path, e)
    os.write(wfd, json.dumps(res).encode()[:4000])
    os._exit(0)


@dataclass
class Outcome:
    kind: str
    n: int
    outcome: str
    detail: str
    seconds: float


def run_forked(kind: str, path: Path, n: int = 0, timeout: float = 10.0,
               mem_bytes: int | None = 4 << 30) -> Outcome:
    """Load ``path`` in a forked child limited to ``timeout`` seconds and ``mem_bytes`` of address space."""
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            _child(kind, path, mem_bytes, w)
        finally:
            os._exit(3)
    os.close(w)
    chunks = []
    deadline = t0 + timeout
    hung = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            hung = True
            break
        ready, _, _ = select.select([r], [], [], left)
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    if hung:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(r)
    secs = time.monotonic() - t0
    if hung:
        return Outcome(kind, n, "hang", f"no result after {timeout:g} s", secs)
    if os.WIFSIGNALED(status):
        return Outcome(kind, n, "crash", f"killed by signal {os.WTERMSIG(status)}", secs)
    try:
        outcome, detail = json.loads(b"".join(chunks))
    except ValueError:
        return Outcome(kind, n, "crash", f"exit status {os.WEXITSTATUS(status)} without a result", secs)
    return Outcome(kind, n, outcome, detail, secs)


def warm_up(seeds: Seeds) -> None:
    """Load every seed once in this process, so forked children inherit compiled kernels and imports; and run the
    dense product once per weight storage and shape class (a mutated GGUF may turn a seed matrix into another
    storage: compiling its kernel in a child took ~10 s, the hang timeout)."""
    for kind, path in (("safetensors", seeds.hf_dir), ("gguf", seeds.gguf), ("trace", seeds.trace),
                       ("ftw", seeds.ftw)):
        load_input(kind, path)
    from freetoken import ops
    from freetoken.ops.dense import BLOCK_STORAGES, STORAGE_DTYPES, k_multiple, row_bytes

    for storage, dtype in STORAGE_DTYPES.items():
        k = max(32, k_multiple(storage))  # rows of 32 weights, or of one k-quant super-block
        w = np.zeros((8, row_bytes(storage, k) if storage in BLOCK_STORAGES else k), dtype)
        for tokens in (1, 64):  # a decode GEMV and a prompt product
            ops.dense(np.zeros((tokens, k), np.float32), w, storage, device="cpu")


# ---- a fork server: loads run in children of a fresh process ---------------------------------------------------


def serve(root: str) -> None:
    """Answer ``{"kind", "path", "timeout", "mem"}`` lines on stdin with ``[outcome, detail, seconds]`` lines, each
    input loaded in a forked child of this process (started fresh, so Numba's threads are fork-safe here)."""
    import sys

    seeds = make_seeds(root)
    warm_up(seeds)
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out = run_forked(req["kind"], Path(req["path"]), 0, timeout=req["timeout"], mem_bytes=req["mem"])
        print(json.dumps([out.outcome, out.detail, out.seconds]), flush=True)


class ForkServer:
    """A ``serve`` process (``python -m freetoken.testing.fuzz SEEDS_DIR``) for callers that may already run
    Numba's (not fork-safe) OpenMP threads themselves, such as a pytest session."""

    def __init__(self, root: str | os.PathLike):
        import subprocess
        import sys

        env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen([sys.executable, "-m", "freetoken.testing.fuzz", os.fspath(root)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        if json.loads(self.proc.stdout.readline() or "null") != "ready":
            raise RuntimeError("fuzz fork server did not start")

    def run(self, kind: str, path: Path, timeout: float = 10.0, mem_bytes: int = 4 << 30) -> tuple[str, str, float]:
        self.proc.stdin.write(json.dumps({"kind": kind, "path": str(path), "timeout": timeout,
                                          "mem": mem_bytes}) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("fuzz fork server died")
        outcome, detail, seconds = json.loads(line)
        return outcome, detail, seconds

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    import sys

    serve(sys.argv[1])
