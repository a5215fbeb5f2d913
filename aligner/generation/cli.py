"""`aligner generate --model DIR --prompts FILE --out FILE [key=value ...]`: sample from an aligner checkpoint.

DIR is an aligner checkpoint (its tokenizer, when saved, in DIR/tokenizer). FILE is JSONL, one prompt
per line: {"prompt": "text"} (needs the tokenizer; encoded with its default special tokens) or
{"prompt_ids": [int, ...]}. The output has one JSON line per prompt, in input order:
{"response_ids": [...], "response": text or null, "logprobs": [...], "stop_reason": ...}.
Sample i is seeded with (sampling.seed, i), so the output does not depend on batch_size or on the
number of ranks, up to float rounding (other batches pad differently: the log-probs move in their last
bits). Progress: a bar on a terminal, else a log line every 30 s (aligner.observe.progress).
A SteerLM checkpoint (`aligner train steerlm`) is steered with
`steerlm.attributes=name:value,...` (every attribute it was trained on): each prompt then starts with
the same condition as in training. Overrides (key=value): see OVERRIDES. Several ranks run through the embedded
launcher; TP x PP must divide launcher.nproc_per_node, the remaining factor splits the prompts (DP).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from aligner import errors
from aligner.config.generation_schema import validate_generation_backend
from aligner.data.jsonl import read_token_sequences
from aligner.data.steerlm import condition_ids, insert_condition, parse_condition
from aligner.data.tokenizer import load_tokenizer
from aligner.files import atomic_write
from aligner.generation import rng
from aligner.generation.backends import build_engine
from aligner.generation.types import DECODE_MODES, SamplingParams
from aligner.launch.local import launch
from aligner.models.checkpoint import load_language_model, model_config_from_checkpoint, read_metadata
from aligner.observe.progress import Progress
from aligner.runtime import collectives

# megatron, and the modules that import it (runtime.distributed, runtime.seeding), are imported inside
# run_generation: the CLI process imports this module before it launches ranks.

OVERRIDES = {  # key -> (type, default)
    "sampling.greedy": (bool, False),
    "sampling.temperature": (float, 1.0),
    "sampling.top_k": (int, 0),
    "sampling.top_p": (float, 1.0),
    "sampling.min_new_tokens": (int, 0),
    "sampling.max_new_tokens": (int, 128),
    "sampling.seed": (int, 0),
    "batch_size": (int, 32),
    "generation.backend": (str, "megatron"),  # megatron | trtllm (aligner/generation/backends.py)
    "decode": (str, "auto"),  # auto | lean | compiled | megatron (MegatronEngine's decode paths)
    "launcher.nproc_per_node": (int, 1),
    "model.tensor_model_parallel_size": (int, 1),
    "model.pipeline_model_parallel_size": (int, 1),
    "steerlm.attributes": (str, ""),  # a SteerLM model's condition, e.g. helpfulness:4,verbosity:1
}


class UsageError(errors.UsageError, ValueError):
    pass


def _parse_value(key: str, kind, text: str):
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise UsageError(f"{key}={text}: expected true or false")
    try:
        return kind(text)
    except ValueError:
        raise UsageError(f"{key}={text}: expected {kind.__name__}") from None


def parse_overrides(items: list[str]) -> dict:
    """{key: value} for every known key (defaults filled in); an unknown key raises UsageError naming it."""
    values = {key: default for key, (_, default) in OVERRIDES.items()}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"override '{item}' is not key=value")
        if key not in OVERRIDES:
            raise UsageError(f"unknown override '{key}'; known keys: {', '.join(OVERRIDES)}")
        values[key] = _parse_value(key, OVERRIDES[key][0], text)
    tp, pp, nproc = (values["model.tensor_model_parallel_size"], values["model.pipeline_model_parallel_size"],
                     values["launcher.nproc_per_node"])
    if min(tp, pp, nproc, values["batch_size"]) < 1:
        raise UsageError("batch_size, launcher.nproc_per_node and the parallel sizes must be >= 1")
    if nproc % (tp * pp):
        raise UsageError(f"launcher.nproc_per_node={nproc} is not a multiple of TP x PP = {tp} x {pp}")
    if values["decode"] not in DECODE_MODES:
        raise UsageError(f"decode={values['decode']}: expected one of {', '.join(DECODE_MODES)}")
    if values["decode"] == "compiled" and tp > 1:
        raise UsageError("decode=compiled needs model.tensor_model_parallel_size=1")
    if values["generation.backend"] not in ("megatron", "trtllm"):
        raise UsageError(f"generation.backend={values['generation.backend']}: expected megatron or trtllm")
    validate_generation_backend(values["generation.backend"])
    return values


def sampling_params(values: dict):
    return SamplingParams(**{key.split(".", 1)[1]: value for key, value in values.items()
                             if key.startswith("sampling.")})


def read_prompts(path, tokenizer, vocab_size: int) -> list[list[int]]:
    """Token ids per non-blank line; a DataError (ValueError) names file:line for a bad line."""
    def tokenizer_for(where: str):
        if tokenizer is None:
            raise ValueError(f"{where}: a text prompt needs the checkpoint's tokenizer (DIR/tokenizer), "
                             "which is missing; give prompt_ids instead")
        return tokenizer

    return read_token_sequences(path, "prompt", "prompt_ids", vocab_size, tokenizer_for)


def steer(prompts: list[list[int]], attributes: str, model_dir: Path, tokenizer) -> list[list[int]]:
    """Each prompt with a SteerLM condition inserted as `aligner train steerlm` did."""
    trained = read_metadata(model_dir).get("steerlm")
    if trained is None or tokenizer is None:
        raise ValueError(f"steerlm.attributes: {model_dir} is not a SteerLM checkpoint with a tokenizer "
                         f"(train one with `aligner train steerlm`)")
    names = trained["attributes"]
    condition = condition_ids(tokenizer, parse_condition(attributes, names, trained["scale"]), names)
    return [insert_condition(ids, None, condition, tokenizer.bos_token_id)[0] for ids in prompts]


def response_records(rollout, tokenizer) -> list[dict]:
    return [{"response_ids": ids, "response": tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else None,
             "logprobs": lps, "stop_reason": reason}
            for ids, lps, reason in zip(rollout.responses(), rollout.response_logprobs(), rollout.stop_reason)]


def run_generation(job: dict) -> None:
    """One rank: load the checkpoint under TP x PP, generate this data-parallel rank's share, rank 0 writes."""
    from megatron.core import parallel_state as ps  # megatron and its importers: on the ranks only (see above)

    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything

    values, model_dir = job["values"], Path(job["model"])
    tp, pp = values["model.tensor_model_parallel_size"], values["model.pipeline_model_parallel_size"]
    distributed.init_process_group()
    distributed.init_model_parallel(tp, pp)
    seed_everything(values["sampling.seed"])
    layout = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    model_cfg, _ = model_config_from_checkpoint(model_dir, **layout)
    model, vocab_size = load_language_model(model_dir, **layout)
    tokenizer = load_tokenizer(model_dir / "tokenizer") if (model_dir / "tokenizer").is_dir() else None
    prompts = read_prompts(job["prompts"], tokenizer, vocab_size)
    if values["steerlm.attributes"]:
        prompts = steer(prompts, values["steerlm.attributes"], model_dir, tokenizer)
    params = sampling_params(values)

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = -(-len(prompts) // dp)
    mine = list(range(dp_rank * share, min(len(prompts), (dp_rank + 1) * share)))
    engine = build_engine(values["generation.backend"], model, model_cfg, vocab_size, tokenizer,
                          batch_size=values["batch_size"], decode=values["decode"],
                          tokenizer_dir=model_dir / "tokenizer" if tokenizer is not None else None,
                          checkpoint=model_dir)
    records = []
    # batch_size prompts per call, as the engine would batch them in one call: the same output, and
    # a progress bar (or log summaries) of rank 0's share that moves per batch. Every replica makes as
    # many calls as the largest share needs (the last may be empty): TensorRT-LLM's calls are job-wide.
    with Progress(len(mine), unit="prompt", desc="generate", silent=dist.get_rank() != 0) as progress:
        for start in range(0, share, values["batch_size"]):
            batch = mine[start:start + values["batch_size"]]
            rollout = engine.generate([prompts[i] for i in batch], params,
                                      seeds=[rng.derive_seed(params.seed, i) for i in batch])
            records += response_records(rollout, tokenizer)
            progress.update(n=len(batch))
    first_of_replica = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
    gathered = collectives.all_gather_object((dp_rank, records) if first_of_replica else None)
    if dist.get_rank() == 0:
        ordered = [r for _, part in sorted(p for p in gathered if p is not None) for r in part]
        out = Path(job["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(out) as f:
            for record in ordered:
                f.write(json.dumps(record) + "\n")
    distributed.shutdown()


def rank_main(argv: list[str]) -> None:
    """Entry point of a launched rank: argv = [job as JSON]."""
    run_generation(json.loads(argv[0]))


def generate_main(argv: list[str]) -> int:
    parser = errors.ArgumentParser(prog="aligner generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="aligner checkpoint directory")
    parser.add_argument("--prompts", required=True, help='JSONL with {"prompt": ...} or {"prompt_ids": [...]}')
    parser.add_argument("--out", required=True, help="output JSONL")
    parser.add_argument("overrides", nargs="*", help=f"key=value, keys: {', '.join(OVERRIDES)}")
    args = parser.parse_args(argv)
    values = parse_overrides(args.overrides)
    try:
        sampling_params(values)  # validates the sampling values
    except ValueError as e:
        raise UsageError(str(e), "aligner generate sampling.*", "fix that override") from None
    for what, path in (("--model", args.model), ("--prompts", args.prompts)):
        if not Path(path).exists():
            raise errors.UserError(f"{path} does not exist", f"aligner generate {what}",
                                   f"pass {what} an existing path")
    if values["steerlm.attributes"]:  # checked here, before any rank starts
        trained = read_metadata(args.model).get("steerlm")
        if trained is None:
            raise UsageError(f"{args.model} is not a SteerLM checkpoint", "steerlm.attributes",
                             "train one with `aligner train steerlm`, or drop steerlm.attributes")
        try:
            parse_condition(values["steerlm.attributes"], trained["attributes"], trained["scale"])
        except ValueError as e:
            raise UsageError(str(e), "steerlm.attributes", f"use attributes of {trained['attributes']}") from None
    job = {"model": str(Path(args.model).resolve()), "prompts": str(Path(args.prompts).resolve()),
           "out": str(Path(args.out).resolve()), "values": values}
    nproc = values["launcher.nproc_per_node"]
    if nproc == 1 or "WORLD_SIZE" in os.environ:  # a single rank, or torchrun/srun started every rank
        run_generation(job)
        return 0
    launch("aligner.generation.cli:rank_main", [json.dumps(job)], nproc)
    return 0


if __name__ == "__main__":
    sys.exit(generate_main(sys.argv[1:]))
