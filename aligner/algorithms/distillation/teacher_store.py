"""The on-disk form of a teacher's top-k logits (`aligner teacher-logits`), and its reader.

A directory holds:
    manifest.json              what it was made from: the teacher, top_k, the teacher's vocabulary size,
                               chunk_size, the number of samples, the data file (path, sha256, format,
                               max_length, overlong) and the tokenizer (path, fingerprint)
    chunk_<i>.safetensors      samples [i * chunk_size, (i + 1) * chunk_size) of the data file (SFT samples
                               in file order, `aligner.data.sft.load_sft_dataset`): "ids" int32 [T, K] and
                               "logits" float32 [T, K] (largest first) at each sample's loss positions, in
                               order, and "offsets" int64 [samples + 1] into the T rows
A loss position t of a sample is a position whose label ids[t + 1] is trained on (loss_mask[t + 1] = 1):
exactly the positions KD reads. A chunk is written to a temporary file and renamed, so a chunk file
that exists is complete; the directory is complete when every chunk is there.

A run refuses a directory made from another data file, tokenizer or tokenization (`check_matches`),
so the teacher's positions line up with the student's tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from aligner.data.jsonl import DataError
from aligner.errors import UserError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def chunk_path(out_dir, index: int) -> Path:
    return Path(out_dir) / f"chunk_{index:05d}.safetensors"


def num_chunks(manifest: dict) -> int:
    return -(-manifest["num_samples"] // manifest["chunk_size"])


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides token ids: the vocabulary, the special tokens and the chat template (file
    bytes differ between copies of one tokenizer, e.g. the copy saved into a checkpoint)."""
    content = {"vocab": sorted(tokenizer.get_vocab().items()), "special": tokenizer.all_special_tokens,
               "chat_template": getattr(tokenizer, "chat_template", None)}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def data_identity(data_path, tokenizer, tokenizer_path, fmt: str, max_length: int, overlong: str) -> dict:
    """What a directory's positions depend on, in the manifest's form."""
    return {"data": {"path": str(data_path), "sha256": file_sha256(data_path), "format": str(fmt),
                     "max_length": int(max_length), "overlong": str(overlong)},
            "tokenizer": {"path": str(tokenizer_path), "fingerprint": tokenizer_fingerprint(tokenizer)}}


def read_manifest(out_dir, key: str = "--out") -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        what = "does not exist" if not Path(out_dir).exists() else f"has no {MANIFEST}"
        raise UserError(f"teacher-logits directory {out_dir} {what}", key,
                        "write it with `aligner teacher-logits --teacher CKPT --data FILE.jsonl --top-k K --out DIR`")
    return json.loads(path.read_text())


def write_manifest(out_dir, manifest: dict) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / MANIFEST)


def check_matches(manifest: dict, identity: dict, where: str, fix: str) -> None:
    """Refuse a directory made from another data file, tokenizer or tokenization (a DataError naming
    `where`, the directory or key, with `fix`)."""
    made, now = manifest["data"], identity["data"]
    if made["sha256"] != now["sha256"]:
        raise DataError(f"the teacher logits were made from {made['path']} (sha256 {made['sha256'][:12]}), not from "
                        f"{now['path']} (sha256 {now['sha256'][:12]})", where, fix)
    if manifest["tokenizer"]["fingerprint"] != identity["tokenizer"]["fingerprint"]:
        raise DataError(f"the teacher logits were made with another tokenizer ({manifest['tokenizer']['path']}) than "
                        f"{identity['tokenizer']['path']}", where, fix)
    for key in ("format", "max_length", "overlong"):
        if made[key] != now[key]:
            raise DataError(f"the teacher logits were made with {key}={made[key]}, this run has {key}={now[key]}",
                            where, fix)


def save_chunk(out_dir, index: int, ids: torch.Tensor, logits: torch.Tensor, offsets: torch.Tensor) -> Path:
    """Write one chunk atomically (temporary file, then rename)."""

    path = chunk_path(out_dir, index)
    tmp = path.with_suffix(".tmp")
    save_file({"ids": ids.to(torch.int32).contiguous(), "logits": logits.float().contiguous(),
               "offsets": offsets.to(torch.int64).contiguous()}, str(tmp))
    os.replace(tmp, path)
    return path


def first_missing_chunk(out_dir, manifest: dict) -> int:
    """The chunk to continue from: the first one without a file (num_chunks when complete)."""
    return next((i for i in range(num_chunks(manifest)) if not chunk_path(out_dir, i).exists()),
                num_chunks(manifest))


class TeacherLogits:
    """Random access to a complete directory by sample index: `[i] -> (ids int64 [n_i, K], logits
    float32 [n_i, K])` at sample i's n_i loss positions. Chunk files are memory-mapped and only a
    sample's rows are read, so a shuffled batch costs a few rows per chunk, not whole chunks; the
    most recently used chunks stay open."""

    OPEN_CHUNKS = 64

    def __init__(self, out_dir, key: str = "kd.teacher_logits"):
        self.dir, self.key = Path(out_dir), key
        self.manifest = read_manifest(out_dir, key)
        missing = [i for i in range(num_chunks(self.manifest)) if not chunk_path(out_dir, i).exists()]
        if missing:
            raise UserError(f"teacher-logits directory {out_dir} is incomplete ({len(missing)} of "
                            f"{num_chunks(self.manifest)} chunks missing, from chunk {missing[0]})", key,
                            "rerun the same `aligner teacher-logits` command: it continues from the last complete chunk")
        self.top_k, self.vocab_size = self.manifest["top_k"], self.manifest["vocab_size"]
        self._open: dict[int, tuple] = {}  # chunk -> (safetensors handle, offsets), least recently used first

    def __len__(self) -> int:
        return self.manifest["num_samples"]

    def _chunk(self, index: int) -> tuple:
        if index in self._open:
            self._open[index] = self._open.pop(index)
        else:

            if len(self._open) >= self.OPEN_CHUNKS:
                self._open.pop(next(iter(self._open)))
            handle = safe_open(str(chunk_path(self.dir, index)), "pt")
            self._open[index] = (handle, handle.get_tensor("offsets").tolist())
        return self._open[index]

    def __getitem__(self, sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        handle, offsets = self._chunk(sample // self.manifest["chunk_size"])
        row = sample % self.manifest["chunk_size"]
        rows = slice(offsets[row], offsets[row + 1])
        return handle.get_slice("ids")[rows].long(), handle.get_slice("logits")[rows]
