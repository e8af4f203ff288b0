"""The package keeps the shape a newcomer can find their way in (issue 13): layers import only
from the layers below them, nothing imports in a cycle (function-level imports included), no function over 80 lines or class over
300, the algorithm is read only where the sync strategy is picked, and the config loads without
torch or Ray."""

from __future__ import annotations

import ast
import subprocess
import sys

from helpers import ROOT

PKG = ROOT / "ray_diloco"
#: Each layer may import from itself and the layers below it: errors < config (typed, no torch, no Ray)
#: < core (pure algorithm) < models < components < runtime (Ray) < tune, analysis < cli; log (logging) under all.
LAYERS = ["cli", "tune", "analysis", "runtime", "components", "models", "core", "config", "errors", "log"]
BELOW = {
    "cli": set(LAYERS),
    "tune": {"tune", "runtime", "components", "models", "config", "core", "errors", "log"},
    "analysis": {"analysis", "runtime", "components", "models", "config", "core", "errors", "log"},
    "runtime": {"runtime", "components", "models", "config", "core", "errors", "log"},
    "components": {"components", "models", "config", "core", "errors", "log"},
    "models": {"models", "config", "core", "errors", "log"},
    "core": {"core", "config", "errors", "log"},
    "config": {"config", "errors", "log"},
    "errors": {"errors"},
    "log": {"log"},  # logging: any layer may log
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        layer = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else "__init__"
        yield path, layer, ast.parse(path.read_text())


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(tree):
    """The package's modules a module imports; ``from package import module`` is the module (a
    cycle through it is a cycle), ``from package import name`` the package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ray_diloco"):
            subs = [f"{node.module}.{a.name}" for a in node.names]
            yield from (m for m in subs if _is_module(m))
            if not all(_is_module(m) for m in subs):
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("ray_diloco"))


def test_layers_import_only_from_the_layers_below():
    bad = []
    for path, layer, tree in _modules():
        if layer == "__init__":
            continue
        for mod in _imports(tree):
            parts = mod.split(".")
            target = parts[1] if len(parts) > 1 else "__init__"
            if target not in BELOW[layer]:
                bad.append(f"{path.relative_to(ROOT)} ({layer}) imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_counting_function_level_and_type_only_imports():
    """A cycle closed by an import inside a function (or under ``TYPE_CHECKING``) is a cycle all
    the same: the two modules cannot be understood or changed apart."""
    graph = {}
    for path, _, tree in _modules():
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        graph[name] = set(_imports(tree))
    seen, stack = set(), []

    def visit(n):
        if n in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
        if n in seen or n not in graph:
            return
        stack.append(n)
        for d in sorted(graph[n]):
            visit(d)
        stack.pop()
        seen.add(n)

    for n in sorted(graph):
        visit(n)


def test_the_cycle_check_sees_a_module_imported_from_its_package():
    """``from ray_diloco.core import codec`` inside a function of a module codec imports back was
    a cycle this test missed (it counted the package)."""
    tree = ast.parse("def f():\n    from ray_diloco.core import codec, formats\nfrom ray_diloco.config import load_config")
    assert set(_imports(tree)) == {"ray_diloco.core.codec", "ray_diloco.core.formats", "ray_diloco.config"}


#: Format names (``streaming.quantization``); "bf16" is also a precision, so a comparison counts
#: when its other side reads a format (``fmt``, ``format``, ``quantization``).
_FORMAT_NAMES = {"none", "bf16", "fp8_e4m3", "int8", "fp4_e3m0"}


def test_only_core_formats_branches_on_a_formats_name():
    """Each wire format is one object (``core.formats.WireFormat``): its size, codec, scaling and
    whether it is sent raw are asked of it, never decided by comparing a format's name elsewhere
    (``fmt == "none"``, ``fmt in SCALED``, a table keyed by names)."""
    hits = []
    for path, _, tree in _modules():
        if path in (PKG / "core" / "formats.py",) or path.parent == PKG / "config":
            continue
        for node in ast.walk(tree):
            consts = []
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                text = " ".join(ast.unparse(x) for x in sides)
                if any(w in text for w in ("fmt", "format", "quantization", "SCALED")):
                    consts = [c.value for x in sides for c in ast.walk(x) if isinstance(c, ast.Constant)]
                    consts += ["SCALED"] if "SCALED" in text else []
            elif isinstance(node, ast.Dict):
                consts = [k.value for k in node.keys if isinstance(k, ast.Constant)]
                consts = consts if len(set(consts) & _FORMAT_NAMES) >= 2 else []
            if set(consts) & (_FORMAT_NAMES | {"SCALED"}):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)[:80]}")
    assert not hits, "format names branched on outside core/formats.py:\n" + "\n".join(hits)


def test_no_function_over_80_lines_and_no_class_over_300():
    """A class's size counts the package's classes it derives from (a mixin split off to pass the
    limit is no smaller a class)."""
    big, sizes, bases = [], {}, {}
    for path, _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                n = node.end_lineno - node.lineno + 1
                if isinstance(node, ast.ClassDef):
                    where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                    sizes[node.name] = (n, where)
                    bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
                elif n > 80:
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines (limit 80)")

    def total(name: str, seen: frozenset = frozenset()) -> int:
        return sizes[name][0] + sum(total(b, seen | {name}) for b in bases[name] if b in sizes and b not in seen)

    for name, (_, where) in sizes.items():
        if total(name) > 300:
            big.append(f"{where}: {total(name)} lines with its bases (limit 300)")
    assert not big, "\n".join(big)


def test_no_module_over_600_lines():
    big = {str(path.relative_to(PKG)): len(path.read_text().splitlines()) for path, _, _ in _modules()}
    assert not {name: n for name, n in big.items() if n > 600}


def test_only_the_strategy_and_the_config_read_the_algorithm():
    allowed = {PKG / "runtime" / "strategy.py"} | set((PKG / "config").glob("*.py"))
    hits = []
    for path, _, tree in _modules():
        if path in allowed:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(x, ast.Attribute) and x.attr == "algorithm" for x in [node.left, *node.comparators]):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not hits, "algorithm branches outside runtime/strategy.py and config/: " + ", ".join(hits)


def test_load_config_imports_neither_torch_nor_ray():
    code = ("import sys; from ray_diloco.config import load_config; load_config(); "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


#: The objects a run is made of (issue 28): passed typed, built with what they need.
COLLABORATORS = {"trainer", "supervisor", "members", "membership", "sync", "strategy", "checkpointer", "mirror"}


def test_no_collaborator_is_passed_as_any_or_patched_from_outside():
    """No parameter named like one of a run's collaborators is typed ``Any`` (14 were in
    strategy and checkpointing), and no code outside a collaborator assigns to its attributes
    (``trainer.mirror = ...``, ``trainer.members.driver = ...`` were)."""
    found = []
    for path, _, tree in _modules():
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.arg in COLLABORATORS and (a.annotation is None or ast.unparse(a.annotation) == "Any"):
                        found.append(f"{where}:{node.lineno} {node.name}({a.arg}: Any)")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for tgt in targets:
                base = tgt
                while isinstance(base, ast.Attribute):
                    base = base.value
                chain = ast.unparse(tgt).split(".")
                if isinstance(base, ast.Name) and len(chain) > 2 - (base.id != "self") and (
                    base.id in COLLABORATORS or (base.id == "self" and chain[1] in COLLABORATORS)
                ):
                    found.append(f"{where}:{node.lineno} {ast.unparse(tgt)} = ...")
    assert not found, "\n".join(found)
