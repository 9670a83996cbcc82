"""Host memory of a checkpoint save and restore stays within 0.25 x S + 200 MB (issue 42, section 3):
benchmarks/checkpoint_memory.py at S = 256 MB, each case in a fresh process so its RSS is its own.
At this size the bound is 264 MB, and the checksums' whole-state temporaries it guards against
added S to the save and 1.4 S to a restore."""
import importlib.util

from conftest import ROOT

spec = importlib.util.spec_from_file_location("checkpoint_memory", ROOT / "benchmarks" / "checkpoint_memory.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

SIZE = 256 * bench.MB


def test_save_and_restore_add_at_most_a_quarter_of_the_state(tmp_path):
    rows = bench.measure(SIZE, 8, 4, tmp_path)
    assert [r["case"] for r in rows] == ["save", "restore, same mesh", "restore, 4 devices"]
    for r in rows:
        assert 0.8 * SIZE < r["state_bytes"] < 1.25 * SIZE, r
        assert r["added"] <= bench.bound(r["state_bytes"]), bench.table(rows)
    assert rows[2]["devices"] == 4
