"""The parity case: inputs, the NumPy reference, tolerance and bytes moved of one kernel (family).

The cases (one module per op in this package, collected in ``freetoken.testing.cases.CASES``) serve the test suite
(small, awkward shapes on cpu / emu / gpu) and ``bench/gpu_check``
(large shapes on the GPU, timed). A case runs in three steps so that timing covers the launch alone:
``setup`` copies inputs to the device and allocates POISONED outputs (NaN / INT_MIN, so unwritten elements
fail), ``launch`` calls the op, ``fetch`` copies the outputs back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from freetoken.testing.compare import assert_close, max_error, poison


@dataclass(frozen=True)
class KernelCase:
    name: str  # the kernel (or kernel family) exercised
    source: str  # its file in cuda/
    make: Callable[[np.random.Generator, str], dict]  # (rng, "small" | "large") -> host inputs
    setup: Callable[[object, dict], dict]  # (device, inputs) -> device state: inputs and poisoned outputs
    launch: Callable[[object, dict], None]  # (device, state) -> None: the op alone
    reference: Callable[[dict], dict]  # inputs -> expected outputs (host)
    atol: float = 0.0
    rtol: float = 0.0
    bytes_moved: Callable[[dict], int] = lambda inp: 0
    flops: Callable[[dict], int] = lambda inp: 0
    rel_atol: float = 0.0  # added to atol, times the largest |reference| of each output
    cuda_only: bool = False  # computes something only the CUDA kernels compute (e.g. bf16 tensor-core inputs)
    cpu_only: bool = False  # computes something only the cpu kernels compute (e.g. 8-bit activations)
    fetch_fn: Callable[[object, dict], dict] | None = None  # outputs not held in "out_*" state entries
    op: str = ""  # the op of freetoken.ops.OPS this case checks

    def check(self, got: dict, want: dict) -> float:
        """Assert every output within tolerance (NaN never passes); returns the largest error."""
        if set(got) != set(want):
            raise AssertionError(f"{self.name}: outputs {sorted(got)} != reference {sorted(want)}")
        for key in want:
            ref = np.asarray(want[key])
            scale = float(np.nanmax(np.abs(ref))) if ref.size and self.rel_atol else 0.0
            assert_close(got[key], ref, self.atol + self.rel_atol * scale, self.rtol, name=f"{self.name}:{key}")
        return max(max_error(got[k], want[k]) for k in want)

    def fetch(self, dev, state: dict) -> dict:
        if self.fetch_fn is not None:
            return self.fetch_fn(dev, state)
        return {k[4:]: dev.to_host(v) for k, v in state.items() if k.startswith("out_")}

    def run(self, dev, inputs: dict) -> dict:
        """setup + launch + fetch: the case's outputs on ``dev`` as host arrays."""
        state = self.setup(dev, inputs)
        self.launch(dev, state)
        dev.synchronize()
        return self.fetch(dev, state)


def poisoned(dev, shape, dtype):
    """A poisoned output buffer on ``dev`` (see :func:`freetoken.testing.compare.poison`)."""
    return dev.asarray(poison(shape, dtype))
