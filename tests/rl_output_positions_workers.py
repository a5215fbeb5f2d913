"""Rank entry point of tests/integration/test_rl_output_positions.py: the RL passes with the output layer
computed only at the response positions (`read_positions.output_at`) against the same passes with the
full logits, in one 2-rank launch that re-initialises megatron's parallel state per layout (TP=2 with and
without sequence parallelism, PP=2, whose last stage holds the whole vocabulary, and CP=2). Per layout
and packing it records the largest differences of the per-response-token log-probs (the old-log-prob /
reference pass), of the policy loss's reports and of every gradient, and how many positions the output
layer saw each way; rank 0 writes them to <workdir>/results.json."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

VOCAB = 300
PACKINGS = {"padded": {"packed": False, "capacity": None, "flat": False},
            "packed_rows": {"packed": True, "capacity": 24, "flat": False},
            "packed_flat": {"packed": True, "capacity": None, "flat": True}}
# name: (TP, PP, CP, sequence parallelism)
LAYOUTS = {"tp2": (2, 1, 1, False), "tp2_sp": (2, 1, 1, True), "pp2": (1, 2, 1, False),
           "cp2": (1, 1, 2, False)}


def model_config(tp: int, pp: int, cp: int, sp: bool):
    from aligner.config.schema import ModelConfig

    cfg = OmegaConf.structured(ModelConfig)
    cfg.update(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
               seq_length=64, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
               context_parallel_size=cp, sequence_parallel=sp)
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


def sample_groups():
    """Two micro-batches of three samples: prompts longer than their responses, as in RL."""
    from aligner.algorithms.online.samples import Sample

    g = torch.Generator().manual_seed(5)

    def sample(prompt: int, response: int, advantage: float):
        ids = torch.randint(3, VOCAB, (prompt + response,), generator=g).tolist()
        engine = (-torch.rand(response, generator=g)).tolist()
        return Sample(SimpleNamespace(ids=ids[:prompt]), ids[prompt:], engine, True, advantage=advantage)

    return [[sample(9, 3, 1.0), sample(6, 5, -0.5), sample(12, 2, 0.3)],
            [sample(7, 4, -1.0), sample(10, 1, 0.7), sample(5, 6, 0.2)]]


def output_rows(model, run) -> tuple[object, int]:
    """(run(), how many positions the output layer computed during it) on the last stage (0 elsewhere)."""
    from aligner.models.checkpoint import unwrap

    gpt, seen = unwrap(model), []
    if not gpt.post_process:
        return run(), 0
    handle = gpt.output_layer.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[:2].numel()))
    try:
        return run(), sum(seen)
    finally:
        handle.remove()


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference; equal infinities (tokens outside top-k / top-p: log q = -inf) count as equal."""
    return max((torch.where(x == y, 0.0, (x - y).abs()).max().item() for x, y in zip(a, b)), default=0.0)


