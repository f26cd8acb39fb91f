"""k-diffusion's sampler signature over the exact speculative sampler.

:func:`sample_speculative` has the signature of k-diffusion's samplers
(``sample_euler(model, x, sigmas, extra_args=None, callback=None, disable=None,
**options)``), so it plugs in wherever they do (ComfyUI's ``KSAMPLER``, A1111,
Forge; ``docs/kdiffusion.md``). It runs the churned chain of
:func:`specforest.sample` on the given schedule: the same law for any tree,
coupling and draft, fewer sequential model calls.

The mapping (``path="ve"``, the default). A k-diffusion denoiser
``D(x, sigma, **extra_args)`` estimates ``E[x_0 | x]`` for ``x = x_0 + sigma xi``
(the VE / EDM parameterization). With ``t = sigma / (1 + sigma)``,

    x / (1 + sigma) = (1 - t) x_0 + t xi,

the library's linear path at level ``t`` (``1 - t = 1 / (1 + sigma)``). So the
schedule ``sigmas`` becomes the grid ``t_i = sigma_i / (1 + sigma_i)`` (decreasing,
``t = 0`` at ``sigma = 0``), the state is ``x_lin = x / (1 + sigma)``, and the
denoiser becomes the library's velocity through
:class:`~specforest.models.edm.EDMDenoiserVelocity` (which evaluates ``D`` at
``x_lin / (1 - t) = x`` and ``t / (1 - t) = sigma``). A VE schedule never reaches
``t = 1`` (``sigma = 80`` is ``t = 0.9877``): the chain starts at ``t_0 < 1`` from
``x / (1 + sigma_0)``, and its first step is a stochastic step like the others
(only a step from ``t = 1`` is a plain Euler step). The last step, into
``sigma = 0``, is the plain Euler step, ``x_T = D(x_{T-1}, sigma_{T-1})``, as in
k-diffusion's samplers; there both scales are 1, so the result is in the VE scale.

``path="linear"`` is for denoisers whose ``sigma`` is already the linear-path
level, ``x = (1 - sigma) x_0 + sigma xi`` (ComfyUI's ``CONST`` model sampling:
SD3, Flux): the grid is ``sigmas`` itself (``sigmas[0] <= 1``), the state is
``x``, and the velocity is ``(x - D(x, sigma)) / sigma``.

The chain, in k-diffusion's terms (``path="ve"``, churn ``eps``, ``s = sigma_i``,
``s' = sigma_{i+1} > 0``, ``d = (x - D(x, s)) / s`` as k-diffusion's ``to_d``):

    x' = D + d * sigma_down + sigma_up * z,    z ~ N(0, I),
    sigma_down = s' - eps^2 (s - s'),
    sigma_up = eps * sqrt(2 s (s - s') (1 + s') / (1 + s)),

the Euler-Maruyama step of eqs. (35)-(37) on the mapped grid. It is the form of
``sample_euler_ancestral`` with ``eta = eps`` and agrees with its
``get_ancestral_step`` to first order in the step (not exactly); EDM's stochastic
sampler (``sample_euler(s_churn=...)``) matches it to first order only with a
per-step churn ``gamma_i = eps^2 (1 - s' / s)`` (k-diffusion's is
``s_churn / steps``, the same at every step). ``docs/kdiffusion.md`` has the
derivation and what the tests check.

Conditioning. k-diffusion passes ``extra_args`` unchanged to every call, whose
batch is ``x``'s. A speculative call evaluates other rows (a tree's nodes, each
trajectory a different number of them), so an argument with one row per sample
must be declared: names in ``row_args`` are tensors ``(batch, ...)`` given row by row
(each call receives the rows of the trajectories its states belong to, through
:func:`specforest.sample`'s ``cond``); every other argument is passed as it is.
An undeclared tensor with one row per sample (a batch of more than one) is refused,
unless ``shared_args`` names it: it could be either. At batch 1 an undeclared ``(1, ...)``
tensor is the sample's own (what k-diffusion's calls of one row saw): every row of a call
gets it, as if named in ``row_args``.

Drafts that run a network. A draft network is a denoiser called as ``model`` is, with the same
``extra_args`` and the same mapping: a callable ``draft``, and the network of a
:class:`~specforest.drafts.LearnedDraft` made by its ``from_denoiser`` (``draft="learned"`` is
the digits model's). ``draft="cached"`` reuses the target's deep features: a ``model`` with
``deep`` and ``shallow`` methods (:func:`has_features`, the digits model's ``EDMPrecond``) keeps
them through the adapter; any other is refused before the first call, naming the two methods.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch

from .. import sampler, schedules
from ..drafts import DraftModel, LearnedDraft, Proposal, get_proposal
from ..models.edm import EDMDenoiserVelocity
from ..options import RUN_INPUTS, SamplerOptions, make_sde
from ..schedules import PATHS, linear_grid
from ..target import model_name
from ..validation import check_states, working_dtype

__all__ = ["KEYS", "PATHS", "has_features", "linear_grid", "sample", "sample_speculative"]

KEYS = ("x", "i", "sigma", "sigma_hat", "denoised")
"""k-diffusion's callback keys, first in every callback dict, in this order."""

