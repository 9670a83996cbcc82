"""Random input never reaches a user as a traceback: the config loader returns a Config or raises a
UserError; every command's main answers random flags with exit 2 and one `error:` line (or does its
stubbed work). Hypothesis, with few examples: this module is a net, the tables in test_config.py,
test_errors.py and test_cli.py pin the messages."""
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import COMMANDS, stubbed_main

from meshtrain.config.loader import Config, UserError, load_config
from meshtrain.config.spec import settings as config_settings

KEYS = [key for key, _, _ in config_settings()]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 10**9]),
                    st.text(max_size=12))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=5), SCALARS, max_size=2))
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def loads_or_refuses(*args) -> None:
    try:
        assert isinstance(load_config(*args), Config)
    except UserError as e:
        assert "\n" not in str(e)


@pytest.mark.fast
@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, min_size=1, max_size=4))
def test_config_files_of_random_values(tmp_path_factory, document):
    import yaml

    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    nested: dict = {}
    for key, value in document.items():
        head, _, name = key.rpartition(".")
        (nested.setdefault(head, {}) if head else nested)[name] = value
    path.write_text(yaml.safe_dump(nested))
    loads_or_refuses(str(path))


@pytest.mark.fast
@FUZZ
@given(st.lists(st.tuples(st.sampled_from(KEYS), st.text(max_size=16)), min_size=1, max_size=3))
def test_overrides_of_random_text(pairs):
    loads_or_refuses(None, [f"{key}={text}" for key, text in pairs])


@pytest.mark.fast
@FUZZ
@given(st.binary(max_size=64))
def test_config_files_of_random_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    path.write_bytes(data)
    loads_or_refuses(str(path))


TOKENS = st.one_of(st.sampled_from(["--devices", "--mesh", "--set", "--steps", "--seq-len", "--max-new-tokens",
                                    "--temperature", "--top-p", "--top-k", "--headroom", "--device-memory", "--nodes",
                                    "--workers", "--vocab-size", "--trials", "--process-id", "--num-processes",
                                    "--max-shard-gb", "--mem-fraction", "--stages", "--microbatches", "--bogus"]),
                   st.sampled_from(["nan", "inf", "-1", "0", "1e999", "99999999999999999999", "x", "",
                                    "data=2,data=2"]),
                   st.text(max_size=8))


class WorkStarted(BaseException):
    """Raised by the stubbed work: the arguments were accepted (not an Exception: the wrapper lets it by)."""


def start_work(*args, **kwargs):
    raise WorkStarted


@pytest.mark.parametrize("command", COMMANDS)
@FUZZ
@given(extra=st.lists(TOKENS, max_size=4))
def test_random_flags_of_every_command(command, extra, monkeypatch, capsys):
    """The work after parsing is stubbed: each run either reaches it or fails in one line."""
    with monkeypatch.context() as patch:
        main, argv = stubbed_main(patch, command, start_work)
        try:
            code = main([*extra, *argv] if command == "ray_launch" else [*argv, *extra])
        except (SystemExit, WorkStarted) as e:  # --help, or the arguments were accepted
            code = getattr(e, "code", 0)
        err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if code not in (0, None):
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
