"""The command line's parser class and value types, and the flags shared by the commands that run a model (``run``,
``chat``): model, device, sampling, cache slots, context and KV cache.

Bad input is one clear line on stderr and exit code 2 (:class:`Parser` for the flags, ``freetoken.cli.main`` for
what the loaders and the model refuse); ``--debug`` shows the traceback instead."""

from __future__ import annotations

import argparse
import math

from freetoken.device.simd import ACTIVATIONS
from freetoken.models.kv import KV_KINDS


class UsageError(Exception):
    """A flag or argument the parser refused; ``prog`` is the command it belongs to."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a :class:`UsageError` (one line, exit code 2 in ``main``) instead of the
    usage text and ``SystemExit``; subcommand parsers are of this class too."""

    def error(self, message: str):
        raise UsageError(self.prog, f"{message} (see {self.prog} --help)")


def check_text(text: str, what: str) -> str:
    """``text`` from the command line or stdin, refused when it is not valid UTF-8 (Python keeps undecodable
    bytes as lone surrogates; the tokenizer and the terminal would fail on them later)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 (byte {e.start} onward)") from None
    return text


def check_writable(path: str, flag: str) -> None:
    """The directory of ``path`` exists and is writable (checked before long work that ends by writing it)."""
    import os
    from pathlib import Path

    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: the directory {parent} is not writable")
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: is a directory")


def future_value(text: str) -> float | str:
    """An argparse type: ``auto``, ``global`` (the estimators measured while running) or seconds >= 0."""
    return text if text in ("auto", "global") else real()(text)


def count(minimum: int = 0):
    """An argparse type: a whole number >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return v
    parse.__name__ = "count"
    return parse


def real(minimum: float = 0.0, maximum: float = math.inf, above: bool = False):
    """An argparse type: a finite number in [``minimum``, ``maximum``] (``above``: strictly above ``minimum``)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = v > minimum if above else v >= minimum
        if not (math.isfinite(v) and low_ok and v <= maximum):
            bound = f"{'>' if above else '>='} {minimum:g}" + (f" and <= {maximum:g}" if maximum < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return v
    parse.__name__ = "number"
    return parse


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def size(text: str) -> int:
    """An argparse type: a memory size in bytes, such as ``2GiB``, ``512MiB``, ``1.5G`` (powers of 1000 without
    the ``i``) or a plain byte count."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in _SIZE_UNITS or not (math.isfinite(value) and value > 0) or value * _SIZE_UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MiB or 1.5G, got {text!r}")
    return int(value * _SIZE_UNITS[unit])


size.__name__ = "size"


def add_context_args(p: argparse.ArgumentParser) -> None:
    """--ctx, --kv-dtype, --kv-memory, --prefill-chunk (the context and its paged KV cache), --verbose."""
    g = p.add_argument_group("context and KV cache")
    g.add_argument("--ctx", type=count(1), default=None, metavar="N",
                   help="the longest sequence, prompt and generated tokens together (default: the model's "
                        "max_position_embeddings, capped by what the KV memory holds)")
    g.add_argument("--kv-dtype", default="bf16", choices=list(KV_KINDS),
                   help="how keys and values are stored: bf16 (default), f16, f32, or fp8 (e4m3 with a float32 scale "
                        "per token and kv head: half of bf16's memory)")
    g.add_argument("--kv-memory", type=size, default=None, metavar="SIZE",
                   help="bytes of the KV pool, e.g. 2GiB (default: on gpu what is left after the weights and expert "
                        "slots less a 1 GiB margin; on cpu/emu what the context needs, at most half of the available "
                        "host memory)")
    g.add_argument("--prefill-chunk", type=count(1), default=None, metavar="N",
                   help="prompt tokens per forward pass, which bounds the activations of a long prompt (default: the "
                        "largest power of two from 512 to 2048 whose activations fit in 256 MiB)")
    g.add_argument("--verbose", action="store_true", help="a breakdown of the memory report")


