"""`aligner generate` in batches: the same output as one batch, and progress summaries (no bar) in a piped
stderr. Progress itself (bar, summaries, ranks) on a fake clock: tests/unit/test_progress.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, run_cli, write_jsonl_lines
from tests.unit.test_progress import BAR_MARKS, ETA


def one_call_outputs(model_dir: str, prompts_path: str, out_prefix: str) -> None:
    """What `aligner generate` wrote before it generated in batches: one engine call over every prompt,
    with max_batch_size 3 and 64 (run in a subprocess, as the CLI's rank is: one thread, a fresh process)."""
    from aligner.data.tokenizer import load_tokenizer
    from aligner.generation import rng
    from aligner.generation.cli import parse_overrides, read_prompts, response_records, sampling_params
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.models.checkpoint import load_weights, model_config_from_checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.launch.ranks import single_process
    from aligner.runtime.seeding import seed_everything

    params = sampling_params(parse_overrides(SAMPLING))
    with single_process():  # on CPU it keeps freed memory, as a generating rank does
        seed_everything(params.seed)
        cfg, vocab = model_config_from_checkpoint(model_dir)
        model = build_gpt(cfg, vocab)
        load_weights(model_dir, model)
        tokenizer = load_tokenizer(Path(model_dir) / "tokenizer")
        prompts = read_prompts(prompts_path, tokenizer, vocab)
        for batch_size in (3, 64):
            engine = MegatronEngine(model, cfg, vocab, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                                    tokenizer=tokenizer, max_batch_size=batch_size)
            rollout = engine.generate(prompts, params, seeds=[rng.derive_seed(params.seed, i) for i in range(7)])
            Path(f"{out_prefix}{batch_size}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in response_records(rollout, tokenizer)))


SAMPLING = ["sampling.temperature=1.0", "sampling.max_new_tokens=12", "sampling.seed=5"]


def test_generate_in_batches_writes_what_one_call_did_and_logs_summaries(rl_assets, tokenizer, tmp_path):
    """Sampled (not greedy): each prompt's seed comes from its index, so batches draw the same tokens."""
    model = rl_assets / "sft" / "checkpoints" / "step_000040"
    records = [json.loads(line) for line in (rl_assets / "prompts.jsonl").read_text().splitlines()[:7]]
    prompts = write_jsonl_lines(tmp_path / "prompts.jsonl", [
        {"prompt": tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)}
        for r in records])
    out = tmp_path / "batches.jsonl"
    result = run_cli("generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out), *SAMPLING,
                     "batch_size=3")  # 3 + 3 + 1 prompts
    assert result.returncode == 0, result.stderr[-3000:]
    assert "generate: prompt 7/7 (100%)" in result.stderr and "ETA 0s" in result.stderr, result.stderr[-3000:]
    assert not any(mark in result.stderr for mark in BAR_MARKS) and not ETA.search(result.stderr), result.stderr

    reference = subprocess.run([sys.executable, "-c", "import sys; from tests.e2e.test_progress import one_call_outputs; "
                                "one_call_outputs(*sys.argv[1:])", str(model), str(prompts), str(tmp_path / "one_")],
                               cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert out.read_bytes() == (tmp_path / "one_3.jsonl").read_bytes()  # the same engine batches: byte-identical
    # one batch of 7: the same tokens; log-probs within float32 rounding (other padding, other kernels)
    batched, one_batch = ([json.loads(line) for line in path.read_text().splitlines()]
                          for path in (out, tmp_path / "one_64.jsonl"))
    assert len(batched) == 7
    for a, b in zip(batched, one_batch):
        assert (a["response_ids"], a["response"], a["stop_reason"]) == (b["response_ids"], b["response"], b["stop_reason"])
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
