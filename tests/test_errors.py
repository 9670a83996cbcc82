"""Bad input: a one-line `error: ...` naming the problem and the fix, exit 2, nothing written."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY

from meshtrain.train import main

SHAKESPEARE = str(ROOT / "configs" / "shakespeare_char.yaml")
INTERRUPTED = "interrupted (Ctrl-C); run the command again to redo it\n"

BAD_INPUTS = [
    (["--mesh", "2x2x4"], "mesh 2x2x4 needs 16 devices, found 8; change --mesh or --devices"),
    (["--mesh", "data=2,model=4"], "unknown mesh axis 'model' in --mesh data=2,model=4"),
    (["--mesh", "data=2,tensor=3", "--devices", "6"], "--devices 6 must be set before JAX starts"),
    (["--mesh", "0x8"], "--mesh 0x8: axis sizes must be >= 1"),  # not YAML's hex 8
    (["--devices", "0"], "--devices 0: simulate 1 to 4096 CPU devices"),
    (["--devices", "100000"], "--devices 100000: simulate 1 to 4096 CPU devices"),
    (["--set", "model.num_layers=0"], "model.num_layers=0 must be >= 1"),
    (["--mesh", "data=2,tensor=4", "--set", "model.num_kv_heads=2"], "num_kv_heads=2 is not divisible by tensor=4"),
    (["--mesh", "data=8", "--batch-size", "12"],
     "batch_size=12 is not divisible by the batch axes expert (1) x data (8) x fsdp (1)"),
    (["--data", "/nonexistent/corpus.txt"], "data path '/nonexistent/corpus.txt' does not exist"),
    (["--mesh", "2x1x1x4", "--set", "parallel.microbatches=2"],
     "parallel.microbatches=2 is fewer than the 4 pipeline stages"),
    (["--mesh", "data=2,tensor=4", "--set", "parallel.rules.seq=[tensor]", "--seq-len", "18"],
     "parallel.rules.seq=['tensor'] splits the sequence 4 ways, which does not divide train.seq_len=18"),
    (["--set", "parallel.rules.seq=[tensor"], "--set parallel.rules.seq line 1, column 8: expected ',' or ']'"),
    (["--steps", "12", "--set", "train.steps=100"], "--steps 12 and --set train.steps=100 both set train.steps"),
    (["--set", "model.width=64"], "unknown config key 'model.width'"),
    (["--set", "parallel.precision=fp4"], "parallel.precision='fp4' is not one of fp32, bf16"),
    (["--set", "train.steps=many"], "train.steps='many' is not a valid int"),
    (["--config", "configs/nope.yaml"], "config file configs/nope.yaml not found"),
    (["--mesh", "data=2,data=4"], "--mesh data=2,data=4 names axis 'data' twice; give each axis once"),
    (["--set", "parallel.mesh=fsdp=-1,tensor=16"],  # a config's mesh for other devices
     "--mesh fsdp=-1,tensor=16: 8 devices do not divide by 16; change --mesh or --devices"),
    (["--set", "parallel.rules.mlp=[tensor, tensor]"],
     "parallel.rules.mlp=['tensor', 'tensor'] names a mesh axis twice"),
    (["--set", "optim.lr=nan"], "optim.lr=nan must be a finite number >= 0"),
    (["--steps", "1e3"], "argument --steps: invalid int value: '1e3'; see python -m meshtrain.train --help"),
    (["--process-id", "-1"], "argument --process-id: -1 must be >= 0"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id 2 is not one of the 2 processes; give each process its own id from 0 to 1"),
    (["--seq-len", "100000000", "--set", "parallel.attention=blockwise"],  # linear in L, yet terabytes
     "train.seq_len=100000000 x train.batch_size=16 needs at least"),
    (["--seq-len", "1048576"], "train.seq_len=1048576 x train.batch_size=16 needs at least"),  # [L, L] scores
]


def test_plan_refuses_an_absurd_size_before_compiling(capsys):
    """A compile of a 10^8-token step runs for minutes; the formula refuses it in a second."""
    from meshtrain import plan

    started = time.perf_counter()
    assert plan.main(["--config", TINY, "--devices", "8", "--mesh", "fsdp=8", "--set", "train.seq_len=100000000",
                      "--set", "parallel.attention=blockwise"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.seq_len=100000000 x train.batch_size=16 needs at least ") and \
        "GB one H100 SXM has; lower train.seq_len or train.batch_size, or add devices\n" in err, err
    assert time.perf_counter() - started < 10


def run_main(argv, capsys, out):
    if "--config" not in argv:
        argv = ["--config", TINY, *argv]
    code = main([*argv, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, (code, err)
    assert not out.exists()  # nothing written
    return err


@pytest.mark.parametrize("argv,message", BAD_INPUTS)
def test_bad_input_is_one_line_error(argv, message, capsys, tmp_path):
    assert message in run_main(argv, capsys, tmp_path / "run")


def test_a_configs_mesh_gives_way_to_mesh_on_the_command_line(capsys, tmp_path):
    """A pod config carries its mesh (configs/llama3_8b.yaml: fsdp=-1) and --mesh replaces it;
    a config's mesh these devices cannot make is one error line naming the fix, nothing written."""
    llama3 = str(ROOT / "configs" / "llama3_8b.yaml")
    for flags, mesh in (([], "fsdp=-1"), (["--mesh", "data=8"], "data=8")):
        assert main(["--config", llama3, *flags, "--print-config"]) == 0
        assert f"\n  mesh: {mesh}  # " in capsys.readouterr().out
    (tmp_path / "pod.yaml").write_text(f"{Path(TINY).read_text()}parallel: {{mesh: 'fsdp=2,tensor=8'}}\n")
    err = run_main(["--config", str(tmp_path / "pod.yaml")], capsys, tmp_path / "run")
    assert err == "error: mesh 1x2x8 needs 16 devices, found 8; change --mesh or --devices"


