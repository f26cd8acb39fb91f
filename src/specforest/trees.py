"""Draft topologies: rooted trees given by a parent array (paper Sec. 3.1).

A node is one candidate realisation of the state at one step; its depth is the
number of steps past the round's root. Nodes are stored in breadth-first order
(depth non-decreasing, every parent before its children), so that

* each depth layer is a contiguous index range, and
* the truncation ``T|_m`` of eq. (11) to depth ``m`` is a prefix of the nodes.

Constructors: :func:`chain` (the RMC lookahead), :func:`uniform` (the paper's
``(K, L)`` family), :func:`widths` (depth-dependent widths ``[K_1, ..., K_L]``)
and :func:`from_parents` (any rooted tree). :class:`TreeTables` holds a tree's
topology on a run's device, with what a round reads of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import streams
from .validation import check_int, check_ints

__all__ = ["DraftTree", "TreePolicy", "chain", "uniform", "widths", "from_parents", "optimal", "VERIFY_MODES"]

VERIFY_MODES = ("internal", "drafted")
"""Where the target is evaluated each round: the root and the internal nodes
(the cheap mode), or every node including the leaves (``drafted``)."""

_MAX_NODES = 50_000_000
"""The most nodes a tree may have (every constructor refuses more, before it builds anything)."""


def _check_nodes(nodes: int, fix: str) -> None:
    """Refuse a tree of more than :data:`_MAX_NODES` nodes (``nodes``: its count, or a lower bound)."""
    if nodes > _MAX_NODES:
        raise ValueError(f"the tree would have more than {_MAX_NODES} nodes; {fix}")


def check_budget(budget: object, name: str = "budget") -> int:
    """``budget``, drafted states per round, as an int ``>= 1`` whose trees fit the node cap.

    Raises:
        TypeError: if it is not an int.
        ValueError: if it is < 1, or a tree of it would exceed 50 million nodes.
    """
    budget = check_int(name, budget, 1)
    _check_nodes(budget + 1, f"reduce {name}")
    return budget


def _length(values: object) -> int:
    """How many elements a constructor's sequence holds, without reading them (0 for anything else:
    :func:`~specforest.validation.check_ints` then names what is wrong with it)."""
    if isinstance(values, torch.Tensor):
        return values.numel()
    return len(values) if isinstance(values, Sequence) and not isinstance(values, (str, bytes)) else 0


def _uniform_nodes(K: int, L: int) -> int:
    """Nodes of the uniform ``(K, L)`` tree, or a number past :data:`_MAX_NODES` once it is one
    (a few multiplications: a deep ``K = 1`` chain is counted, not listed)."""
    if K == 1:
        return L + 1
    total, layer = 1, 1
    for _ in range(L):
        layer *= K
        total += layer
        if total > _MAX_NODES:
            break
    return total


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A rooted draft tree in breadth-first order.

    Attributes:
        parent: ``(V,)`` long, ``parent[0] = -1`` for the root, ``parent[v] < v``.
        depth: ``(V,)`` long, ``depth[0] = 0``, non-decreasing.
    """

    parent: torch.Tensor
    depth: torch.Tensor

    def __post_init__(self) -> None:
        p, d = self.parent, self.depth
        for name, t in (("parent", p), ("depth", d)):
            if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"{name} must be an integer tensor (see trees.from_parents for a list), got {got}")
        if p.ndim != 1 or d.shape != p.shape or p.numel() < 1:
            raise ValueError("parent and depth must be 1-D tensors of the same length >= 1")
        _check_nodes(p.numel(), "give fewer nodes")
        if p[0] != -1 or d[0] != 0:
            raise ValueError("node 0 must be the root (parent -1, depth 0)")
        if p.numel() > 1:
            idx = torch.arange(1, p.numel())
            if ((p[1:] < 0) | (p[1:] >= idx)).any():
                raise ValueError("parent[v] must be in [0, v) for every non-root node v")
            if (d[1:] != d[p[1:]] + 1).any() or (d[1:] < d[:-1]).any() or (p[2:] < p[1:-1]).any():
                raise ValueError(
                    "nodes must be in breadth-first order (depth = parent depth + 1, "
                    "parents non-decreasing); build irregular trees with from_parents"
                )
        V = p.numel()
        counts = torch.bincount(p[1:], minlength=V) if V > 1 else torch.zeros(1, dtype=torch.long)
        kmax = int(counts.max()) if V > 1 else 0
        # children table, padded with -1, children in index order
        table = torch.full((V, max(kmax, 1)), -1, dtype=torch.long)
        if V > 1:
            child = torch.arange(1, V)
            par = p[1:]
            first = torch.zeros(V, dtype=torch.long)
            first[1:] = torch.cumsum(counts, 0)[:-1]
            # parents are non-decreasing in BFS order, so rank = index - first child
            rank = child - 1 - first[par]
            table[par, rank] = child
        L = int(d[-1])
        layer_start = torch.searchsorted(d, torch.arange(L + 2), right=False)
        object.__setattr__(self, "_num_children", counts)
        object.__setattr__(self, "_children", table)
        object.__setattr__(self, "_layer_start", layer_start)

    # -- structure -------------------------------------------------------------
    @property
    def size(self) -> int:
        """``|V|``, root included."""
        return self.parent.numel()

    @property
    def L(self) -> int:
        """Depth of the tree (0 for a lone root)."""
        return int(self.depth[-1])

    @property
    def budget(self) -> int:
        """Drafted states per round, ``B = |V| - 1`` (ERRATA 7)."""
        return self.size - 1

    @property
    def num_children(self) -> torch.Tensor:
        """``(V,)`` long number of children of each node."""
        return self._num_children

    @property
    def children(self) -> torch.Tensor:
        """``(V, K_max)`` long children of each node, padded with -1."""
        return self._children

    @property
    def max_children(self) -> int:
        """Largest number of children of any node (1 for a lone root)."""
        return self._children.shape[1]

    @property
    def internal(self) -> torch.Tensor:
        """``(V,)`` bool, True for nodes with children (``I(T)`` of eq. 9)."""
        return self._num_children > 0

    def layer(self, level: int) -> slice:
        """Index range of the nodes at depth ``level`` (a slice; empty if none)."""
        if level < 0 or level > self.L:
            return slice(0, 0)
        return slice(int(self._layer_start[level]), int(self._layer_start[level + 1]))

    def verification_budget(self, mode: str = "internal") -> int:
        """Target evaluations per full round: ``|I|`` or ``|V|`` (eq. 10, 16)."""
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {mode!r}")
        return int(self.internal.sum()) if mode == "internal" else self.size

    def truncate(self, m: int) -> "DraftTree":
        """The induced subtree ``T|_m`` of nodes of depth at most ``m`` (eq. 11)."""
        m = check_int("m", m, 0)
        if m >= self.L:
            return self
        n = int(self._layer_start[m + 1])
        return DraftTree(self.parent[:n].clone(), self.depth[:n].clone())

    def size_at_depth(self, m: int) -> int:
        """``|V_{<= m}|``: number of nodes of ``T|_m``."""
        m = min(max(m, 0), self.L)
        return int(self._layer_start[m + 1])

    def __repr__(self) -> str:
        # kept on the (immutable) tree: every run records it in its config
        text = self.__dict__.get("_repr")
        if text is None:
            widths = [self.layer(level).stop - self.layer(level).start for level in range(self.L + 1)]
            text = self.__dict__["_repr"] = f"DraftTree(L={self.L}, budget={self.budget}, layer_sizes={widths})"
        return text


