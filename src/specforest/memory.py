"""One memory model for every command: what a run holds, and how to split it to fit.

The limit bounds the whole process's peak: on a CPU its resident set (what the
kernel kills on), on CUDA the memory PyTorch allocates on the device. What the
process holds when the run is sized (the interpreter, torch, the model's
weights, the text embeddings) is the run's ``fixed_bytes`` (:func:`held_bytes`);
the default limit (:func:`default_memory_limit`) is 50% of physical RAM on a
CPU, which that baseline counts toward, and the free memory of a CUDA device,
which already excludes it.

On top of that baseline a run holds, per trajectory, what a round of its tree
needs at its peak, and per target row what the model needs inside its call.
Both figures were measured, not guessed: ``benchmarks/memory.py`` reproduces
the measurements behind the constants below (live tensor bytes of a round,
bytes per model row, and every command's peak against its estimate):

* **A full round** (all nodes drafted, then one target call, then the walk)
  peaks inside the walk's rank-1 reduction over every verification problem at
  once, and just before it in the draft's random numbers (made as int64 words
  and float64 uniforms, 24 bytes per element beyond their float32 result).
  Measured live tensor bytes of one trajectory: ``D x w x (6 V + 5 V_i)`` for
  ``V`` realized nodes and ``V_i`` nodes above the last layer (``w`` the
  working dtype's size, 4 for float32), plus one state per evaluated row when
  the rows are gathered for the call, plus ``x``, the prefetched pair and the
  counters (``8`` states), plus the round's int64 node keys (8 bytes a node,
  in both modes); per run, the tree's tables (160 bytes a node).
* **A lazy round** (the cost simulation) draws the children of the visited node
  at each depth: ``D x w x (7 K_max + 8)`` per trajectory (the noise of the
  ``K_max`` children is made like the full tree's, 28 bytes an element).
* **Inside the target call** every row adds the model's own work: a model
  declares it with a ``row_bytes`` attribute (an int) or method
  (``row_bytes(x_row, **cond_row) -> int``, given one row as the model would be
  called with it), read by :func:`row_bytes_of`. The shipped models declare
  measured figures (:class:`~specforest.models.GaussianMixture`: ``(2 D + 7 C) w``;
  the digits U-Net: 136 kB a float32 row; the SD3 transformer adapter:
  :func:`specforest.diffusers.transformer_row_bytes`). A model that declares
  nothing is counted at :data:`DEFAULT_ROW_STATES` states a row.
* **What a run holds whole** (:class:`Held`), whatever its chunking: a model's parameters, the
  initial states of every trajectory, the samples and statistics it returns
  (:func:`returned_bytes`). A caller lists them with the options that size them; they count as
  fixed bytes, and where they alone do not fit, the run is refused naming those options
  (:func:`check_held`).
* **Tree-parallel verification** (``world`` processes) gathers every row's
  velocity on every process: three more states a row; each process's model
  call holds its share of the rows.
* **Allocator slack** (:func:`allocator_slack`): glibc serves blocks under
  32 MiB from its heap, which a round of smaller trees fragments; measured
  resident sets reach up to twice the live tensor bytes while a round's tensors
  are that small, and 3-10% above them once they are mapped on their own. The
  estimate adds 10% of the dynamic bytes plus up to :data:`HEAP_SLACK_BYTES`
  (the dynamic bytes again while they are below it). On CUDA: 10%.

:func:`estimate` turns that into the two knobs the sampler has: how many
trajectories run together (``chunk``; chunks run one after another) and how
many rows one network call may hold (``max_rows``; the sub-batches of one call
still count as one NFE). With per-sample random streams neither knob changes a
sample. A run that does not fit even at one trajectory and one row (or, where
the batch cannot be split, at all its trajectories) stops with a
:class:`MemoryError` that gives the estimate, the limit, where the limit comes
from and what to change, before anything is allocated for sampling.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .carried import Carried
from .drafting import remembers_chain, runs_full
from .drafts import get_proposal
from .held import Held, check_held
from .stages import Stages
from .trees import DraftTree, TreePolicy
from .validation import check_int

__all__ = [
    "DEFAULT_ROW_STATES",
    "HEAP_SLACK_BYTES",
    "Held",
    "MemoryEstimate",
    "allocator_slack",
    "chain_shape",
    "check_held",
    "default_memory_limit",
    "estimate",
    "held_bytes",
    "physical_memory",
    "resolve_limit",
    "returned_bytes",
    "row_bytes_of",
    "run_shape",
    "tree_footprint",
]

_F32 = 4
# live states of one trajectory in a full round (measured, see the module docstring)
_NODE_STATES = 6  # per realized node
_INNER_STATES = 5  # per node above the last layer (a verification problem)
_ROW_STATES = 1  # per evaluated row, gathered for the call
_LAZY_CHILD_STATES = 7  # per child drawn in a lazy round (28 bytes an element in float32)
# per trajectory, beyond the tree: x, the prefetched (state, velocity) pair, its history, counters
_SCRATCH_STATES = 8
# per trajectory and tree node, whatever the mode: the round's int64 node keys
_KEY_BYTES = 8
# per run and tree node: the tree's tables (node steps, noise levels, scales, masks per lookahead),
# measured at 140 bytes a node on a (6, 6) tree
_TABLE_BYTES = 160
# a draft's memory at the round's commit: the memory the round drafted with (its observe reads it),
# the group's new part, and the copy DraftMemory.put makes of the whole with that part in place
_MEMORY_COPIES = 3
# tree-parallel: the padded rows, the gathered shares and their concatenation
_SPLIT_ROW_STATES = 3
DEFAULT_ROW_STATES = 4
"""States of the working dtype one row adds inside the call of a model that declares no
``row_bytes``: the cast input, the output and two temporaries (a model with larger activations
must declare its own figure)."""
HEAP_SLACK_BYTES = 256 * 2**20
"""Most bytes of heap fragmentation counted on a CPU (see :func:`allocator_slack`)."""
_SLACK_FRACTION = 0.10
# fraction of physical RAM assumed free on devices whose free memory is not known
_RAM_FRACTION = 0.5
_RAM_UNKNOWN_BYTES = 8 * 10**9


def held_bytes(device: Union[str, torch.device] = "cpu") -> int:
    """Bytes the process holds now on ``device``: a run's ``fixed_bytes``.

    CPU: the resident set (``/proc/self/statm``, else ``psutil``, else 0). CUDA:
    the memory PyTorch has allocated on the device.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device)) if torch.cuda.is_available() else 0
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil
    except ImportError:
        return 0
    return int(psutil.Process().memory_info().rss)


