"""The package layout draws the architecture: each folder of meshtrain/ is a layer, and a module
imports only from its own layer or the layers below it (function-level imports included), so the
folders read bottom-up as the library is built. The commands (meshtrain/*.py) sit on top."""
import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from meshtrain.models import FAMILIES
from meshtrain.testing import ROOT

# Bottom to top; a tuple holds independent layers (neither imports the other).
LAYERS = ["core", "data", "parallel", "ops", "models", "objectives", "config", "engine", "interop", ("planner", "run"),
          "sweep"]
RANK = {name: rank for rank, layer in enumerate(LAYERS) for name in (layer if isinstance(layer, tuple) else (layer,))}
TOP = len(LAYERS)  # the commands and meshtrain/__init__.py


def folder(package: str) -> Path:
    return ROOT / "models" if package == "models" else ROOT / "meshtrain" / package


def modules():
    """(module's layer name, its file) for every module of the library."""
    for name in RANK:
        for path in sorted(folder(name).glob("*.py")):
            yield name, path
    for path in sorted((ROOT / "meshtrain").glob("*.py")):
        yield "top", path


def imported_layers(path: Path):
    """(line, layer) of every meshtrain import in a file, top-level or inside functions."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module + "." + a.name for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
                 and node.level == 0 else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "models":
                raise AssertionError(f"{path}:{node.lineno} imports the top-level `models`; it is meshtrain.models")
            if parts[0] == "meshtrain" and len(parts) > 1:
                yield node.lineno, parts[1] if parts[1] in RANK else "top"


@pytest.mark.fast
def test_imports_only_go_down_the_layers():
    upward = []
    for layer, path in modules():
        rank = TOP if layer == "top" else RANK[layer]
        for line, target in imported_layers(path):
            target_rank = TOP if target == "top" else RANK[target]
            if target != layer and (target_rank > rank or target_rank == rank):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports meshtrain.{target}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


@pytest.mark.fast
def test_every_folder_is_a_declared_layer_and_an_installed_package():
    folders = {p.name for p in (ROOT / "meshtrain").iterdir() if (p / "__init__.py").exists()} | {"models"}
    assert folders == set(RANK)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) == {"meshtrain"} | {f"meshtrain.{name}" for name in RANK}
    assert setuptools["package-dir"] == {"meshtrain.models": "models"}
    for name in RANK:  # each folder says what it owns
        doc = ast.get_docstring(ast.parse((folder(name) / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) >= 2, f"{name}/__init__.py needs a docstring naming what it owns"


# The modules of models/ that code outside it may import, and that the families share; every other one
# is a family's (it declares a FAMILY), reached only through meshtrain.models.FAMILIES and the protocol in
# models/base.py, so a family that only changes blocks stays one module.
MODELS_SHARED = {"__init__", "spec", "base", "axes", "lora", "rope", "kv_cache", "hf_llama", "experts", "routed",
                 "qk_norm", "latent_attention", "layer_runs"}


def family_modules() -> set[str]:
    return {p.stem for p in folder("models").glob("*.py")} - MODELS_SHARED


def imported_families(source: str, families: set[str]):
    """(line, family) of every import of a family module in `source`: `import meshtrain.models.moe`,
    `from meshtrain.models.moe import x`, `from meshtrain.models import moe`; top-level or in a function."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [node.module + "." + a.name for a in node.names]
        else:
            continue
        hits = {parts[2] for parts in (name.split(".") for name in names)
                if parts[:2] == ["meshtrain", "models"] and len(parts) > 2 and parts[2] in families}
        yield from ((node.lineno, family) for family in sorted(hits))


@pytest.mark.fast
def test_every_module_of_models_is_shared_or_a_registered_family():
    """Each module of models/ outside MODELS_SHARED declares a FAMILY, registered under its module's name."""
    declared = {path.stem for path in folder("models").glob("*.py")
                if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "FAMILY" for t in n.targets)
                       for n in ast.parse(path.read_text()).body)}
    assert declared == family_modules(), "a module of models/ either declares a FAMILY or is in MODELS_SHARED"
    assert declared == set(FAMILIES), "each family module is registered in models/__init__.py under its name"


@pytest.mark.fast
def test_nothing_outside_models_imports_a_family_module():
    families = family_modules()
    assert {"llama", "moe", "qwen3", "qwen3_moe", "gemma3"} <= families
    caught = [f for _, f in imported_families("import meshtrain.models.moe as m\nfrom meshtrain.models.llama import "
                                              "FAMILY\nfrom meshtrain.models import gemma3, base\n"
                                              "def f():\n    from meshtrain.models.qwen3 import Qwen3Block\n",
                                              families)]
    assert caught == ["moe", "llama", "gemma3", "qwen3"]
    files = [p for p in sorted((ROOT / "meshtrain").rglob("*.py")) if p.relative_to(ROOT).parts[1] != "models"]
    files += [p for folder_ in ("tests", "benchmarks", "examples") for p in sorted((ROOT / folder_).rglob("*.py"))]
    assert len(files) > 100
    found = [f"{path.relative_to(ROOT).as_posix()}:{line} imports meshtrain.models.{fam}"
             for path in files for line, fam in imported_families(path.read_text(), families)]
    assert not found, ("outside models/, go through meshtrain.models (FAMILIES, base, spec) or the family "
                       "protocol, not a family module:\n" + "\n".join(found))


