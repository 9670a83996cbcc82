"""meshtrain on Ray (meshtrain/ray_launch.py): a local Ray instance (2 CPUs, no dashboard) places two
bundles on this machine and runs a 2-process meshtrain job (2 x 4 simulated CPU devices, gloo, the
settings of tests/test_multihost.py) through jax.distributed: both processes finish, only process 0
logs, the losses are the single-device run's, and the checkpoint they write together is there. A
failing process fails the launch with its `error:` line."""
import json

import numpy as np
import pytest
from conftest import TINY

ray = pytest.importorskip("ray")

from meshtrain.ray_launch import launch, main, summarize  # noqa: E402

# ray.init starts Ray's own processes (fork + exec) from this process, where JAX's threads already run.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
LAYOUT = ["--set", "parallel.mesh=2x2x2", "--set", "parallel.zero=0"]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_two_meshtrain_processes_on_ray(local_ray, tmp_path, reference_run):
    out = tmp_path / "run"
    results = launch(2, ["--config", TINY, "--devices", "4", *LAYOUT, "--out", str(out), "--heartbeat-timeout", "10"],
                     strategy="PACK")
    assert [(r["process"], r["code"]) for r in results] == [(0, 0), (1, 0)], results
    # Only process 0 logs; its losses are the one-device run's (tests/test_parity.py's tolerance).
    assert any(line.startswith("step      5  loss") for line in results[0]["tail"])
    assert not any(line.startswith("step ") for line in results[1]["tail"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([r["loss"] for r in records if "loss" in r], reference_run[1], rtol=1e-5, atol=0)
    assert (out / "checkpoints" / "5").is_dir()
    assert "on 8 x cpu (cpu), 2 process(es)" in (out / "config.yaml").read_text().splitlines()[0]


def test_a_failed_process_fails_the_launch(local_ray, tmp_path, capsys):
    results = launch(2, ["--config", TINY, "--devices", "4", "--set", "optim.lrr=1", "--out", str(tmp_path / "run")],
                     strategy="PACK")
    assert [r["code"] for r in results] == [2, 2]
    assert summarize(results, 1.0) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: process 0 of 2 failed (exit 2): error: unknown config key 'optim.lrr'")
    assert len(err) == 2 and not (tmp_path / "run").exists()


def test_launcher_flags_are_checked_before_ray_starts(capsys, monkeypatch):
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    assert main(["--nodes", "2", "--config", TINY]) == 2
    assert main(["--nodes", "2", "--", "--config", TINY, "--process-id", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: pass the meshtrain.train arguments after --, e.g. ... --nodes 2 -- --config configs/tiny.yaml",
        "error: --process-id is set by the launcher for each process; leave it out of the meshtrain arguments"]
