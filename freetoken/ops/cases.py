"""Parity cases for every kernel: inputs, the NumPy reference, tolerance and bytes moved.

One registry serves the test suite (small, awkward shapes on cpu / emu / gpu) and ``bench/gpu_check``
(large shapes on the GPU, timed). A case runs in three steps so that timing covers the launch alone:
``setup`` copies inputs to the device and allocates POISONED outputs (NaN / INT_MIN, so unwritten elements
fail), ``launch`` calls the op, ``fetch`` copies the outputs back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from freetoken import formats, ops
from freetoken.formats import RecordLayout
from freetoken.ops.attention_reference import attention_reference
from freetoken.ops.dense import dense_gemv
from freetoken.ops.moe_experts import moe_experts
from freetoken.ops.moe_reference import moe_forward_reference, moe_prefill_reference
from freetoken.testing import assert_close, max_error, poison, random_record


@dataclass(frozen=True)
class KernelCase:
    name: str  # the kernel (or kernel family) exercised
    source: str  # its file in cuda/
    make: Callable[[np.random.Generator, str], dict]  # (rng, "small" | "large") -> host inputs
    setup: Callable[[object, dict], dict]  # (device, inputs) -> device state: inputs and poisoned outputs
    launch: Callable[[object, dict], None]  # (device, state) -> None: the op alone
    reference: Callable[[dict], dict]  # inputs -> expected outputs (host)
    atol: float = 0.0
    rtol: float = 0.0
    bytes_moved: Callable[[dict], int] = lambda inp: 0
    flops: Callable[[dict], int] = lambda inp: 0
    rel_atol: float = 0.0  # added to atol, times the largest |reference| of each output
    cuda_only: bool = False  # computes something only the CUDA kernels compute (e.g. bf16 tensor-core inputs)
    fetch_fn: Callable[[object, dict], dict] | None = None  # outputs not held in "out_*" state entries

    def check(self, got: dict, want: dict) -> float:
        """Assert every output within tolerance (NaN never passes); returns the largest error."""
        if set(got) != set(want):
            raise AssertionError(f"{self.name}: outputs {sorted(got)} != reference {sorted(want)}")
        for key in want:
            ref = np.asarray(want[key])
            scale = float(np.nanmax(np.abs(ref))) if ref.size and self.rel_atol else 0.0
            assert_close(got[key], ref, self.atol + self.rel_atol * scale, self.rtol, name=f"{self.name}:{key}")
        return max(max_error(got[k], want[k]) for k in want)

    def fetch(self, dev, state: dict) -> dict:
        if self.fetch_fn is not None:
            return self.fetch_fn(dev, state)
        return {k[4:]: dev.to_host(v) for k, v in state.items() if k.startswith("out_")}

    def run(self, dev, inputs: dict) -> dict:
        """setup + launch + fetch: the case's outputs on ``dev`` as host arrays."""
        state = self.setup(dev, inputs)
        self.launch(dev, state)
        dev.synchronize()
        return self.fetch(dev, state)


def _poisoned(dev, shape, dtype):
    return dev.asarray(poison(shape, dtype))


# ---- reduce.cu --------------------------------------------------------------------------------------------
def _make_reduce(rng, size):
    rows, cols = (37, 1001) if size == "small" else (8192, 4096)
    return {"x": rng.standard_normal((rows, cols)).astype(np.float32)}


def _setup_reduce(dev, inp):
    x = dev.asarray(inp["x"])
    return {"x": x, "out_sum": _poisoned(dev, (x.shape[0],), np.float32)}


def _launch_reduce(dev, st):
    ops.row_sum(st["x"], out=st["out_sum"], device=dev)


# ---- topk.cu ----------------------------------------------------------------------------------------------
def _make_topk(rng, size):
    rows, n, k = (19, 129, 8) if size == "small" else (4096, 256, 8)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[1, 3] = np.nan
    x[2, :] = 0.5  # all ties: the lowest indices win
    x[3, ::7] = np.float32(2.0)  # repeated maxima
    return {"x": x, "k": k}


