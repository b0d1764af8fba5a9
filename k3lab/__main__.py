"""Command line: ``python -m k3lab <command>``; ``python -m k3lab --help`` lists the commands."""

import argparse
import sys

from k3lab.experiments.course import CourseError, add_course_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m k3lab",
        description="k3lab: Kimi K3 rebuilt at small scale, as a notebook course.",
        epilog="run 'python -m k3lab COMMAND --help' for a command's options",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_course_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args)
    except CourseError as err:
        print(f"python -m k3lab {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
