"""The round loop of Algorithm 1, batched over trajectories.

Each round, every unfinished trajectory contributes rows to **one** batched
target call and advances by what that call buys it:

* on a deterministic step (ERRATA 6) it takes the plain Euler step;
* on a stochastic step without a prefetched evaluation (the run's first
  speculative round) it only evaluates its root, which the next round drafts
  from (``fetch``);
* otherwise it drafts its tree layer by layer, has the root and the internal
  nodes (or every node, ``verify="drafted"``) evaluated, walks down from the
  root with the coupling until the first rejection, commits, and keeps one
  evaluation of this round as the next round's prefetched drift.

The standard Euler-Maruyama sampler is the same loop with no tree: every
stochastic round evaluates the state and draws the exact transition.

Trajectories run at their own steps; a trajectory that has finished takes no
rows. The loop knows neither the coupling's nor the proposal's internals.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .couplings import Coupling, get_coupling
from .proposals import Prefetch, Proposal, get_proposal
from .sde import ReverseSDE, flow_match_grid, uniform_grid
from .trees import VERIFY_MODES, DraftTree

__all__ = ["PREFETCH_POLICIES", "SampleResult", "SampleStats", "sample", "standard_sample"]

PREFETCH_POLICIES = ("nearest", "parent")
"""Which evaluation of a round the next round's draft reuses after a rejection.

