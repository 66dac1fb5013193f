"""Every configuration key is read by the code (a key that nothing reads says something false).

Static check over the package's source: a field ``f`` of section ``s`` (``rollout``,
``algorithm``, ...) counts as read where the code accesses ``<expr>.s.f``, or ``x.f`` with ``x``
bound in the same function to ``<expr>.s`` (``a = cfg.algorithm``; tuple assignments too) or
annotated with the section's class (``layout: LayoutConfig``). Validation in the section's own
``__post_init__`` does not count: checking a value is not using it.
"""

import ast
import dataclasses
from pathlib import Path

import earl_megatron
from earl_megatron.config.train import STAGES, TrainConfig

PACKAGE = Path(earl_megatron.__file__).parent

READ_ELSEWHERE = {
    # LayoutConfig.static(stage) reads getattr(self, stage) for stage in STAGES
    ("layout", s): "LayoutConfig.static" for s in STAGES
}
REJECTED: set[tuple[str, str]] = set()  # keys accepted but refused at validation: none today


def _reads() -> set[tuple[str, str]]:
    sections = {name: type(getattr(TrainConfig(), name)).__name__
                for name in (f.name for f in dataclasses.fields(TrainConfig))}
    by_class = {cls: name for name, cls in sections.items()}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                continue
            if isinstance(fn, ast.FunctionDef) and fn.name == "__post_init__":
                continue
            bound: dict[str, str] = {}
            if not isinstance(fn, ast.Module):
                for arg in fn.args.args + fn.args.kwonlyargs:
                    ann = arg.annotation
                    name = getattr(ann, "id", None) or getattr(ann, "value", None)
                    if name in by_class:
                        bound[arg.arg] = by_class[name]
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign):
                    pairs = []
                    for t in node.targets:
                        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                            pairs += zip(t.elts, node.value.elts)
                        else:
                            pairs.append((t, node.value))
                    for t, v in pairs:
                        if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) \
                                and v.attr in sections:
                            bound[t.id] = v.attr
            for node in ast.walk(fn):
                if not isinstance(node, ast.Attribute):
                    continue
                v = node.value
                if isinstance(v, ast.Attribute) and v.attr in sections:
                    found.add((v.attr, node.attr))
                elif isinstance(v, ast.Name) and v.id in bound:
                    found.add((bound[v.id], node.attr))
    return found


def test_every_config_field_is_read():
    reads = _reads()
    unread = []
    for f in dataclasses.fields(TrainConfig):
        if f.name == "model":
            continue  # the model's fields are its shape: read by plan/ and models/ throughout
        for g in dataclasses.fields(type(getattr(TrainConfig(), f.name))):
            key = (f.name, g.name)
            if key not in reads and key not in READ_ELSEWHERE and key not in REJECTED:
                unread.append(f"{f.name}.{g.name}")
    assert not unread, f"configuration keys that no code reads: {unread}"


def test_the_check_sees_a_missing_read():
    # the scan must not pass vacuously: a key nobody reads is absent from what it finds
    reads = _reads()
    assert ("rollout", "engine") in reads and ("run", "iterations") in reads
    assert ("rollout", "no_such_key") not in reads
