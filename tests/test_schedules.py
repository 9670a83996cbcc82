"""The pipeline schedules' registry (meshtrain/parallel/schedules.py SCHEDULES): each entry's bubble
formula in words against its terms, which entries split the weight gradient or interleave, the one-line
error for a name it does not hold, and DualPipeV's V placement and lockstep idle. (The timetables
themselves: tests/test_pipeline.py.)"""
import re

import pytest

from meshtrain.core.errors import UserError
from meshtrain.parallel.schedules import (
    SCHEDULES,
    Schedule,
    check,
    check_residuals,
    device_of,
    dualpipev_order,
    gpipe_order,
    lookup,
    model_stage,
    timetable,
)
from meshtrain.parallel.tick_tables import executor_tables

pytestmark = pytest.mark.fast  # the quick tier (python -m pytest -m fast)

SIZES = [(2, 2, 1), (2, 4, 1), (4, 8, 1), (4, 32, 1), (8, 16, 1), (4, 8, 2), (4, 12, 3), (8, 16, 4)]


def evaluate(expression: str, S: int, M: int, V: int) -> float:
    """A bubble formula as the planner prints it, e.g. (S-1)/(3M+S-1), evaluated."""
    python = re.sub(r"(\d)([SMV])", r"\1*\2", expression)  # 3M -> 3*M
    assert set(python) <= set("SMV0123456789+-*/() "), expression
    return eval(python, {}, {"S": S, "M": M, "V": V})


def test_registry_holds_the_five_schedules_by_name():
    assert list(SCHEDULES) == ["gpipe", "1f1b", "interleaved", "zb", "dualpipev"]
    assert all(name == s.name and lookup(name) is s for name, s in SCHEDULES.items())


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("S,M,V", SIZES)
def test_bubble_formula_in_words_is_the_bubble_terms(name, S, M, V):
    schedule = SCHEDULES[name]
    idle, total = schedule.bubble_terms(S, M, V)
    assert idle == (5 * S - 8 if name == "dualpipev" else S - 1) and schedule.bubble(S, M, V) == idle / total
    assert evaluate(schedule.bubble_expression, S, M, V) == pytest.approx(idle / total, abs=1e-15)


def test_the_formulas_as_published():
    """Narayanan et al. 2021 (eq. 1-2) for GPipe, 1F1B and interleaved; ZB-H1 for zb."""
    assert [SCHEDULES[n].bubble_terms(4, 8, 1) for n in ("gpipe", "1f1b", "zb")] == [(3, 11), (3, 11), (3, 27)]
    assert SCHEDULES["interleaved"].bubble_terms(4, 8, 2) == (3, 19)


def test_zb_and_dualpipev_split_the_weight_gradient_and_only_interleaved_interleaves():
    assert [n for n, s in SCHEDULES.items() if s.splits_weight_grad] == ["zb", "dualpipev"]
    assert [n for n, s in SCHEDULES.items() if s.interleaved] == ["interleaved"]
    assert [(n, s.placement, s.chunks) for n, s in SCHEDULES.items() if s.chunks] == [("dualpipev", "v", 2)]
    assert SCHEDULES["zb"].action_costs() == SCHEDULES["dualpipev"].action_costs() == {"F": 1, "B": 1, "W": 1}
    for name in ("gpipe", "1f1b", "interleaved"):
        assert SCHEDULES[name].action_costs() == {"F": 1, "B": 2, "W": 0}
        assert SCHEDULES[name].action_costs("recompute") == {"F": 1, "B": 3, "W": 0}  # the forward again
    with pytest.raises(UserError, match="parallel.schedule=zb needs parallel.residuals=save"):
        check_residuals("zb", "recompute", "none")
    with pytest.raises(UserError, match="parallel.schedule=interleaved needs parallel.virtual_stages >= 2"):
        check("interleaved", 4, 8, 1)
    with pytest.raises(UserError, match="parallel.virtual_stages=2 needs parallel.schedule=interleaved, dualpipev"):
        check("1f1b", 4, 8, 2)
    with pytest.raises(UserError, match="places 2 chunks of layers on each stage: set parallel.virtual_stages=2"):
        check("dualpipev", 4, 8, 3)
    with pytest.raises(UserError, match=r"parallel.microbatches \(6\) >= twice the pipeline size \(8\)"):
        check("dualpipev", 4, 6, 2)


