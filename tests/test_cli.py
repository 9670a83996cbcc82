"""`python -m meshtrain.train` end to end on the default corpus (the Python standard library)."""
import json
import subprocess
import sys

import yaml

from conftest import ROOT


def test_cli_trains_on_default_corpus_and_writes_metrics(tmp_path):
    cmd = [sys.executable, "-m", "meshtrain.train", "--devices", "8", "--mesh", "data=2,fsdp=2,tensor=2",
           "--steps", "60", "--batch-size", "16", "--seq-len", "64", "--out", str(tmp_path),
           "--set", "model.num_layers=2", "--set", "model.d_model=64", "--set", "optim.lr=3e-3",
           "--set", "optim.warmup_steps=10", "--set", "train.log_every=10", "--set", "train.eval_every=30"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh data=2,fsdp=2,tensor=2,pipeline=1" in proc.stdout
    assert "tokens/s" in proc.stdout

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60]
    assert [r["step"] for r in evals] == [30, 60]
    for r in train:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s"} <= r.keys()
        assert r["tokens_per_sec"] > 0 and r["grad_norm"] > 0
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [r["loss"] for r in train]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]

    resolved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert resolved["parallel"]["mesh"] == "data=2,fsdp=2,tensor=2" and resolved["train"]["steps"] == 60
