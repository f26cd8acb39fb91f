"""The package's layout: no module reaches into another's private names.

A name with a leading underscore is its module's own; a helper two modules share is public in the
module that owns it. Checked on the source with :mod:`ast`, with nothing allowed by name:

* ``from <specforest module> import _name`` (at any depth, relative or absolute);
* ``module._name`` where ``module`` is a specforest module bound by an import;
* ``obj._name`` (``obj`` not ``self`` or ``cls``) where ``_name`` is defined in another specforest
  module and not in this one: a private method or attribute of another module's class.

The checker is tested on small made-up packages, so that a checker that finds nothing cannot pass
for a package that has no such use.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import specforest

ROOT = Path(specforest.__file__).parent
_PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")


def _private(name: str) -> bool:
    """A leading underscore and not a dunder."""
    return bool(_PRIVATE.match(name)) and not name.endswith("__")


def _modules(root: Path) -> dict:
    """``{dotted name: (path, is package)}`` of every module under the package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, package)
    return out


def _source(name: str, package: bool, node: ast.ImportFrom) -> str:
    """The absolute module ``node`` imports from, in the module ``name``."""
    if not node.level:
        return node.module or ""
    here = name if package else name.rpartition(".")[0]
    parts = here.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _defined(tree: ast.AST) -> set:
    """The private names a module defines: functions, classes, assigned names and attributes, and
    string constants spelled like one (``object.__setattr__(self, "_a", ...)``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return {n for n in out if _private(n)}


def private_uses(root: Path) -> list:
    """``["module:line: what"]`` for every use of another specforest module's private name under the
    package directory ``root`` (the rules of this module's docstring)."""
    modules = _modules(root)
    top = root.name
    trees = {
        name: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for name, (path, _) in modules.items()
    }
    defined = {name: _defined(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        package = modules[name][1]
        bound = {}  # local name -> the specforest module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _source(name, package, node)
                if source != top and not source.startswith(top + "."):
                    continue
                for alias in node.names:
                    if _private(alias.name) and source != name:
                        found.append(f"{name}:{node.lineno}: from {source} import {alias.name}")
                    if f"{source}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        bound[alias.asname] = alias.name
        elsewhere = set().union(*(d for other, d in defined.items() if other != name))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in bound and bound[value.id] != name:
                found.append(f"{name}:{node.lineno}: {value.id}._{node.attr[1:]} of {bound[value.id]}")
            elif isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            elif node.attr not in defined[name] and node.attr in elsewhere:
                found.append(f"{name}:{node.lineno}: ._{node.attr[1:]}, private to another module")
    return found


def test_no_module_uses_another_modules_private_names():
    assert len(_modules(ROOT)) > 50  # every module read
    found = private_uses(ROOT)
    assert not found, "private names used across modules (make the helper public where it lives):\n" + "\n".join(found)


def _package(tmp_path: Path, files: dict) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_the_checker_finds_every_spelling_of_a_private_use(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def _h():\n    pass\n\nclass A:\n    def _m(self):\n        return self._m\n",
            "b.py": "from .a import _h\n",
            "c.py": "def f():\n    from pkg.a import A, _h\n    return A()._m()\n",
            "d.py": "from . import a\nimport pkg.a as aa\n\nx = a._h\ny = aa._h\n",
            "sub/__init__.py": "",
            "sub/e.py": "from ..a import _h as h\n",
            "f.py": "import os\nfrom os import _exit\n\ndef _own():\n    return os._exit, _own, pipe._pack\n",
        },
    )
    found = sorted(private_uses(root))
    assert found == [
        "pkg.b:1: from pkg.a import _h",
        "pkg.c:2: from pkg.a import _h",
        "pkg.c:3: ._m, private to another module",
        "pkg.d:4: a._h of pkg.a",
        "pkg.d:5: aa._h of pkg.a",
        "pkg.sub.e:1: from pkg.a import _h",
    ]


# -- grids and schedules live in one module ---------------------------------------------------------------

GRID_BUILDERS = (
    "GRIDS",
    "MAX_STEPS",
    "PATHS",
    "SCHEDULES",
    "check_sigmas",
    "ddpm_discrete_sigmas",
    "ddpm_linear_grid",
    "flow_match_grid",
    "get_sigmas_exponential",
    "get_sigmas_karras",
    "get_sigmas_polyexponential",
    "get_sigmas_vp",
    "karras_linear_grid",
    "linear_grid",
    "named_grid",
    "schedule_grid",
    "shift_sigmas",
    "uniform_grid",
    "vp_sigmas",
)
# the places users import them from (README, docs): the same objects, re-exported
RE_EXPORTS = {
    "specforest": ("flow_match_grid", "uniform_grid"),
    "specforest.sde": ("MAX_STEPS", "check_sigmas", "flow_match_grid", "shift_sigmas", "uniform_grid"),
    "specforest.chains": ("PATHS", "ddpm_linear_grid", "karras_linear_grid"),
    "specforest.options": ("GRIDS",),
    "specforest.kdiffusion": (
        "PATHS",
        "get_sigmas_exponential",
        "get_sigmas_karras",
        "get_sigmas_polyexponential",
        "get_sigmas_vp",
        "linear_grid",
    ),
}


def test_every_grid_and_schedule_is_made_in_the_schedules_module():
    import importlib

    from specforest import schedules

    for name in GRID_BUILDERS:
        obj = getattr(schedules, name)
        assert name in schedules.__all__
        if callable(obj):
            assert obj.__module__ == "specforest.schedules", f"{name} is made in {obj.__module__}"
    for module, names in RE_EXPORTS.items():
        there = importlib.import_module(module)
        for name in names:
            assert getattr(there, name) is getattr(schedules, name), f"{module}.{name} is not schedules.{name}"


def grid_dispatches(root: Path) -> list:
    """``["module:line"]`` where a module other than ``schedules`` compares a value with a named grid's
    name (``grid == "flow_match"``): choosing among the named grids is :func:`specforest.schedules.named_grid`'s."""
    found = []
    for name, (path, _) in _modules(root).items():
        if name.endswith(".schedules"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value == "flow_match" for o in operands):
                    found.append(f"{name}:{node.lineno}")
    return found


def test_the_named_grids_are_chosen_in_one_place():
    import torch

    from specforest.schedules import flow_match_grid, named_grid, uniform_grid

    assert not grid_dispatches(ROOT), grid_dispatches(ROOT)
    assert torch.equal(named_grid("flow_match", 7, shift=3.0), flow_match_grid(7, shift=3.0))
    assert torch.equal(named_grid("uniform", 7, shift=0.5), uniform_grid(7, shift=0.5))
    with pytest.raises(ValueError, match="grid"):
        named_grid("karras", 7)


def test_the_grid_dispatch_checker_finds_a_comparison(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "a.py": "def f(g):\n    return 1 if g == 'flow_match' else 2\n"})
    assert grid_dispatches(root) == ["pkg.a:2"]


# -- one word for the noise level, one name per coefficient ------------------------------------------------


def _code_names(tree: ast.AST) -> set:
    """The names a module's code binds or reads (variables, arguments, attributes), not its text."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
    return out


def test_the_chain_layer_has_one_word_for_the_level_and_one_name_per_coefficient():
    """In ``sde.py`` and ``chains.py`` the linear-path level is ``t`` (``sigma`` is a VE level; ``sigmas``
    the grid's name in every signature), the reverse drift is ``b`` and a multistep chain's coefficients
    of its past predictions are ``past``: no ``B`` or ``b1`` beside ``b``, no ``_ve`` that is both a
    level's map and a chain's coefficients, and no ``sigma`` meaning a linear-path level in ``sde.py``."""
    sde = (ROOT / "sde.py").read_text(encoding="utf-8")
    chains = (ROOT / "chains.py").read_text(encoding="utf-8")
    for text, where in ((sde, "sde.py"), (chains, "chains.py")):
        names = _code_names(ast.parse(text))
        assert not names & {"B", "b1"}, f"{where}: {sorted(names & {'B', 'b1'})}"
    assert not re.findall(r"\bsigma(?:_n)?\b", sde), "sde.py calls the linear-path level sigma"
    from specforest.chains import DPMPP2MSDE, DPMPP3MSDE

    assert callable(DPMPP2MSDE.ve_terms) and callable(DPMPP3MSDE.ve_terms)
    assert not hasattr(DPMPP3MSDE, "_ve")


def test_the_reverse_sde_is_its_own_modules_and_sde_holds_the_tables_only():
    """``sde.py`` is one concept, the tabulated Gaussian chain (``GaussianChain``, ``StepTables``); the paper's chain
    (``ReverseSDE``) is made in ``specforest.reverse_sde`` and exported as ``specforest.ReverseSDE``. ``sde``
    does not re-export it: ``reverse_sde`` imports ``sde``, and the package has no import cycle
    (``tests/test_imports.py``)."""
    import inspect

    import specforest
    from specforest import reverse_sde, sde
    from specforest.reverse_sde import ReverseSDE

    assert ReverseSDE.__module__ == "specforest.reverse_sde"
    assert ReverseSDE is reverse_sde.ReverseSDE is specforest.ReverseSDE
    assert not hasattr(sde, "ReverseSDE")
    made = {n for n, obj in vars(sde).items() if inspect.isclass(obj) and obj.__module__ == "specforest.sde"}
    assert made == {"GaussianChain", "StepTables"}
