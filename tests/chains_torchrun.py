"""Run under ``torchrun`` by ``tests/test_chains_generate.py``: every registered chain through
:func:`specforest.generate` on two processes, data-parallel (each rank its shard, then gathered) and
tree-parallel (the ranks share each verification call), and a chain that declares its calls' time inputs
with a model that takes them (``TIMED``). Rank 0 saves ``{chain}/{mode}`` samples and
NFE to ``argv[1]`` (a ``.pt`` file)."""

from __future__ import annotations

import sys

import torch

from specforest import chains, distributed, generate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from chains_generate_setup import COUNT, TIMED, TimedMixture, config, make_x, model, timed_config  # noqa: E402


def run(name: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    kw, velocity = (timed_config(), TimedMixture()) if name == TIMED else (config(name), model())
    if mode == "tree":
        finished = list(
            generate(velocity, count=COUNT, make_x=make_x, process_group=torch.distributed.group.WORLD, **kw)
        )
    else:
        finished = list(generate(velocity, indices=distributed.shard(COUNT), make_x=make_x, **kw))
    idx = torch.cat([f.index for f in finished]) if finished else torch.zeros(0, dtype=torch.long)
    x = torch.cat([f.samples for f in finished]) if finished else torch.zeros(0, 3, dtype=torch.float64)
    nfe = torch.cat([f.stats.nfe for f in finished]).double() if finished else torch.zeros(0, dtype=torch.float64)
    if mode == "data":
        idx, x = distributed.gather(idx, torch.cat([x, nfe[:, None]], 1))
    else:
        order = idx.argsort()
        idx, x = idx[order], torch.cat([x, nfe[:, None]], 1)[order]
    return x[:, :-1], x[:, -1]


def main() -> None:
    distributed.init_from_env("cpu")
    out = {}
    for name in (*chains.available_chains(), TIMED):
        for mode in ("data", "tree"):
            out[f"{name}/{mode}"] = run(name, mode)
    if distributed.rank() == 0:
        torch.save(out, sys.argv[1])
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
