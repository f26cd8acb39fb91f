"""Addressable random streams: every draw is a function of (seed, sample, place).

specforest never draws from a shared sequential stream. A run derives one
64-bit *key* per trajectory from the seed and the trajectory's global sample
index; every random number of the run is then a hash of that key, of where in
the run it is drawn (its step, the tree node, what it is for) and of its
position in the drawn vector. This is a counter-based generator in plain
tensor ops (the SplitMix64 finalizer, a bijective 64-bit mixer, in wrapping
``int64`` arithmetic), evaluated on the states' device; it plays the role of
EDM's per-sample generators and of diffrax's keyed Brownian tree.

Contract (what the tests check):

* sample ``i`` of a run depends only on ``(seed, i)`` and its own initial
  state: not on the batch size, the order of the samples, ``max_rows``
  chunking, lazy or full execution, or the number of processes;
* two places never share a draw: keys are folded with distinct tags for the
  initial noise, exact transitions, drafted children and coupling draws;
* uniforms have 52 random bits, in ``(0, 1)``; a normal is the inverse normal
  CDF of one such uniform, computed in float64 and cast.

Bitwise equality across batch compositions holds where the model itself is
batch-invariant (the closed-form Gaussian mixture in float64); a network's own
results may change in the last bits with its batch, and the samples follow it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .validation import check_indices, check_seed

__all__ = [
    "Stream",
    "TAG_DRAFT",
    "TAG_EXACT",
    "TAG_INIT",
    "SLOT_COUPLE",
    "fold",
    "key_from_generator",
    "mix",
    "normal",
    "randn",
    "sample_keys",
    "uniform",
    "uniforms",
]


def _signed(c: int) -> int:
    """A 64-bit constant as the ``int64`` with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
# ``>>`` on int64 is arithmetic: masking the top bits makes it logical
_MASK = {k: (1 << (64 - k)) - 1 for k in (12, 27, 30, 31)}

TAG_INIT = 1
"""Initial noise ``x_T`` of a sample (:func:`randn`)."""
TAG_EXACT = 2
"""The exact Euler-Maruyama transition of the standard sampler at a step."""
TAG_DRAFT = 3
TAG_START = 4
"""Slot of the noise a chain adds to the caller's states before its first step (EDM's churn of ``x_0``)."""
"""The noise of a drafted child (node of a round's tree)."""
SLOT_COUPLE = 1 << 20
"""First slot of the coupling's draws under a node's key (its drafting noise is at :data:`TAG_DRAFT`)."""


def mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on ``int64`` tensors: a bijection of 64-bit words.

    Args:
        z: any shape, ``torch.int64`` (not modified).

    Returns:
        Same shape and dtype; wrapping arithmetic makes it identical on every device.
    """
    return _mix_(z.clone())


@functools.lru_cache(maxsize=None)
def _consts(device: torch.device) -> tuple:
    """The mixer's shifts, masks and multipliers as 0-d tensors on ``device`` (cheaper than Python ints)."""
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return tuple((t(k), t(_MASK[k]), None if m is None else t(m)) for k, m in ((30, _M1), (27, _M2), (31, None)))


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """:func:`mix` on a tensor the caller owns: in place when it is large (no temporaries)."""
    consts = _consts(z.device)
    if z.numel() < 1 << 16:
        # tiny tensors: fewer dispatches beat fewer allocations
        for shift, mask, mult in consts:
            z = z ^ ((z >> shift) & mask)
            if mult is not None:
                z = z * mult
        return z
    t = torch.empty_like(z)
    for shift, mask, mult in consts:
        torch.bitwise_right_shift(z, shift, out=t)
        t &= mask
        z ^= t
        if mult is not None:
            z *= mult
    return z


def fold(keys: torch.Tensor, data: "torch.Tensor | int") -> torch.Tensor:
    """Derive keys for a sub-place: ``mix(keys ^ mix(data * golden + golden))``.

    Args:
        keys: ``(*batch)`` int64 keys.
        data: an int or an int64 tensor broadcastable with ``keys`` (a step, a
            node id, a tag).

    Returns:
        The folded keys, broadcast shape, int64.
    """
    if isinstance(data, torch.Tensor):
        d = _mix_(data.to(torch.int64) * _GOLDEN + _GOLDEN)
    else:
        d = _mixed_constant(int(data), keys.device)
    return _mix_(keys ^ d)


