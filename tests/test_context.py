"""Long sequences: context parallelism (the sequence split over `context`, ring attention, each
device an early and a late chunk) and Megatron sequence parallelism (norms and residuals split over
`tensor`) compute the single-device run (fp32), and change the compiled program as they claim."""
import jax
import numpy as np
import pytest
from conftest import max_param_diff, run_tiny, tiny_config

from meshtrain.config.loader import UserError
from meshtrain.engine.program import TrainProgram
from meshtrain.planner import hlo

LAYOUTS = [
    ("data=4,context=2", False),
    ("data=2,context=4", False),
    ("fsdp=2,tensor=2,context=2", False),
    ("data=2,context=2,pipeline=2", False),
    ("data=4,tensor=2", True),
    ("tensor=2,context=2,data=2", True),
]


@pytest.mark.parametrize("mesh,sequence_parallel", LAYOUTS)
def test_layout_matches_single_device(mesh, sequence_parallel, reference_run):
    _, ref_losses, ref_params = reference_run
    _, losses, params = run_tiny(f"parallel.mesh={mesh}", "parallel.attention=ring",
                                 f"parallel.sequence_parallel={sequence_parallel}")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    assert max_param_diff(params, ref_params) < 1e-5


def compiled(*overrides):
    return TrainProgram.from_config(tiny_config(*overrides)).lower().compile()


def collectives(*overrides):
    return hlo.collectives(compiled(*overrides).as_text(), 8)


def test_ring_attention_passes_keys_and_values_around():
    found = collectives("parallel.mesh=data=2,context=4", "parallel.attention=ring")
    # 4 layers x 3 sends per ring step (forward K/V, backward K/V and their gradients) at least
    assert found["collective-permute"]["count"] >= 4 * 3 * 3


def test_sequence_parallel_splits_the_residual_stream():
    """The norms and residuals are split over tensor: fewer temporary bytes, and the sequence is
    all-gathered before the matmuls. (XLA's CPU backend lowers the matching reduce-scatter as an
    all-reduce and a slice, so the all-reduces remain here; GPUs get reduce-scatters.)"""
    plain = compiled("parallel.mesh=data=4,tensor=2")
    split = compiled("parallel.mesh=data=4,tensor=2", "parallel.sequence_parallel=true")
    assert split.memory_analysis().temp_size_in_bytes < 0.95 * plain.memory_analysis().temp_size_in_bytes
    gathers = lambda c: hlo.collectives(c.as_text(), 8)["all-gather"]["count"]
    assert gathers(split) > gathers(plain)


@pytest.mark.parametrize("overrides,message", [
    (("parallel.mesh=data=4,context=2", "parallel.attention=xla"),  # auto, the default, takes the ring
     "mesh context=2 splits the sequence.*set parallel.attention=ring"),
    (("parallel.mesh=data=2,context=4", "parallel.attention=ring", "train.seq_len=12"),
     r"train.seq_len=12 is not divisible by 2 x context \(8\)"),
])
def test_context_layout_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        TrainProgram.from_config(tiny_config(*overrides))


def test_context_parallel_activation_memory_shrinks():
    """Same batch (2 sequences of 256) on data=2 x context=C devices: the compiled step's temporaries
    per device fall as C grows."""
    def temp(c):
        cfg = tiny_config(f"parallel.mesh=data=2,context={c}", "parallel.attention=ring", "train.seq_len=256",
                          "train.batch_size=2")
        program = TrainProgram.from_config(cfg, devices=jax.devices()[:2 * c])
        return program.lower().compile().memory_analysis().temp_size_in_bytes

    temps = [temp(c) for c in (1, 2, 4)]
    assert temps[0] > 1.5 * temps[1] > 2.25 * temps[2], temps