def test_bad_files(capsys, tmp_path):
    (tmp_path / "broken.yaml").write_text("model: {num_layers: 4\ntrain: [\n")
    err = run_main(["--config", str(tmp_path / "broken.yaml")], capsys, tmp_path / "run")
    assert err == (f"error: {tmp_path / 'broken.yaml'} line 2, column 6: expected ',' or '}}', but got ':'; "
                   "fix the YAML syntax")

    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    err = run_main(["--data", str(tmp_path / "odd.bin")], capsys, tmp_path / "run")
    assert "has 3 bytes, not a whole number of 2-byte (uint16) tokens" in err

    (tmp_path / "small.txt").write_text("x" * 1000)  # + a newline: 950 tokens to train on, 51 held out
    err = run_main(["--config", SHAKESPEARE, "--data", str(tmp_path / "small.txt"), "--mesh", "data=8"],
                   capsys, tmp_path / "run")
    assert "the data holds 1,001 tokens, leaving 51 for validation" in err

    (tmp_path / "a_file").write_text("")
    err = run_main([], capsys, tmp_path / "a_file" / "run")
    assert err == (f"error: --out {tmp_path / 'a_file' / 'run'}: {tmp_path / 'a_file'} is a file, not a folder; "
                   "pick another --out")

    if os.geteuid() == 0:  # writable by access() as root, yet nothing can be created there
        err = run_main([], capsys, Path("/proc/meshtrain/run"))
        assert err.startswith("error: --out /proc/meshtrain/run cannot be created (")
        assert err.endswith("; pick another --out")


def test_a_dangling_link_as_out_is_one_line(capsys, tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "runs")
    for out in (tmp_path / "link", tmp_path / "link" / "run"):
        err = run_main([], capsys, out)
        assert err == (f"error: --out {out}: {tmp_path / 'link'} is a link to {tmp_path / 'gone' / 'runs'}, which "
                       f"does not exist; create that folder or pick another --out")


@pytest.mark.fast
def test_a_forced_platform_the_machine_lacks_is_one_line(monkeypatch):
    from meshtrain.core import cli

    monkeypatch.setattr(cli, "no_cuda_driver", lambda: True)
    for value, platform in (("cuda", "cuda"), ("cpu,gpu", "gpu")):
        monkeypatch.setenv("JAX_PLATFORMS", value)
        with pytest.raises(cli.UserError, match=rf"^JAX_PLATFORMS={value} asks for {platform}, which this machine "
                                                rf"lacks \(no CUDA driver: libcuda.so.1 is not found\); unset"):
            cli.simulate_devices(None)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    cli.check_platforms()  # the CPU is always there


def test_a_folder_where_a_file_is_due_is_one_line_before_any_work(capsys, tmp_path):
    from meshtrain import eval as eval_command

    assert eval_command.main(["--run", str(tmp_path / "no-run"), "--json", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --json {tmp_path} is a folder; name a file\n"


def test_explicit_data_kind_wins_over_data_flag(capsys, tmp_path):
    (tmp_path / "corpus.txt").write_text("abc" * 1001)  # 3003 bytes: not whole uint16 tokens
    err = run_main(["--data", str(tmp_path / "corpus.txt"), "--set", "data.kind=tokens"], capsys, tmp_path / "run")
    assert "not a whole number of 2-byte (uint16) tokens" in err  # read as tokens, as asked


def test_ctrl_c_before_training_exits_quietly_and_writes_nothing(capsys, tmp_path, monkeypatch):
    import meshtrain.run.trainer

    def interrupted_compile(self, cfg, devices=None, allow_change=False):
        raise KeyboardInterrupt
    monkeypatch.setattr(meshtrain.run.trainer.Trainer, "__init__", interrupted_compile)
    assert main(["--config", TINY, "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err == INTERRUPTED
    assert not (tmp_path / "run").exists()


def test_ctrl_c_swallowed_by_a_library_still_stops_before_training(capsys, tmp_path, monkeypatch):
    """A SIGINT whose KeyboardInterrupt a callback swallows (as JAX's GC hook does during import)."""
    import os
    import signal

    import meshtrain.run.trainer

    def swallowed_interrupt(self, cfg, devices=None, allow_change=False):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            pass
    monkeypatch.setattr(meshtrain.run.trainer.Trainer, "__init__", swallowed_interrupt)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs as a background job
    assert main(["--config", TINY, "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err == INTERRUPTED
    assert not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGINT) == before  # handler restored


def test_cli_process_exits_nonzero_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", TINY, "--devices", "4",
                           "--mesh", "2x2x2", "--out", str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("error: mesh 2x2x2 needs 8 devices, found 4; "
                                                    "change --mesh or --devices")
    assert not (tmp_path / "run").exists()
