"""What a run reports: TensorBoard event files (read back by TensorBoard's own reader), the profile
trace of `--profile`, the console lines and the end-of-run summary, the report of several runs, the
progress bar, device memory, the pipeline drawings, and the one-line errors of bad options."""
import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import TINY, tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshtrain import report
from meshtrain.planner import drawing
from meshtrain.run import dashboards, loggers
from meshtrain.train import main

STEPS, EVAL_EVERY = 6, 3


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def scalars(logdir: Path, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny config through the CLI entry point: 6 steps, evals at 3 and 6, steps 2-4 traced."""
    out = tmp_path_factory.mktemp("observed")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["--config", TINY, "--out", str(out), "--steps", str(STEPS), "--profile", "2:4",
                     "--set", f"train.eval_every={EVAL_EVERY}"])
    assert code == 0, stdout.getvalue()
    return out, stdout.getvalue()


def test_tensorboard_event_files_hold_the_logged_values(run):
    out, _ = run
    logged = records(out)
    train = {r["step"]: r for r in logged if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in logged if "eval_loss" in r}
    assert sorted(train) == list(range(1, STEPS + 1)) and sorted(evals) == [3, 6]
    logdir = out / "tensorboard"
    for tag, key in [("train/loss", "loss"), ("train/grad_norm", "grad_norm"), ("train/lr", "lr"),
                     ("perf/tokens_per_sec", "tokens_per_sec"), ("perf/step_time_s", "step_time_s"),
                     ("guard/skipped_steps", "skipped_steps")]:
        board = scalars(logdir, tag)
        assert sorted(board) == sorted(train), tag
        np.testing.assert_array_equal([board[s] for s in train], np.float32([train[s][key] for s in train]), tag)
    board = scalars(logdir, "eval/loss")
    assert board == {s: float(np.float32(v)) for s, v in evals.items()}


def test_profile_traces_the_window_for_tensorboard_and_perfetto(run):
    out, stdout = run
    traces = list((out / "profile" / "plugins" / "profile").glob("*"))
    assert len(traces) == 1, traces
    assert list(traces[0].glob("*.xplane.pb"))[0].stat().st_size > 0  # TensorBoard's profile plugin
    assert (traces[0] / "perfetto_trace.json.gz").stat().st_size > 0  # ui.perfetto.dev
    assert f"profile of steps 2-4 written to {out / 'profile'}" in stdout
    # tracing's own time (its write: seconds) is kept out of the steps' times: step 4 is no slower than the rest
    # by far (0.25 s: a busy worker's stall on a step of milliseconds)
    times = [r["step_time_s"] for r in records(out) if "loss" in r]
    assert times[3] < 5 * np.median(times[1:]) + 0.25, times


@pytest.mark.fast
def test_console_lines_keep_their_format(run):
    out, stdout = run
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    train = [r for r in records(out) if "loss" in r]
    pattern = re.compile(r"step +(\d+)  loss (\d+\.\d{4})  grad_norm \d+\.\d{3}  lr \S+  tokens/s [\d,]+  "
                         r"step_time [\d.]+ms(  ETA \S+)?$")  # the ETA once warm (loggers.Pace)
    matched = [pattern.match(line) for line in lines if "eval_loss" not in line]
    assert all(matched), lines
    assert [(int(m[1]), m[2]) for m in matched] == [(r["step"], f"{r['loss']:.4f}") for r in train]
    assert [line for line in lines if "eval_loss" in line] == [
        f"step {r['step']:>6}  eval_loss {r['eval_loss']:.4f}" for r in records(out) if "eval_loss" in r]


@pytest.mark.fast
def test_summary_line_names_the_results_and_where_they_are(run):
    out, stdout = run
    summary = stdout.strip().splitlines()[-1]
    logged = records(out)
    train = [r for r in logged if "loss" in r]
    last_eval = [r for r in logged if "eval_loss" in r][-1]
    # tokens / step time over the records, each covering the steps since the one before
    steps = np.diff([0] + [r["step"] for r in train])
    seconds = steps * np.array([r["step_time_s"] for r in train])
    rate = np.sum(seconds * [r["tokens_per_sec"] for r in train]) / np.sum(seconds)
    m = re.fullmatch(r"done: steps 1-6 in ([\d.]+)s; loss (\S+), eval_loss (\S+); ([\d,]+) tokens/s mean; "
                     r"checkpoint (\S+); logs (\S+), (\S+); goodput \d+% \(.+\)", summary)
    assert m, summary
    assert (m[2], m[3]) == (f"{train[-1]['loss']:.4f}", f"{last_eval['eval_loss']:.4f}")
    assert abs(int(m[4].replace(",", "")) - rate) <= 1, (m[4], rate)
    assert m.groups()[4:] == (str(out / "checkpoints" / "6"), str(out / "metrics.jsonl"), str(out / "tensorboard"))
    assert (out / "checkpoints" / "6").is_dir()


@pytest.mark.fast
def test_mean_tokens_per_sec_weighs_each_record_by_its_steps_past_first():
    # a MetricsLog passed to fit twice: the second run's summary counts its own steps only
    earlier = [{"step": s, "loss": 1.0, "tokens_per_sec": 1.0, "step_time_s": 1.0} for s in (1, 2)]
    history = earlier + [{"step": 4, "loss": 1.0, "tokens_per_sec": 100.0, "step_time_s": 1.0},
                         {"step": 4, "eval_loss": 1.0},
                         {"step": 5, "loss": 1.0, "tokens_per_sec": 400.0, "step_time_s": 0.25}]
    # steps 3-4: 2 x 100 tokens in 2 s; step 5: 100 tokens in 0.25 s
    assert loggers.mean_tokens_per_sec(history, first=2) == pytest.approx(300 / 2.25)
    assert loggers.mean_tokens_per_sec(earlier, first=2) is None


@pytest.mark.fast
def test_rewind_and_resume_purge_the_steps_tensorboard_will_see_again(tmp_path):
    """A guard rollback retrains steps: TensorBoard, like metrics.jsonl, then holds each step once,
    with the values of the attempt that counts."""
    log = loggers.MetricsLog(sinks=[loggers.Jsonl(tmp_path, keep_through=0),
                                    dashboards.TensorBoard(tmp_path / "tb", keep_through=0)])
    for step in range(1, 7):
        log.write({"step": step, "loss": float(step)})
    log.rewind(3)
    for step in range(4, 7):
        log.write({"step": step, "loss": 10.0 * step})
    log.close()
    assert scalars(tmp_path / "tb", "train/loss") == {1: 1, 2: 2, 3: 3, 4: 40, 5: 50, 6: 60}
    assert [r["loss"] for r in records(tmp_path)] == [1, 2, 3, 40, 50, 60]
    assert [r["loss"] for r in log.history] == [1, 2, 3, 40, 50, 60]

    resumed = dashboards.TensorBoard(tmp_path / "tb", keep_through=4)  # a run resuming from step 4
    resumed.write({"step": 5, "loss": 7.0})
    resumed.close()
    assert scalars(tmp_path / "tb", "train/loss") == {1: 1, 2: 2, 3: 3, 4: 40, 5: 7}


def test_tensorboardx_loads_without_torch_which_still_imports_after_and_on_other_threads(tmp_path):
    """tensorboardX would import torch where installed (seconds of a run's start) for type hints only:
    a fresh process writes its events with torch never loaded; torch imports as ever afterwards, and
    meanwhile on any other thread."""
    code = """
import sys, threading
from meshtrain.run import dashboards, loggers
finder = dashboards._NoTorchOnThisThread()
elsewhere = []
other = threading.Thread(target=lambda: elsewhere.append(finder.find_spec("torch")))
other.start()
other.join()
assert elsewhere == [None], elsewhere
try:
    finder.find_spec("torch")
    raise AssertionError("torch was not refused on the finder's thread")
except ModuleNotFoundError:
    pass
board = dashboards.TensorBoard(sys.argv[1])
board.write({"step": 1, "loss": 2.5})
board.close()
assert "torch" not in sys.modules and "tensorboardX" in sys.modules
import torch
print("torch", torch.__version__)
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tb")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "torch 2.13.0+cpu"
    assert scalars(tmp_path / "tb", "train/loss") == {1: 2.5}


@pytest.mark.fast
def test_tags_group_the_metrics():
    assert [dashboards.tag(k) for k in ("loss", "eval_loss", "tokens_per_sec", "mfu", "skipped_steps", "loss_scale",
                                     "overflows", "router_aux_loss", "memory_peak_bytes_in_use", "new_metric")] == [
        "train/loss", "eval/loss", "perf/tokens_per_sec", "perf/mfu", "guard/skipped_steps",
        "precision/loss_scale", "precision/overflows", "moe/router_aux_loss", "memory/peak_bytes_in_use",
        "train/new_metric"]
    assert dict(dashboards.scalars({"step": 3, "time": 1.0, "loss": 2.5, "mfu": None, "finite": True})) == {
        "train/loss": 2.5}


@pytest.mark.fast
def test_logging_section_chooses_the_sinks(tmp_path):
    cfg = tiny_config("logging.progress=none", "logging.tensorboard=false", out=str(tmp_path))
    log = loggers.for_run(tmp_path, cfg, True, 0, 5)
    assert [type(s) for s in log.sinks] == [loggers.Jsonl]
    log.close()
    cfg = tiny_config("logging.progress=lines", out=str(tmp_path))
    log = loggers.for_run(tmp_path, cfg, True, 0, 5)
    assert [type(s) for s in log.sinks] == [loggers.Lines, loggers.Jsonl, dashboards.TensorBoard]
    log.close()
    assert loggers.for_run(tmp_path, cfg, False, 0, 5).sinks == []  # only process 0 writes


@pytest.mark.fast
def test_progress_bar_prints_the_lines_above_it():
    from rich.console import Console

    screen = io.StringIO()
    bar = loggers.ProgressBar(0, 10, console=Console(file=screen, force_terminal=True, width=200))
    record = {"step": 5, "loss": 1.87, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_sec": 1000.0, "step_time_s": 0.01}
    bar.write(record)
    assert bar.bar.tasks[0].completed == 5
    bar.rewind(3)
    assert bar.bar.tasks[0].completed == 3
    bar.close()
    assert loggers.format_record(record) in screen.getvalue()
    assert loggers.format_record(record).startswith("step      5  loss 1.8700  grad_norm 0.500")


@pytest.mark.fast
def test_device_memory_is_the_largest_reported_and_absent_where_unreported():
    import jax

    device = lambda stats: SimpleNamespace(memory_stats=lambda: stats)
    devices = [device({"bytes_in_use": 5, "peak_bytes_in_use": 9}), device({"bytes_in_use": 7,
                                                                             "peak_bytes_in_use": 8})]
    assert loggers.device_memory(devices) == {"memory_bytes_in_use": 7, "memory_peak_bytes_in_use": 9}
    assert loggers.device_memory([device(None)]) == {}
    assert loggers.device_memory([device({"bytes_in_use": 5})]) == {}  # the console line shows both or none
    assert loggers.device_memory(jax.devices("cpu")) == {}  # the CPU backend reports none
    line = loggers.format_record({"step": 1, "loss": 1.0, "grad_norm": 1.0, "lr": 0.0, "tokens_per_sec": 1.0,
                                  "step_time_s": 1.0, "memory_bytes_in_use": 2.5e9, "memory_peak_bytes_in_use": 3e9})
    assert line.endswith("memory 2.50 GB (peak 3.00)")


@pytest.mark.fast
def test_report_compares_runs_in_a_png_and_a_table(run, tmp_path, capsys):
    out, _ = run
    other = tmp_path / "other"
    other.mkdir()
    lines = []
    for r in records(out):  # a second run: the same steps, its losses 0.5 lower, half the tokens/s
        r = {k: (v - 0.5 if k in ("loss", "eval_loss") else v / 2 if k == "tokens_per_sec" else v)
             for k, v in r.items()}
        lines.append(json.dumps(r) + "\n")
    (other / "metrics.jsonl").write_text("".join(lines))
    png = tmp_path / "report.png"
    assert report.main([str(out), str(other), "--out", str(png)]) == 0
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[0] >= 300 and image.shape[1] >= 900 and image.shape[2] in (3, 4)
    assert image[..., :3].std() > 0.05  # curves, not a blank canvas
    # each run's curve (matplotlib's colors C0, C1) in each panel: train loss, eval loss, tokens/s
    # (a line some 350 pixels long; the legend's samples hold some 30)
    for panel in np.array_split(image, 3, axis=1):
        assert pixels_of(panel, "#1f77b4") > 100 and pixels_of(panel, "#ff7f0e") > 100, "a curve is missing"
    table = capsys.readouterr().out.splitlines()
    logged = records(out)
    final = [r for r in logged if "loss" in r][-1]["loss"]
    best = min((r for r in logged if "eval_loss" in r), key=lambda r: r["eval_loss"])
    assert table[0].split()[:4] == ["run", "steps", "final", "loss"]
    assert table[1].split()[:5] == [str(out), "6", f"{final:.4f}", f"{best['eval_loss']:.4f}", f"({best['step']})"]
    assert table[2].split()[:4] == [str(other), "6", f"{final - 0.5:.4f}", f"{best['eval_loss'] - 0.5:.4f}"]
    rate = np.median([r["tokens_per_sec"] for r in logged if "loss" in r])  # the median: warm-up aside
    assert [row.split()[-1] for row in table[1:3]] == [f"{rate:,.0f}", f"{rate / 2:,.0f}"]
    assert table[-1] == f"plot written to {png}"


@pytest.mark.fast
def test_report_errors_are_one_line(tmp_path, capsys):
    assert report.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "no metrics.jsonl there" in err
    (tmp_path / "metrics.jsonl").write_text("")
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no training records yet" in err


FIELDS = ("step", "loss", "eval_loss", "tokens_per_sec")


@pytest.mark.fast
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dropped=st.lists(st.tuples(st.integers(0, 7), st.sampled_from(FIELDS)), max_size=10),
       record_keys=st.sets(st.sampled_from(["identity", "starts", "data_files", "data_source"])))
def test_report_shows_what_records_hold_and_names_what_they_lack(tmp_path_factory, dropped, record_keys):
    """Any fields dropped from any records of metrics.jsonl and any sections from run.json: report
    draws and tables what is left, says how many records lack a step or tokens/s, and fails (one
    line) only when no record holds a step and a loss; run twice, its default report.png is replaced."""
    import os

    tmp = tmp_path_factory.mktemp("records")
    records = [{"step": k + 1, "loss": 5.0 - k / 10, "tokens_per_sec": 1000.0 + k, **({"eval_loss": 4.9 - k / 10}
                if k % 4 == 3 else {})} for k in range(8)]
    for k, field in dropped:
        records[k].pop(field, None)
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    start = {"time": 1.0, "step": 0, "devices": 1, "mesh": "data=1", "process_count": 1}
    full = {"identity": {"model": {}, "data": None, "seed": 0, "schedule_steps": 8}, "starts": [start],
            "data_files": [], "data_source": "x"}
    (tmp / "run.json").write_text(json.dumps({k: full[k] for k in record_keys}))
    trains = [r for r in records if "step" in r and "loss" in r]
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        code = report.main([str(tmp)])
        assert code == (0 if trains else 2)
        if not trains:
            return
        assert report.main([str(tmp)]) == 0 and (tmp / "report.png").is_file()  # the default output, replaced
    finally:
        os.chdir(cwd)
    run = report.load_run(str(tmp))
    unplaced = sum("step" not in r for r in records)
    assert (f"{unplaced:,} of 8 records have no numeric step: left out" in run.notes) == bool(unplaced)
    rated = [r for r in trains if "tokens_per_sec" in r]
    assert any("have no tokens_per_sec" in n for n in run.notes) == (len(rated) < len(trains))
    row = report.table([run]).splitlines()[1].split()
    assert row[1] == str(max(r["step"] for r in trains)) and row[-1] == (
        f"{np.median([r['tokens_per_sec'] for r in rated]):,.0f}" if rated else "-")
    assert ("starts" in record_keys) or "run.json has no" in report.goodput_table(run)


@pytest.mark.fast
def test_a_named_report_file_is_protected_and_the_default_replaced(tmp_path, capsys, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "tokens_per_sec": 5.0}) + "\n")
    monkeypatch.chdir(tmp_path)
    assert report.main([str(tmp_path)]) == 0 and report.main([str(tmp_path)]) == 0
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"my own figure")
    assert report.main([str(tmp_path), "--out", str(mine)]) == 2 and mine.read_bytes() == b"my own figure"
    assert f"--out {mine} already exists" in capsys.readouterr().err
    assert report.main([str(tmp_path), "--out", str(mine), "--force"]) == 0


