"""The suite's setup and its own rule.

* torch on one thread (``OMP_NUM_THREADS=1`` unless the environment sets it, before anything imports
  torch, so the commands the tests start inherit it): the tests' models are tiny, and on a loaded machine
  two threads per process fighting over the cores made the same tests several times slower.
* The fast tier (``-m "not slow"``, ``make test``) runs a test of every test file. A file whose every
  test carries ``@pytest.mark.slow`` would drop out of ``make test`` without a word; a run that collects
  the whole suite refuses to start then, naming the file. (A run of a few files, or of selected tests,
  checks nothing: what it leaves out is not missing.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

TESTS = Path(__file__).resolve().parent


def files_without_fast_tests(items: list, test_files: "set[Path]") -> "list[str] | None":
    """The names of the test files none of whose ``items`` is outside the slow tier, or ``None`` when
    ``items`` do not come from every one of ``test_files`` (a partial run: nothing to check)."""
    collected = {Path(item.path) for item in items}
    if not test_files <= collected:
        return None
    fast = {Path(item.path) for item in items if item.get_closest_marker("slow") is None}
    return sorted(p.name for p in test_files - fast)


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect anything
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    missing = files_without_fast_tests(items, set(TESTS.glob("test_*.py")))
    if missing:
        raise pytest.UsageError(
            f"every test of {', '.join(missing)} is marked slow: `make test` (-m 'not slow') would run none of "
            "them; keep a covering subset of each file outside the slow tier"
        )


@pytest.fixture
def no_work(monkeypatch):
    """Every command's work replaced by :func:`helpers.never_called`, which raises (the checks before it
    still run): a bad input must be refused before the work begins."""
    from helpers import never_called

    from specforest import landscape, latency
    from specforest.experiments import drafts, pipelines, pixel, sd3, train_digits, train_digits_draft, train_natural
    from specforest.experiments import generate as gen_exp
    from specforest.experiments import gmm as gmm_exp

    for module, name in (
        (pixel, "simulate"),
        (pixel, "run_sweep"),
        (gmm_exp, "simulate"),
        (gmm_exp, "run_sweep"),
        (gen_exp, "run_job"),
        (latency, "tune"),
        (drafts, "draft_diagnostics"),
        (landscape, "plot_landscape"),
        (train_digits, "main_train"),
        (train_digits_draft, "main_train_draft"),
        (train_natural, "main_train_natural"),
        (sd3, "load_pipeline"),
        (pipelines, "load_pipeline"),
    ):
        monkeypatch.setattr(module, name, never_called)
