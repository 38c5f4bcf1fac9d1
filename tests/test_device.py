"""The device interface: selection, memory, pinned host memory, streams/events, DLPack."""

import numpy as np
import pytest

from freetoken import ops
from freetoken.device import DeviceUnavailable, device_status, get_device
from freetoken.testing.oracles import need


def test_auto_picks_gpu_only_when_present():
    dev = get_device("auto")
    assert dev.kind == ("gpu" if device_status()["gpu"][0] else "cpu")


def test_unknown_device_name():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_device("tpu")


@pytest.mark.skipif(device_status()["gpu"][0], reason="a GPU is present")
def test_gpu_unavailable_says_why():
    with pytest.raises(DeviceUnavailable, match="gpu device is unavailable"):
        get_device("gpu")


def test_devices_are_singletons(device):
    assert get_device(device.kind) is device
    assert get_device(device) is device


def test_round_trip(device):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = device.asarray(x)
    assert isinstance(d, device.xp.ndarray)
    np.testing.assert_array_equal(device.to_host(d), x)
    z = device.zeros((2, 3), np.int32)
    assert device.to_host(z).sum() == 0 and z.dtype == np.int32


def test_pinned_memory_is_readable_by_kernels(device):
    pinned = device.pinned_empty((5, 40), np.float32)
    assert pinned.shape == (5, 40) and pinned.dtype == np.float32 and pinned.nbytes == 800
    assert pinned.device_ptr != 0
    pinned.host[...] = np.arange(200, dtype=np.float32).reshape(5, 40)
    if device.kind == "cpu":
        return  # the cpu device reads host memory directly; nothing is launched
    out = device.asarray(np.full(5, np.nan, np.float32))
    device.load_cuda("reduce.cu").get_function("reduce_rows_f32")(
        (5,), (64,), (pinned, out, np.int32(5), np.int32(40))
    )
    device.synchronize()
    np.testing.assert_allclose(device.to_host(out), pinned.host.sum(1))


def test_streams_and_events(device):
    s = device.stream()
    a, b = device.event(), device.event()
    a.record(s)
    x = device.asarray(np.ones((64, 64), np.float32))
    ops.row_sum(x, device=device)
    b.record(s)
    s.wait_event(b)
    s.synchronize()
    assert b.query()
    assert a.elapsed_ms(b) >= 0.0


def test_host_event_needs_both_recorded():
    from freetoken.device import HostEvent

    with pytest.raises(RuntimeError, match="both events"):
        HostEvent().elapsed_ms(HostEvent().record())


def test_cpu_has_no_cuda_modules():
    with pytest.raises(NotImplementedError, match="cpu device does not run CUDA modules"):
        get_device("cpu").load_cuda("reduce.cu")


def test_dlpack_numpy_consumer(device):
    """An object that only speaks DLPack (not an ndarray) is accepted by the public ops."""

    class Wrapped:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    x = np.random.default_rng(0).standard_normal((4, 9)).astype(np.float32)
    got = ops.row_sum(Wrapped(device.asarray(x)), device=device)
    np.testing.assert_allclose(device.to_host(got), x.sum(1), rtol=1e-5)


def test_dlpack_torch_tensors(device):
    torch = need("torch")
    x = torch.randn(6, 33, dtype=torch.float32)
    if device.kind == "gpu":
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA")
        x = x.cuda()
    idx, val = ops.topk(x, 3, device=device)
    want = torch.topk(x.cpu(), 3, dim=1)
    np.testing.assert_array_equal(device.to_host(idx), want.indices.numpy())
    np.testing.assert_allclose(device.to_host(val), want.values.numpy())


def test_non_array_argument_is_refused(device):
    with pytest.raises(TypeError):
        ops.row_sum([[1.0, 2.0]], device=device)