def widths(ks: Sequence[int]) -> DraftTree:
    """A tree where every node at depth ``l - 1`` has ``ks[l - 1]`` children.

    Args:
        ks: per-depth widths ``[K_1, ..., K_L]``, ints >= 1; empty gives a lone root.

    Returns:
        The tree with ``prod(ks[:l])`` nodes at depth ``l``.

    Raises:
        TypeError: if ``ks`` is not a sequence of ints.
        ValueError: if a width is < 1 or the tree would exceed 50 million nodes.
    """
    # every width is >= 1: a list this long is refused before its elements are read
    _check_nodes(_length(ks) + 1, "give fewer widths")
    ks = check_ints("ks", ks)
    for k in ks:
        check_int("K", k, 1)
    total, layer = 1, 1
    for k in ks:
        layer *= k
        total += layer
        _check_nodes(total, "reduce K or L")
    parents = [torch.tensor([-1])]
    depths = [torch.tensor([0])]
    start, count = 0, 1
    for level, k in enumerate(ks, start=1):
        par = torch.arange(start, start + count).repeat_interleave(k)
        parents.append(par)
        depths.append(torch.full((count * k,), level))
        start, count = start + count, count * k
    return DraftTree(torch.cat(parents).long(), torch.cat(depths).long())


def uniform(K: int, L: int) -> DraftTree:
    """The paper's uniform ``(K, L)`` tree: ``B = K + K^2 + ... + K^L``.

    Args:
        K: children per internal node, >= 1.
        L: depth (lookahead), >= 1.

    Raises:
        TypeError: if ``K`` or ``L`` is not an int.
        ValueError: if one is < 1 or the tree would exceed 50 million nodes (before any list is built).
    """
    check_int("K", K, 1)
    check_int("L", L, 1)
    _check_nodes(_uniform_nodes(K, L), "reduce K or L")
    return widths([K] * L)


