"""Every collective goes through aligner/runtime/collectives.py, which puts tensors on the group's
device: an AST scan of the package, the device rule, and the module's conventions in a world of one."""
import ast
from pathlib import Path

import pytest
import torch

from aligner.runtime import collectives
from tests.conftest import init_single_process

PACKAGE = Path(__file__).resolve().parents[1] / "aligner"
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


def test_conventions_in_a_world_of_one():
    init_single_process()
    t = torch.tensor([1.0, 2.0])
    with collectives.record() as calls:
        assert collectives.all_reduce(t) is t  # in place, the caller's tensor returned
        assert torch.equal(collectives.all_gather_into_tensor(torch.ones(2, 3)), torch.ones(2, 3))
        parts = collectives.all_gather(torch.arange(3))
        assert len(parts) == 1 and torch.equal(parts[0], torch.arange(3))
        assert collectives.broadcast_object({"a": 1}, src=0) == {"a": 1}
        assert collectives.all_gather_object("x") == ["x"]
        assert collectives.scatter_object(["only"], src=0) == "only"
    assert [(op, ranks) for op, ranks, _ in calls] == [
        ("all_reduce", (0,)), ("all_gather_into_tensor", (0,)), ("all_gather", (0,)), ("broadcast_object", (0,)),
        ("all_gather_object", (0,)), ("scatter_object", (0,))]
    assert calls[0][2] == ((2,), "torch.float32")
    collectives.all_reduce(t)
    assert len(calls) == 6  # nothing is recorded outside the block