# options of specforest.sample that this signature gives another way, and that way
_GIVEN_OTHERWISE = {
    "steps": "the schedule is sigmas",
    "sigmas": "the schedule is the positional sigmas",
    "grid": "the schedule is sigmas",
    "shift": "the schedule is sigmas",
    "cond": "pass conditioning in extra_args (per-row tensors named in row_args)",
    "model_kwargs": "pass conditioning in extra_args",
    "progress": "the progress bar is disable=False",
}
# the options and run inputs of specforest.sample this signature passes on (callback is its own)
_PASSED = tuple(
    name
    for name in (*SamplerOptions.names(), *RUN_INPUTS)
    if name not in _GIVEN_OTHERWISE and name not in ("callback", "tuned_for")
)
_ROW = "_specforest_row"  # the trajectory of each row, given to the denoiser wrapper only when a callback records


class _Roots:
    """What each trajectory's root evaluation of a round saw: the callback's ``x``, ``sigma`` and ``denoised``.

    A round evaluates a trajectory's root (its current state, at its current step) and tree
    nodes at later steps, so the root is the row of the trajectory at the highest noise level
    among the round's calls (several with ``max_rows`` or ``lazy``).
    """

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.x: Optional[torch.Tensor] = None
        self.denoised: Optional[torch.Tensor] = None
        self.sigma: Optional[torch.Tensor] = None

    def reset(self) -> None:
        if self.sigma is not None:
            self.sigma.fill_(-1.0)

    def record(self, rows: torch.Tensor, y: torch.Tensor, s: torch.Tensor, d: torch.Tensor) -> None:
        if self.sigma is None:
            self.x = y.new_zeros((self.batch, *y.shape[1:]))
            self.denoised = torch.zeros_like(self.x)
            self.sigma = torch.full((self.batch,), -1.0, dtype=y.dtype, device=y.device)
        s = s.to(self.sigma.dtype)
        best = self.sigma.scatter_reduce(0, rows, s, "amax")
        top = s >= best[rows]
        self.sigma = best
        self.x[rows[top]] = y[top].to(self.x.dtype)
        self.denoised[rows[top]] = d[top].to(self.x.dtype)


