"""README.md and docs/ stay true: every command in them is run here, checked against the real
parser, or named as one CI runs; the generated pages match the code; figures, settings and
paths they name are the repository's.

Which test answers for a command (``kind``):

- ``kvd ...``: parsed by kvd's own argument parser, as typed (inline spans too: their
  subcommands and flags); a block that starts ``kvd serve --runtime-dir /tmp/kvd-0 ... &`` is a
  session, run as written against a real kvd on a fresh directory;
- ``python -m vllm.entrypoints.openai.api_server ...``, ``python -m kvd.vllm.cli serve ...`` and
  ``vllm serve ...``: parsed by vLLM's own server parser in tests/vllm/test_docs_recipe.py (where
  vLLM is installed); the README's CPU recipe, with its proxy and its ``curl``, is also run as
  written by tests/vllm/test_serve.py;
- ``python -m kvd.schema`` and ``python -m kvd.daemon.config_page``: run as written in a scratch
  directory, their output equal to the checked-in files;
- ``pip install`` and ``pip uninstall``: what they name is what .ci/run installs or removes;
- ``pytest``, ``ruff``, ``mypy``, ``mkdocs``, ``kvd demo``: lines of .ci/run, as written;
- ``kubectl kustomize``: run as written where kubectl is installed;
- the rest change a machine or need what CI has not (root, systemd, a cluster, a registry):
  ``NOT_RUN`` says why, and the repository files they name must exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import yaml

from kvd.cli import build_parser
from kvd.daemon import config_page
from kvd.daemon.config import Config
from kvd.daemon_process import DaemonProcess
from tests.doc_commands import (
    PAGES,
    ROOT,
    Block,
    Command,
    blocks,
    commands,
    inline_spans,
    kvd_argv,
    logical_lines,
    python_module,
    sh_commands,
    vllm_server_args,
)

SESSION_DIR = "/tmp/kvd-0"
"""The runtime directory a session block starts its kvd on (replaced by a fresh one here)."""
GENERATORS = {"kvd.schema", "kvd.daemon.config_page"}
CI_PROGRAMS = {"pytest", "ruff", "mypy", "mkdocs"}
CI_KVD = {"kvd demo"}
"""kvd commands .ci/run runs as written, beyond the parse every kvd command gets."""
NOT_RUN = {
    "sudo": "changes the machine (users, /opt, /etc, systemd units): needs root",
    "systemctl": "needs systemd as PID 1; tests/test_systemd.py verifies the unit",
    "journalctl": "needs a journal with kvd's unit in it",
    "docker": "builds and pushes an image: no container runtime or registry in CI",
    "kubectl": "needs a cluster; tests/test_kubernetes.py renders and validates the manifests",
    "curl": "needs a kvd serving metrics on port 9400; tests/test_health.py asks the same paths",
}
PROSE = {
    "kvd p50 us",
    "kvd is not reachable at DIR",
    "kvd failed request ... (interrupted): vLLM recomputes it",
}
"""Inline spans that start with kvd but are not commands: a column's name, log lines."""
KNOWN_LANGS = {"sh", "python", "yaml", ""}
"""Fenced blocks are commands (sh), code run against a kvd (python), configuration parsed
(yaml), or text (diagrams, output)."""

_CI_RUN = (ROOT / ".ci" / "run").read_text()


def kind(command: Command) -> str:
    argv = command.argv
    if "sudo" in command.wrappers:
        return "not run"
    if kvd_argv(argv) is not None:
        return "kvd"
    if python_module(argv) in GENERATORS:
        return "generator"
    if vllm_server_args(argv) is not None:
        return "vllm"
    if python_module(argv) == "kvd.bench.proxy" or argv[0] == "curl":
        return (
            "served"  # the recipe's proxy and request: run as written by tests/vllm/test_serve.py
        )
    if argv[0] in ("python", "python3") and argv[1:2] and argv[1].startswith("examples/"):
        return "example"
    if Path(argv[0]).name == "pip":
        return "pip"
    if argv[0] in CI_PROGRAMS or argv[:3] == ["python3", "-m", "venv"] or argv[0] == ".":
        return "ci"
    if argv[:2] == ["kubectl", "kustomize"]:
        return "kustomize"
    if argv[0] in NOT_RUN:
        return "not run"
    return "unknown"


def is_session(block: Block) -> bool:
    first = commands(block)[:1]
    return bool(first) and (kvd_argv(first[0].argv) or [])[:3] == [
        "serve",
        "--runtime-dir",
        SESSION_DIR,
    ]


SH = sh_commands()
SESSIONS = [b for b in blocks() if b.lang == "sh" and is_session(b)]
IN_SESSIONS = {c.where for b in SESSIONS for c in commands(b)}


