"""Test oracles (torch, transformers, llama-cpp-python, sentencepiece, ...): present, or a visible outcome.

``need("torch")`` returns the imported module (``need_program("/usr/bin/chromium")``: the program's path).
Where it cannot be imported (or is not installed), a local run skips the test with the reason, while a CI run
(``CI`` set to anything but ``""``/``0``/``false``) FAILS it: a broken install must not turn the parity tests into
a green run of skips. At module level it skips or fails the whole module, so call it there
only for modules whose every test needs the oracle.
"""

from __future__ import annotations

import contextlib
import importlib
import os


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def need(module: str, why: str = ""):
    """The imported ``module``; skip (locally) or fail (in CI) the calling test or module when it is missing."""
    __tracebackhide__ = True  # the skip or failure is reported at the caller's line (the test module), not here
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install raising anything else on import
        _missing(f"test oracle {module!r} is not importable ({type(e).__name__}: {e})" + (f"; {why}" if why else ""))


def need_program(path: str, why: str = "") -> str:
    """``path``, an executable (a browser, its driver); skip (locally) or fail (in CI) as :func:`need` does when it
    is not there."""
    __tracebackhide__ = True
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        _missing(f"test oracle {path} is not an installed program" + (f"; {why}" if why else ""))
    return path


def need_file(path, why: str = ""):
    """``path``, a file that setup puts in place (a vendored script); skip (locally) or fail (in CI) as
    :func:`need` does when it is not there."""
    __tracebackhide__ = True
    if not os.path.isfile(path):
        _missing(f"test oracle {path} is not there" + (f"; {why}" if why else ""))
    return path


def _missing(reason: str):
    import pytest

    __tracebackhide__ = True
    if in_ci():
        pytest.fail(f"{reason}; CI needs every oracle (bash scripts/setup --test-oracles --llama-cpp)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@contextlib.contextmanager
def llama_cpp_without_repacking():
    """Inside: ``llama_cpp.Llama`` loads models with llama.cpp's weight repacking off (the CPU backend's extra buffer
    types). llama-cpp-python 0.3.36 on AVX-512 machines aborts in its scheduler (``GGML_ASSERT(*cur_backend_id !=
    -1)``) on the deepseek2 graph with repacked Q4_0 experts and crashes (SIGSEGV) on Q4_K_M files with repacked
    k-quants; the values it computes do not depend on the layout it keeps the weights in."""
    import llama_cpp

    lib = llama_cpp.llama_cpp
    defaults = lib.llama_model_default_params

    def no_repack():
        params = defaults()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = no_repack
    try:
        yield
    finally:
        lib.llama_model_default_params = defaults
