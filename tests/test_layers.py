"""The import structure: the library never imports its CLI, the data side never imports the model
side, the public API (dali_pipe/__init__.py, dali_pipe/api.py) sits above both and nothing below imports
it, and no project module imports itself back through others (all imports count, lazy ones too, and
the package's lazily exported names)."""
from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    files = [ROOT / "train.py", *sorted((ROOT / "dali_pipe").rglob("*.py")), *sorted((ROOT / "model").rglob("*.py"))]
    mods = {_module_name(f): f for f in files}
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    import dali_pipe  # its public names are imported on first use, by module name: count those too

    graph["dali_pipe"] |= {f"dali_pipe.{m}" for m in dali_pipe._WHERE.values()}
    return graph


GRAPH = _graph()


def _is_cli(mod: str) -> bool:
    return mod.startswith("dali_pipe.cli") or mod == "dali_pipe.__main__"


API = ("dali_pipe", "dali_pipe.api")  # the public API layer: above the model side and the data side


def test_library_never_imports_the_cli():
    for mod, deps in GRAPH.items():
        if mod.startswith(("dali_pipe", "model")) and not _is_cli(mod):
            assert not {d for d in deps if d == "train" or d.startswith("dali_pipe.cli")}, (mod, deps)


def test_data_side_never_imports_the_model_side():
    for mod, deps in GRAPH.items():
        if mod.startswith("dali_pipe") and not _is_cli(mod) and mod not in API:
            assert not {d for d in deps if d.startswith("model")}, (mod, deps)


def test_nothing_below_the_api_imports_it():
    for mod, deps in GRAPH.items():
        if not _is_cli(mod) and mod not in API and mod != "train":
            assert "dali_pipe.api" not in deps, (mod, deps)


def test_settings_are_a_leaf():
    assert GRAPH["dali_pipe.config"] <= {"dali_pipe.errors"}
    assert GRAPH["dali_pipe.errors"] == set() and GRAPH["dali_pipe.forms"] <= {"dali_pipe.errors"}


def test_no_import_cycle():
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]):
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in GRAPH:
        if m not in state:
            visit(m, [m])


def _library_files():
    return [*sorted((ROOT / "dali_pipe").rglob("*.py")), *sorted((ROOT / "model").rglob("*.py"))]


def _function_local_imports(path: Path):
    """(line number, source line, target module) of each import inside a function or class body that takes
    one of the project's modules or a standard-library module."""
    src = path.read_text()
    tree = ast.parse(src)
    top = {id(n) for n in tree.body}
    lines = src.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top:
            continue
        if isinstance(node, ast.ImportFrom):
            own = node.level > 0 or (node.module or "").split(".")[0] in ("dali_pipe", "model")
            root = (node.module or "").split(".")[0]
        else:
            root = node.names[0].name.split(".")[0]
            own = root in ("dali_pipe", "model")
        if own or root in sys.stdlib_module_names:
            yield node.lineno, lines[node.lineno - 1], root


def test_own_and_standard_library_imports_sit_at_the_top():
    """A module's first screen is its place in the graph: the project's own modules and the standard library
    are imported at the top; the few exceptions (the CLI's dispatch to a command, whose module loads
    Lightning) say why on the line, and stay few."""
    lazy = []
    for path in _library_files():
        for lineno, line, _ in _function_local_imports(path):
            where = f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}"
            assert "# lazy: " in line, f"a function-local import without a '# lazy: reason' comment: {where}"
            lazy.append(where)
    assert len(lazy) <= 15, "\n".join(lazy)


def test_no_module_imports_another_modules_private_names():
    """What one module shares with another is public (no leading underscore) and documented where it lives."""
    for path in [ROOT / "train.py", *_library_files()]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").split(".")[0] in ("dali_pipe", "model")):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not private, f"{path.relative_to(ROOT)}:{node.lineno} imports {private} from {node.module}"


def test_ruff_finds_nothing():
    """ruff with the rule set of pyproject.toml ([tool.ruff.lint]: pyflakes' errors, syntax errors, sorted
    imports) over the whole tree."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--quiet", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _best_of(cmd: list[str], tries: int = 3) -> float:
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=60)
        best = min(best, time.perf_counter() - start)
    return best


def test_import_and_help_are_fast():
    """`import dali_pipe` (< 0.5 s) and `train.py --help` (< 1 s) load none of the heavy libraries: measured
    in a fresh interpreter, best of three (today about 0.05 s and 0.15 s on two cores, so the bounds leave a
    wide margin for a loaded machine)."""
    assert _best_of([sys.executable, "-c", "import dali_pipe"]) < 0.5
    assert _best_of([sys.executable, "train.py", "--help"]) < 1.0


def test_the_byte_mover_and_the_shard_modules_sit_below_the_pipeline():
    """transfer.py moves bytes for everyone and knows no shard format; the value types the pipeline reads
    (samples.py) sit below both the pipeline and the shard modules, so no shard module imports the pipeline."""
    assert not {d for d in GRAPH["dali_pipe.transfer"] if d.startswith("dali_pipe.shards")}
    for mod, deps in GRAPH.items():
        if mod.startswith("dali_pipe.shards"):
            assert "dali_pipe.pipeline" not in deps, (mod, deps)


def test_only_the_registry_names_a_form():
    """The form modules (dali_pipe/inputs/NAME.py) are imported by the registry alone: everything that reads
    data asks the registry, so a new form is its module, its line in FORMS and its test."""
    forms = {m for m in GRAPH if m.startswith("dali_pipe.inputs.") and m != "dali_pipe.inputs.form"}
    assert len(forms) >= 6
    for mod, deps in GRAPH.items():
        if mod != "dali_pipe.inputs" and mod not in forms:
            assert not deps & forms, (mod, deps & forms)


def test_what_the_tools_import_is_there():
    """Every `from dali_pipe... import NAME` in tools/, in code and in the scripts they run as strings, names
    something that exists (a module split once left a benchmark's upload script importing a name that had moved)."""
    import importlib
    import re

    pattern = re.compile(r"from (dali_pipe(?:\.\w+)*) import ([\w, ]+)")
    missing = []
    for path in sorted((ROOT / "tools").glob("*.py")):
        for mod, names in pattern.findall(path.read_text()):
            module = importlib.import_module(mod)
            for n in (n.split(" as ")[0].strip() for n in names.split(",")):
                package = hasattr(module, "__path__") and importlib.util.find_spec(f"{mod}.{n}") is not None
                if n and not hasattr(module, n) and not package:
                    missing.append(f"{path.name}: {mod}.{n}")
    assert not missing, missing
