"""The package's layers are a fact the build checks: import-linter's contracts in pyproject.toml hold
(function-local imports included), and ``Store`` is composed, not mixed together."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import mmreplay
from mmreplay.store import Store

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    pytest.importorskip("importlinter")
    # lint-imports itself, as CI would run it (in a child: it configures import-linter process-wide)
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"import-linter found a broken contract:\n{run.stdout}\n{run.stderr}"
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", run.stdout)
    assert kept and int(kept.group(1)) >= 5, run.stdout  # layers, optional deps, storage rooms, two storage surfaces
    assert "storage/ rooms: public -> durability -> format -> files KEPT" in run.stdout, run.stdout
    for contract in ("sampling/ imports no storage internals", "distributed/ imports no storage internals"):
        assert f"{contract} (only mmreplay.storage.public) KEPT" in run.stdout, run.stdout


def test_store_is_composed_not_mixed_in():
    assert Store.__mro__ == (Store, object)  # help(Store) shows no WritePath base


def test_public_names_resolve_and_are_documented():
    for name in mmreplay.__all__:
        value = getattr(mmreplay, name)
        if isinstance(value, type):
            assert value.__doc__ and value.__doc__.strip(), f"mmreplay.{name} has no docstring"


# -- import cycles: module-level and function-level imports alike ---------------------------------------

PACKAGE = ROOT / "mmreplay"


def _module_files(package_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    modules = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(path: pathlib.Path, package: str) -> set[str]:
    """Every name an ``import`` anywhere in the file brings in (inside functions too), fully qualified:
    ``from a.b import c`` gives ``a.b.c`` (a module or a name of ``a.b``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package upwards
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(package_dir: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name imported from a module counts as that module)."""
    modules = _module_files(package_dir)
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for name in _imported_names(path, package):
            while name and name not in modules:  # a.b.c where c is a class of a.b: the module a.b
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative):
    each is a set of modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_cycle_finder_sees_function_level_and_indirect_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import other\n")  # function-level, relative
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a\n")  # imports into the cycle, is not part of it
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.d"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_import_cycles_in_the_package():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and "mmreplay.store" in graph["mmreplay.integrations.torchrl_storage"]  # parsed it all
    cycles = import_cycles(graph)
    assert not cycles, "modules that import each other (module- or function-level imports): " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_no_import_cycles_in_the_bench_harness():
    graph = import_graph(ROOT / "scripts" / "benchmarks")
    assert "benchmarks.modes.ltr_big" in graph and "benchmarks.modes.ltr_checks" in graph["benchmarks.modes.ltr_big"]
    cycles = import_cycles(graph)
    assert not cycles, "bench modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


# -- docstrings: every class of the data path says what it is ------------------------------------------

DATA_PATH = ("reading", "storage", "sampling", "index", "columns", "_native", "codecs", "device")


def test_every_data_path_class_has_a_docstring():
    missing = []
    for layer in DATA_PATH:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and not (ast.get_docstring(node) or "").strip():
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not missing, "classes without a docstring (say what it is and its invariant):\n" + "\n".join(missing)


# -- size: no hub on the data path (issue #39) ------------------------------------------------------------

MAX_CLASS_LINES, MAX_CLASS_METHODS, MAX_MODULE_LINES = 300, 25, 600
# Being split right now (issue #39): an entry goes when its split lands. Not a place for new entries.
BEING_SPLIT: set[str] = set()


def oversized(paths, root: pathlib.Path, max_class_lines: int, max_methods: int, max_module_lines: int) -> dict:
    """``"path"`` or ``"path:Class"`` -> why it is too large, for modules over ``max_module_lines`` lines and
    classes (nested ones too) over ``max_class_lines`` lines or ``max_methods`` methods (properties and static
    methods count: each is a name a reader of the class must learn)."""
    found = {}
    for path in paths:
        source = path.read_text()
        where = path.relative_to(root).as_posix()
        if len(source.splitlines()) > max_module_lines:
            found[where] = f"{len(source.splitlines())} lines"
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if lines > max_class_lines or methods > max_methods:
                    found[f"{where}:{node.name}"] = f"{lines} lines, {methods} methods"
    return found


def test_the_size_check_sees_long_classes_many_methods_and_long_modules(tmp_path):
    methods = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(6))
    (tmp_path / "many.py").write_text(f"class Many:\n    x = 0\n{methods}\n\nclass Few:\n    x = 1\n")
    (tmp_path / "long.py").write_text("class Outer:\n    class Long:\n" + "        x = 1\n" * 20 + "\n" * 30)
    found = oversized(sorted(tmp_path.glob("*.py")), tmp_path, max_class_lines=15, max_methods=5,
                      max_module_lines=40)
    assert found == {"many.py:Many": "14 lines, 6 methods", "long.py:Outer": "22 lines, 0 methods",
                     "long.py:Long": "21 lines, 0 methods", "long.py": "52 lines"}, found


def test_no_data_path_class_or_module_is_a_hub():
    """No class of the data path over 300 lines or 25 methods, no module over 600 lines: a concern that large is
    several (the read path is a router over one source per tier, not one class that does everything)."""
    paths = [p for layer in DATA_PATH for p in sorted((PACKAGE / layer).rglob("*.py"))]
    assert len(paths) > 60  # it found the data path
    found = oversized(paths, ROOT, MAX_CLASS_LINES, MAX_CLASS_METHODS, MAX_MODULE_LINES)
    too_large = {where: why for where, why in found.items() if where not in BEING_SPLIT}
    assert not too_large, f"too large (split it by concern): {too_large}"


def test_the_frame_reader_is_a_router_over_sources():
    """``FrameReader`` routes (at most 250 lines, 25 methods), and a disk-path change touches one source: of the
    reader and its sources (``reading/sources/``), only ``sources/files.py`` imports the disk path
    (``reading/disk.py``, ``reading/runs.py``). Every module of reading/ opens with its invariant."""
    reading = sorted((PACKAGE / "reading").rglob("*.py"))
    found = oversized(reading, ROOT, 250, 25, MAX_MODULE_LINES)
    assert "mmreplay/reading/frames.py:FrameReader" not in found, found
    graph = import_graph(PACKAGE)
    readers = {m for m in graph if m == "mmreplay.reading.frames" or m.startswith("mmreplay.reading.sources.")}
    assert len(readers) >= 5 and "mmreplay.reading.sources.files" in readers, readers
    disk_path = {"mmreplay.reading.disk", "mmreplay.reading.runs"}
    assert {m for m in readers if graph[m] & disk_path} == {"mmreplay.reading.sources.files"}, graph
    silent = [p.relative_to(ROOT).as_posix() for p in reading if p.read_text().strip()
              and "Invariant" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert not silent, f"reading/ modules that do not open with their invariant: {silent}"


def test_clock_ids_come_from_the_time_module():
    """A compiled kernel's ``clock_gettime`` clock id is ``time.CLOCK_*``, never a literal (ids differ by OS)."""
    literals = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                names = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("CLOCK_")]
                literals += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names]
    assert not literals, f"clock ids given as literals: {literals}"


