"""The GRS residual law: its tail mass, and an exact draw at a fixed cost.

After ``K`` rejections, greedy rejection sampling draws the projection ``S``
from the residual density (paper eq. 17, ERRATA 2 and 4)

    r(s) = (phi(s - delta) - lam phi(s))_+ / G,    lam = lambda_K,  G = G_{K+1},

which lives on the half-line ``s > tau = ln(lam) / delta + delta / 2``, the
super-level set ``rho(s) > lam`` in the projection coordinate. There
``phi(s - delta) - lam phi(s) = phi(s - delta) (1 - exp(-delta (s - tau)))``,
and the tail mass is closed form:

    H(s) = Phibar(s - delta) - lam Phibar(s),    H(tau) = G.

A draw is the root of ``H(S) = u H(tau)`` for a uniform ``u`` in (0, 1]
(:func:`sample_grs_residual`).

**Trials first.** The sampler draws with :func:`draw_grs_residual`: up to
:data:`TRIALS` rejection trials from the normal ``N(delta, 1)`` truncated to
``s > tau``, each kept with probability ``1 - exp(-delta (s - tau))`` (the
residual over that envelope, up to its constant), and the inversion above only
where no trial was kept. A kept trial has the residual's law, and so has the
inversion: the draw is exact whichever gives it. Where the envelope's mass over
the residual's, ``M = Phibar(tau - delta) / G``, is small (``delta`` of order one
and above, where draft and target disagree and rejections happen), a trial is
kept with probability ``1 / M`` and the inversion is rarely needed; on the CPU
it is then skipped, which is most of the cost of a draw.

**The Rayleigh score.** With ``psi(s) = sqrt(-2 ln(H(s) / H(tau)))`` the draw
solves ``psi(S) = sqrt(-2 ln u)``. Were ``S - tau`` Rayleigh distributed,
``psi`` would be ``s - tau`` exactly, and the residual is close to that: as
``delta -> 0`` with ``K = 1`` it *is* Rayleigh; near ``tau`` the density
vanishes linearly, so ``1 - H / H(tau) ~ c (s - tau)^2`` and ``psi`` grows
linearly from 0 even though ``H'(tau) = 0``; far out ``H`` is a normal tail and
``psi ~ s - delta``. Newton's method on this nearly linear function converges
quadratically from a closed-form start, with no special case for ``u`` near 1
or near 0.

**Precision.** Near ``tau``, ``H / H(tau) = 1 - C / H(tau)`` with
``C(s) = int_tau^s r``, and ``C`` must keep its relative precision (at
``u = 1 - 1e-15`` it is ``1e-15`` of ``G``): forming ``G - H`` would lose every
digit. ``C`` is a smooth integral over a short interval of an integrand that
is evaluated without cancellation (with ``expm1``), so a Gauss-Legendre rule
gets it to rounding error. Elsewhere :func:`tail_mass` evaluates ``ln H`` in
closed form, keeping full precision in both tails and for small ``delta``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

__all__ = ["TRIALS", "draw_grs_residual", "log_sf", "sample_grs_residual", "tail_mass"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

# Below this delta, log Phibar(s) - log Phibar(s - delta) in the tail mass is
# taken from the hazard at the midpoint instead of by subtracting two nearly
# equal logarithms, which loses ~log10(1 / delta) digits. The midpoint rule with
# its second-order term is off by ~delta^4 / 1920 relative (5e-12 at the
# switch), where the subtraction loses under two digits.
_SMALL_DELTA = 1e-2

# Newton steps on the Rayleigh score, fixed from measured worst cases over
# delta in [1e-6, 12], K in 1..16 and u in [1e-300, 1] (10^4 points against a
# 60-digit reference): the largest error is 7e4 times the tolerance
# 1e-10 (1 + |s|) after two steps, 6e-2 times it after three and 1e-3 times it
# (the rounding floor) after four. The slowest cases are delta < 1e-4 with K
# near 16 and u in 1e-20..1e-2, where the start is about one unit off.
_NEWTON_STEPS = 3

# Below the residual's 10 % point (u > 0.9) C, not H, is the small quantity, and
# ln(H / H(tau)) comes from the quadrature of C. Twelve Gauss-Legendre nodes
# keep its error under 1e-3 of the tolerance up to that point for every delta
# up to 12; ten reach 2e-2 of it, and at the median sixteen would be needed.
_NEAR = 0.9
_GL_NODES = 12

TRIALS = 16
"""Rejection trials of :func:`draw_grs_residual` before it inverts: where the envelope's mass over
the residual's is ``M <= 4`` (about ``delta >= 0.4`` for ``K = 2``), all of them fail with
probability at most ``(3 / 4)^16 = 1 %``."""

# Trials are made where M < 16: above it, 16 trials fail more often than not (36 % at M = 16),
# and a draw that pays for trials and the inversion costs more than the inversion alone.
_LOG_M_TRIALS = math.log(16.0)

# Offsets s - tau stay at least this large so that log(1 - exp(-delta (s - tau)))
# is finite; tau + _X_MIN rounds to tau.
_X_MIN = 1e-280
# A Newton step never shrinks s - tau by more than this factor, so that an
# overshoot past tau, possible where the score is not concave, cannot stall the
# iteration at tau. It never acts on the measured grid.
_SHRINK = 1e-3
# exp(-700) is a normal float64: the start's normal quantile is taken no deeper.
_LOG_TINY = -700.0
# The Newton step's factor H / (phi(s - delta) (1 - exp(-delta (s - tau)))) is
# capped at exp(700): at s = tau + _X_MIN (u = 1) it overflows for delta above
# ~30 while psi = 0, and 0 * inf would be nan.
_LOG_HUGE = 700.0


def _needed(mask: torch.Tensor) -> bool:
    """Whether some element takes the branch ``mask`` selects with ``torch.where``.

    Off the CPU always (reading the mask would synchronize); on the CPU a read
    is free, and a branch no element takes is skipped. Either way the result
    is the same bit for bit: ``where`` with an all-false mask returns the other
    branch.
    """
    return mask.device.type != "cpu" or bool(mask.any())


def log_sf(x: torch.Tensor) -> torch.Tensor:
    """``log Phibar(x)``, the log standard-normal survival function, stable in both tails.

    Args:
        x: any shape.

    Returns:
        ``log Phibar(x)``, same shape and dtype as ``x``.
    """
    return torch.special.log_ndtr(-x)


def tail_mass(s: torch.Tensor, delta: torch.Tensor | float, log_lam: torch.Tensor) -> torch.Tensor:
    """``log H(s) = log [Phibar(s - delta) - lam Phibar(s)]`` for ``s`` in the super-level set.

    Written as ``log Phibar(s - delta) + log(1 - exp(i))`` with
    ``i = log lam + log Phibar(s) - log Phibar(s - delta)``, so that neither tail
    loses precision. For ``delta < 1e-2`` the difference of the two log survival
    functions, ``delta`` times the mean hazard ``h = phi / Phibar`` on
    ``[s - delta, s]``, comes from the midpoint rule with its second-order term,
    ``delta (h(m) + delta^2 h''(m) / 24)`` with ``m = s - delta / 2`` and
    ``h'' = h ((h - m)(2 h - m) - 1)``, instead of from a subtraction that
    cancels. Against a 40-digit reference the subtraction is off by up to 6e-9
    relative at ``delta = 1e-6`` (3e-9 in ``G_{K+1} = H(tau)``, as ``grs_levels``
    computes it today), the midpoint form by under 1e-14 at ``tau`` and 5e-13
    where ``log H ~ -700``. For ``delta >= 1e-2`` the result is bit-identical to
    the plain formula.

    Args:
        s: ``(*batch)`` float64 points with ``s >= ln(lam) / delta + delta / 2``.
        delta: ``(*batch)`` normalized mean mismatch, > 0.
        log_lam: ``(*batch)`` ``ln lam``, ``lam >= 1``.

    Returns:
        ``(*batch)`` ``log H(s)``; ``-inf`` where ``H`` underflows.
    """
    delta = torch.as_tensor(delta, dtype=s.dtype, device=s.device)
    return _log_tail(-s, delta - s, delta, log_lam, midpoint=True)


def _log_tail(
    neg_s: torch.Tensor, delta_minus_s: torch.Tensor, delta: torch.Tensor, log_lam: torch.Tensor, *, midpoint: bool
) -> torch.Tensor:
    """:func:`tail_mass` given ``-s`` and ``delta - s`` (``log_sf(x)`` reads ``-x``: negated
    arguments save a negation per call, and ``-(s - delta)`` is ``delta - s`` exactly), with the
    small-``delta`` form only if ``midpoint``.

    Newton steps before the last one only have to get close, and the plain
    formula's error does not matter to them.
    """
    a = torch.special.log_ndtr(delta_minus_s)  # log_sf(s - delta)
    inner = log_lam + torch.special.log_ndtr(neg_s) - a
    if midpoint and _needed(small := delta < _SMALL_DELTA):
        m = (-0.5 * delta) - neg_s  # s - delta / 2, bit for bit
        # phi(m) / Phibar(m) = sqrt(2 / pi) / erfcx(m / sqrt 2), without overflowing exp(m^2 / 2)
        h = _SQRT_2_OVER_PI / torch.special.erfcx(m * (1.0 / math.sqrt(2.0)))
        q = h - m
        h = h * (1.0 + (delta * delta / 24.0) * (q * (h + q) - 1.0))
        inner = torch.where(small, log_lam - delta * h, inner)
    return a + torch.log(-torch.expm1(inner.clamp(max=0.0)))


@functools.lru_cache(maxsize=None)
def _gauss_legendre(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss-Legendre rule on ``[0, 1]`` for ``C``, float64, built once per device.

    Returns the nodes divided by ``sqrt 2`` and the logs of the weights divided
    by ``sqrt(2 pi)``, so that
    ``-C(tau + x) / x = sum(exp(log_w - z^2) * expm1(-delta x t))`` with
    ``z = (x t + tau - delta) / sqrt 2`` at the nodes ``t`` of ``[0, 1]``.
    """
    nodes, weights = np.polynomial.legendre.leggauss(_GL_NODES)
    t = torch.tensor((nodes + 1.0) / 2.0 / math.sqrt(2.0), dtype=torch.float64, device=device)
    log_w = torch.tensor(np.log(weights / 2.0) - _LOG_SQRT_2PI, dtype=torch.float64, device=device)
    return t, log_w