def test_every_block_is_of_a_kind_the_tests_read() -> None:
    unknown = [f"{b.where}: ```{b.lang}" for b in blocks() if b.lang not in KNOWN_LANGS]
    assert not unknown, f"blocks no test reads (use one of {sorted(KNOWN_LANGS)}): {unknown}"


def test_every_command_is_run_or_checked_by_a_test_or_ci() -> None:
    assert len(SH) > 30  # the extraction itself works
    unknown = [str(c) for c in SH if kind(c) == "unknown"]
    assert not unknown, "commands no test or CI step answers for: " + "\n".join(unknown)
    examples = [str(c) for c in SH if kind(c) == "example" and c.where not in IN_SESSIONS]
    assert not examples, f"example scripts outside a session block, so never run: {examples}"


# -- kvd's own commands ---------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    """``kvd ARGV`` through the real parser; a usage error fails with argparse's message."""
    parser = build_parser()
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return argparse.Namespace(run=None)
        raise AssertionError(f"kvd {shlex.join(argv)}: not accepted by kvd's parser") from exc


@pytest.mark.parametrize("command", [c for c in SH if kind(c) == "kvd"], ids=str)
def test_kvd_commands_parse_as_written(
    command: Command, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parse(kvd_argv(command.argv) or [])
    assert hasattr(args, "run"), f"{command}: names a command group, not a command"
    assert "usage" not in capsys.readouterr().err


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def check_span(argv: list[str]) -> list[str]:
    """What is wrong with a ``kvd ...`` span of prose: subcommands that do not exist, flags the
    command does not take (values and placeholders such as ``...`` are not checked)."""
    parser = build_parser()
    problems = []
    rest = list(argv)
    while rest and (subs := _subcommands(parser)) and not rest[0].startswith("-"):
        if rest[0] == "...":
            return problems
        if rest[0] not in subs:
            return [f"no command {rest[0]!r} (known: {sorted(subs)})"]
        parser = subs[rest.pop(0)]
    options = _options(parser)
    for token in rest:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in options:
            problems.append(f"{parser.prog} has no {flag}")
    return problems


def _kvd_spans() -> list[tuple[str, list[str]]]:
    spans = []
    for where, text in inline_spans():
        if text in PROSE:
            continue
        try:
            argv = shlex.split(text)
        except ValueError:
            continue
        if argv and kvd_argv(argv) is not None and argv != ["kvd"]:
            spans.append((where, kvd_argv(argv) or []))
    return spans


def test_kvd_commands_named_in_prose_exist_with_their_flags() -> None:
    spans = _kvd_spans()
    assert len(spans) > 20
    wrong = [f"{where}: kvd {shlex.join(a)}: {p}" for where, a in spans for p in check_span(a)]
    assert not wrong, "\n".join(wrong)


def test_the_span_check_catches_a_wrong_flag_and_command() -> None:
    assert check_span(["bench", "pipeline", "--windows", "0,auto"]) == []
    assert check_span(["bench", "pipeline", "--window", "0"]) == [
        "kvd bench pipeline has no --window"
    ]
    assert check_span(["bnch"])[0].startswith("no command 'bnch'")


# -- sessions: run as written against a real kvd --------------------------------------------


@pytest.fixture(scope="module")
def shell_path() -> Iterator[str]:
    """A PATH on which ``kvd`` and ``python`` are this interpreter's, as in the reader's venv."""
    shims = Path(tempfile.mkdtemp(prefix="kvd-doc-bin-"))
    # Scripts, not symlinks: a venv's interpreter finds its venv from the path it was run by.
    for name, args in (("python", ""), ("kvd", " -m kvd")):
        shim = shims / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)}{args} "$@"\n')
        shim.chmod(0o755)
    yield f"{shims}{os.pathsep}{os.environ['PATH']}"
    shutil.rmtree(shims, ignore_errors=True)


def _env(path: str, **extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, **extra}


def test_there_is_a_session_and_it_starts_kvd() -> None:
    assert SESSIONS, f"no sh block starts with kvd serve --runtime-dir {SESSION_DIR}"


