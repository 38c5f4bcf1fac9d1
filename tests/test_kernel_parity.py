"""Every kernel against its NumPy reference on every device present, with awkward shapes."""

import numpy as np
import pytest

from freetoken import ops
from freetoken.ops.cases import CASES, topk_reference
from freetoken.testing import assert_close


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_case_matches_reference(case, device):
    if case.cuda_only and device.kind == "cpu":
        pytest.skip(f"{case.name} checks what only the CUDA kernels compute")
    rng = np.random.default_rng(1234)
    inputs = case.make(rng, "small")
    case.check(case.run(device, inputs), case.reference(inputs))


@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 33), (5, 31), (3, 2049)])
def test_row_sum_shapes(device, rows, cols):
    x = np.random.default_rng(rows * 100 + cols).standard_normal((rows, cols)).astype(np.float32)
    got = device.to_host(ops.row_sum(device.asarray(x), device=device))
    assert_close(got, x.astype(np.float64).sum(1), atol=1e-4, rtol=1e-5)


def test_row_sum_nan_propagates(device):
    x = np.ones((3, 40), np.float32)
    x[1, 7] = np.nan
    got = device.to_host(ops.row_sum(device.asarray(x), device=device))
    assert np.isnan(got[1]) and np.all(got[[0, 2]] == 40)


@pytest.mark.parametrize("rows,n,k", [(1, 1, 1), (3, 7, 7), (5, 33, 1), (6, 64, 32), (2, 300, 8)])
def test_topk_shapes(device, rows, n, k):
    x = np.random.default_rng(n).standard_normal((rows, n)).astype(np.float32)
    idx, val = ops.topk(device.asarray(x), k, device=device)
    want_idx, want_val = topk_reference(x, k)
    np.testing.assert_array_equal(device.to_host(idx), want_idx)
    np.testing.assert_array_equal(device.to_host(val), want_val)


def test_topk_rejects_bad_k(device):
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="k=5"):
        ops.topk(x, 5, device=device)


@pytest.mark.parametrize("dtype", [np.uint8, np.float16, np.float32, np.int64])
@pytest.mark.parametrize("rows,cols", [(1, 1), (33, 1), (31, 65)])
def test_transpose_dtypes(device, dtype, rows, cols):
    x = (np.arange(rows * cols) % 251).astype(dtype).reshape(rows, cols)
    got = device.to_host(ops.transpose(device.asarray(x), device=device))
    np.testing.assert_array_equal(got, x.T)


def test_histogram_empty_and_out_of_range(device):
    got = device.to_host(ops.histogram(device.asarray(np.array([], np.int32)), 4, device=device))
    np.testing.assert_array_equal(got, np.zeros(4, np.int32))
    got = device.to_host(ops.histogram(device.asarray(np.array([-1, 4, 0, 3, 3], np.int32)), 4, device=device))
    np.testing.assert_array_equal(got, [1, 0, 0, 2])


def test_out_shape_is_checked(device):
    with pytest.raises(ValueError, match="out must be float32 of shape"):
        ops.row_sum(np.zeros((3, 4), np.float32), out=device.asarray(np.zeros(4, np.float32)), device=device)


def test_wrong_dtype_is_refused(device):
    with pytest.raises(TypeError, match="x must be float32"):
        ops.row_sum(np.zeros((3, 4), np.float64), device=device)
