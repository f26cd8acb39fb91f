"""The contract every verification rule implements: :class:`Coupling`, and the rank-1 projection.

Every rule works on the rank-1 reduction of paper Sec. 3.1: proposal
``P = N(mu_p, s^2 I)`` and target ``Q = N(mu_q, s^2 I)`` differ only along
``e = (mu_q - mu_p) / |mu_q - mu_p|``. With ``delta = |mu_q - mu_p| / s`` and the
projection ``S = e.(Y - mu_p) / s`` (ERRATA 2), ``S ~ N(0, 1)`` under P and
``N(delta, 1)`` under Q, and ``rho(S) = dQ/dP = exp(delta S - delta^2 / 2)``. A
rule only replaces the projection of a child; the orthogonal part is kept
(:func:`project`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..streams import Stream

__all__ = ["Coupling", "CouplingResult", "project"]


@dataclass
class CouplingResult:
    """Outcome of one batch of verification problems.

    Attributes:
        state: ``(P, D)`` the exact target draws ``Y ~ Q``.
        accepted: ``(P,)`` bool, True if ``Y`` is one of the drafted children.
        index: ``(P,)`` long, which child was accepted (-1 if none).
        delta: ``(P,)`` float64 normalized mean mismatch of each problem.
    """

    state: torch.Tensor
    accepted: torch.Tensor
    index: torch.Tensor
    delta: torch.Tensor


def project(
    z: torch.Tensor, diff: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rank-1 reduction of paper Sec. 3.1 (eqs. 12-13) for a batch of problems.

    Args:
        z: ``(..., K, D)`` the children's standardized offsets ``(Y - mu_p) / s``.
        diff: ``(..., D)`` the mean displacement ``mu_q - mu_p``.
        scale: ``(...)`` float64 transition std ``s > 0``.

    Returns:
        ``(s_hat, delta, e)``: ``(..., K)`` float64 projections ``e . z``,
        ``(...)`` float64 ``delta = |diff| / s`` and ``(..., D)`` the unit
        direction ``e`` in ``diff``'s dtype (zero where ``diff = 0``). Only
        elementwise ops and reductions over the last axis: every problem's
        numbers are independent of the batch it is in.
    """
    norm = torch.linalg.vector_norm(diff, dim=-1, keepdim=True)
    # diff / max(norm, tiny) is the zero vector where diff is
    e = diff / norm.clamp_min(torch.finfo(diff.dtype).tiny)
    s_hat = (z * e[..., None, :]).sum(-1).to(torch.float64)
    return s_hat, norm[..., 0].to(torch.float64) / scale, e


