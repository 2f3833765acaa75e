"""The package's shape (docs/design.md section 5): no import cycles, no reaching into
another module's private names, one registry line and one file per architecture.

Read from the source with `ast`, imports inside functions included, so a lazy
import cannot hide a cycle.
"""

import ast
from pathlib import Path

import pytest

from flashnorm_mlx import models

ROOT = Path(__file__).resolve().parent.parent / "flashnorm_mlx"


def _modules():
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path, text=None):
    """(imported project module, names taken from it) for every import in `path`
    (or in `text`, read as that file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            subs = [s for s in subs if s in MODULES]
            if subs:
                yield from ((s, []) for s in subs)
            elif base in MODULES:
                yield base, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names if a.name in MODULES)


GRAPH = {
    name: {m for m, _ in _imports(name, path) if m != name}
    for name, path in MODULES.items()
}


def test_no_import_cycles():
    def visit(node, stack):
        for nxt in sorted(GRAPH[node]):
            if nxt in stack:
                return stack[stack.index(nxt) :] + [nxt]
            cycle = visit(nxt, stack + [nxt])
            if cycle:
                return cycle
        return None

    for name in MODULES:
        cycle = visit(name, [name])
        assert cycle is None, " -> ".join(cycle)


def _private_names(name: str, path: Path, text=None) -> list:
    """Another module's private names `name` takes: imported, or as `mod._x`."""
    found = []
    aliases = {}  # local name -> project module, for `mod._private` access
    for mod, names in _imports(name, path, text):
        found += [
            f"{name}: from {mod} import {n}"
            for n in names
            if n.startswith("_") and not n.startswith("__")
        ]
        aliases[mod.rpartition(".")[2]] = mod
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and aliases[node.value.id] != name
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{name}: {node.value.id}.{node.attr}")
    return found


def test_no_private_names_taken_from_other_modules():
    """cli/ included: the commands call the library's public functions."""
    found = [f for name, path in MODULES.items() for f in _private_names(name, path)]
    assert not found, found


@pytest.mark.parametrize(
    "line",
    [
        "from ..serve.scheduler import _batch_size\n",
        "from ..serve import scheduler\nscheduler._batch_size\n",
        "def f():\n    from ..serve.sequential import _one\n",
    ],
)
def test_a_private_name_from_serve_in_cli_generate_is_found(line):
    """The rule sees cli/generate.py take a private name from serve, at the top
    or inside a function (cli/ is not exempt)."""
    name = "flashnorm_mlx.cli.generate"
    path = MODULES[name]
    assert _private_names(name, path) == []
    assert _private_names(name, path, path.read_text() + line), line


def test_every_registered_architecture_has_its_model_file():
    for model_type, file in models.ARCHITECTURES.items():
        module = models.model_module({"model_type": model_type})
        assert module.__name__ == f"flashnorm_mlx.models.{file}", model_type
        for attr in ("ARCH", "Model", "ModelArgs"):
            assert hasattr(module, attr), (model_type, attr)
    model_files = {
        p.stem
        for p in (ROOT / "models").glob("*.py")
        if hasattr(__import__(f"flashnorm_mlx.models.{p.stem}", fromlist=["x"]), "ARCH")
    }
    assert model_files == set(models.ARCHITECTURES.values()), model_files


@pytest.mark.parametrize(
    "model_type, words",
    [
        ("gpt2", "FlashNorm does not cover model_type 'gpt2'"),  # mlx-lm's: stock
        ("no_such_family", "unsupported model_type 'no_such_family'"),
        (None, "unsupported model_type None"),
    ],
)
def test_unknown_model_type_is_one_clear_error(model_type, words):
    with pytest.raises(models.UnsupportedModel, match=words):
        models.architecture({"model_type": model_type})


def test_the_design_map_names_every_module_and_folder_of_the_package_root():
    """docs/design.md section 5 is where a newcomer finds the pipeline: each
    module (`name.py`) and folder (`name/`) of the package root is named there."""
    doc = (ROOT.parent / "docs" / "design.md").read_text()
    section = doc[doc.index("## 5. Map of the package") :]
    entries = [
        f"{p.name}/" if p.is_dir() else p.name
        for p in sorted(ROOT.iterdir())
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
    ]
    missing = [e for e in entries if f"`{e}" not in section]
    assert not missing, f"not on the map: {missing}"


