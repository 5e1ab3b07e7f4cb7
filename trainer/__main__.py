"""`python -m malleus.trainer JOB.yaml [--plan PLAN.json] ...`: one rank, under torchrun."""

import sys

from .cli import worker_main

if __name__ == "__main__":
    sys.exit(worker_main())
