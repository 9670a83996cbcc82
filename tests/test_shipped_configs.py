"""Every shipped config on the pod its comment documents (`# pod: --devices N`, the mesh its own
parallel.mesh): the planner's one verdict for the run (train step, eval step, generation, each
compiled for the pod's mesh on simulated CPU devices) FITS the memory the runtime can use, with its
margin, and the collective traffic it prints matches its formula per kind (or the plan flags the
kind). One plan per config, in a subprocess with the pod's device count. A config that keeps its
layers' parameters in host memory (parallel.offload=optimizer+params) is planned by XLA's GPU compiler
for an H100: XLA:CPU holds host and device arrays in one memory, so only the GPU program separates them."""
import json
import subprocess
import sys

import jax
import pytest
from conftest import ROOT

from meshtrain.config.loader import documented_pod, load_config
from meshtrain.parallel.mesh import parse_mesh
from meshtrain.plan import main as plan_main
from meshtrain.planner import compilers, traffic

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def plan(config, capsys) -> dict:
    """The plan's JSON: in this process when the pod has this process's 8 simulated devices, else
    in a subprocess with the pod's device count."""
    gpu = load_config(str(config)).parallel.offload == "optimizer+params"
    if gpu and (missing := compilers.gpu_compiler_missing()):
        pytest.skip(missing)
    argv = ["--config", str(config.relative_to(ROOT)), *documented_pod(config), "--json", "--search-budget", "0",
            # the pods by XLA:CPU: 8-15 s each here, 30-100 s by the GPU compiler
            *(("--compiler", "gpu", "--device", "h100") if gpu else ("--compiler", "cpu"))]
    if argv[argv.index("--devices") + 1] == str(len(jax.devices())):
        capsys.readouterr()
        assert plan_main(argv) in (0, None)
        return json.loads(capsys.readouterr().out)
    done = subprocess.run([sys.executable, "-m", "meshtrain.plan", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_shipped_config_fits_its_pod(config, capsys):
    report = plan(config, capsys)
    verdict, steps = report["verdict"], report["steps"]
    assert verdict["status"] == "fits" and verdict["margin"] >= 0, (verdict, steps)
    assert verdict["peak"] == max(steps.values()) <= report["budget"]["budget"]
    assert steps["eval"] <= steps["train"]  # the train step's microbatches, forward only, beside its optimizer state
    assert 0 < report["generation"]["kv_cache_formula"] < steps["generation"]
    for kind, c in report["collectives"].items():  # within 10% of the formula, or flagged with its reason
        assert c["within"] or (c["flag"] and "roofline uses the measured" in c["flag"]
                               and traffic.UNEXPLAINED not in c["flag"]), (kind, c["ratio"], c["flag"])


@pytest.mark.fast
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_the_mesh_is_in_one_place(config):
    """A pod config's mesh is its parallel.mesh, which makes the pod's mesh from the comment's
    --devices alone; a CPU-scale config keeps data=-1 (it trains on any device count) and its comment
    names the mesh its pod is planned on."""
    flags, cfg = documented_pod(config), load_config(str(config))
    devices = int(flags[flags.index("--devices") + 1])
    if "--mesh" in flags:
        assert cfg.parallel.mesh == "data=-1" and len(flags) == 4, flags
    else:
        assert flags == ["--devices", str(devices)] and parse_mesh(cfg.parallel.mesh, devices)
