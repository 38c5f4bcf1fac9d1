"""The ops: one launcher module per op family (checks shapes and dtypes, picks launch geometry, launches the CUDA
kernel on gpu/emu or runs the Numba kernel on the cpu device), every op function exported here.

:data:`OPS` lists every op with its contract: the function, its CUDA source(s) in ``cuda/``, its launcher module,
its Numba kernel(s) in ``cpu_kernels/``, its NumPy reference and its parity cases (the last two as dotted paths
into ``freetoken.testing``, which the package never imports). tests/test_ops_registry.py checks the registry is
complete; tests/test_kernel_parity.py runs every case on every device present.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from freetoken.device import constants
from freetoken.ops.cache import (
    cache_admit,
    cache_admit_scored,
    cache_borrow_layer,
    cache_copy,
    cache_scored_prefill,
    cache_stream_bypassed,
)
from freetoken.ops.dense import dense, dense_gemv, dense_grouped
from freetoken.ops.histogram import histogram
from freetoken.ops.latent_attention import latent_attention, latent_store
from freetoken.ops.linear_attention import gated_delta_rule, short_conv
from freetoken.ops.linear_batch import StateBatch, gated_delta_rule_batch, short_conv_batch
from freetoken.ops.moe_experts import MoeWorkspace, moe_experts
from freetoken.ops.paged_attention import kv_store, paged_attention
from freetoken.ops.paged_batch import (
    PagedBatch,
    kv_store_batch,
    latent_attention_batch,
    latent_store_batch,
    paged_attention_batch,
)
from freetoken.ops.reduce import row_sum
from freetoken.ops.rms_norm import add_rms_norm, rms_norm
from freetoken.ops.rope import rope, rope_qkv_cache
from freetoken.ops.routing import route_sigmoid_group_topk, route_softmax_group_topk, route_softmax_topk
from freetoken.ops.topk import topk
from freetoken.ops.transpose import transpose


@dataclass(frozen=True)
class Op:
    """One op's contract. ``numba``: "module:function" in ``freetoken.cpu_kernels`` (empty where the cpu device runs
    array code: ``cpu`` says what); ``reference``: "module:function"; ``cases``: the module whose ``CASES`` hold this
    op's cases (``KernelCase.op == name``)."""

    name: str
    function: Callable
    cuda: tuple[str, ...]
    launcher: str
    numba: tuple[str, ...]
    reference: str
    cases: str
    cpu: str = "numba"


_K, _R, _C = "freetoken.cpu_kernels.", "freetoken.testing.reference.", "freetoken.testing.cases."

