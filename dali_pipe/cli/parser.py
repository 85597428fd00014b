"""The command-line parsers, generated from the settings (dali_pipe/config.py defines each setting once: its
default, its one-line help, its check): a flag per setting, every value kept as given so that
config.validate lists every problem at once, the settings a user gave recorded (GIVEN), and no abbreviation
of a flag taken as the flag.

Why a small generator and not a library: transformers' `HfArgumentParser` (the closest fit) costs about 1.4 s
to import, stops at the first bad value (argparse `type=` errors exit at once, while we list every problem),
and cannot express "an integer or 'auto'"; jsonargparse would be a new dependency for the same 100 lines;
LightningCLI would rename the public flags (`--trainer.max_epochs`). The generator keeps the flags stable and
the messages ours.
"""
from __future__ import annotations

import argparse
import difflib
import sys

from ..config import (
    FIELDS,
    GROUPS,
    TRAIN_GROUPS,
    Settings,
    UsageError,
    converter,
    flag_of,
    parse_bool,
    selected,
    tolerant,
)


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one clear message; exit 2 in the CLI, output/failure under
    SageMaker) instead of exiting from deep inside the parser. Flags are named whole: argparse's abbreviations
    took `--epoch 3` as `--epochs 3` without a word (its subcommands' parsers are of this class too)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        """A switch (`--force`, `--no-progress`) of a command with positionals takes the next word as its value
        only if it is true or false: `manifest --force FOLDER` and `sync --no-progress URI DIR` keep their
        positionals, as `--skip-missing false` (SageMaker's strings) keeps its value. (argparse's nargs="?"
        takes any word.) Where there is no positional (train.py), or the word is empty, argparse takes it and
        the setting's check names the flag and the word."""
        args = list(sys.argv[1:] if args is None else args)
        if not any(not a.option_strings for a in self._actions):
            return super().parse_known_args(args, namespace)
        longs = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        switches = {s for a in self._actions if a.nargs == "?" and a.const is True for s in a.option_strings}
        out = []
        for i, tok in enumerate(args):
            if tok == "--":
                out.extend(args[i:])
                break
            after = args[i + 1] if i + 1 < len(args) else None
            full = tok if tok in longs else None
            if full in switches and after and not after.startswith("-") and not _is_bool_word(after):
                tok = f"{full}=true"
            out.append(tok)
        return super().parse_known_args(out, namespace)


def _is_bool_word(s: str) -> bool:
    try:
        parse_bool(s)
    except ValueError:
        return False
    return True


GIVEN = "_given"  # the namespace attribute in which the parser records the settings given (settings_from reads it)


class _Given(argparse.Action):
    """argparse's plain store, which also records that the user gave this setting (so that a command can tell
    a value typed from its default, without comparing the two: `Settings.given`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {self.dest})


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show '(default: X)' except where the default is computed and the help says how."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool) and \
                action.option_strings and action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def build_parser(prog: str, description: str, groups=TRAIN_GROUPS, epilog: str | None = None) -> _Parser:
    """The argparse parser for the settings of `groups`, one flag per field."""
    return add_settings(_Parser(prog=prog, description=description, epilog=epilog, formatter_class=_Formatter),
                        groups)


def add_subcommand(subparsers, name: str, summary: str, description: str, groups, helps: dict | None = None) -> _Parser:
    """A subcommand (`python -m dali_pipe NAME`) whose flags are the settings of `groups`; `helps` replaces
    a setting's help text where the command reads it differently (predict's --data is no dataset root)."""
    return add_settings(subparsers.add_parser(name, help=summary, description=description,
                                              formatter_class=_Formatter), groups, helps)


def add_settings(p: argparse.ArgumentParser, groups, helps: dict | None = None):
    """Add one argument per setting of `groups` (group names or single field names) to `p`, in one
    help section per settings class (`helps`: a command's own help text for some of them, by name)."""
    sections = {}
    several = len({FIELDS[n][0] for n in selected(groups)}) > 1
    for name in selected(groups):
        group, f, tp = FIELDS[name]
        if group not in sections:
            doc = (GROUPS[group].__doc__ or "").strip()
            sections[group] = p.add_argument_group(group, doc) if several else p
        section = sections[group]
        meta = f.metadata
        conv, expected = converter(name)
        kw = dict(help=(helps or {}).get(name, meta["help"]), default=f.default, type=tolerant(conv, expected),
                  action=_Given)
        if meta["metavar"]:
            kw["metavar"] = meta["metavar"]
        elif meta["choices"]:
            kw["metavar"] = "{" + ",".join(map(str, meta["choices"])) + "}"
        if meta["positional"]:
            kw.pop("default")
            section.add_argument(name, **kw)
            continue
        if conv is parse_bool:  # `--flag` alone means true; `--flag false` (SageMaker strings) works too
            kw.update(nargs="?", const=True)
        elif meta["nargs"]:
            kw["nargs"] = meta["nargs"]
        section.add_argument(flag_of(name), dest=name, **kw)
    return p


def new_parser(prog: str, description: str) -> _Parser:
    return _Parser(prog=prog, description=description, formatter_class=_Formatter)


def parse(argv: list[str], parser: _Parser) -> tuple[argparse.Namespace, list[str]]:
    """Parse argv. Returns the namespace and the problems with unknown arguments, each suggesting
    the closest known flag (validate() lists them with the others)."""
    ns, extra = parser.parse_known_args(argv)
    problems = []
    if extra:
        known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
        parts = []
        for tok in extra:
            if tok.startswith("-"):
                close = difflib.get_close_matches(tok.split("=")[0], known, n=1)
            else:  # a flag without its dashes (`train.py benchmark`)
                close = [f"--{tok}"] if f"--{tok}" in known else []
            parts.append(f"{tok} (did you mean {close[0]}?)" if close else tok)
        problems.append(f"unrecognized arguments: {' '.join(parts)} (see {parser.prog} --help)")
    return ns, problems


def settings_from(ns: argparse.Namespace) -> Settings:
    """Group a parsed namespace into Settings (fields the parser did not expose keep their defaults), with
    the names of the settings given on the command line in `given`."""
    s = Settings(given=frozenset(getattr(ns, GIVEN, ())))
    for name, value in vars(ns).items():
        if name == GIVEN:
            continue
        group = FIELDS[name][0]
        setattr(getattr(s, group), name, value)
    return s
