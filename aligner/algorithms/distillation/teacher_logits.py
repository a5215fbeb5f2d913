"""`aligner teacher-logits`: a teacher's top-k logits at every loss position of an SFT data file, for
offline knowledge distillation (`aligner train kd kd.teacher_logits=DIR`).

    aligner teacher-logits --teacher CKPT --data FILE.jsonl --top-k 100 --out DIR [--tp N --pp N]

The data is read the way `aligner train sft` reads it (chat or input/output records, the teacher's
tokenizer unless --tokenizer), so the student's tokens line up with the teacher's. The teacher runs
forward-only on tp*pp ranks (`run_ranks`, as `aligner logprobs`; distillation/teacher_ranks.py has the
rank code and the top-k forward step). The last stage's TP-rank 0 writes one chunk file per
--chunk-size samples (distillation/teacher_store.py has the layout). Rerunning the same command after an
interruption continues from the first chunk without a file; a directory made for other data, tokenizer,
teacher or top-k is refused.
"""
from __future__ import annotations

from pathlib import Path

from aligner.algorithms.distillation import teacher_store as store
from aligner.data.sft import load_sft_dataset
from aligner.data.tokenizer import load_tokenizer
from aligner.errors import ArgumentParser, UsageError, UserError
from aligner.launch.ranks import run_ranks
from aligner.models.checkpoint import read_metadata


def main(argv: list[str]) -> int:
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
        run_ranks("aligner.algorithms.distillation.teacher_ranks:rank_entry",
                  [str(out), str(start), str(batch_size), str(tp), str(pp)], tp * pp)
    return Path(out)


def _prepare_out_dir(out, manifest: dict) -> None:
    """A new directory gets the manifest; an existing one must have been started with the same inputs."""
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