def context_kwargs(args: argparse.Namespace) -> dict:
    """The :func:`freetoken.load` keywords of :func:`add_context_args`' flags."""
    return dict(ctx=args.ctx, kv_dtype=args.kv_dtype, kv_memory=args.kv_memory, prefill_chunk=args.prefill_chunk,
                allow_widen=getattr(args, "allow_widen", False), verify=getattr(args, "verify", "full"),
                host_memory=getattr(args, "host_memory", None))


def read_prompt_file(path: str) -> str:
    """The text of ``--prompt-file PATH``; a missing, unreadable or undecodable file is a ValueError naming it."""
    from pathlib import Path

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"--prompt-file {path}: {'is a directory' if p.is_dir() else 'no such file'}")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ValueError(f"--prompt-file {path}: cannot read it ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path} is not valid UTF-8 (byte {e.start})") from None


def add_model_args(p: argparse.ArgumentParser, max_tokens: int, what: str) -> None:
    """--model, --device, --max-tokens (default ``max_tokens``; ``what`` says per what), sampling, --cache-slots,
    --cpu-activations, and the context flags (:func:`add_context_args`)."""
    p.add_argument("--model", default=None,
                   help="HF model directory, GGUF file or FTW file of a Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5, "
                        "gpt-oss, DeepSeek-V2/V3 (Kimi-K2), Qwen3-Next or Qwen3.5/3.6-MoE model (default: the "
                        "bundled model)")
    p.add_argument("--device", default="auto", choices=["auto", "gpu", "cpu", "emu"],
                   help="where to run (auto: gpu when present, else cpu)")
    p.add_argument("--max-tokens", type=count(1), default=max_tokens, metavar="N",
                   help=f"tokens {what} at most (default {max_tokens})")
    p.add_argument("--temperature", type=real(), default=0.7, help="0 is greedy (default 0.7)")
    p.add_argument("--top-k", type=count(0), default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=real(0.0, 1.0, above=True), default=1.0,
                   help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--repetition-penalty", type=real(0.0, above=True), default=1.0,
                   help="penalise repeats (default 1.0: off)")
    p.add_argument("--seed", type=count(0), default=None, help="random seed for reproducible sampling")
    p.add_argument("--cache-slots", type=count(1), default=None, metavar="N",
                   help="gpu/emu: device slots of the expert cache (default: room for every expert)")
    p.add_argument("--cpu-activations", default="auto", choices=list(ACTIVATIONS),
                   help="experts computed on the CPU: q8 reduces their inputs, to 8-bit blocks with int8 dot "
                        "products for the 4-bit, q8_0 and k-quant formats (llama.cpp's rounding), to bf16 with bf16 "
                        "dot products for bf16 and fp8_block; f32 keeps float32 (exact, slower); auto (default): q8 "
                        "where it is the fast path (int8 formats and bf16: AVX2 or AVX-512; fp8_block: "
                        "AVX512-BF16)")
    p.add_argument("--host-memory", type=size, default=None, metavar="SIZE",
                   help="host memory for the routed experts, e.g. 8GB or 512MiB (default: all of them). Below what "
                        "they take, an FTW file's expert records are read from disk as steps need them into a host "
                        "tier of SIZE (least recently used records make room; at least two MoE layers' records); "
                        "other model files are refused: freetoken convert them to FTW first")
    p.add_argument("--verify", default="full", choices=["full", "sample", "none"],
                   help="an FTW file's checksums, checked as its data is read: every tensor and expert record "
                        "(full, the default), every tensor and one record in 16 (sample), or none")
    p.add_argument("--allow-widen", action="store_true",
                   help="load a GGUF file whose non-expert matrices are in a block type freetoken does not keep "
                        "(Q5_0, Q3_K, IQ2_XXS, ...) by widening them to float32 (default: refuse, naming the tensor)")
    add_context_args(p)
