"""`aligner rs-generate --model CKPT --prompts FILE.jsonl --out FILE.jsonl [key=value ...]`: rejection
sampling offline. Each prompt gets `rs.num_rollouts_per_prompt` samples from the checkpoint, they are
scored by `reward.functions` and/or the server at `reward.url`, and the `rs.top_n` best of each prompt
(`rs_select.select_winners`: ties go to the earlier sample, unscored samples never win) are written
as SFT records, prompt after prompt, best first:

  chat prompt (a list of messages): {"messages": [prompt messages..., {"role": "assistant", "content": response}],
                                     "reward": r}
  text prompt:                      {"input": prompt, "output": response, "reward": r}

so that `aligner train sft data.train_path=OUT` trains on them. Prompts are the RL prompt records
(`aligner.data.prompts`: {"prompt": text or messages, ...}; the other fields go to the reward
functions); prompts longer than data.max_length tokens are left out (counted). A text prompt's
empty response cannot be an SFT output and is left out (counted). The response text is decoded
without special tokens; the eos the SFT data adds ends it again.

Overrides are those of conf/rs.yaml under rs.*, reward.*, sampling.*, generation.*, data.max_length,
data.overlong, plus `batch_size` (= generation.batch_size, sequences per forward batch) and `seed`
(= trainer.seed: sample k, counted prompt after prompt, is seeded with (seed, k), as in `aligner
train rs`). One process (CPU or one GPU). The tokenizer is CKPT/tokenizer unless --tokenizer.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path


from aligner import errors
from aligner.algorithms.online.rs_select import flat_winners
from aligner.config.load import compose_config
from aligner.config.rs_schema import validate_rs_sampling
from aligner.data.jsonl import read_jsonl
from aligner.data.prompts import load_prompt_dataset
from aligner.data.sft import check_messages
from aligner.data.tokenizer import load_tokenizer
from aligner.files import atomic_write
from aligner.generation import rng
from aligner.generation.backends import build_engine
from aligner.generation.types import SamplingParams
from aligner.models.checkpoint import load_language_model, model_config_from_checkpoint, read_metadata
from aligner.observe.progress import Progress
from aligner.rewards.scoring import RewardScorer, resolve_reward_functions
from aligner.runtime import distributed
from aligner.runtime.seeding import seed_everything

SECTIONS = ("rs.", "reward.", "sampling.", "generation.", "data.max_length=", "data.overlong=")
ALIASES = {"batch_size": "generation.batch_size", "seed": "trainer.seed"}


def hydra_overrides(items: list[str]) -> list[str]:
    """The command line's key=value items as overrides of conf/rs.yaml; another key is a UsageError."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise errors.UsageError(f"override '{item}' is not key=value", "aligner rs-generate")
        if key in ALIASES:
            item = f"{ALIASES[key]}={value}"
        elif not item.startswith(SECTIONS):
            raise errors.UsageError(f"unknown override '{key}'", "aligner rs-generate",
                                    "use rs.*, reward.*, sampling.*, generation.*, data.max_length, data.overlong, "
                                    "batch_size or seed")
        out.append(item)
    return out


def sft_record(raw_prompt, response: str, reward: float) -> dict | None:
    """A winner as an SFT record (see the module doc); None for a text prompt's empty response."""
    if isinstance(raw_prompt, str):
        return {"input": raw_prompt, "output": response, "reward": reward} if response else None
    messages = check_messages(raw_prompt, "prompt")
    return {"messages": messages + [{"role": "assistant", "content": response}], "reward": reward}


def load_config(args):
    """conf/rs.yaml composed with the overrides and this command's paths, checked (rs_schema)."""
    tokenizer = args.tokenizer or str(Path(args.model) / "tokenizer")
    for what, path in (("--model", args.model), ("--prompts", args.prompts), ("--tokenizer", tokenizer)):
        if not Path(path).exists():
            raise errors.UserError(f"{path} does not exist", f"aligner rs-generate {what}",
                                   f"pass {what} an existing path" if what != "--tokenizer" else
                                   "pass --tokenizer DIR (the checkpoint has no tokenizer/)")
    cfg = compose_config("rs", [*hydra_overrides(args.overrides), f"data.train_path={Path(args.prompts).resolve()}",
                                f"tokenizer.path={Path(tokenizer).resolve()}",
                                f"model.pretrained={Path(args.model).resolve()}"])
    # the checkpoint's own context length (training configs keep theirs; this command has none)
    cfg.model.seq_length = read_metadata(cfg.model.pretrained)["model"]["seq_length"]
    validate_rs_sampling(cfg)
    try:
        resolve_reward_functions(list(cfg.reward.functions))
    except ValueError as e:
        raise errors.UsageError(str(e), "reward.functions", "name a builtin or an importable package.module:function") \
            from None
    return cfg


