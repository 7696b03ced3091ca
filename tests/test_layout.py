"""The code's rooms: no module imports from a floor above its own, no two modules import each
other, however indirectly (an import inside a function counts: it is a dependency all the same;
so does a module imported by its name, with `importlib.import_module`), and the packages the
README names exist."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hotjax", "models", "sharding", "scripts")
# The folders at the top of the tree that install inside `hotjax` (pyproject.toml's package-dir).
INSTALLED_AS = {"models": "hotjax.models", "sharding": "hotjax.sharding"}
# The floors, lowest first: a module imports from its own floor and those below, never above. A
# module's floor is that of the longest name here it starts with.
FLOORS = (
    # The ground floor: errors, bounds on untrusted values, paths, the choices of options.
    ("hotjax.errors", "hotjax.bounds", "hotjax.paths", "hotjax.choices"),
    ("hotjax.models",),  # the model alone
    ("hotjax.sharding",),  # strategies: how the model is laid out on devices
    ("hotjax",),  # the library: runs, data, checkpoints, planning
    # The command line, thin users of the library: its commands and its two `python -m` entries
    # (`hotjax.peak` runs `hotjax.cli.main`).
    ("hotjax.commands", "hotjax.cli", "hotjax.peak"),
    ("scripts",),  # the benchmarks, which may use anything
)


def _module(path: Path, root: Path = ROOT) -> str:
    """The name `path` is imported by once installed."""
    parts = path.relative_to(root).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    top, dot, rest = name.partition(".")
    return INSTALLED_AS[top] + dot + rest if top in INSTALLED_AS else name


def _type_checking(tree: ast.AST) -> set[ast.AST]:
    """The nodes under `if TYPE_CHECKING:`, which never run."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If)
            and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
            for statement in block.body for node in ast.walk(statement)}


def _by_name(tree: ast.AST, modules: set[str]) -> set[str]:
    """The project's modules `tree` imports by name: the string given to
    `importlib.import_module`, and where the name is computed (`import_module(NAMES[key])`),
    every string in the module that names one of them."""
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
             in ("import_module", "__import__") and node.args]
    if all(isinstance(call.args[0], ast.Constant) for call in calls):
        return {call.args[0].value for call in calls} & modules
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in modules}