def allocator_slack(dynamic_bytes: int, device: Union[str, torch.device] = "cpu") -> int:
    """Bytes the allocator holds beyond ``dynamic_bytes`` of live tensors at a run's peak.

    CPU (glibc): 10% plus ``min(dynamic_bytes, HEAP_SLACK_BYTES)``: blocks under
    32 MiB come from the heap, and rounds of trees of different sizes fragment it
    (resident sets measured at up to twice the live bytes while the tensors are
    that small); larger blocks are mapped and unmapped whole. CUDA: 10% (the
    caching allocator's rounding; the limit is compared with allocated memory).
    """
    d = max(int(dynamic_bytes), 0)
    slack = _SLACK_FRACTION * d
    if torch.device(device).type != "cuda":
        slack += min(d, HEAP_SLACK_BYTES)
    return int(math.ceil(slack))


def _dynamic_room(room: int, device: Union[str, torch.device]) -> int:
    """The most dynamic bytes ``d`` with ``d + allocator_slack(d) <= room``."""
    if room <= 0:
        return 0
    if torch.device(device).type == "cuda":
        return int(room / (1 + _SLACK_FRACTION))
    small = room / (2 + _SLACK_FRACTION)
    if small <= HEAP_SLACK_BYTES:
        return int(small)
    return int((room - HEAP_SLACK_BYTES) / (1 + _SLACK_FRACTION))


