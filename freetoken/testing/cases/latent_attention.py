"""Parity cases of ``ops.latent_store`` and ``ops.latent_attention`` (``cuda/latent_attention.cu`` with the paged
cache's ``kv_store_<kind>`` and ``paged_combine`` from ``cuda/paged_attention.cu``;
``cpu_kernels/latent_attention.py``).

Every case scatters the sequence over a shuffled block table in a pool with more blocks than it uses; the blocks the
table does not name (and, for attention, the rows past the sequence's end) hold NaN or random codes, so a kernel that
reads them fails. Small sizes: few heads, latent ranks of 31 to 100, rope parts of 0 to 16, a prefix before the
queries; large sizes: DeepSeek-V3 (128 heads, R = 512, P = 64) decoding at 4k context and a prompt chunk."""

from __future__ import annotations

import numpy as np

from freetoken import ops
from freetoken.testing.cases.base import KernelCase, poisoned
from freetoken.testing.cases.paged_attention import _pool
from freetoken.testing.reference.latent_attention import (
    latent_attention_batch_reference,
    latent_attention_reference,
    latent_store_batch_reference,
    latent_store_reference,
)
from freetoken.testing.reference.paged_attention import kv_encode_reference

#: DeepSeek-V3's attention: 128 heads, latent rank 512, rope dims 64, 64-token blocks.
DEEPSEEK = {"heads": 128, "rank": 512, "rope": 64, "block_size": 64}


