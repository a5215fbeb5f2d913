"""Helpers for the HF interop tests: tiny HF models / tokenizers, and rank entry points for
`aligner.launch.local.launch` (run as `tests.hf_workers:<function>`)."""
from __future__ import annotations

import glob
import json
from pathlib import Path

import torch

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world, hello aligner",
         "megatron and transformers should agree on every logit", "a b c d e f g"]


def make_tokenizer(path) -> None:
    """A byte-level BPE tokenizer (< 300 ids) that prepends <s>, trained on TEXTS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(path))


BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)


def hf_config(kind: str, **overrides):
    """Tiny configs: llama (GQA), qwen2 (q/k/v bias, tied), mistral (head_dim 32 > hidden/heads), llama3 (rope scaling)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if kind == "llama":
        return LlamaConfig(**{**BASE, "rope_theta": 10000.0, **overrides})
    if kind == "qwen2":
        return Qwen2Config(**{**BASE, "tie_word_embeddings": True, "rope_theta": 1e6, **overrides})
    if kind == "mistral":
        return MistralConfig(**{**BASE, "sliding_window": None, "head_dim": 32, **overrides})  # heads*head_dim != hidden
    if kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        return LlamaConfig(**{**BASE, "max_position_embeddings": 16384, "rope_parameters": rope, **overrides})
    raise ValueError(kind)


def make_hf_model(kind: str, path, seed: int = 0, max_shard_size=None, **overrides):
    """Random tiny HF model (all weights random, norms around 1) saved as safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides), dtype=torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    return randomize_and_save(model, path, **kwargs)


def randomize_and_save(model, path, **save_kwargs):
    """Draw `model`'s weights from torch's global generator (norms around 1, the rest around 0), save it
    as safetensors with a `make_tokenizer` tokenizer, and return it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), **save_kwargs)
    make_tokenizer(path)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def hf_token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[0, t] | ids[0, :t]) for t >= 1 under a causal LM, from one sequence `ids` [1, length]."""
    return torch.log_softmax(hf_logits(model, ids), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]


def load_safetensors_dir(path) -> dict:
    """Every tensor of the *.safetensors files in `path` (an HF model directory, one shard or several)."""
    from safetensors.torch import load_file

    return {k: v for f in glob.glob(str(Path(path) / "*.safetensors")) for k, v in load_file(f).items()}


# ---------------------------------------------------------------------------------------------
# rank entry points
# ---------------------------------------------------------------------------------------------
def parity_worker(argv: list[str]) -> None:
    """argv[0]: JSON list of jobs {ckpt, tp, pp, tokens, out, all_ranks}. For each job (one launch,
    several layouts): load the checkpoint at that layout, save the full logits of `tokens` from the
    last stage (`<out>.logits.pt`) and the streamed HF state dict from rank 0 (`<out>.stream.pt`;
    with all_ranks every rank saves `<out>.stream.rank<r>.pt`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from aligner.models.checkpoint import load_weights, model_config_from_checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.models.forward_step import collect, make_forward_step, run_micro_batches
    from aligner.models.weight_stream import iter_hf_weights
    from aligner.runtime.distributed import init_model_parallel, init_process_group, shutdown
    from aligner.runtime.seeding import seed_everything

    init_process_group()
    for job in json.loads(Path(argv[0]).read_text()):
        tp, pp = job["tp"], job["pp"]
        init_model_parallel(tp, pp)
        cfg, vocab = model_config_from_checkpoint(job["ckpt"], tensor_model_parallel_size=tp,
                                                  pipeline_model_parallel_size=pp)
        seed_everything(0)
        model = build_gpt(cfg, vocab)
        load_weights(job["ckpt"], model)
        model.eval()
        tokens = torch.load(job["tokens"])

        def full_logits(logits, local, batch):
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            return torch.cat(parts, dim=-1)[..., :vocab]

        step = make_forward_step(lambda logits, local: logits, collect(full_logits))
        with torch.no_grad():
            outputs = run_micro_batches(model, step, [{"tokens": tokens}], tokens.shape[1], forward_only=True)
        if outputs and ps.get_tensor_model_parallel_rank() == 0:
            torch.save(outputs[0]["out"], job["out"] + ".logits.pt")
        streamed, buckets = {}, 0
        for bucket in iter_hf_weights(model, cfg, vocab, bucket_bytes=job.get("bucket_bytes", 1 << 16),
                                      all_ranks=job.get("all_ranks", False)):
            streamed.update(bucket)
            buckets += 1
        if job.get("all_ranks"):
            torch.save(streamed, f"{job['out']}.stream.rank{dist.get_rank()}.pt")
        elif dist.get_rank() == 0:
            torch.save({"state": streamed, "buckets": buckets}, job["out"] + ".stream.pt")
        else:
            assert not streamed, "only rank 0 receives tensors"
    shutdown()