@pytest.mark.fast
@pytest.mark.parametrize("window, says", [("4:2", "1 <= START <= STOP <= 5"), ("two", "pass START:STOP"),
                                          ("2:9", "outside steps 1-5"), ("0:1", "outside steps 1-5")])
def test_bad_profile_window_is_a_one_line_error(tmp_path, capsys, window, says):
    assert main(["--config", TINY, "--out", str(tmp_path / "run"), "--profile", window]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --profile {window} (logging.profile)") and says in err
    assert not (tmp_path / "run").exists()


@pytest.mark.fast
@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_names_the_install(tmp_path, capsys):
    assert main(["--config", TINY, "--out", str(tmp_path / "run"), "--set", "logging.wandb=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install wandb" in err


@pytest.mark.fast
def test_schedule_drawing_is_a_png_as_wide_as_the_timeline(tmp_path):
    import matplotlib.image

    from meshtrain.plan import main as plan

    widths, areas = {}, {}
    for schedule, micro in [("gpipe", 4), ("gpipe", 8)]:
        png = tmp_path / f"{schedule}{micro}.png"
        assert plan(["--schedule", schedule, "--stages", "4", "--microbatches", str(micro), "--draw", str(png)]) == 0
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 100 and image[..., :3].std() > 0.05
        widths[micro] = image.shape[1]
        areas[micro] = [pixels_of(image, fill) for fill in (drawing.COLORS["F"][0], drawing.COLORS["B"][0],
                                                            drawing.IDLE)]
    # time 7 + 7 x 2 = 21 vs 11 + 11 x 2 = 33 forward-units: the boxes' width grows by 12 units
    assert widths[8] - widths[4] == pytest.approx(12 * drawing.UNIT_INCHES * drawing.DPI, abs=2)
    # forward, backward and idle boxes cover their time x 4 stages: F 1 and B 2 per microbatch, the
    # rest of the 21 (33) units idle; in pixels per unit of a forward box (numbers and edges: +-20%)
    unit = areas[4][0] / 16
    np.testing.assert_allclose(np.array(areas[4]) / unit, [16, 32, 4 * 21 - 48], rtol=0.2)
    np.testing.assert_allclose(np.array(areas[8]) / unit, [32, 64, 4 * 33 - 96], rtol=0.2)


def pixels_of(image: np.ndarray, hex_color: str) -> int:
    """How many pixels of an RGB(A) float image have this color."""
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]) / 255
    return int((np.abs(image[..., :3] - rgb).max(-1) < 0.02).sum())