def row_bytes_of(model: Any, x_row: torch.Tensor, cond_row: Optional[dict] = None) -> Optional[int]:
    """What ``model`` declares one row costs inside its call, or ``None`` if it declares nothing.

    Args:
        model: the target velocity; its ``row_bytes`` is an int, ``None``, or a
            method ``row_bytes(x_row, **cond_row) -> int | None``.
        x_row: ``(1, *shape)`` one state as the model is called with it.
        cond_row: one row of the per-trajectory conditioning (tensors ``(1, ...)``).

    Raises:
        TypeError / ValueError: if the declaration is not a non-negative int.
    """
    decl = getattr(model, "row_bytes", None)
    if decl is None:
        return None
    value = decl(x_row, **(cond_row or {})) if callable(decl) else decl
    if value is None:
        return None
    return check_int("model.row_bytes", value, 0)


def resolve_limit(
    memory_gb: Optional[float], device: Union[str, torch.device] = "cpu", name: str = "memory_gb"
) -> tuple[int, str, int]:
    """The limit of a run, where it comes from, and what the process holds against it now.

    Args:
        memory_gb: the user's limit in GB, or ``None`` for :func:`default_memory_limit`.
        device: where the run happens.
        name: the option's name, for messages (``--memory-gb``, ``max_memory_gb``).

    Returns:
        ``(limit_bytes, source, fixed_bytes)``: a given limit bounds the whole
        process, so ``fixed_bytes`` is :func:`held_bytes`; the default on CUDA
        (the free memory now) already excludes what is held, so it is 0 there.
    """
    device = torch.device(device)
    if memory_gb is not None:
        return int(memory_gb * 1e9), f"{name}={memory_gb:g}", held_bytes(device)
    limit, source = default_memory_limit(device)
    fixed = 0 if device.type == "cuda" and torch.cuda.is_available() else held_bytes(device)
    return limit, source, fixed


def default_memory_limit(device: Union[str, torch.device] = "cpu") -> tuple[int, str]:
    """Bytes available for sampling on ``device`` and where the figure comes from.

    CUDA: the device's free memory now (after the model was loaded). Other
    devices: 50% of physical RAM (8 GB where it cannot be read).

    Returns:
        ``(limit_bytes, source)``, ``source`` a phrase for messages.
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    total = physical_memory()
    if total is None:
        return _RAM_UNKNOWN_BYTES, "default of 8 GB (physical memory unknown)"
    return int(_RAM_FRACTION * total), "50% of physical RAM"


def physical_memory() -> Optional[int]:
    """Bytes of physical RAM of the machine, or ``None`` where they cannot be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return int(total) if total > 0 else None


def returned_bytes(
    trajectories: int, state_numel: int, tree: "DraftTree | TreePolicy | None", *, steps: int, work_bytes: int = _F32
) -> int:
    """Bytes of what :func:`specforest.sample` returns for ``trajectories``: the samples and their
    :class:`~specforest.SampleStats` (four ``(n,)`` counters and four ``(n, L)`` ones of 8 bytes,
    ``L`` the deepest round of ``tree`` on a grid of ``steps``).

    Args:
        trajectories: trajectories of the run.
        state_numel: elements ``D`` of one state.
        tree: the run's tree, tree policy or ``None``.
        steps: grid steps ``T`` (a policy's rounds are at most that deep).
        work_bytes: element size of the samples' dtype.
    """
    if tree is None:
        depth = 0
    elif isinstance(tree, DraftTree):
        depth = tree.L
    else:
        depth = max(min(int(tree.max_depth), int(steps)), int(tree.initial.L))
    return int(trajectories) * (int(state_numel) * int(work_bytes) + 8 * (5 + 4 * depth))


def tree_footprint(
    tree: "DraftTree | TreePolicy | None", *, verify: str = "internal", lazy: bool = False, steps: Optional[int] = None
) -> tuple[int, int]:
    """``(nodes, rows)`` one trajectory holds in a round: realized states and target rows per call.

    Args:
        tree: a :class:`~specforest.trees.DraftTree`, a tree policy with a
            ``budget`` (e.g. :class:`~specforest.planning.AdaptiveTree`: any plan
            has at most ``budget + 1`` nodes) or ``None`` (the standard sampler).
        verify: ``internal`` or ``drafted`` (which nodes a full round evaluates).
        lazy: the cost simulation (one row per call, the children of one node per depth).
        steps: grid steps ``T``; a round is at most ``T`` deep.
    """
    nodes, _, rows, _, _ = _counts(tree, verify, lazy, steps)
    return nodes, rows