def chain(L: int) -> DraftTree:
    """The RMC chain of ``L`` drafted states (a uniform tree with ``K = 1``).

    Raises:
        TypeError: if ``L`` is not an int.
        ValueError: if it is < 1 or the chain would exceed 50 million nodes (before any list is built).
    """
    check_int("L", L, 1)
    _check_nodes(L + 1, "reduce L")
    return widths([1] * L)


def from_parents(parents: Sequence[int]) -> DraftTree:
    """Any rooted tree, from a parent list with exactly one root (parent -1).

    The nodes are renumbered in breadth-first order (children of a node keep
    their relative order), so node ids of the result differ from the input's.

    Args:
        parents: ``parents[v]`` (an int) is the parent of node ``v``; one entry is -1.

    Raises:
        TypeError: if ``parents`` is not a sequence of ints.
        ValueError: if it does not describe one rooted tree, or has more than 50 million nodes.
    """
    _check_nodes(_length(parents), "give fewer nodes")
    par = check_ints("parents", parents)
    V = len(par)
    roots = [v for v, p in enumerate(par) if p == -1]
    if len(roots) != 1:
        raise ValueError(f"parents must contain exactly one root (-1), found {len(roots)}")
    kids: list[list[int]] = [[] for _ in range(V)]
    for v, p in enumerate(par):
        if p != -1:
            if not 0 <= p < V or p == v:
                raise ValueError(f"parents[{v}] = {p} is not a node index in [0, {V})")
            kids[p].append(v)
    order, depth_of = [roots[0]], {roots[0]: 0}
    i = 0
    while i < len(order):
        u = order[i]
        for c in kids[u]:
            depth_of[c] = depth_of[u] + 1
            order.append(c)
        i += 1
    if len(order) != V:
        raise ValueError("parents does not describe a tree: some nodes are unreachable or in a cycle")
    new_id = {old: new for new, old in enumerate(order)}
    new_par = [-1] + [new_id[par[old]] for old in order[1:]]
    new_depth = [depth_of[old] for old in order]
    return DraftTree(torch.tensor(new_par, dtype=torch.long), torch.tensor(new_depth, dtype=torch.long))


