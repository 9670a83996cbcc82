"""The documentation cannot drift: every ```bash and ```python block of README.md and docs/*.md runs.

- ```bash blocks run command by command (backslash continuations joined, `#` comments dropped):
  `python -m meshtrain.<command> ...` in this process (`main(argv)`, on the suite's 8 simulated CPU
  devices: no interpreter start, and the suite's compilation cache), or in a subprocess when it asks
  for another device count or several processes; anything else through bash. Each must exit 0.
- ```python blocks run as snippets (`exec`) in this process.
- Every other fence (```text, ```yaml, output) is shown only. A command that cannot run on a CPU or
  within the suite's budget is fenced ```text with its reason visible in the page, and listed in
  TEXT_ONLY below with that reason: the two are checked against each other, so the list stays short
  and honest.

All pages run in one folder, in the site's nav order, then the README: a page's blocks run in order
(a block may use what an earlier page wrote: the Shakespeare run of Getting started is quantized
and exported by later pages, the data page's runs/shakes evaluated), and a command that already
ran (the README repeats a few) runs once.
The folder holds links to the repository's configs/, examples/ and benchmarks/ and two stand-in
inputs the pages name: path/to/tinyshakespeare.txt and docs.jsonl (the pages' own text). The site
itself is built with `mkdocs build --strict` (the `docs` extra).
"""
import contextlib
import io
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# The README's first two commands set up a fresh machine: .ci/run runs the second (this suite); the
# first's training run is the CLI path every other train block takes, at 300 steps (2 minutes).
SETUP = "python3 -m venv .venv"

# Command blocks fenced as ```text: (page, the block's first command as `command_key` names it) -> the
# reason, which the page shows within the 3 lines before the block.
TEXT_ONLY = {
    ("speed.md", "python benchmarks/gpu.py"): "needs an NVIDIA GPU",
    ("precision.md", "python benchmarks/gpu.py"): "needs an NVIDIA GPU",
    ("precision.md", "python -m meshtrain.train"): "about 5 minutes on one CPU",
    ("precision.md", "python -m meshtrain.plan"): "plans a 64-device pod",
    ("zero-fsdp.md", "python -m meshtrain.plan"): ("plans a 64-device pod", "a 13B model for 4 GPUs, twice",
                                                    "a 13B model on one GPU"),
    ("experts.md", "python -m meshtrain.plan"): "plans a 64-device pod",
    ("planner.md", "python -m meshtrain.plan"): "64- and 128-device pods",
    ("context.md", "python -m meshtrain.plan"): "about 6 minutes on 2 cores",
    ("sweeps.md", "python -m meshtrain.sweep"): "about 4 minutes on 2 cores",
    ("fine-tuning.md", "python -m meshtrain.plan"): "it compiles Llama 3 8B twice",
    ("fine-tuning.md", "python -m meshtrain.train"): "about 2 minutes on 2 cores",
    ("metrics.md", "tensorboard"): "starts a server",
    ("evaluation.md", "python -m meshtrain.eval"): "a run with a step 400 and a download",
    ("evaluation.md", "import"): "it needs a task folder",
    ("multihost.md", "for"): "as `tests/test_multihost.py` runs them",
    ("multihost.md", "ray"): "needs a Ray cluster",
    ("clusters.md", "sbatch"): "needs a SLURM cluster",
    ("clusters.md", "kubectl"): "needs a Kubernetes cluster",
    ("clusters.md", "ray"): "needs a Ray cluster",
    ("data.md", "python -m meshtrain.data"): "needs a Ray cluster",
    ("clusters.md", "mpirun"): "needs an MPI cluster",
    ("clusters.md", "python -m meshtrain.train"): "needs two hosts",
}
COMMAND_START = re.compile(r"^(python3? |#SBATCH|srun |sbatch |kubectl |mpirun |ray |tensorboard |for |mkdocs "
                           r"|import |from )")