def _depth(tree: Any, steps: Optional[int]) -> int:
    """The deepest round of ``tree`` (a :class:`DraftTree`, or a policy's ``max_depth``, default its
    budget), capped at ``steps``: a round never drafts past the grid."""
    depth = tree.L if isinstance(tree, DraftTree) else int(getattr(tree, "max_depth", tree.budget))
    return depth if steps is None else min(depth, max(steps, 1))


def _counts(tree: Any, verify: str, lazy: bool, steps: Optional[int]) -> tuple[int, int, int, int, int]:
    """``(nodes, inner, rows, children, size)``: realized nodes, nodes above the last layer (full
    rounds), target rows per call, children drawn at once per trajectory, and the tree's nodes
    (whose keys and tables every round holds, lazy or not)."""
    if tree is None:
        return 1, 0, 1, 0, 1
    depth = _depth(tree, steps)
    if not isinstance(tree, DraftTree):
        budget = int(tree.budget)
        kmax = int(getattr(tree, "kmax", budget))
        if lazy:
            return 1 + kmax * depth, 0, 1, kmax, budget + 1
        return budget + 1, budget, budget + 1, budget, budget + 1
    t = tree.truncate(depth)
    if lazy:
        return 1 + t.max_children * depth, 0, 1, t.max_children, t.size
    return t.size, t.size_at_depth(depth - 1), t.verification_budget(verify), t.size - 1, t.size


@dataclass(frozen=True)
class MemoryEstimate:
    """What a run holds in memory, estimated before it starts. Sizes in bytes.

    Attributes:
        trajectories: trajectories of the run (its batch).
        state_numel: elements of one state ``D``.
        nodes: realized states per trajectory in a round.
        rows: target rows per trajectory and call (before guidance branches).
        trajectory_bytes: what one trajectory holds at a round's peak, outside
            the model's call (see the module docstring) plus its own conditioning.
        row_bytes: peak bytes one row adds inside a target call.
        fixed_bytes: bytes held whatever the batch: the process's baseline given
            to :func:`estimate` and the tree's tables.
        chunk: trajectories run together (``trajectories``: one chunk).
        max_rows: rows per target sub-batch (``None``: a whole call at once).
        limit_bytes: the memory limit.
        limit_source: where the limit comes from.
        world: processes sharing each call's rows (tree-parallel verification).
        device_type: ``cpu`` or ``cuda`` (the allocator slack differs).
        row_source: where ``row_bytes`` comes from (the model's declaration, the caller, a default).
    """

    trajectories: int
    state_numel: int
    nodes: int
    rows: int
    trajectory_bytes: int
    row_bytes: int
    fixed_bytes: int
    chunk: int
    max_rows: Optional[int]
    limit_bytes: int
    limit_source: str
    world: int = 1
    device_type: str = "cpu"
    row_source: str = "given"

    @property
    def chunks(self) -> int:
        """Chunks of trajectories run one after another."""
        return math.ceil(self.trajectories / self.chunk)

    @property
    def rows_per_call(self) -> int:
        """Target rows of a full call of one chunk."""
        return self.chunk * self.rows

    @property
    def sampler_bytes(self) -> int:
        """What the sampler holds for one chunk at a round's peak."""
        return self.chunk * self.trajectory_bytes

    @property
    def call_rows(self) -> int:
        """Rows one process's network call holds at once: its share of a call, at most ``max_rows``."""
        share = math.ceil(self.rows_per_call / self.world)
        return share if self.max_rows is None else min(self.max_rows, share)

    @property
    def dynamic_bytes(self) -> int:
        """Live tensor bytes of the run at its peak: the chunk's sampler bytes and one sub-batch of rows."""
        return self.sampler_bytes + self.call_rows * self.row_bytes

    @property
    def slack_bytes(self) -> int:
        """The allocator's share beyond the live bytes (:func:`allocator_slack`)."""
        return allocator_slack(self.dynamic_bytes, self.device_type)

    @property
    def total_bytes(self) -> int:
        """Estimated peak of the process: fixed bytes, the dynamic bytes and the allocator slack."""
        return self.fixed_bytes + self.dynamic_bytes + self.slack_bytes

    def describe(self) -> str:
        """One line for logs."""
        gb = 1e9
        calls = "whole calls" if self.max_rows is None else f"sub-batches of {self.max_rows} rows"
        return (
            f"memory: {self.chunks} chunk(s) of <= {self.chunk} trajectories x {self.nodes} states x "
            f"{self.state_numel} elements; sampler {self.sampler_bytes / gb:.3g} GB, "
            f"{self.row_bytes / 1e6:.3g} MB per target row ({self.row_source}) in {calls}, "
            f"{self.fixed_bytes / gb:.3g} GB fixed (held before, tree tables), {self.slack_bytes / gb:.3g} GB allocator slack; "
            f"peak ~{self.total_bytes / gb:.3g} GB of {self.limit_bytes / gb:.3g} GB ({self.limit_source})"
        )


