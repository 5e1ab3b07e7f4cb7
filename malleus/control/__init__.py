"""The trainers' control API, torch-free: what rank 0's endpoint serves and takes.

Rooms:
- `status`: the typed ``GET /status`` body (`ControlStatus`) and the records it carries
  (`MigrationRecord`, `PlanFailure`, `RecoveryRecord`);
- `client`: the one client of the endpoint, blocking (`ControlClient`) and asyncio
  (`AsyncControlClient`), whom it trusts over HTTPS (`ControlTLS`), and what its calls raise:
  `ControlError` (nothing answered, or an answer outside the contract), `PlanConflict` (409: a
  plan's generation is not the next one) or `malleus.errors.BadInput` (400);
- `sealed`: the seal of the job's rendezvous store values (an HMAC with a key derived from the
  job's token: `store_key`, `seal`, `open_sealed`), which the trainers and the runner share;
- `capped`: reading an HTTP answer under a byte cap (`MAX_RESPONSE_BYTES`) and one deadline for
  the whole request, which the clients here and the controller's Prometheus source share.

The trainer serves these models (``trainer/endpoint/``); the controller, the local runner and
the operator read and write the endpoint only through these clients.

Imports: control -> planner (the plan contract, the calibration), errors; nothing here imports
the job, the controller, the runner, the operator or the trainer.
"""

from .capped import MAX_RESPONSE_BYTES
from .client import (
    JOB_METRICS_PATH,
    AsyncControlClient,
    ControlClient,
    ControlError,
    ControlTLS,
    PlanConflict,
)
from .status import ControlStatus, MigrationRecord, PlanFailure, RecoveryRecord

__all__ = [
    "JOB_METRICS_PATH",
    "MAX_RESPONSE_BYTES",
    "AsyncControlClient",
    "ControlClient",
    "ControlError",
    "ControlStatus",
    "ControlTLS",
    "MigrationRecord",
    "PlanConflict",
    "PlanFailure",
    "RecoveryRecord",
]
