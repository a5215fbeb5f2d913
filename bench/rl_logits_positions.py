"""The RL passes' output layer at the response positions only (`aligner.models.read_positions.output_at`)
against the full logits, in one process, on the shapes of bench/rl_vs_trl.py with long prompts: its
policy's architecture (Llama 4L/128h/4 heads/ffn 512/vocab 512, random weights: only the shapes matter),
32 samples of `--prompt-tokens` (256) prompt and `--response-tokens` (16) response tokens in one packed
micro-batch (`aligner train grpo`'s layout on the local spec: flat packed), fp32, 1 thread.

For the two passes of a step that read log-probs, the forward-only log-prob pass (old / reference
log-probs) and the policy loss's forward + backward, each way (`make_forward_step(...,
output_at_read_positions=False|True)`):
* logits MiB: what the output layer returns (the logits) per micro-batch;
* peak MiB: the peak of CPU tensor memory the pass allocates (torch's profiler, allocation events);
* CPU s: median CPU seconds of the process over `--repeats` runs, the two ways interleaved (CPU time,
  not wall time: other processes on a shared machine stretch the wall time, not this).
Ratios are after / before (the response-positions way over the full logits), measured in the same run.

    python bench/rl_logits_positions.py [--prompt-tokens 256] [--response-tokens 16] [--vocab 512] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SAMPLES = 32  # bench/rl_vs_trl.py: 8 prompts x 4 samples, one micro-batch


def build(vocab: int, prompt: int, response: int, seed: int = 1234):
    """(policy, micro-batches, length, sampling params, algorithm config) on one process (world of one)."""
    import torch
    from omegaconf import OmegaConf

    from aligner.algorithms.online.loss import rl_micro_batches
    from aligner.algorithms.online.samples import Sample
    from aligner.config.rl_schema import RLAlgorithmConfig
    from aligner.config.schema import ModelConfig
    from aligner.generation.types import SamplingParams
    from aligner.models.policy import build_policy
    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything

    distributed.init_process_group()
    distributed.init_model_parallel()
    seed_everything(seed)
    m = OmegaConf.structured(ModelConfig)
    m.update(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
             seq_length=prompt + response, max_position_embeddings=max(2048, prompt + response))
    model = build_policy(m, vocab)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(SAMPLES):
        ids = torch.randint(3, vocab, (prompt + response,), generator=g).tolist()
        samples.append(Sample(SimpleNamespace(ids=ids[:prompt]), ids[prompt:], [-1.0] * response, True,
                              advantage=float(i % 4) - 1.5))
    micro, length = rl_micro_batches([samples], 0, {"packed": True, "capacity": None, "flat": True}, multiple=1)
    for batch in micro:
        batch["old_logprobs"] = batch["ref_logprobs"] = batch["engine_logprobs"].clone()
    a = OmegaConf.structured(RLAlgorithmConfig)
    a.kl.coef = 0.04  # bench/rl_vs_trl.py's k3 KL in the loss
    return model, micro, length, SamplingParams(temperature=1.0, max_new_tokens=response), a


def passes(model, micro, length, params, a, vocab: int) -> dict:
    """name -> read -> a function running that pass once."""
    from aligner.algorithms.online.loss import PolicyLoss, logprobs_output, token_logprob_values, token_values
    from aligner.algorithms.shared.sequence_logprobs import collected
    from aligner.models.forward_step import collect, make_forward_step, run_micro_batches

    def logprobs(read):
        step = make_forward_step(token_logprob_values(vocab, params), collect(logprobs_output), read)
        return lambda: collected(model, step, micro, length)

    def train(read):
        step = make_forward_step(token_values(vocab, params, entropy_grad=False), PolicyLoss(a, params.max_new_tokens),
                                 read)

        def run():
            model.zero_grad(set_to_none=True)
            model.train()
            return run_micro_batches(model, step, micro, length, forward_only=False)

        return run

    return {"logprobs": {read: logprobs(read) for read in (False, True)},
            "train": {read: train(read) for read in (False, True)}}


def logits_bytes(model, run) -> int:
    """Bytes of what the output layer returned during `run()`."""
    seen = []
    handle = model.output_layer.register_forward_hook(lambda module, args, out: seen.append(out[0].nbytes))
    try:
        run()
    finally:
        handle.remove()
    return sum(seen)


def tensor_peak(run) -> int:
    """The peak of CPU tensor bytes allocated during `run()` and not yet freed (torch's profiler): the
    allocator's running total at its highest, less its total before the run's first allocation."""
    import torch
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        kind, fields = node.typed
        if kind == _EventType.Allocation and fields.device.type == "cpu":
            events.append((node.start_time_ns, fields.total_allocated, fields.alloc_size))
    events.sort()
    before = events[0][1] - events[0][2]  # alloc_size is negative for a free
    return max(total for _, total, _ in events) - before


def measure(prompt: int, response: int, vocab: int, repeats: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    model, micro, length, params, a = build(vocab, prompt, response)
    runs = passes(model, micro, length, params, a, vocab)
    out = {"prompt_tokens": prompt, "response_tokens": response, "vocab": vocab, "samples": SAMPLES,
           "positions": sum(b["tokens"].numel() for b in micro), "read_positions": int(sum(b["loss_mask"].sum()
                                                                                        for b in micro))}
    for name, ways in runs.items():
        for run in ways.values():
            run()  # warm-up
        seconds = {False: [], True: []}
        for _ in range(repeats):
            for read, run in ways.items():
                start = time.process_time()
                run()
                seconds[read].append(time.process_time() - start)
        result = {}
        for read, run in ways.items():
            result["after" if read else "before"] = {"logits_mib": logits_bytes(model, run) / 2 ** 20,
                                                     "peak_mib": tensor_peak(run) / 2 ** 20,
                                                     "s": statistics.median(seconds[read])}
        result["ratios"] = {k: result["after"][k] / result["before"][k] for k in result["before"]}
        out[name] = result
    return out


def report(r: dict) -> None:
    print(f"\nOutput layer at the response positions only, against the full logits: {r['samples']} samples x "
          f"({r['prompt_tokens']} prompt + {r['response_tokens']} response) tokens, vocab {r['vocab']}, one packed "
          f"micro-batch ({r['read_positions']} of {r['positions']} positions read); after / before, same run\n")
    print("| pass | logits MiB before | after | ratio | peak MiB before | after | ratio | CPU s before | after | "
          "ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("logprobs", "train"):
        b, a, q = r[name]["before"], r[name]["after"], r[name]["ratios"]
        print(f"| {name} | {b['logits_mib']:.1f} | {a['logits_mib']:.1f} | {q['logits_mib']:.3f} | "
              f"{b['peak_mib']:.1f} | {a['peak_mib']:.1f} | {q['peak_mib']:.3f} | {b['s']:.4f} | {a['s']:.4f} | "
              f"{q['s']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line (last line)")
    args = parser.parse_args()
    r = measure(args.prompt_tokens, args.response_tokens, args.vocab, args.repeats, args.threads)
    report(r)
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