# The commands, each a library module (or package) with its CLI in cli/: they sit
# side by side above the library, and what they share lives below them
# (engine, timing, loading.variants, models).
COMMANDS = (
    "bench",
    "cache_prompt",
    "chat",
    "convert",
    "generate",
    "perplexity",
    "serve",
    "verify",
)


def _command_of(module: str):
    """The command `module` belongs to: flashnorm_mlx.<command>[.*] or
    flashnorm_mlx.cli.<command>; None for the library below them."""
    parts = module.split(".")[1:]
    if parts[:1] == ["cli"]:
        parts = parts[1:]
    return parts[0] if parts and parts[0] in COMMANDS else None


def test_the_commands_import_none_of_each_other():
    crossed = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        for dep in deps
        if _command_of(name)
        and _command_of(dep)
        and _command_of(dep) != _command_of(name)
    ]
    below = [
        f"{name} (library, or the CLI the commands share) imports {dep}"
        for name, deps in GRAPH.items()
        if not _command_of(name) and name != "flashnorm_mlx.cli"  # the dispatcher
        for dep in deps
        if _command_of(dep)
    ]
    assert not crossed and not below, crossed + below


def test_every_command_module_is_covered_by_the_rules():
    """Every command the CLI dispatches is a COMMANDS entry here, so its module
    is checked (generate and cache-prompt included)."""
    from flashnorm_mlx.cli import COMMANDS as DISPATCHED

    modules = {module for module, _ in DISPATCHED.values()}
    assert modules == set(COMMANDS), sorted(modules ^ set(COMMANDS))
    for module in modules:
        assert _command_of(f"flashnorm_mlx.cli.{module}") == module


def test_the_engine_owns_compilation():
    """Models know no engine: blocks and model files import neither the engine
    nor its step, and only engine.py calls mx.compile."""
    models_import_engine = [
        name
        for name, deps in GRAPH.items()
        if name.startswith("flashnorm_mlx.models") and "flashnorm_mlx.engine" in deps
    ]
    assert not models_import_engine, models_import_engine
    compiling = sorted(
        name for name, path in MODULES.items() if "mx.compile(" in path.read_text()
    )
    assert compiling == ["flashnorm_mlx.engine"], compiling


MAX_MODULE_LINES = 500  # the developers' guide: split a module by concern past this


def test_no_module_is_over_the_line_limit():
    """Every module of the package is at most MAX_MODULE_LINES lines."""
    over = {
        str(path.relative_to(ROOT.parent)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"over {MAX_MODULE_LINES} lines: " + ", ".join(
        f"{p} ({n} lines)" for p, n in sorted(over.items())
    )


def test_the_slow_list_names_tests_and_fixtures_that_exist():
    """tests/conftest.py's SLOW and SLOW_FIXTURES (the developer loop leaves
    them out): a renamed test or fixture would silently rejoin the loop; and
    LAUNCHES (one at a time under pytest-xdist)."""
    import conftest

    stale = []
    launches = {}
    for entry in conftest.LAUNCHES:  # "file" (all its tests) or "file::test"
        file, _, test = entry.partition("::")
        launches[file] = launches.get(file, ()) + ((test,) if test else ())
    for table in (conftest.SLOW, conftest.SLOW_FIXTURES, launches):
        for file, names in table.items():
            path = ROOT.parent / "tests" / file
            stale += [] if path.exists() else [file]
            defs = (
                {
                    n.name
                    for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.FunctionDef)
                }
                if path.exists()
                else set()
            )
            stale += [f"{file}::{n}" for n in names if n not in defs]
    assert not stale, stale


def _fast_tests(path: Path):
    """The test functions of a test file that `pytest -m "not slow"` runs: not
    marked slow by the file's pytestmark, a decorator or tests/conftest.py."""
    import conftest

    tree = ast.parse(path.read_text())
    for n in tree.body:
        targets = [getattr(t, "id", "") for t in getattr(n, "targets", ())]
        if "pytestmark" in targets and "slow" in ast.unparse(n.value):
            return []
    return [
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and n.name.startswith("test_")
        and "pytest.mark.slow" not in map(ast.unparse, n.decorator_list)
        and not conftest.is_slow(path.name, n.name, [a.arg for a in n.args.args])
    ]


def test_every_test_file_has_a_fast_test():
    """The developer loop exercises what each test file covers, if not all of it."""
    tests = ROOT.parent / "tests"
    bare = [p.name for p in sorted(tests.glob("test_*.py")) if not _fast_tests(p)]
    assert not bare, f"only slow tests in {bare}"