def _check_call(mu_p, mu_q, scale, children, valid, generator) -> None:
    """The arguments of a direct :meth:`Coupling.__call__`, each refused by name (the sampler calls
    :meth:`Coupling.select` itself and never pays for this; a zero ``scale`` here made the rejection
    residuals of the list couplings loop forever on a NaN ``delta``)."""
    if not isinstance(children, torch.Tensor) or children.ndim != 3 or not children.is_floating_point():
        got = (
            f"{children.dtype} of shape {tuple(children.shape)}"
            if isinstance(children, torch.Tensor)
            else type(children).__name__
        )
        raise TypeError(f"children must be a floating-point tensor (P, K, D), got {got}")
    P, K, D = children.shape
    if K < 1:
        raise ValueError(f"children must have K >= 1 children per problem, got shape {tuple(children.shape)}")
    for name, t, shape in (("mu_p", mu_p, (P, D)), ("mu_q", mu_q, (P, D)), ("scale", scale, (P,))):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
            got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point tensor of shape {shape}, got {got}")
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or tuple(valid.shape) != (P, K):
        got = (
            f"{valid.dtype} of shape {tuple(valid.shape)}" if isinstance(valid, torch.Tensor) else type(valid).__name__
        )
        raise TypeError(f"valid must be a bool tensor of shape {(P, K)}, got {got}")
    if P and not bool(valid[:, 0].all() and (valid[:, 1:] <= valid[:, :-1]).all()):
        raise ValueError("valid must be a prefix of True in every row (at least one real child)")
    for name, t in (("mu_p", mu_p), ("mu_q", mu_q), ("children", children)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or inf")
    if not bool(((scale > 0) & torch.isfinite(scale)).all()):
        raise ValueError("scale must be finite and > 0 in every problem")
    if isinstance(generator, Stream):
        if generator.keys.shape != (P,):
            raise ValueError(f"generator: a Stream needs one key per problem ({P}), got {tuple(generator.keys.shape)}")
    elif generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a Stream, a torch.Generator or None, got {type(generator).__name__}")


class Coupling:
    """Base class of verification rules (the ``Verify`` of Algorithm 1).

    A rule works on the scalar projections of the rank-1 reduction (eqs.
    12-15, which live here, as does the reconstruction): :meth:`select` decides
    whether a child is accepted and which one; :meth:`residual` draws the
    target projection of a rejected problem. The sampler calls :meth:`select`
    on every verification problem of a round's tree at once and
    :meth:`residual` only where its walk stopped, so a new rule touches neither
    the reduction nor the sampler loop.

    Randomness comes from a :class:`~specforest.streams.Stream` (one key per
    problem); draw with ``rng.uniform(slot, n)`` / ``rng.normal(slot, n)``,
    one slot per distinct draw of the rule, the same slots in :meth:`select`
    and :meth:`residual` for a draw they share.

    Declared needs (class attributes, read by the sampler):
        name: registry name, recorded in results.
        max_children: largest number of children of a node (``None``: any).
        structured_siblings: the rule draws a node's children jointly through
            :meth:`structure_noise` (then every internal node needs the same
            number of children, and adaptive trees, which assume i.i.d.
            children, are refused); a direct call refuses children without
            the structure (:meth:`structure_defect`).
    """

    name: str = "coupling"
    max_children: Optional[int] = None
    structured_siblings: bool = False

    def __call__(
        self,
        mu_p: torch.Tensor,
        mu_q: torch.Tensor,
        scale: torch.Tensor,
        children: torch.Tensor,
        valid: torch.Tensor,
        generator: "Optional[torch.Generator] | Stream" = None,
    ) -> CouplingResult:
        """Couple each problem's children with its target (the whole rule, for direct use and tests).

        Args:
            mu_p: ``(P, D)`` proposal means.
            mu_q: ``(P, D)`` target means.
            scale: ``(P,)`` shared transition std, > 0.
            children: ``(P, K, D)`` drafted children, i.i.d. from ``N(mu_p, scale^2 I)``;
                for a rule with :attr:`structured_siblings`,
                ``mu_p[:, None] + scale[:, None, None] * rule.structure_noise(z)`` with ``z``
                ``(P, K, D)`` i.i.d. ``N(0, 1)`` (other children are refused).
            valid: ``(P, K)`` bool, a prefix of True per row (at least one).
            generator: a :class:`~specforest.streams.Stream` with ``P`` keys, or a
                ``torch.Generator`` from which one is keyed.

        Returns:
            A :class:`CouplingResult`.

        Raises:
            TypeError / ValueError: naming the argument whose type, shape or values are wrong
                (non-finite numbers, ``scale <= 0``, a ``valid`` row that is not a prefix of True).
            ValueError: if the rule cannot take ``K`` children, or has structured
                siblings and ``children`` lack the structure (:meth:`structure_defect`).
        """
        _check_call(mu_p, mu_q, scale, children, valid, generator)
        P, K, _ = children.shape
        self.check_children(K)
        work = children.dtype if children.dtype in (torch.float32, torch.float64) else torch.float32
        rng = generator if isinstance(generator, Stream) else Stream.from_generator(P, generator, children.device)
        s64 = scale.to(torch.float64)
        mu_p_in = mu_p
        mu_p = mu_p.to(work)
        z = (children.to(work) - mu_p[:, None]) / s64.to(work)[:, None, None]
        if self.structured_siblings:
            # the sampler drafts through structure_noise and calls select directly, never this method:
            # the check costs direct callers only
            self._check_structure(z, valid, mu_p / s64.to(work)[:, None], (children.dtype, mu_p_in.dtype))
        s_hat, delta, e = project(z, mu_q.to(work) - mu_p, s64)
        accepted, index = self.select(s_hat, delta, valid, rng)
        children = children.to(work)
        state = children[torch.arange(P, device=children.device), index]
        rej = (~accepted).nonzero()[:, 0]
        if rej.numel():
            state[rej] = self.rejected_state(
                s_hat[rej], delta[rej], valid[rej], index[rej], rng.take(rej), children[rej], s64[rej], e[rej]
            )
        return CouplingResult(state, accepted, torch.where(accepted, index, -1), delta)

    def rejected_state(
        self,
        s_hat: torch.Tensor,
        delta: torch.Tensor,
        valid: torch.Tensor,
        index: torch.Tensor,
        rng: Stream,
        children: torch.Tensor,
        scale: torch.Tensor,
        e: torch.Tensor,
    ) -> torch.Tensor:
        """The target states ``(P, D)`` of rejected problems (eq. 15): the kept child ``index``
        with its projection replaced by the :meth:`residual` draw, along ``e``.

        Args:
            s_hat, delta, valid, index, rng: as for :meth:`residual`.
            children: ``(P, K, D)`` the problems' children.
            scale: ``(P,)`` float64 transition std.
            e: ``(P, D)`` unit mean displacement (``children``' dtype).
        """
        rows = torch.arange(s_hat.shape[0], device=s_hat.device)
        s_new = self.residual(s_hat, delta, valid, index, rng)
        shift = ((s_new - s_hat[rows, index]) * scale).to(children.dtype)
        return torch.addcmul(children[rows, index], shift[:, None], e)

    def select(
        self, s_hat: torch.Tensor, delta: torch.Tensor, valid: torch.Tensor, rng: Stream
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide each problem: is a child accepted, and which.

        Args:
            s_hat: ``(P, K)`` float64 projections, i.i.d. ``N(0, 1)`` (or as
                :meth:`structure_noise` makes them).
            delta: ``(P,)`` float64 mismatch ``>= 0``.
            valid: ``(P, K)`` bool prefix mask of real children.
            rng: the problems' random stream.

        Returns:
            ``(accepted, index)``: ``(P,)`` bool and ``(P,)`` long, the accepted
            child, or when rejected the child whose orthogonal part is kept.
        """
        raise NotImplementedError

    def residual(
        self, s_hat: torch.Tensor, delta: torch.Tensor, valid: torch.Tensor, index: torch.Tensor, rng: Stream
    ) -> torch.Tensor:
        """The target projection of rejected problems (the same rows' inputs as :meth:`select`).

        Returns:
            ``(P,)`` float64: together with the accepted children's projections,
            exactly ``N(delta, 1)``.
        """
        raise NotImplementedError

    def acceptance(self, delta: torch.Tensor | float, K: int) -> torch.Tensor:
        """Closed-form probability of accepting a child, given ``delta`` and ``K``."""
        raise NotImplementedError

    def model_acceptance(self, delta: torch.Tensor | float, K: int) -> torch.Tensor:
        """A fast approximation of :meth:`acceptance` for planning models (default: the exact one)."""
        return self.acceptance(delta, K)

    def uniform_draws(self, K: int) -> tuple:
        """The ``(slot, n)`` uniform draws :meth:`select` (and :meth:`residual`) make at every
        problem with ``K`` children, in :meth:`Stream.uniform <specforest.streams.Stream.uniform>`'s terms.

        The sampler computes them in advance, in one pass with the round's
        drafting noise (:func:`specforest.streams.uniforms`), and hands them over
        in the stream: the same numbers, fewer tensor ops. Draws not declared
        here are computed when asked for. Default: none.
        """
        return ()

    def check_children(self, K: int) -> None:
        """Raise ``ValueError`` if a node cannot have ``K`` children under this rule."""
        if self.max_children is not None and K > self.max_children:
            raise ValueError(
                f"coupling {self.name!r} takes at most {self.max_children} child per node, "
                f"got {K}; use a tree with K <= {self.max_children} or another coupling"
            )

    def structure_defect(self, z: torch.Tensor) -> torch.Tensor:
        """How far standardized children ``z (P, K, D)`` are from noise :meth:`structure_noise` makes.

        Only read by :meth:`__call__` (the sampler drafts through :meth:`structure_noise`
        itself), for rules with :attr:`structured_siblings`. The default,
        ``structure_noise(z) - z``, is zero exactly on the structured noise when
        :meth:`structure_noise` is a projection onto it (it leaves structured noise as it
        is, as mirroring does); a rule whose map is not one overrides this.

        Returns:
            ``(P, K, D)``: zero (up to rounding) for structured children, not for i.i.d. ones.
        """
        return self.structure_noise(z) - z

    def _check_structure(self, z: torch.Tensor, valid: torch.Tensor, offset: torch.Tensor, dtypes: tuple) -> None:
        """Refuse children without the rule's sibling structure, with how to draw them.

        ``offset (P, D)`` is ``mu_p / s``: rounding the children moves ``z`` by up to a few ulps of
        ``|mu_p| / s + |z|``, so the tolerance scales with it, at float32's precision or the
        inputs' if coarser (children made in float32 and handed over in float64 still pass;
        i.i.d. children are off by order one).
        """
        eps = max(torch.finfo(t if t.is_floating_point else torch.float32).eps for t in (torch.float32, *dtypes))
        defect = self.structure_defect(z).abs()
        tol = 16.0 * eps * (offset.abs()[:, None] + z.abs() + 1.0)
        bad = ((defect > tol) & valid[..., None]).flatten(1).any(1)
        if bool(bad.any()):
            p = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"coupling {self.name!r} draws a node's children jointly (structured_siblings), but "
                f"children lack that structure ({int(bad.sum())} of {z.shape[0]} problems, the first "
                f"problem {p}); draw them as mu_p[:, None] + scale[:, None, None] * "
                f"coupling.structure_noise(z) with z ~ N(0, 1) of shape (P, K, D)"
            )

    def structure_noise(self, z: torch.Tensor) -> torch.Tensor:
        """Joint law of siblings: map i.i.d. standard noise ``(n, K, ...)`` of each
        node's ``K`` children to the noise the rule expects (identity: i.i.d.).

        Only used when :attr:`structured_siblings` is True. Every sibling must
        stay marginally standard normal, so each child (and the subtree drafted
        below it) keeps the proposal's law.
        """
        return z

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
