import pytest

from freetoken.device import device_status

_STATUS = device_status()


def _device_param(kind: str):
    ok, why = _STATUS[kind]
    marks = [pytest.mark.skipif(not ok, reason=f"{kind} device unavailable: {why}")]
    if kind == "gpu":
        marks.append(pytest.mark.gpu)
    return pytest.param(kind, marks=marks, id=kind)


ALL_DEVICES = [_device_param(k) for k in ("cpu", "emu", "gpu")]
CUDA_DEVICES = [_device_param(k) for k in ("emu", "gpu")]


@pytest.fixture(params=ALL_DEVICES)
def device(request):
    from freetoken.device import get_device

    return get_device(request.param)


@pytest.fixture(params=CUDA_DEVICES)
def cuda_device(request):
    from freetoken.device import get_device

    return get_device(request.param)