@functools.lru_cache(maxsize=4096)
def _mixed_constant(data: int, device: torch.device) -> torch.Tensor:
    """``mix(data * golden + golden)`` as a 0-d tensor, cached (folds by a tag or slot are hot)."""
    word = _signed(((data + 1) * 0x9E3779B97F4A7C15) % (1 << 64))
    return _mix_(torch.tensor(word, dtype=torch.int64, device=device))


@functools.lru_cache(maxsize=256)
def _counters(n: int, slot: int, device: torch.device) -> torch.Tensor:
    """``(n,)`` mixed counters of the elements of draw ``slot``, cached per device (the hot path reuses them)."""
    j = torch.arange(n, dtype=torch.int64, device=device)
    return _mix_(_mix_(j * _GOLDEN + _M2) ^ _mixed_constant(slot, device))


def _bits_to_unit(h: torch.Tensor) -> torch.Tensor:
    # the top 52 bits, centred in their cell: (k + 1/2) 2^-52 is exact in float64,
    # in [2^-53, 1 - 2^-53], symmetric about 1/2 and never 0 or 1
    h >>= 12
    h &= _MASK[12]
    return h.to(torch.float64).mul_(2.0**-52).add_(2.0**-53)


def uniform(keys: torch.Tensor, n: int, slot: int = 0) -> torch.Tensor:
    """``n`` float64 uniforms in ``(0, 1)`` per key, at draw ``slot``.

    Args:
        keys: ``(*batch)`` int64.
        n: how many per key, >= 1.
        slot: which draw of the key's place (distinct slots never share a number).

    Returns:
        ``(*batch, n)`` float64; element ``j`` depends only on the key, ``slot`` and ``j``.
    """
    return _bits_to_unit(_mix_(keys[..., None] ^ _counters(n, slot, keys.device)))


def uniforms(*draws: tuple) -> list:
    """Several draws in one pass of the mixer, each the same bit for bit as :func:`uniform`'s.

    A round draws its nodes' noise and its coupling's uniforms from different
    keys and slots; mixing them together costs one set of tensor ops instead of
    one per draw.

    Args:
        draws: ``(keys (*batch), layout)`` pairs, ``layout`` a tuple of ``(slot, n)``.

    Returns:
        One ``(*batch, sum of n)`` float64 tensor per pair, whose columns are
        ``uniform(keys, n, slot)`` for each ``(slot, n)`` of its layout, in order.
    """
    words = [keys[..., None] ^ _layout_counters(layout, keys.device) for keys, layout in draws]
    if len(words) == 1:
        return [_bits_to_unit(_mix_(words[0]))]
    u = _bits_to_unit(_mix_(torch.cat([w.reshape(-1) for w in words])))
    return [part.view(w.shape) for part, w in zip(u.split_with_sizes([w.numel() for w in words]), words, strict=True)]


@functools.lru_cache(maxsize=256)
def _layout_counters(layout: tuple, device: torch.device) -> torch.Tensor:
    """The counters of the draws ``layout`` (``(slot, n)`` pairs), concatenated."""
    parts = [_counters(n, slot, device) for slot, n in layout]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def normal(keys: torch.Tensor, n: int, dtype: torch.dtype = torch.float64, slot: int = 0) -> torch.Tensor:
    """``n`` standard normals per key at draw ``slot``: the inverse normal CDF of 52-bit uniforms,
    in float64, then cast to ``dtype`` (the tails are exact out to 8.2 standard deviations,
    beyond which lies a mass of 2e-16).

    Args:
        keys: ``(*batch)`` int64.
        n: how many per key, >= 1.
        dtype: the output's floating dtype.
        slot: which draw of the key's place.

    Returns:
        ``(*batch, n)``; element ``j`` depends only on the key, ``slot`` and ``j``.
    """
    return torch.special.ndtri(uniform(keys, n, slot)).to(dtype)


def key_from_generator(generator: Optional[torch.Generator]) -> int:
    """A 63-bit run seed drawn from ``generator`` (fresh entropy when ``None``).

    The generator advances by one draw, so the same generator state gives the
    same seed and ``sample(..., generator=g)`` stays reproducible.
    """
    if generator is None:
        generator = torch.Generator()
        generator.seed()
    return int(torch.randint(0, 2**63 - 1, (), generator=generator, device=generator.device))


