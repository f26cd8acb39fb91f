"""Command line: ``specforest couplings table`` and ``specforest couplings plot``.

A thin shell over :mod:`specforest.landscape`: the per-step acceptance of each
coupling against the mismatch delta, and the i.i.d. list bound.
"""

from __future__ import annotations

import json

import click

from .common import float_list, int_list, output_path

__all__ = ["couplings"]


@click.group()
def couplings() -> None:
    """Acceptance of the couplings against the mismatch delta, and the i.i.d. list bound."""


@couplings.command("table")
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object per line (delta, K, rmc, grs, rank, antithetic, bound)."
)
@click.option("--K-values", "K_values", default="1,2,4,8", show_default=True, help="Comma list of K (>= 1).")
@click.option(
    "--deltas",
    default=",".join(f"{0.25 * i:g}" for i in range(21)),
    show_default=True,
    callback=float_list("deltas", 0.0, 50.0),
    help="Comma list of delta values in [0, 50].",
)
def couplings_table(as_json: bool, K_values: str, deltas: list[float]) -> None:
    """Per-step acceptance of RMC, GRS, rank and antithetic couplings and the bound.

    rmc is the single-proposal maximal coupling (independent of K); antithetic
    (K/2 mirrored pairs) is defined for even K only (null otherwise) and can
    exceed the bound, which holds for i.i.d. children.
    """
    from ..landscape import acceptance_table

    Ks = int_list("K-values", 1)(None, None, K_values)
    rows = acceptance_table(deltas, Ks)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r))
        return
    click.echo(f"{'K':>3} {'delta':>6} {'rmc':>8} {'grs':>8} {'rank':>8} {'anti':>8} {'bound':>8}")
    for r in rows:
        anti = "-" if r["antithetic"] is None else f"{r['antithetic']:.4f}"
        click.echo(
            f"{r['K']:>3} {r['delta']:>6.2f} {r['rmc']:>8.4f} {r['grs']:>8.4f} {r['rank']:>8.4f} {anti:>8} {r['bound']:>8.4f}"
        )


@couplings.command("plot")
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default="acceptance_landscape.png",
    show_default=True,
    callback=output_path(".png", what="a PNG image"),
    help="PNG file to write.",
)
@click.option("--K-values", "K_values", default="1,2,4,8", show_default=True, help="Comma list of K (>= 1).")
def couplings_plot(out: str, K_values: str) -> None:
    """Plot per-step acceptance against delta in [0, 5] for each K (one panel per K)."""
    from ..landscape import plot_landscape

    plot_landscape(out, Ks=int_list("K-values", 1)(None, None, K_values))
    click.echo(f"wrote {out}")
