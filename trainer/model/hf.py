"""Hugging Face weights in and out: safetensors slices per rank, and `--save-hf` folders.

In: `spec.model.path` is a folder as `save_pretrained` writes it. Each rank opens the files
lazily (`safe_open`) and reads, for every piece it holds, only that piece's rows or columns
(`get_slice`), so no rank ever loads the whole model. A folder without weights is refused
(`malleus.job.hf.folder_faults`): only a job that names no path starts from the seeded random
pieces. The names map one to one
(`HF_NAMES`); nothing is padded (the ends are cut by hidden columns, trainer/model/decoder.py), so what
is read is exactly what is exported.

Out: config.json (the input's, or a Llama config made from the job's sizes) and the full
tensors in the config's dtype, one file, or several with model.safetensors.index.json above
`max_shard_bytes` (what `from_pretrained` reads). Loading and saving with no step in between
gives the input's bytes back: fp32 masters hold bf16 or fp16 weights exactly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from malleus.errors import BadInput, Fault
from malleus.job import ModelConfig, ResolvedJob
from malleus.job.contained import contained
from malleus.job.hf import CONFIG, INDEX, folder_faults, read_config

from .decoder import Piece, init_piece, join_pieces, param_specs, pieces

__all__ = [
    "INDEX",
    "MAX_SHARD_BYTES",
    "WeightFiles",
    "hf_config",
    "hf_name",
    "initial_full",
    "initial_pieces",
    "save_hf",
]

MAX_SHARD_BYTES = 5 << 30
"""Above this many bytes the export is split into several files with an index (as transformers)."""
WHERE = "spec.model.path"

HF_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "mlp.w1": "mlp.gate_proj",
    "mlp.w3": "mlp.up_proj",
    "mlp.w2": "mlp.down_proj",
}
"""Canonical names (per layer without `layers.L.`) -> transformers' Llama names."""
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_name(name: str) -> str:
    """transformers' name of a canonical full parameter."""
    if name in HF_NAMES:
        return HF_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match is None:
        raise KeyError(name)
    layer, module, kind = match.groups()
    inner = HF_NAMES.get(f"{module}.{kind}") or f"{HF_NAMES[module]}.{kind}"
    return f"model.layers.{layer}.{inner}"


def _weight_map(folder: Path, index: Path) -> dict[str, Path]:
    """The index's tensor -> file map, every file inside `folder` (`malleus.job.contained`: an
    entry such as `../x` or `/etc/passwd` is BadInput naming the index and the entry)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        items = list(weight_map.items())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(
            [Fault(WHERE, f"{index}: not a readable weight map ({type(e).__name__}: {e})")]
        ) from None
    where, faults = {}, []
    for name, file in items:
        try:
            where[name] = contained(folder, file, index, f"weight_map[{name!r}]")
        except ValueError as e:
            faults.append(Fault(WHERE, str(e)))
    if faults:
        raise BadInput(faults)
    return where


class WeightFiles:
    """The safetensors of a model folder, opened lazily; tensors are read slice by slice."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / INDEX
        if index.is_file():
            self.where = _weight_map(folder, index)
        else:
            self.where = {}
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(file, framework="pt") as f:
                    self.where.update((name, file) for name in f.keys())  # noqa: SIM118
        self._open: dict[Path, Any] = {}

    @classmethod
    def of(cls, job: ResolvedJob) -> WeightFiles | None:
        """The job's weights; None without a path (a random start). A folder without weights
        (or with the index's files missing) is `BadInput`, never a random start."""
        path = job.spec.model.path
        if path is None:
            return None
        faults = folder_faults(path)
        if faults:
            raise BadInput(faults)
        return cls(Path(path))

    def _file(self, name: str) -> Any:
        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file]

    def check(self, cfg: ModelConfig) -> None:
        """Every tensor the model needs is there with its shape (headers only); else BadInput."""
        faults = []
        for spec in param_specs(cfg):
            name = hf_name(spec.name)
            if name not in self.where:
                faults.append(Fault(WHERE, f"{self.folder}: tensor {name} is missing"))
                continue
            shape = tuple(self._file(name).get_slice(name).get_shape())
            if shape != spec.shape:
                faults.append(
                    Fault(WHERE, f"{self.folder}: {name} is {shape}, config.json says {spec.shape}")
                )
        if faults:
            raise BadInput(faults)

    def read(self, piece: Piece, tp: int) -> Tensor:
        """One piece, float32: only its rows (or columns) are read from disk."""
        spec, name = piece.spec, hf_name(piece.spec.name)
        view = self._file(name).get_slice(name)
        if piece.shard is None:
            return view[:].float()
        size = spec.shape[spec.split] // spec.count(tp)
        cut = slice(piece.shard * size, (piece.shard + 1) * size)
        part = view[cut] if spec.split == 0 else view[:, cut]  # (rows, C) or (C, cols)
        return part.float().contiguous()


def initial_pieces(job: ResolvedJob, held: Iterable[Piece]) -> dict[str, Tensor]:
    """The starting value of every piece this rank holds: read from the job's safetensors when
    there are some (checked against config.json first), else drawn from the seed."""
    files = WeightFiles.of(job)
    if files is not None:
        files.check(job.model)
        return {p.name: files.read(p, job.tp) for p in held}
    return {p.name: init_piece(p, job.tp, job.spec.training.seed) for p in held}


def initial_full(job: ResolvedJob) -> dict[str, Tensor]:
    """The whole starting model (canonical names), for the single-process reference."""
    parts = initial_pieces(job, pieces(job.model, job.tp))
    return join_pieces(job.model, job.tp, parts)


def hf_config(job: ResolvedJob) -> dict[str, Any]:
    """config.json of the export: the input's as it was, else a Llama config of the job."""
    if job.spec.model.path is not None:
        source = Path(job.spec.model.path) / CONFIG
        if source.is_file():
            return read_config(source)
    cfg = job.model
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta} | vars(cfg.rope_scaling)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.sequence,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tied_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
    }


def save_hf(
    job: ResolvedJob,
    full: Mapping[str, Tensor],
    directory: str | Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[Path]:
    """Write `full` (canonical names) as a Hugging Face folder; returns the files written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(job)
    dtype = _DTYPES.get(config.get("dtype") or config.get("torch_dtype") or "", torch.float32)
    tensors = {hf_name(n): full[n].detach().to("cpu", dtype).contiguous() for n in full}
    files: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append({})
            size = 0
        files[-1][name] = t
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    written = []
    for name, part in zip(names, files, strict=True):
        save_file(part, out / name, metadata={"format": "pt"})
        written.append(out / name)
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {t: n for n, part in zip(names, files, strict=True) for t in part},
        }
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / INDEX)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    written.append(out / CONFIG)
    return written
