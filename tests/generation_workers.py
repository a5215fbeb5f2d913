"""Rank entry point for the generation-engine tests (launched by tests/integration/test_generation_engine.py).

One 2-rank launch runs every multi-process check, re-initialising megatron's parallel state per phase:
  tp1 (TP=1, the 2 ranks are DP replicas): references by full recompute without a KV cache, both
      decode paths, trainer-side log-probs, seeds, stops, an optimizer step on the shared model, refit
      from weight streams, and the checkpoint + expected output for the CLI test;
  tp2 / pp2: the TP=1 weights loaded into TP=2 and PP=2 models, checked against the tp1 results.
Rank 0 writes every measured quantity to <workdir>/results.json; the pytest side asserts on it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tests.parity_worker import global_name, my_shard_of

VOCAB = 500  # padded to 512 at TP=1 and TP=2
PROMPT_LENGTHS = (3, 9, 1, 14, 6)
MAX_NEW = 10
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9)


def model_config(tp: int = 1, pp: int = 1):
    from aligner.config.schema import ModelConfig

    cfg = OmegaConf.structured(ModelConfig)
    cfg.update(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
               seq_length=64, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def setup(tp: int, pp: int, **fields):
    from aligner.models.gpt import build_gpt
    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything

    distributed.init_model_parallel(tp, pp, fields.get("context_parallel_size", 1))
    seed_everything(1)
    m = model_config(tp, pp)
    m.update(fields)
    return build_gpt(m, VOCAB), m


# ------------------------------------------------------------------------------------------ weights
@torch.no_grad()
def load_full_state(model, m, state: dict) -> None:
    for name, p in model.named_parameters():
        p.copy_(my_shard_of(name, state[global_name(name, m)], p))


# ------------------------------------------------------------------------------------- references
@torch.no_grad()
def recompute_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forward passes without a KV cache (TP=1, PP=1 model)."""
    model.eval()
    device = next(model.parameters()).device
    seq, logprobs = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([seq], device=device), torch.arange(len(seq), device=device)[None],
                       None)[0, -1, :VOCAB].float()
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        seq.append(token)
    return seq[len(prompt):], logprobs


@torch.no_grad()
def trainer_logprobs(model, prompt: list[int], response: list[int], params) -> list[float]:
    """Trainer-side log q(response) from one full forward (vocab-parallel logits, PP=1)."""
    from aligner.generation.trainer_logprobs import sampling_logprobs

    model.eval()
    device = next(model.parameters()).device
    seq = prompt + response
    logits = model(torch.tensor([seq], device=device), torch.arange(len(seq), device=device)[None], None)[0]
    positions = slice(len(prompt) - 1, len(seq) - 1)
    return sampling_logprobs(logits[positions], torch.tensor(response, device=device), params, VOCAB).tolist()


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)


def decode_modes(m) -> tuple[str, ...]:
    """The decode paths a layout runs: the compiled one needs TP=1."""
    return ("lean", "compiled", "megatron") if m.tensor_model_parallel_size == 1 else ("lean", "megatron")


def engines(model, m, **kwargs):
    from aligner.generation.megatron_engine import MegatronEngine

    return {mode: MegatronEngine(model, m, VOCAB, decode=mode, **kwargs) for mode in decode_modes(m)}


