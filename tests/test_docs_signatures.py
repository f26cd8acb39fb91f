"""Every call and signature README.md and docs/*.md show is the library's own (issue 40, item 10).

The README gave ``trees.optimal(model, B, depth)`` for a function that takes an acceptance model.
Here each Python block and each inline code span of the documentation is parsed (``ast``); every
call in it whose callee resolves to a specforest function or class (through the block's imports,
the submodules' short names, or a public name of the library) is bound to its signature
(``inspect.signature(...).bind``): an unknown keyword, a missing required argument or one
positional argument too many fails, naming the file and line. A call with ``...`` among its
arguments, and a call in the prose (an inline span, which may show some of its arguments), is bound
partially: a missing argument is no error there. In an inline span written as a signature
(``trees.chain(L)``), each positional name must be the parameter's own name or one of the
abbreviations the docs use throughout (:data:`ABBREVIATIONS`); a span written with ``*``
(``plan_tree(model, x, *, budget, ...)``) must list the parameters, their kinds and the defaults it
shows as the function has them. The examples that run (the README's Python API) run in the slow tier.
"""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import specforest
from specforest.options import RUN_INPUTS, SamplerOptions

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SUBMODULES = (
    "trees",
    "planning",
    "streams",
    "couplings",
    "proposals",
    "testing",
    "latency",
    "distributed",
    "kdiffusion",
    "acceptance",
    "memory",
    "warmup",
    "allocator",
    "diffusers",
    "options",
    "models",
)
"""The submodules users import (``docs/api.md``), by the short names the docs call them."""

ABBREVIATIONS = {"B": "budget", "T": "steps"}
"""A positional name the docs show for a parameter: the budget ``B``, the steps ``T``."""

DOC_NAMESPACES = {"diffusers.md": "specforest.diffusers", "kdiffusion.md": "specforest.kdiffusion"}
"""Where a doc's bare names (``sample(pipe, ...)``) live, when not at the top level."""

_OPTIONS = set(SamplerOptions.names()) | set(RUN_INPUTS)


def _option_takers() -> set:
    """The functions whose ``**`` keywords are :func:`specforest.sample`'s options and run inputs."""
    from specforest import kdiffusion, planning

    return {
        specforest.sample,
        specforest.standard_sample,
        specforest.generate,
        kdiffusion.sample,
        kdiffusion.sample_speculative,
        planning.plan_tree,
    }


def _short_names() -> dict:
    names = {"specforest": specforest}
    for sub in SUBMODULES:
        names[sub] = importlib.import_module(f"specforest.{sub}")
    return names


SHORT = _short_names()


def _public(name: str, namespace: object = None) -> object:
    """A bare name: the doc's ``namespace``'s, else the top-level one, else the one object of that
    name among the submodules' ``__all__``."""
    for ns in (namespace, specforest):
        if ns is not None and name in getattr(ns, "__all__", ()):
            return getattr(ns, name)
    hits = {
        id(getattr(m, name)): getattr(m, name)
        for m in SHORT.values()
        if name in getattr(m, "__all__", ()) and hasattr(m, name)
    }
    return next(iter(hits.values())) if len(hits) == 1 else None


def _dotted(node: ast.AST) -> list:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *parts[::-1]] if isinstance(node, ast.Name) else []


def _imports(tree: ast.AST) -> tuple:
    """``(names, missing)``: the specforest names a block imports (``from specforest.x import y``,
    ``import specforest.x as z``), and the imports that name nothing the library has."""
    names, missing = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specforest"):
            mod = importlib.import_module(node.module)
            for a in node.names:
                obj = getattr(mod, a.name, None)
                if obj is None:
                    try:
                        obj = importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        missing.append(f"from {node.module} import {a.name}")
                        continue
                names[a.asname or a.name] = obj
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("specforest"):
                    top = a.name.split(".")[0]
                    names[a.asname or top] = importlib.import_module(a.name if a.asname else top)
    return names, missing


