"""Captured launch sequences (freetoken/device/graphs.py): on emu a capture records the launches and a replay runs
them with one host call, reading the arrays as they are at replay time, bit-equal to running the ops eagerly."""

import numpy as np
import pytest

from freetoken import ops
from freetoken.device import get_device, launches
from freetoken.device.graphs import GraphError


def _step(dev, x, w, cos, sin, normed, roped):
    """Two kernels over fixed buffers: an RMSNorm of x, then RoPE of the normed rows."""
    ops.rms_norm(x, w, 1e-6, out=normed, device=dev)
    ops.rope(normed.reshape(x.shape[0], 4, 16), cos, sin, out=roped, device=dev)


def test_replay_runs_the_captured_launches_on_the_arrays_as_they_are_then(cuda_device):
    """emu, and gpu where one is present (a CUDA graph from stream capture)."""
    dev, xp = cuda_device, cuda_device.xp
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 64), np.float32), rng.standard_normal(64, np.float32)
    cos, sin = rng.standard_normal((6, 16), np.float32), rng.standard_normal((6, 16), np.float32)
    x, w, cos, sin = (dev.asarray(a) for a in (x, w, cos, sin))
    normed, roped = xp.zeros((6, 64), np.float32), xp.zeros((6, 4, 16), np.float32)
    before = launches.snapshot()
    graph = dev.capture(lambda: _step(dev, x, w, cos, sin, normed, roped))
    dev.synchronize()
    assert launches.snapshot() == before and not dev.to_host(roped).any()  # recorded, not run
    assert graph.kernels and all(isinstance(k, str) for k in graph.kernels)
    for seed in (1, 2):  # new inputs written in place, then one replay
        r = np.random.default_rng(seed)
        x[...] = dev.asarray(r.standard_normal(x.shape, np.float32))
        cos[...] = dev.asarray(r.standard_normal(cos.shape, np.float32))
        sin[...] = dev.asarray(r.standard_normal(sin.shape, np.float32))
        before = launches.snapshot()
        graph.replay()
        dev.synchronize()
        assert launches.snapshot() - before == {"graph_replay": 1}  # one host call for the whole sequence
        want_n, want_r = xp.zeros_like(normed), xp.zeros_like(roped)
        _step(dev, x.copy(), w, cos.copy(), sin.copy(), want_n, want_r)
        np.testing.assert_array_equal(dev.to_host(normed), dev.to_host(want_n))
        np.testing.assert_array_equal(dev.to_host(roped), dev.to_host(want_r))


def test_capture_misuse_is_refused():
    dev = get_device("emu")
    with pytest.raises(GraphError, match="do not nest"):
        dev.capture(lambda: dev.capture(lambda: None))
    with pytest.raises(NotImplementedError, match="cpu device"):
        get_device("cpu").capture(lambda: None)
    dev.capture(lambda: None).replay()  # an empty graph replays to nothing
