"""The routed-expert forward (the MoE FFN) on every device.

``y[t] = sum_j weights[t, j] * (down_e @ act(gate_e @ x[t] (+ gb), up_e @ x[t] (+ ub)) (+ db))``, ``e = ids[t, j]``.

gpu / emu run ``cuda/moe_plan.cu`` (group pairs by slot), then ``cuda/moe_decode.cu`` (few tokens: GEMV over
records, each record byte read once) or ``cuda/moe_prefill.cu`` (many tokens: grouped GEMM, tensor cores on
sm_80+), then ``moe_combine``. The cpu device runs the Numba kernels of ``cpu_kernels/moe_experts.py``.
Prefill computes with bf16-rounded inputs (as tensor cores do); decode reads weights exactly.
"""

from __future__ import annotations

import os

import numpy as np

from freetoken.device.constants import (
    DECODE_MAX_TOKENS,
    DECODE_ROWS,
    EXPERT_BANKS,
    NO_ROUTE,
    PLAN,
    PREFILL_ROWS,
    TILE_M,
    activation_code,
)
from freetoken.device.simd import ACTIVATIONS
from freetoken.formats import MATRICES, RecordLayout
from freetoken.formats.table import KERNEL_FAMILY
from freetoken.ops._common import as_input, check_int32, cpu_module, cuda_kernel, prepare_out, resolve

# TILE_M (pairs per prefill tile), DECODE_ROWS / PREFILL_ROWS (output rows per block), DECODE_MAX_TOKENS (mode="auto"
# runs the decode kernels up to this many tokens), EXPERT_BANKS / PLAN struct layouts: freetoken.device.constants.
__all__ = ["DECODE_MAX_TOKENS", "DECODE_ROWS", "EXPERT_BANKS", "KERNEL_FAMILY", "PLAN", "PREFILL_ROWS", "TILE_M",
           "MoeWorkspace", "moe_experts"]

#: Routed pairs up to which the plan is one launch (``moe_plan_block``: count, scan and scatter in one block; a
#: decode step's pairs) instead of three over as many blocks as the pairs need.
PLAN_BLOCK_MAX_PAIRS = 1024


def _bank_struct(dev, layout: RecordLayout, banks: dict) -> np.void:
    rec = np.zeros((), EXPERT_BANKS)
    for m in MATRICES:
        for f in ("w", "s", "g", "b"):
            arr = banks.get(f"{m}.{f}")
            if arr is None:
                continue
            ptr = dev.pointer_of(arr, strided_rows=True)  # slot rows may be longer than the bank (kernels take strides)
            if ptr is None:
                raise TypeError(f"bank {m}.{f} is not an array on the {dev.kind} device")
            stride = int(arr.strides[0])  # bytes per slot: the record's bank, or a longer slot row
            # values: 16-byte loads in every slot; scales: as aligned as their header size, which a slot stride of
            # the bank's own size or of a multiple of 16 keeps (cuda/moe_common.cuh, GgufFmt)
            if f in ("w", "s") and ptr % 16 or f == "w" and stride % 16 or \
                    f == "s" and stride % 16 and stride != arr[0].nbytes:
                raise ValueError(f"bank {m}.{f} must be 16-byte aligned (values: in every slot) for the kernels' "
                                 "vector loads")
            rec[f"{m}_{f}"], rec[f"{m}_{f}_stride"] = ptr, stride
    return rec[()]


def _x_kind(x) -> str:
    if x.dtype == np.float32:
        return "f32"
    if x.dtype.name == "bfloat16" or x.dtype == np.uint16:
        return "bf16"
    raise TypeError(f"x must be float32 or bfloat16 (ml_dtypes.bfloat16, or uint16 holding bf16 bits), got {x.dtype}")


