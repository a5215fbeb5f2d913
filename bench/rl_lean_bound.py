"""How fast can the GRPO step of bench/rl_vs_trl.py be at all on this machine? A lean bound, measured.

The matmul floor (rl_vs_trl.matmul_floor) counts only the step's dense matmul FLOPs at the core's best GEMM
rate. This measures what a lean, compiled implementation of the same step reaches, with no framework
around it: the baseline's HF Llama policy (transformers, SDPA attention) under `torch.compile` (inductor,
static shapes), on the step's shapes (32 samples of prompt + response tokens), fp32:
  * train: the policy's forward with grad, the sampled tokens' log-probs, GRPO's clipped token-mean loss
    with the k3 KL to given reference log-probs, backward, grad-norm clipping and AdamW's step;
  * reference: the reference's forward and the sampled tokens' log-probs, without grad;
  * generate: NOT measured: credited at its matmul floor (the least any decoder can spend).
Sampling, scoring, data and logging are left out. The bound is train + reference + generate's floor, CPU
seconds per step (process time, `--threads` torch threads): an implementation of the step that does all
its work cannot be faster, so TRL's step over it bounds the ratio over TRL any implementation reaches
here.
With `--value DIR` (a LlamaForSequenceClassification: PPO's reward model and value-model initialisation) it
also measures, compiled alike, the parts PPO adds:
  * value_forward: the value model's per-token values without grad (a reward model's forward costs the
    same: the score head read at the last token); PPO runs two a step, the values and the reward;
  * value_train: the value model's forward with grad, PPO's clipped value loss (cliprange 0.2) on
    returns, backward, grad-norm clipping and AdamW's step.
PPO's bound is then train (the GRPO step above, whose k3 KL term is a few elementwise ops more than
PPO's surrogate) + reference + 2 x value_forward + value_train + PPO's generate floor.

    python bench/rl_lean_bound.py --policy ART/policy [--value ART/reward] --prompt-tokens 4 --response-tokens 16
        [--threads 1]

prints one JSON object; bench/rl_vs_trl.py runs it in a fresh process and reports it beside the floor.
"""
from __future__ import annotations

import argparse
import json
import time


def measure(policy: str, samples: int, prompt_tokens: int, response_tokens: int, threads: int,
            steps: int = 30, value: str | None = None) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(policy, torch_dtype=torch.float32, attn_implementation="sdpa")
    reference = LlamaForCausalLM.from_pretrained(policy, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    model.config.use_cache = reference.config.use_cache = False
    vocab = model.config.vocab_size
    length = prompt_tokens + response_tokens
    ids = torch.randint(0, vocab, (samples, length))
    mask = torch.zeros(samples, length - 1)
    mask[:, prompt_tokens - 1:] = 1.0  # the response tokens' predictions
    advantages = torch.randn(samples, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)

    def token_logprobs(net, tokens):
        logits = net(input_ids=tokens).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    @torch.compile(dynamic=False)
    def reference_logprobs(tokens):
        with torch.no_grad():
            return token_logprobs(reference, tokens)

    @torch.compile(dynamic=False)
    def loss_of(tokens, ref, adv, m):
        logprobs = token_logprobs(model, tokens)
        ratio = torch.exp(logprobs - logprobs.detach())  # one update per rollout: old = current
        policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        d = ref - logprobs
        kl = torch.exp(d) - d - 1  # k3
        return ((policy + 0.04 * kl) * m).sum() / m.sum()

    def train_step(ref):
        loss_of(ids, ref, advantages, mask).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(fn, n):
        for _ in range(5):  # compile and warm up
            fn()
        start = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - start) / n

    ref = reference_logprobs(ids)
    result = {"reference_s": timed(lambda: reference_logprobs(ids), steps),
              "train_s": timed(lambda: train_step(ref), steps), "threads": threads, "torch": torch.__version__}
    if value is not None:
        result.update(measure_value(value, ids, mask, timed, steps))
    return result


def measure_value(path: str, ids, mask, timed, steps: int) -> dict:
    """PPO's value-model parts (see the module doc) on the policy's token batch."""
    import torch
    from transformers import LlamaForSequenceClassification

    critic = LlamaForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
    scorer = LlamaForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    critic.config.use_cache = scorer.config.use_cache = False
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-5, weight_decay=0.0)

    def values_of(net, tokens):  # per-token values [n, s - 1]: the state before each predicted token
        return net.score(net.model(input_ids=tokens).last_hidden_state)[:, :-1, 0].float()

    @torch.compile(dynamic=False)
    def value_forward(tokens):
        with torch.no_grad():
            return values_of(scorer, tokens)

    old = value_forward(ids)
    returns = old + torch.randn(old.shape)

    @torch.compile(dynamic=False)
    def value_loss(tokens, old_values, target, m):
        v = values_of(critic, tokens)
        clipped = old_values + (v - old_values).clamp(-0.2, 0.2)
        return (torch.maximum((v - target) ** 2, (clipped - target) ** 2) * m).sum() / m.sum() / 2

    def value_train():
        value_loss(ids, old, returns, mask).backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {"value_forward_s": timed(lambda: value_forward(ids), steps), "value_train_s": timed(value_train, steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", required=True, help="the baseline's HF policy directory")
    parser.add_argument("--value", help="PPO: the baseline's seq-cls reward model (value-model initialisation)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--response-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(measure(args.policy, args.samples, args.prompt_tokens, args.response_tokens, args.threads,
                             value=args.value)))


if __name__ == "__main__":
    main()
