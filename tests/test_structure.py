"""The package's shape (docs/design.md section 5): no import cycles, no reaching into
another module's private names or attributes, no two modules with one file name,
the CLI on serve's package face, one registry line and one file per architecture.

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


# The private attributes a module may read on an object it did not define, each
# with why: (module, what it reads) -> reason.
FOREIGN_PRIVATES = {
    ("flashnorm_mlx.interrupt", "os._exit"): "the standard library's exit without"
    " cleanup (a thread may be inside MLX); public despite its underscore",
    **{
        ("flashnorm_mlx.mlx_lm_compat", read): "the one module that reads mlx-lm's"
        " private names, each with a test that names the version when it changes"
        for read in (
            "rope._freqs",
            "rope._scale",
            "tokenizer._tokenizer",
            "stock._get_per_layer_inputs",
            "stock._project_per_layer_inputs",
        )
    },
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_privates(tree) -> set:
    """The private names a module defines: its functions, classes, methods,
    variables and the attributes its classes set (self._x = ...; `h._x = ...`
    on another object defines nothing)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            out.add(node.attr)
    return {n for n in out if _is_private(n)}


def _foreign_privates(name: str, path: Path, text=None) -> list:
    """(line, "x._name") for each `x._name` (or getattr(x, "_name")) read,
    called or set in `name` on an object other than self/cls where `_name` is no
    name `name` defines: another module's private attribute. Dunder names are
    public protocol."""
    tree = ast.parse(path.read_text() if text is None else text)
    own = _defined_privates(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            obj, attr = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            obj, attr = node.args[0], node.args[1].value
        else:
            continue
        if not _is_private(attr) or attr in own:
            continue
        if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
            continue
        found.append((node.lineno, f"{ast.unparse(obj)}.{attr}"))
    return found


def test_no_module_touches_another_modules_private_attributes():
    """serve's routes use the Handler's public methods (read_json, send_json,
    ...), never its _names; what remains is FOREIGN_PRIVATES, each with why,
    and each still needed."""
    reads = {
        (name, read, line)
        for name, path in MODULES.items()
        for line, read in _foreign_privates(name, path)
    }
    found = [
        f"{n}:{line}: {r}"
        for n, r, line in sorted(reads)
        if (n, r) not in FOREIGN_PRIVATES
    ]
    stale = set(FOREIGN_PRIVATES) - {(n, r) for n, r, _ in reads}
    assert not found and not stale, (found, sorted(stale))


@pytest.mark.parametrize(
    "line",
    [
        "def f(h):\n    h._send_json(200, {})\n",
        "def f(h):\n    return h._read_json()\n",
        "def f(h):\n    h._sent = True\n",
        "def f(h):\n    return getattr(h, '_keep_open')\n",
        "def f(s):\n    return s.worker._queue\n",
    ],
)
def test_a_private_attribute_of_the_handler_in_routes_is_found(line):
    """The rule sees serve/routes.py reach into an object's private attribute
    (the Handler's, or any other's), called, read, set or through getattr."""
    name = "flashnorm_mlx.serve.routes"
    path = MODULES[name]
    assert _foreign_privates(name, path) == []
    assert _foreign_privates(name, path, path.read_text() + line), line


def test_no_two_modules_share_a_file_name():
    """One meaning per word: a file name says which module it is, wherever it
    stands (cli/bench.py is the bench command, jobs/speed.py what it measures), so no
    two modules share one; a package's __init__.py is named by its folder."""
    by_name = {}
    for f in sorted(ROOT.rglob("*.py")):
        if f.name != "__init__.py":
            by_name.setdefault(f.name, []).append(str(f.relative_to(ROOT.parent)))
    shared = {n: paths for n, paths in by_name.items() if len(paths) > 1}
    assert not shared, "; ".join(f"{n}: {', '.join(p)}" for n, p in shared.items())


def _serve_internals(name: str, path: Path, text=None) -> list:
    """What `name` takes from inside serve rather than from its package face
    (flashnorm_mlx.serve's __all__)."""
    from flashnorm_mlx import serve

    found = []
    for mod, names in _imports(name, path, text):
        if mod.startswith("flashnorm_mlx.serve."):
            found.append(f"{name} imports {mod}")
        elif mod == "flashnorm_mlx.serve":
            found += [f"{name}: serve.{n}" for n in names if n not in serve.__all__]
    return found


def test_the_cli_takes_serve_through_its_package_face():
    """cli/ uses serve's public face alone, so serve's modules can change shape
    without the CLI knowing (the other commands call their library module's
    public functions: test_no_private_names_taken_from_other_modules)."""
    found = [
        f
        for name, path in MODULES.items()
        if name.startswith("flashnorm_mlx.cli")
        for f in _serve_internals(name, path)
    ]
    assert not found, found


@pytest.mark.parametrize(
    "line",
    [
        "from ..serve.scheduler import Worker\n",
        "def f():\n    from ..serve import compare\n",
        "from ..serve import RequestError\n",  # serve's, but not on its face
    ],
)
def test_a_serve_internal_in_cli_serve_is_found(line):
    name = "flashnorm_mlx.cli.serve"
    path = MODULES[name]
    assert _serve_internals(name, path) == []
    assert _serve_internals(name, path, path.read_text() + line), line


# A mode is a record (flashnorm_mlx/modes.py) that code asks, never a name it
# compares: its names are for flags, JSON and printing (docs/design.md section 1).
MODE_NAMES = {"stock", "stock_fused", "nonorm", "flashnorm"}
MODE_HOMES = {"flashnorm_mlx.modes", "flashnorm_mlx.loading.rows"}


def _mode_name_compares(text: str) -> list:
    """(line, name) of every comparison (==, !=, in, is, ...) with a mode's
    name as a literal, alone or in a literal tuple, list or set."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = (
                side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else []
            )
            for lit in (side, *items):
                if isinstance(lit, ast.Constant) and lit.value in MODE_NAMES:
                    found.append((node.lineno, lit.value))
    return found


def test_no_code_compares_a_mode_by_its_name():
    found = [
        f"{path.relative_to(ROOT.parent)}:{line} compares {value!r}"
        for name, path in MODULES.items()
        if name not in MODE_HOMES
        for line, value in _mode_name_compares(path.read_text())
    ]
    assert not found, "ask the mode's record (modes.Mode) instead: " + "; ".join(found)


@pytest.mark.parametrize(
    "code, n",
    [
        ('if mode == "stock":\n    pass\n', 1),
        ('x = "flashnorm" in modes\n', 1),
        ('ok = m not in ("nonorm", "stock_fused")\n', 2),
        ('p.add_argument("--mode", choices=("stock", "flashnorm"))\n', 0),
        ('print(f"{mode} is not stock"); rows = {"stock": 1}\n', 0),
    ],
)
def test_a_mode_compared_by_name_is_found(code, n):
    """The rule sees a comparison with a mode's name, and leaves choices,
    text and dictionary keys alone."""
    got = _mode_name_compares(code)
    print(code, got)
    assert len(got) == n, got


def test_every_registered_architecture_has_its_model_file():
    for model_type, file in models.ARCHITECTURES.items():
        config = {"model_type": model_type}
        module = models.model_module(config)
        assert module.__name__ == f"flashnorm_mlx.models.{file}", model_type
        assert models.architecture({"model_type": model_type}) is module.ARCH
        for attr in ("ARCH", "Model", "ModelArgs"):
            assert hasattr(module, attr), (model_type, attr)
    model_files = {
        p.stem
        for p in (ROOT / "models").glob("*.py")
        if hasattr(__import__(f"flashnorm_mlx.models.{p.stem}", fromlist=["x"]), "ARCH")
    }
    assert model_files == set(models.ARCHITECTURES.values()), model_files


def test_each_familys_decoder_reads_its_own_contract():
    """The decoder a family defines reads that family's `ARCH`, the one the
    registry gives, not the contract of the family its class came from
    (Qwen3's decoder once read Llama's, without Qwen3's QK-norms)."""
    from flashnorm_mlx.models.decoder import Decoder

    for file in set(models.ARCHITECTURES.values()):
        module = __import__(f"flashnorm_mlx.models.{file}", fromlist=["x"])
        decoders = [
            c
            for c in vars(module).values()
            if isinstance(c, type)
            and issubclass(c, Decoder)
            and c.__module__ == module.__name__
        ]
        for c in decoders:
            assert c.ARCH is module.ARCH, (file, c.__name__)
    assert "ARCH" not in vars(Decoder)  # declared, never defaulted


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


# The commands (cli/<command>.py) and the library modules (or package) doing
# each one's work, named for what they compute: the commands sit side by side
# above the library, and what they share lives below them (engine, timing,
# loading.rows, models, prompt_cache, decode_options).
COMMANDS = {
    "bench": ("jobs.speed", "jobs.speed_draft"),
    "cache_prompt": (),
    "chat": ("jobs.conversation",),
    "convert": ("jobs.checkpoint",),
    "generate": (),
    "perplexity": ("jobs.likelihood",),
    "serve": ("serve",),
    "verify": ("jobs.equivalence",),
}


def _command_of(module: str):
    """The command `module` belongs to: flashnorm_mlx.cli.<command>, or one of
    its library modules flashnorm_mlx.<library>[.*]; None for the library below."""
    parts = module.split(".")[1:]
    if parts[:1] == ["cli"]:
        return parts[1] if parts[1:] and parts[1] in COMMANDS else None
    for command, library in COMMANDS.items():
        if any(parts[: len(m.split("."))] == m.split(".") for m in library):
            return command
    return None


def test_each_command_library_module_exists():
    """A renamed library module must be renamed here too, or its command's
    rules below would silently stop covering it."""
    missing = [
        f"{command}: {m}"
        for command, library in COMMANDS.items()
        for m in library
        if f"flashnorm_mlx.{m}" not in MODULES
    ]
    assert not missing, missing


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


MAX_FUNCTION_LINES = 80  # the developers' guide: a function reads on one screen
# Longer ones at their line counts (def to last line), should one ever need
# to wait: each may only shrink, and leaves the list once it is at most
# MAX_FUNCTION_LINES. None is over it today.
LONG_FUNCTIONS = {}


def _function_lines(tree, prefix=""):
    """(qualified name, lines from `def` to its last line) of every function
    and method under `tree`, nested ones too."""
    for n in ast.iter_child_nodes(tree):
        name = f"{prefix}{getattr(n, 'name', '')}"
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield name, n.end_lineno - n.lineno + 1
        deeper = isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        yield from _function_lines(n, f"{name}." if deeper else prefix)


def long_function_problems(root: Path, listed: dict, limit=MAX_FUNCTION_LINES):
    """What breaks the rule under `root`: an unlisted function over `limit`, a
    listed one grown past its count, and a listed one that is short now or gone."""
    found = {
        f"{f.relative_to(root).as_posix()}::{name}": n
        for f in sorted(root.rglob("*.py"))
        for name, n in _function_lines(ast.parse(f.read_text()))
    }
    problems = []
    for key, n in sorted(found.items()):
        if key not in listed and n > limit:
            problems.append(f"{key}: {n} lines, over {limit}")
        elif key in listed and n > listed[key]:
            problems.append(f"{key}: {n} lines, grown past its listed {listed[key]}")
        elif key in listed and n <= limit:
            problems.append(f"{key}: {n} lines now; take it off the list")
    problems += [f"{key}: listed but gone" for key in listed if key not in found]
    return problems


def test_no_function_is_over_80_lines_but_the_listed_which_only_shrink():
    problems = long_function_problems(ROOT, LONG_FUNCTIONS)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "lines,listed,want",
    [
        (81, {}, "pkg/m.py::f: 81 lines, over 80"),
        (80, {}, None),
        (82, {"pkg/m.py::f": 81}, "pkg/m.py::f: 82 lines, grown past its listed 81"),
        (81, {"pkg/m.py::f": 81}, None),
        (80, {"pkg/m.py::f": 81}, "pkg/m.py::f: 80 lines now; take it off the list"),
    ],
)
def test_the_function_length_rule_catches_each_way_to_break_it(
    tmp_path, lines, listed, want
):
    """The checker on a module it is handed: a function of `lines` lines (def
    to last line), in a class, against `listed`."""
    body = "".join(f"        x{i} = {i}\n" for i in range(lines - 2))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        f"class C:\n    def f(self):\n{body}        return 0\n"
    )
    listed = {k.replace("::f", "::C.f"): n for k, n in listed.items()}
    got = long_function_problems(tmp_path, listed)
    assert got == ([want.replace("::f", "::C.f")] if want else []), got


