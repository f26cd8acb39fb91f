"""The ``specforest`` command line: one module per command group, a thin shell over library calls.

:data:`main` is the root group; each command lives in its own module and is added here:

* ``gmm`` (and ``gmm sweep``, ``gmm drafts``): :mod:`.gmm`, over :mod:`specforest.experiments.gmm`;
* ``couplings table|plot``: :mod:`.couplings`, over :mod:`specforest.landscape`;
* ``pixel`` (and ``pixel sweep``): :mod:`.pixel`, over :mod:`specforest.experiments.pixel`;
* ``train digits|digits-draft|natural32|natural64``: :mod:`.train`, over
  :mod:`specforest.experiments.train_digits`, ``train_digits_draft`` and ``train_natural``;
* ``sd3``: :mod:`.sd3`, over :mod:`specforest.experiments.sd3`;
* ``diffusers``: :mod:`.diffusers`, over :mod:`specforest.experiments.pipelines`;
* ``generate gmm|pixel|sd3|diffusers``: :mod:`.generate`, over :mod:`specforest.experiments.generate`;
* ``tune``: :mod:`.tune`, over :func:`specforest.latency.tune`.

:mod:`.common` holds what they share: the one error policy and each shared option.
"""

from __future__ import annotations

import click

from . import couplings, diffusers, generate, gmm, pixel, sd3, train, tune
from .common import CONTEXT

__all__ = ["main"]


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="specforest")
def main() -> None:
    """specforest: exact speculative sampling for diffusion models on draft trees."""


for _command in (
    gmm.gmm,
    couplings.couplings,
    pixel.pixel,
    train.train,
    sd3.sd3,
    diffusers.diffusers_command,
    generate.generate,
    tune.tune,
):
    main.add_command(_command)
del _command