def nav_pages() -> list[Path]:
    """docs/ pages in mkdocs.yml's nav order (those present), then the README."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def walk(entries):
        for entry in entries:
            for value in entry.values():
                yield from walk(value) if isinstance(value, list) else [value]

    pages = [DOCS / p for p in walk(nav) if (DOCS / p).exists() and not p.startswith("reference/")]
    return [*pages, ROOT / "README.md"]


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """(info string, body, line of the opening fence) of every top-level ``` block."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            blocks.append((m.group(1), "\n".join(lines[i + 1:j]), i))
            i = j
        i += 1
    return blocks


def commands(body: str) -> list[str]:
    """A bash block's commands: continuations joined, comment lines dropped (bash drops the rest)."""
    lines = (line.strip() for line in body.replace("\\\n", " ").split("\n"))
    return [line for line in lines if line and not line.startswith("#")]


def command_key(body: str) -> str:
    """A text block's first command as TEXT_ONLY names it: `python -m module` (or `python script`), else
    its first word."""
    words = next(line for line in body.split("\n") if line.strip()).split()
    if words[0] in ("python", "python3"):
        return " ".join(w for w in words[:3] if not w.startswith("-") or w == "-m")
    return words[0]


def stand_in_inputs(folder: Path) -> None:
    for name in ("configs", "examples", "benchmarks"):
        (folder / name).symlink_to(ROOT / name)
    (folder / "docs").mkdir()  # `plan --draw docs/...` writes here, not over the repository's drawings
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    (folder / "path" / "to").mkdir(parents=True)
    (folder / "path/to/tinyshakespeare.txt").write_text(text * 3)
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs * 2))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    stand_in_inputs(folder)
    return {"folder": folder, "ran": set()}


def in_process(argv: list[str]) -> bool:
    """Run in this process unless the command needs another device count or several processes."""
    if "--coordinator" in argv or "--num-processes" in argv:
        return False
    if "--devices" in argv and int(argv[argv.index("--devices") + 1]) != 8:
        return False
    return True


def run_command(cmd: str, folder: Path) -> str:
    argv = shlex.split(cmd, comments=True)
    if argv[:2] == ["python", "-m"] and argv[2].startswith("meshtrain.") and in_process(argv[3:]):
        import importlib

        module = importlib.import_module(argv[2] if argv[2] != "meshtrain.data" else "meshtrain.data.__main__")
        out = io.StringIO()
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = module.main(argv[3:])
        finally:
            os.chdir(cwd)
        assert code in (0, None), f"{cmd}\nexit {code}\n{out.getvalue()[-3000:]}"
        return out.getvalue()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", cmd], cwd=folder, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{cmd}\nexit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def run_snippet(code: str, folder: Path) -> None:
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, "<docs snippet>", "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(cwd)


def clocks() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def since(start: tuple[float, float]) -> tuple[float, float]:
    now = clocks()
    return now[0] - start[0], now[1] - start[1]


PAGES = nav_pages()


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_blocks_run(page, workdir):
    """Each bash command exits 0 and each Python snippet runs, in page order; a command run by an
    earlier page is not run again."""
    folder, ran = workdir["folder"], workdir["ran"]
    timings = []  # (command, wall s, CPU s of this process and its children): CPU s, not wall, on a busy machine
    for lang, body, _ in fenced_blocks(page.read_text()):
        if lang == "python":
            if body not in ran:
                start = clocks()
                run_snippet(body, folder)
                ran.add(body)
                timings.append((body.split("\n")[0], *since(start)))
        elif lang == "bash":
            for cmd in commands(body):
                if cmd.startswith(SETUP):
                    assert page.name in ("README.md", "getting-started.md"), f"{page.name}: {cmd}"
                    continue
                key = shlex.join(shlex.split(cmd, comments=True))
                if key in ran:
                    continue
                start = clocks()
                run_command(cmd, folder)
                ran.add(key)
                timings.append((cmd, *since(start)))
    print("".join(f"\n{wall:6.1f} s wall {cpu:6.1f} s CPU  {c[:90]}" for c, wall, cpu in timings))


def test_text_fenced_commands_are_listed_with_their_reason():
    """A command shown as ```text is in TEXT_ONLY, and the page says why in the line before it (one of
    the reasons listed for its page and command)."""
    found = {}
    for page in PAGES:
        lines = page.read_text().split("\n")
        for lang, body, at in fenced_blocks(page.read_text()):
            first = next((line for line in body.split("\n") if line.strip()), "")
            if lang in ("text", "") and COMMAND_START.match(first):
                key = (page.name, command_key(body))
                assert key in TEXT_ONLY, f"{page.name} line {at + 1}: {first!r} is fenced as text; run it or list it"
                before = " ".join(lines[max(0, at - 3):at])
                reasons = TEXT_ONLY[key] if isinstance(TEXT_ONLY[key], tuple) else (TEXT_ONLY[key],)
                assert any(r in before for r in reasons), f"{page.name} line {at + 1}: say why ({reasons}) before it"
                found[key] = True
    assert set(found) == set(TEXT_ONLY), f"listed but not in the pages: {set(TEXT_ONLY) - set(found)}"


def test_readme_stays_a_front_page():
    """At most 300 lines; its first two commands set up and run the main job and the tests, and
    the second is exactly what .ci/run runs."""
    text = (ROOT / "README.md").read_text()
    assert len(text.split("\n")) <= 300
    setup = [b for lang, b, _ in fenced_blocks(text) if lang == "bash"][:2]
    assert setup[0].startswith(SETUP) and "python -m meshtrain.train" in setup[0]
    assert setup[1].startswith(SETUP) and setup[1].endswith("python -m pytest -q")
    assert setup[1] in (ROOT / ".ci" / "run").read_text().split("\n")


def test_every_package_has_a_reference_page():
    """The API reference covers every package the project installs (pyproject's packages)."""
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    pages = {p.stem for p in (DOCS / "reference").glob("*.md")}
    missing = [p for p in packages if p != "meshtrain" and p.split(".")[1] not in pages]
    assert not missing, f"add docs/reference/<name>.md (::: the package) and its nav entry for {missing}"
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f"reference/{p}.md" in nav for p in pages)


def test_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: every nav page present, every link and anchor resolved, every API
    page's object found."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is missing: pip install -e '.[test]' (the test extra includes the docs extra)"
    proc = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
