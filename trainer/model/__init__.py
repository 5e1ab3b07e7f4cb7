"""The model: the LLaMA-style decoder and its logical shards (pieces), the layers' math,
numeric precision, and Hugging Face weights in and out.

Holds: `decoder.py` (GPT, pieces and their specs), `layers.py` (attention, RoPE, SwiGLU,
RMSNorm), `precision.py` (fp32 / bf16 / float64 and the master copies), `hf.py` (safetensors
slices per rank, `--save-hf`).

May import: `world` only (and `malleus.job`); nothing that knows about plans or processes.
"""
