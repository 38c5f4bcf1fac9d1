"""freetoken.loaders: HF safetensors directories and GGUF files (tiny checkpoints built in tmp_path)."""

from __future__ import annotations

import json
import mmap
import struct

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.numpy import load_file as st_load_file
from safetensors.numpy import save_file as st_save_file

from freetoken import formats
from freetoken.loaders import GGUFFile, LoadError, Quantization, SafetensorsDir, quantization
from freetoken.testing.oracles import need

Q = GGMLQuantizationType

# ---- helpers ------------------------------------------------------------------------------------------------


def write_config(d, **extra):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "test", **extra}))


def write_safetensors_by_hand(path, tensors: dict[str, tuple[str, np.ndarray]], metadata=None, pad_to=8):
    """Write a safetensors file without the library: {name: (dtype string, array)} -> header + raw bytes."""
    header, blobs, off = {}, [], 0
    for name, (dtype, a) in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % pad_to)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def mmap_root(a: np.ndarray):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


def special_values():
    rng = np.random.default_rng(1)
    bf = rng.standard_normal((4, 8)).astype(np.float32).astype(ml_dtypes.bfloat16)
    e4m3 = np.arange(256, dtype=np.uint8).reshape(16, 16).view(ml_dtypes.float8_e4m3fn)
    e5m2 = np.arange(256, dtype=np.uint8).reshape(8, 32).view(ml_dtypes.float8_e5m2)
    e8m0 = np.arange(256, dtype=np.uint8).reshape(2, 128).view(ml_dtypes.float8_e8m0fnu)
    return {"w.bf16": ("BF16", bf), "w.e4m3": ("F8_E4M3", e4m3), "w.e5m2": ("F8_E5M2", e5m2),
            "w.e8m0": ("F8_E8M0", e8m0), "w.scalar": ("F32", np.array(2.5, np.float32)),
            "w.empty": ("F32", np.zeros((0, 3), np.float32))}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ---- safetensors: single file -------------------------------------------------------------------------------