def moe_experts(x, ids, weights, banks: dict, layout: RecordLayout, *, act: str | None = None, mode: str = "auto",
                out=None, device=None, validate: bool = True, workspace: MoeWorkspace | None = None,
                activations: str = "auto", checked: bool = False):
    """Routed expert forward over slot-indexed record banks.

    Parameters
    ----------
    x : [T, H] float32 or bf16 (``ml_dtypes.bfloat16``, or uint16 bf16 bits where the array library has no bf16)
    ids : int32 [T, k] slot ids: indices into the leading dimension of every bank; ``NO_ROUTE`` (-1) marks a pair
        this call skips (routed to experts in another format): it adds nothing to its token's output
    weights : float32 [T, k] routing weights
    banks : record banks on the device (``layout.bank_specs()``; leading dimension = slots)
    layout : the record layout (format, H, I, biases)
    act : "swiglu" or "gpt_oss"; default: the layout's (``layout.act``)
    mode : "decode", "prefill" or "auto" (decode up to 16 tokens); gpu/emu only
    out : float32 [T, H], optional
    validate : check that every id names a slot (synchronises on gpu; off inside captured graphs)
    workspace : a :class:`MoeWorkspace` for these banks (gpu/emu): the plan and intermediate buffers are reused,
        so a call allocates nothing but ``out`` (pass ``out`` too for an allocation-free, capturable call)
    activations : the cpu device's token vectors: "q8" (reduced: for the 4-bit formats, q8_0 and the k-quants 8-bit
        blocks and int8 dot products, llama.cpp's q8_0 rounding; for bf16 and fp8_block bf16 tokens and bf16 dot
        products), "f32" (the float path) or "auto" (q8 where it is the fast path: AVX2 or AVX-512 for the
        int8 formats and bf16, AVX512-BF16 for fp8_block; :func:`freetoken.cpu_kernels.moe_experts.uses_q8`).
        The CUDA kernels read float32/bf16: "q8" is refused
        on gpu/emu, "auto" and "f32" are the same there
    checked : the caller vouches for the arguments (``device`` a Device; ``x`` float32, ``ids`` int32 and ``weights``
        float32, all C-contiguous and shaped as above; ``act`` and ``activations`` valid; ``banks`` the same
        arrays as when this dict was last used): on the cpu device the call goes straight to the kernels

    Returns
    -------
    float32 [T, H] on the device.
    """
    if checked and device.kind == "cpu" and x.shape[0] and ids.shape[1]:
        y = np.empty(x.shape, np.float32) if out is None else out
        cpu_module("moe_experts").run_prepared(_prepared_cpu_banks(banks, layout, trusted=True), x, ids, weights,
                                               activation_code(layout.act if act is None else act), y, activations)
        return y
    dev = resolve(device)
    code = activation_code(layout.act if act is None else act)
    x = as_input(dev, x, "x", None, 2)
    xk = _x_kind(x)
    ids = as_input(dev, ids, "ids", np.int32, 2)
    weights = as_input(dev, weights, "weights", np.float32, 2)
    tokens, hidden = x.shape
    k = ids.shape[1]
    if hidden != layout.hidden:
        raise ValueError(f"x has {hidden} features, the expert records expect {layout.hidden}")
    if ids.shape[0] != tokens or weights.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [{tokens}, k]")
    prepared = _prepared_cpu_banks(banks, layout) if dev.kind == "cpu" else None
    slots = prepared.num_experts if prepared is not None else layout.check(banks)
    y = prepare_out(dev, out, (tokens, hidden), np.float32)
    if tokens == 0 or k == 0:
        y[...] = 0
        return y
    if mode not in ("auto", "decode", "prefill"):
        raise ValueError(f"mode must be auto, decode or prefill, got {mode!r}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if activations == "q8" and dev.kind != "cpu":
        raise ValueError(f"activations='q8' (int8 dot products) is a cpu-device path; the {dev.kind} device reads "
                         "float activations")
    if dev.kind == "cpu":
        forward = cpu_module("moe_experts").forward

        if validate:
            bad = np.argwhere(((ids < 0) | (ids >= slots)) & (ids != NO_ROUTE))
            if bad.size:
                t, j = (int(v) for v in bad[0])
                raise ValueError(f"ids[{t}, {j}] = {int(ids[t, j])} is not a slot (there are {slots})")

        x32 = np.asarray(x.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if xk == "bf16" else x
        forward(layout.fmt.name, np.ascontiguousarray(x32), ids, weights, banks, layout.hidden, layout.inter, code, y,
                prepared=prepared, activations=activations, down_fmt_name=layout.format_of("down").name)
        return y
    if mode == "auto":
        mode = "decode" if tokens <= DECODE_MAX_TOKENS else "prefill"
    if workspace is not None and not workspace.fits(dev, banks, layout, tokens * k, slots):
        workspace = None  # a larger batch (a prompt) than the workspace was made for: plain buffers
    _run_cuda(dev, x, xk, ids, weights, banks, layout, code, mode, slots, y, validate,
              workspace or MoeWorkspace(dev, layout, banks, tokens * k))
    return y


#: Validated cpu banks by the identity of their dict: a decoder calls every layer's (constant) banks once per
#: token, and re-validating six banks costs as much as a small expert. Holding the dict keeps its id unique.
_PREPARED: dict[int, tuple[dict, RecordLayout, object]] = {}


def _prepared_cpu_banks(banks: dict, layout: RecordLayout, trusted: bool = False):
    """The banks validated for the cpu kernels, from :data:`_PREPARED` when this dict was prepared for this layout
    and still holds the same arrays (``trusted``: the caller vouches for that, so only the dict and the layout are
    compared)."""
    hit = _PREPARED.get(id(banks))
    if hit is not None and hit[0] is banks and (hit[1] is layout or hit[1] == layout) and (trusted or all(
            hit[2].banks.get(k) is v for k, v in banks.items())):
        return hit[2]
    layout.check(banks)
    p = cpu_module("moe_experts").prepare(layout.fmt.name, banks, layout.hidden, layout.inter,
                                          layout.format_of("down").name)
    if len(_PREPARED) >= 1024:
        _PREPARED.clear()
    _PREPARED[id(banks)] = (banks, layout, p)
    return p


class MoeWorkspace:
    """The routing plan's and the expert kernels' buffers for calls of up to ``max_pairs`` (token, expert) pairs
    over one set of slot banks, allocated once (the decode loop reuses them every layer and step), with the plan
    and bank structs built once. A call then launches kernels only (plus, for a plan of many pairs, one memset of the
    counters): nothing is allocated or copied from the host, as a captured CUDA graph requires."""

    def __init__(self, dev, layout: RecordLayout, banks: dict, max_pairs: int):
        xp, i32 = dev.xp, np.int32
        slots = layout.check(banks)
        self.dev, self.layout, self.banks, self.slots, self.max_pairs = dev, layout, banks, slots, int(max_pairs)
        pairs = self.max_pairs
        self.max_tiles = -(-pairs // TILE_M) + min(pairs, slots)
        self.counts, self.bad = xp.zeros(slots, i32), xp.zeros(1, i32)
        self.slot_off, self.cursor = xp.empty(slots, i32), xp.empty(slots, i32)
        self.n_unique, self.n_tiles = xp.empty(1, i32), xp.empty(1, i32)
        self.unique_slot, self.unique_off = xp.empty(pairs, i32), xp.empty(pairs + 1, i32)
        self.pair_list = xp.empty(pairs, i32)
        self.tile_unique, self.tile_start = xp.empty(self.max_tiles, i32), xp.empty(self.max_tiles, i32)
        self.h = xp.empty((pairs, layout.inter), np.float32)
        self.o = xp.empty((pairs, layout.hidden), np.float32)
        plan = np.zeros((), PLAN)
        for name in ("n_unique", "unique_slot", "unique_off", "pair_list", "n_tiles", "tile_unique", "tile_start"):
            plan[name] = dev.pointer_of(getattr(self, name))
        self.plan = plan[()]
        self.bank_struct = _bank_struct(dev, layout, banks)
        self._fresh = True  # counters are zero as allocated

    def fits(self, dev, banks: dict, layout: RecordLayout, pairs: int, slots: int) -> bool:
        return (dev is self.dev and banks is self.banks and layout == self.layout and pairs <= self.max_pairs
                and slots == self.slots)

    def reset_counters(self) -> None:
        if not self._fresh:
            self.counts.fill(0)
            self.bad.fill(0)
        self._fresh = False

    def counters_used(self) -> None:
        """The counters are written by a kernel that zeroes them first (``moe_plan_block``)."""
        self._fresh = False


def plan_pairs(dev, ids, pairs: int, slots: int, ws, one_block: bool | None = None) -> None:
    """Group the (token, k) pairs of ``ids`` (int32 slot ids, ``FT_NO_ROUTE`` skipped) by slot into the plan buffers
    of ``ws`` (a :class:`MoeWorkspace`; ``cuda/moe_plan.cu``): one launch of ``moe_plan_block`` up to
    :data:`PLAN_BLOCK_MAX_PAIRS` pairs (or as ``one_block`` says), else count, scan and scatter after one memset of
    the counters. Both give the same plan."""
    one_block = pairs <= PLAN_BLOCK_MAX_PAIRS if one_block is None else one_block
    i32 = np.int32
    np_pairs, np_slots = check_int32("pairs", pairs), check_int32("slots", slots)
    scan_threads = min(1024, 32 * -(-slots // 32))
    tail = (ws.slot_off, ws.cursor, ws.n_unique, ws.unique_slot, ws.unique_off, ws.n_tiles, ws.tile_unique,
            ws.tile_start)
    if one_block:  # it zeroes the counters itself
        ws.counters_used()
        cuda_kernel(dev, "moe_plan.cu", "moe_plan_block")(
            (1,), (scan_threads,), (ids, np_pairs, np_slots, i32(TILE_M), ws.counts, ws.bad, *tail, ws.pair_list))
        return
    ws.reset_counters()
    grid_pairs = (-(-pairs // 256),)
    cuda_kernel(dev, "moe_plan.cu", "moe_plan_count")(grid_pairs, (256,), (ids, np_pairs, np_slots, ws.counts, ws.bad))
    cuda_kernel(dev, "moe_plan.cu", "moe_plan_scan")((1,), (scan_threads,), (ws.counts, np_slots, i32(TILE_M), *tail))
    cuda_kernel(dev, "moe_plan.cu", "moe_plan_scatter")(
        grid_pairs, (256,), (ids, np_pairs, np_slots, ws.slot_off, ws.cursor, ws.pair_list))


def _run_cuda(dev, x, xk, ids, weights, banks, layout, code, mode, slots, y, validate, ws: MoeWorkspace):
    tokens, hidden = x.shape
    k = ids.shape[1]
    inter = layout.inter
    pairs = tokens * k
    max_tiles = -(-pairs // TILE_M) + min(pairs, slots)
    i32 = np.int32
    bad, h, o = ws.bad, ws.h, ws.o

    np_slots = check_int32("slots", slots)
    plan_pairs(dev, ids, pairs, slots, ws)
    if validate:
        bad_pair = int(dev.to_host(bad)[0])
        if bad_pair:
            p = bad_pair - 1
            bad_id = int(dev.to_host(ids.reshape(-1)[p:p + 1])[0])
            raise ValueError(f"ids[{p // k}, {p % k}] = {bad_id} is not a slot (there are {slots})")

    plan, bank_struct = ws.plan, ws.bank_struct
    # gate/up and down are separate launches, so a record whose down matrix has its own format (Q4_K_M) runs each
    # matrix's kernel family
    fam, down_fam = KERNEL_FAMILY[layout.fmt.name], KERNEL_FAMILY[layout.format_of("down").name]
    src = f"moe_{mode}.cu"
    # FREETOKEN_NO_MMA=1 builds the prefill kernels with their plain fallback instead of tensor cores (to tell a
    # tensor-core fault from the rest of the kernel on a GPU; the emulator always runs the fallback).
    opts = ("-DFT_NO_MMA",) if mode == "prefill" and os.environ.get("FREETOKEN_NO_MMA") == "1" else ()
    if mode == "decode":
        grid_x, rows = pairs, DECODE_ROWS
    else:
        grid_x, rows = max_tiles, PREFILL_ROWS
    h_i32, i_i32 = check_int32("hidden", hidden), check_int32("inter", inter)
    cuda_kernel(dev, src, f"moe_{mode}_gate_up_{fam}_{xk}", opts)(
        (grid_x, -(-inter // rows)), (128,), (bank_struct, x, plan, i32(k), h_i32, i_i32, i32(code), h))
    cuda_kernel(dev, src, f"moe_{mode}_down_{down_fam}", opts)(
        (grid_x, -(-hidden // rows)), (128,), (bank_struct, h, plan, h_i32, i_i32, o))
    cuda_kernel(dev, "moe_plan.cu", "moe_combine")(
        (-(-(tokens * hidden) // 256),), (256,), (o, ids, weights, i32(tokens), i32(k), h_i32, np_slots, y))
