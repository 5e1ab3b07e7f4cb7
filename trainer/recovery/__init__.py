"""Live recovery, built on top of the Trainer: survivors of a failed rank re-form the job and
go on; a replacement joins a running job.

Holds: `protocol.py` (detection, the leader's decision, `recover`), `wait.py` (the leader's wait
for arrivals), `groups.py` (letting go of the broken process group, forming the next),
`restore.py` (every member restores its state under the recovery plan), `join.py`
(replacements entering the running job), `ledger.py` (recovery's own state on a rank: who is out,
the pending and completed recoveries, the admitted replacements), `tally.py` (what a recovery
costs the store: every call counted).

May import: every room below it (`world` .. `engine`); never `launch` or `run`.
"""
