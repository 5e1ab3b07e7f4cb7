"""spec.emulation.gpuProfile: the CRD's names are the trainer's profiles, and a named profile
sets the emulated clock's per-layer-shard times."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from malleus.job import GPU_PROFILES, BadInput, ResolvedJob, load_job
from malleus.trainer.engine.services import Services

ROOT = Path(__file__).resolve().parents[3]


def _job(**emulation: object) -> dict:
    manifest = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"]["emulation"].update(emulation)
    return manifest


def test_crd_enum_lists_exactly_the_trainer_profiles() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "malleusjob.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    enum = spec["properties"]["emulation"]["properties"]["gpuProfile"]["enum"]
    assert sorted(enum) == sorted(GPU_PROFILES)


@pytest.mark.parametrize("name", sorted(GPU_PROFILES))
def test_profile_replaces_the_millisecond_fields(name: str) -> None:
    job = load_job(_job(gpuProfile=name, layerForwardMs=99, layerBackwardMs=99))
    assert (
        job.spec.emulation.layer_seconds() == GPU_PROFILES[name]
    )  # what `malleus run` predicts with
    clock = Services.null(ResolvedJob.of(job), 1).clock  # what a rank charges
    assert (clock.forward_s, clock.backward_s) == GPU_PROFILES[name]


def test_without_a_profile_the_millisecond_fields_count() -> None:
    clock = Services.null(ResolvedJob.load(_job(layerForwardMs=7, layerBackwardMs=14)), 1).clock
    assert (clock.forward_s, clock.backward_s) == pytest.approx((0.007, 0.014))


def test_unknown_profile_is_rejected_with_its_path() -> None:
    with pytest.raises(BadInput, match=r"spec\.emulation\.gpuProfile"):
        load_job(_job(gpuProfile="a100-80gb"))