def test_library_written_single_file_zero_copy(tmp_path):
    rng = np.random.default_rng(0)
    ref = {"a.f32": rng.standard_normal((3, 5)).astype(np.float32),
           "b.f16": rng.standard_normal((7,)).astype(np.float16),
           "c.i32": rng.integers(-9, 9, (2, 2, 2)).astype(np.int32),
           "d.i64": np.arange(5, dtype=np.int64), "e.u8": np.arange(10, dtype=np.uint8),
           "f.f64": rng.standard_normal(4), "g.bool": np.array([True, False, True]),
           "h.i8": np.arange(-4, 4, dtype=np.int8), "k.i16": np.arange(6, dtype=np.int16)}
    write_config(tmp_path, hidden_size=8)
    st_save_file(ref, str(tmp_path / "model.safetensors"), metadata={"format": "np"})
    d = SafetensorsDir(tmp_path)
    assert d.config["hidden_size"] == 8
    assert sorted(d.names()) == sorted(ref) and len(d) == len(ref)
    assert d.metadata() == {"format": "np"}
    assert d.info("a.f32") == ("F32", (3, 5), str(tmp_path / "model.safetensors"))
    assert d.info("c.i32").dtype == "I32" and d.info("g.bool").shape == (3,)
    for name, want in ref.items():
        got = d.get(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable
        assert isinstance(mmap_root(got), mmap.mmap)  # a view of the file mapping, not a copy
        assert np.shares_memory(got, d.get(name))
    f32 = d.get_f32("b.f16")
    assert f32.dtype == np.float32 and f32.flags.writeable and not np.shares_memory(f32, d.get("b.f16"))
    np.testing.assert_array_equal(f32, ref["b.f16"].astype(np.float32))
    assert d.has("a.f32") and "a.f32" in d and not d.has("zzz")
    assert d.quantization() == Quantization("none", "bf16", source=str(tmp_path / "config.json"))


def test_hand_written_bf16_fp8_e8m0(tmp_path):
    ref = special_values()
    write_config(tmp_path)
    write_safetensors_by_hand(tmp_path / "model.safetensors", ref)
    with SafetensorsDir(tmp_path) as d:
        want_dtypes = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
                       "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu, "F32": np.float32}
        for name, (dt, want) in ref.items():
            assert d.info(name) == (dt, want.shape, str(tmp_path / "model.safetensors"))
            got = d.get(name)
            assert got.dtype == np.dtype(want_dtypes[dt])
            assert same_bits(got, want)
            assert isinstance(mmap_root(got), mmap.mmap)
            np.testing.assert_array_equal(d.get_f32(name), want.astype(np.float32))  # NaN == NaN here
        # Spot checks of the decodes against the format facts.
        e4 = d.get_f32("w.e4m3").reshape(-1)
        assert e4[0x7E] == 448 and np.isnan(e4[0x7F]) and e4[0x38] == 1.0
        e8 = d.get_f32("w.e8m0").reshape(-1)
        assert e8[127] == 1.0 and e8[0] == np.float32(2.0**-127) and np.isnan(e8[255])
        assert d.get("w.scalar").shape == () and d.get("w.scalar") == 2.5
        assert d.get("w.empty").shape == (0, 3)


def test_unaligned_header_still_reads(tmp_path):
    ref = special_values()
    write_config(tmp_path)
    write_safetensors_by_hand(tmp_path / "model.safetensors", ref, pad_to=1)
    d = SafetensorsDir(tmp_path)
    for name, (_, want) in ref.items():
        assert same_bits(d.get(name), want)


# ---- safetensors: sharded -------------------------------------------------------------------------------------


def make_sharded(tmp_path):
    rng = np.random.default_rng(2)
    shard1 = {"model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
              "model.layers.0.mlp.gate.weight": rng.standard_normal((4, 8)).astype(np.float32)}
    shard2 = special_values()
    write_config(tmp_path, num_hidden_layers=1)
    st_save_file(shard1, str(tmp_path / "model-00001-of-00002.safetensors"))
    write_safetensors_by_hand(tmp_path / "model-00002-of-00002.safetensors", shard2, metadata={"shard": "2"})
    wm = {n: "model-00001-of-00002.safetensors" for n in shard1} | {n: "model-00002-of-00002.safetensors"
                                                                   for n in shard2}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                       "weight_map": wm}))
    return shard1, shard2


def test_sharded_directory(tmp_path):
    shard1, shard2 = make_sharded(tmp_path)
    d = SafetensorsDir(tmp_path)
    assert d.names() == list(shard1) + list(shard2)
    assert sorted(p.name for p in d.files()) == ["model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"]
    assert d.info("model.layers.0.mlp.gate.weight").file == str(tmp_path / "model-00001-of-00002.safetensors")
    assert d.info("w.bf16").file == str(tmp_path / "model-00002-of-00002.safetensors")
    assert d.metadata("model-00002-of-00002.safetensors") == {"shard": "2"}
    for name, want in shard1.items():
        np.testing.assert_array_equal(d.require(name, shape=want.shape, dtypes="F32"), want)
    for name, (dt, want) in shard2.items():
        assert same_bits(d.require(name, dtypes=[dt, "F32"]), want)
    assert d.require("model.embed_tokens.weight", shape=(None, 8)).shape == (16, 8)


def test_index_authoritative_over_extra_shard_tensors(tmp_path):
    make_sharded(tmp_path)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["w.e5m2"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    d = SafetensorsDir(tmp_path)
    assert not d.has("w.e5m2") and d.has("w.e4m3")


# ---- safetensors: errors ----------------------------------------------------------------------------------------


def test_missing_config(tmp_path):
    st_save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match=r"config\.json: missing"):
        SafetensorsDir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match=r"config\.json: corrupt"):
        SafetensorsDir(tmp_path)
    with pytest.raises(LoadError, match="not a directory"):
        SafetensorsDir(tmp_path / "nope")


def test_no_weights(tmp_path):
    write_config(tmp_path)
    with pytest.raises(LoadError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        SafetensorsDir(tmp_path)


def test_missing_shard(tmp_path):
    make_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LoadError, match=r"model-00002-of-00002\.safetensors: missing.*index") as ei:
        SafetensorsDir(tmp_path)
    assert ei.value.file == str(tmp_path / "model-00002-of-00002.safetensors")


