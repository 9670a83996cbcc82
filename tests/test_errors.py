"""Bad input: a one-line `error: ...` naming the problem and the fix, and a non-zero exit."""
import subprocess
import sys

import pytest

from conftest import ROOT, TINY
from meshtrain.train import main

BAD_INPUTS = [
    (["--mesh", "2x2x4"], "mesh 2x2x4 needs 16 devices, found 8"),
    (["--mesh", "data=2,model=4"], "unknown mesh axis 'model'"),
    (["--mesh", "data=2,tensor=3", "--devices", "6"], "devices"),  # 6 != the 8 already simulated
    (["--mesh", "data=2,tensor=4", "--set", "model.num_kv_heads=2"], "num_kv_heads=2 is not divisible by tensor=4"),
    (["--mesh", "data=8", "--batch-size", "12"], "batch_size=12 is not divisible by data x fsdp (8)"),
    (["--data", "/nonexistent/corpus.txt"], "data path '/nonexistent/corpus.txt' does not exist"),
    (["--mesh", "2x1x1x4", "--set", "pipeline.microbatches=2"], "pipeline.microbatches=2 is fewer than the 4 pipeline stages"),
    (["--set", "model.width=64"], "unknown config key 'model.width'"),
    (["--set", "precision=fp8"], "precision='fp8' is not one of fp32, bf16"),
    (["--set", "train.steps=many"], "train.steps='many' is not a valid int"),
    (["--config", "configs/nope.yaml"], "config file configs/nope.yaml not found"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS)
def test_bad_input_is_one_line_error(argv, message, capsys, tmp_path):
    if "--config" not in argv:
        argv = ["--config", TINY, *argv]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert message in err, err


def test_cli_process_exits_nonzero_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", TINY, "--devices", "4",
                           "--mesh", "2x2x2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: mesh 2x2x2 needs 8 devices, found 4; change --mesh or --devices"
