"""Training samples as a pure function of (seed, global sample index), and `malleus data prepare`.

Holds: `samples.py` (the sources: synthetic, text, hf-dataset; micro-batch slicing), `prepare.py`
(text to token ids with a `tokenizer.json`), `tiny_corpus.txt` (the demo corpus).

May import: `world` only (and `malleus.job`).
"""
