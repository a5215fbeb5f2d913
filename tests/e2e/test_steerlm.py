"""SteerLM end to end (the condition format and its errors: tests/unit/test_steerlm_data.py): labels from
a regression reward model equal its in-process scores, and `aligner train steerlm` learns to follow an
attribute that `aligner generate ... steerlm.attributes=...` then steers."""
from __future__ import annotations

import json
import math

from tests.conftest import run_cli, write_jsonl_lines
from tests.server_workers import make_reward_checkpoint

NAMES = ["helpfulness", "verbosity"]


# ---- labels from a regression reward model ----------------------------------------------------------
def test_label_attributes_round_and_clip_the_reward_models_scores(tiny_assets, tokenizer, tmp_path):
    from aligner.models.scoring import score_checkpoint

    # scores spread over 3..8 (seed 7): labels 3 and 4, some clipped at scale 4
    make_reward_checkpoint(tmp_path / "rm", tiny_assets / "tokenizer", 2, seed=7, attributes=NAMES,
                           head_scale=[-10.0, -14.3])
    records = [{"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                             {"role": "assistant", "content": str(a + b + (a * b) % 3)}]} for a in range(4)
               for b in range(3)] + [{"input": "What is 9*9? ", "output": "81"}]
    write_jsonl_lines(tmp_path / "sft.jsonl", records)
    result = run_cli("label-attributes", "--rm", str(tmp_path / "rm"), "--data", str(tmp_path / "sft.jsonl"),
                     "--out", str(tmp_path / "labelled.jsonl"))
    assert result.returncode == 0, result.stderr[-3000:]
    labelled = [json.loads(line) for line in (tmp_path / "labelled.jsonl").read_text().splitlines()]

    def scored_ids(record):  # what the reward model was trained to score: the rendered text + eos
        text = (tokenizer.apply_chat_template(record["messages"], tokenize=False) if "messages" in record
                else record["input"] + record["output"])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids if ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]

    scores = score_checkpoint(tmp_path / "rm", [scored_ids(r) for r in records])
    expected = [{n: min(4, max(0, math.floor(s + 0.5))) for n, s in zip(NAMES, row)} for row in scores.tolist()]
    assert [r["attributes"] for r in labelled] == expected
    assert [{k: v for k, v in r.items() if k != "attributes"} for r in labelled] == records
    assert len({tuple(e.values()) for e in expected}) > 2 and scores.max() > 4.5  # not one label; clipping


# ---- train, then steer ------------------------------------------------------------------------------
def test_steerlm_learns_to_follow_an_attribute(tiny_assets, tokenizer, tmp_path):
    """verbosity 0: the answer once; verbosity 2: the answer six times. Prompts held out."""
    def record(a, b, verbosity):
        answer = " ".join([str(a + b)] * (1 if verbosity == 0 else 6))
        return {"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                             {"role": "assistant", "content": answer}],
                "attributes": {"helpfulness": 4, "verbosity": verbosity}}

    train = [record(a, b, v) for a in range(8) for b in range(8) for v in (0, 2)]
    write_jsonl_lines(tmp_path / "train.jsonl", train)
    run_dir = tmp_path / "run"
    result = run_cli("train", "steerlm", f"run_dir={run_dir}", f"data.train_path={tmp_path / 'train.jsonl'}",
                     f"tokenizer.path={tiny_assets / 'tokenizer'}", "steerlm.attributes=[helpfulness,verbosity]",
                     "trainer.max_steps=80", "trainer.global_batch_size=32", "trainer.micro_batch_size=16",
                     "optim.lr=3e-3", "optim.warmup_steps=5", "logging.progress=false", "logging.tensorboard=false")
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = run_dir / "checkpoints" / "step_000080"
    meta = json.loads((ckpt / "aligner.json").read_text())
    assert meta["steerlm"] == {"attributes": ["helpfulness", "verbosity"], "scale": 4}

    held_out = [(a, b) for a in range(8, 10) for b in range(10)]
    prompts = write_jsonl_lines(tmp_path / "prompts.jsonl", [{"prompt": tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is {a}+{b}?"}], tokenize=False, add_generation_prompt=True)}
        for a, b in held_out])
    lengths = {}
    for verbosity in (0, 2):
        out = tmp_path / f"gen_{verbosity}.jsonl"
        result = run_cli("generate", "--model", str(ckpt), "--prompts", str(prompts), "--out", str(out),
                         "sampling.greedy=true", "sampling.max_new_tokens=24",
                         f"steerlm.attributes=helpfulness:4,verbosity:{verbosity}")
        assert result.returncode == 0, result.stderr[-3000:]
        lengths[verbosity] = [len(json.loads(line)["response"].split()) for line in out.read_text().splitlines()]
    short = sum(n == 1 for n in lengths[0]) / len(held_out)
    long = sum(n >= 4 for n in lengths[2]) / len(held_out)
    print(f"SteerLM held-out: verbosity 0 -> one answer {short:.2f}; verbosity 2 -> >= 4 answers {long:.2f}")
    assert short >= 0.8 and long >= 0.8, lengths
    bad = run_cli("generate", "--model", str(ckpt), "--prompts", str(prompts), "--out", str(tmp_path / "x.jsonl"),
                  "steerlm.attributes=helpfulness:4")
    assert bad.returncode == 2 and "missing: verbosity" in bad.stderr
