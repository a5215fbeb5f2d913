"""LoRA checkpoints <-> PEFT adapters (aligner/models/lora_peft.py, `aligner convert ... --lora`): a LoRA
checkpoint's PEFT export on the HF export of its base computes its merged export; importing that adapter and
exporting merged again gives the same weights; an adapter made by peft itself with different q/k/v A's, rank
and alpha patterns and rsLoRA imports (at TP=2) exactly at a larger rank; what cannot be represented is refused
in one line naming the file and the key."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from aligner import cli
from aligner.launch.ranks import single_process
from aligner.models import checkpoint, lora, lora_peft
from aligner.models.hf_convert import hf_to_mcore, mcore_to_hf
from tests import hf_workers as hfw

peft = pytest.importorskip("peft")
TOKENS = torch.tensor([[0, 17, 3, 250, 8, 99, 41, 5], [0, 2, 300, 6, 6, 180, 77, 12]])
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf(path):
    from transformers import AutoModelForCausalLM  # slow to import: only where a test needs it

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _save_lora_checkpoint(base, out, rank: int = 4, alpha: float = 8.0) -> None:
    """A LoRA checkpoint on `base` whose A and B are random (non-zero: B starts at zero when trained)."""
    from omegaconf import OmegaConf  # with the model code: this helper builds a model

    from aligner.runtime.seeding import seed_everything

    with single_process():
        seed_everything(0)
        model, vocab = checkpoint.load_language_model(base)
        cfg, _ = checkpoint.model_config_from_checkpoint(base)
        settings = {"rank": rank, "alpha": alpha, "dropout": 0.0, "target_modules": list(lora.TARGETS)}
        lora.add_adapters(model, settings)
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, adapter in lora.adapters(model):
                adapter.b.copy_(0.05 * torch.randn(adapter.b.shape, generator=generator))
        model_cfg = {**OmegaConf.to_container(cfg, resolve=True), "lora": settings, "pretrained": str(base)}
        checkpoint.save_checkpoint(out, model, model_cfg, vocab)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny HF Llama (GQA), its import as the base, a LoRA checkpoint on it, and the three exports."""
    root = tmp_path_factory.mktemp("lora_peft")
    hf_model = hfw.make_hf_model("llama", root / "hf", seed=3)
    hf_to_mcore(root / "hf", root / "base")
    _save_lora_checkpoint(root / "base", root / "lora")
    return SimpleNamespace(root=root, hf_model=hf_model, base_hf=mcore_to_hf(root / "base", root / "base_hf"),
                           merged=mcore_to_hf(root / "lora", root / "merged"),
                           adapter=mcore_to_hf(root / "lora", root / "adapter", lora_mode="adapter"))


def _peft_logits(base_dir, adapter_dir) -> torch.Tensor:
    return hfw.hf_logits(peft.PeftModel.from_pretrained(_hf(base_dir), str(adapter_dir)).eval(), TOKENS)


