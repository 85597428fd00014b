"""dataset.tsv as text: read into columns of strings, its header checked, each path made safe (lexically, touching
no file). No numpy here: a pack's sync and the commands that only read a manifest's paths load this alone;
manifest.py turns the columns into samples.
"""
from __future__ import annotations

import csv
import difflib
import io
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

MANIFEST_NAME = "dataset.tsv"


class ManifestError(UserError):
    """The manifest cannot be used as it is; the message says which row or column and the fix."""


_QUOTED = re.compile(r'[\t\n\r]|^"')  # what a cell must be quoted for (csv's and pandas' rule, "" for ")


def row(cells) -> str:
    """One line of a TSV we write (bad_images.tsv, predictions.tsv): a cell holding a tab or a line break, or
    starting with a quote, is quoted as the csv module and pandas read it back; any other cell is written as it
    is, so a dataset.tsv path (which holds none of these) comes out exactly as that file wrote it. A file name with
    a tab and a newline once added a forged row to both reports."""
    return "\t".join('"' + c.replace('"', '""') + '"' if _QUOTED.search(c) else c for c in map(str, cells)) + "\n"


def preview(items: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(i) for i in items[:n])
    return f"{shown}{f' ... and {len(items) - n} more' if len(items) > n else ''} ({len(items)} in all)"


def safe_relpath(image_path: str, root: Path) -> str:
    """Normalise a manifest path to a POSIX path relative to `root`, refusing any that escapes it.

    Purely lexical: nothing is opened, so a hostile row never touches the file system.
    Raises ValueError with the reason.
    """
    p = image_path.replace("\\", "/")
    if not p:
        raise ValueError("empty image_path")
    if "\x00" in p:
        raise ValueError("image_path contains a NUL byte")
    if posixpath.isabs(p) or (len(p) > 1 and p[1] == ":"):
        root_s = str(root.resolve()).replace("\\", "/").rstrip("/") + "/"
        norm = posixpath.normpath(p)
        if not norm.startswith(root_s):
            raise ValueError(f"absolute path {image_path!r} is outside the dataset root {str(root)!r}")
        p = norm[len(root_s):]
    norm = posixpath.normpath(p)
    if norm == "." or norm.startswith("../") or norm == ".." or posixpath.isabs(norm):
        raise ValueError(f"path {image_path!r} escapes the dataset root (uses '..')")
    return norm


@dataclass
class Table:
    """A manifest as read, in columns: the header's column names (trimmed, lower-case), each column's trimmed
    strings for the non-blank rows, and `_line`, each row's line number in the file (the header is line 1)."""
    columns: list[str]
    data: dict[str, list]
    header_line: int = 1

    def __getitem__(self, column: str) -> list:
        return self.data[column]

    def __len__(self) -> int:
        return len(self.data["_line"])

    @property
    def empty(self) -> bool:
        return not len(self)


