"""HF interop across ranks (gloo, CPU): import at TP=2 / PP=2, exact round trip, `score_logprobs`
and raw-logit parity with transformers at TP=2 / PP=2, and the TP/PP weight stream."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from aligner.models import hf_weights as hw
from aligner.models.hf_convert import hf_to_mcore, mcore_to_hf, write_hf_dir
from aligner.models.scoring import score_logprobs
from tests import hf_workers as hfw
from tests.conftest import REPO, write_jsonl_lines

pytestmark = pytest.mark.dist
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _ranks_import_tests():
    """Launched ranks import `tests.hf_workers` from the repository root."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        yield


@pytest.fixture(scope="module")
def world(tmp_path_factory, _ranks_import_tests):
    """Llama (GQA, untied, sharded safetensors + index) imported at TP=2; Qwen2 (q/k/v bias, tied,
    4 layers) imported at PP=2."""
    root = tmp_path_factory.mktemp("hf")
    llama = hfw.make_hf_model("llama", root / "llama", seed=1, max_shard_size="40KB")
    qwen = hfw.make_hf_model("qwen2", root / "qwen", seed=2, num_hidden_layers=4)
    assert (root / "llama" / "model.safetensors.index.json").exists()
    hf_to_mcore(root / "llama", root / "ck_llama", tp=2)
    hf_to_mcore(root / "qwen", root / "ck_qwen", pp=2)
    lines = [{"text": t} for t in hfw.TEXTS] + [{"input_ids": [0, 5, 300, 319, 7, 7, 2]}, {"input_ids": [4]},
                                                {"input_ids": list(range(0, 320, 9))}]
    data = write_jsonl_lines(root / "data.jsonl", lines + [""])  # a blank line at the end, skipped
    return SimpleNamespace(root=root, data=data, n_inputs=len(lines),
                           models={"llama": (llama, root / "ck_llama"), "qwen": (qwen, root / "ck_qwen")})


def _hf_state(model) -> dict:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def test_import_metadata(world):
    meta = json.loads((world.root / "ck_llama" / "aligner.json").read_text())
    assert meta["saved_with"]["tensor_model_parallel_size"] == 2 and meta["vocab_size"] == 320
    assert meta["hf"]["architecture"] == "LlamaForCausalLM" and meta["hf"]["config"]["bos_token_id"] == 0
    qwen = json.loads((world.root / "ck_qwen" / "aligner.json").read_text())
    assert qwen["hf"]["architecture"] == "Qwen2ForCausalLM" and qwen["model"]["tie_embeddings"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(world.root / "ck_llama" / "tokenizer"))


@pytest.mark.parametrize("name, shard_bytes", [("llama", 60_000), ("qwen", 2 * 10**9)])
def test_round_trip_is_exact(world, name, shard_bytes):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, ckpt = world.models[name]
    out = mcore_to_hf(ckpt, world.root / f"export_{name}", max_shard_bytes=shard_bytes)
    exported, original = hfw.load_safetensors_dir(out), _hf_state(model)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert (out / "model.safetensors.index.json").exists() == (name == "llama")  # several shards + index
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.tensor([[0, 17, 3, 250, 8, 99]])
    assert torch.equal(hfw.hf_logits(reloaded, ids), hfw.hf_logits(model, ids))
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    reference = AutoTokenizer.from_pretrained(str(world.root / name), local_files_only=True)
    assert tokenizer(hfw.TEXTS[0])["input_ids"] == reference(hfw.TEXTS[0])["input_ids"]
    with pytest.raises(FileExistsError):
        mcore_to_hf(ckpt, out)


@pytest.mark.parametrize("name, tp, pp", [("llama", 2, 1), ("qwen", 1, 2)])
def test_score_logprobs_matches_transformers(world, name, tp, pp):
    model, ckpt = world.models[name]
    out = world.root / f"lp_{name}_{tp}{pp}.jsonl"
    score_logprobs(ckpt, world.data, out, tp=tp, pp=pp, batch_size=3)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == world.n_inputs and rows[0]["input_ids"][0] == 0  # <s> from the tokenizer
    assert rows[4]["input_ids"] == [0, 5, 300, 319, 7, 7, 2] and rows[5]["logprobs"] == []
    worst = 0.0
    for row in rows:
        assert len(row["logprobs"]) == len(row["input_ids"]) - 1
        if len(row["input_ids"]) < 2:
            continue
        ref = hfw.hf_token_logprobs(model, torch.tensor([row["input_ids"]]))
        worst = max(worst, (ref - torch.tensor(row["logprobs"])).abs().max().item())
    print(f"\n{name} TP={tp} PP={pp}: max |dlogprob| = {worst:.3g}")
    assert worst <= TOL


