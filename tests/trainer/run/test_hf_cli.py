"""`malleus train --save-hf`: a trained Hugging Face model back out, from the parallel trainer
and from the single-process reference, loadable by `AutoModelForCausalLM.from_pretrained`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from malleus.runner import cli as runner_cli
from malleus.runner.processes import LaunchSpec
from malleus.trainer import cli
from tests.job.tiny_llama import SEQUENCE
from tests.trainer.hf_models import hf_model, job_for, rel

PY = sys.executable


def test_train_and_save_hf_from_two_ranks_and_from_the_reference(tmp_path: Path) -> None:
    source = tmp_path / "model"
    hf_model(LlamaForCausalLM, num_attention_heads=4, num_key_value_heads=1).save_pretrained(source)
    job = job_for(source, nodes=1, gpusPerNode=2, emulation={"enabled": False})
    manifest = job.job.model_dump(by_alias=True, exclude_none=True)
    manifest["spec"]["training"] |= {"globalBatchSize": 4, "steps": 2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    # The two runs are independent: started together, their interpreters and torch imports
    # overlap instead of queueing (each still checked on its own exit code and output).
    outs: dict[str, Path] = {}
    procs: dict[str, subprocess.Popen[str]] = {}
    for name, extra in (("parallel", []), ("reference", ["--reference"])):
        outs[name] = tmp_path / name
        args = [PY, "-m", "malleus.cli", "train", str(path), "--quiet", *extra]
        procs[name] = subprocess.Popen(
            [*args, "--save-hf", str(outs[name])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{name}: {err}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    x = torch.randint(0, 97, (1, SEQUENCE), generator=torch.Generator().manual_seed(3))
    trained = AutoModelForCausalLM.from_pretrained(outs["parallel"])(input_ids=x).logits
    reference = AutoModelForCausalLM.from_pretrained(outs["reference"])(input_ids=x).logits
    untrained = AutoModelForCausalLM.from_pretrained(source)(input_ids=x).logits
    assert rel(trained, reference) <= 1e-4
    assert rel(trained, untrained) > 1e-3  # two steps moved it


def test_malleus_run_hands_save_hf_to_every_trainer(tmp_path: Path) -> None:
    # `malleus run --save-hf DIR` reaches the trainers' command line, which parses it.
    parser = argparse.ArgumentParser()
    runner_cli.add_arguments(parser)
    assert parser.parse_args(["job.yaml", "--save-hf", "out"]).save_hf == "out"
    spec = LaunchSpec("job.yaml", 2, tmp_path, tmp_path / "token", save_hf=str(tmp_path / "hf"))
    argv = spec.argv(1, tmp_path / "plan.json", 8040, resume=False)
    trainer = argparse.ArgumentParser()
    cli.add_arguments(trainer)
    assert trainer.parse_args(argv[3:]).save_hf == str(tmp_path / "hf")
