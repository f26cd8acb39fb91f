"""Command line: ``specforest tune --model gmm|digits --out tuned.json``: the fastest configuration here.

A thin shell over :func:`specforest.latency.tune`: measures the target's
batch-cost curve on the device, calibrates acceptance on a short run, times the
sampler's own work per candidate, prints the chosen configuration with its
predicted latency next to the standard sampler's, and writes it.
"""

from __future__ import annotations

import json

import click

from .atomic import atomic_write_text
from .cli_common import (
    CONTEXT,
    churn_option,
    library_errors,
    progress_option,
    set_threads,
    steps_option,
    threads_option,
)

__all__ = ["tune"]


def _target(model: str, o: dict, n: int):
    import torch

    from . import streams

    idx = torch.arange(n)
    if model == "gmm":
        from .models import GaussianMixture

        gmm = GaussianMixture.paper(dim=o["dim"], components=o["components"], seed=o["mixture_seed"])
        return gmm, streams.randn(0, idx, (o["dim"],), device=o["device"]), None
    from .models.digits import IMAGE_SHAPE, load_velocity

    cond = {"class_labels": (idx % 10).to(o["device"])}
    return load_velocity(device=o["device"]), streams.randn(0, idx, IMAGE_SHAPE, device=o["device"]), cond


@click.command("tune", context_settings=CONTEXT)
@click.option("--model", type=click.Choice(["gmm", "digits"]), required=True, help="The target to tune for.")
@steps_option(30)
@churn_option(0.1)
@click.option("--batch", type=click.IntRange(1), default=1, show_default=True, help="Images per run (>= 1).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dim", type=click.IntRange(1), default=500, show_default=True, help="gmm: dimension.")
@click.option("--components", type=click.IntRange(1), default=5, show_default=True, help="gmm: components.")
@click.option("--mixture-seed", type=click.IntRange(0), default=0, show_default=True, help="gmm: mixture seed.")
@click.option("--drafts", default="velocity,x0", show_default=True, help="Comma list of draft kinds to consider.")
@click.option("--budget-max", type=click.IntRange(1), default=62, show_default=True, help="Largest budget tried.")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="The JSON to write.")
@threads_option()
@progress_option()
def tune(**o) -> None:
    """Measure this device's batch-cost curve and the sampler's own time, and pick the fastest configuration.

    The JSON holds the configuration (tree as its parent list, coupling, verify,
    draft), predicted_seconds_per_image, predicted_speedup over the standard
    sampler, the cost curve and every candidate's prediction. The tuner measures
    with the thread count it sets (--threads).
    """
    from .latency import tune as tune_fn

    threads = set_threads(o["threads"])
    model, x, cond = library_errors(lambda: _target(o["model"], o, max(o["batch"], 16)))
    drafts = [d.strip() for d in o["drafts"].split(",") if d.strip()]
    res = library_errors(
        lambda: tune_fn(
            model,
            x,
            steps=o["steps"],
            churn=o["churn"],
            cond=cond,
            batch=o["batch"],
            budget_max=o["budget_max"],
            drafts=drafts,
            progress=o["progress"],
        )
    )
    data = res.to_json()
    data["tuned_for"] = {k: o[k] for k in ("model", "steps", "churn", "batch", "device", "dim", "components")}
    data["tuned_for"]["threads"] = threads
    atomic_write_text(o["out"], json.dumps(data, indent=1) + "\n")
    ms = 1e3
    click.echo(
        f"chosen: {res.label}: {ms * res.predicted_seconds_per_image:.2f} ms per image predicted, "
        f"{res.predicted_speedup:.2f}x the standard sampler's {ms * res.standard_seconds_per_image:.2f} ms "
        f"({o['batch']} per run, {threads} thread(s)); wrote {o['out']}"
    )
    for c in res.candidates[:5]:
        click.echo(f"  {c['label']}: {ms * c['seconds_per_image']:.2f} ms per image, {c['calls']:.1f} calls")
