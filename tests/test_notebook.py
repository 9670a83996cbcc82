"""examples/notebook.ipynb: saved executed, and its cells run as one script (few steps, a small
text instead of Shakespeare) in a fresh process, as a notebook kernel would."""
import json
import os
import subprocess
import sys

from meshtrain.testing import ROOT

NOTEBOOK = ROOT / "examples" / "notebook.ipynb"


def code_cells():
    return [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]


def test_notebook_is_saved_executed_with_its_plot_and_sample():
    cells = code_cells()
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1))
    outputs = [o for c in cells for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the loss curve
    assert any("ROMEO:" in "".join(o.get("text", "")) for o in outputs)  # the sample


def test_notebook_cells_run_as_a_script(tmp_path):
    text = "".join(f"{name}:\nThe {word} of the {thing} is not {word} to me.\n\n"
                   for name in ("ROMEO", "JULIET", "NURSE") for word in ("light", "night", "rose")
                   for thing in ("day", "house", "sun", "field")) * 30
    (tmp_path / "text.txt").write_text(text)
    script = "\n\n".join("".join(c["source"]) for c in code_cells())
    env = dict(os.environ)  # the notebook asks for its 8 devices; the suite's compile flags stay
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env.update(SHAKESPEARE=str(tmp_path / "text.txt"), STEPS="24", MPLBACKEND="Agg",
               TMPDIR=str(tmp_path))  # its run folder (tempfile.mkdtemp) lands in pytest's folder
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "examples", env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loss_line = next(line for line in done.stdout.splitlines() if line.startswith("loss "))
    first, last = (float(x) for x in loss_line.split(",")[0].split()[1::2])
    assert last < first - 1.0, loss_line  # it learned
    assert "ROMEO:" in done.stdout and "JULIET:" in done.stdout