def _resolve(parts: list, names: dict, namespace: object = None) -> tuple:
    """``(callee, is_method)``: the specforest object a dotted name denotes, and whether it is a plain
    function looked up on a class (its ``self`` is not shown); ``(None, False)`` when it is not one."""
    obj = names.get(parts[0]) or SHORT.get(parts[0])
    if obj is None:
        obj = _public(parts[0], namespace)
    owner = None
    for p in parts[1:]:
        if obj is None or not hasattr(obj, p):
            return None, False
        owner, obj = obj, getattr(obj, p)
    if obj is None or inspect.ismodule(obj) or not callable(obj):
        return None, False
    if not str(getattr(obj, "__module__", "")).startswith("specforest"):
        return None, False
    method = inspect.isclass(owner) and inspect.isfunction(inspect.getattr_static(owner, parts[-1], None))
    return obj, method


class _Any:
    """A stand-in for an argument the docs show by name."""


def _bind(sig: inspect.Signature, node: ast.Call, method: bool, partial: bool) -> tuple:
    """Bind the call's arguments (partially for an elided call, with ``...``, ``*args`` or ``**kwargs``
    among them, or when ``partial``); returns ``(bound arguments, the positional AST nodes)``."""
    dots = lambda a: isinstance(a, ast.Constant) and a.value is Ellipsis  # noqa: E731
    elided = any(dots(a) for a in node.args) or any(dots(k.value) for k in node.keywords)
    starred = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
    args = [a for a in node.args if not isinstance(a, ast.Starred) and not dots(a)]
    values = ([_Any()] if method else []) + [_Any() for _ in args]
    kwargs = {k.arg: _Any() for k in node.keywords if k.arg not in (None, "_elided_")}
    bound = (sig.bind_partial if partial or elided or starred else sig.bind)(*values, **kwargs)
    return bound, args


def _elided_tail(text: str) -> str:
    """``f(a, b=1, ...)`` (arguments elided after keywords, not Python) made parseable: the trailing
    ``...`` becomes the keyword ``_elided_=...``, which marks the call elided."""
    return re.sub(r",\s*\.\.\.\)$", ", _elided_=...)", text)


def _snippets():
    """``(doc, line, code, inline)`` for every Python block and inline code span of the docs."""
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"```python\n(.*?)```|`([^`\n]+)`", text, flags=re.S):
            line = text[: m.start()].count("\n") + 1
            if m.group(1) is not None:
                yield doc.name, line, m.group(1), False
            elif "(" in m.group(2) and not text[: m.start()].endswith("`"):
                yield doc.name, line, m.group(2), True


def _check_call(node: ast.Call, names: dict, inline: bool, namespace: object) -> "tuple[str, str] | None":
    """``(callee, problem)`` for a call that does not fit its specforest callee, ``(callee, "")`` for one
    that does, ``None`` for a call of something else."""
    parts = _dotted(node.func)
    if not parts:
        return None
    obj, method = _resolve(parts, names, namespace)
    if obj is None:
        return None
    name = ".".join(parts)
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    try:
        # prose mentions a call by some of its arguments (``sample(..., churn=1e-7)``): bound partially
        bound, args = _bind(sig, node, method, partial=inline)
    except TypeError as err:
        return name, str(err)
    extra = next((p for p in params if p.kind is p.VAR_KEYWORD), None)
    if extra is not None and obj in _option_takers():
        unknown = sorted(set(bound.arguments.get(extra.name, {})) - _OPTIONS)
        if unknown:
            return name, f"{unknown} are not options of specforest.sample"
    if inline:
        shown = params[1:] if method else params
        for p, a in zip(shown, args, strict=False):
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY):
                break
            if isinstance(a, ast.Name) and a.id != p.name and ABBREVIATIONS.get(a.id) != p.name:
                return name, f"shows {a.id!r} for the parameter {p.name!r}"
    return name, ""