class _Denoiser:
    """The user's denoiser with its shared arguments bound; records the roots for a callback."""

    def __init__(self, fn: Callable[..., torch.Tensor], shared: dict, roots: Optional[_Roots]) -> None:
        self.fn, self.shared, self.roots = fn, shared, roots

    def __call__(self, y: torch.Tensor, s: torch.Tensor, **rows: Any) -> torch.Tensor:
        traj = rows.pop(_ROW, None)
        return self._checked(self.fn(y, s, **rows, **self.shared), y, s, traj)

    def _checked(self, d: Any, y: torch.Tensor, s: torch.Tensor, traj: Optional[torch.Tensor]) -> torch.Tensor:
        """The denoiser's output ``d`` at ``y``, ``s``, refused unless a tensor on ``y``'s device; a root
        of a callback's report where ``traj`` names the rows' trajectories."""
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"the denoiser must return a tensor (the denoised x0), got {type(d).__name__}")
        if d.device != y.device:
            raise ValueError(
                f"the denoiser {model_name(self.fn)} returned its output on {d.device}, but the states it was "
                f"given are on {y.device}: return the denoised x0 on its input's device"
            )
        # (a wrong shape is refused by the velocity adapter right after)
        if self.roots is not None and traj is not None and d.shape == y.shape:
            self.roots.record(traj.to(y.device), y, s, d)
        return d


class _FeatureDenoiser(_Denoiser):
    """A denoiser with the deep-feature protocol (:func:`has_features`) passed through: the cached
    self-draft's target calls (``deep``, roots recorded as a plain call's) and its outer-block calls
    (``shallow``, a draft's: never a root), both with the shared arguments and the rows' own."""

    def deep(self, y: torch.Tensor, s: torch.Tensor, **rows: Any) -> tuple[torch.Tensor, torch.Tensor]:
        traj = rows.pop(_ROW, None)
        out = self.fn.deep(y, s, **rows, **self.shared)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"the denoiser {model_name(self.fn)}'s deep method must return (denoised, features), got "
                f"{type(out).__name__}"
            )
        return self._checked(out[0], y, s, traj), out[1]

    def shallow(self, y: torch.Tensor, s: torch.Tensor, feat: torch.Tensor, **rows: Any) -> torch.Tensor:
        rows.pop(_ROW, None)
        return self._checked(self.fn.shallow(y, s, feat, **rows, **self.shared), y, s, None)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The denoiser's parameters, if it has any (where the features are counted: its device)."""
        params = getattr(self.fn, "parameters", None)
        return iter(params()) if callable(params) else iter(())