def optimal(
    acceptance: "Callable[[int, int], float]", budget: int, max_depth: int, kmax: int | None = None
) -> DraftTree:
    """The tree that maximizes the expected steps committed per round under a budget.

    Model: a node at depth ``l - 1`` whose ``k`` children are verified accepts one
    of them with probability ``acceptance(l, k)`` (e.g. Theorem 2 at the mismatch
    ``delta_l`` observed at depth ``l``). A round commits one step per depth it
    reaches, so with ``V(l, b)`` the expected steps from a node at depth ``l - 1``
    with ``b`` drafted states below it,

        V(l, 0) = 0,   V(l, b) = max_{k, b'} 1 + acceptance(l, k) V(l + 1, b'),
        over k >= 1, b' >= 0 with k (1 + b') <= b,

    solved by dynamic programming over ``(l, b)``, in the spirit of Sequoia's
    tree construction for language models. Every child of a node gets the same
    subtree, so the result has depth-dependent widths and may stop early (a
    pruned, irregular tree), using at most ``budget`` drafted states.

    Args:
        acceptance: ``acceptance(l, k)`` in [0, 1], ``l >= 1`` depth, ``k >= 1`` children (e.g.
            :func:`specforest.acceptance.acceptance_model` of a run's recorded mismatches). Not a
            model: :func:`specforest.planning.plan_tree` plans a tree for a model.
        budget: drafted states ``B >= 1``.
        max_depth: largest depth to consider (e.g. the steps left), ``>= 1``. A tree of ``budget``
            drafted states is at most ``budget`` deep, so deeper levels are never considered.
        kmax: largest number of children per node considered (default: ``budget``).

    Returns:
        The optimal tree (breadth-first ordered).

    Raises:
        TypeError: if ``acceptance`` is not such a function (a model, say), naming what to pass.
        ValueError: if an argument is out of range, an acceptance is outside ``[0, 1]``, the tree
            could exceed 50 million nodes, or the table of the dynamic program would
            (``budget x max_depth``), before ``acceptance`` is called.
    """
    _check_acceptance(acceptance)
    budget = check_budget(budget)
    max_depth = check_int("max_depth", max_depth, 1)
    kmax = budget if kmax is None else min(check_int("kmax", kmax, 1), budget)
    # (levels past the budget hold no node: the same tree, from a smaller table)
    max_depth = min(max_depth, budget)
    if (max_depth + 2) * (budget + 1) > _MAX_NODES:
        raise ValueError(
            f"planning budget={budget} to max_depth={max_depth} needs a table of more than {_MAX_NODES} "
            "entries; reduce budget or max_depth"
        )
    acc = {}
    for level in range(1, max_depth + 1):
        for k in range(1, kmax + 1):
            a = _acceptance_at(acceptance, level, k)
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"acceptance({level}, {k}) must be in [0, 1], got {a}")
            acc[level, k] = a
    # V[l][b], best[l][b] = (k, b') ; depth max_depth + 1 has no children
    V = [[0.0] * (budget + 1) for _ in range(max_depth + 2)]
    best: list[list[tuple[int, int] | None]] = [[None] * (budget + 1) for _ in range(max_depth + 2)]
    for level in range(max_depth, 0, -1):
        for b in range(1, budget + 1):
            top, arg = 0.0, None
            for k in range(1, min(b, kmax) + 1):
                sub_max = b // k - 1
                a = acc[level, k]
                # V[l+1] is non-decreasing in the budget: the largest b' is best
                val = 1.0 + a * V[level + 1][sub_max]
                if val > top + 1e-12:
                    top, arg = val, (k, sub_max)
            V[level][b], best[level][b] = top, arg
    parents = [-1]
    frontier = [(0, 1, budget)]  # (node id, level of its children, budget below it)
    while frontier:
        nxt = []
        for node, level, b in frontier:
            if b <= 0 or level > max_depth or best[level][b] is None:
                continue
            k, sub = best[level][b]
            for _ in range(k):
                parents.append(node)
                nxt.append((len(parents) - 1, level + 1, sub))
        frontier = nxt
    return from_parents(parents)


_ACCEPTANCE = (
    "acceptance must be a function acceptance(l, k) -> the probability in [0, 1] that one of k children "
    "at depth l is accepted (e.g. specforest.acceptance.acceptance_model(deltas, coupling)); to plan a tree "
    "for a model, call specforest.planning.plan_tree(model, x, budget=..., steps=..., churn=...)"
)


def _check_acceptance(acceptance: object) -> None:
    """Refuse what cannot be an acceptance function: not callable, or a network."""
    if not callable(acceptance):
        raise TypeError(f"{_ACCEPTANCE}; got {type(acceptance).__name__}")
    if isinstance(acceptance, torch.nn.Module):
        raise TypeError(f"{_ACCEPTANCE}; got a torch.nn.Module ({type(acceptance).__name__}), a model")


def _acceptance_at(acceptance: Callable, level: int, k: int) -> float:
    """``acceptance(level, k)`` as a float; a function that cannot take two ints (a velocity
    ``v(x, sigma)``, say) or returns no number is refused with what to pass."""
    try:
        a = acceptance(level, k)
    except (TypeError, ValueError, AttributeError, IndexError, RuntimeError) as err:
        raise TypeError(f"{_ACCEPTANCE}; acceptance({level}, {k}) raised {type(err).__name__}: {err}") from err
    got = f"a tensor of shape {tuple(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
    if isinstance(a, (bool, str, bytes)):
        raise TypeError(f"{_ACCEPTANCE}; acceptance({level}, {k}) returned {got}")
    try:
        return float(a)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{_ACCEPTANCE}; acceptance({level}, {k}) returned {got}") from err


class TreePolicy:
    """A draft tree chosen anew every round from the run's own recorded verifications.

    Pass an instance as ``tree`` to :func:`specforest.sample`
    (:class:`specforest.planning.AdaptiveTree` is one). The sampler calls
    :meth:`plan` once per round with the verifications of the earlier rounds
    only, so a round's tree is fixed given the past and the sampler stays
    exact. Policies assume i.i.d. children (couplings with structured siblings
    are refused).

    Attributes:
        budget: drafted states per round (for reports).
        max_depth: deepest tree the policy may return.
        initial: the tree of the rounds before any statistics exist.
    """

    budget: int
    max_depth: int
    initial: DraftTree

    def plan(self, deltas: "torch.Tensor | None", coupling, max_depth: int) -> DraftTree:
        """The tree for the next round.

        Args:
            deltas: ``(n, 4)`` float64 rows ``(depth, step, delta, accepted)`` of
                the run's verifications so far, or ``None`` before any.
            coupling: the run's :class:`~specforest.couplings.Coupling`.
            max_depth: the deepest useful tree (the horizon left), ``>= 1``.
        """
        raise NotImplementedError


