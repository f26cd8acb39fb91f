"""Stable Diffusion 3 text-to-image study of the paper (Sec. 5.3, Figure 5, Table 1).

The paper's setting: 512 x 512 images, ``T = 50`` steps, guidance 7, churn 0.8,
timestep shift 3 (eq. 38), lookahead ``L = 2`` and ``K = 2..7`` (budgets
``B = K + K^2 = 6..56``), D-GRS on the ``(K, 2)`` tree against RMC on a chain of
the matched budget ``B`` and the standard sampler (``T`` NFE per image), 100 COCO
captions, CLIP score with ``openai/clip-vit-large-patch14``.

Every configuration starts from the same initial latents (the generator of batch
``i`` is seeded from ``(seed, i)`` and draws the latents first), so the methods
differ only in how they sample the chain. Per image, the speedup is ``T / NFE``
(and ``(T - 2) / (NFE - 2)``, the stochastic steps per call spent on them, since
the first and last steps are deterministic Euler steps every sampler takes).
Results are written atomically after every configuration and a rerun with the
same setting skips what is done.

Modules: :mod:`.setting` (the study's setting and configurations),
:mod:`.loading` (captions, the pipeline, text embeddings), :mod:`.clip` (CLIP
scores), :mod:`.run` (one configuration), :mod:`.sweep` (the resumable study)
and :mod:`.report` (figure and text).
"""

from ..common import SweepResult, budget_of
from .clip import clip_scores
from .loading import DTYPES, encode_prompts, load_pipeline, load_prompts
from .report import format_line, format_summary, write_figure
from .run import run_config
from .setting import DETERMINISTIC_STEPS, METHODS, SD3Setting, configs, setting_id
from .sweep import KEY_FIELDS, run_experiment

__all__ = [
    "DETERMINISTIC_STEPS",
    "DTYPES",
    "KEY_FIELDS",
    "METHODS",
    "SD3Setting",
    "SweepResult",
    "budget_of",
    "clip_scores",
    "configs",
    "encode_prompts",
    "format_line",
    "format_summary",
    "load_pipeline",
    "load_prompts",
    "run_config",
    "run_experiment",
    "setting_id",
    "write_figure",
]
