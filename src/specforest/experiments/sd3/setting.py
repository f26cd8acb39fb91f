"""The SD3 study's setting (the paper's Sec. 5.3 by default) and its configurations."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...options import check_option
from ..common import budget_of, check_churn, check_int, check_number
from ..further_options import further_options, with_options

__all__ = ["DETERMINISTIC_STEPS", "METHODS", "SD3Setting", "configs", "setting_id"]

METHODS = ("standard", "rmc", "dgrs", "tuned")
"""The methods of the study: the standard sampler, D-GRS and RMC, and ``tuned``, the configuration
``specforest tune`` chose (any tree, coupling, verification mode and draft)."""

DETERMINISTIC_STEPS = 2
"""Steps every sampler takes as plain Euler steps: the first, from pure noise, and the last, into 0."""


@dataclass(frozen=True)
class SD3Setting:
    """Everything that defines one study (the paper's Sec. 5.3 by default).

    Attributes:
        height, width: image size in pixels.
        steps: grid steps ``T`` (>= 3: the first and last are deterministic).
        guidance_scale: classifier-free guidance (<= 1: none).
        churn: ``eps`` in (0, 1].
        shift: static timestep shift ``kappa`` (eq. 38), overriding the scheduler's.
        L: tree depth of D-GRS.
        K_values: tree widths of D-GRS; RMC runs a chain of ``budget_of("dgrs", K, L)`` for each.
        verify: ``drafted`` (every drafted state evaluated, the paper's protocol) or ``internal``.
        prefetch: ``nearest`` or ``parent`` (ERRATA 9).
        draft: the draft of every speculative configuration (``velocity``, the paper's protocol).
        lazy: the sampler's cost simulation (same law and NFE, less memory).
        seed: seed of the initial latents and of the sampling noise.
        batch_size: images per sampler call (``None``: all at once).
        max_sequence_length: T5 tokens.
        options: further options of :func:`specforest.sample` by name, passed to every run of the study
            (:func:`specforest.diffusers.sample`, which refuses one it does not take) and recorded under
            their keys (:mod:`specforest.experiments.further_options`); none the study sets itself
            (``steps``, ``churn``, ``tree``, ...).

    Raises:
        ValueError / TypeError: on an invalid field, naming it.
    """

    height: int = 512
    width: int = 512
    steps: int = 50
    guidance_scale: float = 7.0
    churn: float = 0.8
    shift: float = 3.0
    L: int = 2
    K_values: tuple[int, ...] = (2, 3, 4, 5, 6, 7)
    verify: str = "drafted"
    prefetch: str = "nearest"
    draft: str = "velocity"
    lazy: bool = False
    seed: int = 0
    batch_size: int | None = None
    max_sequence_length: int = 256
    options: dict = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name, lo in (("height", 1), ("width", 1), ("steps", 3), ("L", 1), ("seed", 0), ("max_sequence_length", 1)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), lo))
        if self.batch_size is not None:
            object.__setattr__(self, "batch_size", check_int("batch_size", self.batch_size, 1))
        ks = tuple(check_int("K_values", k, 1) for k in self.K_values)
        if not ks:
            raise ValueError("K_values must be a non-empty list of ints >= 1, got an empty one")
        object.__setattr__(self, "K_values", tuple(sorted(set(ks))))
        # validated, not converted: the values enter the resume key as given
        check_churn(self.churn)
        check_number("guidance_scale", self.guidance_scale, 0.0)
        check_number("shift", self.shift, 0.0, lo_open=True)
        for name in ("verify", "prefetch", "draft"):
            check_option(name, getattr(self, name))  # (the choices the sampler's options declare)
        object.__setattr__(self, "options", further_options(self.options, by="the SD3 study"))
        self.as_dict()  # (an option's key that is a field already is refused now, before any work)

    def as_dict(self) -> dict:
        """The fields as a JSON-serializable dict (``K_values`` a list; the further options under their
        record keys, none without them)."""
        d = dataclasses.asdict(self)
        d["K_values"] = list(self.K_values)
        return with_options(d, d.pop("options"))


def configs(K_values: Sequence[int], L: int) -> list[tuple[str, int, int]]:
    """``(method, K, L)`` of a study: the standard sampler, then D-GRS ``(K, L)``
    and RMC on a chain of the matched budget ``B = K + ... + K^L`` (recorded as
    ``(1, B)``) for each ``K``."""
    out = [("standard", 0, 0)]
    for K in sorted(set(K_values)):
        out += [("dgrs", K, L), ("rmc", 1, budget_of("dgrs", K, L))]
    return out


def setting_id(setting: SD3Setting, prompts: Sequence[str], model: str, dtype: str) -> str:
    """Short hash of what makes results comparable: the setting (``K_values`` aside), captions, model, dtype.

    ``K_values`` is left out so that a study can be extended to more ``K`` in the same directory; the
    further options are in under their record keys (none without them: the ids of studies made before stay).
    """
    st = {k: v for k, v in setting.as_dict().items() if k != "K_values"}
    if st["draft"] == "velocity":
        del st["draft"]  # the paper's draft: the ids of studies made before the option stay
    blob = json.dumps({"setting": st, "prompts": list(prompts), "model": model, "dtype": dtype}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