#: Every op, by name (the name is the function's name in this package).
OPS: dict[str, Op] = {op.name: op for op in (
    Op("topk", topk, ("topk.cu",), "freetoken.ops.topk", (_K + "topk:topk_rows_f32",), _R + "topk:topk_reference",
       _C + "topk"),
    Op("row_sum", row_sum, ("reduce.cu",), "freetoken.ops.reduce", (_K + "reduce:row_sum_f32",),
       _R + "reduce:row_sum_reference", _C + "reduce"),
    Op("histogram", histogram, ("histogram.cu",), "freetoken.ops.histogram", (_K + "histogram:histogram_i32",),
       _R + "histogram:histogram_reference", _C + "histogram"),
    Op("transpose", transpose, ("transpose.cu",), "freetoken.ops.transpose", (_K + "transpose:transpose_2d",),
       _R + "transpose:transpose_reference", _C + "transpose"),
    Op("kv_store", kv_store, ("paged_attention.cu",), "freetoken.ops.paged_attention",
       (_K + "kv_store:kv_store_rows",), _R + "paged_attention:kv_store_reference", _C + "paged_attention",
       cpu="numba for f32/bf16 pools; array code (kv_encode and a scatter) for f16/fp8"),
    Op("paged_attention", paged_attention, ("paged_attention.cu",), "freetoken.ops.paged_attention",
       (_K + "paged_attention:paged_attention_rows", _K + "paged_decode:paged_decode_rows"),
       _R + "paged_attention:paged_attention_reference", _C + "paged_attention"),
    Op("kv_store_batch", kv_store_batch, ("paged_attention.cu",), "freetoken.ops.paged_batch",
       (_K + "kv_store:kv_store_rows_batch",), _R + "paged_attention:kv_store_batch_reference",
       _C + "paged_attention", cpu="numba for f32/bf16 pools; array code a sequence at a time for f16/fp8"),
    Op("paged_attention_batch", paged_attention_batch, ("paged_attention.cu",), "freetoken.ops.paged_batch",
       (_K + "paged_decode:paged_decode_batch", _K + "paged_attention:paged_attention_rows"),
       _R + "paged_attention:paged_attention_batch_reference", _C + "paged_attention"),
    Op("latent_store", latent_store, ("paged_attention.cu",), "freetoken.ops.latent_attention", (),
       _R + "latent_attention:latent_store_reference", _C + "latent_attention",
       cpu="array code (freetoken.ops.paged_attention.kv_encode and a scatter)"),
    Op("latent_attention", latent_attention, ("latent_attention.cu", "paged_attention.cu"),
       "freetoken.ops.latent_attention", (_K + "latent_attention:latent_attention_rows",),
       _R + "latent_attention:latent_attention_reference", _C + "latent_attention"),
    Op("latent_store_batch", latent_store_batch, ("paged_attention.cu",), "freetoken.ops.paged_batch", (),
       _R + "latent_attention:latent_store_batch_reference", _C + "latent_attention",
       cpu="array code (freetoken.ops.paged_attention.kv_encode and one scatter for every sequence)"),
    Op("latent_attention_batch", latent_attention_batch, ("latent_attention.cu", "paged_attention.cu"),
       "freetoken.ops.paged_batch", (_K + "latent_attention:latent_attention_batch",),
       _R + "latent_attention:latent_attention_batch_reference", _C + "latent_attention"),
    Op("short_conv", short_conv, ("linear_attention.cu",), "freetoken.ops.linear_attention",
       (_K + "linear_attention:short_conv_rows",), _R + "linear_attention:short_conv_reference",
       _C + "linear_attention"),
    Op("gated_delta_rule", gated_delta_rule, ("linear_attention.cu",), "freetoken.ops.linear_attention",
       (_K + "linear_attention:gated_delta_rule_rows",), _R + "linear_attention:gated_delta_rule_reference",
       _C + "linear_attention"),
    Op("short_conv_batch", short_conv_batch, ("linear_attention.cu",), "freetoken.ops.linear_batch",
       (_K + "linear_attention:short_conv_batch_rows", _K + "linear_attention:short_conv_rows"),
       _R + "linear_attention:short_conv_batch_reference", _C + "linear_attention"),
    Op("gated_delta_rule_batch", gated_delta_rule_batch, ("linear_attention.cu",), "freetoken.ops.linear_batch",
       (_K + "linear_attention:gated_delta_rule_rows",),
       _R + "linear_attention:gated_delta_rule_batch_reference", _C + "linear_attention"),
    Op("dense_gemv", dense_gemv, ("dense.cu",), "freetoken.ops.dense",
       (_K + "gemv:matmul_into", _K + "qgemv:qmatmul_into", _K + "fp8_dense:fp8_matmul_into"),
       _R + "dense:dense_reference", _C + "dense"),
    Op("dense", dense, ("dense.cu",), "freetoken.ops.dense",
       (_K + "gemv:matmul_into", _K + "qgemv:qmatmul_into", _K + "qgemv:dequantize_rows",
        _K + "fp8_dense:fp8_matmul_into", _K + "fp8_dense:fp8_dequantize_rows"),
       _R + "dense:dense_reference", _C + "dense"),
    Op("dense_grouped", dense_grouped, ("dense.cu",), "freetoken.ops.dense",
       (_K + "fp8_dense:fp8_grouped_into", _K + "fp8_dense:fp8_dequantize_rows"),
       _R + "dense:dense_grouped_reference", _C + "dense"),
    Op("rms_norm", rms_norm, ("rms_norm.cu",), "freetoken.ops.rms_norm", (_K + "rms_norm:rms_norm_rows",),
       _R + "rms_norm:rms_norm_reference", _C + "rms_norm"),
    Op("add_rms_norm", add_rms_norm, ("rms_norm.cu",), "freetoken.ops.rms_norm",
       (_K + "rms_norm:add_rms_norm_rows",), _R + "rms_norm:add_rms_norm_reference", _C + "rms_norm"),
    Op("rope", rope, ("rope.cu",), "freetoken.ops.rope", (_K + "rope:rope_rows",), _R + "rope:rope_reference",
       _C + "rope"),
    Op("rope_qkv_cache", rope_qkv_cache, ("rope.cu",), "freetoken.ops.rope", (_K + "rope:rope_qkv_cache_rows",),
       _R + "rope:rope_qkv_cache_reference", _C + "rope"),
    Op("route_softmax_topk", route_softmax_topk, ("routing.cu",), "freetoken.ops.routing",
       (_K + "routing:softmax_topk_rows",), _R + "routing:route_softmax_topk_reference", _C + "routing"),
    Op("route_sigmoid_group_topk", route_sigmoid_group_topk, ("routing.cu",), "freetoken.ops.routing",
       (_K + "routing:sigmoid_group_topk_rows",), _R + "routing:route_sigmoid_group_topk_reference",
       _C + "routing"),
    Op("route_softmax_group_topk", route_softmax_group_topk, ("routing.cu",), "freetoken.ops.routing",
       (_K + "routing:softmax_group_topk_rows",), _R + "routing:route_softmax_group_topk_reference",
       _C + "routing"),
    Op("moe_experts", moe_experts, ("moe_plan.cu", "moe_decode.cu", "moe_prefill.cu"), "freetoken.ops.moe_experts",
       (_K + "moe_experts:forward",), _R + "moe_experts:moe_forward_reference", _C + "moe_experts"),
    Op("cache_admit", cache_admit, ("cache.cu",), "freetoken.ops.cache", (_K + "cache:cache_admit",),
       _R + "cache:CacheModel", _C + "cache"),
    Op("cache_admit_scored", cache_admit_scored, ("cache.cu",), "freetoken.ops.cache",
       (_K + "cache:cache_admit_scored",), _R + "cache:ScoredCacheModel", _C + "cache"),
    Op("cache_scored_prefill", cache_scored_prefill, ("cache.cu",), "freetoken.ops.cache",
       (_K + "cache:cache_scored_prefill",), _R + "cache:ScoredCacheModel", _C + "cache"),
    Op("cache_stream_bypassed", cache_stream_bypassed, ("cache.cu",), "freetoken.ops.cache",
       (_K + "cache:cache_stream_bypassed",), _R + "cache:stream_bypassed_reference", _C + "cache"),
    Op("cache_copy", cache_copy, ("cache.cu",), "freetoken.ops.cache", (_K + "cache:cache_copy_bank",),
       _R + "cache:CacheModel", _C + "cache"),
    Op("cache_borrow_layer", cache_borrow_layer, ("cache.cu",), "freetoken.ops.cache",
       (_K + "cache:cache_borrow_layer",), _R + "cache:CacheModel", _C + "cache"),
)}

__all__ = ["OPS", "MoeWorkspace", "Op", "PagedBatch", "StateBatch", "add_rms_norm", "cache_admit",
           "cache_admit_scored",
           "cache_borrow_layer", "cache_copy", "cache_scored_prefill", "cache_stream_bypassed", "constants",
           "dense", "dense_gemv", "dense_grouped",
           "gated_delta_rule", "gated_delta_rule_batch", "histogram", "moe_experts",
           "kv_store", "kv_store_batch", "latent_attention", "latent_attention_batch", "latent_store",
           "latent_store_batch", "paged_attention",
           "paged_attention_batch", "rms_norm", "rope", "rope_qkv_cache",
           "route_sigmoid_group_topk", "route_softmax_group_topk", "route_softmax_topk", "row_sum", "short_conv",
           "short_conv_batch", "topk", "transpose"]
