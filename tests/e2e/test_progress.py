"""Progress of long commands (aligner.observe.progress): a tqdm bar with ETA on a terminal, periodic INFO
summaries otherwise (or with logging.progress=false), nothing on ranks other than the logging rank; and
`aligner generate` in batches: the same output as one batch, summaries in a piped stderr."""
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aligner.observe import progress as progress_module
from aligner.observe.progress import Progress, format_duration
from tests.conftest import REPO, cli_env, run_cli, write_jsonl_lines

ETA = re.compile(r"\d+/\d+ \[\d\d:\d\d<\d\d:\d\d")  # tqdm's "3/5 [00:01<00:02": elapsed < remaining
BAR_MARKS = ("\r", "%|")  # what only a tqdm bar writes (with ETA's "[00:01<00:02")


class Terminal(io.StringIO):
    def isatty(self):
        return True


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress_module, "_clock", fake)
    return fake


def summaries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == progress_module.__name__]


def run_steps(progress: Progress, steps: int, clock=None, seconds: float = 0.0) -> None:
    for step in range(steps):
        if clock is not None:
            clock.now += seconds
        progress.update({"loss": 2.0 - step / 10, "lr": 3e-4, "grad_norm": 1.0, "reward/mean": 0.25})
    progress.close()


def test_a_terminal_gets_a_bar_with_eta_and_the_watched_metrics(caplog):
    caplog.set_level(logging.INFO)
    stream = Terminal()
    run_steps(Progress(5, desc="train", stream=stream), 5)
    drawn = stream.getvalue()
    assert ETA.search(drawn) and "5/5" in drawn and "train" in drawn, drawn
    assert "loss=1.6" in drawn and "lr=0.0003" in drawn and "reward/mean=0.25" in drawn and "grad_norm" not in drawn
    assert summaries(caplog) == []


def test_piped_output_gets_periodic_summaries_and_the_last_one(caplog, clock):
    caplog.set_level(logging.INFO)
    stream = io.StringIO()
    run_steps(Progress(10, desc="train", stream=stream, summary_every_s=30), 10, clock, seconds=10.0)
    assert stream.getvalue() == ""  # nothing but log lines
    assert summaries(caplog) == [
        "train: step 3/10 (30%), 10.00 s/step, ETA 1m10s, loss 1.8 reward/mean 0.25 lr 0.0003",
        "train: step 6/10 (60%), 10.00 s/step, ETA 40s, loss 1.5 reward/mean 0.25 lr 0.0003",
        "train: step 9/10 (90%), 10.00 s/step, ETA 10s, loss 1.2 reward/mean 0.25 lr 0.0003",
        "train: step 10/10 (100%), 10.00 s/step, ETA 0s, loss 1.1 reward/mean 0.25 lr 0.0003",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_disabled_on_a_terminal_gives_summaries_not_a_bar(caplog, clock):
    """logging.progress=false: a resumed run (step 100 of 300) stopped early still logs where it stopped."""
    caplog.set_level(logging.INFO)
    stream = Terminal()
    progress = Progress(300, 100, enabled=False, stream=stream, summary_every_s=30)
    for _ in range(4):
        clock.now += 0.5
        progress.update(n=5)  # 4 updates of 5 units in 2 s: one summary, at close
    progress.close()
    progress.close()  # closing twice logs nothing more
    assert stream.getvalue() == ""
    assert summaries(caplog) == ["step 120/300 (40%), 10.0 step/s, ETA 18s"]


def test_a_failed_command_ends_with_its_error_not_a_summary(caplog, clock):
    caplog.set_level(logging.INFO)
    with pytest.raises(ValueError):
        with Progress(10, stream=io.StringIO(), summary_every_s=30) as progress:
            clock.now += 1
            progress.update()
            raise ValueError("a bad record")
    assert summaries(caplog) == []


def test_only_the_logging_rank_shows_progress(caplog):
    caplog.set_level(logging.INFO)
    for stream, enabled in ((Terminal(), True), (io.StringIO(), True), (Terminal(), False)):
        run_steps(Progress(4, enabled=enabled, silent=True, stream=stream, summary_every_s=0), 4)
        assert stream.getvalue() == ""
    assert summaries(caplog) == []


def test_durations_read_short():
    assert [format_duration(s) for s in (0, 45.4, 545, 3600 + 125)] == ["0s", "45s", "9m05s", "1h02m"]


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
    from aligner.runtime.cpu_memory import keep_freed_memory
    from aligner.runtime.seeding import seed_everything

    params = sampling_params(parse_overrides(SAMPLING))
    with single_process():
        keep_freed_memory()
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
