"""Rank entry points for the preference parity tests (tests/integration/test_preference_parity.py).

`reference WORKDIR TOKENIZER`: one process, TP=PP=CP=DP=1. Saves the initial weights as a
checkpoint (the policy and its reference both start from it, as with `model.pretrained`), then runs
two optimizer steps of every case through `SequenceTrainer.train_step` and saves the metrics of
both steps, the gradients of the first and the parameters after the second. It also compares the
three reference modes and packed against padded batches, in the same process.
`parallel WORKDIR TOKENIZER LAYOUTS_JSON`: every layout in turn, in one launch (megatron's parallel
state is rebuilt for each), repeats every case and writes the largest differences per quantity.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tests.parity_worker import global_name, my_shard_of, with_layout

STEPS = 2
CASES = {  # name -> (algorithm, packed, reference mode)
    "dpo": ("dpo", False, "model"),
    "dpo_packed": ("dpo", True, "model"),
    "kto": ("kto", False, "model"),
}
METRICS = {"dpo": ("loss", "loss/preference", "loss/sft", "accuracy", "reward/chosen", "reward/rejected",
                   "logps/chosen", "grad_norm"),
           "kto": ("loss", "kl", "reward/desirable", "reward/undesirable", "logps/desirable", "fraction/desirable",
                   "grad_norm")}


def make_config(workdir: Path, tokenizer: str, algorithm: str, packed: bool, mode: str, layout: dict):
    from aligner.config.preference_schema import DPORunConfig, KTORunConfig

    cfg = OmegaConf.structured(DPORunConfig if algorithm == "dpo" else KTORunConfig)
    cfg.run_dir = str(workdir / f"run_{algorithm}_{mode}")
    cfg.tokenizer.path = tokenizer
    cfg.data.train_path = str(workdir / f"{algorithm}.jsonl")
    cfg.data.packing = packed
    cfg.model.seq_length = 64
    cfg.model.pretrained = str(workdir / "init")
    cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size = 2, 8
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.scheduler = 1e-3, 0, "constant"
    cfg.reference.mode = mode
    if algorithm == "dpo":
        cfg.dpo.beta, cfg.dpo.sft_weight = 0.5, 0.1
    else:
        cfg.kto.beta, cfg.kto.undesirable_weight = 0.5, 1.5
    return with_layout(cfg, layout)


def write_data(workdir: Path) -> None:
    from aligner.data.preference import synthetic_preferences, synthetic_unpaired, write_jsonl

    write_jsonl(workdir / "dpo.jsonl", synthetic_preferences(64, seed=11))
    write_jsonl(workdir / "kto.jsonl", synthetic_unpaired(64, seed=12))


def run_case(workdir: Path, tokenizer_path: str, case: str, layout: dict, mode: str | None = None,
             packed: bool | None = None) -> dict:
    """Two training steps of `case` under `layout`: metrics, step-1 gradients and final parameters
    (global names, this rank's shards)."""
    from aligner.algorithms.preference.losses import DPO, KTO
    from aligner.algorithms.shared.sequence_trainer import SequenceFormat, SequenceTrainer
    from aligner.algorithms.shared.sequence_logprobs import sequence_loss_step
    from aligner.data.preference import load_preference_dataset, load_unpaired_dataset
    from aligner.data.tokenizer import load_tokenizer
    from aligner.models import checkpoint
    from aligner.models.policy import build_policy
    from aligner.models.training import wrap_for_training
    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything

    algorithm_name, case_packed, case_mode = CASES[case]
    mode = mode or case_mode
    packed = case_packed if packed is None else packed
    cfg = make_config(workdir, tokenizer_path, algorithm_name, packed, mode, layout)
    m = cfg.model
    distributed.init_model_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                    m.context_parallel_size)
    seed_everything(cfg.trainer.seed)
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = len(tokenizer)
    gpt = build_policy(m, vocab)
    if not (workdir / "init").exists():
        checkpoint.save_checkpoint(workdir / "init", gpt, m, vocab)
    model, optimizer, scheduler = wrap_for_training(gpt, m, cfg.optim)
    if algorithm_name == "dpo":
        algorithm = DPO(cfg.dpo)
        data = load_preference_dataset(cfg.data.train_path, tokenizer, max_length=m.seq_length)
    else:
        algorithm = KTO(cfg.kto)
        data = load_unpaired_dataset(cfg.data.train_path, tokenizer, max_length=m.seq_length)
    packing = {"packed": packed, "capacity": m.seq_length if packed else None}
    trainer = SequenceTrainer(cfg, model, optimizer, scheduler, sequence_loss_step(algorithm.loss, vocab),
                                data, None, SequenceFormat(algorithm, tokenizer.pad_token_id), vocab, tokenizer,
                                algorithm=algorithm, reference_mode=mode, packing=packing)
    trainer.resume()
    result = {"metrics": []}
    for step in range(STEPS):
        result["metrics"].append({k: v for k, v in trainer.train_step().items() if k in METRICS[algorithm_name]})
        if step == 0:
            result["grads"] = {global_name(n, m): p.main_grad.detach().clone() for n, p in gpt.named_parameters()}
    result["params"] = {global_name(n, m): p.detach().clone() for n, p in gpt.named_parameters()}
    result["param_objects"] = {global_name(n, m): p for n, p in gpt.named_parameters()}
    return result


