"""Every parallel dimension against a single-process run of the same weights and batch.

Tolerances (fp32, CPU): logits and loss 1e-5, gradients 1e-4, parameters after two Adam steps 1e-4.
Each layout is one launch of tests/parity_worker.py; the reference runs once per session.
"""
import json

import pytest

from aligner.launch.local import launch

LAYOUTS = {
    "tp2": ({"model.tensor_model_parallel_size": 2}, 2),
    "tp2_sp": ({"model.tensor_model_parallel_size": 2, "model.sequence_parallel": True}, 2),
    "pp2_1f1b": ({"model.pipeline_model_parallel_size": 2, "trainer.micro_batch_size": 2}, 2),
    "cp2": ({"model.context_parallel_size": 2}, 2),
    "dp2": ({}, 2),
    "dp2_distributed_optimizer": ({"optim.distributed_optimizer": True}, 2),
    "tp2_pp2": ({"model.tensor_model_parallel_size": 2, "model.pipeline_model_parallel_size": 2,
                 "trainer.micro_batch_size": 2}, 4),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("parity")
    launch("tests.parity_worker:main", ["reference", str(workdir)], 1)
    return workdir


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_single_process(reference, name):
    from tests.parity_worker import layout_name

    layout, nproc = LAYOUTS[name]
    launch("tests.parity_worker:main", ["parallel", str(reference), json.dumps(layout)], nproc,
           log_dir=reference / f"logs_{name}")
    diff = json.loads((reference / f"diff_{layout_name(layout)}.json").read_text())
    print(name, diff)
    assert diff["loss"] < 1e-5
    assert diff["logits"] < 1e-5
    assert diff.get("grads", 0.0) < 1e-4  # absent under the distributed optimizer (sharded grads)
    assert ("grads" in diff) != ("distributed_optimizer" in name)
    assert diff["params"] < 1e-4
