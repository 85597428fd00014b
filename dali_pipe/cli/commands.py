"""`python -m dali_pipe COMMAND`: the data commands, with flags generated from the settings."""
from __future__ import annotations

import sys

from ..config import add_subcommand, new_parser, parse, settings_from, validate

SYNC_DOC = ("Download s3://bucket/prefix/dataset.tsv and every file it lists into LOCAL_DIR. Files already present "
            "and unchanged (size + ETag) are skipped; each file is written under a temporary name and renamed when "
            "complete, so an interrupted sync can simply be rerun. Credentials, region and AWS_ENDPOINT_URL come "
            "from the standard AWS environment.")


COMMANDS = {"sync": ("sync", "skip_missing")}  # the settings each command exposes


def parser():
    p = new_parser("python -m dali_pipe", "Data commands of dali_pipe.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_subcommand(sub, "sync", "download dataset.tsv and only the files it lists, in parallel, resumably",
                   SYNC_DOC, COMMANDS["sync"])
    return p


def main(argv: list[str] | None = None) -> int:
    ns, problems = parse(list(sys.argv[1:] if argv is None else argv), parser())
    command = ns.command
    del ns.command
    s = settings_from(ns)
    validate(s, COMMANDS[command], problems)
    if command == "sync":
        from ..sync import sync

        stats = sync(s.sync.uri, s.sync.local_dir, workers=s.sync.workers, skip_missing=s.data.skip_missing,
                     progress=not s.sync.no_progress)
        if s.sync.no_progress:
            print(stats.summary())
    return 0
