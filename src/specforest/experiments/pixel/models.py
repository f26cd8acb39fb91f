"""The models the pixel experiment, its ``generate`` job and ``specforest tune`` run: declared once here.

Each :class:`PixelModel` names a shipped EDM denoiser (``digits``: the class-conditional
``1 x 8 x 8`` model of :mod:`specforest.models.digits`; ``natural32``, ``natural64``: the
unconditional natural-image models of :mod:`specforest.models.natural`), the shape of one
state, whether it takes class labels, how to load it as a velocity, and the classifier a run
reports the accuracy of (digits only). The command line's ``--model`` of ``pixel``,
``generate pixel`` and ``tune`` lists :data:`PIXEL_MODELS` and resolves a name through
:func:`pixel_model`; nothing else names the models.

``draft="learned"`` is the draft network the model object declares (its ``learned_draft``,
:func:`specforest.drafts.model.declared_draft`); :func:`refuse_undeclared_learned` refuses it, before
anything runs, for a model that declares none, rather than the library's fallback to the digits
model's draft (which serves ``1 x 8 x 8`` only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ...models import digits, natural
from ...models.digits import IMAGE_SHAPE, NUM_CLASSES
from ..common import check_choice

__all__ = [
    "DEFAULT_MODEL",
    "PIXEL_MODELS",
    "PixelModel",
    "pixel_model",
    "refuse_undeclared_learned",
    "tune_target",
]


@dataclass(frozen=True)
class PixelModel:
    """One model of the pixel experiment.

    Attributes:
        name: what ``--model`` calls it (``digits``, ``natural32``, ``natural64``).
        description: what a run's record says under ``model`` (``"digits 1x8x8 (EDM U-Net)"``).
        shape: one state's shape ``(C, H, W)``.
        num_classes: the class labels it is conditioned on (``0``: unconditional).
        loader: ``device -> velocity``, the shipped network's loader (:meth:`load`).
    """

    name: str
    description: str
    shape: tuple[int, ...]
    loader: Callable[..., Callable[..., torch.Tensor]] = field(repr=False, compare=False)
    num_classes: int = 0

    @property
    def conditional(self) -> bool:
        """Whether a run draws a class label per sample and passes it as ``cond["class_labels"]``."""
        return self.num_classes > 0

    def load(self, device: "str | torch.device" = "cpu") -> Callable[..., torch.Tensor]:
        """The shipped network as a velocity ``v(x: (M, *shape), sigma: (M,), **cond) -> (M, *shape)``
        (an :class:`~specforest.models.edm.EDMDenoiserVelocity` declaring its memory per row and keeping
        its deep features for ``draft="cached"``)."""
        return self.loader(device=device)

    def classifier(self) -> Optional[Any]:
        """The classifier a run scores its samples with against their labels (the digits classifier),
        ``None`` for an unconditional model: its record's ``classifier_accuracy`` is null."""
        if not self.conditional:
            return None
        from ...models.digits import load_classifier

        return load_classifier()

    def cond(self, labels: Optional[torch.Tensor]) -> Optional[dict]:
        """The conditioning of states with ``labels (n,)``: ``{"class_labels": labels}``, or ``None``."""
        return None if labels is None else {"class_labels": labels}


PIXEL_MODELS: dict[str, PixelModel] = {
    "digits": PixelModel(
        "digits", "digits 1x8x8 (EDM U-Net)", IMAGE_SHAPE, digits.load_velocity, num_classes=NUM_CLASSES
    ),
    **{
        name: PixelModel(
            name,
            f"{name} {'x'.join(map(str, m.state_shape))} (EDM U-Net)",
            m.state_shape,
            functools.partial(natural.load_velocity, name),
        )
        for name, m in natural.MODELS.items()
    },
}
"""The models by the name ``--model`` gives them, the default first."""

DEFAULT_MODEL = "digits"
"""The model of a run that names none (every record and job made before ``--model`` existed)."""


def pixel_model(name: str) -> PixelModel:
    """The model called ``name``.

    Raises:
        ValueError / TypeError: naming ``model`` and the accepted names.
    """
    return PIXEL_MODELS[check_choice("model", name, tuple(PIXEL_MODELS))]


def refuse_undeclared_learned(
    velocity: Any, model: PixelModel, drafts: "str | Iterable[str]", *, param: str = "draft"
) -> None:
    """Refuse ``draft="learned"`` among ``drafts`` for a model object that declares no draft network.

    The declaration is read on the object (``learned_draft`` on the velocity or the denoiser it wraps,
    :func:`specforest.drafts.model.declared_draft`), never from a list of model names: a model that
    gains a distilled draft gets ``learned`` by declaring it.

    Args:
        velocity: the loaded model (:meth:`PixelModel.load`).
        model: its declaration here (named in the message).
        drafts: the run's draft, or the drafts a tuner considers.
        param: the parameter that named them (``draft``, ``drafts``), as the message names it.

    Raises:
        ValueError: naming ``param='learned'``, the model and that it declares no draft network.
    """
    from ...drafts.model import declared_draft

    names = (drafts,) if isinstance(drafts, str) else tuple(drafts)
    if "learned" in names and declared_draft(velocity) is None:
        raise ValueError(
            f"{param}='learned' runs the draft network the model declares (learned_draft), and the {model.name} "
            "model declares no draft network; choose another draft (cached, x0, velocity, ...)"
        )


def tune_target(
    name: str, n: int, device: "str | torch.device" = "cpu"
) -> "tuple[Callable[..., torch.Tensor], torch.Tensor, Optional[dict]]":
    """What ``specforest tune --model NAME`` measures: the model's velocity, ``n`` initial states
    ``x (n, *shape)`` of seed 0 (:func:`specforest.streams.randn`, sample ``i`` a function of ``i``), and
    their conditioning (a conditional model's labels cycle through its classes, ``i mod num_classes``;
    ``None`` for an unconditional model).

    Raises:
        ValueError / TypeError: naming ``model`` and the accepted names.
    """
    from ... import streams

    pm = pixel_model(name)
    idx = torch.arange(n)
    x = streams.randn(0, idx, pm.shape, device=device)
    cond = pm.cond((idx % pm.num_classes).to(device)) if pm.conditional else None
    return pm.load(device=device), x, cond
