"""The base of the MalleusJob spec's models: camelCase aliases, unknown fields rejected.

One class, `StrictModel`, shared by `malleus.job.spec` (the training, model and control-loop
sections), `malleus.job.spec_cluster` (the pod template, run policy and scheduling) and
`malleus.job.status`; a module of its own so that those can import it without importing one
another.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class StrictModel(BaseModel):
    """Base: camelCase aliases, construction by either name, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