# -- on the run's device ---------------------------------------------------------------------


@dataclass(frozen=True)
class TreeTables:
    """A tree's topology on the run's device, with what the round reads of it (made once per tree)."""

    tree: DraftTree
    parent: torch.Tensor  # (V,)
    up: torch.Tensor  # (V,) the parent, the root's being the root
    depth: torch.Tensor  # (V,)
    children: torch.Tensor  # (V, K_max), -1 padded
    kids: torch.Tensor  # (V, K_max) the children, a padding entry pointing at the root
    kid_eval: torch.Tensor  # (L + 1, V, K_max) bool: the child is real and a round with lookahead m evaluates it
    internal: torch.Tensor  # (V,) bool
    code: torch.Tensor  # (V,) int64: mixed node ids, XORed into the round's key
    valid: torch.Tensor  # (V, K_max) bool: real children (a leaf gets a full row of dummy ones)
    layers: tuple  # per depth l: (start, stop, k) with k the common number of children or 0 if mixed
    rows_at: torch.Tensor  # (L + 1,) rows a round with lookahead m evaluates
    rows_spec: torch.Tensor  # (L + 1,) the same with 0 at m = 0 (a trajectory that does not speculate)
    eval_at: torch.Tensor  # (L + 1, V) bool: the nodes a round with lookahead m evaluates
    verify_at: torch.Tensor  # (L + 1, V) bool: the nodes whose children a round with lookahead m verifies
    step_of: torch.Tensor  # (V,) long: the step offset of the noise that drafts a node (its parent's depth)
    node_ids: torch.Tensor  # (V,) long arange
    eval_prefix: tuple  # per lookahead m: n when the nodes evaluated are exactly 0..n-1, else -1
    L: int = 0  # depth, as a Python int (the round reads it often; no host read of a tensor)

    @classmethod
    def of(cls, tree: DraftTree, verify: str, device: torch.device) -> "TreeTables":
        """The tables of ``tree`` for ``verify`` on ``device``, built once and kept on the (immutable) tree."""
        cache = tree.__dict__.setdefault("_tables", {})
        key = (verify, str(device))
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = cls.build(tree, verify, device)
        return hit

    @classmethod
    def build(cls, tree: DraftTree, verify: str, device: torch.device) -> "TreeTables":
        layers = []
        for level in range(tree.L + 1):
            sl = tree.layer(level)
            k = tree.num_children[sl]
            layers.append((sl.start, sl.stop, int(k[0]) if bool((k == k[0]).all()) else 0))
        m = torch.arange(tree.L + 1)[:, None]
        d = tree.depth[None, :]
        # with lookahead m: the nodes whose children are verified, and the nodes the target evaluates
        verified = (d < m) & tree.internal[None, :]
        ev = verified if verify == "internal" else d <= m
        code = streams.mix(torch.arange(tree.size, dtype=torch.int64) * 2 + 1)
        valid = tree.children >= 0
        # a node without children (a leaf) is never verified, but the full round decides every node
        # at once: a full row of dummy children keeps its junk problem well-formed for any rule
        valid[tree.num_children == 0] = True
        counts = ev.sum(1)
        prefix = tuple(int(n) if bool(row[:n].all()) else -1 for row, n in zip(ev, counts.tolist(), strict=True))
        kids = tree.children.clamp(min=0)
        to = lambda t: t.to(device)  # noqa: E731
        return cls(
            tree,
            to(tree.parent),
            to(tree.parent.clamp(min=0)),
            to(tree.depth),
            to(tree.children),
            to(kids),
            to((tree.children >= 0)[None] & ev[:, kids]),
            to(tree.internal),
            to(code),
            to(valid),
            tuple(layers),
            to(counts),
            to(torch.cat([counts.new_zeros(1), counts[1:]])),
            to(ev),
            to(verified),
            to((tree.depth - 1).clamp(min=0)),
            to(torch.arange(tree.size)),
            prefix,
            tree.L,
        )

    def sizes(self, m: int) -> list:
        """Layer sizes of the tree truncated to depth ``m``."""
        return [b - a for a, b, _ in self.layers[: m + 1]]

    def size_at(self, m: int) -> int:
        """Nodes of the tree truncated to depth ``m``."""
        return self.layers[min(max(m, 0), self.L)][1]
