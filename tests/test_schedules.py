"""The pipeline schedules' registry (meshtrain/parallel/schedules.py SCHEDULES): each entry's bubble
formula in words against its terms, which entries split the weight gradient or interleave, and the
one-line error for a name it does not hold. (The timetables themselves: tests/test_pipeline.py.)"""
import re

import pytest

from meshtrain.core.errors import UserError
from meshtrain.parallel.schedules import SCHEDULES, Schedule, check, check_residuals, gpipe_order, lookup, timetable

pytestmark = pytest.mark.fast  # the quick tier (python -m pytest -m fast)

SIZES = [(2, 2, 1), (2, 4, 1), (4, 8, 1), (4, 32, 1), (8, 16, 1), (4, 8, 2), (4, 12, 3), (8, 16, 4)]


def evaluate(expression: str, S: int, M: int, V: int) -> float:
    """A bubble formula as the planner prints it, e.g. (S-1)/(3M+S-1), evaluated."""
    python = re.sub(r"(\d)([SMV])", r"\1*\2", expression)  # 3M -> 3*M
    assert set(python) <= set("SMV0123456789+-*/() "), expression
    return eval(python, {}, {"S": S, "M": M, "V": V})


def test_registry_holds_the_four_schedules_by_name():
    assert list(SCHEDULES) == ["gpipe", "1f1b", "interleaved", "zb"]
    assert all(name == s.name and lookup(name) is s for name, s in SCHEDULES.items())


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("S,M,V", SIZES)
def test_bubble_formula_in_words_is_the_bubble_terms(name, S, M, V):
    schedule = SCHEDULES[name]
    idle, total = schedule.bubble_terms(S, M, V)
    assert idle == S - 1 and schedule.bubble(S, M, V) == idle / total
    assert evaluate(schedule.bubble_expression, S, M, V) == pytest.approx(idle / total, abs=1e-15)


def test_the_formulas_as_published():
    """Narayanan et al. 2021 (eq. 1-2) for GPipe, 1F1B and interleaved; ZB-H1 for zb."""
    assert [SCHEDULES[n].bubble_terms(4, 8, 1) for n in ("gpipe", "1f1b", "zb")] == [(3, 11), (3, 11), (3, 27)]
    assert SCHEDULES["interleaved"].bubble_terms(4, 8, 2) == (3, 19)


def test_only_zb_splits_the_weight_gradient_and_only_interleaved_interleaves():
    assert [n for n, s in SCHEDULES.items() if s.splits_weight_grad] == ["zb"]
    assert [n for n, s in SCHEDULES.items() if s.interleaved] == ["interleaved"]
    assert SCHEDULES["zb"].action_costs() == {"F": 1, "B": 1, "W": 1}
    for name in ("gpipe", "1f1b", "interleaved"):
        assert SCHEDULES[name].action_costs() == {"F": 1, "B": 2, "W": 0}
        assert SCHEDULES[name].action_costs("recompute") == {"F": 1, "B": 3, "W": 0}  # the forward again
    with pytest.raises(UserError, match="parallel.schedule=zb needs parallel.residuals=save"):
        check_residuals("zb", "recompute", "none")
    with pytest.raises(UserError, match="parallel.schedule=interleaved needs parallel.virtual_stages >= 2"):
        check("interleaved", 4, 8, 1)
    with pytest.raises(UserError, match="parallel.virtual_stages=2 needs parallel.schedule=interleaved"):
        check("1f1b", 4, 8, 2)


def test_an_unknown_name_is_one_line_naming_the_schedules():
    with pytest.raises(UserError) as e:
        lookup("pipedream")
    assert str(e.value) == "parallel.schedule='pipedream' is not one of gpipe, 1f1b, interleaved, zb"
    with pytest.raises(UserError, match="is not one of gpipe, 1f1b, interleaved, zb"):
        timetable("pipedream", 4, 8)


def test_an_entry_is_all_a_schedule_needs():
    """A schedule outside the registry times like one inside it: nothing else asks its name."""
    twin = Schedule(name="gpipe-twin", order=gpipe_order, costs={"F": 1, "B": 2, "W": 0},
                    bubble_terms=lambda S, M, V: (S - 1, M + S - 1), bubble_expression="(S-1)/(M+S-1)")
    assert lookup(twin) is twin
    mine, theirs = timetable(twin, 4, 8), timetable("gpipe", 4, 8)
    assert mine.ticks == theirs.ticks and mine.bubble == theirs.bubble == mine.bubble_formula