def _defined(path: Path) -> set:
    """The functions a test file defines, and the names it assigns at module
    level: fixtures tests/family.py makes (`folder, source, stock_q4 = ...`)."""
    tree = ast.parse(path.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for n in tree.body:
        for target in n.targets if isinstance(n, ast.Assign) else ():
            names |= {t.id for t in ast.walk(target) if isinstance(t, ast.Name)}
    return names


def test_the_slow_record_and_launches_name_tests_and_fixtures_that_exist():
    """tests/durations.json's slow entries (the developer loop leaves them
    out): a renamed test or fixture would silently rejoin the loop, until the
    record is refreshed; and conftest's LAUNCHES (one at a time under
    pytest-xdist)."""
    import conftest
    import durations

    stale = []
    names = {}  # file -> (test or fixture names, or () for the whole file)
    for entry in conftest.LAUNCHES:  # "file" (all its tests) or "file::test"
        file, _, test = entry.partition("::")
        names[file] = names.get(file, ()) + ((test,) if test else ())
    for kind in ("tests", "fixtures"):
        for entry, seconds in conftest.DURATIONS[kind].items():
            file, _, name = entry.partition("::")
            if seconds >= durations.SLOW_S:
                names[file] = names.get(file, ()) + (name,)
    for file, defined in names.items():
        path = ROOT.parent / "tests" / file
        stale += [] if path.exists() else [file]
        defs = _defined(path) if path.exists() else set()
        stale += [f"{file}::{n}" for n in defined if n not in defs]
    assert not stale, stale


def _fast_tests(path: Path):
    """The test functions of a test file that `pytest -m "not slow"` runs: not
    marked slow by the file's pytestmark, a decorator or tests/durations.json."""
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
