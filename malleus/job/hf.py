"""A Hugging Face model folder's config.json, read and judged without torch.

`spec.model.path` names a folder as `save_pretrained` writes it (config.json, *.safetensors,
maybe model.safetensors.index.json). The trainer executes one decoder (trainer/model/decoder.py:
RMSNorm, rotary positions, SwiGLU, grouped-query attention), so a config is accepted exactly
when that decoder computes what the config describes: Llama, Mistral without a sliding window
narrower than the training sequence, and Qwen2 (its q/k/v biases are sharded by heads like the
projections' rows). Everything else is refused here, naming the config field and what is
supported, so `malleus check` refuses it before any trainer starts.

`folder_faults` judges the folder itself wherever it is readable (`malleus check`, `run`,
`train`, every trainer at its start): it must exist and hold config.json and the weights. A job
trains from random weights only when it names no path, never because a path was mistyped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from malleus.errors import BadInput, Fault

from .contained import contained
from .presets import ModelConfig, RopeScaling

__all__ = [
    "CONFIG",
    "INDEX",
    "SUPPORTED",
    "check_weights",
    "config_in",
    "folder_faults",
    "model_config",
    "read_config",
    "shown",
]

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
"""The weight map of a model saved in several safetensors files."""
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
"""Architectures the trainer's decoder computes exactly, with their model_type."""

WHERE = "spec.model.path"


def config_in(folder: str | Path) -> Path | None:
    """The folder's config.json when it is readable here (the operator never sees the folder)."""
    path = Path(folder) / CONFIG
    return path if path.is_file() else None


def check_weights(folder: str | Path) -> None:
    """`BadInput` for a folder of pickled `*.bin` weights, as soon as its config.json is read:
    only safetensors are read (sliced per rank). Every other fault of the folder, missing
    weights included, is `folder_faults`'s, judged with the job's other files."""
    folder = Path(folder)
    if any(folder.glob("*.safetensors")) or not any(folder.glob("*.bin")):
        return
    raise BadInput([_pickled(folder)])


def _pickled(folder: Path) -> Fault:
    return Fault(
        WHERE,
        f"{folder} holds *.bin weights and no *.safetensors; only safetensors are read "
        "(re-save with save_pretrained(..., safe_serialization=True))",
    )


def shown(path: Path) -> str:
    """`path` as a message names it: a relative one with the folder it is read from."""
    return str(path) if path.is_absolute() else f"{path} (under {Path.cwd()})"


RANDOM_START = "leave spec.model.path out (stating the sizes) to train from random weights"


def folder_faults(path: str | Path) -> list[Fault]:
    """Every fault of `spec.model.path` as the trainers will read it: the folder exists and
    holds config.json and the weights (*.safetensors, and every file the index names).

    Judged where the folder is (`malleus check` / `run` / `train`, every trainer at its start),
    never by the operator, which cannot see the trainers' volumes. Each fault says what is
    wrong and what to do."""
    folder = Path(path)
    if not folder.exists():
        return [
            Fault(
                WHERE,
                f"{shown(folder)}: no such folder; correct the path (the folder save_pretrained "
                f"wrote: config.json + *.safetensors), or {RANDOM_START}",
            )
        ]
    if not folder.is_dir():
        tip = f"name its folder, {folder.parent}" if folder.name == CONFIG else "name its folder"
        return [
            Fault(
                WHERE,
                f"{shown(folder)} is a file, not a model folder (config.json + *.safetensors): "
                f"{tip}",
            )
        ]
    if not (folder / CONFIG).is_file():
        inside = sorted(p for p in _subfolders(folder) if (p / CONFIG).is_file())
        tip = f"did you mean {inside[0]}?" if inside else "name the folder save_pretrained wrote"
        return [
            Fault(
                WHERE, f"{shown(folder)} holds no {CONFIG}: not a Hugging Face model folder; {tip}"
            )
        ]
    return _weight_faults(folder)


def _subfolders(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir()]
    except OSError:
        return []


