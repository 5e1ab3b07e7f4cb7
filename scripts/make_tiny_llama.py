"""Write a tiny random Llama and a token file: what examples/own-model.yaml trains.

    python scripts/make_tiny_llama.py own-model        # own-model/llama/ and own-model/train.bin
    malleus train examples/own-model.yaml --steps 20

The model is a `transformers.LlamaForCausalLM` with random weights saved by `save_pretrained`
(config.json + model.safetensors), shaped like the real thing at toy size: grouped-query
attention (4 query heads, 2 key-value heads), untied embeddings. The token file is the `tokens`
data format (docs/data.md): little-endian uint16 ids, here the bytes of the small English corpus
shipped with malleus (vocabulary 256), so the loss visibly falls within a few steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

CORPUS = Path(__file__).resolve().parents[1] / "trainer" / "data" / "tiny_corpus.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write llama/ and train.bin into")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=176)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=256,  # the corpus's bytes are the token ids
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.out / "llama")

    tokens = np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8).astype("<u2")
    (args.out / "train.bin").write_bytes(tokens.tobytes())
    params = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {args.out / 'llama'} ({params:,} parameters) and "
        f"{args.out / 'train.bin'} ({len(tokens):,} uint16 tokens)"
    )


if __name__ == "__main__":
    main()
