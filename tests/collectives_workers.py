"""Rank entry point of tests/integration/test_collectives.py: the collectives module's conventions at world size 2 on
gloo. argv[0]: a directory; rank r writes r.json with what each call returned (the test compares)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist


def conventions(argv: list[str]) -> None:
    from aligner.runtime import collectives
    from aligner.runtime.distributed import init_process_group

    init_process_group(timeout_s=60)
    rank = dist.get_rank()
    out = {}
    with collectives.record() as calls:
        # in place on a non-contiguous view: the module works on a contiguous copy and writes it back
        t = (torch.arange(6.0).view(2, 3) * (rank + 1)).t()
        out["all_reduce_is_input"] = collectives.all_reduce(t) is t
        out["all_reduce"] = t.tolist()
        b = torch.full((3, 2), float(rank)).t()
        out["broadcast_is_input"] = collectives.broadcast(b, src=1) is b
        out["broadcast"] = b.tolist()
        r = torch.tensor([rank + 1.0, 10.0])
        collectives.reduce(r, dst=0, op=collectives.ReduceOp.MAX)
        out["reduce"] = r.tolist() if rank == 0 else None
        out["all_gather"] = [p.tolist() for p in collectives.all_gather(torch.tensor([rank, rank]))]
        out["all_gather_into_tensor"] = collectives.all_gather_into_tensor(torch.tensor([[rank, 7]])).tolist()
        if rank == 0:
            collectives.send(torch.tensor([[1, 2], [3, 4]]).t(), dst=1)
        else:
            box = torch.zeros(2, 2, dtype=torch.long).t()
            out["recv_is_input"] = collectives.recv(box, src=0) is box
            out["recv"] = box.tolist()
        out["broadcast_object"] = collectives.broadcast_object({"from": rank}, src=1)
        out["all_gather_object"] = collectives.all_gather_object(f"rank{rank}")
        out["scatter_object"] = collectives.scatter_object(["a", "b"] if rank == 0 else None, src=0)
        collectives.barrier()
    collectives.all_reduce(torch.zeros(1))  # outside the block: not recorded
    out["calls"] = [[op, list(ranks), shape and [list(shape[0]), shape[1]]] for op, ranks, shape in calls]
    (Path(argv[0]) / f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def lead_works_alone(argv: list[str]) -> None:
    """Rank 0 works alone for twice the process group's timeout, then broadcasts; argv[1] "wait": the other rank
    first waits for it with wait_for_rank (else it waits in the broadcast, which the timeout ends)."""
    import time

    from aligner.runtime import collectives
    from aligner.runtime.distributed import init_process_group

    init_process_group(timeout_s=2)
    rank = dist.get_rank()
    if rank == 0:
        time.sleep(4)
    if argv[1] == "wait":
        collectives.wait_for_rank(0)
    got = collectives.broadcast_object({"from": rank}, src=0)
    (Path(argv[0]) / f"{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()
