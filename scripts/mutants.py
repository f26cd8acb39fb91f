"""Mutation check: every shipped mutant of the library must be killed by the fast tests it names.

A mutant is one file ``mutants/NAME.patch``: a unified diff made with ``git diff`` against the
library (a wrong line that changes the law of the samples), headed by comment lines that
``git apply`` ignores::

    # Mutant: what is wrong, in one line
    # Killed by: tests/test_exactness_units.py::test_name[case]
    # Killed by: (more pytest node ids, if several tests must run)
    diff --git a/src/specforest/... b/src/specforest/...

For each mutant the script copies the working tree's files that git knows (tracked, and untracked
ones it does not ignore) to a temporary folder, applies the patch there, and runs only the named
tests with this Python, ``PYTHONPATH=<copy>/src`` so that the mutated copy is imported instead of
the installed package (checked once, by importing it). The mutant is killed when the tests fail.
First the same tests run once on the unmutated copy, where they must pass; otherwise a failing
test would "kill" every mutant.

Usage::

    python scripts/mutants.py            # every mutant (make mutants)
    python scripts/mutants.py NAME ...   # the mutants mutants/NAME.patch (make mutants NAME=...)
    python scripts/mutants.py --list     # the mutants and their killing tests

Exit status 0 when every mutant is killed; 1 when one survives, a patch no longer applies, the
named tests fail on the unmutated copy, or the copy is not what the tests import.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
KILLER = re.compile(r"^# Killed by:\s*(\S+)\s*$")
DESCRIPTION = re.compile(r"^# Mutant:\s*(.+?)\s*$")


@dataclass(frozen=True)
class Mutant:
    """One patch file: its name, what it breaks and the pytest node ids that must kill it."""

    name: str
    path: Path
    description: str
    killers: tuple[str, ...]


def read_mutant(path: Path) -> Mutant:
    """Parse the header of ``path`` (the comment lines before its first ``diff --git``).

    Raises:
        ValueError: if the patch names no killing test, names one outside ``tests/``, or has no diff.
    """
    killers, description, has_diff = [], "", False
    for line in path.read_text().splitlines():
        if line.startswith("diff --git "):
            has_diff = True
            break
        if m := KILLER.match(line):
            killers.append(m.group(1))
        elif m := DESCRIPTION.match(line):
            description = m.group(1)
    if not has_diff:
        raise ValueError(f"{path}: no 'diff --git' section (make the patch with git diff)")
    if not killers:
        raise ValueError(f"{path}: name the fast test that kills it in a '# Killed by: tests/...::test' line")
    bad = [k for k in killers if not k.startswith("tests/")]
    if bad:
        raise ValueError(f"{path}: killing tests must be pytest node ids under tests/, got {bad}")
    return Mutant(path.stem, path, description, tuple(killers))


def all_mutants() -> dict[str, Mutant]:
    """Every ``mutants/*.patch``, by name."""
    return {p.stem: read_mutant(p) for p in sorted(MUTANTS.glob("*.patch"))}


def copy_tree(dest: Path) -> None:
    """Copy the working tree's files that git knows (tracked and untracked-but-not-ignored) to ``dest``:
    the library, the tests, the data and docs they read, pyproject.toml's pytest settings."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def environment(copy: Path) -> dict[str, str]:
    """The tests' environment: the copy's ``src`` first on the path; git never looks above the copy."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy / "src"), env.get("PYTHONPATH")]))
    env["GIT_CEILING_DIRECTORIES"] = str(copy.parent)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def imported_from(copy: Path) -> str:
    """Where ``import specforest`` resolves in the copy's environment.

    Raises:
        RuntimeError: if it is not the copy's ``src`` (the installed package would be tested instead).
    """
    res = subprocess.run(
        [sys.executable, "-c", "import specforest; print(specforest.__file__)"],
        cwd=copy,
        env=environment(copy),
        capture_output=True,
        text=True,
    )
    where = res.stdout.strip()
    if res.returncode or not Path(where).resolve().is_relative_to((copy / "src").resolve()):
        raise RuntimeError(f"specforest is imported from {where or res.stderr.strip()!r}, not from {copy / 'src'}")
    return where


def run_tests(copy: Path, killers: "tuple[str, ...] | list[str]") -> tuple[int, str]:
    """Run the node ids ``killers`` in ``copy``; pytest's exit status and the tail of its output."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *killers],
        cwd=copy,
        env=environment(copy),
        capture_output=True,
        text=True,
    )
    return res.returncode, "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])


def apply_patch(copy: Path, mutant: Mutant) -> str:
    """Apply ``mutant`` to ``copy``; ``""`` on success, else git's complaint."""
    res = subprocess.run(
        ["git", "apply", str(mutant.path)], cwd=copy, env=environment(copy), capture_output=True, text=True
    )
    return "" if res.returncode == 0 else (res.stderr.strip() or "git apply failed")


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (mutants/NAME.patch); default: all")
    parser.add_argument("--list", action="store_true", help="list the mutants and their killing tests, run nothing")
    args = parser.parse_args(argv)
    try:
        known = all_mutants()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"error: no mutant named {unknown}; known: {sorted(known)}", file=sys.stderr)
        return 1
    chosen = [known[n] for n in args.names] if args.names else list(known.values())
    if not chosen:
        print(f"error: no mutants in {MUTANTS}", file=sys.stderr)
        return 1
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.description}\n    " + "\n    ".join(m.killers))
        return 0

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specforest-mutants-") as tmp:
        clean = Path(tmp) / "clean"
        copy_tree(clean)
        try:
            print(f"specforest imported from {imported_from(clean)}")
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        killers = list(dict.fromkeys(k for m in chosen for k in m.killers))
        rc, tail = run_tests(clean, killers)
        if rc != 0:
            print(f"error: the killing tests do not pass on the unmutated copy (pytest exit {rc}):\n{tail}")
            return 1
        print(f"unmutated copy: {len(killers)} killing tests pass")
        results = {}
        for m in chosen:
            copy = Path(tmp) / m.name
            shutil.copytree(clean, copy, ignore=shutil.ignore_patterns("__pycache__"))
            problem = apply_patch(copy, m)
            if problem:
                results[m.name] = "does not apply"
                print(f"{m.name}: DOES NOT APPLY\n{problem}")
                continue
            rc, tail = run_tests(copy, m.killers)
            # exit 1: tests ran and failed; 0: they passed; anything else (no test collected, a
            # collection or usage error) proves nothing about the tests' power
            results[m.name] = {0: "SURVIVED", 1: "killed"}.get(rc, f"error (pytest exit {rc})")
            print(f"{m.name}: {results[m.name]}  ({m.description})")
            # what killed it (pytest's summary lines), or everything pytest said when nothing did
            print("\n".join(f"    {ln}" for ln in tail.splitlines() if rc != 1 or ln.startswith("FAILED")))
            shutil.rmtree(copy)
    bad = [n for n, r in results.items() if r != "killed"]
    print(f"{len(results) - len(bad)}/{len(results)} mutants killed in {time.perf_counter() - t0:.0f} s")
    if bad:
        print(f"not killed: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
