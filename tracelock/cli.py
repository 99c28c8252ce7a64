"""The ``tracelock`` command line: one subcommand per job."""

import argparse
import sys


def _env(args):
    from tracelock.env import main as env_main

    return env_main([])


def build_parser():
    parser = argparse.ArgumentParser(prog="tracelock", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("env", help="print torch, triton, interpreter mode, tracelock._C and GPU status")
    p.set_defaults(func=_env)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
