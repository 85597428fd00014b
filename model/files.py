"""The size and sha256 of every file a model folder holds: recorded when the folder is written (the
export's metrics.json, the best model's best.json), checked before the folder is read, so a
truncated or altered file is named instead of loaded."""
from __future__ import annotations

import json
import os
from pathlib import Path

from dali_pipe.shards.format import file_sha256
from dali_pipe.workdir import plain_name

RECORD = "metrics.json"  # the export's commit record (its `export` entry); see model/export.py


def read_record(out: Path) -> dict | None:
    """The export record in OUT's metrics.json, or None (none, unreadable, or an older version's)."""
    try:
        record = json.loads((out / RECORD).read_text()).get("export")
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def unreadable(path: Path) -> bool:
    """Whether `path` exists and is not JSON (a damaged metrics.json; one another tool wrote is JSON)."""
    try:
        json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    return False


def file_record(folder: Path) -> dict:
    """{name: {"size", "sha256"}} of every file in `folder`, each flushed to disk first."""
    files = {}
    for f in sorted(Path(folder).iterdir()):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())  # the bytes are on disk before any name points at them
        files[f.name] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
    return files


def damaged_files(folder: Path, record: dict | None = None) -> list[str]:
    """The files of an export that differ from its record (missing, another size, another sha256);
    empty when the folder has no record (written by another tool or an older version). `record`
    defaults to the export record in the folder's metrics.json. A name that is not a plain file name of
    the folder (`../x`, an absolute path) is a problem too, and nothing outside the folder is read."""
    if record is None:
        record = read_record(Path(folder))
        if record is None and unreadable(Path(folder) / RECORD):
            return [f"{Path(folder) / RECORD} is damaged (not JSON), so the checksums of the folder's files cannot "
                    "be checked"]
    problems = []
    listed = (record or {}).get("files", {})
    for name, want in (listed.items() if isinstance(listed, dict) else [("files", None)]):
        path = Path(folder) / name if plain_name(name) else None
        if path is None or not isinstance(want, dict) or not isinstance(want.get("size"), int):
            problems.append(f"the record in {Path(folder)} lists {name!r}, which is not a file name of that folder "
                            "with its size and sha256")
        elif path.is_symlink():
            problems.append(f"{path} is a link, not the file that was written")
        elif not path.is_file():
            problems.append(f"{path} is a folder, not the file that was written" if path.exists() else
                            f"{path} is missing")
        elif path.stat().st_size != want["size"]:
            problems.append(f"{path} is damaged (truncated or overwritten: {path.stat().st_size} bytes, "
                            f"{want['size']} when it was written)")
        elif file_sha256(path) != want["sha256"]:
            problems.append(f"{path} is damaged (its bytes differ from the sha256 recorded when it was written)")
    return problems
