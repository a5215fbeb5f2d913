"""LoRA on the Megatron GPT (aligner/models/lora.py): fresh adapters compute the base bit for bit, only the
adapters train (no gradient buffer or Adam state for the base), and a parallel layout (TP=2 with sequence
parallelism, PP=2, DP=2 with the distributed optimizer) takes the same three steps as one process (loss
and grad norm within 1e-5), and resumes a LoRA checkpoint saved at TP=1 (adapters and Adam state
resharded) to the same next step."""
import json

import pytest
import torch

from aligner.launch.local import launch

LAYOUTS = {
    "tp2_sp": ({"model.tensor_model_parallel_size": 2, "model.sequence_parallel": True}, 2),
    "pp2": ({"model.pipeline_model_parallel_size": 2, "trainer.micro_batch_size": 2}, 2),
    "dp2_distributed_optimizer": ({"optim.distributed_optimizer": True}, 2),
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
    # the weight stream (TensorRT-LLM's refit, HF export) carries W + (alpha / r) B A: layer 0's q/k/v rows
    from aligner.models.hf_weights import Geometry, to_hf
    from tests.parity_worker import make_config

    m = make_config({})["model"]
    hf = to_hf("decoder.layers.0.self_attention.linear_qkv.weight", result["merged_by_hand"],
               Geometry.of(m, 500, 1))
    for name, tensor in hf.items():
        assert torch.allclose(result["streamed"][name], tensor, atol=1e-6, rtol=0), name


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
    assert ("resumed_adapters" in diff) != ("distributed_optimizer" in name)  # resumes its own kind only
    if "resumed_adapters" in diff:
        assert diff["resumed_adapters"] == 0.0  # the TP=1 checkpoint resharded exactly
        assert diff["resumed_step3_loss"] < 1e-5 and diff["resumed_step3_grad_norm"] < 1e-5
        assert diff["resumed_step3_adapters"] < 1e-5
    assert diff["streamed"] < 1e-5  # the merged weights gathered from this layout's shards


def _tensor_bytes() -> int:
    """Bytes of every tensor alive in this process (storages counted once)."""
    import gc

    seen = {}
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # a fake tensor another test's tracing left behind: no memory of its own
            continue
        except ReferenceError:  # a weakref proxy whose referent died: no tensor at all
            continue
    return sum(seen.values())


def test_the_reference_of_a_lora_run_costs_no_second_copy(monkeypatch):
    """build_reference: reference.mode=model holds a second copy of the weights; cpu_swap copies the policy's own
    to CPU memory and builds no second model (whose weights would sit on the device as they were copied out); with
    adapters, the policy itself with its adapters off (its logits: the base's), and no new tensor bytes."""
    from omegaconf import OmegaConf

    from aligner.algorithms.shared import reference as reference_module
    from aligner.algorithms.shared.reference import build_reference
    from aligner.config.schema import ModelConfig
    from aligner.models import lora
    from tests.conftest import build_single_process_gpt

    gpt = build_single_process_gpt(11)
    weights = sum(p.numel() * p.element_size() for p in gpt.parameters())
    tokens = torch.randint(0, 300, (2, 12))
    positions = torch.arange(12)[None].expand(2, 12)
    gpt.eval()
    with torch.no_grad():
        base = gpt(tokens, positions, None)
    plain = OmegaConf.create({"model": OmegaConf.structured(ModelConfig)})
    before = _tensor_bytes()
    full = build_reference(plain, gpt, 300, None)
    second_copy = _tensor_bytes() - before
    del full
    with monkeypatch.context() as patch:
        patch.setattr(reference_module, "build_policy", lambda *args: pytest.fail("cpu_swap built a second model"))
        swapped = build_reference(plain, gpt, 300, "cpu_swap")
    assert swapped.model is None and all(torch.equal(swapped.weights.tensors[n], p) for n, p in gpt.named_parameters())
    del swapped
    adapted_cfg = OmegaConf.create({"model": OmegaConf.structured(ModelConfig(pretrained="base"))})
    adapted_cfg.model.lora.rank = 4
    lora.add_adapters(gpt, adapted_cfg.model.lora)
    with torch.no_grad():
        for _, adapter in lora.adapters(gpt):
            adapter.b.normal_()
    before = _tensor_bytes()
    reference = build_reference(adapted_cfg, gpt, 300, None)
    extra = _tensor_bytes() - before
    print(f"weights {weights} bytes; reference.mode=model adds {second_copy}, the LoRA reference {extra}")
    assert reference.mode == "adapters" and second_copy >= weights and extra == 0
    with torch.no_grad():
        assert torch.equal(reference.run(lambda model: model(tokens, positions, None)), base)
        assert not torch.equal(gpt(tokens, positions, None), base)  # the adapters are back on after the pass


def test_adapter_dropout_and_the_merged_weight():
    """Dropout on the adapter's input acts in training only; in eval the adapted linear computes
    x (W + (alpha / r) B A)^T, the weight the engine and the HF export take (lora.merged_weight)."""
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from aligner.config.schema import LoraConfig
    from aligner.models import lora
    from tests.conftest import build_single_process_gpt

    gpt = build_single_process_gpt(12)
    lora.add_adapters(gpt, OmegaConf.structured(LoraConfig(rank=4, alpha=8.0, dropout=0.5)))
    fc2 = gpt.decoder.layers[1].mlp.linear_fc2
    with torch.no_grad():
        fc2.lora.b.normal_()
    x = torch.randn(5, 2, fc2.weight.shape[1])
    gpt.train()
    with torch.no_grad():
        first, second = fc2(x)[0], fc2(x)[0]
    assert not torch.equal(first, second)
    gpt.eval()
    with torch.no_grad():
        out = fc2(x)[0]
        assert torch.equal(out, fc2(x)[0])
        assert torch.allclose(out, F.linear(x, lora.merged_weight(fc2)), atol=1e-5, rtol=0)
        with lora.disabled(gpt):
            assert torch.equal(fc2(x)[0], F.linear(x, fc2.weight)) and torch.equal(lora.merged_weight(fc2), fc2.weight)
