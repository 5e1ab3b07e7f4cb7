"""The `malleus` command: `plan` needs no torch; `train` and `run` import the trainer lazily."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="malleus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a layout for a PlanningProblem JSON")
    p.add_argument("problem", help="PlanningProblem JSON file (DESIGN §4.1)")
    p.add_argument("-o", "--output", help="write the Plan JSON here")
    p.set_defaults(func=_cmd_plan)

    t = sub.add_parser("train", help="train a MalleusJob locally under a plan")
    try:
        from malleus.trainer import cli as trainer_cli  # torch is imported only when run
    except ImportError:  # the operator image has no trainer
        trainer_cli = None
    if trainer_cli is not None:
        trainer_cli.add_arguments(t)
        t.set_defaults(func=trainer_cli.main)

    from malleus.runner import cli as runner_cli  # torch-free: the trainers are subprocesses

    r = sub.add_parser(
        "run", help="run a MalleusJob on this machine, re-planning around stragglers"
    )
    runner_cli.add_arguments(r)
    r.set_defaults(func=runner_cli.main)
    return parser


def _cmd_plan(args: argparse.Namespace) -> int:
    from malleus.planner.cli import plan_main

    return plan_main(args)


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
