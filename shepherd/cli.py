"""`shepherd serve | gateway | epp | simulate | calibrate | bench | ray-serve`.

Each subcommand lives beside the code it drives and exposes
`add_arguments(parser)` and `main(args) -> int`; this file only dispatches,
so importing the CLI does not import torch for commands that do not need it.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("shepherd.server.serve_cli", "serve a model over an OpenAI-compatible API"),
    "gateway": ("shepherd.gateway.gateway_cli", "route requests across replicas"),
    "epp": ("shepherd.epp.epp_cli", "pick endpoints for Envoy (ext_proc, Gateway API Inference Extension)"),
    "simulate": ("shepherd.sim.sim_cli", "simulate a serving cluster on a trace"),
    "calibrate": ("shepherd.sim.calibrate", "time the torch executor and fit a cost model"),
    "bench": ("shepherd.bench.bench_cli", "load an OpenAI endpoint and report latency/throughput"),
    "ray-serve": ("shepherd.deploy.ray_cli", "serve replicas on a Ray cluster (Ray Serve), shepherd's routing"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shepherd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(command_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(command_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command_missing", False):
        print(f"shepherd {args.command}: not available in this build", file=sys.stderr)
        return 2
    return int(importlib.import_module(args.command_module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
