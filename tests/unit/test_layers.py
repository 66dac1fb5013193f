"""Imports only go down the layers, for EVERY module of the package (function-local ones too).

    config, quiet -> plan -> models, rl, envs -> runtime -> weights, rollout -> trainer -> entry points

A module may import its own layer and the layers before it. ``earl_megatron.testing`` sits above
everything and is imported only by tests and benchmarks. Read with ``ast``, nothing imported.
"""

import ast
import pathlib

import earl_megatron

PACKAGE = pathlib.Path(earl_megatron.__file__).parent
LAYERS = {"quiet": 0, "config": 0, "plan": 1, "models": 2, "rl": 2, "envs": 2, "runtime": 3,
          "weights": 4, "rollout": 4, "trainer": 5, "train": 6, "selfcheck": 6, "testing": 7}


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
