"""Drafts that make network calls of their own while drafting: an independent draft model
(:class:`DraftModel`), the learned draft anchored at the run's evaluations (``learned``) and the
cached self-draft that reuses the target's deep features (``cached``)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch

from ..target import model_name, outside_inference
from .base import Proposal, StepTables, VelocityFn
from .chain_memory import RemembersChain
from .memory import memory_node, same_step

__all__ = ["CachedDraft", "DraftModel", "LearnedDraft", "declared_draft"]


class DraftModel(Proposal):
    """An independent draft model ``v_draft(x, sigma, **cond)`` with the target's signature.

    It is evaluated once per drafted parent, and on a chain of several stages at the stage points its
    own predictions give (:attr:`~specforest.drafts.Proposal.staged`: one batched call a stage; its calls
    are counted apart from the target's NFE), and receives the same arguments as the target: the run's
    ``model_kwargs`` and its per-trajectory conditioning, indexed per row; no
    prefetching is needed.

    Args:
        fn: callable ``(x: (M, *shape), sigma: (M,), **cond) -> (M, *shape)`` velocity.
    """

    needs_prefetch = False
    staged = True
    name = "model"
    _load: Optional[Callable[[], VelocityFn]] = None  # a network loaded at the first call (LearnedDraft)

    def __init__(self, fn: VelocityFn) -> None:
        if not callable(fn):
            raise TypeError("draft model must be callable as fn(x, sigma)")
        self.fn = fn
        self.model_kwargs: dict = {}

    def mapped(self, wrap: Callable[[VelocityFn], VelocityFn]) -> "DraftModel":
        """A copy of this draft whose network is ``wrap(network)`` (a network loaded at the first
        call is wrapped when it is loaded); this draft is left as it is."""
        out = copy.copy(self)
        if self._load is not None:
            load = self._load
            out._load = lambda: wrap(load())
        else:
            out.fn = wrap(self.fn)
        return out

    def bind(self, model: Any, shape: tuple[int, ...], model_kwargs: Optional[dict] = None) -> int:
        # the network is called as the target is, with the run's model_kwargs too
        self.model_kwargs = dict(model_kwargs or {})
        return 0

    def mean(self, tab, y, steps, pre, cond, shape, state):
        G, n, D = y.shape
        # trajectory-major rows: row b * n + i belongs to trajectory b
        kw = {k: v.repeat_interleave(n, dim=0) for k, v in cond.items()}

        def network(points: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
            with outside_inference():
                out = self.fn(points.reshape(G * n, *shape), levels.reshape(-1), **self.model_kwargs, **kw)
            if not isinstance(out, torch.Tensor) or out.numel() != points.numel():
                raise ValueError(f"the draft model must return a tensor of shape {(G * n, *shape)}")
            return out.reshape(G, n, D).to(y.dtype)

        v = self.stage_velocity(tab, network, y, steps, network(y, tab.sig[steps]))
        # one check of the stages' velocities together: a non-finite stage makes v_eff non-finite
        bad = ~torch.isfinite(v).all(-1)
        if bad.any():
            at = sorted(set(steps[bad].tolist()))
            raise FloatingPointError(
                f"the draft model returned NaN or inf at step {at[0]} (steps {at}); refusing to continue"
            )
        return tab.mean(y, v, steps)

    def __repr__(self) -> str:
        return f"DraftModel({self.fn!r})"


class LearnedDraft(RemembersChain, DraftModel):
    """A draft network anchored at the run's own evaluations (``draft="learned"`` with the digits
    model's distilled U-Net, :func:`specforest.models.digits.load_draft_denoiser`).

    What it reads, all made before the round's verification call:

    * the draft network ``f`` (a velocity with the target's signature), called at the drafted
      parents and at their anchors: one batched call per drafted level, ``s`` on a chain of ``s``
      stages (counted in ``draft_calls``, never in the target's NFE);
    * the anchor of each parent: the remembered chain node at the parent's own step
      (its memory's ``y`` and ``x0``, :class:`~specforest.drafts.chain_memory.ChainMemory`: the
      previous round's evaluation there, as :class:`SecantDraft` reads it), else the prefetched
      evaluation ``(y*, v*, step*)``.

    Rule: with the anchor's state ``y_a`` at noise level ``sigma_a`` and the target's clean-data
    prediction there ``x0_a``, the draft's prediction at a parent ``y`` of level ``sigma`` is
    ``x0_a + f_x0(y, sigma) - f_x0(y_a, sigma_a)`` (``f_x0 = y - sigma f``): the network supplies
    how the prediction moves from the anchor, the target the level. So the draft is the
    ``x0`` kind anchored at the prefetch when ``f``'s own clean-data prediction ``f_x0`` is
    constant (``f = y / sigma``, say), and the target itself when ``f`` is; at a same-step
    memory anchor its error is ``(J - J_f)(y - y_a)`` to first order (the Jacobians of the
    target's and the network's predictions), which :class:`SecantDraft` approximates with a
    scalar gain. Chains draw their noise by step (:attr:`aligned_noise`), so ``y - y_a`` is small.
    On a chain of several stages ``f_x0`` is the network's prediction from those stages
    (:meth:`~specforest.drafts.Proposal.stage_velocity`), at the parent's step and at the anchor's
    own, as ``x0_a`` is the target's: the target as the network is still the target.

    The draft is exact for any network: it only moves the acceptance. A network whose output
    is NaN or inf makes a non-finite mismatch, which stops the run with the step and the draft
    named (the sampler's check, no extra synchronization).

    The network is a velocity in the library's convention, or, made by :meth:`from_denoiser`, an
    EDM denoiser (:attr:`denoiser`): :func:`specforest.sample` turns it into a velocity with
    :class:`~specforest.models.edm.EDMDenoiserVelocity`, and the k-diffusion drop-ins call it as
    they call the model (its ``extra_args``, its path; :meth:`adapted`).

    Args:
        fn: the draft velocity ``(x: (M, *shape), sigma: (M,), **cond) -> (M, *shape)``, or a
            callable of no arguments returning it (loaded at the first call).
        shape: the per-sample state shape the network serves (``None``: any); a run of another
            shape is refused before sampling (:meth:`check`).
        label: how errors name the network.
        lazy_load: ``fn`` is the callable of no arguments.

    ``draft="learned"`` (:meth:`of_model`) is the target model's own draft network where the model
    declares one (a ``learned_draft`` attribute, :func:`declared_draft`: the digits denoiser of
    :func:`specforest.models.digits.load_denoiser` declares its distilled U-Net), else the digits
    model's; a model of another family gets the name by declaring its network the same way.

    Attributes:
        denoiser: for a draft made by :meth:`from_denoiser`, a callable of no arguments returning its
            denoiser network (loaded once, at the first call); ``None`` for a velocity network.
        follows_model: whether :meth:`check` replaces the network by the one the run's model declares
            (``draft="learned"``, :meth:`of_model`).
    """

    needs_prefetch = True
    uses_states = True
    name = "learned"

    def __init__(
        self,
        fn: "VelocityFn | Callable[[], VelocityFn]",
        *,
        shape: Optional[tuple[int, ...]] = None,
        label: str = "the draft network",
        lazy_load: bool = False,
    ) -> None:
        super().__init__(fn)
        self._load = fn if lazy_load else None
        self.serves = None if shape is None else tuple(int(n) for n in shape)
        self.label = label
        self.denoiser: Optional[Callable[[], Callable[..., torch.Tensor]]] = None
        self.follows_model = False

    @classmethod
    def from_denoiser(
        cls,
        denoiser: Callable[..., torch.Tensor],
        *,
        shape: Optional[tuple[int, ...]] = None,
        label: str = "the draft network",
        lazy_load: bool = False,
        sigma_min: float = 1e-3,
        sigma_max: float = 80.0,
    ) -> "LearnedDraft":
        """The learned draft of an EDM denoiser network ``denoiser(x: (M, *shape), sigma: (M,), **cond)
        -> (M, *shape)`` (an estimate of ``E[x_0 | x = x_0 + sigma xi]``, as the target's in the
        k-diffusion drop-ins), the form every entry point takes.

        :func:`specforest.sample` (and ``generate``, the tuner) evaluate it through
        :class:`~specforest.models.edm.EDMDenoiserVelocity` with the EDM noise level clipped to
        ``[sigma_min, sigma_max]``; the k-diffusion drop-ins call it as they call the model, with the
        same ``extra_args`` and the same mapping of ``sigmas`` (:meth:`adapted`).

        Args:
            denoiser: the draft denoiser, or with ``lazy_load`` a callable of no arguments returning it.
            shape, label: as the constructor's.
            lazy_load: load the network at the first call.
            sigma_min, sigma_max: the clipping range of :class:`~specforest.models.edm.EDMDenoiserVelocity`.

        Raises:
            TypeError: if ``denoiser`` is not callable.
            ValueError: on an invalid clipping range.
        """
        from ..models.edm import EDMDenoiserVelocity, check_sigma_range

        if not callable(denoiser):
            raise TypeError(f"denoiser must be callable as denoiser(x, sigma, **cond), got {type(denoiser).__name__}")
        lo, hi = check_sigma_range(sigma_min, sigma_max)
        net = _Net(denoiser, lazy_load)
        draft = cls(lambda: EDMDenoiserVelocity(net(), lo, hi), shape=shape, label=label, lazy_load=True)
        draft.denoiser = net
        return draft

    def adapted(self, velocity_of: Callable[[Callable[..., torch.Tensor]], VelocityFn]) -> "LearnedDraft":
        """This draft with its denoiser network turned into a velocity by ``velocity_of`` rather than
        :class:`~specforest.models.edm.EDMDenoiserVelocity` (the k-diffusion drop-ins pass their own
        mapping, which gives the network the model's ``extra_args``); the network is loaded once, at
        the first call of either.

        Raises:
            ValueError: if the draft's network is a velocity (not made by :meth:`from_denoiser`).
        """
        if self.denoiser is None:
            raise ValueError(f"draft={self.name!r}: {self.label} is a velocity, not a denoiser")
        net = self.denoiser
        draft = type(self)(lambda: velocity_of(net()), shape=self.serves, label=self.label, lazy_load=True)
        draft.denoiser = self.denoiser
        return draft

    @classmethod
    def of_model(cls) -> "LearnedDraft":
        """``draft="learned"``: the target model's own draft network where the model declares one
        (:func:`declared_draft`), else the digits model's (:meth:`digits`); resolved by
        :meth:`check`, before sampling."""
        draft = cls.digits()
        draft.follows_model = True
        return draft

    def for_model(self, model: Any) -> "LearnedDraft":
        """The draft a run of the target ``model`` uses: for a draft that follows the model
        (:meth:`of_model`) and a model that declares its draft network (:func:`declared_draft`),
        that network's draft (its EDM adapter clipped as the model's own, where the model is an
        :class:`~specforest.models.edm.EDMDenoiserVelocity`); else this draft itself."""
        from ..models.edm import EDMDenoiserVelocity

        load = declared_draft(model) if self.follows_model else None
        if load is None:
            return self
        lo, hi = (model.sigma_min, model.sigma_max) if isinstance(model, EDMDenoiserVelocity) else (1e-3, 80.0)
        label = f"the learned draft {model_name(model)} declares"
        return type(self).from_denoiser(load, label=label, lazy_load=True, sigma_min=lo, sigma_max=hi)

    @classmethod
    def digits(cls) -> "LearnedDraft":
        """The digits model's learned draft: its distilled U-Net's denoiser (the shipped weights,
        :func:`specforest.models.digits.load_draft_denoiser`, loaded at the first call)."""

        def load() -> Callable[..., torch.Tensor]:
            from ..models.digits import load_draft_denoiser

            return load_draft_denoiser()

        from ..models.digits import IMAGE_SHAPE

        return cls.from_denoiser(load, shape=IMAGE_SHAPE, label="the digits model's distilled U-Net", lazy_load=True)

    def check(self, shape: tuple[int, ...], dtype: torch.dtype, model: Any = None) -> None:
        if model is not None and self.follows_model:
            # the run's draft is the model's declared network, where it declares one: this instance
            # (a fresh one per name, get_proposal) becomes that draft for the run
            own = self.for_model(model)
            self.fn, self._load, self.serves, self.label = own.fn, own._load, own.serves, own.label
            self.denoiser, self.follows_model = own.denoiser, False
        if self.serves is not None and tuple(shape) != self.serves:
            raise ValueError(
                f"draft={self.name!r} is {self.label}: it serves states of shape {self.serves}, got {tuple(shape)}"
            )

    def mean(self, tab, y, steps, pre, cond, shape, state, memory=None):
        if pre is None:
            raise ValueError(f"draft={self.name!r} needs a prefetched evaluation")
        if self._load is not None:
            self.fn, self._load = self._load(), None
        G, n, D = y.shape
        sig = tab.sig[steps]  # (G, n)
        sig_p = tab.sig[pre.step]  # (G,)
        ya = pre.y[:, None].expand(G, n, D)
        xa = (pre.y - sig_p[:, None] * pre.v)[:, None].expand(G, n, D)
        sa = sig_p[:, None].expand(G, n)
        step_a = pre.step[:, None].expand(G, n)
        if memory is not None and memory.y is not None:
            same, j = same_step(steps, pre, memory)
            ya = torch.where(same[..., None], memory.y.gather(1, j), ya)
            xa = torch.where(same[..., None], memory.x0.gather(1, j), xa)
            sa = torch.where(same, sig, sa)
            step_a = torch.where(same, steps, step_a)
        # one call a stage: the parents' rows, then their anchors' (trajectory-major within each half)
        kw = {k: v.repeat_interleave(n, dim=0).repeat(2, *(1,) * (v.ndim - 1)) for k, v in cond.items()}

        def network(points: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
            with outside_inference():
                out = self.fn(points.reshape(2 * G * n, *shape), levels.reshape(-1), **self.model_kwargs, **kw)
            if not isinstance(out, torch.Tensor) or out.numel() != points.numel():
                raise ValueError(
                    f"draft={self.name!r}: {self.label} must return a tensor of shape {(2 * G * n, *shape)}"
                )
            return out.reshape(2 * G, n, D).to(y.dtype)

        # the anchor's x0_a is the target's prediction from its stages at the anchor's step (the run's
        # evaluations), so the network's there goes through the same stages: for a network equal to the
        # target the anchor's terms cancel
        X = torch.cat([y, ya])
        f = self.stage_velocity(tab, network, X, torch.cat([steps, step_a]), network(X, torch.cat([sig, sa])))
        # v = (y - x0_a - f_x0(y) + f_x0(y_a)) / sigma = f(y) + (f_x0(y_a) - x0_a) / sigma
        v = f[:G] + (ya - sa[..., None] * f[G:] - xa) / sig[..., None]
        return tab.mean(y, v, steps)

    def __repr__(self) -> str:
        return f"LearnedDraft({self.label})"


def declared_draft(model: Any) -> Optional[Callable[[], Callable[..., torch.Tensor]]]:
    """The draft network a target model declares for ``draft="learned"``: its ``learned_draft``
    attribute, a callable of no arguments returning the draft's EDM denoiser (an estimate of
    ``E[x_0 | x = x_0 + sigma xi]`` with the target denoiser's signature), read on the model or on
    the denoiser it adapts (:class:`~specforest.models.edm.EDMDenoiserVelocity`'s ``denoiser``);
    ``None`` where neither declares one."""
    for obj in (model, getattr(model, "denoiser", None)):
        load = getattr(obj, "learned_draft", None)
        if callable(load):
            return load
    return None


class _Net:
    """A draft network, or the callable of no arguments that loads it at the first call (once)."""

    def __init__(self, net: Callable[..., Any], lazy_load: bool) -> None:
        self._net, self._lazy = net, lazy_load

    def __call__(self) -> Callable[..., Any]:
        if self._lazy:
            self._net, self._lazy = self._net(), False
        return self._net


class CachedDraft(RemembersChain):
    """The cached self-draft (``draft="cached"``, DeepCache-style): the target network itself with
    its deep features reused from an evaluation of the previous round, only its outer blocks
    recomputed at the drafted state and level.

    What it reads, all made before the round's verification call:

    * its memory's ``features``: the target's deep features at the previous speculative round's
      evaluated chain nodes, kept by that round's verification call (the model's
      ``with_features``; the engine asks for them only for this draft), and those nodes' steps
      (``s0``, ``n``; :class:`~specforest.drafts.chain_memory.ChainMemory`);
    * the prefetched evaluation ``(y*, v*, step*)``, as the ``x0`` kind does, where no node is
      remembered.

    Rule: a parent at step ``s`` reads node ``j`` as :class:`MemoryDraft` does (the remembered node
    at its own step, else the chain's last one past it, never one older than the prefetch), and
    its draft velocity is the model's cheap evaluation ``from_features(y, sigma_s, f_j)``: the
    embedding, the outer encoder and decoder blocks at the parent, the deeper blocks node ``j``'s.
    At node ``j``'s own state and level that is the target's velocity exactly; where no node is
    remembered (the first round after a fetch, a tree whose first level branches) it is the
    ``x0`` kind. Chains draw their noise by step (:attr:`aligned_noise`), so a redrafted parent
    lies near the node whose features it reuses.

    One batched call of the outer blocks a drafted level (``G n`` rows, counted in
    ``draft_calls``, its time the draft phase's), never the target's NFE; on a chain of ``s``
    stages ``s`` calls, the later ones at the stage points the cheap predictions give, with node
    ``j``'s features (:meth:`~specforest.drafts.Proposal.stage_velocity`). The draft is exact for
    any features: it only moves the acceptance. A model without the protocol
    (``feature_numel``, ``with_features``, ``from_features``:
    :class:`~specforest.models.edm.EDMDenoiserVelocity` around a denoiser with ``deep`` and
    ``shallow``, as the digits model's) is refused before sampling (:meth:`check`).
    """

    uses_features = True
    staged = True
    name = "cached"

    def __init__(self) -> None:
        self.model: Any = None
        self.model_kwargs: dict = {}
        self._counted: tuple = ()  # (model, shape, feature numbers) of the last count

    def _features_of(self, model: Any, shape: tuple[int, ...]) -> int:
        """The model's feature numbers a row (0 without the protocol), counted once per model and
        shape: ``feature_numel`` may run the network (``check`` and ``bind`` both ask)."""
        shape = tuple(shape)
        if self._counted and self._counted[0] is model and self._counted[1] == shape:
            return self._counted[2]
        have = all(callable(getattr(model, k, None)) for k in ("feature_numel", "with_features", "from_features"))
        F = int(model.feature_numel(shape)) if have else 0
        self._counted = (model, shape, F)
        return F

    def check(self, shape, dtype, model=None):
        if model is not None and self._features_of(model, shape) <= 0:
            raise ValueError(
                f"draft={self.name!r} reuses the target's deep features: the model must keep them "
                f"(feature_numel > 0, with_features, from_features: an EDMDenoiserVelocity around a denoiser with "
                f"deep and shallow methods, as the digits model's); the model given, {model_name(model)}, does not"
            )

    def bind(self, model, shape, model_kwargs=None):
        self.model, self.model_kwargs = model, dict(model_kwargs or {})
        return self._features_of(model, shape)

    def mean(self, tab, y, steps, pre, cond, shape, state, memory=None):
        if pre is None:
            raise ValueError(f"draft={self.name!r} needs a prefetched evaluation")
        sig = tab.sig[steps]  # (G, n)
        x0 = (pre.y - tab.sig[pre.step][:, None] * pre.v)[:, None]  # (G, 1, D)
        v = (y - x0) / sig[..., None]
        feats = None if memory is None else memory.features
        if feats is not None:
            j, use = memory_node(steps, pre, memory)
            feat = feats.gather(1, j[..., None].expand(-1, -1, feats.shape[2]))
            network = self.stage_network(tab, feat, cond, shape)
            v = torch.where(use[..., None], self.stage_velocity(tab, network, y, steps, network(y, sig)), v)
        return tab.mean(y, v, steps)

    def stage_network(
        self, tab: StepTables, feat: torch.Tensor, cond: dict, shape: tuple[int, ...]
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The cheap evaluation as a network of points and levels, ``(G, n, D), (G, n) -> (G, n, D)``, for the
        draft's own first call and then :meth:`~specforest.drafts.Proposal.stage_velocity`'s: its ``k``-th call
        reads stage ``k``'s deep features of ``feat (G, n, s F)`` (the remembered node's call at the same stage,
        at that stage's level: :func:`specforest.stages.evaluate` keeps one set a stage). The stages are called
        in order (:meth:`specforest.stages.Stages.velocity`), so the calls count the stage."""
        parts = feat.chunk(tab.stages, -1)
        stage = iter(range(len(parts)))
        return lambda p, lv: self.cheap_velocity(p, lv, parts[next(stage)], cond, shape)

    def cheap_velocity(
        self, y: torch.Tensor, sig: torch.Tensor, feat: torch.Tensor, cond: dict, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The model's cheap evaluation ``from_features`` in one batched call (counted with the drafted
        level's): velocities ``(G, n, D)`` at states ``y (G, n, D)`` of levels ``sig (G, n)`` with the deep
        features ``feat (G, n, F)``, the ``G`` trajectories' conditioning ``cond`` given to their rows.

        Raises:
            ValueError: if the draft was not bound to a model, or ``from_features`` returns another shape.
        """
        if self.model is None:
            raise ValueError(f"draft={self.name!r} was not bound to the run's model")
        G, n, D = y.shape
        kw = {k: t.repeat_interleave(n, dim=0) for k, t in cond.items()}
        with outside_inference():
            vc = self.model.from_features(
                y.reshape(G * n, *shape), sig.reshape(-1), feat.reshape(G * n, -1), **self.model_kwargs, **kw
            )
        if not isinstance(vc, torch.Tensor) or vc.numel() != y.numel():
            raise ValueError(f"draft={self.name!r}: from_features must return a tensor of shape {(G * n, *shape)}")
        return vc.reshape(G, n, D).to(y.dtype)

    def __repr__(self) -> str:
        return "CachedDraft()"
