"""The routing plan of the expert kernels (cuda/moe_plan.cu) two ways on the emulator: one block
(``moe_plan_block``, a decode step's few pairs) and count / scan / scatter over many blocks: the same plan, and the
plan a NumPy counting sort gives (pairs grouped by slot in increasing slot order, prefill tiles of TILE_M pairs)."""

from types import SimpleNamespace

import numpy as np
import pytest

from freetoken.device import device_status, get_device
from freetoken.device.constants import NO_ROUTE, TILE_M
from freetoken.ops.moe_experts import plan_pairs


def _buffers(dev, pairs: int, slots: int):
    i32 = np.int32
    tiles = -(-pairs // TILE_M) + min(pairs, slots)
    ws = SimpleNamespace(counts=np.full(slots, 7, i32), bad=np.full(1, 7, i32), slot_off=np.empty(slots, i32),
                         cursor=np.empty(slots, i32), n_unique=np.empty(1, i32), n_tiles=np.empty(1, i32),
                         unique_slot=np.full(pairs, -9, i32), unique_off=np.full(pairs + 1, -9, i32),
                         pair_list=np.full(pairs, -9, i32), tile_unique=np.full(tiles, -9, i32),
                         tile_start=np.full(tiles, -9, i32))

    def reset_counters():  # the many-block path's memset (the one-block kernel zeroes them itself)
        ws.counts.fill(0)
        ws.bad.fill(0)

    ws.reset_counters, ws.counters_used = reset_counters, lambda: None
    return ws


def _plan(ws) -> dict:
    n, t = int(ws.n_unique[0]), int(ws.n_tiles[0])
    off = ws.unique_off[:n + 1]
    groups = [sorted(ws.pair_list[off[u]:off[u + 1]].tolist()) for u in range(n)]
    return dict(slots=ws.unique_slot[:n].tolist(), off=off.tolist(), groups=groups, bad=int(ws.bad[0]),
                tiles=list(zip(ws.tile_unique[:t].tolist(), ws.tile_start[:t].tolist(), strict=True)))


def _expected(ids: np.ndarray, slots: int) -> dict:
    valid = [(p, s) for p, s in enumerate(ids.tolist()) if 0 <= s < slots]
    used = sorted({s for _, s in valid})
    groups = [[p for p, s in valid if s == u] for u in used]
    off = np.concatenate([[0], np.cumsum([len(g) for g in groups])]).astype(int).tolist()
    tiles = [(u, start) for u, g in enumerate(groups) for start in range(0, len(g), TILE_M)]
    bad = [p for p, s in enumerate(ids.tolist()) if not 0 <= s < slots and s != NO_ROUTE]
    return dict(slots=used, off=off, groups=groups, bad=max(bad) + 1 if bad else 0, tiles=tiles)


@pytest.mark.parametrize(("pairs", "slots"), [(1, 6), (16, 6), (128, 300), (700, 2500), (1500, 40)])
def test_one_block_and_many_blocks_give_the_plan(pairs, slots):
    ok, why = device_status()["emu"]
    if not ok:
        pytest.fail(f"the emu device is needed: {why}")
    dev = get_device("emu")
    rng = np.random.default_rng(pairs * 31 + slots)
    # skewed ids (a few popular slots, so some hold more than a tile), some pairs routed elsewhere
    ids = np.minimum(rng.geometric(3.0 / slots, pairs) - 1, slots - 1).astype(np.int32)
    ids[rng.random(pairs) < 0.1] = NO_ROUTE
    want = _expected(ids, slots)
    for one_block in (True, False):
        ws = _buffers(dev, pairs, slots)
        plan_pairs(dev, ids, pairs, slots, ws, one_block=one_block)
        assert _plan(ws) == want, one_block


def test_an_id_out_of_range_is_reported_by_both():
    dev = get_device("emu")
    ids = np.array([0, 3, 9, 1, -5, NO_ROUTE], np.int32)
    for one_block in (True, False):
        ws = _buffers(dev, len(ids), 4)
        plan_pairs(dev, ids, len(ids), 4, ws, one_block=one_block)
        assert int(ws.bad[0]) == 5  # 1 + the last offending pair (-5 at 4); NO_ROUTE is not an error
