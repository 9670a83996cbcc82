"""The planner's reading of a pipeline's ticks (meshtrain/planner/ticks.py): which branches each stage
takes at each tick, from the executor's tables; on the GPU program, a device's kernels and collectives as
its stages' mean (the formulas' figures) and each tick priced at its slowest stage."""
import re

import jax
import pytest
from conftest import MOE_TINY, TINY, tiny_config

from meshtrain.core import compile_cache
from meshtrain.core.errors import UserError
from meshtrain.core.metrics import DEVICE_PROFILES
from meshtrain.engine.program import TrainProgram
from meshtrain.parallel.schedules import SCHEDULES, device_of, lookup, timetable
from meshtrain.parallel.tick_tables import executor_tables
from meshtrain.planner import compilers, hlo, kernel_time, kernels, ticks, traffic

MICRO = 4


def program_of(schedule: str, devices=None, micro: int = MICRO, *more):
    virtual = 2 if lookup(schedule).interleaved or lookup(schedule).chunks else 1
    cfg = tiny_config("parallel.mesh=fsdp=2,pipeline=2", f"parallel.schedule={schedule}",
                      f"parallel.microbatches={micro}", f"parallel.virtual_stages={virtual}", *more, config=TINY)
    return TrainProgram.from_config(cfg, devices=devices)


@pytest.mark.fast
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_stage_runs_each_microbatch_once_and_the_embedding_and_head_on_their_stages(schedule):
    program = program_of(schedule, jax.devices()[:4])
    plan, S, V = ticks.tick_plan(program), 2, program.plan.virtual_stages
    cells = [cell for phase in plan.values() for row in phase for cell in row]
    assert list(plan) == [f"ticks_train{i}" for i in range(len(plan))] and len(cells) % S == 0
    per_stage = lambda tag: [sum(tag in row[s] for phase in plan.values() for row in phase) for s in range(S)]
    assert per_stage("F") == per_stage("B") == [MICRO * V] * S
    assert per_stage("W") == ([MICRO * V] * S if lookup(schedule).splits_weight_grad else [0] * S)
    placement = lookup(schedule).placement
    for tag, model_stage in (("first", 0), ("last", S * V - 1)):
        stage = device_of(placement, model_stage, S)[0]
        for kind in ("F", "B"):
            assert per_stage(f"{kind}/{tag}") == [MICRO if s == stage else 0 for s in range(S)], (kind, tag)