def test_adapter_export_is_the_merged_model(world):
    config = json.loads((world.adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ALL)
    assert config["rank_pattern"] == {} and config["base_model_name_or_path"] == str((world.root / "base").resolve())
    tensors = hfw.load_safetensors_dir(world.adapter)
    assert len(tensors) == 2 * len(ALL) * 2
    qkv_a = [tensors[f"base_model.model.model.layers.1.self_attn.{p}_proj.lora_A.weight"] for p in "qkv"]
    assert torch.equal(qkv_a[0], qkv_a[1]) and torch.equal(qkv_a[0], qkv_a[2])  # linear_qkv's one A
    assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (32, 4)

    merged = hfw.hf_logits(_hf(world.merged), TOKENS)
    base = hfw.hf_logits(_hf(world.base_hf), TOKENS)
    adapted = _peft_logits(world.base_hf, world.adapter)
    delta = (adapted - merged).abs().max().item()
    print(f"\nPEFT adapter on the base export vs the merged export: max |dlogits| = {delta:.3g}")
    assert (merged - base).abs().max().item() > 0.05  # the adapters do change the model
    assert delta <= 1e-4
    # the merged export takes the architecture, token ids and tokenizer of the LoRA checkpoint's base
    assert json.loads((world.merged / "config.json").read_text())["bos_token_id"] == 0
    assert (world.merged / "tokenizer.json").exists()


def test_import_of_our_adapter_exports_the_same_merged_model(world):
    out = hf_to_mcore(world.base_hf, world.root / "reimport", lora_dir=world.adapter)
    meta = checkpoint.read_metadata(out / "lora")["lora"]
    assert (meta["rank"], meta["alpha"], "module_ranks" in meta) == (4, 8.0, False)  # q/k/v's A's fused at rank 4
    assert meta["base"]["path"] == str((out / "base").resolve())
    assert meta["base"]["fingerprint"] == checkpoint.fingerprint(out / "base")
    assert not list((out / "lora" / "weights").glob("*optimizer*"))
    again = mcore_to_hf(out / "lora", world.root / "merged_again")
    first, second = hfw.load_safetensors_dir(world.merged), hfw.load_safetensors_dir(again)
    delta = max((first[k] - second[k]).abs().max().item() for k in first)
    print(f"\nmerged export -> PEFT -> import -> merged export: max |dweight| = {delta:.3g}")
    assert set(first) == set(second) and delta <= 1e-5


def test_peft_made_adapter_with_different_a_imports_exactly(world):
    """q/k/v (k left out) and gate/up with their own A's, a rank pattern for one layer (the other layer's fused
    adapter padded), an alpha pattern, rsLoRA, down_proj in layer 0 only (a regex): imported at TP=2."""
    peft_model = peft.get_peft_model(_hf(world.root / "hf"), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=r".*\.(q_proj|v_proj|o_proj|gate_proj|up_proj)|.*layers\.0\.mlp\.down_proj",
        rank_pattern={"layers.1.self_attn.v_proj": 3}, alpha_pattern={"o_proj": 3.0}, use_rslora=True,
        task_type="CAUSAL_LM"))
    assert not hasattr(peft_model.base_model.model.model.layers[1].mlp.down_proj, "lora_A")
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    peft_dir = world.root / "peft_made"
    peft_model.save_pretrained(str(peft_dir))
    reference = hfw.hf_logits(peft_model.merge_and_unload().eval(), TOKENS)
    assert (reference - hfw.hf_logits(world.hf_model, TOKENS)).abs().max().item() > 0.05

    out = hf_to_mcore(world.root / "hf", world.root / "imported", tp=2, lora_dir=peft_dir)
    meta = checkpoint.read_metadata(out / "lora")
    assert meta["saved_with"]["tensor_model_parallel_size"] == 2
    assert meta["lora"]["rank"] == 2 and meta["lora"]["module_ranks"] == {"linear_qkv": 5, "linear_fc1": 4}
    merged = mcore_to_hf(out / "lora", world.root / "imported_merged")
    delta = (hfw.hf_logits(_hf(merged), TOKENS) - reference).abs().max().item()
    print(f"\npeft's merge_and_unload vs our import's merged export: max |dlogits| = {delta:.3g}")
    assert delta <= 1e-4
    # ... and that checkpoint's own PEFT export (rank/alpha patterns for the wider targets) computes the same
    adapter = mcore_to_hf(out / "lora", world.root / "imported_adapter", lora_mode="adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {"q_proj": 5, "k_proj": 5, "v_proj": 5, "gate_proj": 4, "up_proj": 4}
    delta = (_peft_logits(world.base_hf, adapter) - reference).abs().max().item()
    print(f"peft's merge_and_unload vs the re-exported adapter: max |dlogits| = {delta:.3g}")
    assert delta <= 1e-4


# ---- one-line refusals ------------------------------------------------------------------------------------
def _variant(world, tmp_path, config_changes=None, tensor_changes=None):
    """A copy of our exported adapter with some config keys and tensors changed (None removes one)."""
    from safetensors.torch import save_file  # only the refusal tests write adapters by hand

    config = {**json.loads((world.adapter / "adapter_config.json").read_text()), **(config_changes or {})}
    tensors = {**hfw.load_safetensors_dir(world.adapter), **(tensor_changes or {})}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in tensors.items() if v is not None}, str(tmp_path / "adapter_model.safetensors"))
    return tmp_path


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
REFUSED = [
    ({"use_dora": True}, None, "adapter_config.json", "use_dora=True"),
    ({"bias": "lora_only"}, None, "adapter_config.json", "bias='lora_only'"),
    ({"fan_in_fan_out": True}, None, "adapter_config.json", "fan_in_fan_out=True"),
    ({"modules_to_save": ["lm_head"]}, None, "adapter_config.json", "modules_to_save="),
    ({"target_modules": ["q_proj", "lm_head"]}, None, "adapter_config.json", "target_modules ['lm_head']"),
    ({"peft_type": "IA3"}, None, "adapter_config.json", "peft_type is 'IA3'"),
    (None, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "adapter_model.safetensors",
     "lm_head.lora_A.weight is not a lora_A/lora_B"),
    (None, {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.zeros(64)},
     "adapter_model.safetensors", "q_proj.lora_B.bias is not"),
    (None, {KEY: torch.zeros(4, 65)}, "adapter_model.safetensors", "q_proj: lora_A [4, 65]"),
    (None, {KEY: None}, "adapter_model.safetensors", "q_proj has lora_B but not lora_A"),
    ({"rank_pattern": {"q_proj": 8}}, None, "adapter_model.safetensors", "rank 8 need"),
]


@pytest.mark.parametrize("config_changes, tensor_changes, file, message", REFUSED)
def test_unrepresentable_adapters_are_refused(world, tmp_path, config_changes, tensor_changes, file, message):
    bad = _variant(world, tmp_path / "bad", config_changes, tensor_changes)
    with pytest.raises(lora_peft.PeftAdapterError) as caught:
        hf_to_mcore(world.base_hf, tmp_path / "out", lora_dir=bad)
    line = str(caught.value)
    assert "\n" not in line and message in line and f"{bad}/{file}" in line
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_cli_errors_are_one_line(world, tmp_path, capsys):
    assert cli.main(["convert", "mcore-to-hf", "--ckpt", str(world.root / "base"), "--out", str(tmp_path / "a"),
                     "--lora", "adapter"]) == 1
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "is not a LoRA checkpoint" in line and "--lora adapter" in line
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "adapter_config.json").write_text("{}")
    (tmp_path / "legacy" / "adapter_model.bin").write_bytes(b"")
    assert cli.main(["convert", "hf-to-mcore", "--hf", str(world.base_hf), "--out", str(tmp_path / "b"),
                     "--lora", str(tmp_path / "legacy")]) == 1
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "has no adapter_model.safetensors (only safetensors" in line and "--lora" in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
