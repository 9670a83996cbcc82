"""MoE runs trained on an expert mesh go to Hugging Face intact (issue 41, section 3): a Mixtral-form
and a Qwen3-MoE run trained on data=2,expert=4 and on fsdp=2,expert=4 with ZeRO-3 export with
`convert --to-hf`; transformers loads every expert of every layer and its logits equal meshtrain's on
the same tokens; importing the export gives back the trained parameters bitwise. The same after a
resume onto another expert count (expert=2)."""
import jax
import numpy as np
import pytest
from conftest import MOE_TINY, ROOT, tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from meshtrain import convert  # noqa: E402
from meshtrain.interop import hf  # noqa: E402
from meshtrain.models import FAMILIES  # noqa: E402
from meshtrain.parallel.mesh import build_mesh, parse_mesh  # noqa: E402
from meshtrain.parallel.sharding import param_shardings  # noqa: E402
from meshtrain.run.loggers import MetricsLog  # noqa: E402
from meshtrain.run.trainer import Trainer  # noqa: E402
from meshtrain.testing import max_param_diff  # noqa: E402

QWEN3_MOE_TINY = str(ROOT / "configs" / "qwen3_moe_tiny.yaml")
FAMILIES_UNDER_TEST = {"mixtral": (MOE_TINY, ("model.num_shared_experts=0",)), "qwen3_moe": (QWEN3_MOE_TINY, ())}
LAYOUTS = {"data2_expert4": ("parallel.mesh=data=2,expert=4",),
           "fsdp2_expert4_zero3": ("parallel.mesh=fsdp=2,expert=4", "parallel.zero=3")}
TOKENS = np.random.default_rng(1).integers(0, 256, (2, 24))


def trained(tmp_path, config, overrides, steps, resume=False) -> Trainer:
    trainer = Trainer(tiny_config(*overrides, *(["checkpoint.resume=auto"] if resume else []),
                                  out=str(tmp_path / "run"), config=config))
    trainer.fit(steps, log=MetricsLog(trainer.out, primary=False))  # ends with its save of `steps`
    trainer.checkpointer.wait()
    return trainer


def check_export(trainer: Trainer, folder) -> None:
    """transformers' logits of the export equal meshtrain's; its import equals the trained parameters."""
    convert.to_hf(str(trainer.out), str(folder), "float32", 1 << 30, "fsdp=-1")
    params = jax.device_get(trainer.unpermuted_params())
    ours = np.asarray(trainer.program.model.apply(params, TOKENS))
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = theirs_model(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)  # measured <= 5e-7; the largest logit ~0.4
    spec = hf.read_spec(folder)
    model = FAMILIES[spec.family](spec)
    one = build_mesh(parse_mesh("1", 1), jax.devices()[:1])
    assert max_param_diff(jax.device_get(hf.load_params(folder, model, param_shardings(model, one))), params) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES_UNDER_TEST)
def test_a_run_trained_on_an_expert_mesh_exports_intact(tmp_path, family, layout):
    config, model_overrides = FAMILIES_UNDER_TEST[family]
    trainer = trained(tmp_path, config, (*model_overrides, *LAYOUTS[layout]), steps=2)
    check_export(trainer, tmp_path / "hf")
    assert hf.read_spec(tmp_path / "hf").family == trainer.program.model.cfg.family


def test_a_run_resumed_on_another_expert_count_exports_intact(tmp_path):
    """qwen3_moe's 8 experts: 2 per device on expert=4, then 4 per device on expert=2."""
    config, model_overrides = FAMILIES_UNDER_TEST["qwen3_moe"]
    trained(tmp_path, config, (*model_overrides, *LAYOUTS["data2_expert4"]), steps=2)
    resumed = trained(tmp_path, config, (*model_overrides, "parallel.mesh=expert=2,data=2,fsdp=2"), steps=3,
                      resume=True)
    assert resumed.resumed_from == tmp_path / "run" / "checkpoints" / "2"
    check_export(resumed, tmp_path / "hf")
