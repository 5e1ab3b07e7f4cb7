"""Starting trainer processes: one rank's environment and process group, spawning ranks
locally, and the rendezvous store hosted by no rank.

Holds: `distributed.py` (torchrun's environment, `init_distributed`, the store's address, the
launcher's note), `spawn.py` (`spawn_local`: local processes supervised to the end),
`rendezvous.py` (`python -m malleus.trainer store`), `output.py` (`whole_lines`: ranks that
share a stdout never split each other's lines).

May import: `world` only.
"""