class _RowBlind:
    """A draft velocity network called without the callback's record of each row's trajectory."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond: Any) -> torch.Tensor:
        cond.pop(_ROW, None)
        return self.fn(x, sigma, **cond)


def has_features(denoiser: Any) -> bool:
    """Whether a k-diffusion denoiser keeps the deep features ``draft="cached"`` reuses: it has
    ``deep(x, sigma, **extra_args) -> (denoised, features (M, ...))`` and ``shallow(x, sigma, features,
    **extra_args) -> denoised`` methods, the second evaluating only the outer blocks with the deep
    features of an earlier ``deep`` call (:class:`~specforest.models.unet.EDMPrecond`, the digits
    model's denoiser, has them)."""
    return callable(getattr(denoiser, "deep", None)) and callable(getattr(denoiser, "shallow", None))


def _wrap(fn: Callable[..., torch.Tensor], shared: dict, roots: Optional[_Roots]) -> _Denoiser:
    """The user's denoiser bound for the run, its deep-feature protocol kept where it has one."""
    return (_FeatureDenoiser if has_features(fn) else _Denoiser)(fn, shared, roots)


class _LinearDenoiserVelocity:
    """``v = (x - D(x, t)) / t`` for a denoiser on the linear path itself (``path="linear"``), with the
    deep-feature protocol of ``draft="cached"`` where the denoiser has it (:func:`has_features`)."""

    def __init__(self, denoiser: _Denoiser) -> None:
        self.denoiser = denoiser

    def __call__(self, x: torch.Tensor, t: torch.Tensor, **cond: Any) -> torch.Tensor:
        return self._velocity(x, t, self.denoiser(x, t, **cond))

    def feature_numel(self, shape: tuple[int, ...]) -> int:
        """Numbers per row of the denoiser's deep features (0 without the protocol), made by one call
        on a zero row at ``t = 0.5``, as :meth:`EDMDenoiserVelocity.feature_numel` counts them."""
        if not isinstance(self.denoiser, _FeatureDenoiser):
            return 0
        param = next(self.denoiser.parameters(), None)
        x = torch.zeros(1, *shape, device=None if param is None else param.device)
        with torch.no_grad():
            return int(self.with_features(x, torch.full((1,), 0.5, device=x.device))[1].shape[1])

    def with_features(self, x: torch.Tensor, t: torch.Tensor, **cond: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(v, feat (M, F))``: the velocity of a call and the denoiser's deep features, flattened per row."""
        d, feat = self.denoiser.deep(x, t, **cond)
        return self._velocity(x, t, d), feat.reshape(x.shape[0], -1)

    def from_features(self, x: torch.Tensor, t: torch.Tensor, feat: torch.Tensor, **cond: Any) -> torch.Tensor:
        """The velocity with the deep features ``feat (M, F)`` of an earlier call in place of the denoiser's own."""
        return self._velocity(x, t, self.denoiser.shallow(x, t, feat, **cond))

    @staticmethod
    def _velocity(x: torch.Tensor, t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        if d.shape != x.shape:
            raise ValueError(f"the denoiser must return shape {tuple(x.shape)}, got {tuple(d.shape)}")
        return (x - d.to(x.dtype)) / t.to(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))


def _velocity(denoiser: _Denoiser, s: torch.Tensor, path: str) -> Callable[..., torch.Tensor]:
    if path == "linear":
        return _LinearDenoiserVelocity(denoiser)
    # a clipping range wider than the schedule: the denoiser is called at the schedule's levels
    # (up to rounding), never clipped, like k-diffusion's samplers
    return EDMDenoiserVelocity(denoiser, sigma_min=0.5 * float(s[-2]), sigma_max=2.0 * float(s[0]))


def _draft(draft: Any, model: Any, shared: dict, s: torch.Tensor, path: str) -> Any:
    """The run's ``draft`` in this signature's convention: a draft network is a denoiser called as
    ``model`` is (a callable, or a :class:`~specforest.drafts.LearnedDraft` made by
    :meth:`~specforest.drafts.LearnedDraft.from_denoiser`, ``"learned"`` among them), given the shared
    ``extra_args`` and mapped onto ``path`` as ``model``; a draft that reuses the target's deep
    features needs a ``model`` that keeps them (:func:`has_features`). Anything else is passed on."""
    if callable(draft) and not isinstance(draft, (str, Proposal)):
        return _velocity(_Denoiser(draft, shared, None), s, path)
    if not isinstance(draft, (str, Proposal)):
        return draft  # (refused by the run, naming draft)
    prop = get_proposal(draft)
    if prop.uses_features and not has_features(model):
        raise ValueError(
            f"draft={prop.name!r} reuses the target network's deep features: the denoiser must have deep and "
            "shallow methods (deep(x, sigma, **extra_args) -> (denoised, features), shallow(x, sigma, features, "
            "**extra_args) -> denoised, as the digits model's EDMPrecond); the model given here, "
            f"{model_name(model)}, is called as model(x, sigma, **extra_args) only. Pick another draft (velocity, "
            "x0, secant, ...)"
        )
    if isinstance(prop, LearnedDraft):
        # the user's denoiser itself may declare its draft network (the adapter around it does not)
        prop = prop.for_model(model)
    if isinstance(prop, LearnedDraft) and prop.denoiser is not None:
        return prop.adapted(lambda net: _velocity(_Denoiser(net, shared, None), s, path))
    if isinstance(prop, DraftModel):
        # a velocity network in the library's convention, given as a Proposal: it gets the rows'
        # conditioning as in specforest.sample, never the callback's record of each row's trajectory
        return prop.mapped(_RowBlind)
    return draft


def _names(name: str, value: Any) -> tuple:
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{name} must be a sequence of extra_args names (str), got {value!r}")
    return tuple(value)


def _split_extra_args(extra_args: Optional[dict], batch: int, row_args: Any, shared_args: Any) -> tuple[dict, dict]:
    """``extra_args`` as (per-row conditioning, arguments passed as they are); see the module docstring."""
    extra = {} if extra_args is None else extra_args
    if not isinstance(extra, dict):
        raise TypeError(f"extra_args must be a dict or None, got {type(extra).__name__}")
    rows, shared = _names("row_args", row_args), _names("shared_args", shared_args)
    for name, listed in (("row_args", rows), ("shared_args", shared)):
        missing = [k for k in listed if k not in extra]
        if missing:
            raise ValueError(f"{name} names {missing}, which extra_args does not hold (it holds {sorted(extra)})")
    both = sorted(set(rows) & set(shared))
    if both:
        raise ValueError(f"{both} are in both row_args and shared_args")
    if _ROW in extra:
        raise ValueError(f"extra_args must not hold the reserved name {_ROW!r}")
    cond = {}
    for k in rows:
        v = extra[k]
        if not isinstance(v, torch.Tensor) or v.ndim < 1 or v.shape[0] != batch:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(
                f"extra_args[{k!r}] is in row_args: it must be a tensor ({batch}, ...), one row per sample, got {got}"
            )
        cond[k] = v
    for k, v in extra.items():
        if k in cond or k in shared or not (isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == batch):
            continue
        if batch == 1:
            # the sample's own tensor, as k-diffusion's calls of one row saw it: a tree call of several
            # rows (all of this one trajectory) gets it on each
            cond[k] = v
        else:
            raise ValueError(
                f"extra_args[{k!r}] has one row per sample (shape {tuple(v.shape)}), but a speculative call "
                f"evaluates other rows: name it in row_args=({k!r},) to give each call its rows' values, or "
                f"in shared_args=({k!r},) to pass it as it is to every call"
            )
    return cond, {k: v for k, v in extra.items() if k not in cond}


def _progress(disable: Any) -> bool:
    if disable is None:
        # tqdm's convention, which k-diffusion's trange follows: no bar when stderr is not a terminal
        return bool(sys.stderr.isatty())
    if not isinstance(disable, bool):
        raise TypeError(f"disable must be None or a bool, got {type(disable).__name__}")
    return not disable


def sample(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    *,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> sampler.SampleResult:
    """:func:`sample_speculative` returning the whole :class:`~specforest.sampler.SampleResult` (samples and stats).

    Same arguments as :func:`sample_speculative`; ``result.samples`` is what it returns, and
    ``result.stats`` the run's NFE, rounds and acceptance (see :func:`specforest.sample`).
    """
    check_states(x, example=" (e.g. (batch, C, H, W))")
    t = linear_grid(sigmas, path)
    unknown = sorted(k for k in options if k not in _PASSED)
    if unknown:
        hints = "; ".join(f"{k}: {_GIVEN_OTHERWISE[k]}" for k in unknown if k in _GIVEN_OTHERWISE)
        raise TypeError(f"unexpected options {unknown}" + (f" ({hints})" if hints else f"; options are {_PASSED}"))
    # (churn, required with the default em chain, is checked with the other options by SamplerOptions)
    if not callable(model):
        raise TypeError("model must be callable as model(x, sigma, **extra_args) (a k-diffusion denoiser)")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    if callback is not None and options.get("process_group") is not None:
        raise ValueError(
            "callback with process_group is not supported: each process evaluates only its share of the roots"
        )
    batch = x.shape[0]
    cond, shared = _split_extra_args(extra_args, batch, row_args, shared_args)
    s = sigmas.detach().to("cpu", torch.float64)
    roots = _Roots(batch) if callback is not None else None
    if roots is not None:
        cond = {**cond, _ROW: torch.arange(batch, device=x.device)}
    velocity = _velocity(_wrap(model, shared, roots), s, path)
    if "draft" in options:
        options["draft"] = _draft(options["draft"], model, shared, s, path)
    work = working_dtype(x.dtype)
    x_lin = x.to(work) / float(schedules.ve_scale(s[0])) if path == "ve" else x
    hook = None
    if callback is not None:
        chain, churn = options.get("chain", "em"), options.get("churn")
        # the run checks the options before its first round: the hook builds the tables after it
        hook = _callback(callback, roots, sigmas, t, path, lambda: make_sde(None, t, None, None, churn, chain))
    out = sampler.sample(velocity, x_lin, sigmas=t, cond=cond, callback=hook, progress=_progress(disable), **options)
    # at sigma = 0 the VE and linear-path states coincide (both scales are 1)
    out.samples = out.samples.to(x.dtype)
    out.config.update(path=path, sigma_first=float(s[0]), sigma_last_positive=float(s[-2]))
    return out


def _callback(
    user: Callable[[dict], None],
    roots: _Roots,
    sigmas: torch.Tensor,
    t: torch.Tensor,
    path: str,
    tables: Callable[[], Any],
) -> Callable[[dict], None]:
    """The library's per-round callback turned into k-diffusion's dict (see :func:`sample_speculative`).

    ``t`` is the run's grid ``(T + 1,)`` on ``path`` and ``tables()`` its chain's tables, whose states sit at
    the grid's levels, EDM's churned ones (``euler``) or also between them (``dpmpp_sde``'s midpoints), linear-path
    float64. A round is reported where its slowest trajectory's chain step begins grid step ``i``
    (:meth:`specforest.chains.Chain.grid_step`); ``sigma_hat`` is that state's level on ``sigmas``' scale,
    ``sigmas[i]`` itself where the chain does not move it.
    """
    hats: list = []  # per chain step: (grid step i, k-diffusion's sigma_hat), or None between grid levels

    def at(n: int) -> Optional[tuple]:
        if not hats:
            tab = tables()
            lvl = tab.sigmas
            own = lvl / (1.0 - lvl) if path == "ve" else lvl  # on sigmas' scale
            chain = getattr(tab, "chain", None)
            grid = chain.grid_step(t.numel() - 1).tolist() if chain is not None else list(range(t.numel() - 1))
            for m, i in enumerate(grid):
                if m and grid[m - 1] == i:
                    hats.append(None)
                    continue
                hat = sigmas[i] if bool(lvl[m] == t[i]) else own[m].to(sigmas.dtype).to(sigmas.device)
                hats.append((i, hat))
        return hats[n]

    before: list = [None]  # each trajectory's step at the start of the next round

    def hook(info: dict) -> None:
        committed, xs = info["committed"], info["x"]
        step0 = torch.zeros_like(info["step"]) if before[0] is None else before[0]
        before[0] = info["step"].clone()
        if not bool((committed > 0).any()):
            # the first speculative round only evaluates its roots; the next round evaluates them again
            roots.reset()
            return
        at(0)  # the tables, made once: len(hats) is the chain's steps
        active = step0 < len(hats)
        report = at(int(step0[active].min()))
        if report is None:
            # the slowest trajectory is between grid levels (a half-step chain's midpoint): k-diffusion reports none
            roots.reset()
            return
        i, hat = report
        a = active.reshape((-1,) + (1,) * (xs.ndim - 1)).to(xs.device)
        x = torch.where(a, roots.x.to(xs.device), xs.to(roots.x.dtype))
        denoised = torch.where(a, roots.denoised.to(xs.device), xs.to(roots.x.dtype))
        row_sigma = torch.where(active.to(roots.sigma.device), roots.sigma, torch.zeros_like(roots.sigma))
        roots.reset()
        user(
            {
                "x": x,
                "i": i,
                "sigma": sigmas[i],
                "sigma_hat": hat,
                "denoised": denoised,
                "step": step0,
                "row_sigma": row_sigma,
                "committed": committed,
                "round": info["round"],
            }
        )

    return hook


def sample_speculative(
    model: Callable[..., torch.Tensor],
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: Optional[dict] = None,
    callback: Optional[Callable[[dict], None]] = None,
    disable: Optional[bool] = None,
    *,
    row_args: Sequence[str] = (),
    shared_args: Sequence[str] = (),
    path: str = "ve",
    **options: Any,
) -> torch.Tensor:
    """Sample the churned chain on a k-diffusion schedule exactly, speculating on a draft tree.

    k-diffusion's sampler signature; the output has the law of the standard chain
    (``tree=None``) on the mapped grid for any tree, coupling and draft (see the module
    docstring for the mapping and the chain in k-diffusion's terms).

    Args:
        model: a k-diffusion denoiser ``model(x: (M, *shape), sigma: (M,), **extra_args) -> (M, *shape)``,
            an estimate of ``E[x_0 | x = x_0 + sigma xi]``. ``M`` is the call's rows: tree nodes of
            several trajectories at several noise levels, not ``x``'s batch.
        x: ``(batch, *shape)`` initial states at ``sigmas[0]`` (noise times ``sigmas[0]``, or a noised
            image for img2img).
        sigmas: ``(T + 1,)`` schedule, strictly decreasing, ending in 0 (``get_sigmas_karras``, ...).
        extra_args: the model's keyword arguments: those named in ``row_args`` row by row, the
            others as they are.
        callback: called after every round that commits a step (one model call each; the first
            speculative round only evaluates and makes none) with k-diffusion's keys first:
            ``x`` ``(batch, *shape)`` each trajectory's state at the round's start, the one its model
            call saw (VE scale; a trajectory that has finished: its sample), ``i`` (int) the
            slowest trajectory's step (non-decreasing; every step when ``tree=None``), ``sigma``
            ``sigmas[i]``, ``sigma_hat`` the level step ``i``'s state is evaluated at (``sigmas[i]``
            itself, but EDM's churned level with ``chain="euler"``, as k-diffusion's ``sample_euler``
            reports), ``denoised`` ``(batch, *shape)`` the model's output at
            ``x`` (finished: the sample); then ``step`` ``(batch,)`` each trajectory's step at the
            round's start (``T`` when finished), ``row_sigma`` ``(batch,)`` the level each row of ``x``
            was evaluated at (0 when finished), ``committed`` ``(batch,)`` steps the round committed,
            ``round``.
        disable: ``True`` no progress bar, ``False`` a bar, ``None`` a bar when stderr is a terminal.
        row_args: names in ``extra_args`` of tensors ``(batch, ...)`` with one row per sample.
        shared_args: names in ``extra_args`` of tensors with ``batch`` rows to pass as they are.
        path: ``"ve"`` (k-diffusion, EDM, ComfyUI's EPS / V_PREDICTION models) or ``"linear"``
            (ComfyUI's CONST models: ``x = (1 - sigma) x_0 + sigma xi``).
        **options: :func:`specforest.sample`'s options: ``churn`` (required, in (0, 1]), ``tree``,
            ``coupling``, ``draft`` (a name, a Proposal, or a draft *denoiser* with ``model``'s
            signature, given the same ``extra_args``, as is the network of a
            :meth:`~specforest.drafts.LearnedDraft.from_denoiser` draft and of ``"learned"``;
            ``"cached"`` needs a ``model`` with ``deep`` and ``shallow`` methods,
            :func:`has_features`), ``prefetch``, ``verify``, ``seed`` or
            ``generator`` (none: fresh entropy; nothing is drawn from torch's global RNG),
            ``sample_index``, ``max_rows``, ``lazy``, ``record_deltas``, ``pad_rows``,
            ``process_group`` (not with ``callback``).

    Returns:
        ``(batch, *shape)`` final states at ``sigma = 0`` in ``x``'s dtype (the sampler works in
        float32, or float64 for float64 ``x``).

    Raises:
        ValueError / TypeError: naming the parameter (``x``, ``sigmas``, ``churn``, ``extra_args``,
            ``row_args``, an option given another way here, ...).
        FloatingPointError: if the model returns NaN or inf.
    """
    return sample(
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        row_args=row_args,
        shared_args=shared_args,
        path=path,
        **options,
    ).samples
