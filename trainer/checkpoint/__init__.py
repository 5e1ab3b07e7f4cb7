"""Plan-independent checkpoints that cannot be silently wrong.

Holds: `directory.py` (one directory per checkpoint step, written atomically: save, latest,
read the manifest, load pieces, verify) and `files.py` (payload files written with their
sha256 and read back only after every check). It takes explicit pieces and optimizer state,
never a Trainer.

May import: `world`, `model`, `data`, `parallel`, `measure`.
"""
