"""The import structure: the library never imports its CLI, the data side never imports the model
side, the public API (dali_pipe/__init__.py, dali_pipe/api.py) sits above both and nothing below imports
it, and no project module imports itself back through others (all imports count, lazy ones too, and
the package's lazily exported names)."""
from __future__ import annotations

import ast
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
    assert GRAPH["dali_pipe.errors"] == set()


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
