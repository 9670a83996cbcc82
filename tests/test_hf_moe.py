"""MoE runs trained on an expert mesh go to Hugging Face intact (issue 41, section 3): a Mixtral-form,
a Qwen3-MoE and a DeepSeek-V3 run (its selection biases moving: aux-loss-free balancing) trained on
data=2,expert=4 and on fsdp=2,expert=4 with ZeRO-3 export with `convert --to-hf`; transformers loads
every expert of every layer and its logits equal meshtrain's on the same tokens; importing the export
gives back the trained parameters bitwise. The same after a resume onto another expert count
(expert=2), for Qwen3-MoE and DeepSeek-V3. benchmarks/hf_parity.py --expert-mesh prints the figures."""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from meshtrain.interop import hf  # noqa: E402
from meshtrain.testing import (  # noqa: E402
    MOE_EXPORT_FAMILIES,
    MOE_EXPORT_LAYOUTS,
    MOE_RESUMED_FAMILIES,
    MOE_RESUMED_ON,
    hf_export_parity,
    trained_run,
)

TOKENS = np.random.default_rng(1).integers(0, 256, (2, 24))


def check_export(trainer, folder) -> None:
    """transformers' logits of the export equal meshtrain's; its import equals the trained parameters."""
    logit_diff, _, param_diff = hf_export_parity(trainer, folder, TOKENS)
    assert logit_diff <= 1e-5 and param_diff == 0, (logit_diff, param_diff)  # measured <= 5e-7; largest logit ~0.4


@pytest.mark.parametrize("layout", MOE_EXPORT_LAYOUTS)
@pytest.mark.parametrize("family", MOE_EXPORT_FAMILIES)
def test_a_run_trained_on_an_expert_mesh_exports_intact(tmp_path, family, layout):
    config, model_overrides = MOE_EXPORT_FAMILIES[family]
    trainer = trained_run(tmp_path / "run", config, (*model_overrides, *MOE_EXPORT_LAYOUTS[layout]), steps=2)
    check_export(trainer, tmp_path / "hf")
    assert hf.read_spec(tmp_path / "hf").family == trainer.program.model.cfg.family


@pytest.mark.parametrize("family", MOE_RESUMED_FAMILIES)
def test_a_run_resumed_on_another_expert_count_exports_intact(tmp_path, family):
    config, model_overrides = MOE_EXPORT_FAMILIES[family]
    trained_run(tmp_path / "run", config, (*model_overrides, *MOE_EXPORT_LAYOUTS["data=2,expert=4"]), steps=2)
    resumed = trained_run(tmp_path / "run", config, (*model_overrides, MOE_RESUMED_ON), steps=3, resume=True)
    assert resumed.resumed_from == tmp_path / "run" / "checkpoints" / "2"
    check_export(resumed, tmp_path / "hf")
