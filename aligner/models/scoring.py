"""`aligner logprobs`: per-token log-probabilities of given texts under an aligner checkpoint.

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
from typing import Callable

import torch

from aligner.models.hf_convert import rank_main, run_ranks


def read_inputs(data_path, vocab_size: int, tokenizer_path=None) -> list[list[int]]:
    """Token ids per non-blank line; a DataError (ValueError) names file:line for a bad one."""
    from aligner.data.jsonl import read_token_sequences

    return read_token_sequences(data_path, "text", "input_ids", vocab_size,
                                lambda where: _load_tokenizer(tokenizer_path, where))


def _load_tokenizer(path, where: str):
    if path is None or not Path(path).is_dir():
        raise FileNotFoundError(f"{where} has text to tokenize but there is no tokenizer at {path}; pass "
                                "tokenizer_path (--tokenizer) or give input_ids")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def score_logprobs(model_dir, data_path, out_path, tokenizer_path=None, tp: int = 1, pp: int = 1,
                   batch_size: int = 8) -> Path:
    """Write per-token log-probs of every input (see module doc) to `out_path`, on tp*pp ranks."""
    from aligner.models.checkpoint import read_metadata

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


def run_forward(model, micro_batches: list[dict], seq_length: int,
                on_logits: Callable[[torch.Tensor, dict], dict]) -> list[dict]:
    """Forward-only pass over micro-batches ({"tokens": [b, s]}, all the same shape) with
    megatron's schedule for the current pipeline layout. On the last stage, returns
    `on_logits(vocab-parallel logits [b, s, V/TP], micro-batch)` per micro-batch; [] elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model.parameters()).device

    def forward_step(data_iterator, model):
        batch = dict(next(data_iterator))
        batch["tokens"] = batch["tokens"].to(device)
        positions = torch.arange(batch["tokens"].shape[1], device=device).expand_as(batch["tokens"])
        output = model(batch["tokens"], positions, None)

        def loss_func(logits):
            return (torch.zeros((), device=device), torch.zeros((), dtype=torch.int, device=device),
                    on_logits(logits, batch))

        return output, loss_func

    with torch.no_grad():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
            num_microbatches=len(micro_batches), seq_length=seq_length,
            micro_batch_size=micro_batches[0]["tokens"].shape[0], forward_only=True)


def score_rank(model_dir, inputs_path, out_path, batch_size="8", *, tp: int, pp: int) -> None:
    """Collective, in a process group set up for (tp, pp)."""
    from megatron.core import parallel_state as ps

    from aligner.models.checkpoint import load_weights, model_config_from_checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.models.logprobs import vocab_parallel_logprobs
    from aligner.runtime.seeding import seed_everything

    cfg, vocab = model_config_from_checkpoint(model_dir, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    seed_everything(0)
    model = build_gpt(cfg, vocab)
    load_weights(model_dir, model)
    model.eval()
    sequences = json.loads(Path(inputs_path).read_text())
    results = {i: [] for i, s in enumerate(sequences) if len(s) < 2}
    # longest first, so each batch pads little; output order is restored below
    order = sorted((i for i, s in enumerate(sequences) if len(s) >= 2), key=lambda i: -len(sequences[i]))

    def logprobs(logits, batch):
        return {"logprobs": vocab_parallel_logprobs(logits[:, :-1], batch["tokens"][:, 1:], vocab).float().cpu()}

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
        outputs = run_forward(model, micro, length, logprobs)
        if outputs:
            table = torch.cat([o["logprobs"] for o in outputs])
            for row, i in enumerate(index):
                results[i] = table[row, :len(sequences[i]) - 1].tolist()
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        with open(out_path, "w") as f:
            for i, ids in enumerate(sequences):
                f.write(json.dumps({"input_ids": ids, "logprobs": results[i]}) + "\n")