def read_table(tsv: Path | str, raw: bytes | None = None) -> Table:
    """Load the TSV as strings, tolerating a BOM, CRLF, padding spaces, blank lines and trailing tabs. `raw`: the
    file's bytes where the caller read them already (and keys a cache by them: the same bytes are parsed).

    The standard library's csv reader, not pandas: pandas costs over a second to import, which a data
    mistake should not wait for (the CLI reads the manifest before torch and Lightning load), and with
    one field more than the header on the first row it silently takes the first column as the index.
    """
    try:
        raw = Path(tsv).read_bytes() if raw is None else raw
    except FileNotFoundError:
        raise ManifestError(f"{tsv}: no such manifest. Put a {MANIFEST_NAME} with an 'image_path' "
                            "column at the dataset root, or pass the right --data.") from None
    except OSError as e:
        raise ManifestError(f"{tsv}: cannot be read ({e.strerror or e}).") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ManifestError(f"{tsv}: line {line}: not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                            "UTF-8.") from None
    one = _one_column(text)
    if one is not None:
        return one
    lines = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE, strict=True)
    header, header_line, rows, numbers, problems = None, 1, [], [], []
    try:
        for number, fields in enumerate(lines, start=1):
            if len(fields) == 1 and header is not None and len(header) == 1 and fields[0] and fields[0] == fields[0].strip():
                rows.append(fields)  # the common row of a one-column manifest, as is
                numbers.append(number)
                continue
            fields = [f.strip() for f in fields]
            if not any(fields):
                continue  # a blank line (or only tabs and spaces)
            if header is None:
                header, header_line = [f.lower() for f in fields], number
                continue
            extra = fields[len(header):]
            if any(extra):
                problems.append(f"line {number} has {len(fields)} tab-separated fields, the header {len(header)} "
                                f"({', '.join(header)})")
                continue
            rows.append(fields[:len(header)] + [""] * (len(header) - len(fields)))
            numbers.append(number)
    except csv.Error as e:
        raise ManifestError(f"{tsv}: line {lines.line_num}: not a tab-separated table ({e}).") from None
    if header is None:
        raise ManifestError(f"{tsv}: the file is empty; it needs a header line with 'image_path'.")
    twice = sorted({c for c in header if header.count(c) > 1 and c})
    if twice:
        raise ManifestError(f"{tsv}: line {header_line}: column(s) {', '.join(map(repr, twice))} appear more than "
                            "once in the header (names are case-insensitive); keep one of each.")
    if problems:
        raise ManifestError(f"{tsv}: not a tab-separated table: " + "; ".join(problems[:5])
                            + (f"; ... and {len(problems) - 5} more" if len(problems) > 5 else "")
                            + ". Each line needs at most as many tab-separated fields as the header.")
    data = {c: list(col) for c, col in zip(header, zip(*rows))} if rows else {c: [] for c in header}
    data["_line"] = numbers
    return Table(header, data, header_line)


# line breaks of str.splitlines that the csv reader does not break at
_OTHER_BREAKS = re.compile("[\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def _one_column(text: str) -> Table | None:
    """The table of a manifest without a tab (one column: image_path alone, the common form of a large one), as the
    csv reader reads it, without a list per row (1 M rows: about 1 s and 200 MB less); None for any other text."""
    if "\t" in text or _OTHER_BREAKS.search(text):
        return None
    lines = text.splitlines()
    if lines and max(map(len, lines)) > csv.field_size_limit():
        return None  # the csv reader's refusal, with its message
    header, header_line, rows, numbers = None, 1, [], []
    for number, line in enumerate(lines, start=1):
        field = line.strip()
        if not field:
            continue
        if header is None:
            header, header_line = [field.lower()], number
            continue
        rows.append(field)
        numbers.append(number)
    if header is None:
        return None
    return Table(header, {header[0]: rows, "_line": numbers}, header_line)


COLUMNS = ("image_path", "label", "split")


def check_columns(table: Table, tsv) -> None:
    """Header names are stripped and case-insensitive (read_table lowers them); a column that
    nearly matches a known one (`lable`, `imagepath`) is a typo, not an extra column; a header of
    comma-separated names is a CSV file."""
    check_header(table, tsv)
    if table.empty:
        raise ManifestError(f"{tsv}: no rows. List at least two classes of images under 'image_path'.")


def check_header(table: Table, tsv) -> None:
    """The header names an image_path column and no near-miss of a known one; else one message naming the
    header's line and what it looks like (a typo of which column, a comma-separated file)."""
    cols, where = table.columns, f"{tsv}: line {table.header_line}"
    for sep, name in ((",", "comma"), (";", "semicolon")):
        if len(cols) == 1 and sep in cols[0]:
            raise ManifestError(f"{where}: the header {cols[0]!r} is {name}-separated: this is a CSV file, and "
                                f"{MANIFEST_NAME} is tab-separated. Save it with a tab between the columns (for "
                                f"example pandas.read_csv({str(tsv)!r}, sep={sep!r}).to_csv(..., sep='\\t', "
                                "index=False)).")
    typos = [(c, close[0]) for c in cols if c not in COLUMNS
             for close in [difflib.get_close_matches(c, COLUMNS, n=1, cutoff=0.75)] if close and close[0] not in cols]
    if typos:
        raise ManifestError(f"{where}: " + "; ".join(f"column {c!r} looks like a typo of {k!r}" for c, k in typos)
                            + f"; rename {'it' if len(typos) == 1 else 'them'} (the known columns are "
                            f"{', '.join(COLUMNS)}).")
    if "image_path" in cols:
        return
    raise ManifestError(f"{where}: no 'image_path' column (found {cols}). Add a header line whose "
                        "first field is image_path, tab-separated.")
