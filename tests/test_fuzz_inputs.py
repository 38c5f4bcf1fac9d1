"""Mutated safetensors, GGUF, config.json, trace and FTW files: every outcome is a load or a clear error (issue 20).

Hypothesis picks input numbers; :class:`freetoken.testing.fuzz.Mutator` turns each into a mutated file (a header
field, a length, an offset, a dtype, a shape, a JSON value, a trace array...) and a fork server loads it as a user
would (``freetoken.load(path, device="cpu")`` of the tiny model, or ``load_trace``) in a child limited to 10 s and
4 GB of address space. Allowed outcomes: loaded, or a LoadError / ConfigError / TraceError whose message names the
file. About a minute in all; ``bench/fuzz_loaders.py`` runs the same mutators for thousands of inputs (a failing
input ``n`` reproduces with ``--kinds KIND --n 1 --start n``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freetoken.testing import fuzz

EXAMPLES = 80  # per kind: about half a minute for the four kinds on a CI runner, fork server start-up included


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-seeds")
    seeds = fuzz.make_seeds(root)
    server = fuzz.ForkServer(root)
    try:
        yield fuzz.Mutator(seeds), server, tmp_path_factory.mktemp("fuzz-inputs")
    finally:
        server.close()


def check(harness, kind: str, n: int) -> None:
    mutator, server, work = harness
    path = mutator.make(kind, n, 0, work / kind)
    outcome, detail, seconds = server.run(kind, path, timeout=10.0, mem_bytes=4 << 30)
    assert outcome in ("ok", "clear"), (f"{kind} input n={n} ({outcome} after {seconds:.1f} s): {detail}; "
                                        f"reproduce: python bench/fuzz_loaders.py --kinds {kind} --n 1 --start {n}")


def _settings():
    # derandomized: the same inputs on every machine and run (bench/fuzz_loaders.py explores new ones)
    return settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("kind", fuzz.KINDS)
def test_seed_loads(harness, kind):
    """The unmutated seeds load (so mutations start from a valid file)."""
    mutator, server, _ = harness
    path = {"safetensors": mutator.seeds.hf_dir, "config": mutator.seeds.hf_dir, "gguf": mutator.seeds.gguf,
            "trace": mutator.seeds.trace, "ftw": mutator.seeds.ftw}[kind]
    assert server.run(kind, path)[0] == "ok"


@_settings()
@given(n=st.integers(0, 2**31 - 1))
def test_fuzz_safetensors(harness, n):
    check(harness, "safetensors", n)


@_settings()
@given(n=st.integers(0, 2**31 - 1))
def test_fuzz_gguf(harness, n):
    check(harness, "gguf", n)


@_settings()
@given(n=st.integers(0, 2**31 - 1))
def test_fuzz_config(harness, n):
    check(harness, "config", n)


@_settings()
@given(n=st.integers(0, 2**31 - 1))
def test_fuzz_trace(harness, n):
    check(harness, "trace", n)


@_settings()
@given(n=st.integers(0, 2**31 - 1))
def test_fuzz_ftw(harness, n):
    check(harness, "ftw", n)