def test_index_tensor_missing_from_shard(tmp_path):
    make_sharded(tmp_path)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.mlp.experts.0.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(LoadError, match=r"model-00001-of-00002\.safetensors: tensor "
                                        r"'model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight': listed in") as ei:
        SafetensorsDir(tmp_path)
    assert ei.value.tensor == "model.layers.0.mlp.experts.0.up_proj.weight"


def test_corrupt_index(tmp_path):
    make_sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    with pytest.raises(LoadError, match=r"index\.json: corrupt index"):
        SafetensorsDir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"x": "../evil.safetensors"}}')
    with pytest.raises(LoadError, match="not a file inside the model directory"):
        SafetensorsDir(tmp_path)


@pytest.mark.parametrize("cut", [4, 20, -1])
def test_truncated_shard_fails_at_open(tmp_path, cut):
    make_sharded(tmp_path)
    p = tmp_path / "model-00002-of-00002.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[:cut])
    with pytest.raises(LoadError, match=r"model-00002-of-00002\.safetensors.*truncated"):
        SafetensorsDir(tmp_path)


def test_truncated_data_names_tensor(tmp_path):
    write_config(tmp_path)
    write_safetensors_by_hand(tmp_path / "model.safetensors", {"a": ("F32", np.zeros(4, np.float32)),
                                                              "b": ("F32", np.ones(4, np.float32))})
    p = tmp_path / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(LoadError, match=r"model\.safetensors: tensor 'b': truncated: data ends at byte"):
        SafetensorsDir(tmp_path)


def test_bad_headers(tmp_path):
    write_config(tmp_path)
    p = tmp_path / "model.safetensors"
    body = b"{this is not json}"
    p.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(LoadError, match=r"model\.safetensors: corrupt header JSON"):
        SafetensorsDir(tmp_path)
    p.write_bytes(struct.pack("<Q", 2**40) + body)
    with pytest.raises(LoadError, match="exceeds"):
        SafetensorsDir(tmp_path)

    def header(h):
        t = json.dumps(h).encode()
        p.write_bytes(struct.pack("<Q", len(t)) + t + bytes(64))

    header({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}})
    with pytest.raises(LoadError, match=r"tensor 'x': corrupt header: F32 \[4\] needs 16 bytes"):
        SafetensorsDir(tmp_path)
    header({"x": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 4]}})
    with pytest.raises(LoadError, match=r"tensor 'x': unsupported dtype 'Q9'"):
        SafetensorsDir(tmp_path)
    header({"x": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
            "y": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})
    with pytest.raises(LoadError, match="overlaps"):
        SafetensorsDir(tmp_path)
    header({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 8]}})
    with pytest.raises(LoadError, match="shape"):
        SafetensorsDir(tmp_path)
    header([1, 2])
    with pytest.raises(LoadError, match="expected an object"):
        SafetensorsDir(tmp_path)


def test_require_errors(tmp_path):
    make_sharded(tmp_path)
    d = SafetensorsDir(tmp_path)
    shard1 = str(tmp_path / "model-00001-of-00002.safetensors")
    with pytest.raises(LoadError) as ei:
        d.require("model.layers.0.mlp.gate.weight", shape=(4, 16))
    assert str(ei.value) == f"{shard1}: tensor 'model.layers.0.mlp.gate.weight': expected shape [4, 16], got [4, 8]"
    with pytest.raises(LoadError, match=r"expected shape \[4\], got \[4, 8\]"):
        d.require("model.layers.0.mlp.gate.weight", shape=(4,))
    with pytest.raises(LoadError, match=r"'w\.bf16': expected dtype F32 or F16, got BF16"):
        d.require("w.bf16", dtypes=("F32", "F16"))
    with pytest.raises(LoadError, match=r"index\.json: tensor 'model\.layers\.0\.mlp\.gate\.wieght': missing.*"
                                        r"similar: \['model\.layers\.0\.mlp\.gate\.weight'\]"):
        d.require("model.layers.0.mlp.gate.wieght")
    with pytest.raises(LoadError, match="missing"):
        d.get("nope")
    with pytest.raises(LoadError, match="missing"):
        d.info("nope")
    assert isinstance(LoadError("f", "m"), ValueError)


