"""The structure stays layered: no upward imports in shepherd/ (tests and
benchmarks aside); module and function sizes are printed as a report.

Layers, bottom to top (a module may import its own layer and the ones below):

    0  shepherd/{config,request,paths,step}.py
    1  scheduler/, model/
    2  routing/
    3  engine/
    4  sim/, bench/, server/, gateway/      (bench and sim: one direction at most)
    5  cli.py, __main__.py

The allowlists name what still breaks a rule today in files that other work
in flight owns; each entry must still break it (so the lists only shrink).
Empty them as those files are fixed.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "shepherd"

MAX_FUNCTION_LINES = 80   # the walker's check below: a function of 90 lines is seen as one

LAYERS = {
    "shepherd.config": 0, "shepherd.request": 0, "shepherd.paths": 0, "shepherd.step": 0, "shepherd": 0,
    "shepherd.scheduler": 1, "shepherd.model": 1,
    "shepherd.routing": 2,
    "shepherd.engine": 3,
    "shepherd.sim": 4, "shepherd.bench": 4, "shepherd.server": 4, "shepherd.gateway": 4,
    "shepherd.cli": 5, "shepherd.__main__": 5,
}

# Upward imports ("path -> module"), owned by work in flight.
IMPORT_ALLOWLIST: set = set()

# bench <-> sim: while both directions exist, these bench -> sim edges are tolerated.
BENCH_SIM_ALLOWLIST: set = set()


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
    """Every shepherd module imported anywhere in the file (lazy imports too)."""
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


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def test_no_upward_imports():
    bad = _upward()
    assert bad <= IMPORT_ALLOWLIST, f"upward imports: {sorted(bad - IMPORT_ALLOWLIST)}"
    assert IMPORT_ALLOWLIST <= bad, f"fixed, remove from IMPORT_ALLOWLIST: {sorted(IMPORT_ALLOWLIST - bad)}"


def test_bench_and_sim_do_not_import_each_other():
    def side(rel):
        return rel.split("/")[1] if rel.count("/") >= 2 else ""
    b2s = {f"{r} -> {m}" for r, m in _edges() if side(r) == "bench" and m.startswith("shepherd.sim")}
    s2b = {f"{r} -> {m}" for r, m in _edges() if side(r) == "sim" and m.startswith("shepherd.bench")}
    if b2s and s2b:
        assert b2s <= BENCH_SIM_ALLOWLIST, f"bench and sim import each other: {sorted(b2s - BENCH_SIM_ALLOWLIST)}"
        assert BENCH_SIM_ALLOWLIST <= b2s, f"fixed, shrink BENCH_SIM_ALLOWLIST: {sorted(BENCH_SIM_ALLOWLIST - b2s)}"
    else:
        assert not BENCH_SIM_ALLOWLIST, "bench and sim no longer import each other: empty BENCH_SIM_ALLOWLIST"


def test_size_report(capsys):
    """Line counts are a report, not a cap (a cap steers the carving toward the number): the
    largest modules and functions, printed (pytest -s, or -rA, shows them)."""
    mods = sorted(((len(path.read_text().splitlines()), rel) for rel, path, _ in _modules()), reverse=True)
    funcs = sorted(((n, f"{rel}:{name}") for rel, _, tree in _modules() for name, n in _functions(tree)),
                   reverse=True)
    with capsys.disabled():
        print("\nlargest modules:  " + ", ".join(f"{rel} {n}" for n, rel in mods[:8]))
        print("largest functions: " + ", ".join(f"{name} {n}" for n, name in funcs[:8]))
    assert mods and funcs and mods[0][0] >= funcs[0][0]


def test_the_checks_can_fail():
    """The walkers see what they are meant to see."""
    tree = ast.parse("def f():\n" + "    x = 1\n" * 90 + "\nclass C:\n    def g(self):\n        pass\n")
    sizes = dict(_functions(tree))
    assert sizes["f"] > MAX_FUNCTION_LINES and sizes["C.g"] == 2
    tree = ast.parse("def h():\n    from shepherd.sim import simulator\n")
    assert list(_imports(tree)) == ["shepherd.sim.simulator"]
    assert _layer("shepherd.sim.simulator") > _layer("shepherd.engine.engine")
