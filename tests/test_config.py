from __future__ import annotations

from pathlib import Path

import pytest

from kvd.daemon.config import (
    Config,
    ConfigError,
    load_config,
    parse_batch_window,
    parse_batch_windows,
    unknown_env,
)


def test_defaults() -> None:
    config = load_config(environ={})
    assert config == Config()
    assert config.batch_window_us == 0 and config.device == "cpu"


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text('batch_window_us = 10\nmax_batch_blocks = 64\ndevice = "cpu"\ngpu = "3"\n')
    env = {"KVD_BATCH_WINDOW_US": "20", "KVD_MAX_BATCH_BLOCKS": "128", "KVD_UNRELATED": "x"}
    config = load_config(path, environ=env, overrides={"batch_window_us": "30", "gpu": None})
    assert (config.batch_window_us, config.max_batch_blocks, config.gpu) == (30, 128, "3")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "batch_window_us = 'soon'",
            r"kvd.toml: Invalid enum value 'soon' - at `\$.batch_window_us` \(expected "
            r"microseconds \(0..1000000\) or 'auto'\)",
        ),
        ("engine_lease_s = -1", r"Expected `float` >= 0.0 - at `\$.engine_lease_s`"),
        ("batch_window_us = -1", r"Expected `int` >= 0 - at `\$.batch_window_us`"),
        ("batch_windw_us = 1", "unknown field `batch_windw_us`"),
        ("log_level = 'loud'", r"Invalid enum value 'loud' - at `\$.log_level`"),
        ("batch_window_us = ", "kvd.toml: "),
    ],
)
def test_file_errors_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, environ={})


def test_the_window_may_be_auto_from_every_source(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text('batch_window_us = "auto"\nengine_lease_s = 0\n')
    assert load_config(path, environ={}).batch_window_us == "auto"
    assert load_config(path, environ={}).engine_lease_s == 0
    assert load_config(environ={"KVD_BATCH_WINDOW_US": "auto"}).batch_window_us == "auto"
    flag = load_config(path, environ={}, overrides={"batch_window_us": "75"})
    assert flag.batch_window_us == 75
    with pytest.raises(ConfigError, match=r"--batch-window-us='soon'.*or 'auto'"):
        load_config(environ={}, overrides={"batch_window_us": "soon"})


def test_env_and_flag_errors_name_the_source() -> None:
    with pytest.raises(ConfigError, match=r"KVD_MAX_BATCH_BLOCKS='many'"):
        load_config(environ={"KVD_MAX_BATCH_BLOCKS": "many"})
    with pytest.raises(ConfigError, match=r"--max-message-bytes='12'.*>= 1024"):
        load_config(environ={}, overrides={"max_message_bytes": "12"})
    with pytest.raises(ConfigError, match=r"KVD_MAX_SUBSCRIPTION_BYTES='100'.*>= 256"):
        load_config(environ={"KVD_MAX_SUBSCRIPTION_BYTES": "100"})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml", environ={})


def test_unknown_env_names_the_closest_setting() -> None:
    env = {
        "KVD_BATCH_WINDOW": "5",  # a typo of KVD_BATCH_WINDOW_US
        "KVD_MAX_BATCH_BLOCKS": "64",  # a setting
        "KVD_RUNTIME_DIR": "/run/kvd/0",  # a setting that clients read too
        "KVD_NO_UVLOOP": "1",  # read by the daemon, not a setting
        "KVD_ZZZ": "1",  # nothing close
        "PATH": "/bin",
    }
    assert unknown_env(env) == [
        "KVD_BATCH_WINDOW is not a kvd setting and is ignored; did you mean KVD_BATCH_WINDOW_US?",
        "KVD_ZZZ is not a kvd setting and is ignored",
    ]
    assert unknown_env({"KVD_NO_UVLOP": "1"}) == [
        "KVD_NO_UVLOP is not a kvd setting and is ignored; did you mean KVD_NO_UVLOOP?"
    ]


def test_one_batch_window_parser_for_flags_and_lists() -> None:
    assert parse_batch_window(" 50 ") == 50 and parse_batch_window("auto") == "auto"
    for bad in ("soon", "-1", "1000001", "1.5"):
        with pytest.raises(ValueError, match=r"expected microseconds \(0..1000000\) or 'auto'"):
            parse_batch_window(bad)
    assert parse_batch_windows("0, 50,auto") == [0, 50, "auto"]
    with pytest.raises(ValueError, match=r"comma-separated microseconds \(0..1000000\), got"):
        parse_batch_windows("0,auto", auto=False)
    with pytest.raises(ValueError, match="give two or more distinct windows"):
        parse_batch_windows("50,50", at_least=2)
    with pytest.raises(ValueError, match="repeats a window"):
        parse_batch_windows("0,50,0")
