"""The ``freetoken`` command line."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
freetoken runs huge Mixture-of-Experts language models on one consumer NVIDIA GPU plus host memory:
the routed experts live in host memory, the GPU caches the hot ones.

Commands:
  info    what this machine offers: devices, GPU and PCIe link, CPU SIMD, library versions, cache dir
  trace   routing traces: synthesise, summarise, and replay them through expert-cache policies
"""


def _cmd_info(args: argparse.Namespace) -> int:
    from freetoken.info import collect, format_report

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from freetoken import __version__

    parser = argparse.ArgumentParser(prog="freetoken", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="show devices, versions, GPU/CPU details and the cache directory",
                          description="Show what this machine offers freetoken.")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)
    from freetoken.trace.cli import add_trace_parser

    add_trace_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