def _imports(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The project's modules `path` imports, anywhere in it but under `if TYPE_CHECKING:`."""
    package = (_module(path, root) if path.name == "__init__.py"
               else _module(path, root).rpartition(".")[0])
    tree = ast.parse(path.read_text())
    found, skipped = _by_name(tree, modules), _type_checking(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from hotjax.planning import search` imports the submodule where there is one.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = [f for p in PACKAGES for f in (root / p).rglob("*.py")]
    modules = {_module(f, root) for f in files}
    return {_module(f, root): _imports(f, modules, root) - {_module(f, root)} for f in files}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _floor(module: str) -> int:
    return max((len(name), floor) for floor, names in enumerate(FLOORS) for name in names
               if module == name or module.startswith(f"{name}."))[1]


def _climbs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports from a floor up to a higher one, as (importer, imported)."""
    return sorted((module, imported) for module, imports in graph.items() for imported in imports
                  if _floor(imported) > _floor(module))


def test_no_import_climbs_a_floor():
    assert _climbs(_graph()) == []


def test_the_floor_checker_finds_every_climb():
    graph = {
        "hotjax.models.llama": {"hotjax.sharding.strategy", "hotjax.errors"},
        "hotjax.sharding.table": {"hotjax.config"},
        "hotjax.errors": {"hotjax.models.llama"},
        "hotjax.data.stats": {"hotjax.commands.options", "hotjax.config"},
        "hotjax.checkpoint.store": {"hotjax.cli"},
        "hotjax.run": {"hotjax.models.llama", "scripts.bench_ckpt"},
        "hotjax.commands.ckpt": {"hotjax.run", "hotjax.cli"},
        "scripts.bench_ckpt": {"hotjax.cli", "hotjax.models.llama"},
    }
    assert _climbs(graph) == [("hotjax.checkpoint.store", "hotjax.cli"),
                              ("hotjax.data.stats", "hotjax.commands.options"),
                              ("hotjax.errors", "hotjax.models.llama"),
                              ("hotjax.models.llama", "hotjax.sharding.strategy"),
                              ("hotjax.run", "scripts.bench_ckpt"),
                              ("hotjax.sharding.table", "hotjax.config")]


def test_a_climb_inside_a_function_or_by_name_is_found(tmp_path):
    """As `hotjax.data.cli` once took its options from `hotjax.commands.options`; here one
    library module imports a command inside a function, another loads one by its name."""
    package = tmp_path / "hotjax"
    for folder in ("commands", "data", "checkpoint"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "commands" / "options.py").write_text("")
    (package / "data" / "stats.py").write_text(
        "def stats():\n    from hotjax.commands.options import add_options\n")
    (package / "checkpoint" / "formats.py").write_text(
        'import importlib\n\n\ndef register():\n'
        '    importlib.import_module("hotjax.commands.options")\n')
    assert _climbs(_graph(tmp_path)) == [("hotjax.checkpoint.formats", "hotjax.commands.options"),
                                         ("hotjax.data.stats", "hotjax.commands.options")]


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_circle_made_by_importing_a_name_is_found(tmp_path):
    """As `hotjax.cli` once loaded `hotjax.planning.cli` by its name from a list, and that
    imported `hotjax.cli` back."""
    package = tmp_path / "hotjax"
    (package / "planning").mkdir(parents=True)
    for name in ("__init__.py", "planning/__init__.py"):
        (package / name).write_text("")
    (package / "cli.py").write_text(
        'import importlib\nCOMMANDS = ("hotjax.planning.cli",)\n\n\ndef parser():\n'
        '    for name in COMMANDS:\n        importlib.import_module(name).register()\n')
    (package / "planning" / "cli.py").write_text(
        "def register():\n    from hotjax.cli import parser\n")
    assert _cycles(_graph(tmp_path)) == [["hotjax.cli", "hotjax.planning.cli"]]


def test_the_package_face_starts_nothing_and_shows_its_names():
    """Importing `hotjax` imports neither JAX nor the planner; its lazy names are listed."""
    done = subprocess.run([sys.executable, "-c", "import sys, hotjax; print(sorted(sys.modules)); "
                           "print(dir(hotjax))"], capture_output=True, text=True, check=True,
                          cwd=ROOT)
    loaded, names = done.stdout.splitlines()
    assert "'jax'" not in loaded and "hotjax.planning" not in loaded
    assert all(f"'{name}'" in names for name in ("Run", "RunConfig", "StrategyTable",
                                                  "start_jax", "LlamaConfig"))


def test_planning_is_one_package():
    planning = {m for m in _graph() if m.startswith("hotjax.planning.")}
    assert planning >= {"hotjax.planning.search", "hotjax.planning.cost",
                        "hotjax.planning.profile", "hotjax.planning.measure"}
    assert not any(m.endswith(".cli") for m in planning)  # its command is in hotjax.commands


def _sys_path_edits(path: Path) -> list[int]:
    """The lines of `path` that change `sys.path`: a call of a method that edits it
    (`sys.path.insert(0, ...)`), an assignment to it or to a slice of it, or `site.addsitedir`."""
    def is_sys_path(node: ast.AST | None) -> bool:
        node = node.value if isinstance(node, ast.Subscript) else node
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")

    def edits(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            return method == "addsitedir" or (is_sys_path(node.func.value) and method
                                              in ("insert", "append", "extend", "remove"))
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        return isinstance(node, ast.Assign | ast.AugAssign) and any(map(is_sys_path, targets))

    return sorted(node.lineno for node in ast.walk(ast.parse(path.read_text())) if edits(node))


def test_no_module_edits_sys_path():
    """The packages are installed, and a script run as a file finds those beside it (its folder
    is first on `sys.path`; pytest puts `scripts/` there for the tests): nothing needs to reach
    for `sys.path`."""
    edits = {f"{f.relative_to(ROOT)}:{line}" for p in (*PACKAGES, "tests", "examples")
             for f in (ROOT / p).rglob("*.py")
             for line in _sys_path_edits(f)}
    assert edits == set()


def test_the_sys_path_checker_finds_every_edit(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("import site\nimport sys\nfrom pathlib import Path\n\n"
                      "sys.path.insert(0, str(Path(__file__).parent))\n"
                      "sys.path += ['..']\nsys.path[0:0] = ['.']\nsite.addsitedir('.')\n"
                      "print(sys.path[0])\n")
    assert _sys_path_edits(script) == [5, 6, 7, 8]


def _top_level_imports(path: Path) -> set[str]:
    """The top-level packages `path`'s import statements name."""
    tree = ast.parse(path.read_text())
    return {alias.name.partition(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
            for alias in node.names} | {(node.module or "").partition(".")[0]
                                        for node in ast.walk(tree)
                                        if isinstance(node, ast.ImportFrom) and not node.level}


def test_models_and_sharding_are_imported_inside_hotjax():
    """Run from the tree's root, `import models` would find the folder and pass here while an
    installed copy fails; every file imports them by the names they install under."""
    files = [f for folder in (*PACKAGES, "tests", "examples")
             for f in (ROOT / folder).rglob("*.py")]
    assert sorted(str(f.relative_to(ROOT)) for f in files
                  if _top_level_imports(f) & set(INSTALLED_AS)) == []


def test_every_package_folder_is_installed():
    """pyproject.toml lists its packages by hand (two install under other names): a new folder
    with an `__init__.py` is listed, or an installed copy lacks it."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {_module(f.parent / "__init__.py") for p in ("hotjax", *INSTALLED_AS)
               for f in (ROOT / p).rglob("__init__.py")}
    assert sorted(setup["packages"]) == sorted(folders)
    assert setup["package-dir"] == {name: folder for folder, name in INSTALLED_AS.items()}