def rl_checks(model, micro: list[dict], length: int, out: dict, tag: str) -> None:
    """The log-prob pass (sampling-filtered distribution) and the policy loss's forward and backward."""
    from megatron.core import parallel_state as ps

    from aligner.algorithms.online.loss import PolicyLoss, logprobs_output, token_logprob_values, token_values
    from aligner.algorithms.shared.sequence_logprobs import collected
    from aligner.config.rl_schema import RLAlgorithmConfig
    from aligner.generation.types import SamplingParams
    from aligner.models.forward_step import collect, make_forward_step, run_micro_batches

    tempered = SamplingParams(temperature=0.8, max_new_tokens=6)
    filtered = tempered.replace(top_k=20, top_p=0.9)  # the logits all-gathered over TP and filtered
    logprobs, rows = {}, {}
    for params in (filtered, tempered):  # the second is kept: the loss below needs finite log-probs
        for read in (True, False):
            step = make_forward_step(token_logprob_values(VOCAB, params), collect(logprobs_output), read)
            logprobs[read], rows[read] = output_rows(model, lambda: collected(model, step, micro, length))
        out[f"{tag}_logprobs_top_k" if params is filtered else f"{tag}_logprobs"] = max_diff(logprobs[True],
                                                                                              logprobs[False])
    out[f"{tag}_rows"] = [rows[True], rows[False]]
    if ps.is_pipeline_last_stage():
        g = torch.Generator().manual_seed(9)
        for batch, values in zip(micro, logprobs[False]):
            batch["old_logprobs"] = values + 0.05 * torch.randn(values.shape, generator=g)
            batch["ref_logprobs"] = values + 0.1 * torch.randn(values.shape, generator=g)
    a = OmegaConf.structured(RLAlgorithmConfig)
    a.kl.coef, a.entropy_coef = 0.1, 0.01
    reports, grads = {}, {}
    for read in (True, False):
        step = make_forward_step(token_values(VOCAB, tempered, entropy_grad=True), PolicyLoss(a, 6), read)
        model.zero_grad(set_to_none=True)
        model.train()
        reports[read] = run_micro_batches(model, step, micro, length, forward_only=False)
        grads[read] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out[f"{tag}_loss"] = max((abs(x[k] - y[k]).item() for x, y in zip(reports[True], reports[False]) for k in x),
                             default=0.0)
    out[f"{tag}_grads"] = max((grads[True][n] - grad).abs().max().item() / max(1.0, grad.abs().max().item())
                              for n, grad in grads[False].items())
    out[f"{tag}_grads_complete"] = grads[True].keys() == grads[False].keys() and len(grads[False]) > 0
    out[f"{tag}_grads_norm"] = sum(grad.norm().item() for grad in grads[True].values())


def sequence_sum_checks(model, micro: list[dict], length: int, out: dict, tag: str) -> None:
    """Under CP (where RL's per-token layout does not go) the sequence log-prob sums of the preference
    trainers and the reference, which the same forward step computes."""
    from aligner.algorithms.shared.sequence_logprobs import collected
    from aligner.models.forward_step import collect, label_logprobs, make_forward_step, sequence_sums

    sums, rows = {}, {}
    for read in (True, False):
        step = make_forward_step(label_logprobs(VOCAB),
                                 collect(lambda values, local, batch: sequence_sums(values, local, batch)[0]), read)
        sums[read], rows[read] = output_rows(model, lambda: collected(model, step, micro, length))
    out[f"{tag}_sums"] = max_diff(sums[True], sums[False])
    out[f"{tag}_rows"] = [rows[True], rows[False]]


def phase(name: str, out: dict) -> None:
    from aligner.algorithms.online.loss import rl_micro_batches
    from aligner.models.policy import build_policy
    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything

    tp, pp, cp, sp = LAYOUTS[name]
    distributed.init_model_parallel(tp, pp, cp)
    seed_everything(1)
    model = build_policy(model_config(tp, pp, cp, sp), VOCAB)
    for packing, options in PACKINGS.items():
        if cp > 1 and options["flat"]:
            continue  # flat rows are built without CP only
        micro, length = rl_micro_batches(sample_groups(), 0, options, multiple=4)
        out[f"{name}_{packing}_response_tokens"] = int(sum(b["loss_mask"].sum().item() for b in micro))
        out[f"{name}_{packing}_positions"] = sum(b["tokens"].numel() for b in micro)
        if cp > 1:
            sequence_sum_checks(model, micro, length, out, f"{name}_{packing}")
        else:
            rl_checks(model, micro, length, out, f"{name}_{packing}")


def main(argv: list[str]) -> None:
    from aligner.runtime import distributed

    workdir = Path(argv[0])
    distributed.init_process_group()
    torch.set_num_threads(1)
    results = {}
    for name in LAYOUTS:
        out, start = {}, time.perf_counter()
        phase(name, out)
        out[f"{name}_seconds"] = time.perf_counter() - start
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        results[name] = gathered
    if dist.get_rank() == 0:
        (workdir / "results.json").write_text(json.dumps(results, indent=1))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
