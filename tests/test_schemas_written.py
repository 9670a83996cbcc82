"""Every file meshtrain writes reads back through its declared schema (meshtrain/core/schema.py): a tiny
run's run.json, config.yaml and checkpoint (manifest, metadata), its Hugging Face export (config.json,
safetensors headers and index, SHA256SUMS) and a sweep folder's sweep.json, each written by the real
writer. Not in the fast tier: the run compiles (about 30 s on 2 cores)."""
import shutil
from pathlib import Path

import jax
import pytest

from meshtrain.interop import hf
from meshtrain.models import FAMILIES
from meshtrain.run import checkpoint, run_dir
from meshtrain.sweep import folder
from meshtrain.testing import run_tiny


@pytest.fixture(scope="module")
def tiny_run():
    trainer, _, _ = run_tiny("train.steps=2", devices=jax.devices()[:1])
    return trainer


def test_a_runs_folder_reads_back(tiny_run, tmp_path):
    out = Path(tiny_run.out)
    record = run_dir.read_record(out)
    assert record["identity"]["seed"] == 0 and record["starts"][0]["step"] == 0
    assert run_dir.run_config(out).model.num_layers == 4
    root = out / "checkpoints"
    assert checkpoint.complete_steps(root) == [2]
    checkpoint.check_manifest(root / "2")
    assert checkpoint.saved_metadata(root / "2")["layer_order"] == [0, 1, 2, 3]
    shutil.copytree(root, tmp_path / "checkpoints")  # run.json lost: rebuilt from the checkpoint's metadata
    assert run_dir.record_or_rebuilt(tmp_path)["identity"]["schedule_steps"] == 2


def test_an_hf_export_reads_back(tiny_run, tmp_path):
    files = hf.save_params(tiny_run.unpermuted_params(), tiny_run.cfg.model, tmp_path, max_shard_bytes=50_000)
    hf.write_sums(tmp_path)
    assert len(files) > 1 and (tmp_path / hf.INDEX).is_file()  # the index is read too
    spec = hf.read_spec(tmp_path)
    assert spec.architecture() == tiny_run.cfg.model.architecture()
    hf.check_tensors(hf.SafetensorsFolder(tmp_path), FAMILIES[spec.family](spec), tmp_path)  # every header read


class Study:
    def __init__(self):
        self.user_attrs = {}

    def set_user_attr(self, key, value):
        self.user_attrs[key] = value


def test_a_sweep_folder_reads_back(tmp_path):
    study = Study()
    for _ in range(2):  # the first claim writes sweep.json, the second reads it
        assert folder.claim(tmp_path, "s", "sqlite:///db", lambda: bool(study.user_attrs), lambda: study,
                            lambda: study) is study
    assert (tmp_path / folder.RECORD).is_file()
