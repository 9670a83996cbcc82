"""A checkpoint saved on one expert or context layout resumes on another (elastic), with another
attention backend and remat policy, and continues the uninterrupted single-device run (fp32)."""
import jax
import numpy as np
import pytest
from conftest import MOE_TINY, TINY, run_tiny, tiny_config

from meshtrain.run.loggers import MetricsLog
from meshtrain.run.trainer import Trainer

CASES = [
    (MOE_TINY, ("parallel.mesh=data=2,expert=4",), ("parallel.mesh=expert=2,data=2,fsdp=2", "parallel.remat=full")),
    (TINY, ("parallel.mesh=data=2,context=4", "parallel.attention=ring"),
     ("parallel.mesh=fsdp=4,tensor=2", "parallel.attention=xla", "parallel.remat=save_matmuls")),
]


@pytest.mark.parametrize("config,first,second", CASES, ids=["expert", "context"])
def test_resume_on_another_layout_continues_the_run(config, first, second, tmp_path):
    quiet = lambda trainer, steps: trainer.fit(steps, log=MetricsLog(tmp_path, primary=False))
    _, reference, _ = run_tiny("parallel.mesh=1", devices=jax.devices()[:1], config=config)
    saved = Trainer(tiny_config(*first, out=str(tmp_path), config=config))
    head = quiet(saved, 2)  # its final save: step 2
    resumed = Trainer(tiny_config(*second, "checkpoint.resume=auto", out=str(tmp_path), config=config))
    assert resumed.resumed_from == tmp_path / "checkpoints" / "2"
    tail = quiet(resumed, len(reference))
    losses = [r["loss"] for r in head + tail if "loss" in r]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