def topk_reference(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    key = np.where(np.isnan(x), -np.inf, x)
    idx = np.argsort(-key, axis=1, kind="stable")[:, :k].astype(np.int32)
    return idx, np.take_along_axis(x, idx, axis=1)


def _setup_topk(dev, inp):
    rows, k = inp["x"].shape[0], inp["k"]
    return {"x": dev.asarray(inp["x"]), "k": k, "out_idx": _poisoned(dev, (rows, k), np.int32),
            "out_val": _poisoned(dev, (rows, k), np.float32)}


def _launch_topk(dev, st):
    ops.topk(st["x"], st["k"], out_idx=st["out_idx"], out_val=st["out_val"], device=dev)


def _ref_topk(inp):
    idx, val = topk_reference(inp["x"], inp["k"])
    return {"idx": idx, "val": val}


# ---- histogram.cu -----------------------------------------------------------------------------------------
def _make_hist(rng, size):
    n, nbins = (10007, 61) if size == "small" else (1 << 24, 256)
    return {"ids": rng.integers(-3, nbins + 3, size=n).astype(np.int32), "nbins": nbins}


def _setup_hist(dev, inp):
    return {"ids": dev.asarray(inp["ids"]), "nbins": inp["nbins"],
            "out_counts": _poisoned(dev, (inp["nbins"],), np.int32)}


def _launch_hist(dev, st):
    ops.histogram(st["ids"], st["nbins"], out=st["out_counts"], device=dev)


def _ref_hist(inp):
    ids, nbins = inp["ids"], inp["nbins"]
    return {"counts": np.bincount(ids[(ids >= 0) & (ids < nbins)], minlength=nbins).astype(np.int32)}


# ---- transpose.cu -----------------------------------------------------------------------------------------
def _make_transpose(rng, size):
    rows, cols = (70, 45) if size == "small" else (8192, 8192)
    return {"x": rng.standard_normal((rows, cols)).astype(np.float32)}


def _setup_transpose(dev, inp):
    x = dev.asarray(inp["x"])
    return {"x": x, "out_out": _poisoned(dev, x.shape[::-1], x.dtype)}


def _launch_transpose(dev, st):
    ops.transpose(st["x"], out=st["out_out"], device=dev)


# ---- attention.cu -----------------------------------------------------------------------------------------
def _make_attention(t: int):
    def make(rng, size):
        if size == "small":  # odd head dim (96: 3 elements per lane), a 3-head group, 3 splits on emu
            heads, kv_heads, dim, start = (6, 2, 96, 300) if t == 1 else (8, 1, 64, 37)
        else:  # Qwen3-30B-A3B (32 q / 4 kv heads) and Mixtral-like (32 / 8) heads at a 4096-token context
            heads, kv_heads, dim, start = (32, 4, 128, 4096 - t) if t == 1 else (32, 8, 128, 4096 - t)
        rows = start + t + 5  # rows past start + T - 1 are NaN: a kernel that reads them fails
        q = (2.0 * rng.standard_normal((t, heads, dim))).astype(np.float32)  # peaky softmax: the max matters
        k = rng.standard_normal((rows, kv_heads, dim)).astype(np.float32)
        v = rng.standard_normal((rows, kv_heads, dim)).astype(np.float32)
        k[start + t:] = np.nan
        v[start + t:] = np.nan
        return {"q": q, "k": k, "v": v, "start": start}

    return make


def _setup_attention(dev, inp):
    t, heads, dim = inp["q"].shape
    return {"q": dev.asarray(inp["q"]), "k": dev.asarray(inp["k"]), "v": dev.asarray(inp["v"]),
            "start": inp["start"], "out_out": _poisoned(dev, (t, heads * dim), np.float32)}


def _launch_attention(dev, st):
    ops.attention_decode(st["q"], st["k"], st["v"], st["start"], out=st["out_out"], device=dev)


def _attention_bytes(inp):
    t, _, dim = inp["q"].shape
    kv_bytes = 2 * (inp["start"] + t) * inp["k"].shape[1] * dim * 4
    return kv_bytes + 2 * inp["q"].nbytes


def _attention_flops(inp):
    t, heads, dim = inp["q"].shape
    return sum(4 * heads * dim * (inp["start"] + i + 1) for i in range(t))


ATTENTION_CASES = [
    KernelCase(f"attention_decode_t{t}", "attention.cu", _make_attention(t), _setup_attention, _launch_attention,
               lambda inp: {"out": attention_reference(inp["q"], inp["k"], inp["v"], inp["start"])},
               rel_atol=1e-5, bytes_moved=_attention_bytes, flops=_attention_flops)
    for t in (1, 4)
]


# ---- dense.cu ---------------------------------------------------------------------------------------------
# (N, K, bias) per shape: "sq" a square projection with a bias (qkv-like), "lm" an lm_head. The small shapes have
# odd N; small "sq" K takes the vector path of every storage, small "lm" K (not a multiple of 4) the scalar path.
_DENSE_SHAPES = {"small": {"sq": (37, 104, True), "lm": (301, 66, False)},
                 "large": {"sq": (4096, 4096, True), "lm": (151936, 2048, False)}}


def dense_weights(storage: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(stored weights, their exact float32 values): Gaussian [N, K] rounded to ``storage`` (bf16 as uint16 bits)."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    if storage == "bf16":
        bits = (w.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        return bits, (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if storage == "f16":
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    return w, w


def dense_reference(x: np.ndarray, w32: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ w32.T (+ bias)`` in float64, in row chunks (bounds the float64 copy of a large matrix)."""
    x64 = x.astype(np.float64)
    out = np.empty((x.shape[0], w32.shape[0]), np.float64)
    step = max(1, (1 << 24) // max(1, w32.shape[1]))
    for r0 in range(0, w32.shape[0], step):
        out[:, r0:r0 + step] = x64 @ w32[r0:r0 + step].astype(np.float64).T
    return out if bias is None else out + bias


@lru_cache(maxsize=2)
def _dense_matrix(storage: str, n: int, k: int):
    return dense_weights(storage, n, k, seed=("bf16", "f16", "f32").index(storage))


def _make_dense(storage: str, shape: str, t: int):
    """dense_gemv over one storage: bf16/f16/f32 matrices, or GGUF Q8_0/Q4_0 blocks (their own shapes)."""
    quantized = storage in QUANT_KINDS
    shapes, matrix = (_QDENSE_SHAPES, _qdense_matrix) if quantized else (_DENSE_SHAPES, _dense_matrix)

    def make(rng, size):
        n, k, with_bias = shapes[size][shape]
        w, w32 = matrix(storage, n, k)
        return {"w": w, "w32": w32, "storage": storage, "x": rng.standard_normal((t, k), dtype=np.float32),
                "bias": rng.standard_normal(n, dtype=np.float32) if with_bias else None}

    def setup(dev, inp):
        return {"w": dev.asarray(inp["w"]), "x": dev.asarray(inp["x"]), "storage": inp["storage"],
                "bias": None if inp["bias"] is None else dev.asarray(inp["bias"]),
                "out_y": _poisoned(dev, (t, inp["w"].shape[0]), np.float32)}

    def launch(dev, st):
        dense_gemv(st["x"], st["w"], st["storage"], bias=st["bias"], out=st["out_y"], device=dev)

    return KernelCase(f"dense_gemv_{storage}_{shape}_t{t}", "dense.cu", make, setup, launch,
                      lambda inp: {"y": dense_reference(inp["x"], inp["w32"], inp["bias"])}, rel_atol=1e-5,
                      bytes_moved=lambda inp: inp["w"].nbytes, flops=lambda inp: 2 * inp["x"].size * inp["w"].shape[0])



# GGUF Q8_0 / Q4_0 weights (dense_gemv_q8_0 / dense_gemv_q4_0): K a multiple of 32; small N odd.
_QDENSE_SHAPES = {"small": {"sq": (37, 128, True), "lm": (301, 96, False)},
                  "large": {"sq": (4096, 4096, True), "lm": (151936, 2048, False)}}
QUANT_KINDS = ("q8_0", "q4_0")


def quantized_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF ``kind`` blocks of an [N, K] matrix (uint8 [N, K/32 * block bytes]): every quant byte random,
    scales float16 of magnitude 0.005 .. 0.02 with random signs."""
    from freetoken.models.qmatrix import BLOCK_BYTES

    rng = np.random.default_rng(seed)
    nb, bb = k // 32, BLOCK_BYTES[kind]
    blocks = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
    d = rng.uniform(0.005, 0.02, (n, nb)) * rng.choice(np.array([-1.0, 1.0]), (n, nb))
    blocks[..., :2] = d.astype("<f2")[..., None].view(np.uint8)
    return blocks.reshape(n, nb * bb)


def gguf_dequantized(blocks: np.ndarray, kind: str) -> np.ndarray:
    """float32 values of GGUF blocks per gguf-py (the reference decoder)."""
    from gguf.quants import GGMLQuantizationType, dequantize

    return np.asarray(dequantize(blocks, GGMLQuantizationType[kind.upper()]), dtype=np.float32)


@lru_cache(maxsize=2)
def _qdense_matrix(kind: str, n: int, k: int):
    w = quantized_blocks(kind, n, k, seed=QUANT_KINDS.index(kind))
    return w, gguf_dequantized(w, kind)


DENSE_CASES = [_make_dense(s, shape, t) for s in ("bf16", "f16", "f32") for shape in ("sq", "lm") for t in (1, 4)]
QDENSE_CASES = [_make_dense(q, shape, t) for q in QUANT_KINDS for shape in ("sq", "lm") for t in (1, 4)]


# ---- moe_decode.cu / moe_prefill.cu (with moe_plan.cu) ----------------------------------------------------
@lru_cache(maxsize=2)
def _moe_record(fmt_name: str, size: str):
    """A quantized record set shared by the decode and prefill cases of one format (quantizing is slow)."""
    hidden, inter, experts = (96, 160, 6) if size == "small" else (2048, 768, 8)  # large: Qwen3-30B-A3B experts
    layout = RecordLayout(formats.get(fmt_name), hidden, inter)
    return layout, random_record(layout, experts, seed=formats.NAMES.index(fmt_name), scale=0.05), experts


def _make_moe(fmt_name: str, mode: str):
    def make(rng, size):
        layout, banks, experts = _moe_record(fmt_name, size)
        if size == "small":
            tokens, k = (3, 2) if mode == "decode" else (40, 2)
        else:
            tokens, k = (1, 8) if mode == "decode" else (256, 8)
        ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
        return {"layout": layout, "banks": banks, "x": rng.standard_normal((tokens, layout.hidden)).astype(np.float32),
                "ids": ids, "weights": rng.random((tokens, k)).astype(np.float32)}

    def setup(dev, inp):
        return {"layout": inp["layout"], "banks": {n: dev.asarray(a) for n, a in inp["banks"].items()},
                "x": dev.asarray(inp["x"]), "ids": dev.asarray(inp["ids"]), "weights": dev.asarray(inp["weights"]),
                "out_y": _poisoned(dev, inp["x"].shape, np.float32)}

    def launch(dev, st):
        moe_experts(st["x"], st["ids"], st["weights"], st["banks"], st["layout"], mode=mode, out=st["out_y"],
                    device=dev, validate=False)

    def reference(inp):
        args = inp["x"], inp["ids"], inp["weights"]
        if mode == "prefill":
            return {"y": moe_prefill_reference(*args, inp["layout"], inp["banks"])}
        return {"y": moe_forward_reference(*args, inp["layout"].dequantize(inp["banks"]))}

    def bytes_moved(inp):
        return len(np.unique(inp["ids"])) * inp["layout"].record_bytes

    def flops(inp):
        return 6 * inp["ids"].size * inp["layout"].hidden * inp["layout"].inter

    return KernelCase(f"moe_{mode}_{fmt_name}", f"moe_{mode}.cu", make, setup, launch, reference,
                      rtol=1e-5 if mode == "decode" else 1e-4, rel_atol=2e-6 if mode == "decode" else 1e-4,
                      bytes_moved=bytes_moved, flops=flops, cuda_only=mode == "prefill")


MOE_CASES = [_make_moe(f, m) for m in ("decode", "prefill") for f in formats.NAMES]

# ---- cache.cu -------------------------------------------------------------------------------------------------
def _cache_dims(size):
    # (hidden, inter, layers, experts, slots, k): issue 4's benchmark point on gpu, a toy on emu
    return (64, 32, 2, 16, 40, 8) if size == "small" else (2048, 768, 2, 128, 1024, 8)


def _make_cache_case(fmt_name: str, what: str):
    def make(rng, size):
        hidden, inter, layers, experts, slots, k = _cache_dims(size)
        layout = RecordLayout(formats.get(fmt_name), hidden, inter)
        ids = [np.sort(rng.permutation(experts)[:k]).astype(np.int32)[None, :] for _ in range(32)]
        return {"layout": layout, "layers": layers, "experts": experts, "slots": slots, "ids": ids, "seed": 7}

    def setup(dev, inp):
        from freetoken.cache import ExpertCache, HostPool

        pool = HostPool(dev, inp["layout"], inp["layers"], inp["experts"])
        rng = np.random.default_rng(inp["seed"])
        for name in pool.banks:  # random record bytes: copies are checked byte for byte
            host = pool.host(name).view(np.uint8)
            host[...] = rng.integers(0, 256, host.shape, dtype=np.uint8)
        cache = ExpertCache(pool, inp["slots"], max_active=inp["ids"][0].size)
        first = dev.asarray(inp["ids"][0])
        cache.admit(0, first)
        cache.copy_missing()
        dev.synchronize()
        return {"cache": cache, "first": first, "ids": [dev.asarray(i) for i in inp["ids"]], "i": [0]}

    def launch(dev, st):
        cache = st["cache"]
        if what == "copy":
            cache.copy_missing()  # the first admit's worklist again: k records over PCIe
            return
        i = st["i"][0] = st["i"][0] + 1
        ids = st["ids"][i % len(st["ids"])].copy()
        cache.admit(i % cache.num_layers, ids)
        cache.copy_missing()

    def fetch(dev, st):
        cache = st["cache"]
        slots = dev.to_host(st["first"]).ravel()
        flat = dev.to_host(cache.id_of_slot)[slots]
        same = all(np.array_equal(dev.to_host(bank[int(s)]).view(np.uint8), cache.pool.host(n)[int(f)].view(np.uint8))
                   for n, bank in cache.slot_banks.items() for s, f in zip(slots, flat, strict=True))
        return {"first_slots": slots, "rows_match": np.array([int(same)])}

    def reference(inp):
        from freetoken.cache import CacheModel

        model = CacheModel(inp["layers"], inp["experts"], inp["slots"])
        want, _ = model.admit(0, inp["ids"][0])
        return {"first_slots": want.ravel(), "rows_match": np.array([1])}

    return KernelCase(f"cache_{what}_{fmt_name}", "cache.cu", make, setup, launch, reference, fetch_fn=fetch,
                      cuda_only=True, bytes_moved=lambda inp: inp["ids"][0].size * inp["layout"].record_bytes)


CACHE_CASES = [_make_cache_case(f, w) for w in ("admit_copy", "copy") for f in ("q4_0", "bf16")]

CASES: list[KernelCase] = [
    KernelCase("reduce_rows_f32", "reduce.cu", _make_reduce, _setup_reduce, _launch_reduce,
               lambda inp: {"sum": inp["x"].astype(np.float64).sum(axis=1)}, atol=1e-3, rtol=1e-5,
               bytes_moved=lambda inp: inp["x"].nbytes),
    KernelCase("topk_rows_f32", "topk.cu", _make_topk, _setup_topk, _launch_topk, _ref_topk,
               bytes_moved=lambda inp: inp["x"].nbytes),
    KernelCase("histogram_i32", "histogram.cu", _make_hist, _setup_hist, _launch_hist, _ref_hist,
               bytes_moved=lambda inp: inp["ids"].nbytes),
    KernelCase("transpose_u32", "transpose.cu", _make_transpose, _setup_transpose, _launch_transpose,
               lambda inp: {"out": np.ascontiguousarray(inp["x"].T)},
               bytes_moved=lambda inp: 2 * inp["x"].nbytes),
] + ATTENTION_CASES + DENSE_CASES + QDENSE_CASES + MOE_CASES + CACHE_CASES
