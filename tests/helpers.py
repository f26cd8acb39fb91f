"""What several test files share: a deliberately wrong coupling, and running the CLI as a user would.

``KeepFirst`` accepts its first child whatever the target: the wrong variant every law test must
reject. ``invoke`` runs ``specforest`` in-process (click's runner) and restores torch's thread count,
which ``--threads`` changes; ``refused`` asserts a one-line click error that names what it should;
``never_called`` stands in for a command's work when a bad input must be refused before it (the
``no_work`` fixture of ``conftest.py``).
"""

from __future__ import annotations

import torch
from click.testing import CliRunner, Result

from specforest.cli import main
from specforest.couplings import GRS


class KeepFirst(GRS):
    """Deliberately wrong: accepts its first child whatever the target."""

    name = "keep-first"

    def select(self, s_hat, delta, valid, rng):
        P = s_hat.shape[0]
        return torch.ones(P, dtype=torch.bool), torch.zeros(P, dtype=torch.long)


def invoke(*args) -> Result:
    """``specforest ARGS`` run in-process; torch's thread count is restored after it."""
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(main, [str(a) for a in args])
    finally:
        torch.set_num_threads(threads)


def refused(res: Result, *names: str, codes: "tuple[int, ...]" = (2,)) -> str:
    """The one-line click error of ``res`` (no traceback), exiting with one of ``codes``, which names
    every one of ``names``; returned on one line."""
    # a click error ends in SystemExit; any other exception is a traceback from inside (or the work began)
    assert isinstance(res.exception, SystemExit), (res.exception, res.output)
    assert res.exit_code in codes and "Error" in res.output, (res.exit_code, res.output)
    out = " ".join(res.output.split())
    for name in names:
        assert name in out, (name, out)
    return out


def never_called(*args, **kwargs):
    raise RuntimeError("the work began: the bad input was not refused before it")
