import pytest

from freetoken.device import device_status
from freetoken.testing.oracles import in_ci, need

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


# ---- tests that cannot silently vanish ---------------------------------------------------------------------------
#
# 1. In CI a missing test oracle fails: freetoken.testing.oracles.need() does that; pytest.importorskip (where a
#    module still calls it) is routed through need() in CI so that it cannot turn into a quiet skip either.
# 2. Every skip prints its reason: addopts has -ra ([tool.pytest.ini_options] in pyproject.toml).
# 3. A tests/test_*.py module that collects no test at all is a collection error. A module-level skip (need() at
#    module level, a missing device) is a skipped collection: it is listed with its reason by -ra, not an error.

_importorskip = pytest.importorskip


def _importorskip_or_fail(modname, minversion=None, reason=None, **kw):
    __tracebackhide__ = True
    if in_ci() and minversion is None:
        return need(modname, reason or "")
    return _importorskip(modname, minversion, reason, **kw)


def pytest_configure(config):
    if in_ci():
        pytest.importorskip = _importorskip_or_fail


def pytest_unconfigure(config):
    pytest.importorskip = _importorskip


def _is_test_module(collector) -> bool:
    return isinstance(collector, pytest.Module) and collector.path.name.startswith("test_")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.passed and _is_test_module(collector) and not _collects_a_test(report.result):
        report.outcome = "failed"
        report.longrepr = (f"{collector.path.name} collected no tests: a test module must define at least one test, "
                           "or skip visibly at module level with a reason")
    return report


def _collects_a_test(nodes) -> bool:
    """Whether any of ``nodes`` is a test item or a class that collects one (classes are collected lazily, so
    look at their test-looking attributes instead of collecting them twice)."""
    for node in nodes:
        if isinstance(node, pytest.Item):
            return True
        if isinstance(node, pytest.Class) and any(name.startswith("test") and callable(getattr(node.obj, name))
                                                  for name in dir(node.obj)):
            return True
    return False