def test_an_unknown_name_is_one_line_naming_the_schedules():
    with pytest.raises(UserError) as e:
        lookup("pipedream")
    assert str(e.value) == "parallel.schedule='pipedream' is not one of gpipe, 1f1b, interleaved, zb, dualpipev"
    with pytest.raises(UserError, match="is not one of gpipe, 1f1b, interleaved, zb, dualpipev"):
        timetable("pipedream", 4, 8)


def test_an_entry_is_all_a_schedule_needs():
    """A schedule outside the registry times like one inside it: nothing else asks its name."""
    twin = Schedule(name="gpipe-twin", order=gpipe_order, costs={"F": 1, "B": 2, "W": 0},
                    bubble_terms=lambda S, M, V: (S - 1, M + S - 1), bubble_expression="(S-1)/(M+S-1)")
    assert lookup(twin) is twin
    mine, theirs = timetable(twin, 4, 8), timetable("gpipe", 4, 8)
    assert mine.ticks == theirs.ticks and mine.bubble == theirs.bubble == mine.bubble_formula


def test_the_v_placement_holds_model_stages_s_and_2s_minus_1_minus_s():
    """DualPipeV's V: stage s holds model stages s (chunk 0) and 2S-1-s (chunk 1), so the first stage
    both embeds and applies the head, and the turn (model stages S-1 and S) is on the last device;
    `device_of` inverts `model_stage` for both placements."""
    for S in (2, 4, 8):
        assert [[model_stage("v", s, v, S) for v in (0, 1)] for s in range(S)] == [[s, 2 * S - 1 - s] for s in range(S)]
        for placement, V in (("v", 2), ("circular", 3)):
            assert all(device_of(placement, model_stage(placement, s, v, S), S) == (s, v)
                       for s in range(S) for v in range(V))
    assert device_of("v", 7, 4) == (0, 1) and device_of("circular", 7, 4) == (3, 1)


@pytest.mark.parametrize("S", [2, 3, 4, 5, 6])
def test_dualpipev_idles_its_formula_for_every_microbatch_count(S):
    """The lockstep timetable of `dualpipev_order`: 6M units of work per stage and 5S-8 idle, for
    M from 2S up; its steady ticks pair a forward of one chunk with the full backward of the other
    (different microbatches) on every stage; every W is the order's own; the residuals in flight
    (2S+1 chunks, each half a device's layers) stay under 1F1B's 2S-1 whole ones, while the
    executor's buffers hold 2S slots for each of the two chunks (docs/pipeline.md says so)."""
    for M in range(2 * S, 2 * S + 6):
        tt = timetable("dualpipev", S, M, 2)
        assert tt.time == 6 * M + 5 * S - 8 and tt.bubble == pytest.approx(tt.bubble_formula, abs=1e-12)
        assert max(tt.in_flight()) == 2 * S + 1 < 2 * (2 * S - 1)
        for s in range(S):
            paired = [row[s] for row in tt.ticks if {a.kind for a in row[s]} == {"F", "B", "W"}]
            assert len(paired) >= 2 * (M - 2 * S + s + 1) - (s == S - 1)  # the main step's, but the turn's first
            assert all(f.chunk != b.chunk and f.micro != b.micro and b.micro == w.micro for f, b, w in paired)
        assert int(executor_tables(tt)["residual_slots"]) == 2 * S
    orders = [dualpipev_order(S, 2 * S, s) for s in range(S)]
    assert all(sum(a.kind == "W" for slot in order for a in slot) == 2 * 2 * S for order in orders)
