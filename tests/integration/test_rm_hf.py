"""Hugging Face reward models both ways: `LlamaForSequenceClassification` / `Qwen2ForSequenceClassification`
(1 or several labels) import as aligner reward checkpoints whose scores equal transformers', at TP=1
and TP=2, and our reward checkpoints export to that form and load back in transformers."""
from __future__ import annotations

import json

import pytest
import torch

from tests import hf_workers as hfw
from tests.server_workers import make_reward_checkpoint

PAD = 319  # a token id the test texts never produce
TOL = 1e-4


def make_hf_reward_model(kind: str, path, num_labels: int, seed: int, labels=None):
    from transformers import AutoModelForSequenceClassification

    extra = {"id2label": dict(enumerate(labels))} if labels else {}
    config = hfw.hf_config(kind, num_labels=num_labels, pad_token_id=PAD, **extra)
    config.architectures = [type(AutoModelForSequenceClassification.from_config(config)).__name__]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    return hfw.randomize_and_save(model, path)


def sequences(path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return [tokenizer(t)["input_ids"] + [1] for t in hfw.TEXTS]  # ends with eos (1), never with PAD


def hf_scores(model, seqs, pad: int = PAD) -> torch.Tensor:
    """A sequence-classification model's scores of `seqs`, right-padded with `pad` into one batch."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != pad).long()).logits.float()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from aligner.models.hf_convert import hf_to_mcore

    root = tmp_path_factory.mktemp("hf_rm")
    llama = make_hf_reward_model("llama", root / "llama", 1, seed=1)
    qwen = make_hf_reward_model("qwen2", root / "qwen", 3, seed=2, labels=["helpfulness", "correctness", "coherence"])
    hf_to_mcore(root / "llama", root / "ck_llama")
    hf_to_mcore(root / "qwen", root / "ck_qwen_tp2", tp=2)
    return root, {"llama": llama, "qwen": qwen}


def test_import_scores_match_transformers(imported):
    from aligner.models.checkpoint import read_metadata
    from aligner.models.scoring import score_checkpoint

    root, models = imported
    for name, ckpt in (("llama", "ck_llama"), ("qwen", "ck_qwen_tp2")):
        meta = read_metadata(root / ckpt)
        assert meta["head"] == "reward"
        seqs = sequences(root / name)
        ours, theirs = score_checkpoint(root / ckpt, seqs), hf_scores(models[name], seqs)
        assert ours.shape == theirs.shape == (len(seqs), models[name].config.num_labels)
        assert (ours - theirs).abs().max() < TOL, (name, ours, theirs)
    assert read_metadata(root / "ck_qwen_tp2")["scalar_head"]["attributes"] == ["helpfulness", "correctness", "coherence"]
    assert read_metadata(root / "ck_llama")["scalar_head"] == {"num_outputs": 1, "attributes": None, "loss": None}


def test_export_loads_in_transformers(imported):
    from transformers import AutoModelForSequenceClassification

    from aligner.models.hf_convert import mcore_to_hf

    root, models = imported
    for name, ckpt in (("llama", "ck_llama"), ("qwen", "ck_qwen_tp2")):
        out = mcore_to_hf(root / ckpt, root / f"export_{name}")
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == [type(models[name]).__name__] and config["pad_token_id"] == PAD
        reloaded = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
        seqs = sequences(root / name)
        assert (hf_scores(reloaded, seqs) - hf_scores(models[name], seqs)).abs().max() < TOL
        assert reloaded.config.id2label == models[name].config.id2label


def test_trained_rm_exports_as_llama_sequence_classification(tiny_assets, tokenizer, tmp_path):
    """A reward model of ours (tiny tokenizer, no HF metadata) exports with the tokenizer's pad id,
    from one rank or from a TP=2 x PP=2 layout alike."""
    from transformers import AutoModelForSequenceClassification

    from aligner.models.hf_convert import mcore_to_hf
    from aligner.models.scoring import score_checkpoint

    make_reward_checkpoint(tmp_path / "rm", tiny_assets / "tokenizer", 2, seed=5, attributes=["a", "b"])
    out = mcore_to_hf(tmp_path / "rm", tmp_path / "hf")
    hf = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.pad_token_id == tokenizer.pad_token_id
    seqs = [tokenizer("What is 2+3? 5")["input_ids"] + [tokenizer.eos_token_id], [5, 6, 7, tokenizer.eos_token_id]]
    theirs = hf_scores(hf, seqs, pad=tokenizer.pad_token_id)
    assert (score_checkpoint(tmp_path / "rm", seqs) - theirs).abs().max() < TOL
    # exported through the weight stream from two TP x two PP ranks: the same tensors, bit for bit
    from safetensors.torch import load_file

    resharded = load_file(str(mcore_to_hf(tmp_path / "rm", tmp_path / "hf_tp2pp2", tp=2, pp=2) / "model.safetensors"))
    single = load_file(str(out / "model.safetensors"))
    assert resharded.keys() == single.keys() and "score.weight" in single
    assert all(torch.equal(resharded[k], single[k]) for k in single)
