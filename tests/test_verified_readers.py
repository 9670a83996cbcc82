"""Every reader of checkpoint weights goes through one verified loader (checkpoint.read_params):
without --step the newest intact checkpoint is read and each damaged one skipped with a one-line
warning; a damaged or absent --step, or no intact checkpoint, is a one-line error. No reader renames
or changes a checkpoint file. Exports carry a SHA256SUMS that `sha256sum -c` and the importer check.

One tiny run (the shared single-device one, step 5) gets a second checkpoint, step 6, holding the
negated weights; each case damages step 6 (or both) in its own copy."""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from meshtrain import convert, generate
from meshtrain.config.loader import UserError
from meshtrain.interop import hf
from meshtrain.interop import quantize as qz
from meshtrain.models import FAMILIES
from meshtrain.run import run_dir
from meshtrain.run.checkpoint import Checkpointer
from meshtrain.run.int8_export import export_int8
from meshtrain.testing import run_tiny

OLD, NEW = 5, 6


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(run folder with checkpoints 5 and 6, {step: params in model order on the host})."""
    trainer, _, params = run_tiny("parallel.mesh=1", devices=jax.devices()[:1])
    run = shutil.copytree(trainer.out, tmp_path_factory.mktemp("readers") / "run")
    ckpts = run / "checkpoints"
    assert [int(p.name) for p in ckpts.iterdir()] == [OLD]
    meta = json.loads((ckpts / str(OLD) / "metadata" / "metadata").read_text())
    state = {**trainer.state, "step": trainer.state["step"] + 1,
             "params": jax.tree.map(lambda x: -x, trainer.state["params"])}
    saver = Checkpointer(ckpts, keep=10)
    saver.save(state, meta)
    saver.wait()
    saver.close()
    return run, {OLD: params, NEW: jax.tree.map(lambda x: -x, params)}


# ---- damage: each applied to one checkpoint folder ----

def largest_file(folder):
    return max((f for f in (folder / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def wrong_checksum(folder):
    """A parameter's recorded checksum off by one bit, as a flipped bit in its stored values would
    leave it: same file sizes (the manifest passes) and a clean decode, so only the checksums see it."""
    path = folder / "metadata" / "metadata"
    text = path.read_text()
    state_keys = ["loss_scale", "opt_state", "params", "skipped_steps", "step"]  # their leaves, in this order
    trainer = run_tiny("parallel.mesh=1", devices=jax.devices()[:1])[0]
    assert sorted(trainer.state) == state_keys
    first_param = len(jax.tree.leaves([trainer.state[k] for k in state_keys[:2]]))
    span = re.search(r'"checksums": \[([^\]]*)\]', text)
    number = list(re.finditer(r"\d+", span[1]))[first_param]
    at = span.start(1)
    path.write_text(text[:at + number.start()] + str(int(number[0]) ^ 1) + text[at + number.end():])


def truncated(folder):
    largest_file(folder).write_bytes(b"truncated")


def missing(folder):
    largest_file(folder).unlink()


DAMAGE = {"checksum": wrong_checksum, "truncated": truncated, "missing": missing}
REASONS = {"checksum": r"checksums of the restored arrays differ from those recorded at save time",
           "truncated": r"file state/\S+ has 9 bytes, \d+ were written", "missing": r"file state/\S+ is missing"}


def snapshot(run):
    return {str(f.relative_to(run)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted((run / "checkpoints").rglob("*")) if f.is_file()}


def model_of(run):
    cfg = run_dir.run_config(run)
    return FAMILIES[cfg.model.family](cfg.model)


# ---- the readers: each returns the step whose weights it read, or its exit status ----

def which_step(got, params):
    got = jax.device_get(got)
    same = [s for s in (OLD, NEW) if all(np.array_equal(a, b) for a, b in
                                         zip(jax.tree.leaves(got), jax.tree.leaves(params[s])))]
    assert len(same) == 1, "the weights read are neither checkpoint's"
    return same[0]


def read_api(run, step, out, base, capsys):
    got, used = run_dir.newest_params(run, model_of(run), step=step)
    assert which_step(got, base[1]) == used
    return used


def read_init_from(run, step, out, base, capsys):
    return which_step(run_dir.initial_params(str(run), model_of(run), None), base[1])


def read_to_hf(run, step, out, base, capsys):
    rc = convert.main(["--to-hf", str(run), str(out), "--mesh", "fsdp=-1", *step_flag(step)])
    if rc:
        return rc
    used = int(re.search(r"step (\d+) of", stdout(capsys))[1])
    embedding = hf.SafetensorsFolder(out).get("model.embed_tokens.weight")
    assert np.array_equal(embedding, base[1][used]["embedding"])
    return used


def read_generate(run, step, out, base, capsys):
    rc = generate.main(["--run", str(run), "--prompt", "ab", "--max-new-tokens", "1", "--tokenizer", "byte",
                        *step_flag(step)])
    if rc:
        return rc
    err = capsys.readouterr().err
    sys.stderr.write(err)  # left for the test to read
    return int(re.search(r"^1 tokens from step (\d+) in ", err, re.M)[1])


def read_quantize(run, step, out, base, capsys):
    if step is not None:  # the CLI; the fallback below runs on one device, as the run did
        return convert.main(["--quantize", "int8", str(run), str(out), *step_flag(step)])
    export_int8(run, out, devices=jax.devices()[:1])
    return json.loads((out / qz.INFO_FILE).read_text())["step"]


def stdout(capsys):
    """What was printed on stdout so far; stderr is left for the test to read."""
    captured = capsys.readouterr()
    sys.stderr.write(captured.err)
    return captured.out


def step_flag(step):
    return [] if step is None else ["--step", str(step)]


READERS = {"restore_params/newest_params": read_api, "init_from": read_init_from, "convert --to-hf": read_to_hf,
           "generate": read_generate, "quantize": read_quantize}
STEPPED = [r for r in READERS if r != "init_from"]  # init_from reads the newest intact checkpoint


def case(reader, damage, step=None, newest=False):
    return pytest.param(reader, damage, step, newest, id=f"{reader}-{damage}-step{step}" + "-both" * newest)


CASES = ([case(r, d) for r in READERS if r != "quantize" for d in ("checksum", "truncated", "missing")]
         + [case("quantize", "checksum")]  # each of its runs builds a Trainer: the loader is the one above
         + [case(r, "checksum", NEW) for r in STEPPED] + [case(r, "truncated", 7) for r in STEPPED]
         + [case(r, "missing", None, newest=True) for r in ("restore_params/newest_params", "convert --to-hf")])


@pytest.mark.parametrize("reader, damage, step, both", CASES)
def test_readers_fall_back_or_fail_clearly_and_touch_no_checkpoint(base, tmp_path, capsys, reader, damage,
                                                                   step, both):
    run = shutil.copytree(base[0], tmp_path / "run")
    for s in (NEW, OLD) if both else (NEW,):
        DAMAGE[damage](run / "checkpoints" / str(s))
    before = snapshot(run)
    capsys.readouterr()
    try:
        outcome = READERS[reader](run, step, tmp_path / "out", base, capsys)
    except UserError as e:  # the Python API raises what the CLIs print
        print(f"error: {e}", file=sys.stderr)
        outcome = 2
    err = capsys.readouterr().err
    ckpts = run / "checkpoints"
    if both:
        assert outcome == 2 and err.splitlines()[-1] == (
            f"error: no intact checkpoint in {ckpts} (damaged: 6, 5); train again, or restore its checkpoints "
            f"from a copy")
    elif step == NEW:
        assert outcome == 2 and re.fullmatch(
            rf"error: checkpoint {re.escape(str(ckpts / '6'))} is damaged \({REASONS[damage]}\); choose another "
            rf"--step \(there: 6, 5\), or omit --step for the newest intact one\n", err), err
    elif step is not None:
        assert outcome == 2 and err == f"error: {ckpts} has no checkpoint of step {step}; choose another --step " \
                                       f"(there: 6, 5)\n"
    else:
        assert outcome == OLD
        warnings = [line for line in err.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and re.fullmatch(
            rf"warning: checkpoint {re.escape(str(ckpts / '6'))} is damaged \({REASONS[damage]}\); skipped "
            rf"\(left in place\), trying the previous one", warnings[0]), err
    assert snapshot(run) == before and sorted(p.name for p in ckpts.iterdir()) == ["5", "6"]
    if outcome == 2:
        assert not (tmp_path / "out").exists()


# ---- exports: SHA256SUMS of their own files, the user's file mode; the importer checks the sums ----

@pytest.fixture(scope="module")
def exports(base, tmp_path_factory):
    """{kind: folder}: step 5 of the run exported to Hugging Face form and to int8."""
    run, _ = base
    root = tmp_path_factory.mktemp("exports")
    convert.to_hf(str(run), str(root / "hf"), "float32", 60_000, "fsdp=-1", step=OLD)  # several files + index
    export_int8(run, root / "int8", devices=jax.devices()[:1], step=OLD)
    return {"hf": root / "hf", "int8": root / "int8"}


@pytest.mark.parametrize("kind", ["hf", "int8"])
def test_exports_carry_sums_that_sha256sum_verifies_and_the_users_file_mode(exports, kind):
    folder = exports[kind]
    listed = sorted(line.split("  ")[1] for line in (folder / hf.SUMS).read_text().splitlines())
    assert listed == sorted(p.name for p in folder.iterdir() if p.name != hf.SUMS)
    proc = subprocess.run(["sha256sum", "--check", "--strict", hf.SUMS], cwd=folder, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.count(": OK") == len(listed), proc.stdout + proc.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in folder.iterdir()} == \
        {f.name: oct(0o666 & ~umask) for f in folder.iterdir()}
    assert oct(folder.stat().st_mode & 0o777) == oct(0o777 & ~umask)


def edit(path, old, new):
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def flip_a_byte(folder, name):
    data = bytearray((folder / name).read_bytes())
    data[-1] ^= 1
    (folder / name).write_bytes(bytes(data))


CHANGES = {  # what is done to a copy of the export -> the error the importer gives
    "flipped byte": (lambda f: flip_a_byte(f, "model-00002-of-00004.safetensors"),
                     r"\S+/model-00002-of-00004.safetensors does not match its SHA256SUMS entry \(damaged or changed "
                     r"since it was written\)"),
    "edited config": (lambda f: edit(f / "config.json", "1e-05", "2e-05"),
                      r"\S+/config.json does not match its SHA256SUMS entry"),
    "missing file": (lambda f: (f / "model-00004-of-00004.safetensors").unlink(),
                     r"\S+/model-00004-of-00004.safetensors is listed in \S+/SHA256SUMS but missing"),
    "bad line": (lambda f: (f / hf.SUMS).write_text("not a sum\n"),
                 r"\S+/SHA256SUMS has a line that is not '<sha256>  <file>': 'not a sum'"),
}
FIX = r"; export or download it again \(or delete \S+/SHA256SUMS if you changed the file on purpose\)"


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("importer", ["read_spec", "convert --from-hf", "init_from hf:"])
def test_hf_importers_check_an_exports_sums(exports, tmp_path, capsys, change, importer):
    folder = shutil.copytree(exports["hf"], tmp_path / "hf")
    assert len(list(folder.glob("*.safetensors"))) == 4  # the names CHANGES uses
    hf.read_spec(folder)  # intact: it passes
    damage, message = CHANGES[change]
    damage(folder)
    if importer == "convert --from-hf":
        assert convert.main(["--from-hf", str(folder), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(f"error: {message}.*{FIX}\n", err), err
        assert not (tmp_path / "run").exists()
        return
    with pytest.raises(UserError, match=f"^{message}.*{FIX}$"):
        if importer == "read_spec":
            hf.read_spec(folder)
        else:
            run_dir.initial_params(f"hf:{folder}", model_of(exports["int8"]), None)


def test_int8_load_checks_the_sums(exports, tmp_path):
    folder = shutil.copytree(exports["int8"], tmp_path / "int8")
    qz.load(folder)
    flip_a_byte(folder, qz.MODEL_FILE)
    with pytest.raises(UserError, match=rf"^\S+/{qz.MODEL_FILE} does not match its SHA256SUMS entry.*{FIX}$"):
        qz.load(folder)
