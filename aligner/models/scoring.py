"""Scoring token sequences with a checkpoint, forward only: `aligner logprobs` (a language model's
per-token log-probs), and the rows of a scalar-head model (reward or value) that the reward and
critic servers run collectively (`forward_rows`) or that run in this process (`score_checkpoint`).

`aligner logprobs`: per-token log-probabilities of given texts under an aligner checkpoint.

Input JSONL, one object per line: {"text": str} (tokenised with the checkpoint's tokenizer,
special tokens added the tokenizer's default way) or {"input_ids": [int, ...]}. Blank lines are
skipped. Output JSONL, one line per input in input order:
    {"input_ids": [...], "logprobs": [...]}   logprobs[i] = log p(input_ids[i+1] | input_ids[:i+1])
so len(logprobs) == len(input_ids) - 1. Log-probs are vocab-parallel (never gathering the
vocabulary) and exclude megatron's padded vocabulary rows. The model runs through megatron's
forward-only pipeline schedule, so any TP x PP layout works; the last stage's TP-rank 0 writes.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.data.jsonl import read_token_sequences
from aligner.launch.ranks import rank_main, run_ranks, single_process
from aligner.models.checkpoint import (load_language_model, load_weights, model_config_from_checkpoint, read_metadata,
                                      scalar_head_outputs)
from aligner.models.forward_step import collect, head_values, make_forward_step, run_micro_batches
from aligner.models.gpt import build_gpt
from aligner.models.heads import attach_scalar_head, last_token_scores
from aligner.models.logprobs import vocab_parallel_logprobs
from aligner.models.sdpa_attention import use_fused_attention
from aligner.runtime.distributed import device
from aligner.runtime import collectives
from aligner.runtime.seeding import seed_everything


def read_inputs(data_path, vocab_size: int, tokenizer_path=None) -> list[list[int]]:
    """Token ids per non-blank line; a DataError (ValueError) names file:line for a bad one."""
    return read_token_sequences(data_path, "text", "input_ids", vocab_size,
                                lambda where: _load_tokenizer(tokenizer_path, where))


def _load_tokenizer(path, where: str):
    if path is None or not Path(path).is_dir():
        raise FileNotFoundError(f"{where} has text to tokenize but there is no tokenizer at {path}; pass "
                                "tokenizer_path (--tokenizer) or give input_ids")
    from transformers import AutoTokenizer  # heavy, and only for text inputs

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def score_logprobs(model_dir, data_path, out_path, tokenizer_path=None, tp: int = 1, pp: int = 1,
                   batch_size: int = 8) -> Path:
    """Write per-token log-probs of every input (see module doc) to `out_path`, on tp*pp ranks."""
    meta = read_metadata(model_dir)
    if meta.get("head", "lm") != "lm":
        raise ValueError(f"{model_dir} has a '{meta['head']}' head; log-probs need a language-model checkpoint")
    sequences = read_inputs(data_path, meta["vocab_size"], tokenizer_path or Path(model_dir) / "tokenizer")
    work = Path(tempfile.mkdtemp(prefix="aligner-logprobs-"))
    try:
        inputs = work / "inputs.json"
        inputs.write_text(json.dumps(sequences))
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        run_ranks("aligner.models.scoring:_score_main", [str(model_dir), str(inputs), str(out_path),
                                                         str(batch_size), str(tp), str(pp)], tp * pp)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Path(out_path)


def _score_main(argv: list[str], initialised: bool = False) -> None:
    rank_main(argv, initialised, score_rank)


def score_rank(model_dir, inputs_path, out_path, batch_size="8", *, tp: int, pp: int) -> None:
    """Collective, in a process group set up for (tp, pp)."""
    seed_everything(0)
    model, vocab = load_language_model(model_dir, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    sequences = json.loads(Path(inputs_path).read_text())
    results = {i: [] for i, s in enumerate(sequences) if len(s) < 2}
    # longest first, so each batch pads little; output order is restored below
    order = sorted((i for i, s in enumerate(sequences) if len(s) >= 2), key=lambda i: -len(sequences[i]))

    def next_token_logprobs(logits, local):  # log p(tokens[i+1] | tokens[:i+1]): the last position has no label
        return vocab_parallel_logprobs(logits[:, :-1], local["tokens"][:, 1:], vocab)

    forward_step = make_forward_step(next_token_logprobs,
                                     collect(lambda logprobs, local, batch: logprobs.float().cpu()))

    batch_size = int(batch_size)
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        length = len(sequences[index[0]])
        tokens = torch.zeros(len(index), length, dtype=torch.long)
        for row, i in enumerate(index):
            tokens[row, :len(sequences[i])] = torch.tensor(sequences[i])
        # pipeline stages exchange fixed [s, b, h] activations: one sequence per micro-batch there
        step = 1 if pp > 1 else len(index)
        micro = [{"tokens": tokens[j:j + step]} for j in range(0, len(index), step)]
        with torch.no_grad():
            outputs = run_micro_batches(model, forward_step, micro, length, forward_only=True)
        if outputs:
            table = torch.cat([o["out"] for o in outputs])
            for row, i in enumerate(index):
                results[i] = table[row, :len(sequences[i]) - 1].tolist()
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        with open(out_path, "w") as f:
            for i, ids in enumerate(sequences):
                f.write(json.dumps({"input_ids": ids, "logprobs": results[i]}) + "\n")


# ---- scalar-head models: rewards and values of token rows ------------------------------------------------
def build_scalar_model(checkpoint, parallel, num_outputs: int):
    """GPT + scalar head with `checkpoint`'s architecture at `parallel`'s TP/PP (weights not loaded)."""
    layout = {"tensor_model_parallel_size": parallel.tensor_model_parallel_size,
              "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size}
    if parallel.params_dtype:
        layout["params_dtype"] = parallel.params_dtype
    cfg, vocab = model_config_from_checkpoint(checkpoint, **layout)
    gpt = build_gpt(cfg, vocab)
    use_fused_attention(gpt)  # rows are right-padded and causal: torch's fused kernel, not megatron's [s, s] scores
    return attach_scalar_head(gpt, num_outputs), cfg, vocab


def token_values_head(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """values [b, s, 1] -> [b, s], zero at and after each row's length (a critic's values)."""
    real = torch.arange(values.shape[1], device=values.device)[None, :] < lengths[:, None]
    return values[..., 0] * real


def _split_rows(rows: int, micro_batch_size: int) -> tuple[int, int, int]:
    """(rows per data-parallel rank, micro-batch size, padded total): every replica gets the same
    number of whole micro-batches (pipeline stages exchange fixed shapes)."""
    dp = ps.get_data_parallel_world_size()
    per_rank = -(-rows // dp)
    mbs = max(1, min(micro_batch_size, per_rank))
    per_rank = -(-per_rank // mbs) * mbs
    return per_rank, mbs, per_rank * dp


def _pad_to_rows(tensor: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    pad = tensor.new_full((rows - tensor.shape[0], *tensor.shape[1:]), value)
    return torch.cat([tensor, pad])


def _to_rank0(local: torch.Tensor | None, rows: slice, total: int, trailing: tuple, device) -> torch.Tensor | None:
    """Sum every replica's rows into one [total, *trailing] tensor on global rank 0."""
    owner = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    if dist.get_world_size() == 1:
        return local
    full = torch.zeros((total, *trailing), dtype=torch.float32, device=device)
    if owner:
        full[rows] = local
    collectives.reduce(full, dst=0)
    return full if dist.get_rank() == 0 else None


