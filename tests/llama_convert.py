"""llama.cpp's own HF -> GGUF converter, as users run it, for the tests that load its files.

The converter (``convert_hf_to_gguf.py``, its ``conversion`` package and the ``gguf-py`` it is written against) is
vendored in llama-cpp-python's source distribution; ``bash scripts/setup --llama-cpp`` unpacks the one matching the
installed llama-cpp-python into :data:`CONVERTER_DIR`.

Run as a script (``python tests/llama_convert.py MODEL_DIR --outfile F --outtype f32``) it is the converter with
one change: a tokenizer whose pre-tokenizer hash the converter does not know (the bundled model's byte-level BPE
with GPT-2's split pattern, which the test checkpoints borrow) is written as ``gpt-2`` instead of refused. Every
other step is the converter's own. It runs in a subprocess so that its ``gguf`` (the vendored one) does not meet
the installed gguf-py in one interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CONVERTER_DIR = Path(__file__).resolve().parents[1] / ".venv" / "llama.cpp-convert"


def converter_dir() -> Path:
    """:data:`CONVERTER_DIR` when setup unpacked the converter there; skip (locally) or fail (in CI) otherwise."""
    from freetoken.testing.oracles import need_file

    __tracebackhide__ = True
    need_file(CONVERTER_DIR / "convert_hf_to_gguf.py", "bash scripts/setup --llama-cpp unpacks llama.cpp's converter")
    return CONVERTER_DIR


def convert(model_dir: Path, out: Path, outtype: str = "f32", args: tuple[str, ...] = ()) -> Path:
    """``model_dir`` converted by llama.cpp's converter to ``out`` (``args``: more of its options); a failure raises
    with the converter's output."""
    root = converter_dir()
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter puts its own gguf-py first unless this is set
    r = subprocess.run([sys.executable, __file__, str(root), str(model_dir), "--outfile", str(out),
                        "--outtype", outtype, *args], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return out


def _main() -> None:
    root = Path(sys.argv[1])
    sys.path[:0] = [str(root), str(root / "gguf-py")]  # the vendored gguf before the installed one
    from conversion import base

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"  # an unlisted hash: the test tokenizers split as GPT-2 does

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    import runpy

    sys.argv = [str(root / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    _main()
