"""LoRA on the Megatron GPT (aligner/models/lora.py): fresh adapters compute the base bit for bit, only the
adapters train, and a parallel layout (TP=2 with sequence parallelism, PP=2) takes the same three steps
as one process (loss and grad norm within 1e-5), and resumes a LoRA checkpoint saved at TP=1
(adapters and Adam state resharded) to the same next step."""
import json

import pytest
import torch

from aligner.launch.local import launch

LAYOUTS = {
    "tp2_sp": ({"model.tensor_model_parallel_size": 2, "model.sequence_parallel": True}, 2),
    "pp2": ({"model.pipeline_model_parallel_size": 2, "trainer.micro_batch_size": 2}, 2),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lora")
    launch("tests.lora_workers:main", ["reference", str(workdir)], 1)
    return workdir


def test_fresh_adapters_and_what_trains(reference):
    result = torch.load(reference / "reference.pt")
    assert result["fresh_equals_base"]  # bitwise: B = 0 adds exact zeros
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    expected = sorted(f"decoder.layers.{i}.{'self_attention' if t in targets[:2] else 'mlp'}.{t}.lora.{ab}"
                      for i in range(4) for t in targets for ab in "ab")
    assert result["trainable"] == expected
    assert result["with_grad_buffer"] == expected  # the frozen base has no gradient buffer
    assert result["in_optimizer"] == expected  # ... and no optimizer state
    assert result["losses"][2] < result["losses"][0] < result["base_loss"] + 1e-6


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_layout_matches_one_process(reference, name):
    layout, nproc = LAYOUTS[name]
    launch("tests.lora_workers:main", ["parallel", str(reference), json.dumps(layout)], nproc,
           log_dir=reference / f"logs_{name}")
    key = "_".join(f"{k.split('.')[-1]}={v}" for k, v in sorted(layout.items()))
    diff = json.loads((reference / f"diff_{key}.json").read_text())
    print(name, diff)
    assert diff["loss"] < 1e-5 and diff["grad_norm"] < 1e-5
    assert diff["adapters"] < 1e-5
    assert diff["resumed_adapters"] == 0.0  # the TP=1 checkpoint resharded exactly
    assert diff["resumed_step3_loss"] < 1e-5 and diff["resumed_step3_grad_norm"] < 1e-5
    assert diff["resumed_step3_adapters"] < 1e-5
