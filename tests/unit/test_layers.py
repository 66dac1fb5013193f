"""Imports only go down the layers, for EVERY module of the package (function-local ones too).

    config, quiet, stages, seeds -> plan -> models, rl, envs -> runtime, progress
        -> weights, rollout, agents, trackers, viewer
        -> trainer -> entry points (train, selfcheck, cli)

A module may import its own layer and the layers before it. ``earl_megatron.testing`` sits above
everything and is imported only by tests and benchmarks. Read with ``ast``, nothing imported.
"""

import ast
import pathlib

import earl_megatron

PACKAGE = pathlib.Path(earl_megatron.__file__).parent
LAYERS = {"quiet": 0, "config": 0, "stages": 0, "seeds": 0, "plan": 1, "models": 2, "rl": 2,
          "envs": 2, "runtime": 3, "progress": 3, "weights": 4, "rollout": 4, "agents": 4,
          "trackers": 4, "viewer": 4, "trainer": 5, "train": 6, "reporting": 6, "selfcheck": 6, "cli": 6, "serve": 6, "testing": 7}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        yield ".".join(parts), path


def _imports(name: str, path: pathlib.Path):
    """Every earl_megatron module ``path`` imports, anywhere in the file, resolved to absolute."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            yield base
            # "from earl_megatron import plan" names a subpackage
            yield from (f"{base}.{a.name}" for a in node.names if base == "earl_megatron")


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "earl_megatron" and len(parts) > 1 else ""


def test_every_module_has_a_layer():
    unknown = sorted(m for m, _ in _modules() if m != "earl_megatron" and _top(m) not in LAYERS)
    assert not unknown, f"modules in no layer (add them to LAYERS): {unknown}"


def test_imports_only_go_down():
    bad = [f"{mod} imports {imp}" for mod, path in _modules() if mod != "earl_megatron"
           for imp in _imports(mod, path)
           if LAYERS.get(_top(imp), -1) > LAYERS[_top(mod)]]
    assert not bad, "imports that climb the layers:\n" + "\n".join(bad)


def test_the_walk_sees_function_local_imports():
    """Guard against a parser that misses imports inside functions (most upward imports were)."""
    path = PACKAGE / "runtime" / "build.py"
    assert "earl_megatron.models.provider" in set(_imports("earl_megatron.runtime.build", path))



def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): the import loops."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_loops():
    """No two modules import each other, directly or around a loop (function-local imports
    count). A module importing its own package (``earl_megatron.envs.registry`` imports
    ``earl_megatron.envs`` to run its registrations) is not a loop: Python runs the package's
    ``__init__`` before any of its modules anyway."""
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    mods = dict(_modules())
    graph = {m: {i for i in _imports(m, p) if i in mods and i != m and not m.startswith(i + ".")}
             for m, p in mods.items()}
    assert not _loops(graph), f"import loops: {_loops(graph)}"
