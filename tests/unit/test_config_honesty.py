"""Every configuration key changes what the code does; a key that does nothing in a mode is refused.

A static check over the package's source (AST only, nothing imported), following each field of
each TrainConfig section to where its value is USED, not to where it is handed on:

- a read of a field is an attribute access on a value whose type is known: ``cfg.<section>``
  (the sections of TrainConfig), a name bound to it (``a = cfg.algorithm``), a parameter
  annotated with a dataclass (``scfg: SFTConfig``), a name assigned from a dataclass call
  (``spec = EpisodeSpec(...)``), ``self`` inside that dataclass, or ``self.x`` where the class
  assigned ``self.x = SomeDataclass(...)`` or annotated ``x: SomeDataclass``;
- a read that is itself an argument of a call to a package dataclass is FORWARDED to that
  dataclass's field (by keyword or position), which must then be used in turn; one assigned to
  ``self.x`` is forwarded to that attribute, used only where some method of the class reads
  ``self.x``; one passed to a package function (resolved by its unique name) is forwarded to the
  parameter, used only where the function's body refers to it;
- anything else is a USE (a comparison, arithmetic, a call of torch or the standard library, a
  return); validation (any ``__post_init__`` or ``_check*`` method of config/) is not.

So a field copied into another dataclass whose field nothing reads counts as unread (the
negative control below plants exactly that and sees the check fail). The modes in which a field
would do nothing are refused when the configuration is built (``REFUSED_IN``: each is checked to
raise a ConfigError naming the field). Every field of every configuration dataclass has a
docstring.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import pytest

import earl_megatron
from earl_megatron.config.train import ConfigError, TrainConfig

PACKAGE = Path(earl_megatron.__file__).parent
CONFIG_DIR = PACKAGE / "config"

READ_ELSEWHERE = {
    # LayoutConfig.static(stage) reads getattr(self, stage) for every stage
    ("layout", "rollout"): "LayoutConfig.static", ("layout", "logprob"): "LayoutConfig.static",
    ("layout", "train"): "LayoutConfig.static",
}
SKIPPED_SECTIONS = {"model": "its fields are the model's shape, read by plan/ and models/ "
                             "throughout (and checked against checkpoints by run.init)"}

REFUSED_IN = [  # (the key and a value it does nothing with, the mode that makes it nothing)
    ({"algorithm": {"gamma": 0.9}}, {"algorithm": {"name": "grpo", "group_size": 4}},
     "algorithm.gamma"),
    ({"cluster": {"inter_node_gbps": 100.0}}, {"cluster": {"preset": "cpu"}},
     "cluster.inter_node_gbps"),
    ({"algorithm": {"off_policy": "tis"}}, {"algorithm": {"old_logprobs": "rollout"}},
     "algorithm.off_policy"),
    ({"algorithm": {"off_policy_cap": 3.0}}, {"algorithm": {"off_policy": "none"}},
     "algorithm.off_policy_cap"),
    ({"algorithm": {"routing_replay": True}}, {"model": {"family": "llama"}},
     "algorithm.routing_replay"),
    ({"algorithm": {"kl_coef": 0.1}}, {"algorithm": {"kl_mode": "off"}}, "algorithm.kl_coef"),
]


# -- the analysis ----------------------------------------------------------------------------
@dataclass
class _Module:
    path: str
    tree: ast.Module
    parents: dict


def _parse(sources: dict[str, str]) -> list[_Module]:
    out = []
    for path, text in sources.items():
        tree = ast.parse(text)
        parents = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        out.append(_Module(path, tree, parents))
    return out


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        if getattr(f, "id", None) == "dataclass" or getattr(f, "attr", None) == "dataclass":
            return True
    return False


def _fields(cls: ast.ClassDef) -> list[tuple[str, ast.AnnAssign]]:
    return [(st.target.id, st) for st in cls.body
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)]


def _type_name(ann) -> Optional[str]:
    """``D``, ``"D"``, ``Optional[D]``, ``D | None`` -> "D"."""
    if ann is None:
        return None
    if isinstance(ann, ast.Name):
        return ann.id
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        return ann.value.strip("'\"").split("[")[-1].rstrip("]")
    if isinstance(ann, ast.Attribute):
        return ann.attr
    if isinstance(ann, ast.Subscript):
        return _type_name(ann.slice)
    if isinstance(ann, ast.BinOp):
        return _type_name(ann.left) or _type_name(ann.right)
    return None


class _Package:
    def __init__(self, sources: dict[str, str]):
        self.modules = _parse(sources)
        self.dataclasses: dict[str, list[str]] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.functions: dict[str, list[ast.FunctionDef]] = {}
        for m in self.modules:
            for node in ast.walk(m.tree):
                if isinstance(node, ast.ClassDef):
                    self.classes[node.name] = node
                    if _is_dataclass(node):
                        self.dataclasses[node.name] = [n for n, _ in _fields(node)]
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.setdefault(node.name, []).append(node)
        train = self.classes["TrainConfig"]
        self.sections = {name: _type_name(st.annotation) for name, st in _fields(train)}
        self.parent = {}
        self.loads: dict[str, list[tuple[ast.Attribute, ast.AST]]] = {}
        """attribute name -> every load of it, with its enclosing function (or module)"""
        for m in self.modules:
            self.parent.update(m.parents)
            for node in ast.walk(m.tree):
                node._earl_path = m.path  # noqa: SLF001 - a tag for messages
        for m in self.modules:
            for node in ast.walk(m.tree):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    fn = self._enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    self.loads.setdefault(node.attr, []).append((node, fn or m.tree))
        self._types_cache: dict = {}
        self._attr_cache: dict = {}

    # -- which dataclass a value is ----------------------------------------------------------
    def _enclosing(self, node, kinds):
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, kinds):
                return node
        return None

    def _bindings(self, fn) -> dict[str, str]:
        """Names bound to a known dataclass inside ``fn`` (parameters, assignments)."""
        if fn in self._types_cache:
            return self._types_cache[fn]
        bound: dict[str, str] = {}
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs:
                t = _type_name(arg.annotation)
                if t in self.dataclasses:
                    bound[arg.arg] = t
            cls = self._enclosing(fn, (ast.ClassDef,))
            if cls is not None and cls.name in self.dataclasses and fn.args.args:
                bound[fn.args.args[0].arg] = cls.name
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                pairs = []
                for t in node.targets:
                    if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(t.elts, node.value.elts)
                    else:
                        pairs.append((t, node.value))
                for t, v in pairs:
                    if isinstance(t, ast.Name):
                        typ = self._expr_type(v, fn, bound)
                        if typ:
                            bound[t.id] = typ
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                t = _type_name(node.annotation)
                if t in self.dataclasses:
                    bound[node.target.id] = t
        self._types_cache[fn] = bound
        return bound

    def _self_attr_type(self, cls: ast.ClassDef, attr: str) -> Optional[str]:
        key = (id(cls), attr)
        if key not in self._attr_cache:
            self._attr_cache[key] = None   # a cycle through this attribute finds no type
            self._attr_cache[key] = self._find_self_attr_type(cls, attr)
        return self._attr_cache[key]

    def _find_self_attr_type(self, cls: ast.ClassDef, attr: str) -> Optional[str]:
        for name, st in _fields(cls):
            if name == attr and _type_name(st.annotation) in self.dataclasses:
                return _type_name(st.annotation)
        for node in ast.walk(cls):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and t.attr == attr and \
                            isinstance(t.value, ast.Name) and t.value.id == "self":
                        fn = self._enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        typ = self._expr_type(node.value, fn, self._bindings(fn) if fn else {})
                        if typ:
                            return typ
        return None

    def _expr_type(self, e, fn, bound: dict[str, str]) -> Optional[str]:
        if isinstance(e, ast.Name):
            return bound.get(e.id)
        if isinstance(e, ast.Call):
            name = getattr(e.func, "id", None) or getattr(e.func, "attr", None)
            return name if name in self.dataclasses else None
        if isinstance(e, ast.Attribute):
            if e.attr in self.sections:
                return self.sections[e.attr]
            if isinstance(e.value, ast.Name) and e.value.id == "self" and fn is not None:
                cls = self._enclosing(fn, (ast.ClassDef,))
                if cls is not None:
                    return self._self_attr_type(cls, e.attr)
            inner = self._expr_type(e.value, fn, bound)
            if inner and e.attr in self.dataclasses.get(inner, []):
                fields = dict(_fields(self.classes[inner]))
                t = _type_name(fields[e.attr].annotation)
                return t if t in self.dataclasses else None
        return None

    # -- where a field is read, and what each read does --------------------------------------
    def reads(self, cls: str, field: str) -> Iterable[ast.Attribute]:
        for node, fn in self.loads.get(field, []):
            if self._expr_type(node.value, fn, self._bindings(fn)) == cls:
                yield node

    def _validation(self, node) -> bool:
        fn = self._enclosing(node, (ast.FunctionDef,))
        return (fn is not None and (fn.name == "__post_init__" or fn.name.startswith("_check"))
                and Path(node._earl_path).parent.name == "config")

    def used(self, cls: str, field: str, seen: Optional[set] = None) -> bool:
        seen = set() if seen is None else seen
        if (cls, field) in seen:
            return False
        seen.add((cls, field))
        return any(self._use(node, seen) for node in self.reads(cls, field)
                   if not self._validation(node))

    def _use(self, node, seen: set) -> bool:
        """Whether this read changes behaviour (module docstring), following forwards."""
        parent = self.parent.get(node)
        if isinstance(parent, ast.keyword):
            call, key, index = self.parent[parent], parent.arg, None
        elif isinstance(parent, ast.Call) and node in parent.args:
            call, key, index = parent, None, parent.args.index(node)
        else:
            call = None
        if call is not None:
            name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
            if name in self.dataclasses:
                params = self.dataclasses[name]
                target = key if key is not None else (params[index] if index < len(params)
                                                      else None)
                return target is not None and self.used(name, target, seen)
            fns = self.functions.get(name, [])
            if name in self.classes:   # a class of the package: its __init__
                fns = [f for f in self.classes[name].body
                       if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
                return len(fns) != 1 or self._param_used(fns[0], key, index, True, seen)
            if len(fns) == 1:
                return self._param_used(fns[0], key, index,
                                        isinstance(call.func, ast.Attribute), seen)
            return True
        if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
            t = parent.targets[0]
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                    t.value.id == "self":
                return self._self_attr_used(node, t.attr, seen)
        return True

    def _param_used(self, fn, key, index, bound_method: bool, seen: set) -> bool:
        """Whether ``fn``'s parameter (by keyword or position) is used in its body, following
        each reference as a read of its own."""
        args = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if args and args[0] in ("self", "cls") and bound_method:
            args = args[1:]
        names = args + [a.arg for a in fn.args.kwonlyargs]
        param = key if key is not None else (args[index] if index < len(args) else None)
        if param is None or param not in names:
            return True   # *args / **kwargs: handed on opaquely; count it as used
        if (id(fn), param) in seen:
            return False
        seen.add((id(fn), param))
        return any(self._use(n, seen) for n in ast.walk(fn)
                   if isinstance(n, ast.Name) and n.id == param and isinstance(n.ctx, ast.Load))

    def _self_attr_used(self, node, attr: str, seen: set) -> bool:
        """Whether some method of the enclosing class reads ``self.<attr>``, following each
        read as a read of its own."""
        cls = self._enclosing(node, (ast.ClassDef,))
        if cls is None:
            return True
        if (id(cls), attr) in seen:
            return False
        seen.add((id(cls), attr))
        return any(self._use(n, seen) for n in ast.walk(cls)
                   if isinstance(n, ast.Attribute) and n.attr == attr and
                   isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name) and
                   n.value.id == "self")

    def unread(self) -> list[str]:
        out = []
        for section, cls in self.sections.items():
            if section in SKIPPED_SECTIONS:
                continue
            for field in self.dataclasses[cls]:
                if (section, field) not in READ_ELSEWHERE and not self.used(cls, field):
                    out.append(f"{section}.{field}")
        return out


def _sources() -> dict[str, str]:
    return {str(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


# -- the tests -------------------------------------------------------------------------------
def test_every_config_field_changes_behaviour():
    unread = _Package(_sources()).unread()
    assert not unread, (f"configuration keys that no code uses (read only to be handed on, or "
                        f"not at all): {unread}")


def test_negative_control_a_forwarded_but_unused_field_fails():
    src = _sources()
    section = str(CONFIG_DIR / "rollout.py")
    runner = str(PACKAGE / "trainer" / "runner.py")
    spec = str(PACKAGE / "trainer" / "rollout.py")
    # plant rollout.planted: forwarded into EpisodeSpec.planted, which nothing reads
    assert "class RolloutConfig:\n" in src[section]
    src[section] = src[section].replace(
        "class RolloutConfig:\n", "class RolloutConfig:\n    planted: int = 0\n    \"\"\"x\"\"\"\n", 1)
    src[spec] = src[spec].replace(
        "class EpisodeSpec:\n", "class EpisodeSpec:\n    planted: int = 0\n", 1)
    assert "EpisodeSpec(" in src[runner]
    src[runner] = src[runner].replace("EpisodeSpec(", "EpisodeSpec(planted=cfg.rollout.planted, ", 1)
    assert _Package(src).unread() == ["rollout.planted"]
    # ... and used once something reads the dataclass field it was handed to
    src[spec] += ("\n\ndef _uses_planted(spec: EpisodeSpec) -> int:\n"
                  "    return spec.planted + 1\n")
    assert _Package(src).unread() == []


def test_negative_control_an_attribute_stored_but_never_read_fails():
    src = _sources()
    train = str(CONFIG_DIR / "train.py")
    warm = str(PACKAGE / "trainer" / "warm_start.py")
    assert "class RunConfig:\n" in src[train]
    src[train] = src[train].replace(
        "class RunConfig:\n", "class RunConfig:\n    planted: int = 0\n    \"\"\"x\"\"\"\n", 1)
    assert "self.keep_last = keep_last" in src[warm]
    src[warm] = src[warm].replace("self.keep_last = keep_last",
                                  "self.keep_last = keep_last\n        self.planted = planted", 1)
    src[warm] = src[warm].replace("keep_last: Optional[int] = None):",
                                  "keep_last: Optional[int] = None, planted: int = 0):", 1)
    runner = str(PACKAGE / "trainer" / "runner.py")
    src[runner] = src[runner].replace("keep_last=cfg.run.keep_last)",
                                      "keep_last=cfg.run.keep_last, planted=cfg.run.planted)", 1)
    assert _Package(src).unread() == ["run.planted"]


@pytest.mark.parametrize("value, mode, key", REFUSED_IN, ids=[k for _, _, k in REFUSED_IN])
def test_a_key_that_does_nothing_in_a_mode_is_refused(value, mode, key):
    merged = {s: {**mode.get(s, {}), **value.get(s, {})} for s in {*mode, *value}}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        TrainConfig.from_dict(merged)
    TrainConfig.from_dict(mode)   # the mode itself is fine


def test_every_config_field_has_a_docstring():
    missing = []
    for path in sorted(CONFIG_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ClassDef) and _is_dataclass(node)):
                continue
            for i, st in enumerate(node.body):
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    nxt = node.body[i + 1] if i + 1 < len(node.body) else None
                    if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                            and isinstance(nxt.value.value, str)):
                        missing.append(f"{path.name}: {node.name}.{st.target.id}")
    assert not missing, f"configuration fields without a docstring: {missing}"