@pytest.mark.parametrize("block", SESSIONS, ids=lambda b: b.where)
def test_session_blocks_run_as_written(block: Block, shell_path: str) -> None:
    serve, *rest = commands(block)
    assert serve.background, f"{serve}: a session's kvd serve runs in the background (&)"
    serve_args = (kvd_argv(serve.argv) or [])[3:]
    assert not any(c.background for c in rest), "only the daemon runs in the background"
    if any("nixl_pair.py" in c.text for c in rest) and importlib.util.find_spec("nixl") is None:
        pytest.skip("the session runs examples/nixl_pair.py, which needs nixl")
    with DaemonProcess(*serve_args, runtime_dir=tempfile.mkdtemp(prefix="kvd-doc-")) as daemon:
        for command in rest:
            text = command.text.replace(SESSION_DIR, str(daemon.runtime_dir))
            done = subprocess.run(
                ["bash", "-c", text],
                cwd=ROOT,
                env=_env(shell_path),
                capture_output=True,
                text=True,
                timeout=180,
                check=False,
            )
            assert done.returncode == 0, f"{command.where}: {text}\n{done.stdout}{done.stderr}"


# -- code blocks ----------------------------------------------------------------------------


def _code(lang: str) -> dict[str, list[str]]:
    """Each distinct block's text, with where it is written (README and a page may share one)."""
    found: dict[str, list[str]] = {}
    for block in blocks():
        if block.lang == lang:
            found.setdefault(block.text, []).append(block.where)
    return found


PYTHON = _code("python")