def _weight_faults(folder: Path) -> list[Fault]:
    index = folder / INDEX
    if index.is_file():
        try:
            files = sorted({str(f) for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            return [Fault(WHERE, f"{index}: not a readable weight map ({type(e).__name__}: {e})")]
        outside = []
        for f in files:
            try:
                contained(folder, f, index, "weight_map")
            except ValueError as e:
                outside.append(Fault(WHERE, str(e)))
        if outside:
            return outside
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            return [
                Fault(
                    WHERE,
                    f"{index} names {missing[0]}{more}, missing from {folder}: copy the whole "
                    "folder save_pretrained wrote",
                )
            ]
        return []
    if any(folder.glob("*.safetensors")):
        return []
    if any(folder.glob("*.bin")):
        return [_pickled(folder)]
    return [
        Fault(
            WHERE,
            f"{shown(folder)} holds {CONFIG} but no weights (*.safetensors), so the trainers "
            "would start from random weights: add the weights (save_pretrained(..., "
            f"safe_serialization=True) writes them), or {RANDOM_START}",
        )
    ]


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json as a dict; `BadInput` naming the file if it is no JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput([Fault(WHERE, f"{path}: not a readable JSON config: {e}")]) from None
    if not isinstance(data, dict):
        raise BadInput([Fault(WHERE, f"{path}: not a JSON object")])
    return data


def _rope(config: Mapping[str, Any], say: Any) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers 5's `rope_parameters` or 4.x's rope_theta/rope_scaling."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        say("partial_rotary_factor", "rotary positions on part of each head are not supported")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        say("rope_parameters", f"rope_type {kind!r}; supported: default, llama3")
        return theta, None
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        say("rope_parameters", f"llama3 scaling lacks or mistypes {e}")
        return theta, None
    return theta, scaling


def model_config(config: Mapping[str, Any], sequence: int, label: str = CONFIG) -> ModelConfig:
    """The trainer's `ModelConfig` for a Hugging Face config, training `sequence` tokens long.

    `BadInput` with one fault per unsupported or missing field, each naming it
    (``spec.model.path: config.json architectures: ['GPT2LMHeadModel']; supported: ...``).
    """
    faults: list[Fault] = []

    def say(field: str, message: str) -> None:
        faults.append(Fault(WHERE, f"{label} {field}: {message}"))

    archs = config.get("architectures") or []  # absent when a config alone was saved
    kind = config.get("model_type")
    known = SUPPORTED.get(archs[0]) if len(archs) == 1 else None
    if kind not in SUPPORTED.values() or (archs and known != kind):
        say("architectures", f"{archs} (model_type {kind!r}); supported: {', '.join(SUPPORTED)}")
        raise BadInput(faults)
    sizes: dict[str, int] = {}
    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"):
        value = config.get(field)
        if not isinstance(value, int) or value < 1:
            say(field, f"{value!r} is not a positive integer")
        else:
            sizes[field] = value
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 2:
        say("vocab_size", f"{vocab!r} is not an integer >= 2")
    if faults:
        raise BadInput(faults)
    heads = sizes["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    if heads % kv:
        say("num_key_value_heads", f"{kv} does not divide num_attention_heads({heads})")
    head_dim = config.get("head_dim") or sizes["hidden_size"] // heads
    if config.get("head_dim") is None and sizes["hidden_size"] % heads:
        say("hidden_size", f"{sizes['hidden_size']} is not divisible by num_attention_heads")
    if config.get("hidden_act", "silu") != "silu":
        say("hidden_act", f"{config.get('hidden_act')!r}; supported: silu (SwiGLU)")
    if config.get("mlp_bias"):
        say("mlp_bias", "MLP biases are not supported")
    bias = kind == "qwen2"  # Qwen2's q/k/v projections always carry biases
    if kind == "llama" and config.get("attention_bias"):
        say("attention_bias", "Llama's attention biases include o_proj's; not supported")
    window = config.get("sliding_window")
    windowed = kind == "mistral" or config.get("use_sliding_window")
    if windowed and window is not None and window < sequence:
        say("sliding_window", f"{window} < sequence({sequence}); supported: no sliding window")
    if config.get("attention_dropout", 0.0):
        say("attention_dropout", "dropout is not supported")
    if config.get("num_local_experts") or config.get("num_experts"):
        say("num_experts", "mixture-of-experts layers are not supported")
    if config.get("pretraining_tp", 1) != 1:
        say("pretraining_tp", f"{config['pretraining_tp']}; supported: 1")
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and sequence > limit:
        faults.append(
            Fault("spec.model.sequence", f"{sequence} exceeds max_position_embeddings({limit})")
        )
    theta, scaling = _rope(config, say)
    if faults:
        raise BadInput(faults)
    return ModelConfig(
        layers=sizes["num_hidden_layers"],
        hidden=sizes["hidden_size"],
        heads=heads,
        ffn=sizes["intermediate_size"],
        vocab=int(vocab),  # type: ignore[arg-type]
        sequence=sequence,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        kv_heads=kv,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        attention_bias=bias,
    )