def _compiled_functions(path: pathlib.Path) -> list[str]:
    """Functions of a file decorated with numba (``njit``, ``jit``, ``intrinsic``, ...) or compiled by a call."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                text = ast.unparse(deco)
                if "numba" in text or "njit" in text or "intrinsic" in text or text.startswith("_typed"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return found


def test_compiled_code_lives_in_the_native_package():
    """Every numba kernel and intrinsic is in ``mmreplay/_native`` (one place to audit raw writes), and
    every module there states its invariant."""
    outside = [f for path in sorted(PACKAGE.rglob("*.py")) if "_native" not in path.parts
               for f in _compiled_functions(path)]
    assert not outside, f"compiled code outside mmreplay/_native: {outside}"
    inside = [f for path in sorted((PACKAGE / "_native").rglob("*.py")) for f in _compiled_functions(path)]
    assert len(inside) > 40, inside  # it found the kernels
    for path in sorted((PACKAGE / "_native").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "Invariant" in doc, f"{path.relative_to(ROOT)} has no docstring stating its invariant"


def _kernel_names() -> dict[str, set[str]]:
    """``mmreplay._native.<module>`` -> the names of its compiled functions."""
    kernels = {}
    for path in sorted((PACKAGE / "_native").glob("*.py")):
        names = {entry.rsplit(" ", 1)[1] for entry in _compiled_functions(path)}
        kernels[f"mmreplay._native.{path.stem}"] = names
    return kernels


def test_the_package_reaches_kernels_only_through_checked_entry_points():
    """Outside ``mmreplay/_native`` no module names a compiled function: it calls the Python entry point
    that checks bounds before the kernel writes (imported by name, or as an attribute of the module)."""
    kernels = _kernel_names()
    used = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_native" in path.parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}  # a local name -> the _native module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mmreplay._native"):
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in kernels:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    elif alias.name in kernels.get(node.module, ()):
                        used.append(f"{path.relative_to(ROOT)}:{node.lineno} {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in kernels and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr in kernels[aliases[node.value.id]]:
                used.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
    assert sum(len(names) for names in kernels.values()) > 40  # it found the kernels
    assert not used, f"kernels called without their checked entry point: {used}"


def _reads_through_state(source: str) -> list[str]:
    """Every ``<state>.<x>.<y>`` in ``source``: an attribute of an attribute of a ``StoreState``, where the state
    is ``<anything>._state``, a name assigned from one, a parameter annotated ``StoreState`` or a parameter of a
    lambda handed to ``locked`` (``StoreView.locked(lambda st: ...)``)."""
    tree = ast.parse(source)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "_state":
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.arg) and isinstance(node.annotation, (ast.Name, ast.Constant)) and \
                getattr(node.annotation, "id", getattr(node.annotation, "value", None)) == "StoreState":
            names.add(node.arg)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "locked":
            names.update(a.arg for lam in node.args if isinstance(lam, ast.Lambda) for a in lam.args.args)

    def is_state(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "_state") or \
            (isinstance(node, ast.Name) and node.id in names)
    found = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Attribute) and is_state(node.value.value)]
    return [f"{node.lineno}: {ast.unparse(node)}" for node in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def test_the_state_check_sees_every_way_of_reaching_through():
    source = ("def f(self, store, view):\n"
              "    a = self._state.ring.head\n"
              "    store._state.log.commit(r, [])\n"
              "    st = self._state\n"
              "    b = st.frames.head\n"
              "    c = view.locked(lambda s: s.ring.oldest)\n"
              "    def g(state: StoreState):\n"
              "        return state.samplers.live\n"
              "    ok = (self._state.num_added(), st.ring, self._state.priority_set(n).update(i, p))\n"
              "    self._state.app_meta = {}\n")
    found = _reads_through_state(source)
    assert [f.split(":")[0] for f in found] == ["2", "3", "5", "6", "8"], found


def test_store_never_reaches_through_its_state():
    """``store.py`` asks ``StoreState`` at the level of intent (``state.num_added()``), never reads or calls
    an attribute of one of its parts (``state.ring.head``): the state's parts can change without ``Store``."""
    found = _reads_through_state((PACKAGE / "store.py").read_text())
    assert not found, f"store.py reaches through StoreState: {found}"


def test_the_docs_a_reader_starts_from_stay_short():
    """Issue #39: docs/performance.md holds today's figures only (the dated record is docs/benchmarks/), and
    docs/architecture.md is a map, not a manual."""
    for doc, most in (("docs/performance.md", 250), ("docs/architecture.md", 150)):
        lines = (ROOT / doc).read_text().count("\n")
        assert lines <= most, f"{doc} has {lines} lines, more than {most}: move history to docs/benchmarks/history.md"