def test_the_gpu_program_of_a_pipeline_is_read_as_its_stages_mean_and_priced_at_its_slowest_stage():
    """tiny on fsdp=2,pipeline=2 in 4 microbatches (1F1B) on 4 compile-only H100s: read through each
    stage's branches, a device runs cuDNN's backward attention once per microbatch and layer of its stage
    (read as if every branch ran: more), and its gathers, reduce-scatters and sends move their formulas'
    bytes (the table gathered and reduced on the stage that embeds, the head on the one that applies
    it); the walk prices each tick at its slowest stage, the wait apart from the collectives."""
    if (missing := compilers.gpu_compiler_missing()) is not None:
        pytest.skip(missing)
    sets = ("parallel.precision=bf16", "model.head_dim=64", "train.seq_len=128", "train.batch_size=8")
    devices = compilers.choose("gpu", "h100", 4, 8).devices
    program = program_of("1f1b", devices, MICRO, *sets)
    with compile_cache.suspended():  # a GPU program: JAX could not load it back (tests/test_gpu_compile.py)
        text, plan = program.lower().compile().as_text(), ticks.tick_plan(program)
    layers = program.model.cfg.num_layers // 2
    # the residuals' ring buffer [slots + 1, V, layers, ...] is written after the actions' conditionals: no
    # branch copies it (XLA:GPU copied its leaves 32 times in each of three branches before; engine/stage_state.py)
    slots = executor_tables(timetable("1f1b", 2, MICRO))["residual_slots"]
    rings = [[str(n), "1", str(layers)] for n in (slots, slots + 1)]  # [slots (+ the spare one), V, layers, ...]
    module = hlo.Module(text)
    in_branches = {b for comp in module.comps.values() for ins in comp.values() if ins.op == "conditional"
                   for b in ticks.branches(ins.line)}
    copied = [ins.line for b in in_branches for ins in module.comps[b].values()
              if ins.op == "copy" and ins.shape.split("[")[1].split(",")[:3] in rings]
    assert not copied, copied[:2]
    assert kernels.read(text, tick_plan=plan)["attention"]["backward"] == MICRO * layers
    assert kernels.read(text)["attention"]["backward"] > MICRO * layers  # every branch as if taken

    measured = hlo.by_kind(hlo.read(text, 4, correct=False, tick_plan=plan))
    expected = traffic.expected_traffic(program)
    for kind in ("all-gather", "reduce-scatter", "collective-permute"):
        assert measured[kind]["traffic_bytes"] == pytest.approx(expected[kind]["traffic_bytes"], rel=0.1), kind

    h100 = DEVICE_PROFILES["h100"]
    link_s = kernel_time.link_seconds(hlo.read(text, 4, correct=False, tick_plan=plan), program.sizes, h100, 8)
    walked = kernel_time.step_time(text, h100, link_s, plan)
    assert walked["pipeline_wait_s"] > 0.05 * walked["step_s"]  # 1F1B's warm-up and cool-down; the head's stage
    assert walked["step_s"] == pytest.approx(walked["kernels_s"] + walked["exposed_comm_s"]
                                             + walked["pipeline_wait_s"], rel=1e-9)
    # a tick lasts as long as its slowest stage: the step is at least each stage's own, walked as if every
    # stage ran its cells (its column of each phase), and the mean of each conditional's branches is less
    for stage in range(2):
        alone = {name: tuple(tuple(row[stage] for _ in row) for row in cells) for name, cells in plan.items()}
        assert walked["step_s"] >= kernel_time.step_time(text, h100, link_s, alone)["step_s"]
    assert kernel_time.step_time(text, h100, link_s)["step_s"] < walked["step_s"]
    with pytest.raises(UserError, match="no tick names"):  # an executable cached before the executor named them
        ticks.check_named(plan, text.replace("ticks_train", "scan"))
    other = ticks.tick_plan(program_of("1f1b", devices, MICRO // 2, *sets))  # another program's ticks
    with pytest.raises(ValueError, match="ticks_train"):
        kernel_time.step_time(text, h100, link_s, other)


def test_on_the_gpu_program_dualpipev_pairs_forward_and_backward_and_its_w_moves_no_all_to_all_again():
    """moe_tiny on pipeline=2,expert=2 under dualpipev (8 layers: 2 a chunk), 4 microbatches, on 4
    compile-only H100s: a steady tick's F and B are one branch (`act_pair`), which runs both actions'
    ragged all-to-alls (F's alone and B's alone: the other branches') in one loop over the layers (layer i's
    forward beside layer 1 - i's backward: two loops one after the other would not overlap), so XLA's
    scheduler can hide one's under the other's compute; the experts' grouped matmuls are the Triton
    kernels, so W takes the experts' stash from B's part of their shard_map
    (meshtrain/engine/split_backward.py) and the all-to-alls are the formula's 4 a MoE layer (W rerunning
    the pullback moved 1.5x)."""
    if (missing := compilers.gpu_compiler_missing()) is not None:
        pytest.skip(missing)
    cfg = tiny_config("parallel.mesh=pipeline=2,expert=2", "model.num_layers=8", "parallel.schedule=dualpipev",
                      "parallel.virtual_stages=2", f"parallel.microbatches={MICRO}", config=MOE_TINY)
    program = TrainProgram.from_config(cfg, devices=compilers.choose("gpu", "h100", 4, 8).devices)
    with compile_cache.suspended():
        text, plan = program.lower().compile().as_text(), ticks.tick_plan(program)
    module = hlo.Module(text)

    def ragged(comp: str) -> int:  # ragged all-to-alls started in a computation and what it calls
        return sum(ins.op == "ragged-all-to-all-start" or sum(ragged(c) for c in callees(ins))
                   for ins in module.comps[comp].values())

    def callees(ins) -> list[str]:
        found = re.findall(r"(?:to_apply|calls|body)=%?([\w.\-]+)", ins.line)
        return found + (ticks.branches(ins.line) if ins.op == "conditional" else [])

    switch = next(ins for comp in module.comps.values() for ins in comp.values()
                  if ins.op == "conditional" and "/tick_FB/cond\"" in ins.line)
    idle, f_only, b_only, paired = (ragged(b) for b in ticks.branches(switch.line))
    assert idle == 0 and f_only > 0 and b_only > 0 and paired == f_only + b_only

    def instructions(comp: str):  # a computation's instructions and those of what it calls
        for ins in module.comps[comp].values():
            yield ins
            for callee in callees(ins):
                yield from instructions(callee)

    loops = [re.search(r"body=%?([\w.\-]+)", ins.line).group(1)
             for ins in instructions(ticks.branches(switch.line)[3]) if ins.op == "while"]
    assert max(ragged(body) for body in loops) == paired  # one loop holds F's and B's
    measured = hlo.by_kind(hlo.read(text, 4, correct=False, tick_plan=plan))["all-to-all"]["traffic_bytes"]
    assert measured == pytest.approx(traffic.expected_traffic(program)["all-to-all"]["traffic_bytes"], rel=0.05)
