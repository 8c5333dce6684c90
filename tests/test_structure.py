"""Rules about ownership in shepherd/ (tests and benchmarks aside), read from the code's AST:

  - layers: imports only go down (a module may import its own layer and the ones below);
  - no import cycle, lazy and TYPE_CHECKING imports included;
  - no import of another module's _private name;
  - no reach into another object's _private attribute: `x._y` only where x is `self` or
    `cls` (or `super()`), i.e. inside the class that owns _y (a library's own underscore
    API, e.g. torch's `ops.aten._weight_int8pack_mm` kernels, is the library's to keep);
  - no module that only re-exports (a package's __init__ naming the package's API aside);
  - the executor is typed by step.Executor: no getattr/hasattr probe of an executor, and
    every class in shepherd/ that runs batches (defines `execute`) has every member of it;
  - every name a module reads is bound somewhere in it (imported, assigned, defined, a builtin):
    a name left behind when code moves raises only when its line runs, and a broad `except`
    may hide it (bench's metrics poller read none of the server's metrics for days so).

Layers, bottom to top:

    0  shepherd/{config,request,paths,step}.py
    1  scheduler/, model/, kv_events/ (pure: hashes, wire format, tracker, index)
    2  routing/
    3  engine/, kv_events/{publisher,subscriber}.py (ZMQ I/O)
    4  sim/, bench/, server/, gateway/, deploy/, epp/   (bench and sim: one direction at most)
    5  cli.py, __main__.py

Module and function sizes are a printed report, not a cap: a cap steers the
carving toward the number instead of toward one job per module.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "shepherd"

LAYERS = {
    "shepherd.config": 0, "shepherd.request": 0, "shepherd.paths": 0, "shepherd.step": 0, "shepherd": 0,
    "shepherd.scheduler": 1, "shepherd.model": 1, "shepherd.kv_events": 1,
    "shepherd.routing": 2,
    "shepherd.engine": 3, "shepherd.kv_events.publisher": 3, "shepherd.kv_events.subscriber": 3,
    "shepherd.sim": 4, "shepherd.bench": 4, "shepherd.server": 4, "shepherd.gateway": 4, "shepherd.deploy": 4, "shepherd.epp": 4,
    "shepherd.cli": 5, "shepherd.__main__": 5,
}

# namedtuple's documented methods: public API despite the underscore
PUBLIC_UNDERSCORE = {"_make", "_replace", "_asdict", "_fields", "_field_defaults"}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        yield rel, path, ast.parse(path.read_text(), filename=rel)


def _layer(module: str):
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def _module_name(rel: str) -> str:
    name = rel[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").is_file()


def _imports(tree: ast.AST):
    """Every shepherd module imported anywhere in the file (lazy and TYPE_CHECKING imports too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("shepherd"):
                    yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("shepherd"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    yield sub if _is_module(sub) else node.module


def _edges():
    out = []
    for rel, _, tree in _modules():
        for mod in set(_imports(tree)):
            out.append((rel, mod))
    return out


def _upward():
    bad = set()
    for rel, mod in _edges():
        src, dst = _layer(_module_name(rel)), _layer(mod)
        assert src is not None, f"{rel}: not in any layer; add it to LAYERS in tests/test_structure.py"
        assert dst is not None, f"{rel} imports {mod}: not in any layer"
        if dst > src:
            bad.add(f"{rel} -> {mod}")
    return bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:     # Tarjan; the graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for rel, mod in _edges():
        g.setdefault(_module_name(rel), set()).add(mod)
    return g


def _private_imports(rel: str, tree: ast.AST):
    me = _module_name(rel)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shepherd"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and node.module != me:
                    yield f"{rel}:{node.lineno} imports {node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if any(p.startswith("_") and not p.startswith("__") for p in a.name.split(".")):
                    yield f"{rel}:{node.lineno} imports {a.name}"


def _owner(value: ast.AST) -> bool:
    """`self`, `cls` or `super()`: the class reaching into its own attributes."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def _libraries(tree: ast.AST) -> set[str]:
    """Names a file binds to modules outside shepherd (`import torch`, `import numpy as np`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name.split(".")[0] for a in node.names if not a.name.startswith("shepherd")}
    return out


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _reach_ins(rel: str, tree: ast.AST):
    libs = _libraries(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and node.attr not in PUBLIC_UNDERSCORE and not _owner(node.value)):
            root = _root(node)
            if isinstance(root, ast.Name) and root.id in libs:
                continue
            yield f"{rel}:{node.lineno} {ast.unparse(node)}"


def _only_reexports(tree: ast.Module) -> bool:
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]       # the docstring
    if not body:
        return False          # empty (a package marker)
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            continue
        return False
    return True


def _executor_probes(rel: str, tree: ast.AST):
    """getattr / hasattr on an executor: a member that step.Executor should declare."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and node.args:
            target = ast.unparse(node.args[0])
            if "executor" in target or target == "ex":
                yield f"{rel}:{node.lineno} {ast.unparse(node)}"


def _executor_classes():
    """(module, class name) of every class in shepherd/ that defines execute(), the protocol aside."""
    for rel, _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name != "Executor" and any(
                    isinstance(f, ast.FunctionDef) and f.name == "execute" for f in node.body):
                yield _module_name(rel), node.name


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def _unbound_names(tree: ast.AST) -> list[str]:
    """Names read but bound nowhere in the module. Module-wide, not per scope: it finds a name that
    is missing altogether, which is the slip a move leaves."""
    import builtins
    bound = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__path__"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
    return sorted({f"{n.id} (line {n.lineno})" for n in ast.walk(tree)
                   if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound})


def test_every_name_a_module_reads_is_bound_in_it():
    bad = [f"{rel}: {b}" for rel, _, tree in _modules() for b in _unbound_names(tree)]
    assert not bad, "names read but never bound (imported, assigned or defined):\n  " + "\n  ".join(bad)


def test_no_upward_imports():
    bad = _upward()
    assert not bad, f"upward imports: {sorted(bad)}"


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_imports_across_modules():
    bad = [b for rel, _, tree in _modules() for b in _private_imports(rel, tree)]
    assert not bad, "imports of another module's _private name:\n  " + "\n  ".join(bad)


def test_no_reach_into_private_attributes():
    bad = [b for rel, _, tree in _modules() for b in _reach_ins(rel, tree)]
    assert not bad, "reaches into another object's _private attribute:\n  " + "\n  ".join(bad)


def test_no_module_only_reexports():
    bad = [rel for rel, path, tree in _modules() if path.name != "__init__.py" and _only_reexports(tree)]
    assert not bad, f"modules that only re-export (import from where the names live): {bad}"


def test_bench_and_sim_do_not_import_each_other():
    def side(rel):
        return rel.split("/")[1] if rel.count("/") >= 2 else ""
    b2s = {f"{r} -> {m}" for r, m in _edges() if side(r) == "bench" and m.startswith("shepherd.sim")}
    s2b = {f"{r} -> {m}" for r, m in _edges() if side(r) == "sim" and m.startswith("shepherd.bench")}
    assert not (b2s and s2b), f"bench and sim import each other: {sorted(b2s)}"


def test_executor_is_not_probed():
    bad = [b for rel, _, tree in _modules() for b in _executor_probes(rel, tree)]
    assert not bad, "probes of an executor (declare the member in step.Executor):\n  " + "\n  ".join(bad)


def test_every_executor_has_every_member_of_the_step_contract():
    """Methods and properties of step.Executor, on each class that runs batches and its subclasses
    in shepherd/ (instance attributes such as kv_capacity are set in __init__: not checked here)."""
    import importlib

    from shepherd.step import Executor, PlainExecutor
    members = [n for n, v in vars(Executor).items() if callable(v) or isinstance(v, property)]
    members = [n for n in members if not n.startswith("_")]
    assert {"execute", "grammar_ready", "lora_enabled", "take_lora_loads"} <= set(members)
    classes = [getattr(importlib.import_module(m), c) for m, c in _executor_classes()] + [PlainExecutor]
    assert len(classes) >= 3, classes       # TorchExecutor, SimExecutor, PlainExecutor
    missing = [f"{c.__module__}.{c.__name__}.{n}" for c in classes for n in members
               if c is not PlainExecutor and not hasattr(c, n)]
    missing += [f"PlainExecutor.{n}" for n in members if n != "execute" and not hasattr(PlainExecutor, n)]
    assert not missing, f"executors without a member of step.Executor: {missing}"


def test_size_report(capsys):
    """Line counts are a report, not a cap: the largest modules and functions, printed."""
    mods = sorted(((len(path.read_text().splitlines()), rel) for rel, path, _ in _modules()), reverse=True)
    funcs = sorted(((n, f"{rel}:{name}") for rel, _, tree in _modules() for name, n in _functions(tree)),
                   reverse=True)
    with capsys.disabled():
        print("\nlargest modules:   " + ", ".join(f"{rel} {n}" for n, rel in mods[:8]))
        print("largest functions: " + ", ".join(f"{name} {n}" for n, name in funcs[:8]))
    assert mods and funcs and mods[0][0] >= funcs[0][0]


def test_the_checks_can_fail():
    """Each walker sees what it is meant to see, on code that breaks its rule."""
    tree = ast.parse("def f():\n" + "    x = 1\n" * 90 + "\nclass C:\n    def g(self):\n        pass\n")
    sizes = dict(_functions(tree))
    assert sizes["f"] > 90 and sizes["C.g"] == 2
    tree = ast.parse("def h():\n    from shepherd.sim import simulator\n")
    assert list(_imports(tree)) == ["shepherd.sim.simulator"]
    assert _layer("shepherd.sim.simulator") > _layer("shepherd.engine.engine")
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shepherd.step import Executor\n")
    assert list(_imports(tree)) == ["shepherd.step"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]] and _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from shepherd.bench.traces import _stream, seeded_stream\n")
    assert len(list(_private_imports("shepherd/sim/x.py", tree))) == 1
    tree = ast.parse("import torch\nclass A:\n    def f(self, s):\n"
                     "        return self._a, s._b, super()._c, cls._d, s.kv._e, t._make, torch.ops._k\n")
    assert [b.split(" ")[1] for b in _reach_ins("x.py", tree)] == ["s._b", "s.kv._e"]
    assert _only_reexports(ast.parse('"""doc"""\nfrom a import b\n__all__ = ["b"]\n'))
    assert not _only_reexports(ast.parse("from a import b\n\ndef f():\n    return b\n"))
    left_behind = "import httpx\n\ndef take(m):\n    for k in _GAUGES:\n        m[k] = httpx\n    return [y for y in m]\n"
    assert _unbound_names(ast.parse(left_behind)) == ["_GAUGES (line 4)"]
    tree = ast.parse("a = getattr(core.executor, 'lora', None)\nb = hasattr(ex, 'x')\nc = getattr(m, 'tiles')\n")
    assert [b.split(" ")[0] for b in _executor_probes("x.py", tree)] == ["x.py:1", "x.py:2"]