# ------------------------------------------------------------------------------------------ phases
def phase_tp1(workdir: Path, out: dict, ref: dict) -> None:
    from aligner.data.synthetic import corpus
    from aligner.data.tokenizer import build_tiny_tokenizer, load_tokenizer
    from aligner.generation import rng
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.generation.types import SamplingParams

    model, m = setup(1, 1)
    ref["state"] = {global_name(n, m): p.detach().clone() for n, p in model.named_parameters()}
    ps_ = prompts()
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)
    sampled = SamplingParams(max_new_tokens=MAX_NEW, seed=5, **SAMPLED)
    hot = SamplingParams(temperature=1.3, max_new_tokens=MAX_NEW, seed=6)

    # greedy: both decode paths against recomputation without cache; log-probs against the trainer side
    recomputed = [recompute_greedy(model, p, MAX_NEW) for p in ps_]
    ref["greedy"] = [r for r, _ in recomputed]
    ref["greedy_logprobs"] = [lp for _, lp in recomputed]
    eng = engines(model, m, eos_id=None)
    for mode, e in eng.items():
        roll = e.generate(ps_, greedy)
        out[f"tp1_{mode}_greedy_equal"] = roll.responses() == ref["greedy"]
        out[f"tp1_{mode}_greedy_vs_trainer_logprobs"] = max_diff(
            roll.response_logprobs(), [trainer_logprobs(model, p, r, greedy) for p, r in zip(ps_, ref["greedy"])])
        out[f"tp1_{mode}_greedy_vs_recompute_logprobs"] = max_diff(roll.response_logprobs(), ref["greedy_logprobs"])
    auto = MegatronEngine(model, m, VOCAB, eos_id=None)
    out["tp1_decode_auto"] = auto.decode
    from aligner.generation.types import GenerationBackend

    auto.sleep()
    auto.wake()
    out["tp1_protocol_sleep_wake"] = (isinstance(auto, GenerationBackend)
                                      and auto.generate(ps_, greedy).responses() == ref["greedy"]
                                      and len(auto.generate([], greedy)) == 0)

    # sampling: all paths agree; engine log-probs = trainer log-probs under the filtered distribution
    for name, params in (("sampled", sampled), ("hot", hot)):
        rolls = {mode: e.generate(ps_, params) for mode, e in eng.items()}
        ref[name] = rolls["lean"].responses()
        out[f"tp1_{name}_paths_equal"] = all(r.responses() == ref[name] for r in rolls.values())
        out[f"tp1_{name}_paths_logprob_diff"] = max(max_diff(r.response_logprobs(), rolls["lean"].response_logprobs())
                                                    for r in rolls.values())
        out[f"tp1_{name}_vs_trainer_logprobs"] = max_diff(
            rolls["lean"].response_logprobs(), [trainer_logprobs(model, p, r, params) for p, r in zip(ps_, ref[name])])
        ref[f"{name}_logprobs"] = rolls["lean"].response_logprobs()
    out["tp1_sampled_differs_from_greedy"] = ref["sampled"] != ref["greedy"]

    # seeds: reproducible, and independent of batch neighbours, position and batch size
    seeds = [rng.derive_seed(sampled.seed, i) for i in range(len(ps_))]
    again = eng["lean"].generate(ps_, sampled, seeds=seeds).responses()
    alone = eng["lean"].generate([ps_[3]], sampled, seeds=[seeds[3]]).responses()[0]
    shuffled = eng["lean"].generate([ps_[4], ps_[3], ps_[0]], sampled, seeds=[seeds[4], seeds[3], seeds[0]]).responses()
    small = MegatronEngine(model, m, VOCAB, eos_id=None, max_batch_size=2).generate(ps_, sampled).responses()
    other_seed = eng["lean"].generate(ps_, sampled.replace(seed=99)).responses()
    out["tp1_seed_reproducible"] = again == ref["sampled"]
    out["tp1_seed_independent_of_batch"] = (alone == ref["sampled"][3] and shuffled[1] == ref["sampled"][3]
                                            and shuffled[0] == ref["sampled"][4] and small == ref["sampled"])
    out["tp1_other_seed_differs"] = other_seed != ref["sampled"]

    # stops
    out.update(stop_checks(model, m, ps_, ref, workdir, "tp1"))

    # optimizer step on the shared model: generations change and follow the new weights
    out.update(train_step_checks(model, m, ps_))

    # refit from weight streams into a separately built model
    out.update(refit_checks(model, m, ps_, "tp1"))

    # checkpoint + expected output for the CLI test (sampled, seeds (seed, i) as the CLI derives them)
    from aligner.models.checkpoint import save_checkpoint

    tok_dir = workdir / "tokenizer"
    if dist.get_rank() == 0 and not tok_dir.exists():
        build_tiny_tokenizer(corpus(300, seed=0), tok_dir, vocab_size=VOCAB)
    dist.barrier()
    tokenizer = load_tokenizer(tok_dir)
    save_checkpoint(workdir / "ckpt", model, m, VOCAB, tokenizer=tokenizer)
    texts = ["12 + 7 =", "What is 3 * 4?", "9"]
    cli_prompts = [tokenizer(t)["input_ids"] for t in texts] + [ps_[1]]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=8, seed=3)
    expected = MegatronEngine(model, m, VOCAB, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                              tokenizer=tokenizer).generate(
        cli_prompts, params, seeds=[rng.derive_seed(3, i) for i in range(len(cli_prompts))])
    if dist.get_rank() == 0:
        with open(workdir / "cli_prompts.jsonl", "w") as f:
            for t in texts:
                f.write(json.dumps({"prompt": t}) + "\n")
            f.write(json.dumps({"prompt_ids": ps_[1]}) + "\n")
        (workdir / "cli_expected.json").write_text(json.dumps(
            {"response_ids": expected.responses(), "logprobs": expected.response_logprobs()}))


