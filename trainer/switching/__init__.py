"""The step-boundary protocol: plans and stop requests reach every rank at one boundary.

Holds: `protocol.py` (the boundary's control words, the coordinator, the stop request, the
migration record) and `plan_inbox.py` (the coordinator's inbox for `POST /plan`, without HTTP
or torch).

May import: `world`, `model`, `data`, `parallel`, `measure`, `checkpoint`.
"""
