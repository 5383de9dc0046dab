"""``cann-attn``: the command-line entry point (argparse subcommands).

    cann-attn verify [--op OP] [--quick] [--device DEV] [--seed N]   operators vs float64 oracle (alias: demo)
    cann-attn golden [--op OP] --case CASE.json --out DIR [--inputs PATH...] [--actual DIR]   golden data files
    cann-attn compare ACTUAL GOLDEN [--dtype DT] [--strict]   docs/semantics/precision.md metrics, exit 1 on failure
    cann-attn bench [--suite fa_forward|all] [--device cpu|cuda] [--quick]   benchmarks/ vs PyTorch

Bad usage prints one line (``cann-attn: error: ...``) to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import UsageError, bench, compare, golden, verify

PROG = "cann-attn"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (no usage dump) and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Ascend CANN fused-attention operators off the NPU: verification, golden data, precision "
        "comparison and benchmarks.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    verify.add_parser(sub)
    golden.add_parser(sub)
    compare.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError("a command is required (verify or demo, golden, compare, bench); see cann-attn --help")
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