def stop_checks(model, m, ps_, ref, workdir: Path, tag: str) -> dict:
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.generation.types import SamplingParams

    out = {}
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)

    def expected_cut(stop_ids):
        lengths = []
        for r in ref["greedy"]:
            hits = [i for i, t in enumerate(r) if t in stop_ids]
            lengths.append(hits[0] + 1 if hits else len(r))
        return lengths

    eos = ref["greedy"][0][2]
    roll = MegatronEngine(model, m, VOCAB, eos_id=eos).generate(ps_, greedy)
    cut = expected_cut({eos})
    out[f"{tag}_eos_lengths_ok"] = roll.response_lengths.tolist() == cut
    out[f"{tag}_eos_prefix_ok"] = roll.responses() == [r[:n] for r, n in zip(ref["greedy"], cut)]
    out[f"{tag}_eos_reasons_ok"] = roll.stop_reason == ["eos" if n < MAX_NEW or r[-1] == eos else "length"
                                                        for r, n in zip(ref["greedy"], cut)]
    out[f"{tag}_eos_is_end_ok"] = roll.is_end.tolist() == [s != "length" for s in roll.stop_reason]
    n0 = int(roll.response_lengths[0])
    out[f"{tag}_eos_padding_ok"] = (bool((roll.response_ids[0, n0:] == roll.pad_id).all())
                                    and float(roll.logprobs[0, n0:].abs().sum()) == 0.0)

    stop = ref["greedy"][1][4]
    roll = MegatronEngine(model, m, VOCAB, eos_id=None).generate(ps_, greedy.replace(stop_token_ids=(stop,)))
    cut = expected_cut({stop})
    out[f"{tag}_stop_token_ok"] = (roll.responses() == [r[:n] for r, n in zip(ref["greedy"], cut)]
                                   and roll.stop_reason[1] == "stop_token")

    roll = MegatronEngine(model, m, VOCAB, eos_id=eos).generate(ps_, greedy.replace(min_new_tokens=5))
    first = ref["greedy"][0].index(eos)
    out[f"{tag}_min_new_tokens_ok"] = (all(eos not in r[:5] for r in roll.responses())
                                       and all(eos not in r[:-1] for r in roll.responses())
                                       and roll.responses()[0][:first] == ref["greedy"][0][:first]
                                       and roll.responses()[0] != ref["greedy"][0][:first + 1]
                                       and min(roll.response_lengths.tolist()) >= 5)

    # stop strings need a tokenizer; any decode function of ids works: map each id to one letter
    class Letters:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + t % 26) for t in ids)

    letters = Letters()
    text0 = letters.decode(ref["greedy"][0])
    target = text0[3:5]  # completed by the 5th token of sample 0 (or earlier if it occurs before)
    roll = MegatronEngine(model, m, VOCAB, eos_id=None, tokenizer=letters).generate(
        ps_, greedy.replace(stop_strings=(target,)))
    ok = True
    for r, got, reason in zip(ref["greedy"], roll.responses(), roll.stop_reason):
        n = next((k for k in range(1, len(r) + 1) if target in letters.decode(r[:k])), len(r))
        ok &= got == r[:n] and (reason == "stop_string") == (target in letters.decode(r[:n]))
    out[f"{tag}_stop_string_ok"] = ok and roll.stop_reason[0] == "stop_string" and len(roll.responses()[0]) <= 5
    return out


def train_step_checks(model, m, ps_) -> dict:
    from aligner.algorithms.shared.sft import sft_forward_step
    from aligner.algorithms.shared.training_step import forward_backward
    from aligner.config.schema import OptimConfig
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.generation.types import SamplingParams
    from aligner.models.training import wrap_for_training

    optim = OmegaConf.merge(OmegaConf.structured(OptimConfig), {"lr": 3e-2, "warmup_steps": 0,
                                                                "scheduler": "constant", "decay_steps": 10})
    ddp, optimizer, scheduler = wrap_for_training(model, m, optim)
    engine = MegatronEngine(ddp, m, VOCAB, eos_id=None)  # built on the trainer's wrapped model
    compiled = MegatronEngine(ddp, m, VOCAB, eos_id=None, decode="compiled")  # weights are graph inputs, not constants
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)
    ddp.train()
    before = engine.generate(ps_, greedy).responses()
    compiled_before = compiled.generate(ps_, greedy).responses()
    out = {"train_mode_restored": ddp.training and model.training}
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (4, 17), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(4, 16)}
    forward_step = sft_forward_step(VOCAB)
    for _ in range(2):
        forward_backward(ddp, optimizer, forward_step, [batch], 16)
        optimizer.step()
        scheduler.step(1)
    after = engine.generate(ps_, greedy).responses()
    out["train_generations_changed"] = after != before and compiled_before == before
    out["train_generations_follow_weights"] = (after == [recompute_greedy(model, p, MAX_NEW)[0] for p in ps_]
                                               and compiled.generate(ps_, greedy).responses() == after)
    check = engine.refit_check(ddp)
    out["train_refit_check_shared"] = check["shared"] and check["bitwise"] and check["max_abs_diff"] == 0.0
    engine.refit()  # shared: a no-op
    ddp.train()
    forward_backward(ddp, optimizer, forward_step, [batch], 16)  # training still works after generate
    out["train_after_generate_ok"] = True
    return out