def _check_args(**tensors: torch.Tensor) -> None:
    """Type, dtype, device and shape checks; values are not checked, as that would synchronize."""
    device = None
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype != torch.float64:
            raise TypeError(f"{name} must be float64, got {value.dtype}")
        if device is None:
            device = value.device
        elif value.device != device:
            raise ValueError(f"{name} is on {value.device}, the other arguments on {device}")
    shapes = [value.shape for value in tensors.values()]
    if all(shape == shapes[0] for shape in shapes):
        return  # (the sampler's case: torch.broadcast_shapes, in Python, costs more than a tensor op)
    try:
        torch.broadcast_shapes(*shapes)
    except RuntimeError as err:
        got = ", ".join(f"{name} {tuple(value.shape)}" for name, value in tensors.items())
        raise ValueError(f"delta, lam, G and u must have broadcastable shapes, got {got}") from err


def sample_grs_residual(delta: torch.Tensor, lam: torch.Tensor, G: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Exact draw of ``S`` from the GRS residual ``(q - lam p)_+ / G`` (eq. 17, ERRATA 4).

    Returns the root ``S >= tau`` of ``H(S) = u H(tau)``, the residual's inverse
    tail at ``u`` (module docstring):

    1. ``tau``, ``ln H(tau)`` (:func:`tail_mass`) and the target score
       ``sqrt(-2 ln u)``.
    2. Start at the smaller of the tangent to the score at ``tau``,
       ``tau + sqrt(-2 ln u) / psi'(tau)`` with
       ``psi'(tau) = sqrt(delta phi(tau - delta) / H(tau))`` (left of the root
       where the score is concave, right of it where it is convex), and the
       normal-tail bound ``delta - Phi^{-1}(u H(tau))`` (right of the root, and
       close to it where ``lam Phibar(s) << Phibar(s - delta)``).
    3. Three Newton steps on ``psi(s) = sqrt(-2 ln u)``, with
       ``psi' = r / (psi H / G)`` for the density ``r``. ``ln(H / H(tau))`` is
       ``log1p(-C / H(tau))`` from a 12-node Gauss-Legendre rule on
       ``[tau, s]`` where ``u > 0.9``, and :func:`tail_mass` elsewhere.

    The step count is fixed from measured worst cases: over ``delta`` in
    [1e-6, 12], ``K`` in 1..16 and ``u`` in [1e-300, 1], including ``1 - 2^-53``
    and 1, the draw is within ``6e-12 (1 + |S|)`` of a 60-digit reference, and
    ``S >= tau`` always. Beyond that range it stays finite and ``>= tau``; the
    error is 7e-11 (1 + |S|) at ``K = 40`` and grows with ``delta`` past 12, to
    1e-9 (1 + |S|) at 20 and 1e-6 at 30 (the quadrature).

    The cost is a fixed ~200 tensor operations whatever the batch size: no
    loop over data, no host-device synchronization, no data-dependent branch
    off the CPU (on the CPU, where reading a value is free, the form of
    ``ln(H / H(tau))`` and the small-``delta`` correction no draw needs are
    skipped, which leaves every result unchanged). Each draw depends only on
    its own inputs; on CPU it is the same bit for bit in any batch.

    Args:
        delta: ``(P,)`` float64 normalized mean mismatch, > 0.
        lam: ``(P,)`` float64 level ``lambda_K >= 1``.
        G: ``(P,)`` float64 remaining mass ``G_{K+1} = H(tau) > 0``, the draw's
            normalization: it must be accurate (``grs_levels`` computes it with
            :func:`tail_mass`, to about 4e-15 relative).
        u: ``(P,)`` float64 uniforms in (0, 1]; ``u = 1`` gives ``tau``.

    Returns:
        ``(P,)`` float64 residual draws in the projection coordinate.

    Raises:
        TypeError: if an argument is not a float64 tensor.
        ValueError: if the arguments are on different devices or their shapes
            do not broadcast.
    """
    _check_args(delta=delta, lam=lam, G=G, u=u)
    if not delta.shape == lam.shape == u.shape:
        delta, lam, u = torch.broadcast_tensors(delta, lam, u)
    log_lam = torch.log(lam)
    tau = log_lam / delta + 0.5 * delta
    a = tau - delta  # the residual density at tau + x is phi(x + a) (1 - exp(-delta x)) / G
    log_G = torch.log(G)
    log_u = torch.log(u)
    psi_target = torch.sqrt(-2.0 * log_u)
    near = u > _NEAR

    x_tail = delta - torch.special.ndtri(torch.exp((log_u + log_G).clamp(min=_LOG_TINY))) - tau
    log_slope = 0.5 * (torch.log(delta) - 0.5 * a * a - _LOG_SQRT_2PI - log_G)
    x = torch.minimum(x_tail, psi_target * torch.exp(-log_slope)).clamp(min=_X_MIN)

    # which of the two forms of ln(H / H(tau)) some draw needs (both, off the CPU)
    use_near, use_far = _needed(near), _needed(~near)
    if use_near:
        nodes, log_weights = _gauss_legendre(delta.device)
        a_col = (a * (1.0 / math.sqrt(2.0))).unsqueeze(-1)
        node_rate = (delta * -math.sqrt(2.0)).unsqueeze(-1) * nodes  # -delta t at x = 1
        G_int = torch.exp(log_G)
    neg_delta = -delta
    neg_a, neg_tau = -a, -tau  # (-a) - x is -(x + a) bit for bit: one op where two were
    log_G_phi = log_G + _LOG_SQRT_2PI  # log_density below omits phi's constant
    for step_index in range(_NEWTON_STEPS):
        delta_minus_s = neg_a - x  # -(s - delta) at s = tau + x
        if use_near:
            x_col = x.unsqueeze(-1)
            z = torch.addcmul(a_col, x_col, nodes)
            # a row sum, not a matrix-vector product, whose rounding would depend on the batch size
            integrand = torch.exp(torch.addcmul(log_weights, z, z, value=-1.0)) * torch.expm1(x_col * node_rate)
            log_near = torch.log1p(x * integrand.sum(-1) / G_int)
        if use_far:
            last = step_index == _NEWTON_STEPS - 1
            log_far = _log_tail(neg_tau - x, delta_minus_s, delta, log_lam, midpoint=last) - log_G
        if use_near and use_far:
            log_ratio = torch.where(near, log_near, log_far)
        else:
            log_ratio = log_near if use_near else log_far
        log_ratio = log_ratio.clamp(max=0.0)
        log_density = torch.add(torch.log(-torch.expm1(neg_delta * x)), delta_minus_s.square(), alpha=-0.5)
        psi = torch.sqrt(-2.0 * log_ratio)
        step = (psi - psi_target) * psi * torch.exp((log_G_phi + log_ratio - log_density).clamp(max=_LOG_HUGE))
        x = torch.maximum(x - step, x * _SHRINK)
    return tau + x


def draw_grs_residual(delta: torch.Tensor, lam: torch.Tensor, G: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Exact draw of ``S`` from the GRS residual ``(q - lam p)_+ / G``: trials, then the inversion.

    With ``n = (u.shape[1] - 1) // 2`` trials (the sampler's :data:`TRIALS`):

    1. ``n`` candidates from ``N(delta, 1)`` truncated to ``s > tau``,
       ``s_j = delta - Phi^{-1}(v_j Phibar(tau - delta))``, where the envelope's
       mass ``M = Phibar(tau - delta) / G`` is below 16;
    2. candidate ``j`` passes if ``w_j < 1 - exp(-delta (s_j - tau))``, which is
       ``r(s_j) / (M q_tau(s_j))`` for the truncated normal ``q_tau``: the first
       that passes is a draw from the residual ``r``;
    3. where none passes (or none was tried), :func:`sample_grs_residual` at ``u_0``.

    Every path gives a draw from ``r`` with uniforms of its own, so their
    mixture is ``r`` exactly (``tests/test_grs_residual.py`` checks it against
    the closed-form CDF with and without trials, and a trial test that keeps every
    candidate fails it). No loop over data and no synchronization: the trials
    are one vectorized pass, and off the CPU both paths are computed and chosen
    with ``torch.where``; on the CPU the inversion is skipped when every draw
    passed a trial, and the trials when no draw makes them (the same results).
    Each draw depends only on its own inputs: the same bit for bit in any batch.

    Args:
        delta, lam, G: ``(P,)`` float64, as for :func:`sample_grs_residual`.
        u: ``(P, 1 + 2 n)`` float64 uniforms in (0, 1]: ``u_0`` for the inversion,
            then the ``n`` candidates' ``v`` and the ``n`` tests' ``w``.

    Returns:
        ``(P,)`` float64 residual draws ``>= tau`` in the projection coordinate.

    Raises:
        TypeError: if an argument is not a float64 tensor.
        ValueError: if the arguments are on different devices, ``u`` is not
            ``(P, 1 + 2 n)`` for the ``P`` of ``delta``, or the shapes of ``delta``,
            ``lam`` and ``G`` differ.
    """
    if not isinstance(u, torch.Tensor) or u.ndim != 2:
        raise ValueError(f"u must be a (P, 1 + 2 n) tensor, got {getattr(u, 'shape', type(u).__name__)}")
    _check_args(delta=delta, lam=lam, G=G, u=u[:, 0])
    if u.shape[1] % 2 != 1 or not delta.shape == lam.shape == G.shape == u.shape[:1]:
        raise ValueError(
            f"delta, lam and G must be (P,) and u (P, 1 + 2 n), got delta {tuple(delta.shape)}, "
            f"lam {tuple(lam.shape)}, G {tuple(G.shape)}, u {tuple(u.shape)}"
        )
    n = u.shape[1] // 2
    log_lam = torch.log(lam)
    tau = log_lam / delta + 0.5 * delta
    neg_a = delta - tau  # the truncation point of N(0, 1) is a = tau - delta
    log_mass = torch.special.log_ndtr(neg_a)  # log Phibar(a), the envelope's mass
    trying = (log_mass - torch.log(G)) < _LOG_M_TRIALS
    kept = None
    if n and _needed(trying):
        v, w = u[:, 1 : n + 1], u[:, n + 1 :]
        x = neg_a[:, None] - torch.special.ndtri(v * torch.exp(log_mass)[:, None])  # (P, n) s - tau
        # x <= 0 (a rounding at the truncation point) is never kept: -expm1 of a value >= 0 is <= 0
        passed = (w < -torch.expm1(x * -delta[:, None])) & trying[:, None]
        kept = passed.any(1)
        x_kept = x.gather(1, passed.to(torch.int8).argmax(1, keepdim=True))[:, 0]
        s_kept = tau + x_kept
    if kept is None:
        return sample_grs_residual(delta, lam, G, u[:, 0])
    if not _needed(~kept):
        return s_kept
    return torch.where(kept, s_kept, sample_grs_residual(delta, lam, G, u[:, 0]))
