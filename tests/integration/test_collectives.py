"""Every collective goes through aligner/runtime/collectives.py, which puts tensors on the group's
device: an AST scan of the package, the device rule, and the module's conventions at world size 2 (gloo)."""
import ast
import json
from pathlib import Path

import pytest

from aligner.runtime import collectives

PACKAGE = Path(__file__).resolve().parents[2] / "aligner"
COLLECTIVES = {
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
    "gather_object", "scatter_object_list", "send_object_list", "recv_object_list",
}


def direct_calls(source: str) -> list[str]:
    """`torch.distributed` collectives a module reaches without the collectives module: calls through
    any alias of torch.distributed, and collectives imported by name from it."""
    tree = ast.parse(source)
    aliases, named = {"torch.distributed"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            named += [f"line {node.lineno}: from torch.distributed import {a.name}" for a in node.names
                      if a.name in COLLECTIVES]
    calls = [f"line {node.lineno}: {ast.unparse(node.func)}" for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
             and ast.unparse(node.func.value) in aliases]
    return named + calls


def test_the_scan_finds_each_way_of_calling_a_collective():
    source = ("import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
              "from torch.distributed import all_reduce\n"
              "dist.all_reduce(t)\ntorch.distributed.broadcast(t, 0)\nd2.barrier()\ndist.get_rank()\n")
    assert direct_calls(source) == ["line 4: from torch.distributed import all_reduce", "line 5: dist.all_reduce",
                                    "line 6: torch.distributed.broadcast", "line 7: d2.barrier"]


def test_no_module_calls_a_collective_directly():
    found = {str(p.relative_to(PACKAGE)): direct_calls(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))
             if p.relative_to(PACKAGE) != Path("runtime/collectives.py")}
    assert {name: calls for name, calls in found.items() if calls} == {}


@pytest.mark.parametrize("backend, kind", [("gloo", "cpu"), ("nccl", "cuda"), ("cuda:nccl", "cuda"),
                                           ("cpu:gloo", "cpu"), ("cpu:gloo,cuda:nccl", None)])
def test_the_device_of_a_backend(backend, kind):
    assert collectives.device_kind(backend) == kind


def test_conventions_at_world_size_2(tmp_path):
    from aligner.launch.local import launch

    launch("tests.collectives_workers:conventions", [str(tmp_path)], 2, log_dir=tmp_path / "logs")
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):  # in-place results land in the caller's (non-contiguous) tensor, which is returned
        assert r["all_reduce_is_input"] and r["all_reduce"] == [[0.0, 9.0], [3.0, 12.0], [6.0, 15.0]]
        assert r["broadcast_is_input"] and r["broadcast"] == [[1.0] * 3] * 2
        assert r["all_gather"] == [[0, 0], [1, 1]] and r["all_gather_into_tensor"] == [[0, 7], [1, 7]]
        assert r["broadcast_object"] == {"from": 1} and r["all_gather_object"] == ["rank0", "rank1"]
    assert r0["reduce"] == [2.0, 10.0] and r1["recv_is_input"] and r1["recv"] == [[1, 3], [2, 4]]
    assert (r0["scatter_object"], r1["scatter_object"]) == ("a", "b")
    both = [0, 1]
    assert r0["calls"] == [
        ["all_reduce", both, [[3, 2], "torch.float32"]], ["broadcast", both, [[2, 3], "torch.float32"]],
        ["reduce", both, [[2], "torch.float32"]], ["all_gather", both, [[2], "torch.int64"]],
        ["all_gather_into_tensor", both, [[1, 2], "torch.int64"]], ["send", both, [[2, 2], "torch.int64"]],
        ["broadcast_object", both, None], ["all_gather_object", both, None], ["scatter_object", both, None],
        ["barrier", both, None]]
    assert r1["calls"][5] == ["recv", both, [[2, 2], "torch.int64"]]


def test_a_rank_waits_for_a_lead_working_alone_longer_than_the_groups_timeout(tmp_path):
    """Rank 0 generating for the job or awaiting rollout workers: the others wait in the store
    (collectives.wait_for_rank), as a collective waiting that long is ended by the group's timeout (gloo raises;
    NCCL's watchdog aborts the job), then take the broadcast."""
    from aligner.launch.local import launch

    launch("tests.collectives_workers:lead_works_alone", [str(tmp_path), "wait"], 2, log_dir=tmp_path / "logs")
    assert [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)] == [{"from": 0}] * 2