def refit_checks(model, m, ps_, tag: str) -> dict:
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.generation.types import SamplingParams
    from aligner.models.gpt import build_gpt

    out = {}
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)
    target = MegatronEngine(model, m, VOCAB, eos_id=None).generate(ps_, greedy).responses()
    copy = build_gpt(m, VOCAB)
    engine = MegatronEngine(copy, m, VOCAB, eos_id=None, shared=False)
    before = engine.refit_check(model)
    engine.refit([{n: p.detach() for n, p in model.named_parameters()}])
    after = engine.refit_check(model)
    out[f"{tag}_refit_local_names"] = (not before["bitwise"] and after["bitwise"] and not after["shared"]
                                       and engine.generate(ps_, greedy).responses() == target)
    try:
        from aligner.models.weight_stream import iter_hf_weights
    except ImportError:
        return out  # the HF weight stream is not in this checkout
    copy = build_gpt(m, VOCAB)
    engine = MegatronEngine(copy, m, VOCAB, eos_id=None, shared=False)
    engine.refit(iter_hf_weights(model, m, VOCAB, bucket_bytes=1 << 16, all_ranks=True))
    check = engine.refit_check(model)
    out[f"{tag}_refit_hf_names"] = check["bitwise"] and engine.generate(ps_, greedy).responses() == target
    return out


def phase_parallel(tag: str, tp: int, pp: int, out: dict, ref: dict) -> None:
    from aligner.generation.types import SamplingParams

    model, m = setup(tp, pp)
    load_full_state(model, m, ref["state"])
    ps_ = prompts()
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)
    sampled = SamplingParams(max_new_tokens=MAX_NEW, seed=5, **SAMPLED)
    for mode, e in engines(model, m, eos_id=None).items():
        roll = e.generate(ps_, greedy)
        out[f"{tag}_{mode}_greedy_equal"] = roll.responses() == ref["greedy"]
        out[f"{tag}_{mode}_greedy_logprob_diff"] = max_diff(roll.response_logprobs(), ref["greedy_logprobs"])
        roll = e.generate(ps_, sampled)
        out[f"{tag}_{mode}_sampled_equal"] = roll.responses() == ref["sampled"]
        out[f"{tag}_{mode}_sampled_logprob_diff"] = max_diff(roll.response_logprobs(), ref["sampled_logprobs"])
        if pp == 1:  # trainer-side log-probs from this layout's own vocab-parallel logits
            out[f"{tag}_{mode}_sampled_vs_trainer_logprobs"] = max_diff(
                roll.response_logprobs(),
                [trainer_logprobs(model, p, r, sampled) for p, r in zip(ps_, roll.responses())])
    eos = ref["greedy"][0][2]
    from aligner.generation.megatron_engine import MegatronEngine

    if tp > 1:
        try:
            MegatronEngine(model, m, VOCAB, eos_id=None, decode="compiled")
            out[f"{tag}_compiled_refused"] = False
        except ValueError as e:
            out[f"{tag}_compiled_refused"] = "tensor_model_parallel_size=1" in str(e)
    roll = MegatronEngine(model, m, VOCAB, eos_id=eos).generate(ps_, greedy)
    cut = [next((i + 1 for i, t in enumerate(r) if t == eos), len(r)) for r in ref["greedy"]]
    out[f"{tag}_eos_ok"] = roll.responses() == [r[:n] for r, n in zip(ref["greedy"], cut)]
    out.update(refit_checks(model, m, ps_, tag))
    if tp > 1:  # a sequence-parallel training layout: switched off while generating, then restored
        model, m = setup(tp, pp, sequence_parallel=True)
        load_full_state(model, m, ref["state"])
        for mode, e in engines(model, m, eos_id=None).items():
            out[f"{tag}_sp_{mode}_greedy_equal"] = e.generate(ps_, greedy).responses() == ref["greedy"]
        out[f"{tag}_sp_restored"] = model.config.sequence_parallel and model.embedding.scatter_to_sequence_parallel


