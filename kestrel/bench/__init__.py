"""Benchmark suites: `kestrel bench <suite>`; each module also runs as `python -m kestrel.bench.<suite>`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from kestrel.config import ConfigError


def register_suite(subparsers, name: str, help_text: str,
                   add_arguments: Callable[[argparse.ArgumentParser], None],
                   run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """`kestrel bench <name>`: the suite's sub-command with its arguments and entry point."""
    p = subparsers.add_parser(name, help=help_text)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def standalone_main(suite: str, description: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                    run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """`python -m kestrel.bench.<suite>`: parse the suite's arguments and run it; a ConfigError is a message."""
    parser = argparse.ArgumentParser(prog=f"python -m kestrel.bench.{suite}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as e:
        print(f"{suite}: error: {e}", file=sys.stderr)
        return 2
