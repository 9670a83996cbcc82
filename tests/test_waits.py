"""Every wait ends (issue 57, class 4), and a malformed address or staging folder is one line (class 5):
`core/waits.interruptible` passes any outcome through, says it is waiting, ends at its deadline, and a
Ctrl-C lands at once while the work blocks in native code; the addresses the multi-host flags take
are host:port or one UserError; `--stage` is a local folder or one UserError."""
import logging
import os
import signal
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.core import waits
from meshtrain.core.errors import UserError
from meshtrain.run.multihost import check_address, resolve_launch

pytestmark = pytest.mark.fast
FEW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Boom(Exception):
    pass


@FEW
@given(outcome=st.one_of(st.integers(), st.text(max_size=5), st.just(Boom("failed"))),
       seconds=st.sampled_from([0.0, 0.3, 0.6]))
def test_any_outcome_passes_through_and_the_wait_says_it_is_waiting(outcome, seconds, caplog):
    def work():
        time.sleep(seconds)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    caplog.clear()
    started = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        if isinstance(outcome, Exception):
            with pytest.raises(Boom):
                waits.interruptible(work, "the store", every_s=0.25)
        else:
            assert waits.interruptible(work, "the store", every_s=0.25) == outcome
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the store: ")]
    waited = time.perf_counter() - started  # the sleep may overrun on a busy machine: a line per 0.25 s of it
    assert len(said) <= waited / 0.25 + 1 and (seconds < 0.6 or said), said
    assert all(line.endswith("(Ctrl-C stops)") for line in said)


def test_the_deadline_ends_the_wait_with_its_error_and_abandons_the_work():
    steps, abandoned = [], threading.Event()

    def work():  # work done in steps stops once abandoned
        while not waits.abandoned():
            steps.append(1)
            time.sleep(0.05)
        abandoned.set()
    started = time.monotonic()
    with pytest.raises(UserError, match="did not meet"):
        waits.interruptible(work, "the job", deadline_s=0.5, timed_out=lambda: UserError("did not meet"))
    assert 0.5 <= time.monotonic() - started < 2 and abandoned.wait(2) and steps


def test_ctrl_c_lands_while_the_work_blocks_in_native_code():
    """The work holds a lock with no timeout (native code that does not return); the signal's handler
    runs in the waiting main thread at once."""
    held = threading.Lock()
    held.acquire()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # SIG_IGN in a background job
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            waits.interruptible(held.acquire, "the coordinator")
        assert time.monotonic() - started < 0.3 + 2 * waits.SLICE_S + 0.5
    finally:
        signal.signal(signal.SIGINT, previous)
        held.release()


def test_off_the_main_thread_the_work_runs_in_place():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(waits.interruptible(threading.current_thread, "x")))
    thread.start()
    thread.join()
    assert seen == [thread]


ADDRESS_TEXT = st.one_of(st.text(max_size=12), st.builds(lambda h, p: f"{h}:{p}", st.text(max_size=6),
                                                         st.text(alphabet="0123456789-x ", max_size=6)))


@settings(max_examples=60, deadline=None)
@given(ADDRESS_TEXT)
def test_a_coordinator_address_is_host_and_port_or_one_line(address):
    try:
        resolve_launch({}, address, 2, 0)
    except UserError as e:
        assert "\n" not in str(e) and str(e).startswith(f"--coordinator {address!r} is not host:port")
        return
    host, _, port = address.rpartition(":")
    assert host.strip("[]") and 1 <= int(port) <= 65535 and not any(c.isspace() for c in address)


@pytest.mark.parametrize("env,named", [
    ({"JAX_COORDINATOR_ADDRESS": "node0"}, "JAX_COORDINATOR_ADDRESS"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
      "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "7", "JAX_COORDINATOR_PORT": "99999"},
     "SLURM with JAX_COORDINATOR_PORT"),
])
def test_an_address_from_the_environment_names_its_variable(env, named):
    assert check_address("[fd00::1]:1234", "--coordinator") == "[fd00::1]:1234"
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp6://[fd00::1]:34911"}
    assert resolve_launch(mpi).coordinator.startswith("[fd00::1]:")  # bracketed, or the port reads as the host's
    with pytest.raises(UserError, match="is not host:port"):
        check_address("node:²", "--coordinator")  # a digit to str.isdigit, not to int()
    with pytest.raises(UserError, match=f"^{named} '.*' is not host:port"):
        resolve_launch(env)


@pytest.mark.parametrize("stage,message", [
    ("", "--stage '': name a local folder"),
    ("s3://bucket/tmp", "--stage 's3://bucket/tmp': name a local folder"),
    ("{file}", "--stage {file}: {file} is a file, not a folder"),
    ("{file}/sub", "--stage {file}/sub: {file} is a file, not a folder"),
])
def test_a_staging_folder_that_is_not_one_is_one_line_before_any_work(tmp_path, stage, message):
    from meshtrain.data import store

    (tmp_path / "file").write_text("")
    fill = lambda text: text.format(file=tmp_path / "file")  # noqa: E731
    with pytest.raises(UserError) as e, store.staged(f"file://{tmp_path}/out", fill(stage)):
        pass
    assert str(e.value).startswith(fill(message)) and not (tmp_path / "out").exists()


SCHEMES = st.sampled_from(["s3", "gs", "https", "file", "hdfs", "abfs"])


@settings(max_examples=30, deadline=None)
@given(scheme=SCHEMES, slashes=st.sampled_from([":", ":/", "://", ":///"]),
       rest=st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=8),
       flag=st.sampled_from(["--out", "--json", "--to-hf DIR", "compile_cache", "data.cache_dir"]))
def test_a_uri_where_a_local_path_is_taken_is_one_line(scheme, slashes, rest, flag):
    """Every output path and local folder goes through folders.local: a URI there wrote a folder named
    `s3:` in the working directory (report, convert, compile_cache) or was a traceback (train, eval)."""
    from meshtrain.core import compile_cache
    from meshtrain.core.folders import check_new, file_target, writable

    uri = f"{scheme}{slashes}{'/' if slashes == ':' and rest else ''}{rest}"
    for check in (writable, check_new, file_target, lambda path, flag: compile_cache.folder_for(path)):
        with pytest.raises(UserError) as e:
            check(uri, flag)
        assert "\n" not in str(e.value) and " is a URI; " in str(e.value)


def test_a_second_join_in_one_process_is_one_line(monkeypatch):
    """JAX cannot cancel a join: one given up on (a library caller's Ctrl-C or deadline) still holds
    JAX's client, and a second `initialize` would be JAX's RuntimeError."""
    from jax._src import distributed

    from meshtrain.run.multihost import init_distributed

    monkeypatch.setattr(distributed.global_state, "client", object())
    with pytest.raises(UserError, match="^this process has already joined a multi-host job, or a join it gave up"):
        init_distributed("127.0.0.1:1234", 2, 1)