def phase_cp(out: dict, ref: dict) -> None:
    """CP=2: each CP rank generates the whole prompts with the lean decoder on its whole weights, as one
    process does (greedy and sampled); megatron's decode, whose attention would split the sequence, is refused."""
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.generation.types import SamplingParams

    model, m = setup(1, 1, context_parallel_size=2)
    load_full_state(model, m, ref["state"])
    ps_ = prompts()
    engine = MegatronEngine(model, m, VOCAB, eos_id=None)
    out["cp2_decode_auto"] = engine.decode
    roll = engine.generate(ps_, SamplingParams(greedy=True, max_new_tokens=MAX_NEW))
    out["cp2_lean_greedy_equal"] = roll.responses() == ref["greedy"]
    out["cp2_lean_greedy_logprob_diff"] = max_diff(roll.response_logprobs(), ref["greedy_logprobs"])
    roll = engine.generate(ps_, SamplingParams(max_new_tokens=MAX_NEW, seed=5, **SAMPLED))
    out["cp2_lean_sampled_equal"] = roll.responses() == ref["sampled"]
    out["cp2_lean_sampled_logprob_diff"] = max_diff(roll.response_logprobs(), ref["sampled_logprobs"])
    try:
        MegatronEngine(model, m, VOCAB, eos_id=None, decode="megatron")
        out["cp2_megatron_refused"] = False
    except ValueError as e:
        out["cp2_megatron_refused"] = "context parallelism" in str(e)


def main(argv: list[str]) -> None:
    from aligner.runtime import distributed

    workdir = Path(argv[0])
    distributed.init_process_group()
    torch.set_num_threads(1)
    out, ref = {}, {}
    phase_tp1(workdir, out, ref)
    phase_parallel("tp2", 2, 1, out, ref)
    phase_parallel("pp2", 1, 2, out, ref)
    phase_cp(out, ref)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        merged = {k: v for k, v in gathered[0].items()}
        merged["ranks_agree"] = all(g == gathered[0] for g in gathered)
        (workdir / "results.json").write_text(json.dumps(merged, indent=1))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])


def gpu_main(argv: list[str]) -> None:
    """One rank on one CUDA device: both decode paths against recomputation, fp32 and bf16."""
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.generation.types import SamplingParams
    from aligner.runtime import distributed

    workdir = Path(argv[0])
    distributed.init_process_group()
    out = {}
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)
    sampled = SamplingParams(max_new_tokens=MAX_NEW, seed=5, **SAMPLED)
    for dtype in ("float32", "bfloat16"):
        from aligner.models.gpt import build_gpt
        from aligner.runtime.seeding import seed_everything

        distributed.init_model_parallel(1, 1)
        seed_everything(1)
        m = model_config()
        m.params_dtype = dtype
        model = build_gpt(m, VOCAB)
        ps_ = prompts()
        out[f"{dtype}_device"] = str(next(model.parameters()).device)
        reference = [recompute_greedy(model, p, MAX_NEW) for p in ps_]
        rolls = {mode: MegatronEngine(model, m, VOCAB, eos_id=None, decode=mode) for mode in ("lean", "megatron")}
        for mode, engine in rolls.items():
            roll = engine.generate(ps_, greedy)
            out[f"{dtype}_{mode}_greedy_equal"] = roll.responses() == [r for r, _ in reference]
            out[f"{dtype}_{mode}_greedy_logprob_diff"] = max_diff(roll.response_logprobs(), [lp for _, lp in reference])
            out[f"{dtype}_{mode}_is_cuda"] = roll.response_ids.is_cuda and roll.logprobs.is_cuda
        lean, mega = (rolls[mode].generate(ps_, sampled) for mode in ("lean", "megatron"))
        out[f"{dtype}_sampled_paths_equal"] = lean.responses() == mega.responses()
        out[f"{dtype}_sampled_vs_trainer_logprobs"] = max_diff(
            lean.response_logprobs(), [trainer_logprobs(model, p, r, sampled) for p, r in zip(ps_, lean.responses())])
    (workdir / "gpu_results.json").write_text(json.dumps(out, indent=1))
    distributed.shutdown()
