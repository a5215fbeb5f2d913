"""Rank entry point of tests/integration/test_generation_backends.py: 2 ranks, TP=1 (two data-parallel replicas).

* `generate_on_rank0`, the routing of the TensorRT-LLM backend, with a megatron engine on rank 0 standing in
  for TensorRT-LLM (which cannot run here): each replica's rollout must equal what its own engine generates
  for the same prompts and seeds (a replica may ask for nothing);
* `export_hf`, the directory TensorRT-LLM starts from, loaded into `transformers`: its greedy tokens must be
  the megatron engine's.
Rank 0 writes the measured quantities to <workdir>/results.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.generation_workers import MAX_NEW, SAMPLED, VOCAB, prompts, setup


def main(argv: list[str]) -> None:
    from aligner.generation.backends import build_engine, export_hf, generate_on_rank0
    from aligner.generation.types import SamplingParams
    from aligner.runtime import distributed

    workdir = Path(argv[0])
    distributed.init_process_group()
    torch.set_num_threads(1)
    model, m = setup(1, 1)
    engine = build_engine("megatron", model, m, VOCAB, None, batch_size=8)
    rank, every = dist.get_rank(), prompts()
    params = SamplingParams(**SAMPLED, max_new_tokens=MAX_NEW, seed=3)
    out = {"engine": type(engine).__name__}
    for case, split in (("even", (3, 5)), ("rank 1 asks nothing", (5, 5))):
        mine = every[:split[0]] if rank == 0 else every[split[0]:split[1]]
        seeds = [100 + i for i in (range(split[0]) if rank == 0 else range(split[0], split[1]))]
        own = engine.generate(mine, params, seeds) if mine else None
        routed = generate_on_rank0(engine if rank == 0 else None, mine, params, seeds, pad_id=engine.pad_id)
        out[case] = {"asked": len(mine), "got": len(routed),
                     "same_tokens": own is None or routed.responses() == own.responses(),
                     "same_stops": own is None or routed.stop_reason == own.stop_reason,
                     "logprob_diff": 0.0 if own is None else max(
                         abs(a - b) for x, y in zip(routed.response_logprobs(), own.response_logprobs())
                         for a, b in zip(x, y))}
    out["sleep_wake"] = sleep_and_wake(model, m, engine, every[:2], params)
    export = workdir / "hf"
    export_hf(model, m, VOCAB, export if rank == 0 else None)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        greedy = engine.generate(every, SamplingParams(greedy=True, max_new_tokens=MAX_NEW)).responses()
        hf = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
        theirs = []
        with torch.no_grad():
            for p in every:
                ids = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                  pad_token_id=0)
                theirs.append(ids[0, len(p):].tolist())
        (workdir / "results.json").write_text(json.dumps({"ranks": gathered, "hf_greedy_equal": theirs == greedy,
                                                          "hf_files": sorted(f.name for f in export.iterdir())}))
    distributed.shutdown()


class Recording:
    """The engine under JobTensorRTLLM, its calls recorded (the megatron engine generates on rank 0)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, *args):
        self.calls.append("generate")
        return self.engine.generate(*args)

    def refit(self, stream):
        self.calls.append("refit")

    def sleep(self):
        self.calls.append("sleep")

    def wake(self):
        self.calls.append("wake")


def sleep_and_wake(model, m, engine, prompts, params) -> list[str]:
    """The TensorRT-LLM backend's engine as the RL loops drive it: asleep after a step's generation (once,
    however often asked), woken by the next refit or generation; only rank 0's engine is called."""
    from aligner.generation.backends import JobTensorRTLLM

    job = JobTensorRTLLM.__new__(JobTensorRTLLM)  # its __init__ requires TensorRT-LLM
    job.model, job.model_cfg, job.vocab_size, job.pad_id = model, m, VOCAB, engine.pad_id
    job.engine, job.asleep = Recording(engine), False
    job.sleep()
    job.sleep()
    job.refit()
    job.sleep()
    job.generate(prompts, params, [1, 2])
    job.generate(prompts, params, [1, 2])
    return job.engine.calls


if __name__ == "__main__":
    main(sys.argv[1:])