@pytest.mark.parametrize("text", list(PYTHON), ids=lambda t: ", ".join(PYTHON[t]))
def test_python_blocks_run_against_a_real_kvd(text: str, shell_path: str) -> None:
    with DaemonProcess(runtime_dir=tempfile.mkdtemp(prefix="kvd-doc-")) as daemon:
        done = subprocess.run(
            [sys.executable, "-c", text],
            cwd=ROOT,
            env=_env(shell_path, KVD_RUNTIME_DIR=str(daemon.runtime_dir)),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Ready(req_id='req-1'" in done.stdout, done.stdout


def test_yaml_blocks_parse() -> None:
    assert _code("yaml")
    for text in _code("yaml"):
        assert isinstance(yaml.safe_load(text), dict)


# -- generated files ------------------------------------------------------------------------


def test_the_configuration_page_is_what_the_code_generates() -> None:
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == config_page.render(), (
        "docs/configuration.md drifted from kvd/daemon/config.py: run "
        "`python -m kvd.daemon.config_page`"
    )


def test_the_configuration_page_names_every_flag_of_kvd_serve_and_no_other() -> None:
    serve = _subcommands(build_parser())["serve"]
    flags = _options(serve) - {"-h", "--help", "--config"}
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert set(re.findall(r"^- flag: `(--[a-z-]+)`$", page, re.M)) == flags
    for name, value in msgspec.structs.asdict(Config()).items():
        # Each TOML line the page shows is one kvd reads back as the default.
        line = re.search(rf"^- TOML: `({name} = .*)`$", page, re.M)
        assert line is not None and tomllib.loads(line.group(1)) == {name: value}


GENERATOR_COMMANDS = [c for c in SH if kind(c) == "generator"]


def test_both_generators_are_documented() -> None:
    assert {python_module(c.argv) for c in GENERATOR_COMMANDS} == GENERATORS


@pytest.mark.parametrize("command", GENERATOR_COMMANDS, ids=str)
def test_generators_run_as_written_and_write_the_checked_in_files(
    command: Command, tmp_path: Path, shell_path: str
) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "protocol").mkdir()
    done = subprocess.run(
        ["bash", "-c", command.text],
        cwd=tmp_path,
        env=_env(shell_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written
    for path in written:
        relative = path.relative_to(tmp_path)
        assert path.read_text() == (ROOT / relative).read_text(), f"{relative} drifted: {command}"


# -- what CI runs ---------------------------------------------------------------------------


def _ci_lines() -> set[str]:
    """The commands of .ci/run, continuation lines joined."""
    return {line.strip() for _, line in logical_lines(_CI_RUN)}


@pytest.mark.parametrize(
    "command",
    [c for c in SH if kind(c) == "ci" or shlex.join(c.argv) in CI_KVD],
    ids=str,
)
def test_ci_runs_the_command_as_written(command: Command) -> None:
    argv = command.argv
    if argv[:3] == ["python3", "-m", "venv"]:
        # CI builds its own fresh environment, in .venv-ci.
        assert re.search(r"^python3 -m venv \S+$", _CI_RUN, re.M), "CI creates no venv"
        return
    if argv[0] == ".":
        assert re.search(r"^\. \S+/bin/activate$", _CI_RUN, re.M), "CI activates no venv"
        return
    assert shlex.join(argv) in _ci_lines(), f"{command}: not a line of .ci/run"


def _pip(argv: list[str]) -> tuple[str, set[str]]:
    """(install or uninstall, what it names: requirement specs, and extras as '.[extra]')."""
    args = argv[argv.index("pip") + 1 :] if "pip" in argv else argv[1:]
    verb, *rest = args
    named = set()
    for token in rest:
        if token.startswith("-"):
            continue
        if token.startswith("."):
            extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", token)
            assert extras is not None, token
            named |= {f".[{e}]" for e in (extras.group(1) or "").split(",") if e} or {"."}
        else:
            named.add(token)
    return verb, named


EXTRAS: dict[str, list[str]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
]


def _included(extras: set[str]) -> set[str]:
    """``extras`` and every extra they bring through a ``kvd[...]`` requirement."""
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra not in seen:
            seen.add(extra)
            for requirement in EXTRAS.get(extra, []):
                if match := re.match(r"kvd\[([\w,-]+)\]", requirement):
                    todo += match.group(1).split(",")
    return seen


def _ci_pip() -> dict[str, set[str]]:
    done: dict[str, set[str]] = {"install": set(), "uninstall": set()}
    for line in _ci_lines():
        argv = shlex.split(line)
        if "pip" in argv and argv[argv.index("pip") + 1] in done:
            verb, named = _pip(argv)
            done[verb] |= named
    # The project with extras is the project, and an extra brings those it names (kvd[test]).
    extras = _included({name[2:-1] for name in done["install"] if name.startswith(".[")})
    done["install"] |= {f".[{extra}]" for extra in extras} | ({"."} if extras else set())
    return done


@pytest.mark.parametrize("command", [c for c in SH if kind(c) == "pip"], ids=str)
def test_pip_commands_name_what_ci_installs(command: Command) -> None:
    extras = EXTRAS
    verb, named = _pip(command.argv)
    for name in named:
        if name.startswith(".["):
            assert name[2:-1] in extras, f"{command}: pyproject.toml has no extra {name}"
    missing = named - _ci_pip()[verb]
    assert not missing, f"{command}: .ci/run does not {verb} {sorted(missing)}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("command", [c for c in SH if kind(c) == "kustomize"], ids=str)
def test_kubectl_kustomize_renders_as_written(command: Command) -> None:
    done = subprocess.run(
        command.argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "kind: Deployment" in done.stdout


_REPO_PATH = re.compile(
    r"^(?:kvd|tests|examples|systemd|deploy|dashboards|protocol|docs|\.ci)/\S*$"
)


@pytest.mark.parametrize("command", [c for c in SH if kind(c) == "not run"], ids=str)
def test_commands_not_run_here_name_files_that_exist(command: Command) -> None:
    argv = command.argv
    assert "sudo" in command.wrappers or argv[0] in NOT_RUN
    for token in argv:
        if _REPO_PATH.match(token):
            assert (ROOT / token).exists(), f"{command}: no {token}"


# -- facts the pages state ------------------------------------------------------------------


def _table(text: str, heading: str) -> list[str]:
    """The rows of the first table after ``heading``, header and rule left out."""
    section = text[text.index(heading) :]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows[2:]


README = (ROOT / "README.md").read_text()


def test_readme_headline_figures_are_rows_of_the_benchmarks_page() -> None:
    headline = _table(README, "## Figures")
    results = _table((ROOT / "docs" / "benchmarks.md").read_text(), "## Current results")
    assert len(headline) >= 4
    missing = [row for row in headline if row not in results]
    assert not missing, f"README figures not in docs/benchmarks.md's table: {missing}"


def test_readme_settings_are_settings_with_their_defaults() -> None:
    rows = _table(README, "## The settings that matter")
    defaults = msgspec.structs.asdict(Config())
    assert len(rows) == 6
    for row in rows:
        name, default = (cell.strip().strip("`") for cell in row.split("|")[1:3])
        assert name in defaults, f"README names a setting kvd does not have: {name}"
        assert default == json.dumps(defaults[name]), f"{name}: README says {default}"


def _paths_named() -> list[tuple[str, str]]:
    named = []
    for where, span in inline_spans():
        path = span.split("::")[0]
        if _REPO_PATH.match(path) and "*" not in path and "<" not in path:
            named.append((where, span))
    for path in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", path.read_text()):
            if not re.match(r"[a-z]+:", target):
                resolved = (path.parent / target).resolve().relative_to(ROOT)
                named.append((str(path.relative_to(ROOT)), str(resolved)))
    return named


def test_files_and_tests_named_in_the_pages_exist() -> None:
    named = _paths_named()
    assert len(named) > 50
    missing = []
    for where, span in named:
        path, _, test = span.partition("::")
        if not (ROOT / path).exists():
            missing.append(f"{where}: {path}")
        elif test and f"def {test.split('[')[0]}(" not in (ROOT / path).read_text():
            missing.append(f"{where}: {span}")
    assert not missing, "named in the docs, not in the repository:\n" + "\n".join(missing)
