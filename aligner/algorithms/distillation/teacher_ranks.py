"""The ranks of `aligner teacher-logits` (distillation/teacher_logits.py launches them), and the top-k
teacher forward step that online distillation (`kd.teacher=CKPT`, distillation/kd.py) also runs.

Each rank loads the teacher at (tp, pp) and runs it forward-only through megatron's pipeline schedule
on batches of the manifest's samples; the top-k is taken vocab-parallel (`vocab_parallel_topk`: k
candidates per TP rank, never the vocabulary). The last stage's TP-rank 0 writes one chunk file per
chunk_size samples (distillation/teacher_store.py has the layout).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.algorithms.distillation import teacher_store as store
from aligner.data.loader import collate
from aligner.data.sft import load_sft_dataset
from aligner.data.tokenizer import load_tokenizer
from aligner.launch.ranks import rank_main
from aligner.models.checkpoint import load_language_model
from aligner.models.forward_step import run_micro_batches, run_model
from aligner.models.logprobs import vocab_parallel_topk
from aligner.observe.progress import Progress
from aligner.runtime.distributed import device
from aligner.runtime.seeding import seed_everything


def rank_entry(argv: list[str], initialised: bool = False) -> None:
    """`run_ranks`' entry point: argv = out_dir, start_chunk, batch_size, tp, pp."""
    rank_main(argv, initialised, teacher_logits_rank)


def topk_forward_step(k: int, vocab_size: int):
    """A forward-only megatron step whose result per micro-batch (last stage) is {"values", "ids"} [b,
    s_local, k] and "positions" [s_local]: the top-k logits at this rank's positions."""
    where = device() if torch.cuda.is_available() else None

    def forward_step(data_iterator, model):
        output, local = run_model(next(data_iterator), model, where)

        def keep(logits):
            values, ids = vocab_parallel_topk(logits, k, vocab_size)
            return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {
                "values": values, "ids": ids, "positions": local["position_ids"][0]}

        return output, keep

    return forward_step


def loss_positions(sample) -> torch.Tensor:
    """The positions t whose label ids[t + 1] a sample trains on (the collated loss mask)."""
    return torch.tensor(sample.loss_mask[1:]).nonzero().flatten()


@torch.no_grad()
def teacher_logits_rank(out_dir, start_chunk, batch_size, *, tp: int, pp: int) -> None:
    """Collective, in a process group set up for (tp, pp): chunks start_chunk.. of `out_dir`'s manifest."""
    manifest = store.read_manifest(out_dir)
    d, size = manifest["data"], manifest["chunk_size"]
    tokenizer = load_tokenizer(manifest["tokenizer"]["path"])
    samples = load_sft_dataset(d["path"], tokenizer, d["format"], d["max_length"], d["overlong"])
    seed_everything(0)  # megatron's RNG tracker needs a seed; the loaded weights replace the initial values
    model, vocab = load_language_model(manifest["teacher"]["path"], tensor_model_parallel_size=tp,
                                       pipeline_model_parallel_size=pp)
    forward_step = topk_forward_step(manifest["top_k"], vocab)
    writer = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    chunks = range(int(start_chunk), store.num_chunks(manifest))
    with Progress(len(chunks), unit="chunk", desc="teacher-logits", silent=dist.get_rank() != 0) as progress:
        for chunk in chunks:
            index = list(range(chunk * size, min(len(samples), (chunk + 1) * size)))
            found = {}
            for start in range(0, len(index), int(batch_size)):
                batch = [samples[i] for i in index[start:start + int(batch_size)]]
                length = max(len(s.ids) for s in batch) - 1
                tokens = collate(batch, tokenizer.pad_token_id, length)["tokens"]
                # pipeline stages exchange fixed [s, b, h] activations: one sequence per micro-batch there
                step = 1 if pp > 1 else len(batch)
                micro = [{"tokens": tokens[j:j + step]} for j in range(0, len(batch), step)]
                outputs = run_micro_batches(model, forward_step, micro, length, forward_only=True)
                if outputs:
                    ids, values = torch.cat([o["ids"] for o in outputs]), torch.cat([o["values"] for o in outputs])
                    for row, sample in enumerate(batch):
                        at = loss_positions(sample)
                        found[index[start + row]] = (ids[row, at].cpu(), values[row, at].cpu())
            if writer:
                rows = [found[i] for i in index]
                offsets = torch.tensor([0] + [len(r[0]) for r in rows]).cumsum(0)
                store.save_chunk(out_dir, chunk, torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]),
                                 offsets)
            progress.update()
