"""The target as the sampler calls it: one velocity call per round, checked, conditioned and timed.

:class:`Target` wraps the user's velocity ``v(x, sigma, **cond, **model_kwargs)``:
it reshapes the flattened states to the model's shape, gives each call the
per-trajectory conditioning of its rows' trajectories, splits a call into
``max_rows`` chunks, refuses an output that is not a floating-point tensor of the
input's shape, casts it to the coupling arithmetic's dtype,
accumulates a device-side flag for NaN or inf outputs (read with the round's
one host read, so that no call synchronizes) with which rows and noise levels
they were at (read only to say so, naming the model, the step and the rows), and times the network calls
themselves (CUDA events on a GPU, read once at the end of the run). With
``pad_rows`` every network call's rows are padded up to one of a few sizes, so
that a ``torch.compile(mode="reduce-overhead")`` or CUDA-graph model does not
recompile for every new row count.

A chain that declares its calls' own time inputs (:meth:`specforest.chains.Chain.call_times`) has each
call's rows given theirs (``timestep``): a model that declares ``takes_timestep = True`` receives them as the
keyword ``timestep`` ``(M,)`` (the diffusers UNet adapters: a scheduler's own timesteps), any other maps the
level as always.

Tree-parallel verification: with a ``torch.distributed`` process group, the
rows of each call are split into one equal share per process (padded with
copies of the last row), every process evaluates its own share, and the
shares are gathered (``all_gather``), so every process holds every velocity of
the round. The sampler, run identically on every process with the same
random streams, then commits the same states everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any, Callable, Optional

import torch

__all__ = ["ALL_ROWS", "Target", "model_name"]

ALL_ROWS = "all"
"""The :meth:`Target.cond_rows` key of every trajectory in order (``traj`` an arange)."""

FOLD_CALLS = 16
"""Calls whose per-row NaN flags a target keeps as they are; beyond, they are folded into one
``(batch,)`` record, so a run that reads its flag only at its end (the standard sampler's) holds a
bounded record."""

_WRAPPED = ("denoiser", "fn", "model")
"""Where the library's own adapters keep the callable they wrap (:func:`model_name`)."""


def model_name(fn: Any) -> str:
    """What an error calls the model: the user's function's name or class, found through the
    library's own adapters (a k-diffusion denoiser inside its velocity adapter, say)."""
    for _ in range(8):
        if not type(fn).__module__.startswith("specforest."):
            break
        inner = next((getattr(fn, a) for a in _WRAPPED if callable(getattr(fn, a, None))), None)
        if inner is None:
            break
        fn = inner
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


class Target:
    """The user's velocity with shape/dtype checks, per-trajectory conditioning and timing.

    Args:
        fn: ``v(x (M, *shape), sigma (M,), **cond, **model_kwargs) -> (M, *shape)``.
        shape: per-sample state shape.
        dtype: the coupling arithmetic's dtype (outputs are cast to it).
        max_rows: split each call into sub-batches of at most this many rows.
        cond: per-trajectory conditioning, tensors ``(batch, ...)``: each call gets
            the rows of the trajectories its states belong to.
        model_kwargs: passed to every call as they are.
        device: where the NaN flag lives (the states' device).
        group: a ``torch.distributed`` process group to split each call's rows
            over (tree-parallel verification), or ``None``.
        pad_rows: pad each network call's rows up to the next of these sizes
            (ascending ints; a call larger than the largest is split into calls of
            that size), so that a compiled or CUDA-graph model sees few shapes.
            The padding rows repeat the last real row and their outputs are dropped.
        batch: the trajectories (``traj < batch``): with it, the per-row NaN flags of
            more than :data:`FOLD_CALLS` unread calls are folded per trajectory.
        grid: ``(T + 1,)`` the run's noise levels, in the dtype of the ``sigma`` a call is
            given: a NaN error names the step of a level (``None``: the level itself).
    """

    def __init__(
        self,
        fn: Callable,
        shape: tuple,
        dtype: torch.dtype,
        max_rows: Optional[int],
        cond: dict,
        model_kwargs: dict,
        device: "torch.device | str" = "cpu",
        group: Any = None,
        pad_rows: Optional[tuple] = None,
        batch: Optional[int] = None,
        grid: Optional[torch.Tensor] = None,
    ) -> None:
        self.fn, self.shape, self.dtype = fn, shape, dtype
        self.name = model_name(fn)
        # the model's declaration: it reads the time input a chain declares per call (else it maps the level)
        self.takes_timestep = bool(getattr(fn, "takes_timestep", False))
        self.batch, self.grid = batch, grid
        self.group, self.pad_rows = group, pad_rows
        if pad_rows:
            # a call never exceeds the largest padded size
            max_rows = min(max_rows or pad_rows[-1], pad_rows[-1])
        self.max_rows = max_rows
        self.cond, self.kwargs = cond, model_kwargs
        self._rows: dict = {}  # (key, rows) -> the conditioning rows of a named pattern: see cond_rows
        self.seconds = 0.0
        self.calls = 0
        self._events: list = []
        self.bad = torch.zeros((), dtype=torch.long, device=device)  # 1 once some output was NaN or inf
        # where: per call not read yet, (rows' flags (M,), their noise levels (M,), trajectories (M,));
        # and what older calls folded into, per trajectory the highest level it went bad at (-inf: never)
        self._unread: list = []
        self._worst: Optional[torch.Tensor] = None

    def cond_rows(self, traj: torch.Tensor, key: Hashable = None) -> dict:
        """The conditioning of trajectories ``traj (n,)``.

        ``key``, when given, names the pattern of ``traj``: a caller passes the same key only with
        the same trajectories (:data:`ALL_ROWS` for every trajectory in order, say), so their rows
        are gathered once and kept until :meth:`set_rows` gives the trajectories new conditioning.
        A run whose calls evaluate the same trajectories every round (the standard sampler, one
        image's trees) then indexes its conditioning once.
        """
        if key is not None:
            hit = self._rows.get((key, traj.shape[0]))
            if hit is not None:
                return hit
        # conditioning stays on its own device (labels on the CPU next to a CUDA model, say); a
        # Python test of the device costs less than a ``to`` that does nothing
        rows = {k: v[traj if traj.device == v.device else traj.to(v.device)] for k, v in self.cond.items()}
        if key is not None:
            self._rows[key, traj.shape[0]] = rows
        return rows

    def set_rows(self, traj: torch.Tensor, cond: dict) -> None:
        """Replace the conditioning of trajectories ``traj (n,)`` by ``cond`` (one row each), between rounds.

        Continuous batching (:func:`specforest.generate`) gives a finished slot to a new sample.
        """
        if set(cond) != set(self.cond):
            raise ValueError(f"make_cond returned keys {sorted(cond)}, but the first call returned {sorted(self.cond)}")
        self.cond = {
            k: v.index_copy(0, traj.to(v.device), cond[k].to(device=v.device, dtype=v.dtype))
            for k, v in self.cond.items()
        }
        self._rows = {}

    def __call__(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        traj: torch.Tensor,
        rows_key: Hashable = None,
        features: bool = False,
        timestep: Optional[torch.Tensor] = None,
    ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        """Velocities ``(M, D)`` at flattened states ``x (M, D)``, noise levels ``(M,)``, trajectories
        ``(M,)``; ``rows_key`` names the pattern of ``traj`` as in :meth:`cond_rows`; ``timestep``: ``(M,)`` the
        rows' time input where the chain declares it, given to a model that takes it as ``timestep``.

        With ``features``, the model's ``with_features`` is called instead (the protocol of
        ``draft="cached"``, :class:`specforest.drafts.CachedDraft`), and ``(v (M, D), feat
        (M, F))`` is returned: the features travel as extra columns of each row, so chunking,
        padding and the gather of tree-parallel verification treat them as the velocities."""
        timestep = timestep if self.takes_timestep else None
        if self.group is not None:
            v = self._split(x, sigma, traj, features, timestep)
        else:
            v = self._local(x, sigma, traj, rows_key=rows_key, features=features, timestep=timestep)
        if features:
            D = x.shape[1]
            return v[:, :D], v[:, D:]
        return v

    def _split(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        traj: torch.Tensor,
        features: bool = False,
        timestep: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Tree-parallel: this process evaluates its share of the rows; the shares are gathered."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        M = x.shape[0]
        share = -(-M // world)
        x, sigma, traj, timestep = _pad(x, sigma, traj, share * world, timestep)
        mine = slice(rank * share, (rank + 1) * share)
        v = self._local(
            x[mine].contiguous(), sigma[mine], traj[mine], flag=False, features=features,
            timestep=None if timestep is None else timestep[mine],
        )  # fmt: skip
        parts = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(parts, v.contiguous(), group=self.group)
        v = torch.cat(parts)[:M]
        # the flag of the gathered rows only (not the padding): every process raises at once
        self._flag(v[:, : x.shape[1]], sigma[:M], traj[:M])
        return v

    def _local(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        traj: torch.Tensor,
        flag: bool = True,
        rows_key: Hashable = None,
        features: bool = False,
        timestep: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        M, D = x.shape
        chunk = self.max_rows or M
        key = rows_key if chunk >= M else None  # (a chunk's trajectories are a part of the pattern)
        cuda = x.device.type == "cuda"
        outs = []
        for i in range(0, M, chunk):
            xc, sc, tc = (
                (x, sigma, traj) if chunk >= M else (x[i : i + chunk], sigma[i : i + chunk], traj[i : i + chunk])
            )
            kc = timestep if timestep is None or chunk >= M else timestep[i : i + chunk]
            m = xc.shape[0]
            if self.pad_rows:
                xc, sc, tc, kc = _pad(xc, sc, tc, next(p for p in self.pad_rows if p >= m), kc)
            xi = xc.reshape(-1, *self.shape)
            si = sc if sc.dtype == x.dtype else sc.to(x.dtype)
            rows = self.cond_rows(tc, key)
            if kc is not None:
                rows = {**rows, "timestep": kc}
            # only the network call itself is timed: the rest is the sampler's own time
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            with outside_inference():
                if features:
                    out, feat = self.fn.with_features(xi, si, **self.kwargs, **rows)
                else:
                    out = self.fn(xi, si, **self.kwargs, **rows)
            if cuda:
                end.record()
                self._events.append((start, end))
            else:
                self.seconds += time.perf_counter() - t0
            if not isinstance(out, torch.Tensor) or out.shape != xi.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"model must return a tensor of the input's shape {tuple(xi.shape)}, got {got}")
            if not out.is_floating_point():
                # a cast would truncate the velocities silently
                raise TypeError(
                    f"model {self.name!r} returned a {out.dtype} tensor: it must return floating-point velocities"
                )
            # a copy: a CUDA-graph target's next replay overwrites its output buffers
            out = out.reshape(-1, D)
            if features:
                out = torch.cat([out.to(self.dtype), feat.reshape(out.shape[0], -1).to(self.dtype)], 1)
            if self.pad_rows is not None:
                out = out[:m].to(self.dtype, copy=True)
            elif out.dtype != self.dtype:
                out = out.to(self.dtype)
            outs.append(out)
        v = torch.cat(outs) if len(outs) > 1 else outs[0]
        self.calls += 1
        # checked at the round's one host read (``check_finite``): NaN or inf never passes silently
        if flag:
            self._flag(v[:, :D] if features else v, sigma, traj)
        return v

    def _flag(self, v: torch.Tensor, sigma: torch.Tensor, traj: torch.Tensor) -> None:
        """Note on the device which rows of a call's output ``v (M, D)`` are NaN or inf, with their
        levels ``sigma (M,)`` and trajectories ``traj (M,)``: no host read."""
        rows = _not_finite_rows(v)
        self.bad = self.bad | rows.any()
        self._unread.append((rows, sigma, traj))
        if len(self._unread) > FOLD_CALLS and self.batch is not None:
            self._worst = self._folded()
            self._unread = []

    def _folded(self) -> torch.Tensor:
        """``(batch,)`` per trajectory the highest noise level (its earliest step) at which its output
        was NaN or inf, ``-inf`` where never: the record so far with the unread calls folded in."""
        rows, sigma, traj = (torch.cat(t) if len(t) > 1 else t[0] for t in zip(*self._unread, strict=True))
        level = torch.where(rows, sigma, float("-inf"))
        if self._worst is None:
            batch = self.batch if self.batch is not None else int(traj.max()) + 1
            self._worst = torch.full((batch,), float("-inf"), dtype=level.dtype, device=level.device)
        return self._worst.scatter_reduce(0, traj.to(level.device), level.to(self._worst.dtype), "amax")

    def read_clear(self) -> None:
        """The flag was read clear (no call so far returned NaN or inf): forget the unread calls' rows."""
        self._unread = []

    def check_finite(self) -> None:
        """Raise if any call so far returned NaN or inf (a host read)."""
        if bool(self.bad):
            self.raise_not_finite()
        self.read_clear()

    def first_bad(self) -> "tuple[int, float, list]":
        """Where the model's output first went NaN or inf: ``(step, level, rows)``, the step (``-1``
        without a ``grid``) and noise level of the earliest and the trajectories whose output was NaN
        or inf there. Host reads: called only to stop a run."""
        worst = self._folded() if self._unread else self._worst
        level = worst.amax()
        rows = torch.nonzero(worst == level)[:, 0].tolist()
        step = -1 if self.grid is None else int((self.grid.to(level.device) > level.to(self.grid.dtype)).sum())
        return step, float(level), rows

    def raise_not_finite(self) -> None:
        """Stop the run: the model's own output was NaN or inf (where first, and in which rows)."""
        if self._worst is None and not self._unread:
            where = f"within its first {self.calls} calls"
        else:
            step, level, rows = self.first_bad()
            at = f"at noise level {level:.6g}" if step < 0 else f"at step {step} (noise level {level:.6g})"
            shown = ", ".join(map(str, rows[:8])) + (f", ... ({len(rows)} rows)" if len(rows) > 8 else "")
            where = f"{at}, for rows [{shown}] of the batch"
        raise FloatingPointError(
            f"model {self.name!r} returned NaN or inf {where}: the target's own output, not a draft's; "
            "refusing to continue"
        )

    def total_seconds(self) -> float:
        """Time inside target calls so far (on CUDA from events, read once here)."""
        if self._events:
            torch.cuda.synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events = []
        return self.seconds


class outside_inference:  # noqa: N801 (used as a function: ``with outside_inference():``)
    """Run user code (a model, a draft model, a callback) in normal mode, without autograd.

    The sampler's own arithmetic runs under :func:`torch.inference_mode` (its
    small tensor ops dispatch faster there, ``docs/engine.md``); the code it calls
    runs as it would under :func:`torch.no_grad`, so a model that caches tensors
    (rotary tables, say) does not keep inference tensors that would fail later in
    training.

    Entered on every target call: a slotted class that holds the inference-mode
    guard and the grad flag itself, cheaper than ``torch.inference_mode(False)``
    inside ``torch.no_grad()`` inside a generator (timings in ``docs/engine.md``).
    """

    __slots__ = ("_guard", "_grad")

    def __enter__(self) -> None:
        self._grad = torch.is_grad_enabled()
        self._guard = torch._C._InferenceMode(False)
        self._guard.__enter__()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: Any) -> None:
        torch._C._set_grad_enabled(self._grad)
        self._guard.__exit__(*exc)


def _not_finite_rows(v: torch.Tensor) -> torch.Tensor:
    """``(M,)`` bool: some element of row ``v[i]`` is NaN or inf. ``0 * v`` is 0 where ``v`` is finite
    and NaN where not, and a sum of zeros cannot overflow: three ops where ``~isfinite(v).all(1)`` takes
    more."""
    return (v * 0).sum(1).isnan()


def _pad(
    x: torch.Tensor, sigma: torch.Tensor, traj: torch.Tensor, size: int, timestep: Optional[torch.Tensor] = None
) -> tuple:
    """Rows ``x (m, D)``, ``sigma (m,)``, ``traj (m,)`` and their ``timestep (m,)`` (or ``None``) padded to ``size``
    with copies of the last row (finite inputs whose results are dropped)."""
    pad = size - x.shape[0]
    if pad <= 0:
        return x, sigma, traj, timestep
    return (
        torch.cat([x, x[-1:].expand(pad, -1)]),
        torch.cat([sigma, sigma[-1:].expand(pad)]),
        torch.cat([traj, traj[-1:].expand(pad)]),
        None if timestep is None else torch.cat([timestep, timestep[-1:].expand(pad)]),
    )