def test_logits_and_weight_stream(world, tmp_path):
    """One 2-rank launch, four layouts (dist checkpoints reshard): raw logits vs transformers, and
    the HF stream (to rank 0, or to all ranks) loads into transformers with the same logits."""
    from aligner.launch.local import launch

    torch.manual_seed(0)
    tokens = torch.randint(0, 320, (2, 11))
    torch.save(tokens, tmp_path / "tokens.pt")
    layouts = [("llama", 2, 1, False), ("qwen", 1, 2, False), ("llama", 1, 2, True), ("qwen", 2, 1, True)]
    jobs = [{"ckpt": str(world.models[name][1]), "tp": tp, "pp": pp, "tokens": str(tmp_path / "tokens.pt"),
             "out": str(tmp_path / f"job{i}"), "all_ranks": all_ranks}
            for i, (name, tp, pp, all_ranks) in enumerate(layouts)]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    launch("tests.hf_workers:parity_worker", [str(tmp_path / "jobs.json")], 2, log_dir=tmp_path / "logs")

    from transformers import AutoModelForCausalLM

    for i, (name, tp, pp, all_ranks) in enumerate(layouts):
        model = world.models[name][0]
        reference = hfw.hf_logits(model, tokens)
        delta = (torch.load(tmp_path / f"job{i}.logits.pt") - reference).abs().max().item()
        print(f"\n{name} TP={tp} PP={pp}: max |dlogits| = {delta:.3g}")
        assert delta <= TOL
        if all_ranks:
            streamed = torch.load(tmp_path / f"job{i}.stream.rank0.pt")
            other = torch.load(tmp_path / f"job{i}.stream.rank1.pt")
            assert set(other) == set(streamed) and all(torch.equal(other[k], streamed[k]) for k in streamed)
        else:
            result = torch.load(tmp_path / f"job{i}.stream.pt")
            streamed = result["state"]
            assert result["buckets"] > 3  # 64 KiB buckets: the stream really is chunked
        original = _hf_state(model)
        assert set(streamed) == set(original) and all(torch.equal(streamed[k], original[k]) for k in original)
        config = json.loads((world.root / name / "config.json").read_text())
        out = write_hf_dir(tmp_path / f"stream{i}", config, [streamed])
        reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        assert torch.equal(hfw.hf_logits(reloaded, tokens), reference)


# ---- clear errors before any rank starts ----------------------------------------------------
def test_errors(world, tmp_path):
    with pytest.raises(ValueError, match="TP=3 must divide num_attention_heads=4, num_key_value_heads=2"):
        hf_to_mcore(world.root / "llama", tmp_path / "x", tp=3)
    with pytest.raises(ValueError, match="PP=3 must divide num_hidden_layers=2"):
        hf_to_mcore(world.root / "llama", tmp_path / "x", pp=3)
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((world.root / "llama" / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}))
    with pytest.raises(hw.UnsupportedModelError, match="rope type 'yarn'"):
        hf_to_mcore(bad, tmp_path / "x")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        hf_to_mcore(bad, tmp_path / "x")
    ckpt = world.models["llama"][1]
    for content, message in [('{"text": "ok"}\n{"txt": "oops"}\n', r"data.jsonl:2: expected"),
                             ('{"input_ids": [1, 2]}\n\n{"input_ids": [1, 320]}\n', r"data.jsonl:3: token id 320"),
                             ('{"input_ids": [1, "a"]}\n', r"data.jsonl:1: input_ids must be"),
                             ("not json\n", r"data.jsonl:1: expected one JSON object per line, got invalid JSON")]:
        (tmp_path / "data.jsonl").write_text(content)
        with pytest.raises(ValueError, match=message):
            score_logprobs(ckpt, tmp_path / "data.jsonl", tmp_path / "out.jsonl")
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        score_logprobs(ckpt, tmp_path / "data.jsonl", tmp_path / "out.jsonl", tokenizer_path=tmp_path / "none")