def sample_keys(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Per-sample keys ``(batch,)`` int64 from a run seed and the samples' global indices ``(batch,)``.

    Raises:
        TypeError / ValueError: if ``seed`` is not an int in ``[0, 2**64)``.
    """
    base = _mix_(torch.tensor(_signed(check_seed(seed)), dtype=torch.int64, device=index.device))
    return fold(base.expand(index.shape), index)


def keys_from_generators(generators: Sequence[torch.Generator], device: "torch.device | str") -> torch.Tensor:
    """``(batch,)`` per-sample keys, one drawn from each generator (diffusers' list convention)."""
    seeds = [key_from_generator(g) for g in generators]
    return sample_keys(0, torch.tensor(seeds, dtype=torch.int64, device=device))


def randn(
    seed: int,
    index: "torch.Tensor | Sequence[int]",
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: "torch.device | str" = "cpu",
) -> torch.Tensor:
    """Initial noise of samples ``index``: ``(len(index), *shape)``, row ``i`` a function of ``(seed, index[i])``.

    The same keys as :func:`specforest.sample` with ``seed=seed`` uses, folded
    with :data:`TAG_INIT`, so a run's initial states and its sampling noise
    both follow the samples' indices.

    Args:
        seed: the run's seed, an int in ``[0, 2**64)``.
        index: ``(n,)`` the samples' global indices, distinct integers in ``[0, 2**63)``.
        shape: one sample's shape.
        dtype, device: of the result.

    Raises:
        TypeError / ValueError: naming ``seed`` or ``index`` (a repeated index among them: each is one sample).
    """
    check_seed(seed)
    idx = check_indices("index", index, unique=True, device=device)
    return normal(sample_keys(seed, idx), math.prod(shape), dtype, TAG_INIT).reshape(idx.numel(), *shape)


@dataclass(frozen=True)
class Stream:
    """The random source of a batch of problems: one key per row.

    A coupling draws with :meth:`uniform` / :meth:`normal` at a *slot* (an int
    naming the draw within the rule, e.g. 0 for the acceptance uniforms), so a
    row's draws depend only on its own key, not on which other rows are in the
    batch. :meth:`take` restricts to some rows.

    Attributes:
        keys: ``(P,)`` int64.
        base: added to every slot: the sampler keys a node's coupling draws with
            the node's own key at ``base = SLOT_COUPLE``, apart from its noise.
        drawn: ``(P, C)`` uniforms computed in advance (by :func:`uniforms`,
            with the round's noise), or ``None``; ``layout`` names their columns
            as ``(slot, n)`` pairs in order. :meth:`uniform` returns them for a
            draw in the layout: the same numbers it would compute.
    """

    keys: torch.Tensor
    base: int = 0
    drawn: Optional[torch.Tensor] = None
    layout: tuple = ()

    @classmethod
    def from_generator(cls, n: int, generator: Optional[torch.Generator], device) -> "Stream":
        """``n`` rows keyed from one draw of ``generator`` (for direct calls outside the sampler)."""
        return cls(sample_keys(key_from_generator(generator), torch.arange(n, device=device)))

    def take(self, rows: torch.Tensor) -> "Stream":
        """The stream of rows ``rows`` (indices or a bool mask)."""
        drawn = None if self.drawn is None else self.drawn[rows]
        return Stream(self.keys[rows], self.base, drawn, self.layout)

    def uniform(self, slot: int, n: int = 1) -> torch.Tensor:
        """``(P, n)`` float64 uniforms in (0, 1) at ``slot``."""
        if self.drawn is not None:
            start = 0
            for s, m in self.layout:
                if (s, m) == (slot, n):
                    return self.drawn[:, start : start + n]
                start += m
        return uniform(self.keys, n, self.base + slot)

    def normal(self, slot: int, n: int = 1) -> torch.Tensor:
        """``(P, n)`` float64 standard normals at ``slot``."""
        return normal(self.keys, n, torch.float64, self.base + slot)

    def __len__(self) -> int:
        return self.keys.shape[0]
