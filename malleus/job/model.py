"""`spec.model` resolved into the `ModelConfig` every consumer computes with.

Three sources, one result: a preset, explicit sizes (overriding the preset's), or a Hugging Face
folder (`path`, judged by `malleus.job.hf`). The folder lives on the trainers' volume, so the
operator never reads it: there the sizes stated beside `path` are the model, and wherever the
folder is readable (`malleus check`, `malleus run`, every trainer at start) they must agree with
its config.json, so a job is never trained as another model than the one it was planned as.
"""

from __future__ import annotations

from pathlib import Path

from pydantic.alias_generators import to_camel

from malleus.errors import BadInput, Fault

from .hf import CONFIG, WHERE, check_weights, config_in, model_config, read_config, shown
from .presets import PRESETS, ModelConfig
from .spec import ModelSpec as ModelSection

__all__ = ["resolve_model"]

_SIZES = ("layers", "hidden", "heads", "ffn", "vocab", "sequence")
_OPTIONAL = {"kv_heads": 0, "head_dim": 0}  # ModelConfig's "same as heads / hidden/heads"


def resolve_model(model: ModelSection) -> ModelConfig:
    """The sizes of ``spec.model``: config.json's when `path` is readable here (explicit sizes
    must then agree with it), else the preset's, overridden by any size given explicitly.

    Where the folder is not readable (the operator's case) the explicit sizes are the model:
    the trainers, which read the folder, refuse to start if config.json disagrees with them.
    """
    config = config_in(model.path) if model.path is not None else None
    if config is not None:
        if model.sequence is None:
            raise BadInput([Fault("spec.model.sequence", "Required value: the training length")])
        cfg = model_config(read_config(config), model.sequence, str(config))
        check_weights(config.parent)
        _check_agreement(model, cfg, str(config))
        return cfg
    base = PRESETS[model.preset] if model.preset is not None else None
    sizes: dict[str, int] = {}
    missing: list[str] = []
    for name in _SIZES:
        value = getattr(model, name)
        if value is None and base is not None:
            value = getattr(base, name)
        if value is None:
            missing.append(name)
        else:
            sizes[name] = value
    if missing and model.path is not None:
        raise BadInput([_unreadable(model.path, missing)])
    if missing:
        raise BadInput(
            [Fault(f"spec.model.{name}", "Required value: no preset gives it") for name in missing]
        )
    optional = {k: getattr(model, k) or default for k, default in _OPTIONAL.items()}
    return ModelConfig(**sizes, **optional, tied_embeddings=model.tied_embeddings)


def _unreadable(path: str, missing: list[str]) -> Fault:
    """Sizes missing beside a `path` whose config.json is not readable here: the path is wrong,
    or the folder lives elsewhere (the trainers' volume, which the operator never sees)."""
    folder, names = Path(path), ", ".join(f"spec.model.{name}" for name in missing)
    if folder.is_dir():
        why = f"{shown(folder)} holds no {CONFIG}: name the model's folder, or"
    else:
        why = (
            f"no folder {shown(folder)} here: correct the path if the folder is on this machine; "
            "if it is on the trainers' volume only,"
        )
    return Fault(
        WHERE,
        f"{folder / CONFIG} is not readable here, so the sizes must be stated ({why} state "
        f"{names} beside it)",
    )


def _check_agreement(model: ModelSection, cfg: ModelConfig, label: str) -> None:
    """Sizes stated beside `path` (what the operator planned with) must be config.json's."""
    faults = [
        Fault(
            f"spec.model.{to_camel(name)}",
            f"{stated} disagrees with {label} ({getattr(cfg, name)})",
        )
        for name in (*_SIZES[:-1], *_OPTIONAL)
        if (stated := getattr(model, name)) is not None and stated != getattr(cfg, name)
    ]
    if model.tied_embeddings and not cfg.tied_embeddings:  # false is also the CRD's default
        faults.append(Fault("spec.model.tiedEmbeddings", f"true disagrees with {label} (untied)"))
    if faults:
        raise BadInput(faults)