# ---- quantization configs ---------------------------------------------------------------------------------------


def test_quantization_configs(tmp_path):
    assert quantization({}).method == "none"
    fp8 = quantization({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                "weight_block_size": [128, 128]}})
    assert (fp8.method, fp8.expert_format, fp8.block) == ("fp8_block", "fp8_block", (128, 128))
    ds4 = quantization({"expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8",
                                                                       "weight_block_size": [128, 128]}})
    assert (ds4.method, ds4.expert_format) == ("fp8_block", "ds_fp4")
    mx = quantization({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}})
    assert (mx.method, mx.expert_format, mx.block, mx.ignore) == ("mxfp4", "mxfp4", (32,), ("router",))
    ct = quantization({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                         "group_size": 16}}}}})
    assert (ct.method, ct.expert_format, ct.block, ct.ignore) == ("nvfp4_compressed", "nvfp4", (16,), ("lm_head",))
    mo = quantization({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    assert (mo.method, mo.expert_format, mo.block) == ("nvfp4_modelopt", "nvfp4", (16,))

    # ModelOpt export: hf_quant_config.json next to a config without quantization_config.
    write_config(tmp_path)
    write_safetensors_by_hand(tmp_path / "model.safetensors", {"x": ("U8", np.zeros(2, np.uint8))})
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    q = SafetensorsDir(tmp_path).quantization()
    assert (q.method, q.expert_format, q.ignore) == ("nvfp4_modelopt", "nvfp4", ("lm_head",))
    assert q.source.endswith("hf_quant_config.json")


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4}, "unknown quantization method 'gptq'"),
    ({"quant_method": "bitsandbytes"}, "unknown quantization method 'bitsandbytes'"),
    ({"bits": 4}, "no quant_method"),
    ({"quant_method": "fp8"}, "per-tensor"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo 'FP8'"),
    ({"quant_method": "modelopt"}, "without quant_algo"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "pack-quantized"),
])
def test_quantization_errors(tmp_path, qc, match):
    with pytest.raises(LoadError, match=match):
        quantization({"quantization_config": qc})
    write_config(tmp_path, quantization_config=qc)
    write_safetensors_by_hand(tmp_path / "model.safetensors", {"x": ("U8", np.zeros(2, np.uint8))})
    with pytest.raises(LoadError, match=r"config\.json: .*" + match):
        SafetensorsDir(tmp_path).quantization()


# ---- a real HF checkpoint ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3moe_checkpoint(tmp_path_factory):
    torch, transformers = need("torch"), need("transformers")

    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=32, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("qwen3moe")
    model.save_pretrained(out / "f32", max_shard_size="100KB")  # sharded, with an index
    model.to(torch.bfloat16).save_pretrained(out / "bf16")
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    return out, state


