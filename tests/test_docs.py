"""The documentation's commands: every command line in README.md and docs/*.md (`python train.py ...`,
`python -m dali_pipe ...`, `docker run ... IMAGE ...`) parses with the CLI's own parsers: its subcommands
and flags exist and take the values given (placeholders such as DIR or OUT stand for values)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dali_pipe.cli import commands, train_parser
from dali_pipe.cli.parser import parse
from dali_pipe.config import UsageError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = re.compile(r"^(\S*/)?python3?$")
IMAGE = re.compile(r"^(IMAGE|(\S+/)?dali-pipe(:[\w.-]+)?)$")  # the image, as the docs name it


def command_lines(text: str) -> list[tuple[str, bool]]:
    """(line, inline) for the shell lines of the fenced code blocks (continuations joined) and the inline code
    spans that run python or docker (a sentence may name a command without its positional arguments)."""
    lines, block, pending = [], False, ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("```"):
            block = not block
            continue
        if block:
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            lines.append((line, False))
        else:
            lines += [(span, True) for span in re.findall(r"`([^`]+)`", raw) if re.match(r"(python|docker) ", span)]
    return lines


def invocations(line: str) -> list[tuple[str, list[str]]]:
    """(which CLI, its argv) for each command of ours on a shell line: 'train' (train.py and the image's entry
    point) or 'commands' (python -m dali_pipe); optional [--flag value] groups are taken, and each of a|b|c."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # not shell (a Python line of a code block)
        return []
    out, segment = [], []
    for word in words + ["&&"]:
        if word not in ("&&", "||", ";", "|"):
            segment.append(word)
            continue
        while segment and re.match(r"^[A-Z_]+=", segment[0]):  # VAR=value before the command
            segment.pop(0)
        found = None
        if len(segment) >= 2 and PYTHON.match(segment[0]) and segment[1] == "train.py":
            found = ("train", segment[2:])
        elif len(segment) >= 3 and PYTHON.match(segment[0]) and segment[1:3] == ["-m", "dali_pipe"]:
            found = ("commands", segment[3:])
        elif segment[:2] == ["docker", "run"]:
            at = next((i for i, w in enumerate(segment) if IMAGE.match(w)), None)
            found = ("train", segment[at + 1:]) if at is not None else None
        if found:
            argv = [w.strip("[]") for w in found[1] if w not in ("...", "[", "]")]
            choices = [i for i, w in enumerate(argv) if "|" in w]
            variants = [argv]
            for i in choices:
                variants = [v[:i] + [alt] + v[i + 1:] for v in variants for alt in argv[i].split("|")]
            out += [(found[0], v) for v in variants]
        segment = []
    return out


def problems(cli: str, argv: list[str]) -> list[str]:
    """What the CLI's parser says about argv's flags and subcommands (values may be placeholders)."""
    if cli == "commands" and argv[:1] == ["train"]:
        cli, argv = "train", argv[1:]
    if cli == "train" and argv[:1] == ["train"]:  # the SageMaker contract: train.py's flags after it
        argv = argv[1:]
    if cli == "commands" and not argv:  # the program's name in a sentence ("`python -m dali_pipe` runs ...")
        return []
    if cli == "commands" and argv[:1] == ["COMMAND"]:  # `python -m dali_pipe COMMAND --help`: each of them
        return [p for c in ("sync", "pack", "evaluate", "predict", "train") for p in problems(cli, [c, *argv[1:]])]
    try:
        _, found = parse(argv, train_parser() if cli == "train" else commands.parser())
    except UsageError as e:
        return [str(e)]
    except SystemExit as e:  # --help
        return [] if e.code == 0 else [f"exit {e.code}"]
    return found


def test_every_documented_command_parses(capsys):
    checked = 0
    for path in DOCS:
        for line, inline in command_lines(path.read_text()):
            for cli, argv in invocations(line):
                found = [p for p in problems(cli, argv) if not (inline and "arguments are required" in p)]
                assert not found, f"{path.relative_to(ROOT)}: {line}\n  {found}"
                checked += 1
    capsys.readouterr()  # the --help texts
    assert checked >= 30, checked  # the docs' commands were found (README, training, data, packs, SageMaker, ...)


@pytest.mark.parametrize("line", [
    "python train.py --data DIR --no-such-flag 3",
    "python -m dali_pipe nosuch --data DIR",
    "python -m dali_pipe pack DATA PACKED --max-sides 384",
    "docker run --gpus all -v $PWD/data:/data dali-pipe --data /data --epocs 2",
    "python -m dali_pipe evaluate --model OUT [--splits val|train]",
    "python train.py --crop-scale 0.3   # one of its two values",
])
def test_a_command_the_cli_does_not_know_is_found(line, capsys):
    """The check can fail: a misspelt flag or subcommand, in every form the docs write commands."""
    found = [p for cli, argv in invocations(line) for p in problems(cli, argv)]
    capsys.readouterr()
    assert found, line
