"""Parity cases of ``ops.kv_store`` and ``ops.paged_attention`` (``cuda/paged_attention.cu``,
``cpu_kernels/paged_attention.py``).

Every case scatters the sequence over a shuffled block table in a pool with more blocks than it uses; the blocks the
table does not name (and, for attention, the rows past the sequence's end) hold NaN or random codes, so a kernel that
reads them fails."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.reference.paged_attention import (
    KV_DTYPES,
    kv_encode_reference,
    kv_store_batch_reference,
    kv_store_reference,
    paged_attention_batch_reference,
    paged_attention_reference,
)


def _pool(rng, kind: str, shape, fill_nan: bool):
    """A pool of random stored values: codes (16/8-bit kinds) or floats (f32, NaN when ``fill_nan``)."""
    dt = np.dtype(KV_DTYPES[kind])
    if kind == "f32":
        return np.full(shape, np.nan, np.float32) if fill_nan else rng.standard_normal(shape).astype(np.float32)
    if kind == "f16":  # random finite halves (random bits would hold NaN and inf)
        a = rng.standard_normal(shape).astype(np.float16)
        if fill_nan:
            a[...] = np.nan
        return a
    return rng.integers(0, np.iinfo(dt).max + 1, shape, dtype=dt)


def _pools(rng, kind: str, shape, fill_nan: bool):
    """(k_pool, v_pool, k_scale, v_scale): two pools of ``shape`` (:func:`_pool`), fp8 with random row scales."""
    k, v = _pool(rng, kind, shape, fill_nan), _pool(rng, kind, shape, fill_nan)
    if kind != "fp8":
        return k, v, None, None
    ks = rng.uniform(0.5, 2.0, shape[:3]).astype(np.float32)
    return k, v, ks, rng.uniform(0.5, 2.0, shape[:3]).astype(np.float32)


def _layout(rng, kind, tokens, block_size, kv_heads, dim, spare=3, fill_nan=False):
    nblocks = -(-tokens // block_size) + spare
    table = rng.permutation(nblocks).astype(np.int32)
    shape = (nblocks, block_size, kv_heads, dim)
    k, v, ks, vs = _pools(rng, kind, shape, fill_nan)
    return k, v, ks, vs, table[: -(-tokens // block_size) + 1]  # one spare entry past the last used block


def _dev(dev, a):
    return None if a is None else dev.asarray(a)


# ---- kv_store -----------------------------------------------------------------------------------------------------
def _make_store(kind: str, t: int):
    def make(rng, size):
        kv_heads, dim, block_size, start = (2, 40, 8, 13) if size == "small" else (4, 128, 64, 4000)
        k, v, ks, vs, table = _layout(rng, kind, start + t, block_size, kv_heads, dim)
        xk = (3.0 * rng.standard_normal((t, kv_heads, dim))).astype(np.float32)
        xv = rng.standard_normal((t, kv_heads, dim)).astype(np.float32)
        xk[0, 0, :3] = [0.0, -0.0, 1e-30]  # signed zero and an underflow to the smallest codes
        xv[-1, -1] = 0.0  # an all-zero row: fp8 scale 1
        return {"k": xk, "v": xv, "k_pool": k, "v_pool": v, "k_scale": ks, "v_scale": vs, "table": table,
                "start": start}

    return make


def _setup_store(dev, inp):
    st = {"k": dev.asarray(inp["k"]), "v": dev.asarray(inp["v"]), "table": dev.asarray(inp["table"]),
          "start": inp["start"], "out_k_pool": dev.asarray(inp["k_pool"]), "out_v_pool": dev.asarray(inp["v_pool"])}
    if inp["k_scale"] is not None:
        st["out_k_scale"], st["out_v_scale"] = dev.asarray(inp["k_scale"]), dev.asarray(inp["v_scale"])
    return st


def _launch_store(dev, st):
    ops.kv_store(st["k"], st["v"], st["out_k_pool"], st["out_v_pool"], st.get("out_k_scale"), st.get("out_v_scale"),
                 st["table"], st["start"], device=dev)


def _ref_store(inp):
    k, v, ks, vs = kv_store_reference(inp["k"], inp["v"], inp["k_pool"], inp["v_pool"], inp["k_scale"],
                                      inp["v_scale"], inp["table"], inp["start"])
    got = {"k_pool": k, "v_pool": v}
    if ks is not None:
        got["k_scale"], got["v_scale"] = ks, vs
    return got


def _store_bytes(inp):
    t, kv_heads, dim = inp["k"].shape
    return 2 * t * kv_heads * dim * (4 + inp["k_pool"].dtype.itemsize)


STORE_CASES = [
    KernelCase(f"kv_store_{kind}_t{t}", "paged_attention.cu", _make_store(kind, t), _setup_store, _launch_store,
               _ref_store, bytes_moved=_store_bytes, op="kv_store")
    for kind, t in (("bf16", 1), ("bf16", 21), ("f16", 5), ("f32", 5), ("fp8", 1), ("fp8", 21))
]


# ---- paged_attention ----------------------------------------------------------------------------------------------
def _make_attention(kind: str, t_small: int, window: int = 0, sinks: bool = False, t_large: int | None = None):
    def make(rng, size):
        t = t_small
        if size == "small":  # odd head dims, groups of 3 and 4, contexts over several blocks
            heads, kv_heads, dim, start, block_size = ((6, 2, 96, 150, 16) if t <= 16 else (8, 2, 40, 19, 16))
        else:  # Qwen3-30B-A3B attention (32 q / 4 kv heads of 128) ending at 4096 tokens of context
            t = t_large or t
            heads, kv_heads, dim, start, block_size = 32, 4, 128, 4096 - t, 64
        total = start + t
        k, v, ks, vs, table = _layout(rng, kind, total, block_size, kv_heads, dim, fill_nan=True)
        # the sequence's positions hold real values; the rest of the pool stays NaN / random codes
        pos = np.arange(total)
        blocks, rows = table[pos // block_size], pos % block_size
        for pool, scales in ((k, ks), (v, vs)):
            vals, sc = kv_encode_reference(rng.standard_normal((total, kv_heads, dim)).astype(np.float32), kind)
            pool[blocks, rows] = vals
            if sc is not None:
                scales[blocks, rows] = sc
        q = (2.0 * rng.standard_normal((t, heads, dim))).astype(np.float32)  # peaky softmax: the max matters
        return {"q": q, "k_pool": k, "v_pool": v, "k_scale": ks, "v_scale": vs, "table": table, "start": start,
                "window": window,
                "sinks": rng.uniform(-1.0, 3.0, heads).astype(np.float32) if sinks else None}

    return make


def _setup_attention(dev, inp):
    t, heads, dim = inp["q"].shape
    return {**{key: _dev(dev, inp[key]) for key in ("q", "k_pool", "v_pool", "k_scale", "v_scale", "table", "sinks")},
            "start": inp["start"], "window": inp["window"],
            "out_out": poisoned(dev, (t, heads * dim), np.float32)}


def _launch_attention(dev, st):
    ops.paged_attention(st["q"], st["k_pool"], st["v_pool"], st["k_scale"], st["v_scale"], st["table"], st["start"],
                        window=st["window"], sinks=st["sinks"], out=st["out_out"], device=dev)


def _ref_attention(inp):
    return {"out": paged_attention_reference(inp["q"], inp["k_pool"], inp["v_pool"], inp["k_scale"], inp["v_scale"],
                                             inp["table"], inp["start"], window=inp["window"], sinks=inp["sinks"])}


def _visible(inp, i):
    pos = inp["start"] + i
    return pos + 1 if inp["window"] == 0 else min(pos + 1, inp["window"])


def _attention_bytes(inp):
    t, heads, dim = inp["q"].shape
    kv = inp["k_pool"]
    keys = inp["start"] + t if t <= 16 else _visible(inp, t - 1)
    return 2 * keys * kv.shape[2] * dim * kv.dtype.itemsize + 2 * inp["q"].nbytes


def _attention_flops(inp):
    t, heads, dim = inp["q"].shape
    return sum(4 * heads * dim * _visible(inp, i) for i in range(t))


#: Decode (T <= 16: fp32 math on the decoded values) within 1e-5 of the largest output; prefill (T > 16: the CUDA
#: kernel multiplies 16-bit Q, K, V and probabilities on the tensor cores, fp32 sums) within 1e-2.
ATTENTION_CASES = [
    KernelCase(f"paged_attention_{kind}_t{t}" + (f"_w{w}" if w else "") + ("_sinks" if s else ""),
               "paged_attention.cu", _make_attention(kind, t, w, s), _setup_attention, _launch_attention,
               _ref_attention, rel_atol=1e-5 if t <= 16 else 1e-2, bytes_moved=_attention_bytes,
               flops=_attention_flops, op="paged_attention")
    for kind, t, w, s in (("bf16", 1, 0, False), ("fp8", 4, 0, True), ("f16", 1, 37, False),
                          ("bf16", 40, 0, False), ("f32", 40, 23, True))
] + [  # a prompt chunk (on the GPU: 1024 queries after 3072 tokens, the prefill kernel's TFLOP/s)
    KernelCase("paged_prefill_bf16_chunk", "paged_attention.cu", _make_attention("bf16", 24, t_large=1024),
               _setup_attention, _launch_attention, _ref_attention, rel_atol=1e-2, bytes_moved=_attention_bytes,
               flops=_attention_flops, op="paged_attention"),
]


# ---- a batch of sequences (ops.kv_store_batch, ops.paged_attention_batch) ----------------------------------------
def _batch_layout(rng, kind, seqs, block_size, kv_heads, dim, shared: int, fill_nan: bool):
    """One pool for several sequences ``seqs`` [(start, rows)]: each sequence's blocks drawn from a shuffled pool
    with spare blocks, the first ``shared`` blocks of sequences 0 and 1 the same blocks (a common prefix, before
    either one's start); tables ``[S, W]`` with a spare entry past each sequence's last block."""
    need = [-(-(start + n) // block_size) for start, n in seqs]
    assert shared * block_size <= min(seqs[0][0], seqs[1][0])
    nblocks = sum(need) - shared + 3
    order = iter(rng.permutation(nblocks).astype(np.int32))
    width = max(need) + 1
    tables = np.zeros((len(seqs), width), np.int32)
    for s, blocks in enumerate(need):
        for b in range(width):
            tables[s, b] = tables[0, b] if s == 1 and b < shared else next(order) if b < blocks else 0
    shape = (nblocks, block_size, kv_heads, dim)
    k, v, ks, vs = _pools(rng, kind, shape, fill_nan)
    return k, v, ks, vs, tables


def _batch_seqs(size: str, prompt: bool):
    """(start, rows) of each sequence: decode steps over contexts of different lengths (one only 4 keys long, one
    4 queries), sequences 0 and 1 sharing their first blocks, and with ``prompt`` a prompt chunk among them."""
    if size == "small":
        seqs = [(150, 1), (37, 1), (3, 1), (64, 4)] + ([(19, 40)] if prompt else [])
        return seqs, (6, 2, 48, 16), 2
    seqs = [(4095 - 97 * i, 1) for i in range(16)] + ([(3072, 256)] if prompt else [])
    return seqs, (32, 4, 128, 64), 32


def _make_store_batch(kind: str):
    def make(rng, size):
        seqs, (_, kv_heads, dim, block_size), shared = _batch_seqs(size, prompt=True)
        k, v, ks, vs, tables = _batch_layout(rng, kind, seqs, block_size, kv_heads, dim, shared, fill_nan=False)
        t = sum(n for _, n in seqs)
        return {"k": (3.0 * rng.standard_normal((t, kv_heads, dim))).astype(np.float32),
                "v": rng.standard_normal((t, kv_heads, dim)).astype(np.float32), "k_pool": k, "v_pool": v,
                "k_scale": ks, "v_scale": vs, "tables": tables, "starts": [s for s, _ in seqs],
                "counts": [n for _, n in seqs]}

    return make


def _setup_store_batch(dev, inp):
    st = _setup_store(dev, {**inp, "table": inp["tables"], "start": 0})
    st["batch"] = ops.PagedBatch(inp["tables"], inp["starts"], inp["counts"], device=dev)
    return st


def _launch_store_batch(dev, st):
    ops.kv_store_batch(st["k"], st["v"], st["out_k_pool"], st["out_v_pool"], st.get("out_k_scale"),
                       st.get("out_v_scale"), st["batch"], device=dev)


def _ref_store_batch(inp):
    k, v, ks, vs = kv_store_batch_reference(inp["k"], inp["v"], inp["k_pool"], inp["v_pool"], inp["k_scale"],
                                            inp["v_scale"], inp["tables"], inp["starts"], inp["counts"])
    return {"k_pool": k, "v_pool": v, **({"k_scale": ks, "v_scale": vs} if ks is not None else {})}


def _make_attention_batch(kind: str, window: int = 0, sinks: bool = False, prompt: bool = True):
    def make(rng, size):
        seqs, (heads, kv_heads, dim, block_size), shared = _batch_seqs(size, prompt)
        k, v, ks, vs, tables = _batch_layout(rng, kind, seqs, block_size, kv_heads, dim, shared, fill_nan=True)
        for s, (start, n) in enumerate(seqs):  # each sequence's positions hold real values (the shared ones once)
            pos = np.arange(shared * block_size if s == 1 else 0, start + n)
            blocks, rows = tables[s][pos // block_size], pos % block_size
            for pool, scales in ((k, ks), (v, vs)):
                vals, sc = kv_encode_reference(rng.standard_normal((pos.size, kv_heads, dim)).astype(np.float32),
                                               kind)
                pool[blocks, rows] = vals
                if sc is not None:
                    scales[blocks, rows] = sc
        t = sum(n for _, n in seqs)
        return {"q": (2.0 * rng.standard_normal((t, heads, dim))).astype(np.float32), "k_pool": k, "v_pool": v,
                "k_scale": ks, "v_scale": vs, "tables": tables, "starts": [s for s, _ in seqs],
                "counts": [n for _, n in seqs], "window": window,
                "sinks": rng.uniform(-1.0, 3.0, heads).astype(np.float32) if sinks else None}

    return make


def _setup_attention_batch(dev, inp):
    t, heads, dim = inp["q"].shape
    return {**{key: _dev(dev, inp[key]) for key in ("q", "k_pool", "v_pool", "k_scale", "v_scale", "sinks")},
            "batch": ops.PagedBatch(inp["tables"], inp["starts"], inp["counts"], device=dev),
            "window": inp["window"], "out_out": poisoned(dev, (t, heads * dim), np.float32)}


def _launch_attention_batch(dev, st):
    ops.paged_attention_batch(st["q"], st["k_pool"], st["v_pool"], st["k_scale"], st["v_scale"], st["batch"],
                              window=st["window"], sinks=st["sinks"], out=st["out_out"], device=dev)


def _ref_attention_batch(inp):
    return {"out": paged_attention_batch_reference(inp["q"], inp["k_pool"], inp["v_pool"], inp["k_scale"],
                                                   inp["v_scale"], inp["tables"], inp["starts"], inp["counts"],
                                                   window=inp["window"], sinks=inp["sinks"])}


def _attention_batch_bytes(inp):
    kv, dim = inp["k_pool"], inp["q"].shape[2]
    keys = sum(start + n for start, n in zip(inp["starts"], inp["counts"], strict=True))
    return 2 * keys * kv.shape[2] * dim * kv.dtype.itemsize + 2 * inp["q"].nbytes


BATCH_CASES = [
    KernelCase(f"kv_store_batch_{kind}", "paged_attention.cu", _make_store_batch(kind), _setup_store_batch,
               _launch_store_batch, _ref_store_batch, bytes_moved=lambda inp: _store_bytes(inp), op="kv_store_batch")
    for kind in ("bf16", "f16", "f32", "fp8")
] + [  # with a prompt chunk among the sequences: its rows run the prefill kernel (bf16 products on the GPU)
    KernelCase(f"paged_attention_batch_{kind}" + (f"_w{w}" if w else "") + ("_sinks" if s else "")
               + ("" if p else "_decode"), "paged_attention.cu", _make_attention_batch(kind, w, s, p),
               _setup_attention_batch, _launch_attention_batch, _ref_attention_batch,
               rel_atol=1e-2 if p else 1e-5, bytes_moved=_attention_batch_bytes, op="paged_attention_batch")
    for kind, w, s, p in (("bf16", 0, False, False), ("bf16", 0, False, True), ("fp8", 0, True, False),
                          ("f16", 37, False, True), ("f32", 23, True, False))
]

CASES = STORE_CASES + ATTENTION_CASES + BATCH_CASES