def test_hf_qwen3moe_sharded_f32(qwen3moe_checkpoint):
    out, state = qwen3moe_checkpoint
    d = SafetensorsDir(out / "f32")
    assert d.index_file is not None and len(d.files()) > 1
    # transformers 5 writes num_local_experts for Qwen3-MoE (older versions: num_experts).
    assert d.config.get("num_experts", d.config.get("num_local_experts")) == 8
    assert d.config["moe_intermediate_size"] == 32
    assert d.quantization().method == "none"
    written = {}
    for f in d.files():
        written.update(st_load_file(str(f)))
    assert sorted(d.names()) == sorted(written)
    for name, want in written.items():
        got = d.get(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    # Names present in the in-memory state dict (non-expert tensors) equal it (values of the bf16 model, widened).
    common = [n for n in state if n in written]
    assert "model.layers.0.mlp.gate.weight" in common
    for n in common:
        np.testing.assert_array_equal(d.get_f32(n).astype(ml_dtypes.bfloat16).astype(np.float32), state[n])
    # The per-expert tensors we will stack: [E] x gate/up [I, H], down [H, I].
    d.require("model.layers.1.mlp.experts.7.gate_proj.weight", shape=(32, 64), dtypes="F32")
    d.require("model.layers.1.mlp.experts.7.down_proj.weight", shape=(64, 32), dtypes="F32")
    d.require("model.layers.0.mlp.gate.weight", shape=(8, 64))


def test_hf_qwen3moe_bf16(qwen3moe_checkpoint):
    torch = need("torch")
    from safetensors.torch import load_file as st_load_torch

    out, state = qwen3moe_checkpoint
    d = SafetensorsDir(out / "bf16")
    assert d.index_file is None
    written = st_load_torch(str(out / "bf16" / "model.safetensors"))
    assert sorted(d.names()) == sorted(written)
    for name, t in written.items():
        assert t.dtype == torch.bfloat16 and d.info(name).dtype == "BF16"
        got = d.get(name)
        assert got.dtype == ml_dtypes.bfloat16 and got.shape == tuple(t.shape)
        assert got.view(np.uint16).tobytes() == t.view(torch.int16).numpy().tobytes()
        np.testing.assert_array_equal(d.get_f32(name), t.float().numpy())
    for n in (n for n in state if n in written):
        np.testing.assert_array_equal(d.get_f32(n), state[n])
    # Experts as the fused in-memory tensor (transformers 5), when present: gate_up = [gate; up] along rows.
    if "model.layers.0.mlp.experts.gate_up_proj" in state:
        gate = np.stack([d.get_f32(f"model.layers.0.mlp.experts.{e}.gate_proj.weight") for e in range(8)])
        up = np.stack([d.get_f32(f"model.layers.0.mlp.experts.{e}.up_proj.weight") for e in range(8)])
        np.testing.assert_array_equal(np.concatenate([gate, up], axis=1),
                                      state["model.layers.0.mlp.experts.gate_up_proj"])


# ---- GGUF --------------------------------------------------------------------------------------------------------

E, F, D = 4, 32, 64


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_embedding_length(D)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(F)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(["a", "b", "ab", "<|endoftext|>", "é"])
    w.add_token_merges(["a b"])
    w.add_token_types([1, 1, 1, 3, 1])
    w.add_token_scores([0.0, -1.0, -2.5, 0.0, -3.0])
    w.add_bos_token_id(3)
    w.add_eos_token_id(3)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    arrays = {
        "token_embd.weight": rng.standard_normal((5, D)).astype(np.float32),
        "output_norm.weight": rng.standard_normal(D).astype(np.float16),
        "blk.0.ffn_gate_inp.weight": rng.standard_normal((E, D)).astype(np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((16, D)).astype(np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((8, D)).astype(np.float32),
        "blk.0.ffn_gate_exps.weight": rng.standard_normal((E, F, D)).astype(np.float32),
        "blk.0.ffn_up_exps.weight": rng.standard_normal((E, F, D)).astype(np.float32),
        "blk.0.ffn_down_exps.weight": rng.standard_normal((E, D, F)).astype(np.float32),
        "blk.1.ffn_gate_exps.weight": rng.standard_normal((E, F, D)).astype(np.float32),
    }
    raw = {}
    for name, a in arrays.items():
        if name in ("token_embd.weight", "output_norm.weight", "blk.0.ffn_gate_inp.weight"):
            w.add_tensor(name, a)
            continue
        qt = {"blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.BF16, "blk.1.ffn_gate_exps.weight": Q.Q8_0}
        qt = qt.get(name, Q.Q4_0)
        raw[name] = (gguf_quantize(a, qt), qt)
        w.add_tensor(name, raw[name][0], raw_dtype=qt)  # uint8 byte shape: gguf-py converts it to elements
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, arrays, raw


def test_gguf_metadata(gguf_path):
    path, _, _ = gguf_path
    g = GGUFFile(path)
    assert g.arch == "qwen3moe"
    assert g.meta("general.name") == "tiny"
    assert g.meta("qwen3moe.expert_count") == E == g.meta("expert_count") == g.meta("{arch}.expert_count")
    assert g.meta("expert_feed_forward_length") == F and g.meta("embedding_length") == D
    assert g.meta("block_count") == 1 and g.meta("expert_used_count") == 2
    assert g.meta("rope.freq_base", None) is None and not g.has_meta("rope.freq_base") and g.has_meta("block_count")
    with pytest.raises(LoadError, match=r"tiny\.gguf: no metadata key 'qwen3moe\.nope'"):
        g.meta("{arch}.nope")
    assert "tokenizer.ggml.tokens" in g.keys() and not any(k.startswith("GGUF.") for k in g.keys())
    tok = g.tokenizer_meta()
    assert tok["model"] == "gpt2" and tok["pre"] == "qwen2"
    assert tok["tokens"] == ["a", "b", "ab", "<|endoftext|>", "é"]
    assert tok["merges"] == ["a b"]
    assert tok["token_types"].tolist() == [1, 1, 1, 3, 1]
    assert tok["scores"].dtype == np.float32 and tok["scores"].tolist() == [0.0, -1.0, -2.5, 0.0, -3.0]
    assert tok["bos_token_id"] == 3 and tok["eos_token_id"] == 3 and tok["padding_token_id"] is None
    assert tok["add_bos_token"] is False and tok["add_eos_token"] is None
    assert tok["chat_template"].startswith("{% for m in messages %}") and tok["chat_templates"] == {}


def test_gguf_tensors(gguf_path):
    path, arrays, raw = gguf_path
    g = GGUFFile(path)
    assert sorted(g.names()) == sorted(arrays) and len(g) == len(arrays) and "token_embd.weight" in g
    for name, a in arrays.items():
        want_type = raw[name][1].name if name in raw else {np.float32: "F32", np.float16: "F16"}[a.dtype.type]
        assert g.info(name) == (want_type, a.shape), name
    emb = g.get("token_embd.weight")
    assert emb.dtype == np.float32 and not emb.flags.writeable and isinstance(mmap_root(emb), mmap.mmap)
    np.testing.assert_array_equal(emb, arrays["token_embd.weight"])
    norm = g.get("output_norm.weight")
    assert norm.dtype == np.float16
    np.testing.assert_array_equal(norm, arrays["output_norm.weight"])
    np.testing.assert_array_equal(g.get_f32("output_norm.weight"), arrays["output_norm.weight"].astype(np.float32))
    bf = g.get("blk.0.attn_k.weight")
    assert bf.dtype == ml_dtypes.bfloat16 and bf.shape == (8, D)
    np.testing.assert_array_equal(bf.astype(np.float32), gguf_dequantize(raw["blk.0.attn_k.weight"][0], Q.BF16))
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"):
        qbytes, qt = raw[name]
        want = gguf_dequantize(qbytes, qt)
        assert want.shape == arrays[name].shape
        np.testing.assert_array_equal(g.get_f32(name), want)
        np.testing.assert_array_equal(g.get(name), want)
        r, t, shape = g.get_raw(name)
        assert t == qt and shape == arrays[name].shape and r.dtype == np.uint8
        assert r.shape == qbytes.shape and r.tobytes() == qbytes.tobytes()
        assert isinstance(mmap_root(r), mmap.mmap)
    r, t, shape = g.get_raw("token_embd.weight")
    assert t == Q.F32 and shape == (5, D) and r.shape == (5, 4 * D)
    with pytest.raises(LoadError, match=r"tiny\.gguf: tensor 'blk\.0\.ffn_gate_exp\.weight': missing.*similar"):
        g.get("blk.0.ffn_gate_exp.weight")


def test_gguf_expert_banks(gguf_path):
    path, arrays, raw = gguf_path
    g = GGUFFile(path)
    assert g.expert_format(0) == "q4_0"
    banks = g.expert_banks(0)
    layout = formats.RecordLayout(formats.get("q4_0"), hidden=D, inter=F)
    assert layout.check(banks) == E
    deq = layout.dequantize(banks)
    for m in ("gate", "up", "down"):
        qbytes, _ = raw[f"blk.0.ffn_{m}_exps.weight"]
        want = gguf_dequantize(qbytes, Q.Q4_0).reshape(arrays[f"blk.0.ffn_{m}_exps.weight"].shape)
        np.testing.assert_array_equal(formats.get("q4_0").dequantize(layout.split(banks, m)), want)
        np.testing.assert_array_equal(deq[m], want)
    assert deq["gate"].shape == (E, F, D) and deq["down"].shape == (E, D, F)
    # Layer 1 has a Q8_0 gate (a kept type) and no up/down: the error names the missing tensor.
    with pytest.raises(LoadError, match=r"tensor 'blk\.1\.ffn_up_exps\.weight': missing"):
        g.expert_banks(1)
    with pytest.raises(LoadError, match=r"tensor 'blk\.2\.ffn_gate_exps\.weight': missing"):
        g.expert_banks(2)


def test_gguf_mxfp4_expert_banks(tmp_path):
    rng = np.random.default_rng(4)
    path = tmp_path / "mx.gguf"
    w = GGUFWriter(str(path), "gpt-oss")
    ref = {}
    for m, shape in (("gate", (E, F, D)), ("up", (E, F, D)), ("down", (E, D, F))):
        ref[m] = gguf_quantize(rng.standard_normal(shape).astype(np.float32), Q.MXFP4)
        w.add_tensor(f"blk.0.ffn_{m}_exps.weight", ref[m], raw_dtype=Q.MXFP4)
        w.add_tensor(f"blk.0.ffn_{m}_exps.bias", rng.standard_normal((E, shape[1])).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(path)
    banks = g.expert_banks(0)
    layout = formats.RecordLayout(formats.get("mxfp4"), hidden=D, inter=F, bias=True)
    assert layout.check(banks) == E
    for m in ("gate", "up", "down"):
        want = gguf_dequantize(ref[m], Q.MXFP4)
        np.testing.assert_array_equal(formats.get("mxfp4").dequantize(layout.split(banks, m)), want)
        np.testing.assert_array_equal(banks[f"{m}.b"], g.get(f"blk.0.ffn_{m}_exps.bias"))


def test_gguf_truncated(gguf_path, tmp_path):
    path, _, _ = gguf_path
    data = path.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:-100])  # inside the last tensor's data
    with pytest.raises(LoadError, match=r"cut\.gguf: tensor '.+': truncated: data ends at byte"):
        GGUFFile(bad)
    for cut in (10, 30, 200, 600):  # inside the fixed header, the metadata, the tensor infos
        bad.write_bytes(data[:cut])
        with pytest.raises(LoadError, match=r"cut\.gguf: (truncated|corrupt)"):
            GGUFFile(bad)
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(LoadError, match="not a GGUF file"):
        GGUFFile(bad)
    with pytest.raises(LoadError, match=r"nope\.gguf: missing"):
        GGUFFile(tmp_path / "nope.gguf")
    # A corrupt array length must fail fast (gguf-py alone would loop over it reading past the end).
    corrupt = bytearray(data)
    k = corrupt.find(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens")
    assert struct.unpack_from("<IIQ", corrupt, k) == (9, 8, 5)  # ARRAY of STRING, 5 items
    struct.pack_into("<Q", corrupt, k + 8, 2**40)
    bad.write_bytes(bytes(corrupt))
    with pytest.raises(LoadError, match=r"cut\.gguf: corrupt header: metadata array 'tokenizer\.ggml\.tokens' "
                                        r"declares 1099511627776 items"):
        GGUFFile(bad)


def test_gguf_unknown_arch_and_no_tokenizer(tmp_path):
    path = tmp_path / "odd.gguf"
    w = GGUFWriter(str(path), "frobnicator")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoadError, match=r"odd\.gguf: unknown architecture 'frobnicator'"):
        GGUFFile(path)
    path2 = tmp_path / "plain.gguf"
    w = GGUFWriter(str(path2), "llama")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(path2)
    with pytest.raises(LoadError, match="no embedded tokenizer"):
        g.tokenizer_meta()
    with pytest.raises(LoadError, match="architecture 'llama' is not supported here"):
        GGUFFile(path2, archs=("qwen3moe",))