def _layout(rng, kind: str, tokens: int, block_size: int, width: int, spare: int = 3, fill_nan: bool = False):
    """(pool, pool_scale or None, table): a pool of random stored values with ``spare`` blocks more than the
    sequence needs, and a shuffled table with one spare entry past its last used block."""
    nblocks = -(-tokens // block_size) + spare
    table = rng.permutation(nblocks).astype(np.int32)
    pool = _pool(rng, kind, (nblocks, block_size, 1, width), fill_nan)
    scale = rng.uniform(0.5, 2.0, (nblocks, block_size, 1)).astype(np.float32) if kind == "fp8" else None
    return pool, scale, table[: -(-tokens // block_size) + 1]


def _dev(dev, a):
    return None if a is None else dev.asarray(a)


# ---- latent_store -------------------------------------------------------------------------------------------------
def _make_store(kind: str, t: int):
    def make(rng, size):
        if size == "small":
            width, block_size, start = 80, 16, 13
        else:
            width, block_size, start = DEEPSEEK["rank"] + DEEPSEEK["rope"], DEEPSEEK["block_size"], 4000
        pool, scale, table = _layout(rng, kind, start + t, block_size, width)
        kv = (3.0 * rng.standard_normal((t, width))).astype(np.float32)
        kv[0, :3] = [0.0, -0.0, 1e-30]  # signed zero and an underflow to the smallest codes
        if t > 1:
            kv[-1] = 0.0  # an all-zero row: fp8 scale 1
        return {"kv": kv, "pool": pool, "pool_scale": scale, "table": table, "start": start}

    return make


def _setup_store(dev, inp):
    st = {"kv": dev.asarray(inp["kv"]), "table": dev.asarray(inp["table"]), "start": inp["start"],
          "out_pool": dev.asarray(inp["pool"])}
    if inp["pool_scale"] is not None:
        st["out_pool_scale"] = dev.asarray(inp["pool_scale"])
    return st


def _launch_store(dev, st):
    ops.latent_store(st["kv"], st["out_pool"], st.get("out_pool_scale"), st["table"], st["start"], device=dev)


def _ref_store(inp):
    pool, scale = latent_store_reference(inp["kv"], inp["pool"], inp["pool_scale"], inp["table"], inp["start"])
    return {"pool": pool} if scale is None else {"pool": pool, "pool_scale": scale}


def _store_bytes(inp):
    t, width = inp["kv"].shape
    return t * width * (4 + inp["pool"].dtype.itemsize)


STORE_CASES = [
    KernelCase(f"latent_store_{kind}_t{t}", "paged_attention.cu", _make_store(kind, t), _setup_store, _launch_store,
               _ref_store, bytes_moved=_store_bytes, op="latent_store")
    for kind, t in (("bf16", 1), ("bf16", 21), ("f16", 5), ("f32", 5), ("fp8", 1), ("fp8", 21))
]


# ---- latent_attention ---------------------------------------------------------------------------------------------
def _make_attention(kind: str, t_small: int, h_small: int, r_small: int, p_small: int, s_small: int,
                    t_large: int = 1):
    def make(rng, size):
        if size == "small":
            t, heads, rank, rope, start, block_size = t_small, h_small, r_small, p_small, s_small, 16
        else:  # DeepSeek-V3 ending at 4096 tokens of context
            t, heads, rank, rope = t_large, DEEPSEEK["heads"], DEEPSEEK["rank"], DEEPSEEK["rope"]
            start, block_size = 4096 - t, DEEPSEEK["block_size"]
        width, total = rank + rope, start + t
        pool, scale, table = _layout(rng, kind, total, block_size, width, fill_nan=True)
        # the sequence's positions hold real values; the rest of the pool stays NaN / random codes
        pos = np.arange(total)
        blocks, rows = table[pos // block_size], pos % block_size
        vals, sc = kv_encode_reference(rng.standard_normal((total, 1, width)).astype(np.float32), kind)
        pool[blocks, rows] = vals
        if sc is not None:
            scale[blocks, rows] = sc
        q = (2.0 * rng.standard_normal((t, heads, width))).astype(np.float32)  # peaky softmax: the max matters
        return {"q": q, "pool": pool, "pool_scale": scale, "table": table, "start": start, "rank": rank,
                "scale": float(1.0 / np.sqrt(width))}

    return make


def _setup_attention(dev, inp):
    t, heads, _ = inp["q"].shape
    return {**{key: _dev(dev, inp[key]) for key in ("q", "pool", "pool_scale", "table")},
            "start": inp["start"], "rank": inp["rank"], "scale": inp["scale"],
            "out_out": poisoned(dev, (t, heads * inp["rank"]), np.float32)}


def _launch_attention(dev, st):
    ops.latent_attention(st["q"], st["pool"], st["pool_scale"], st["table"], st["start"], st["rank"],
                         scale=st["scale"], out=st["out_out"], device=dev)


def _ref_attention(inp):
    return {"out": latent_attention_reference(inp["q"], inp["pool"], inp["pool_scale"], inp["table"], inp["start"],
                                              inp["rank"], scale=inp["scale"])}


def _attention_bytes(inp):
    """Each cached row (and its fp8 scale) read once, q read and the output written once."""
    t, heads, width = inp["q"].shape
    pool = inp["pool"]
    row = width * pool.dtype.itemsize + (4 if inp["pool_scale"] is not None else 0)
    return (inp["start"] + t) * row + inp["q"].nbytes + 4 * t * heads * inp["rank"]


def _attention_flops(inp):
    t, heads, width = inp["q"].shape
    visible = inp["start"] * t + t * (t + 1) // 2  # query i sees start + i + 1 rows
    return 2 * heads * (width + inp["rank"]) * visible


#: CUDA: bf16 Q, rows and probabilities on the tensor cores (fp32 softmax and sums): within 1e-2 of the largest
#: output (Q's rounding dominates: ~5e-3 on these scores); the cpu kernel is float32 (tests/test_latent_attention.py
#: holds it to 1e-5).
ATTENTION_CASES = [
    KernelCase(f"latent_attention_{kind}_t{t}_h{heads}_r{rank}_p{rope}", "latent_attention.cu",
               _make_attention(kind, t, heads, rank, rope, start, t_large), _setup_attention, _launch_attention,
               _ref_attention, rel_atol=1e-2, bytes_moved=_attention_bytes, flops=_attention_flops,
               op="latent_attention")
    for kind, t, heads, rank, rope, start, t_large in (
        ("bf16", 1, 16, 64, 16, 150, 1),  # decode: flash-decoding splits on gpu/emu (DeepSeek at 4k on the GPU)
        ("fp8", 3, 4, 32, 16, 40, 4),
        ("f16", 1, 1, 32, 0, 37, 16),  # one head, no rope part
        ("f32", 17, 4, 100, 12, 20, 16),  # R not a multiple of 8, rows of 112 (the 128 build)
        ("bf16", 40, 4, 64, 16, 19, 256),  # a prompt chunk: rows of several queries share a block
        ("fp8", 17, 16, 32, 16, 9, 1),
        ("bf16", 5, 3, 31, 0, 12, 1),  # odd rows: 3 heads of 31 values
    )
]


# ---- a batch of sequences (ops.latent_store_batch, ops.latent_attention_batch) -------------------------------------
def _make_batch(kind: str, heads: int, rank: int, rope: int, seqs_small):
    """Sequences ``seqs`` [(start, rows)] over one pool (small: 16-row blocks; large: DeepSeek-V3, 16 decode steps
    and a 256-token chunk), sequences 0 and 1 sharing their first block (a common prefix before either one's
    start); each sequence's positions hold real values, the rest of the pool NaN / random codes."""
    def make(rng, size):
        if size == "small":
            seqs, h, r, p, block_size = seqs_small, heads, rank, rope, 16
        else:
            seqs = [(4095 - 97 * i, 1) for i in range(16)] + [(3072, 256)]
            h, r, p, block_size = DEEPSEEK["heads"], DEEPSEEK["rank"], DEEPSEEK["rope"], DEEPSEEK["block_size"]
        width = r + p
        need = [-(-(st + n) // block_size) for st, n in seqs]
        nblocks = sum(need) + 2
        order = iter(rng.permutation(nblocks).astype(np.int32))
        tables = np.zeros((len(seqs), max(need) + 1), np.int32)
        for s, blocks in enumerate(need):
            for b in range(blocks):
                tables[s, b] = tables[0, 0] if s == 1 and b == 0 else next(order)
        pool = _pool(rng, kind, (nblocks, block_size, 1, width), fill_nan=True)
        scale = rng.uniform(0.5, 2.0, (nblocks, block_size, 1)).astype(np.float32) if kind == "fp8" else None
        for s, (st, n) in enumerate(seqs):
            pos = np.arange(block_size if s == 1 else 0, st + n)
            vals, sc = kv_encode_reference(rng.standard_normal((pos.size, 1, width)).astype(np.float32), kind)
            blocks, rows = tables[s][pos // block_size], pos % block_size
            pool[blocks, rows] = vals
            if sc is not None:
                scale[blocks, rows] = sc
        t = sum(n for _, n in seqs)
        return {"q": (2.0 * rng.standard_normal((t, h, width))).astype(np.float32),
                "kv": (3.0 * rng.standard_normal((t, width))).astype(np.float32), "pool": pool, "pool_scale": scale,
                "tables": tables, "starts": [st for st, _ in seqs], "counts": [n for _, n in seqs], "rank": r,
                "scale": float(1.0 / np.sqrt(width))}

    return make


def _setup_batch(dev, inp):
    t, heads, _ = inp["q"].shape
    return {**{key: _dev(dev, inp[key]) for key in ("q", "kv")},
            "batch": ops.PagedBatch(inp["tables"], inp["starts"], inp["counts"], device=dev), "rank": inp["rank"],
            "scale": inp["scale"], "pool": dev.asarray(inp["pool"]), "pool_scale": _dev(dev, inp["pool_scale"]),
            "out_pool": dev.asarray(inp["pool"]), "out_pool_scale": _dev(dev, inp["pool_scale"]),
            "out_out": poisoned(dev, (t, heads * inp["rank"]), np.float32)}


def _fetch_store_batch(dev, st):
    got = {"pool": dev.to_host(st["out_pool"])}
    if st["out_pool_scale"] is not None:
        got["pool_scale"] = dev.to_host(st["out_pool_scale"])
    return got


def _launch_store_batch(dev, st):
    ops.latent_store_batch(st["kv"], st["out_pool"], st["out_pool_scale"], st["batch"], device=dev)


def _ref_store_batch(inp):
    pool, scale = latent_store_batch_reference(inp["kv"], inp["pool"], inp["pool_scale"], inp["tables"],
                                               inp["starts"], inp["counts"])
    return {"pool": pool} if scale is None else {"pool": pool, "pool_scale": scale}


def _launch_attention_batch(dev, st):
    ops.latent_attention_batch(st["q"], st["pool"], st["pool_scale"], st["batch"], st["rank"], scale=st["scale"],
                               out=st["out_out"], device=dev)


def _ref_attention_batch(inp):
    return {"out": latent_attention_batch_reference(inp["q"], inp["pool"], inp["pool_scale"], inp["tables"],
                                                    inp["starts"], inp["counts"], inp["rank"], scale=inp["scale"])}


def _batch_bytes(inp):
    pool = inp["pool"]
    row = pool.shape[3] * pool.dtype.itemsize + (4 if inp["pool_scale"] is not None else 0)
    keys = sum(st + n for st, n in zip(inp["starts"], inp["counts"], strict=True))
    return keys * row + inp["q"].nbytes + 4 * inp["q"].shape[0] * inp["q"].shape[1] * inp["rank"]


_DECODE_SEQS = [(150, 1), (37, 1), (3, 1), (64, 3)]  # decode steps: splits on gpu/emu, one only 4 keys long
BATCH_CASES = [
    KernelCase(f"latent_store_batch_{kind}", "paged_attention.cu", _make_batch(kind, 4, 32, 16, _DECODE_SEQS),
               _setup_batch, _launch_store_batch, _ref_store_batch, fetch_fn=_fetch_store_batch,
               bytes_moved=lambda inp: inp["kv"].shape[0] * inp["kv"].shape[1] * (4 + inp["pool"].dtype.itemsize),
               op="latent_store_batch")
    for kind in ("bf16", "fp8")
] + [
    KernelCase(f"latent_attention_batch_{kind}_h{heads}_r{rank}_p{rope}" + ("_prompt" if len(seqs) > 4 else ""),
               "latent_attention.cu", _make_batch(kind, heads, rank, rope, seqs), _setup_batch,
               _launch_attention_batch, _ref_attention_batch, rel_atol=1e-2, bytes_moved=_batch_bytes,
               fetch_fn=lambda dev, st: {"out": dev.to_host(st["out_out"])}, op="latent_attention_batch")
    for kind, heads, rank, rope, seqs in (
        ("bf16", 16, 64, 16, _DECODE_SEQS),
        ("fp8", 4, 32, 16, _DECODE_SEQS + [(19, 40)]),  # a prompt chunk among them: several row blocks of its own
        ("f32", 3, 31, 0, _DECODE_SEQS),  # odd rows: 3 heads of 31 values
    )
]

CASES = STORE_CASES + ATTENTION_CASES + BATCH_CASES