@pytest.mark.fast
def test_no_family_module_imports_another():
    """What two families share (qwen3's q/k norm, the routed-expert blocks, the Llama form) is a shared
    module of models/, so each family module reads alone."""
    families = family_modules()
    found = [f"models/{name}.py:{line} imports meshtrain.models.{fam}"
             for name in sorted(families)
             for line, fam in imported_families((folder("models") / f"{name}.py").read_text(), families) if fam != name]
    assert not found, "a family module imports another family's; move what they share to a shared module:\n" + \
        "\n".join(found)


@pytest.mark.fast
def test_no_module_is_over_500_lines():
    long = {path.relative_to(ROOT).as_posix(): n for _, path in modules()
            if (n := len(path.read_text().splitlines())) > 500}
    assert not long, f"split these by concern (as models/ is: rope, LoRA, the KV cache, ... each a module): {long}"



def test_ruff_finds_nothing():
    """The lint rules of pyproject.toml's [tool.ruff] hold everywhere (`ruff check` from the root)."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


# ---- no import cycles between modules (within a layer: across layers the test above already forbids them) ----
def module_name(layer: str, path: Path) -> str:
    """meshtrain.<layer>.<module> (a package's __init__.py: meshtrain.<layer>); the commands: meshtrain.<module>."""
    package = ["meshtrain"] if layer == "top" else ["meshtrain", layer]
    return ".".join(package if path.stem == "__init__" else [*package, path.stem])


def import_graph() -> dict[str, set[str]]:
    """Module -> the meshtrain modules it imports, top-level or inside functions. `from package
    import name` is an edge to the module package.name when there is one (a submodule), else to the
    package (its __init__.py's name)."""
    files = {module_name(layer, path): path for layer, path in modules()}
    files.setdefault("meshtrain", ROOT / "meshtrain" / "__init__.py")
    known = lambda name: next((n for n in (name, *(name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)))
                               if n in files), None)
    graph = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {known(f"{node.module}.{a.name}") for a in node.names}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle found by a depth-first walk, as [a, b, ..., a] (one per back edge)."""
    cycles, state = [], {}  # state: 1 on the walk's path, 2 done

    def walk(node, path):
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return cycles


@pytest.mark.fast
def test_import_cycles_are_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert import_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


@pytest.mark.fast
def test_no_module_imports_itself_through_others():
    """fit.py and aot.py imported each other once: a cycle makes the import order matter and the
    two modules one, so none is allowed, within a layer or across."""
    graph = import_graph()
    assert "meshtrain.planner.aot" in graph and "meshtrain.planner.fit" in graph["meshtrain.planner.aot"]
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.fast
def test_notices_go_through_the_notice_level():
    """A notice is `log.log(NOTICE, ...)`: the console prefixes it and sends it to stderr, and a
    handler can filter it by level; "notice: " typed into an info line does neither."""
    typed = [f"{path.relative_to(ROOT)}:{node.lineno}" for _, path in modules()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("notice: ")
             and path.name != "console.py"]
    assert not typed, "log these at NOTICE, without the prefix:\n" + "\n".join(typed)


# The step and its executors call the Objective protocol (meshtrain/objectives/base.py) and no feature
# by name, so an objective is one module; the words below belong to objectives and the adapters.
EXECUTORS = ("meshtrain/engine/step.py", "meshtrain/engine/pipeline.py", "meshtrain/engine/pipeline_step.py",
             "meshtrain/engine/stage_state.py", "meshtrain/parallel/data_parallel.py", "meshtrain/parallel/batching.py")
FEATURE_WORDS = re.compile(r"\b(dpo|mtp|reference|dropout|preference)\b", re.IGNORECASE)


@pytest.mark.fast
def test_the_executors_name_no_objective_feature():
    named = [f"{rel}:{i}: {line.strip()}" for rel in EXECUTORS
             for i, line in enumerate((ROOT / rel).read_text().splitlines(), 1) if FEATURE_WORDS.search(line)]
    assert not named, "ask the objective (meshtrain/objectives/base.py) instead:\n" + "\n".join(named)
    from meshtrain.config.spec import TrainConfig
    from meshtrain.objectives import OBJECTIVES

    assert {"sft", "dpo"} <= set(OBJECTIVES) and TrainConfig().objective in OBJECTIVES  # docs add label_smoothed


# Callers ask a spec, a model or a tokenizer through its protocol (models/spec.py, models/base.py,
# meshtrain/data/tokenizer.py), never `getattr(spec, "name", default)`: a probe hides a missing member.
PROBED = re.compile(r"getattr\(\s*[\w.]*(spec|model|tok|tokenizer|family)\b", re.IGNORECASE)


@pytest.mark.fast
def test_no_probe_stands_in_for_a_protocol_member():
    assert PROBED.search('getattr(program.model, "mtp_depth", 0)') and PROBED.search("getattr(spec, 'lora', None)")
    probes = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for layer, path in modules()
              if layer != "models" and path.name != "tokenizer.py"  # their own modules
              for i, line in enumerate(path.read_text().splitlines(), 1) if PROBED.search(line)]
    assert not probes, "declare the member on the protocol instead:\n" + "\n".join(probes)