``parent``: the node whose children were rejected (one step before the new
state). ``nearest``: among the evaluated nodes at the new state's own step that
were drafted from the same parent (its siblings), the one nearest (Euclidean)
to it; after a reflection that is the rejected child itself. Restricting to
siblings keeps the lazy cost simulation exact; on the paper's Gaussian mixture
((3,3) and (5,3) trees, 400 trajectories) the nearest evaluated node of the
whole layer was a sibling in every round (identical NFE with either rule).
Both fall back to the parent when no sibling was evaluated. After a fully accepted round both use the committed node's own
evaluation when it exists (``verify="drafted"``), else its parent's.
"""

GRIDS = ("flow_match", "uniform")

VelocityFn = Callable[..., torch.Tensor]


@dataclass
class SampleStats:
    """Per-trajectory statistics of a run. ``B`` trajectories, tree depth ``L``.

    Attributes:
        nfe: ``(B,)`` target calls each trajectory took part in (its sequential NFE).
        rounds: ``(B,)`` speculative rounds (rounds that drafted a tree).
        spec_steps: ``(B,)`` steps committed by speculative rounds.
        attempts: ``(B, L)`` verification problems met at each depth.
        accepts: ``(B, L)`` of which a drafted child was accepted.
        delta_sum: ``(B, L)`` float64 sum of the observed ``delta`` at each depth.
        commits: ``(B, L + 1)`` rounds that committed ``j`` steps (column ``j``).
        rows: ``(B,)`` states each trajectory had evaluated by the target.
        deltas: with ``record_deltas=True``, ``(n, 4)`` float64 rows
            ``(depth, step, delta, accepted)`` of every verification problem of the
            run (``step`` is the verified parent's step; for calibrating tree plans
            and for per-step diagnostics).
        calls: batched target calls of the whole run (the batch's NFE).
        draft_calls: calls of an independent draft model (0 for frozen drafts).
        steps: number of steps ``T`` of the grid.
        wall_seconds: wall-clock time of the run.
    """

    nfe: torch.Tensor
    rounds: torch.Tensor
    spec_steps: torch.Tensor
    attempts: torch.Tensor
    accepts: torch.Tensor
    delta_sum: torch.Tensor
    commits: torch.Tensor
    rows: torch.Tensor
    deltas: Optional[torch.Tensor] = None
    calls: int = 0
    draft_calls: int = 0
    steps: int = 0
    wall_seconds: float = 0.0

    @property
    def accept_rate_per_depth(self) -> torch.Tensor:
        """``(L,)`` pooled acceptance rate at each depth (NaN where never reached)."""
        a = self.attempts.sum(0).double()
        return self.accepts.sum(0).double() / a

    @property
    def delta_per_depth(self) -> torch.Tensor:
        """``(L,)`` mean observed ``delta`` at each depth (NaN where never reached)."""
        return self.delta_sum.sum(0) / self.attempts.sum(0).double()

    @property
    def speedup(self) -> torch.Tensor:
        """``(B,)`` float64 ``T / nfe``: speedup over the standard sampler's ``T`` calls."""
        return self.steps / self.nfe.double()

    @property
    def steps_per_round(self) -> torch.Tensor:
        """``(B,)`` mean steps committed per speculative round."""
        return self.spec_steps.double() / self.rounds.double()


@dataclass
class SampleResult:
    """What :func:`sample` returns.

    Attributes:
        samples: ``(B, *shape)`` final states at ``sigma = 0``.
        stats: the run's :class:`SampleStats`.
        config: the options that produced it (names as in :func:`sample`).
    """

    samples: torch.Tensor
    stats: SampleStats
    config: dict = field(default_factory=dict)


def _make_sde(steps, sigmas, grid, shift, churn) -> ReverseSDE:
    if sigmas is None:
        if steps is None:
            raise ValueError("give steps (an int >= 1) or sigmas (a (T + 1,) tensor)")
        if grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
        sigmas = flow_match_grid(steps, shift=shift) if grid == "flow_match" else uniform_grid(steps, shift=shift)
    elif steps is not None and int(steps) != len(sigmas) - 1:
        raise ValueError(f"steps={steps} disagrees with len(sigmas) - 1 = {len(sigmas) - 1}")
    return ReverseSDE(torch.as_tensor(sigmas, dtype=torch.float64), churn)


def _randn(shape, generator, dtype, device) -> torch.Tensor:
    gdev = generator.device
    return torch.randn(shape, generator=generator, dtype=dtype, device=gdev).to(device)


def _nearest(dist: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise argmin of ``dist (n, k)`` over entries where ``ok``; and whether any is ok."""
    dist = torch.where(ok, dist, torch.full_like(dist, float("inf")))
    return dist.argmin(1), ok.any(1)


def _normal_into(out: torch.Tensor, generator: torch.Generator) -> None:
    """Fill ``out`` with standard normals from ``generator`` (in place when devices match)."""
    if out.device == generator.device:
        out.normal_(generator=generator)
    else:
        out.copy_(_randn(out.shape, generator, out.dtype, out.device))


class _Target:
    """Wraps the user's velocity with shape/dtype checks and per-row conditioning.

    A tensor in ``model_kwargs`` whose first dimension is the batch size ``B`` is
    per-trajectory conditioning (e.g. class labels): each call receives its rows
    indexed by the trajectory each state belongs to. Anything else is passed as is.
    """

    def __init__(self, fn: VelocityFn, shape, dtype, max_rows: Optional[int], kwargs: dict, batch: int):
        self.fn, self.shape, self.dtype, self.max_rows = fn, shape, dtype, max_rows
        self.per_row = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == batch}
        self.shared = {k: v for k, v in kwargs.items() if k not in self.per_row}

    def cond(self, traj: torch.Tensor) -> dict:
        """The conditioning of trajectories ``traj (n,)``: per-row tensors indexed, the rest as is."""
        return {**self.shared, **{k: v[traj.to(v.device)] for k, v in self.per_row.items()}}

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
        M, D = x.shape
        chunk = self.max_rows or M
        outs = []
        for i in range(0, M, chunk):
            xi = x[i : i + chunk].reshape(-1, *self.shape)
            rows = {k: v[traj[i : i + chunk].to(v.device)] for k, v in self.per_row.items()}
            out = self.fn(xi, sigma[i : i + chunk].to(x.dtype), **self.shared, **rows)
            if not isinstance(out, torch.Tensor) or out.shape != xi.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"model must return a tensor of the input's shape {tuple(xi.shape)}, got {got}"
                )
            outs.append(out.reshape(-1, D).to(x.dtype))
        v = torch.cat(outs) if len(outs) > 1 else outs[0]
        if not torch.isfinite(v).all():
            bad = (~torch.isfinite(v)).any(1)
            s = sigma[bad]
            raise FloatingPointError(
                f"model returned NaN or inf for {int(bad.sum())} of {M} states "
                f"(sigma in [{s.min().item():.4g}, {s.max().item():.4g}]); refusing to continue"
            )
        return v


def sample(
    model: VelocityFn,
    x: torch.Tensor,
    *,
    steps: Optional[int] = None,
    churn: float,
    sigmas: Optional[torch.Tensor] = None,
    grid: str = "flow_match",
    shift: float = 1.0,
    tree: Optional[DraftTree] = None,
    coupling: "str | Coupling" = "grs",
    draft: "str | Proposal | VelocityFn" = "velocity",
    prefetch: str = "nearest",
    verify: str = "internal",
    generator: Optional[torch.Generator] = None,
    callback: Optional[Callable[[dict], None]] = None,
    progress: bool = False,
    max_rows: Optional[int] = None,
    model_kwargs: Optional[dict] = None,
    lazy: bool = False,
    record_deltas: bool = False,
) -> SampleResult:
    """Sample the churned reverse SDE exactly, speculating on a draft tree.

    The output has the law of the standard Euler-Maruyama chain on the same
    grid (paper eq. 6) for any tree, coupling, draft and prefetch policy;
    those only change how many sequential target calls (NFE) it takes.

    Args:
        model: the target velocity ``v(x, sigma, **model_kwargs)`` on the linear
            path, ``x: (M, *shape)``, ``sigma: (M,)`` -> ``(M, *shape)``.
        x: ``(B, *shape)`` initial states at ``sigmas[0]`` (pure noise at 1).
        steps: number of steps ``T >= 1`` on the chosen ``grid``.
        churn: ``eps`` in (0, 1] (ERRATA 8: 0 makes speculation vacuous).
        sigmas: an explicit ``(T + 1,)`` grid, decreasing from <= 1 to 0.
        grid: ``flow_match`` (diffusers' default grid) or ``uniform`` (the paper's text).
        shift: timestep shift ``kappa`` of eq. (38).
        tree: draft topology; ``None`` runs the standard sampler.
        coupling: ``grs`` (D-GRS, Algorithm 3), ``rmc`` (Algorithm 2, chains
            only) or a :class:`~specforest.couplings.Coupling`.
        draft: frozen-prediction kind (``velocity``, ``drift``, ``x0``, ``eps``),
            a :class:`~specforest.proposals.Proposal`, or a draft-model callable.
        prefetch: ``nearest`` or ``parent``, see :data:`PREFETCH_POLICIES`.
        verify: ``internal`` (evaluate root and internal nodes) or ``drafted``
            (every node, leaves included).
        generator: the only source of randomness. Results are reproducible for a
            given generator state, batch and ``max_rows``-independent; they do
            depend on the batch's composition (all trajectories share one stream).
        callback: called after each round with a dict of named tensors
            (``round``, ``step``, ``x``, ``committed``).
        progress: show a progress bar of the slowest trajectory's step.
        max_rows: split each target call into sub-batches of at most this many
            states (still one call, one NFE; bounds peak memory of the model).
        model_kwargs: extra keyword arguments passed to ``model``. A tensor whose
            first dimension is ``B`` is per-trajectory conditioning (e.g. class
            labels ``(B,)``): every call gets the rows of the trajectories its
            states belong to.
        lazy: cost simulation: realize only the nodes the acceptance phase visits
            (children are i.i.d. given their parent, so drafting them on demand
            gives the same law of samples, NFE and acceptance at a fraction of
            the compute). NFE and ``rows`` are accounted as for the full tree;
            the model is called several times per round with few rows.
        record_deltas: keep every verification's ``(depth, step, delta, accepted)`` in ``stats.deltas``.

    Returns:
        :class:`SampleResult` with ``samples`` ``(B, *shape)`` and ``stats``.

    Raises:
        ValueError / TypeError: on invalid arguments, naming the parameter.
        FloatingPointError: if the model returns NaN or inf.
    """
    t0 = time.perf_counter()
    if not callable(model):
        raise TypeError("model must be callable as model(x, sigma)")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape (batch, *shape), got {type(x).__name__}")
    if x.ndim < 2 or x.shape[0] < 1 or x.numel() == 0:
        raise ValueError(f"x must have shape (batch, *shape) with batch >= 1, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if not torch.isfinite(x).all():
        raise ValueError("x contains NaN or inf")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
        raise TypeError(f"steps must be an int >= 1, got {type(steps).__name__}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if prefetch not in PREFETCH_POLICIES:
        raise ValueError(f"prefetch must be one of {PREFETCH_POLICIES}, got {prefetch!r}")
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"max_rows must be None or an int >= 1, got {max_rows!r}")
    from .planning import AdaptiveTree

    planner = tree if isinstance(tree, AdaptiveTree) else None
    if tree is not None and not isinstance(tree, (DraftTree, AdaptiveTree)):
        raise TypeError(
            f"tree must be a DraftTree (see specforest.trees), a planning.AdaptiveTree or None, got {type(tree).__name__}"
        )
    if planner is not None:
        tree = planner.initial
    if tree is not None and tree.L < 1:
        raise ValueError("tree must have depth L >= 1; use tree=None for the standard sampler")
    if not isinstance(lazy, bool):
        raise TypeError(f"lazy must be a bool, got {type(lazy).__name__}")
    if not isinstance(record_deltas, bool):
        raise TypeError(f"record_deltas must be a bool, got {type(record_deltas).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    sde = _make_sde(steps, sigmas, grid, shift, churn)
    cp = get_coupling(coupling)
    if planner is not None and type(cp).structure_noise is not Coupling.structure_noise:
        raise ValueError(f"coupling {cp.name!r} draws structured siblings; an adaptive tree needs i.i.d. children")
    if tree is not None and type(cp).structure_noise is not Coupling.structure_noise:
        k = tree.num_children[tree.internal]
        if (k != k[0]).any():
            raise ValueError(
                f"coupling {cp.name!r} draws structured siblings: every internal node of the tree "
                "needs the same number of children (e.g. trees.uniform(4, L) for antithetic)"
            )
    if tree is not None:
        for k in tree.num_children[tree.internal].unique().tolist():
            try:
                cp.check_children(int(k))
            except ValueError as err:
                raise ValueError(f"tree: {err}") from None
    proposal = get_proposal(draft)
    if generator is None:
        generator = torch.Generator(device="cpu")
        generator.seed()

    shape = tuple(x.shape[1:])
    B, D = x.shape[0], math.prod(shape)
    dev = x.device
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise TypeError(f"model_kwargs must be a dict or None, got {type(model_kwargs).__name__}")
    target = _Target(model, shape, work, max_rows, model_kwargs or {}, B)
    loop = _Loop(sde, tree, cp, proposal, prefetch, verify, target, generator, shape, dev, work, lazy, planner)
    loop.recorded = [] if (record_deltas or planner is not None) else None
    xs, stats = loop.run(x.reshape(B, D).to(work, copy=True), callback, progress)
    if not torch.isfinite(xs).all():
        raise FloatingPointError("sampling produced NaN or inf; refusing to return it")
    stats.wall_seconds = time.perf_counter() - t0
    config = dict(
        steps=sde.steps, churn=sde.churn, grid=grid if sigmas is None else "custom", shift=shift,
        tree=None if tree is None else repr(planner or tree),
        budget=0 if tree is None else (planner.budget if planner is not None else tree.budget),
        coupling=cp.name, draft=proposal.name, prefetch=prefetch, verify=verify,
        mode="lazy" if lazy else "full",
    )
    return SampleResult(xs.reshape(B, *shape).to(x.dtype), stats, config)


def standard_sample(model: VelocityFn, x: torch.Tensor, **kwargs: Any) -> SampleResult:
    """The standard Euler-Maruyama sampler: :func:`sample` with ``tree=None``."""
    kwargs["tree"] = None
    return sample(model, x, **kwargs)


class _Loop:
    """State and phases of one run; one instance per :func:`sample` call."""

    def __init__(self, sde, tree, coupling, proposal, prefetch, verify, target, gen, shape, dev, work, lazy,
                 planner=None):
        self.sde, self.coupling, self.proposal = sde, coupling, proposal
        self.lazy, self.planner = lazy, planner
        self.recorded = None
        self.structured = type(coupling).structure_noise is not Coupling.structure_noise
        self.prefetch, self.verify, self.target, self.gen = prefetch, verify, target, gen
        self.shape, self.dev, self.work = shape, dev, work
        self.sig = sde.sigmas.to(dev)
        self.scale = sde.scale.to(dev)
        self.stoch = sde.stochastic.to(dev)
        self.run_end = sde.run_end.to(dev)
        self._set_tree(tree)

    def _set_tree(self, tree):
        """Topology tensors of the tree the next rounds draft."""
        self.tree, dev, verify = tree, self.dev, self.verify
        if tree is not None:
            self.parent = tree.parent.to(dev)
            self.depth = tree.depth.to(dev)
            self.children = tree.children.to(dev)
            self.nchild = tree.num_children.to(dev)
            self.internal = tree.internal.to(dev)
            # rows a round with lookahead m evaluates: |I(T|_m)| or |V(T|_m)|
            m = torch.arange(tree.L + 1)
            d = tree.depth[None, :]
            ev = (d < m[:, None]) & tree.internal[None, :] if verify == "internal" else d <= m[:, None]
            self.rows_at = ev.sum(1).to(dev)

    # -- driver -------------------------------------------------------------------
    def run(self, x, callback, progress):
        B, D = x.shape
        T, dev = self.sde.steps, self.dev
        L = self.tree.L if self.tree is not None else 0
        if self.planner is not None:
            L = max(L, min(self.planner.max_depth, T))
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
        st = SampleStats(
            nfe=z(B), rounds=z(B), spec_steps=z(B), attempts=z(B, L), accepts=z(B, L),
            delta_sum=torch.zeros(B, L, dtype=torch.float64, device=dev), commits=z(B, L + 1),
            rows=z(B), steps=T,
        )
        self.st = st
        step = z(B)
        has_pre = torch.zeros(B, dtype=torch.bool, device=dev)
        pre = Prefetch(torch.zeros_like(x), torch.zeros_like(x), z(B), torch.zeros_like(x), torch.zeros_like(x),
                       z(B), torch.zeros(B, dtype=torch.bool, device=dev))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=T, unit="step", desc="sampling")
        rnd = 0
        while True:
            active = step < T
            if not active.any():
                break
            stoch = self.stoch[step.clamp(max=T - 1)] & active
            det = active & ~stoch
            if self.tree is None:
                exact, fetch, spec = stoch, torch.zeros_like(stoch), torch.zeros_like(stoch)
            else:
                exact = torch.zeros_like(stoch)
                fetch = stoch & ~has_pre if self.proposal.needs_prefetch else torch.zeros_like(stoch)
                spec = stoch & ~fetch
            committed = z(B)
            self.proposal.begin_round()
            groups = self._tree_groups(spec, step) if spec.any() else []

            single = det | exact | fetch
            ids_1 = single.nonzero()[:, 0]
            if self.lazy:
                v1 = self.target(x[ids_1], self.sig[step[ids_1]], ids_1) if ids_1.numel() else None
                for mask, tree in groups:
                    self._set_tree(tree)
                    self._speculate_lazy(x, step, mask, pre, committed)
            else:
                # -- one batched target call for every trajectory --------------------
                drafted = []
                for mask, tree in groups:
                    self._set_tree(tree)
                    drafted.append((tree, self._draft(x, step, mask, pre)))
                rows_x, rows_s, rows_t = [x[ids_1]], [self.sig[step[ids_1]]], [ids_1]
                for _, d in drafted:
                    em = d["emask"]
                    rows_x.append(d["Y"][em])
                    rows_s.append(self.sig[d["estep"][em]])
                    rows_t.append(d["ids"][None, :].expand_as(em)[em])
                v_all = self.target(torch.cat(rows_x), torch.cat(rows_s), torch.cat(rows_t))
                v1 = v_all[: ids_1.numel()]
                start = ids_1.numel()
                for tree, d in drafted:
                    self._set_tree(tree)
                    n_rows = int(d["emask"].sum())
                    st.rows[d["ids"]] += d["emask"].sum(0)
                    self._accept(x, step, committed, pre, d, v_all[start : start + n_rows])
                    start += n_rows
            st.nfe += active.long()
            st.rows[ids_1] += 1
            if spec.any():
                ids_s = spec.nonzero()[:, 0]
                st.rounds[ids_s] += 1
                st.spec_steps[ids_s] += committed[ids_s]
                st.commits[ids_s, committed[ids_s]] += 1

            # -- single-row trajectories: Euler step, exact step, or root fetch ------
            if ids_1.numel():
                s1 = step[ids_1]
                mean = self.sde.mean_from_velocity(x[ids_1], v1, s1)
                is_fetch = fetch[ids_1]
                is_exact = exact[ids_1]
                noise = _randn((ids_1.numel(), D), self.gen, self.work, dev)
                new = mean + self.scale[s1].to(self.work)[:, None] * noise * is_exact[:, None]
                move = ~is_fetch
                x[ids_1[move]] = new[move]
                committed[ids_1[move]] = 1
                f = ids_1[is_fetch]
                pre.set(f, x[f], v1[is_fetch], step[f], keep_prev=False)
                has_pre[f] = True

            step += committed
            rnd += 1
            if bar is not None:
                bar.n = int(step.min())
                bar.refresh()
            if callback is not None:
                callback({"round": rnd, "step": step.clone(), "x": x.reshape(B, *self.shape), "committed": committed})
        if bar is not None:
            bar.close()
        st.calls = rnd
        if self.recorded is not None:
            st.deltas = torch.cat(self.recorded) if self.recorded else torch.zeros(0, 4, dtype=torch.float64)
        st.draft_calls = getattr(self.proposal, "calls", 0)
        return x, st

    def _tree_groups(self, spec, step):
        """``[(mask, tree)]``: the trajectories drafting each tree this round.

        A fixed tree serves every trajectory (each truncates it to its horizon).
        An adaptive plan is re-made from the statistics so far and, near the end
        of the chain, re-optimized for each remaining horizon shorter than it.
        """
        if self.planner is None:
            return [(spec, self.tree)]
        T = self.sde.steps
        data = torch.cat(self.recorded) if self.recorded else None
        base = self.planner.plan(data, self.coupling, T)
        if data is None:
            return [(spec, base)]
        horizon = self.run_end[step.clamp(max=T - 1)] - step
        groups = []
        short = spec & (horizon < base.L)
        if (spec & ~short).any():
            groups.append((spec & ~short, base))
        for h in torch.unique(horizon[short]).tolist():
            groups.append((short & (horizon == h), self.planner.plan(data, self.coupling, int(h))))
        return groups

    # -- phase 1: drafting ------------------------------------------------------------
    def _draft(self, x, step, spec, pre):
        tree, dev, T = self.tree, self.dev, self.sde.steps
        ids = spec.nonzero()[:, 0]
        Bs, D = ids.numel(), x.shape[1]
        s0 = step[ids]
        Ls = torch.minimum(self.run_end[s0] - s0, torch.full_like(s0, tree.L))
        Lr = int(Ls.max())
        V = tree.size_at_depth(Lr)
        # node-major layout: a depth layer is one contiguous block of Y
        Y = torch.empty(V, Bs, D, dtype=self.work, device=dev)
        Y[0] = x[ids]
        sub = pre.take(ids) if self.proposal.needs_prefetch else None
        for level in range(1, Lr + 1):
            par_layer, lay = tree.layer(level - 1), tree.layer(level)
            ps = (s0 + level - 1).clamp(max=T - 1)
            m = self.proposal.mean(self.sde, Y[par_layer], ps, sub, self.shape, self.target.cond(ids))
            out = Y[lay]
            _normal_into(out, self.gen)
            if self.structured:
                k = self.tree.max_children
                out.copy_(self.coupling.structure_noise(out.view(-1, k, *out.shape[1:])).reshape(out.shape))
            out.mul_(self.scale[ps].to(self.work)[:, None])
            out.add_(torch.repeat_interleave(m, self.nchild[par_layer], dim=0, output_size=lay.stop - lay.start))
        d = self.depth[:V][:, None]
        if self.verify == "drafted":
            emask = d <= Ls[None, :]
        else:
            emask = (d < Ls[None, :]) & self.internal[:V][:, None]
        estep = (s0[None, :] + d).clamp(max=T - 1)
        row = torch.full((V, Bs), -1, dtype=torch.long, device=dev)
        row[emask] = torch.arange(int(emask.sum()), device=dev)
        return dict(ids=ids, s0=s0, Ls=Ls, Lr=Lr, Y=Y, sub=sub, emask=emask, estep=estep, row=row)

    # -- phase 3: acceptance, commit, prefetch --------------------------------------------
    def _accept(self, x, step, committed, pre, dr, v):
        dev = self.dev
        ids, s0, Ls, Y, row, sub = dr["ids"], dr["s0"], dr["Ls"], dr["Y"], dr["row"], dr["sub"]
        Bs = ids.numel()
        cur = torch.zeros(Bs, dtype=torch.long, device=dev)
        alive = torch.ones(Bs, dtype=torch.bool, device=dev)
        ncom = torch.zeros(Bs, dtype=torch.long, device=dev)
        new_x = torch.empty(Bs, Y.shape[2], dtype=self.work, device=dev)
        ar = torch.arange(Bs, device=dev)
        rej_depth = torch.zeros(Bs, dtype=torch.long, device=dev)
        rej_node = torch.zeros(Bs, dtype=torch.long, device=dev)
        for level in range(1, dr["Lr"] + 1):
            act = alive & (level <= Ls) & (self.nchild[cur] > 0)
            if not act.any():
                break
            a = act.nonzero()[:, 0]
            u = cur[a]
            sa = s0[a] + level - 1
            yu = Y[u, a]
            mu_q = self.sde.mean_from_velocity(yu, v[row[u, a]], sa)
            ch = self.children[u]
            valid = ch >= 0
            kids = Y[ch.clamp(min=0), a[:, None]]
            # the draft mean is a deterministic function of the parent: recompute it
            # here for the visited nodes rather than store it for every node
            pa = None if sub is None else sub.take(a)
            mu_p = self.proposal.mean(self.sde, yu[None], sa, pa, self.shape, self.target.cond(ids[a]))[0]
            res = self._verify(ids[a], level, yu, mu_p, mu_q, sa, pa, kids, valid)
            ncom[a] += 1
            acc = res.accepted
            cur[a[acc]] = ch[acc, res.index[acc]]
            rj = a[~acc]
            new_x[rj] = res.state[~acc].to(self.work)
            alive[rj] = False
            rej_depth[rj] = level
            rej_node[rj] = u[~acc]
        full = alive.nonzero()[:, 0]
        new_x[full] = Y[cur[full], full]
        x[ids] = new_x
        committed[ids] = ncom

        # -- prefetch: which evaluation the next round drafts from ----------------
        src = torch.where(alive, cur, rej_node)
        src_step = s0 + torch.where(alive, self.depth[cur], rej_depth - 1)
        own = alive & (row[cur, ar] >= 0)
        # fully accepted without an evaluation at the committed node: its parent
        nb = alive & ~own
        src[nb] = self.parent[cur[nb]]
        src_step[nb] -= 1
        if self.prefetch == "nearest":
            rj = (~alive).nonzero()[:, 0]
            if rj.numel():
                ch = self.children[rej_node[rj]]  # (n, K_max) the new state's siblings
                ok = (ch >= 0) & (row[ch.clamp(min=0), rj[:, None]] >= 0)
                dist = (Y[ch.clamp(min=0), rj[:, None]] - new_x[rj][:, None]).square().sum(-1)
                pick, has = _nearest(dist, ok)
                rr = rj[has]
                src[rr] = ch.gather(1, pick[:, None])[:, 0][has]
                src_step[rr] = s0[rr] + rej_depth[rr]
        pre.set(ids, Y[src, ar], v[row[src, ar]], src_step, keep_prev=True)

    def _verify(self, traj, level, y, mu_p, mu_q, step, pre, kids, valid):
        """Couple one depth's children with their targets and record the statistics."""
        st = self.st
        res = self.coupling(mu_p, mu_q, self.scale[step], kids, valid, self.gen)
        self.proposal.observe(self.sde, y, mu_q, step, pre, self.scale[step])
        st.attempts[traj, level - 1] += 1
        st.accepts[traj, level - 1] += res.accepted.long()
        st.delta_sum[traj, level - 1] += res.delta.to(st.delta_sum.dtype)
        if self.recorded is not None:
            d = res.delta.detach().double().cpu()
            cols = [torch.full_like(d, float(level)), step.double().cpu(), d, res.accepted.double().cpu()]
            self.recorded.append(torch.stack(cols, 1))
        return res

    # -- lazy cost simulation -----------------------------------------------------------
    def _speculate_lazy(self, x, step, spec, pre, committed):
        """One speculative round that drafts only the children of visited nodes.

        The law of everything observed is that of the full round: the children of
        a node are i.i.d. given it, nodes off the walked path influence nothing,
        and the prefetch rules only read the walked path and its siblings.
        """
        st, dev, T, tree = self.st, self.dev, self.sde.steps, self.tree
        ids = spec.nonzero()[:, 0]
        Bs, D = ids.numel(), x.shape[1]
        s0 = step[ids]
        Ls = torch.minimum(self.run_end[s0] - s0, torch.full_like(s0, tree.L))
        st.rows[ids] += self.rows_at[Ls]
        sub = pre.take(ids) if self.proposal.needs_prefetch else None
        cur = torch.zeros(Bs, dtype=torch.long, device=dev)  # node id in the tree
        cur_y = x[ids].clone()
        alive = torch.ones(Bs, dtype=torch.bool, device=dev)
        ncom = torch.zeros(Bs, dtype=torch.long, device=dev)
        new_x = torch.empty_like(cur_y)
        # the last evaluation on the path: the parent fallback of the prefetch
        src_y, src_v, src_step = cur_y.clone(), torch.empty_like(cur_y), s0.clone()
        for level in range(1, int(Ls.max()) + 1):
            act = alive & (level <= Ls) & (self.nchild[cur] > 0)
            if not act.any():
                break
            a = act.nonzero()[:, 0]
            sa = s0[a] + level - 1
            yu = cur_y[a]
            vu = self.target(yu, self.sig[sa], ids[a])
            src_y[a], src_v[a], src_step[a] = yu, vu, sa
            mu_q = self.sde.mean_from_velocity(yu, vu, sa)
            pa = None if sub is None else sub.take(a)
            mu_p = self.proposal.mean(self.sde, yu[None], sa, pa, self.shape, self.target.cond(ids[a]))[0]
            ch = self.children[cur[a]]
            valid = ch >= 0
            sc = self.scale[sa].to(self.work)
            z = _randn(ch.shape + (D,), self.gen, self.work, dev)
            if self.structured:
                z = self.coupling.structure_noise(z)
            kids = mu_p[:, None] + sc[:, None, None] * z
            res = self._verify(ids[a], level, yu, mu_p, mu_q, sa, pa, kids, valid)
            ncom[a] += 1
            acc = res.accepted
            pick = torch.where(acc, res.index, torch.zeros_like(res.index))
            aa = a[acc]
            cur[aa] = ch[acc, pick[acc]]
            cur_y[aa] = kids[acc, pick[acc]]
            rj = a[~acc]
            new_x[rj] = res.state[~acc].to(self.work)
            alive[rj] = False
            if self.prefetch == "nearest" and rj.numel():
                # siblings at this depth were evaluated iff they are verified nodes
                chr_ = ch[~acc]
                d_kid = self.depth[chr_.clamp(min=0)]
                if self.verify == "drafted":
                    ev = chr_ >= 0
                else:
                    ev = (chr_ >= 0) & self.internal[chr_.clamp(min=0)] & (d_kid < Ls[rj][:, None])
                if ev.any():
                    kid_rj = kids[~acc]
                    dist = (kid_rj - new_x[rj][:, None]).square().sum(-1)
                    pick_s, has = _nearest(dist, ev)
                    rh = rj[has]
                    ys = kid_rj[has, pick_s[has]]
                    src_y[rh] = ys
                    src_v[rh] = self.target(ys, self.sig[s0[rh] + level], ids[rh])
                    src_step[rh] = s0[rh] + level
        full = alive.nonzero()[:, 0]
        new_x[full] = cur_y[full]
        if full.numel() and self.verify == "drafted":
            # the committed node was evaluated in the round: reuse it exactly
            sf = s0[full] + ncom[full]
            src_y[full] = cur_y[full]
            src_v[full] = self.target(cur_y[full], self.sig[sf.clamp(max=T - 1)], ids[full])
            src_step[full] = sf
        x[ids] = new_x
        committed[ids] = ncom
        pre.set(ids, src_y, src_v, src_step, keep_prev=True)
