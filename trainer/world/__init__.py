"""The job's process group as the trainer sees it, and what every other room stands on.

Holds: `World` (`world.py`), the one object a process keeps of the job's process group, made
at launch and handed to whoever needs it (no module globals): the membership in force (GPU ids
against process-group ranks, the coordinator; `membership.py`), the store to recover by, the
bound on collectives and the deadline of a step, and the recovery alarm that interrupts a rank
busy computing (`alarm.py`); the client of the rendezvous store that redials a lost store
(`store_client.py`), fault injection for tests and demos (`faults.py`), the errors and
store keys every room shares (`errors.py`), what a rank believes of the store: values sealed
with the job's key only (`sealed.py`, `Sealer`), and what ranks hand each other besides model
tensors: JSON bytes with a length word and a size bound, each rank's own row of figures, never
a pickle (`exchange.py`).

May import: torch and `malleus.job`/`malleus.planner`/`malleus.control` only; no other room of
the trainer.
"""