def generate_winners(cfg, out: str | Path) -> dict:
    """Generate, score, select and write (see the module doc); returns the counts and mean rewards."""
    r, s, w = cfg.rs, cfg.sampling, cfg.reward
    n = r.num_rollouts_per_prompt
    distributed.init_process_group()
    distributed.init_model_parallel()
    seed_everything(cfg.trainer.seed)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    model_cfg, _ = model_config_from_checkpoint(cfg.model.pretrained)
    model, vocab_size = load_language_model(cfg.model.pretrained)
    prompts = load_prompt_dataset(cfg.data.train_path, tokenizer, cfg.data.max_length, cfg.data.overlong)
    raw = {line: obj for line, obj in read_jsonl(cfg.data.train_path)}
    g = cfg.generation
    engine = build_engine(str(g.backend), model, model_cfg, vocab_size, tokenizer, batch_size=g.batch_size,
                          decode=g.decode, tokenizer_dir=cfg.tokenizer.path, checkpoint=cfg.model.pretrained)
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                            stop_strings=tuple(s.stop_strings), seed=cfg.trainer.seed)
    weights = list(w.weights) if w.weights is not None else None
    scorer = RewardScorer(resolve_reward_functions(list(w.functions)), weights, workers=w.workers, url=w.url,
                          remote_timeout_s=w.timeout_s, tokenizer=tokenizer)
    texts, scores, pending = [], [], None
    per_call = max(1, cfg.generation.batch_size // n)  # prompts per generate call
    try:
        scorer.wait_ready()
        with Progress(len(prompts), unit="prompt", desc="rs-generate") as progress:
            for start in range(0, len(prompts), per_call):
                ids = range(start * n, min(len(prompts), start + per_call) * n)  # sample k: prompt k // n
                rollout = engine.generate([prompts[k // n].ids for k in ids], params,
                                          seeds=[rng.derive_seed(params.seed, k) for k in ids])
                if pending is not None:  # the previous batch was scored while this one generated
                    scores += pending.result()
                batch = tokenizer.batch_decode(rollout.responses(), skip_special_tokens=True)
                texts += batch
                chosen = [prompts[k // n] for k in ids]
                pending = scorer.submit([p.text for p in chosen], batch, [p.fields for p in chosen])
                progress.update(n=len(ids) // n)
            scores += pending.result() if pending is not None else []
    finally:
        scorer.close()
    kept = flat_winners(scores, n, r.top_n)
    records, empty = [], 0
    for k in kept:
        line = int(prompts[k // n].source.rsplit(":", 1)[1])
        record = sft_record(raw[line]["prompt"], texts[k], scores[k])
        empty += record is None
        if record is not None:
            records.append(record)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out) as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    distributed.shutdown()
    valid = [x for x in scores if x is not None]
    return {"prompts": len(prompts), "samples": len(scores), "unscored": len(scores) - len(valid),
            "kept": len(kept), "written": len(records), "empty": empty,
            "reward_mean": statistics.fmean(valid) if valid else float("nan"),
            "kept_reward_mean": statistics.fmean(scores[k] for k in kept) if kept else float("nan")}


def rs_generate_main(argv: list[str]) -> int:
    parser = errors.ArgumentParser(prog="aligner rs-generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="aligner checkpoint directory")
    parser.add_argument("--prompts", required=True, help='JSONL prompts: {"prompt": text or messages, ...}')
    parser.add_argument("--out", required=True, help="output JSONL of SFT records (the winners)")
    parser.add_argument("--tokenizer", default=None, help="default: <model>/tokenizer")
    parser.add_argument("overrides", nargs="*", help="key=value: rs.*, reward.*, sampling.*, generation.*, "
                                                     "data.max_length, data.overlong, batch_size, seed")
    args = parser.parse_args(argv)
    cfg = load_config(args)
    summary = generate_winners(cfg, args.out)
    print(f"wrote {args.out}: {summary['written']} SFT records, the best {cfg.rs.top_n} of "
          f"{cfg.rs.num_rollouts_per_prompt} samples of each of {summary['prompts']} prompts "
          f"({summary['unscored']} samples unscored, {summary['empty']} empty winners left out); "
          f"reward mean {summary['reward_mean']:.4g}, kept {summary['kept_reward_mean']:.4g}")
    return 0
