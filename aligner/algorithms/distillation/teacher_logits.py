"""`aligner teacher-logits`: a teacher's top-k logits at every loss position of an SFT data file, for
offline knowledge distillation (`aligner train kd kd.teacher_logits=DIR`), and the teacher forward that
the online mode (`kd.teacher=CKPT`) runs on each micro-batch.

    aligner teacher-logits --teacher CKPT --data FILE.jsonl --top-k 100 --out DIR [--tp N --pp N]

The data is read the way `aligner train sft` reads it (chat or input/output records, the teacher's
tokenizer unless --tokenizer), so the student's tokens line up with the teacher's. The teacher runs
forward-only on tp*pp ranks through megatron's pipeline schedule (`run_ranks` / `rank_main`, as
`aligner logprobs`); the top-k is taken vocab-parallel (`vocab_parallel_topk`: k candidates per TP
rank, never the vocabulary). The last stage's TP-rank 0 writes one chunk file per --chunk-size samples
(distillation/teacher_store.py has the layout). Rerunning the same command after an interruption continues
from the first chunk without a file; a directory made for other data, tokenizer, teacher or top-k is
refused.
"""
from __future__ import annotations

import torch

from aligner.algorithms.distillation import teacher_store as store
from aligner.errors import UsageError, UserError


# ---- the launching process --------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    from aligner.generation.cli import ArgumentParser  # mistakes are one `error:` line (exit code 2)

    parser = ArgumentParser(prog="aligner teacher-logits",
                            description="a teacher's top-k logits per loss token of SFT data")
    parser.add_argument("--teacher", required=True, help="teacher checkpoint (a language model)")
    parser.add_argument("--data", required=True, help="SFT JSONL (chat messages, or input/output)")
    parser.add_argument("--out", required=True, help="output directory (rerun to continue an interrupted one)")
    parser.add_argument("--top-k", type=int, default=100, help="logits kept per token")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tokenizer", default=None, help="default: <teacher>/tokenizer")
    parser.add_argument("--format", default="auto", choices=["auto", "chat", "input_output"])
    parser.add_argument("--max-length", type=int, default=None, help="default: the teacher's seq_length")
    parser.add_argument("--overlong", default="truncate", choices=["truncate", "drop"])
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    parser.add_argument("--chunk-size", type=int, default=1024, help="samples per chunk file")
    args = parser.parse_args(argv)
    out = write_teacher_logits(args.teacher, args.data, args.out, args.top_k, tp=args.tp, pp=args.pp,
                               tokenizer_path=args.tokenizer, fmt=args.format, max_length=args.max_length,
                               overlong=args.overlong, batch_size=args.batch_size, chunk_size=args.chunk_size)
    print(f"wrote {out}")
    return 0


def write_teacher_logits(teacher, data, out, top_k: int, *, tp: int = 1, pp: int = 1, tokenizer_path=None,
                         fmt: str = "auto", max_length: int | None = None, overlong: str = "truncate",
                         batch_size: int = 8, chunk_size: int = 1024):
    """Write (or finish) the teacher-logits directory `out`; returns its path. Every check runs here,
    before any rank starts."""
    from pathlib import Path

    from aligner.data.sft import load_sft_dataset
    from aligner.data.tokenizer import load_tokenizer
    from aligner.models.checkpoint import read_metadata
    from aligner.models.hf_convert import run_ranks

    meta = read_metadata(teacher)
    if meta.get("head", "lm") != "lm":
        raise UserError(f"{teacher} has a '{meta['head']}' head", "--teacher", "pass a language-model checkpoint")
    vocab = meta["vocab_size"]
    if not 1 <= top_k <= vocab:
        raise UsageError(f"--top-k {top_k} is not in [1, the teacher's vocabulary size {vocab}]", "--top-k",
                         f"pass a k between 1 and {vocab}")
    if min(tp, pp, batch_size, chunk_size) < 1:
        raise UsageError("--tp, --pp, --batch-size and --chunk-size must be >= 1", "aligner teacher-logits")
    tokenizer_path = tokenizer_path or Path(teacher) / "tokenizer"
    if not Path(tokenizer_path).is_dir():
        raise UsageError(f"no tokenizer at {tokenizer_path}", "--tokenizer", "pass --tokenizer DIR (the student's)")
    tokenizer = load_tokenizer(tokenizer_path)
    max_length = max_length or meta["model"]["seq_length"]
    samples = load_sft_dataset(data, tokenizer, fmt, max_length, overlong)  # a bad record fails here
    manifest = {"format": store.FORMAT_VERSION,
                "teacher": {"path": str(teacher), "sha256": store.file_sha256(Path(teacher) / "aligner.json")},
                "top_k": top_k, "vocab_size": vocab, "chunk_size": chunk_size, "num_samples": len(samples),
                **store.data_identity(data, tokenizer, tokenizer_path, fmt, max_length, overlong)}
    _prepare_out_dir(out, manifest)
    start = store.first_missing_chunk(out, manifest)
    if start < store.num_chunks(manifest):
        run_ranks("aligner.algorithms.distillation.teacher_logits:_rank_main", [str(out), str(start), str(batch_size), str(tp),
                                                                   str(pp)], tp * pp)
    return Path(out)


def _prepare_out_dir(out, manifest: dict) -> None:
    """A new directory gets the manifest; an existing one must have been started with the same inputs."""
    from pathlib import Path

    fix = f"pass a new --out, or delete {out} to start over"
    if (Path(out) / store.MANIFEST).is_file():
        made = store.read_manifest(out)
        store.check_matches(made, manifest, str(out), fix)
        for key in ("teacher", "top_k", "chunk_size"):
            if made[key] != manifest[key]:
                raise UserError(f"{out} holds teacher logits made with another {key} ({made[key]})", "--out", fix)
        return
    if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise UserError(f"{out} exists and is not a teacher-logits directory", "--out", fix)
    store.write_manifest(out, manifest)


# ---- the ranks --------------------------------------------------------------------------------------------
def _rank_main(argv: list[str], initialised: bool = False) -> None:
    from aligner.models.hf_convert import rank_main

    rank_main(argv, initialised, teacher_logits_rank)


def topk_forward_step(k: int, vocab_size: int):
    """A forward-only megatron step whose result per micro-batch (last stage) is {"values", "ids"} [b,
    s_local, k] and "positions" [s_local]: the top-k logits at this rank's positions."""
    from aligner.models.forward_step import run_model
    from aligner.models.logprobs import vocab_parallel_topk
    from aligner.runtime.distributed import device

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
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from aligner.data.loader import collate
    from aligner.data.sft import load_sft_dataset
    from aligner.data.tokenizer import load_tokenizer
    from aligner.models.checkpoint import load_language_model
    from aligner.models.forward_step import run_micro_batches
    from aligner.observe.progress import Progress
    from aligner.runtime.seeding import seed_everything

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
