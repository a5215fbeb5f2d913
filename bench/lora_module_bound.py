"""The Megatron actor's own bound on bench/lora.py's LoRA GRPO step (issue 34's 2x target).

bench/lora.py's lean bound (`_lean`) times the step's parts as a compiled HF Llama with no framework. aligner's
actor is Megatron-core's GPTModel, so this times that model itself, with nothing of aligner's trainer around it:
the bench's tiny policy checkpoint, rank-16 adapters (alpha 32) on its four linears, the base frozen, and one
GRPO step's batch (32 rows of the 4-token prompt plus the run's mean response length, one padded length, as
`_lean`'s):
* reference: the forward with the adapters off, without gradients, and the response positions' log-probs;
* train: the forward with the adapters on, `_lean`'s GRPO loss (clipped ratio, k3 KL), backward, gradient
  clipping and AdamW on the adapters.
Each part runs eagerly and under torch.compile (Inductor, static shapes), and the faster counts. Generation is
credited with `_lean`'s decode-shaped matrix products, what an overhead-free KV-cache decoder spends. The sum is
what a step built on this model takes at best on this CPU, whatever surrounds it.

`python bench/lora_module_bound.py POLICY_CKPT THREADS RESPONSE_TOKENS OUT.json` runs it alone (one rank);
bench/lora.py runs it beside `_lean` and reports it with the bounds.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.rl_vs_trl import RUN as RL_RUN  # noqa: E402

RANK, ALPHA, PROMPT = 16, 32.0, 4  # the bench's adapters; the tiny run's prompt tokens (bench/lora.py's _lean)


def timed_cpu(fn, n: int = 20, warmup: int = 5) -> float:
    """CPU seconds a call of `fn`, the mean of `n` after `warmup`."""
    for _ in range(warmup):
        fn()
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n


def rank_main(argv: list[str]) -> None:
    """The rank's entry point (aligner.launch.local): `POLICY_CKPT RESPONSE_TOKENS OUT.json`."""
    import torch
    from omegaconf import OmegaConf

    from aligner.config.schema import LoraConfig
    from aligner.models import checkpoint, lora
    from aligner.models.read_positions import output_at
    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything

    policy, response_tokens, out = argv
    distributed.init_process_group()
    distributed.init_model_parallel(1, 1, 1)
    seed_everything(0)
    model, vocab = checkpoint.load_language_model(policy)
    lora.add_adapters(model, OmegaConf.structured(LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.0)))
    with torch.no_grad():  # B = 0 would make the adapters' backward cheaper than a trained run's
        for _, adapter in lora.adapters(model):
            adapter.b.normal_(0.0, 0.01)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, weight_decay=0.0)
    rows, response = RL_RUN["prompts_per_step"] * RL_RUN["num_generations"], round(float(response_tokens))
    tokens = torch.randint(0, vocab, (rows, PROMPT + response), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    advantages = torch.randn(rows, 1, generator=torch.Generator().manual_seed(1))

    # the output layer at the read positions only, as aligner's passes compute it (read_positions.output_at):
    # megatron's hidden states are [position, row, width], so (row r, position p) is p * rows + r
    read = torch.arange(PROMPT - 1, tokens.shape[1] - 1)
    read_rows = (read[None, :] * rows + torch.arange(rows)[:, None]).reshape(-1)

    def token_logprobs(net):
        logits = net(tokens, positions, None).reshape(rows, response, -1).float()  # [rows, response, vocab]
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, PROMPT:, None]).squeeze(-1)

    def reference(net):
        with torch.no_grad(), lora.disabled(model):
            return token_logprobs(net)

    def train(net, ref):
        logprobs = token_logprobs(net)
        ratio = torch.exp(logprobs - logprobs.detach())
        clip = RL_RUN["clip_eps"]
        policy_loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))
        d = ref - logprobs
        (policy_loss + RL_RUN["kl_beta"] * (torch.exp(d) - d - 1)).mean().backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()  # the trainer's mode (the checkpoint's dropout is 0, so eval would compute the same)
    with output_at(model, read_rows) as only_read:  # one hook for every call below, compiled ones included
        assert only_read
        result = timed_parts(model, reference, train)
    result.update(rows=rows, prompt=PROMPT, response=response, torch=torch.__version__,
                  threads=torch.get_num_threads())
    Path(out).write_text(json.dumps(result))
    distributed.shutdown()


def timed_parts(model, reference, train) -> dict:
    """The reference and train passes timed eagerly and under torch.compile, and the faster of each."""
    import torch

    ref = reference(model)
    result = {"eager": {"reference": timed_cpu(lambda: reference(model)),
                        "train": timed_cpu(lambda: train(model, ref))}}
    compiled = torch.compile(model, dynamic=False)
    start = time.perf_counter()
    reference(compiled), train(compiled, ref)
    result["compile_wall_s"] = time.perf_counter() - start
    result["compiled"] = {"reference": timed_cpu(lambda: reference(compiled)),
                          "train": timed_cpu(lambda: train(compiled, ref))}
    result["compiled_vs_eager_max_abs"] = (reference(compiled) - reference(model)).abs().max().item()
    result["best"] = {part: min(result["eager"][part], result["compiled"][part]) for part in ("reference", "train")}
    return result


def measure(policy: Path, threads: int, response_tokens: float, out: Path) -> dict:
    """Runs `rank_main` on one local rank with `threads` torch threads; its result."""
    from aligner.launch.local import launch

    launch("bench.lora_module_bound:rank_main", [str(policy), str(response_tokens), str(out)], 1,
           log_dir=out.parent / f"{out.stem}_logs", threads_per_rank=threads)
    return json.loads(out.read_text())


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__.split("\n\n")[-1])
    print(json.dumps(measure(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]))))