def run_shape(options: Any) -> dict:
    """What a run's options decide of its memory, as :func:`estimate`'s keywords: ``tree``, ``verify``,
    ``lazy``, ``draft``, ``steps`` (its grid's), ``history`` and ``stages`` (its chain's declarations).

    ``options``: the run's :class:`~specforest.options.SamplerOptions` (an option that changes what a
    run holds is read here, so every caller sizes its runs with it).
    """
    from .options import options_sde

    o = options
    chain = options_sde(o)
    return {
        "tree": o.tree,
        "verify": o.verify,
        "lazy": o.lazy,
        "draft": o.draft,
        "steps": len(chain.sigmas) - 1,
        **chain_shape(chain),
    }


def chain_shape(chain: Any) -> dict:
    """What a chain declares of a run's memory, as :func:`estimate`'s keywords ``history`` and ``stages``.

    ``chain``: the run's :class:`~specforest.sde.GaussianChain` (its tables, e.g.
    :func:`~specforest.options.options_sde` of the run's options).
    """
    return {"history": chain.history, "stages": chain.stages}


def estimate(
    *,
    trajectories: int,
    state_numel: int,
    tree: "DraftTree | TreePolicy | None",
    verify: str = "internal",
    lazy: bool = False,
    steps: Optional[int] = None,
    row_bytes: Optional[int] = None,
    cond_bytes: int = 0,
    fixed_bytes: int = 0,
    limit_bytes: Optional[int] = None,
    limit_source: str = "given limit",
    device: Union[str, torch.device] = "cpu",
    chunked: bool = True,
    model: Any = None,
    x_row: Optional[torch.Tensor] = None,
    cond_row: Optional[dict] = None,
    work_bytes: int = _F32,
    world: int = 1,
    draft: Any = None,
    held: Sequence[Held] = (),
    history: int,
    stages: int,
) -> MemoryEstimate:
    """Estimate a run's memory and choose ``chunk`` and ``max_rows`` so it fits.

    With ``chunked``, the trajectories run in balanced chunks, each as large as
    fits with its whole target calls; where not even one trajectory's whole call
    fits, one trajectory at a time with its calls split into sub-batches. Without
    ``chunked`` all trajectories run together and only the calls are split. "Fits": :attr:`MemoryEstimate.total_bytes` (fixed
    bytes, live bytes and the allocator slack) is at most ``limit_bytes``.

    Args:
        trajectories: trajectories of the run (its batch), ``>= 1``.
        state_numel: elements ``D`` of one state.
        tree: the run's tree (see :func:`tree_footprint`).
        verify, lazy, steps: as in :func:`specforest.sample`.
        row_bytes: peak bytes one row adds inside a target call; default: the
            ``model``'s declaration (:func:`row_bytes_of`), else
            :data:`DEFAULT_ROW_STATES` states of ``work_bytes``.
        cond_bytes: bytes of one trajectory's conditioning.
        fixed_bytes: bytes held whatever the batch (the process's baseline,
            :func:`held_bytes`; :func:`resolve_limit` gives it with the limit).
        limit_bytes: the limit (default: :func:`default_memory_limit` of ``device``).
        limit_source: where ``limit_bytes`` comes from (for messages).
        device: where the run happens (for the default limit and the allocator slack).
        chunked: allow running trajectories in chunks; if ``False`` all must fit at once.
        model: the target, read for its ``row_bytes`` declaration when ``row_bytes`` is not given.
        x_row: ``(1, *shape)`` one state as the model sees it (default: ``(1, D)`` float32).
        cond_row: one row of the conditioning, passed to a ``row_bytes`` method.
        work_bytes: element size of the sampler's working dtype (4: float32, 8: float64).
        world: processes of tree-parallel verification (each holds the whole tree
            and its share of every call's rows).
        draft: the run's draft (a name or a proposal; default: one that keeps nothing between
            rounds). One that remembers the last chain round
            (:func:`~specforest.drafting.remembers_chain`) runs full and keeps one state per
            chain node and trajectory (two where it :attr:`~specforest.drafts.Proposal.uses_states`,
            one more where it :attr:`~specforest.drafts.Proposal.keeps_pairs`),
            and the deep features of those nodes (twice where it keeps pairs) and of every evaluated
            row where it :attr:`~specforest.drafts.Proposal.uses_features` (``model.feature_numel`` of them).
            What it keeps is counted three times: at the round's commit the memory the round drafted
            with (its ``observe`` reads it), the group's new part and the copy
            :meth:`~specforest.drafts.DraftMemory.put` makes are held together.
        history: how many past predictions the chain's mean reads (its declaration, required: a
            caller that sizes a run reads it from the run's chain, :func:`chain_shape`;
            :attr:`~specforest.sde.GaussianChain.history`): the run
            keeps that many more states per trajectory, and a full round the predictions and carried
            predictions of its inner nodes (:meth:`~specforest.carried.Carried.held_states`).
        stages: how many model calls a step makes (its chain's declaration, required as ``history``;
            :attr:`~specforest.sde.GaussianChain.stages`): while a call's later stages run, each row
            holds its earlier stages' predictions and its stage point (:meth:`~specforest.stages.Stages.held_states`).
        held: what the run holds whole whatever its chunking (:class:`Held`), counted with
            ``fixed_bytes`` and checked first (:func:`check_held`, where the process alone is within
            the limit), before the model's declaration is read.

    Returns:
        A :class:`MemoryEstimate` (its ``fixed_bytes`` include ``held``).

    Raises:
        MemoryError: if ``held`` does not fit (naming the options that size it), or one trajectory
            and one row do not (or, with ``chunked=False``, all trajectories and one row); the
            message gives the estimate, the limit, where it comes from and what to change.
    """
    device = torch.device(device)
    if limit_bytes is None:
        limit_bytes, limit_source = default_memory_limit(device)
    kept = sum(int(h.nbytes) for h in held)
    if int(fixed_bytes) < int(limit_bytes):
        # where the process alone is over the limit, what the run holds whole is not what to lower:
        # the refusal below says so with everything else
        check_held(held, limit_bytes=limit_bytes, limit_source=limit_source, fixed_bytes=fixed_bytes)
    remembered = gains = 0
    if draft is not None and remembers_chain(prop := get_proposal(draft), tree):
        # the run goes full and keeps a state per node of its deepest chain (and the node's
        # state beside its prediction where the draft reads it, plus two float64 gains per step)
        lazy = False
        remembered = _depth(tree, steps) * ((2 if prop.uses_states else 1) + (1 if prop.keeps_pairs else 0))
        remembered *= _MEMORY_COPIES
        gains = 2 * 8 * int(steps or 0) if prop.uses_states else 0
    elif draft is not None and runs_full(prop, tree):
        # Picard sweeps: the run goes full, and a sweep holds the parents' evaluations and the
        # redrafted chain beside the last one (two states a node)
        lazy = False
        remembered = 2 * (_depth(tree, steps) + 1)
    nodes, inner, rows, children, size = _counts(tree, verify, lazy, steps)
    D, w, world = int(state_numel), int(work_bytes), max(int(world), 1)
    row_source = "given"
    if row_bytes is None and model is not None:
        x = torch.zeros(1, D) if x_row is None else x_row
        row_bytes = row_bytes_of(model, x, cond_row)
        row_source = f"declared by {type(model).__name__}"
    if row_bytes is None:
        row_bytes = DEFAULT_ROW_STATES * D * w
        row_source = "default"
    row = int(row_bytes)
    if lazy:
        states = _LAZY_CHILD_STATES * children + _SCRATCH_STATES
    else:
        states = _NODE_STATES * nodes + _INNER_STATES * inner + _ROW_STATES * rows + _SCRATCH_STATES
    states += remembered
    states += Carried.held_states(check_int("history", history, 0), inner, lazy)
    states += Stages.held_states(check_int("stages", stages, 1), rows)
    if world > 1:
        states += _SPLIT_ROW_STATES * rows
    per = D * w * states + _KEY_BYTES * size + int(cond_bytes) + gains
    if remembered and prop.uses_features and callable(getattr(model, "feature_numel", None)):
        # the cached self-draft: every evaluated row's deep features come back beside its velocity
        # (the call's output and the round's per-node copy), and each remembered node keeps its own
        # (and its pair's, for a draft that keeps pairs), one set a stage, in _MEMORY_COPIES copies
        F = int(model.feature_numel(tuple(x_row.shape[1:]) if x_row is not None else (D,))) * stages
        kept = _MEMORY_COPIES * _depth(tree, steps) * (2 if prop.keeps_pairs else 1)
        per += (kept + 2 * rows) * F * w
    tables = _TABLE_BYTES * size if tree is not None else 0
    fixed_bytes = int(fixed_bytes) + kept + tables
    room = _dynamic_room(int(limit_bytes) - fixed_bytes, device)
    need = trajectories if not chunked else 1
    if room < need * per + row:
        gb = 1e9
        dyn = need * per + row
        total = int(fixed_bytes) + dyn + allocator_slack(dyn, device)
        raise MemoryError(
            f"this run does not fit the memory limit of {limit_bytes / gb:.3g} GB ({limit_source}): it needs about "
            f"{total / gb:.3g} GB: {need} trajectory(ies) x {nodes} states x {D} elements hold {need * per / gb:.3g} GB "
            f"at a round's peak, one target row needs about {row / gb:.3g} GB, the allocator's slack "
            f"{allocator_slack(dyn, device) / gb:.3g} GB, and the process already holds {fixed_bytes / gb:.3g} GB"
            + (f" (with what the run holds whole: {'; '.join(h.describe() for h in held)})" if held else "")
            + ". Use a smaller tree (K, L or budget), fewer trajectories, verify='internal', lazy=True (--lazy), "
            "or raise the memory limit"
        )
    # with chunking, a chunk is as large as fits with its whole calls (fewer, fuller network
    # calls); only where one trajectory's whole call does not fit are the calls split
    whole = per + math.ceil(rows / world) * row
    fit = room // whole if chunked else 0
    if fit < 1:
        fit = (room - row) // per
    chunk = trajectories
    if fit < trajectories:
        parts = math.ceil(trajectories / fit)
        chunk = math.ceil(trajectories / parts)
    share = math.ceil(chunk * rows / world)
    rows_fit = (room - chunk * per) // row if row else share
    max_rows = None if rows_fit >= share else int(rows_fit)
    return MemoryEstimate(
        trajectories=int(trajectories),
        state_numel=D,
        nodes=nodes,
        rows=rows,
        trajectory_bytes=per,
        row_bytes=row,
        fixed_bytes=fixed_bytes,
        chunk=chunk,
        max_rows=max_rows,
        limit_bytes=int(limit_bytes),
        limit_source=limit_source,
        world=world,
        device_type=device.type,
        row_source=row_source,
    )
