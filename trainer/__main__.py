"""`python -m malleus.trainer JOB.yaml [--plan PLAN.json] ...`: one rank, under torchrun.

`python -m malleus.trainer store [--host H] [--port P]`: the job's rendezvous store, hosted by
no rank (trainer/launch/rendezvous.py).
"""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["store"]:
        from malleus.trainer.launch.rendezvous import main as store_main

        sys.exit(store_main(sys.argv[2:]))
    from malleus.trainer.cli import worker_main

    sys.exit(worker_main())