@torch.no_grad()
def forward_rows(model, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int,
                 head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], trailing: tuple) -> torch.Tensor | None:
    """Collective: `head(values [b, s, k] float32, lengths [b]) -> [b, *trailing]` for every row of
    `tokens` [B, S] (the same on every rank). The rows are split over data-parallel replicas, each
    runs megatron's schedule over micro-batches, and the results are summed into a tensor on rank 0
    (each row is written by exactly one rank: the last pipeline stage's tensor-parallel rank 0 of the
    replica that owns it). Returns the [B, *trailing] result on rank 0, else None."""
    rows, width = tokens.shape
    per_rank, mbs, total = _split_rows(rows, micro_batch_size)
    tokens, lengths = _pad_to_rows(tokens, total), _pad_to_rows(lengths, total, 1)
    mine = slice(ps.get_data_parallel_rank() * per_rank, (ps.get_data_parallel_rank() + 1) * per_rank)
    micro = [{"tokens": tokens[mine][i:i + mbs], "lengths": lengths[mine][i:i + mbs]} for i in range(0, per_rank, mbs)]
    forward_step = make_forward_step(head_values, collect(lambda values, local, batch: head(values, batch["lengths"])))
    outputs = run_micro_batches(model, forward_step, micro, width, forward_only=True)
    local = torch.cat([o["out"] for o in outputs]) if outputs else None
    full = _to_rank0(local, mine, total, trailing, tokens.device)
    return None if full is None else full[:rows]


def load_scalar_model(checkpoint):
    """(model in eval mode, its number of outputs): a scalar-head checkpoint at TP=PP=1 on this process
    (inside `single_process()`)."""
    seed_everything(0)
    outputs = scalar_head_outputs(checkpoint)
    parallel = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, params_dtype=None)
    model, _, _ = build_scalar_model(checkpoint, parallel, outputs)
    load_weights(checkpoint, model)
    model.eval()
    return model, outputs


def score_checkpoint(checkpoint, sequences: list[list[int]], per_token: bool = False,
                     micro_batch_size: int = 8) -> torch.Tensor:
    """A scalar-head checkpoint (reward or value) run in this process (TP=PP=1) on token sequences:
    rewards [n, A] at each sequence's last token, or with `per_token` values [n, longest] (0 past
    each sequence's end) from the first output."""
    with single_process():
        model, outputs = load_scalar_model(checkpoint)
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        tokens = torch.zeros((len(sequences), int(lengths.max())), dtype=torch.int64)
        for row, ids in enumerate(sequences):
            tokens[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        tokens, lengths = tokens.to(device()), lengths.to(device())
        if per_token:
            return forward_rows(model, tokens, lengths, micro_batch_size, token_values_head, (tokens.shape[1],)).cpu()
        return forward_rows(model, tokens, lengths, micro_batch_size, last_token_scores, (outputs,)).cpu()