def compare(a: dict, b: dict) -> dict:
    """Largest differences between two single-process results (same layout)."""
    out = {"metrics": max(abs(x[k] - y[k]) for x, y in zip(a["metrics"], b["metrics"]) for k in x)}
    for key in ("grads", "params"):
        out[key] = max((a[key][n] - b[key][n]).abs().max().item() for n in a[key])
    return out


def reference(workdir: Path, tokenizer_path: str) -> None:
    from aligner.runtime import distributed

    distributed.init_process_group()
    torch.set_num_threads(1)
    write_data(workdir)
    results = {case: run_case(workdir, tokenizer_path, case, {}) for case in CASES}
    torch.save({case: {k: v for k, v in r.items() if k != "param_objects"} for case, r in results.items()},
               workdir / "reference.pt")
    checks = {f"dpo_{mode}": compare(run_case(workdir, tokenizer_path, "dpo", {}, mode=mode), results["dpo"])
              for mode in ("cpu_swap", "precompute")}
    checks["kto_precompute"] = compare(run_case(workdir, tokenizer_path, "kto", {}, mode="precompute"), results["kto"])
    checks["dpo_packed_vs_padded"] = compare(results["dpo_packed"], results["dpo"])
    checks["dpo_first_step"] = results["dpo"]["metrics"][0]
    checks["kto_first_step"] = results["kto"]["metrics"][0]
    (workdir / "reference_checks.json").write_text(json.dumps(checks, indent=1))
    distributed.shutdown()


def parallel(workdir: Path, tokenizer_path: str, layouts: dict) -> None:
    from aligner.runtime import distributed

    distributed.init_process_group()
    torch.set_num_threads(1)
    ref = torch.load(workdir / "reference.pt")
    report = {}
    for name, (layout, cases) in layouts.items():
        for case in cases:
            result = run_case(workdir, tokenizer_path, case, layout)
            params = result["param_objects"]
            # The trainer shares the metrics with every pipeline stage. At step 1 every pair is a tie
            # (policy == reference), so float noise may flip its accuracy: it is compared from step 2 on.
            diffs = {"metrics": max(abs(a[k] - b[k]) for i, (a, b) in enumerate(zip(result["metrics"],
                                                                                    ref[case]["metrics"]))
                                    for k in a if k != "grad_norm" and (i, k) != (0, "accuracy"))}
            diffs["grad_norm"] = max(abs(a["grad_norm"] - b["grad_norm"])
                                     for a, b in zip(result["metrics"], ref[case]["metrics"]))
            for key in ("grads", "params"):
                diffs[key] = max((value - my_shard_of(n, ref[case][key][n], params[n])).abs().max().item()
                                 for n, value in result[key].items())
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, diffs)
            report[f"{name}/{case}"] = {k: max(d[k] for d in gathered if k in d) for k in ("metrics", "grad_norm",
                                                                                        "grads", "params")}
    if dist.get_rank() == 0:
        (workdir / "parallel_diffs.json").write_text(json.dumps(report, indent=1))
    distributed.shutdown()


def main(argv: list[str]) -> None:
    mode, workdir, tokenizer_path = argv[0], Path(argv[1]), argv[2]
    if mode == "reference":
        reference(workdir, tokenizer_path)
    else:
        parallel(workdir, tokenizer_path, json.loads(argv[3]))


if __name__ == "__main__":
    main(sys.argv[1:])
