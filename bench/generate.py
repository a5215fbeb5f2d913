"""Generated tokens/s: aligner's MegatronEngine vs transformers' `LlamaForCausalLM.generate` (KV cache),
on the same weights, in the same process, at the same thread count.

    python bench/generate.py [--threads 1,2] [--batches 1,8,32] [--repeats 5] [--large]
                             [--decode auto|lean|compiled|megatron] [--floor]

Workload: 16-token random prompts, exactly 64 new tokens (eos banned until then on both sides:
min_new_tokens = max_new_tokens = 64), multinomial sampling at temperature 1 with top-k/top-p off.
Time per call includes prefill; the best of `--repeats` calls (after one warm-up call, the two sides
alternating) is reported. With --decode compiled the warm-up call also compiles (not timed).
The tiny model is 4 layers, hidden 128, 4 heads, ffn 512, vocab 512; --large adds hidden 512,
8 layers, 8 heads, ffn 2048.
--floor also times, per row, a loop that runs only what no decoder can avoid in a call's decode steps:
the matrix products of every layer and the LM head, and the attention over the KV cache (the same
shapes, weights and cache growth as the engine's), and prints the ratio to transformers that a
decoder costing exactly that would reach (prefill, norms, RoPE, SwiGLU, cache writes and sampling
excluded). It says how much of the gap is left to anything but faster kernels.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT_LEN, NEW_TOKENS, VOCAB, EOS = 16, 64, 512, 1
MODELS = {"tiny": dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512),
          "large": dict(num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048)}


def build_pair(arch: dict):
    """(megatron GPTModel, its ModelConfig, an HF LlamaForCausalLM holding the same weights)."""
    import torch
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from aligner.config.schema import ModelConfig
    from aligner.models.gpt import build_gpt

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), arch)
    gpt = build_gpt(cfg, VOCAB)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads, hidden_act="silu",
        max_position_embeddings=int(cfg.max_position_embeddings), rms_norm_eps=cfg.norm_epsilon,
        rope_theta=cfg.rotary_base, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_id=EOS, pad_token_id=0))
    hf.to(next(gpt.parameters()).device)
    missing, unexpected = hf.load_state_dict(hf_state(gpt, cfg), strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise RuntimeError(f"weight mapping: missing {missing}, unexpected {unexpected}")
    hf.eval()
    with torch.no_grad():  # same weights => same logits
        ids = torch.randint(0, VOCAB, (2, PROMPT_LEN), device=hf.device)
        ours = gpt(ids, torch.arange(PROMPT_LEN, device=hf.device).expand(2, -1), None)[..., :VOCAB]
        theirs = hf(ids).logits
        diff = (ours - theirs).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"HF and megatron logits differ by {diff}")
    return gpt, cfg, hf, diff


def hf_state(gpt, cfg) -> dict:
    """HF Llama state dict from a TP=1 megatron GPTModel (qkv per query group, fc1 = [gate; up])."""
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    dim = cfg.hidden_size // heads
    state = {"model.embed_tokens.weight": gpt.embedding.word_embeddings.weight[:VOCAB],
             "model.norm.weight": gpt.decoder.final_layernorm.weight,
             "lm_head.weight": gpt.output_layer.weight[:VOCAB]}
    for i, layer in enumerate(gpt.decoder.layers):
        p = f"model.layers.{i}."
        qkv = layer.self_attention.linear_qkv.weight.view(groups, (heads // groups + 2) * dim, -1)
        q, k, v = qkv.split([heads // groups * dim, dim, dim], dim=1)
        gate, up = layer.mlp.linear_fc1.weight.chunk(2)
        state.update({p + "input_layernorm.weight": layer.input_layernorm.weight,
                      p + "post_attention_layernorm.weight": layer.pre_mlp_layernorm.weight,
                      p + "self_attn.q_proj.weight": q.reshape(-1, cfg.hidden_size),
                      p + "self_attn.k_proj.weight": k.reshape(-1, cfg.hidden_size),
                      p + "self_attn.v_proj.weight": v.reshape(-1, cfg.hidden_size),
                      p + "self_attn.o_proj.weight": layer.self_attention.linear_proj.weight,
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": layer.mlp.linear_fc2.weight})
    return {k: v.detach().clone() for k, v in state.items()}


def best_times(fns, repeats: int) -> list[float]:
    """Best wall time of each function; calls alternate so that load changes hit both alike."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def decode_floor(gpt, batch: int):
    """A function running the decode steps of one call (slots PROMPT_LEN .. PROMPT_LEN + NEW_TOKENS - 1)
    with only their matrix products and attention (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from aligner.generation.lean_decode import LeanDecoder
    from aligner.generation.parallel import StageLayout

    layout, c = StageLayout.current(), gpt.config
    weight = next(gpt.parameters())
    like = dict(dtype=weight.dtype, device=weight.device)

    def run():
        with torch.inference_mode(), torch.DisableTorchFunction():
            decoder = LeanDecoder(gpt, layout, batch, PROMPT_LEN + NEW_TOKENS)
            x = torch.randn(batch, c.hidden_size, **like)
            mlp_in = torch.randn(batch, c.ffn_hidden_size, **like)
            dims = decoder.dims
            q = torch.randn(batch * dims.groups, dims.heads_per_group, dims.head_dim, **like)
            decoder.bias[:PROMPT_LEN] = 0.0  # the prompt's slots
            for slot in range(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS):
                capacity = decoder.cache[0][0].shape[2]
                if slot >= capacity:
                    decoder._grow(decoder._capacity(slot + 1))
                decoder.bias[slot] = 0.0
                bias = decoder.bias.expand(batch * dims.groups, dims.heads_per_group, -1)
                for p, cache in zip(decoder.layers, decoder.cache):
                    keys, values = (t.view(-1, *t.shape[2:]) for t in cache)  # [B * G, C, D]
                    F.linear(x, p["qkv"])
                    torch.bmm(torch.baddbmm(bias, q, keys.transpose(1, 2)).softmax(-1), values)
                    torch.addmm(x, x, p["proj"].t())
                    F.linear(x, p["fc1"])
                    torch.addmm(x, mlp_in, p["fc2"].t())
                F.linear(x, decoder.output_weight)
    return run


def run_model(name: str, batches: list[int], repeats: int, decode: str, threads: list[int],
              floor: bool = False) -> list[tuple]:
    import torch

    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.generation.types import SamplingParams

    torch.set_num_threads(1)
    gpt, cfg, hf, diff = build_pair(MODELS[name])
    engine = MegatronEngine(gpt, cfg, VOCAB, eos_id=EOS, pad_id=0, max_batch_size=max(batches), decode=decode)
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, seed=0)
    print(f"{name}: max |HF - megatron| logits {diff:.1e}; engine decode={engine.decode}", flush=True)
    rows = []
    for n_threads, batch in [(n, b) for n in threads for b in batches]:
        torch.set_num_threads(n_threads)
        prompts = torch.randint(2, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(batch))
        hf_prompts = prompts.to(hf.device)

        split = {}

        def ours():
            out = engine.generate(prompts.tolist(), params)
            assert int(out.response_lengths.min()) == NEW_TOKENS
            if out.info["decode_s"] < split.get("decode_s", float("inf")):
                split.update(out.info)

        def theirs():
            with torch.inference_mode():
                out = hf.generate(hf_prompts, attention_mask=torch.ones_like(hf_prompts), do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, use_cache=True, pad_token_id=0, eos_token_id=EOS)
            assert out.shape[1] == PROMPT_LEN + NEW_TOKENS
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        tokens = batch * NEW_TOKENS
        fns = [ours, theirs] + ([decode_floor(gpt, batch)] if floor and engine.decode in ("lean", "compiled") else [])
        t_ours, t_hf, *t_floor = best_times(fns, repeats)
        rows.append((name, n_threads, batch, tokens / t_ours, tokens / t_hf))
        print(f"  {n_threads} thread(s), batch {batch:3d}: aligner {tokens / t_ours:8.0f} tok/s   "
              f"transformers {tokens / t_hf:8.0f} tok/s   "
              f"ratio {t_hf / t_ours:5.2f}x", flush=True)
        if t_floor:
            steps = NEW_TOKENS - 1  # decode steps after the prefill
            print(f"      aligner: prefill {split['prefill_s'] * 1e3:.1f} ms, decode "
                  f"{split['decode_s'] / steps * 1e3:.2f} ms/step; floor (matrix products + attention only) "
                  f"{t_floor[0] / steps * 1e3:.2f} ms/step; transformers / (prefill + floor) "
                  f"{t_hf / (split['prefill_s'] + t_floor[0]):.2f}x", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1", help="comma-separated thread counts, e.g. 1,2")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large", action="store_true", help="also the hidden-512, 8-layer model")
    parser.add_argument("--decode", default="auto", choices=["auto", "lean", "compiled", "megatron"])
    parser.add_argument("--floor", action="store_true", help="also time the matrix-products-and-attention floor")
    args = parser.parse_args(argv)
    threads = [int(n) for n in args.threads.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(threads)))
    import torch
    import transformers

    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything

    transformers.logging.set_verbosity_error()
    distributed.init_process_group()
    distributed.init_model_parallel(1, 1, 1)
    seed_everything(1234)
    batches = [int(b) for b in args.batches.split(",")]
    rows = run_model("tiny", batches, args.repeats, args.decode, threads, args.floor)
    if args.large:
        rows += run_model("large", batches, args.repeats, args.decode, threads, args.floor)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens, sampling T=1, {where}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("| model | threads | batch | aligner tok/s | transformers tok/s | ratio |\n|---|---:|---:|---:|---:|---:|")
    for name, n_threads, batch, ours, theirs in rows:
        print(f"| {name} | {n_threads} | {batch} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |")
    distributed.shutdown()


if __name__ == "__main__":
    main()