def _check_signature_span(code: str, namespace: object) -> "tuple[str, str] | None":
    """A span written as a signature with ``*`` or defaults that is not a call, e.g.
    ``plan_tree(model, x, *, budget, steps, churn, coupling="grs", ...)``: its parameters against the function's."""
    m = re.fullmatch(r"([\w.]+)\((.*)\)", code)
    if not m:
        return None
    try:
        ast.parse(code)
        return None  # a call, checked as one
    except SyntaxError:
        pass
    try:
        fn = ast.parse(f"def _({m.group(2)}): pass").body[0]
    except SyntaxError:
        return None
    obj, method = _resolve(m.group(1).split("."), {}, namespace)
    if obj is None:
        return None
    actual = [p for p in inspect.signature(obj).parameters.values()][1 if method else 0 :]
    a = fn.args
    shown = (
        [(x.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for x in a.args]
        + ([(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL)] if a.vararg else [])
        + [(x.arg, inspect.Parameter.KEYWORD_ONLY) for x in a.kwonlyargs]
        + ([(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD)] if a.kwarg else [])
    )
    real = [(p.name, p.kind) for p in actual]
    if shown != real:
        return m.group(1), f"shows {[n for n, _ in shown]}, the function takes {[n for n, _ in real]}"
    defaults = dict(zip([x.arg for x in a.args][len(a.args) - len(a.defaults) :], a.defaults, strict=True))
    defaults.update({x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None})
    for p in actual:
        if p.name in defaults and ast.literal_eval(defaults[p.name]) != p.default:
            return m.group(1), f"shows {p.name}={ast.unparse(defaults[p.name])}, the default is {p.default!r}"
    return m.group(1), ""


def check_text(doc: str, line: int, code: str, inline: bool) -> list:
    """``(where, callee, problem)`` for every specforest call or signature of one snippet (problem ``""``: fits)."""
    found = []
    where = f"{doc}:{line}"
    namespace = importlib.import_module(DOC_NAMESPACES[doc]) if doc in DOC_NAMESPACES else None
    if inline:
        sig = _check_signature_span(code, namespace)
        if sig is not None:
            return [(where, *sig)]
        code = _elided_tail(code)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return found  # prose, an equation
    names, missing = _imports(tree)
    found += [(where, imp, "imports a name the library does not have") for imp in missing]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            hit = _check_call(node, names, inline, namespace)
            if hit is not None:
                found.append((where, *hit))
    return found


def _all_checks() -> list:
    return [c for snippet in _snippets() for c in check_text(*snippet)]


def test_every_call_the_docs_show_fits_the_librarys_signature():
    checks = _all_checks()
    wrong = [f"{where}: {callee}: {problem}" for where, callee, problem in checks if problem]
    assert not wrong, "\n".join(wrong)
    callees = {callee for _, callee, _ in checks}
    # the check reaches what the docs show of the API, the trees first
    for name in ("trees.optimal", "trees.chain", "trees.uniform", "planning.AdaptiveTree", "specforest.sample"):
        assert name in callees, sorted(callees)
    assert len(checks) >= 80, len(checks)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("trees.optimal(model, B, depth)", "shows 'model' for the parameter 'acceptance'"),
        ("trees.chain(L, K)", "too many positional arguments"),
        ("specforest.sample(model, x, stepz=30)", "['stepz'] are not options"),
        ("planning.plan_tree(model, x, *, budget, steps, churn, kmax=16)", "the function takes"),
        ("trees.optimal(acceptance, budget, max_depth, kmax=3)", ""),
    ],
)
def test_the_check_catches_a_wrong_signature(text, problem):
    """The README's old ``trees.optimal(model, B, depth)`` and other wrong calls fail the check."""
    (result,) = check_text("README.md", 1, text, inline=True)
    assert problem in result[2] and bool(result[2]) == bool(problem), result


def test_the_check_catches_a_missing_argument_in_an_example():
    (result,) = check_text("README.md", 1, "import specforest\nspecforest.trees.uniform(4)\n", inline=False)
    assert "missing a required argument: 'L'" in result[2], result


@pytest.mark.slow
def test_the_readme_python_api_example_runs():
    """The README's first Python block, as it is (100 trajectories of a 500-dimensional mixture, ~12 s)."""
    text = (ROOT / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    out = scope["out"]
    assert out.samples.shape == (100, 500)
    assert out.stats.nfe.shape == (100,) and bool((out.stats.nfe < 30).all())
