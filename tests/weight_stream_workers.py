"""Rank entry point of tests/integration/test_weight_stream_collectives.py: the weight stream's collective calls.

argv: <workdir> <layouts as JSON [[tp, pp], ...]>. <workdir>/hf.pt holds a tiny Hugging Face model
({"config": HF config dict, "state": state dict}). For each layout (one launch, several layouts) every
rank builds the megatron model, loads the HF tensors into its shards (`load_weight_stream`, the
import direction), then under `collectives.record()`:
  * streams it back with `iter_hf_weights` (all_ranks False and True; 16 KiB buckets);
  * runs the TensorRT-LLM refit protocol `send_weight_stream` over that stream (all_ranks False: only
    rank 0 holds tensors; True: every rank does), with a stand-in IPC handle (rank, tensor sum) that
    also checks, through weak references, that the tensors behind a bucket's handles are still alive
    when the next bucket is prepared and (rank 0) while `update` reads them.
Each rank writes <workdir>/<layout>.rank<r>.json: its recorded calls, whether what it received equals
the HF state bit for bit, and (rank 0) the payloads `update` got.
"""
from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

BUCKET_BYTES = 1 << 14


def _calls(recorded) -> list:
    """(op, group ranks, shape, dtype) per call, JSON-ready."""
    return [[op, list(ranks), list(shape[0]) if shape else None, shape[1] if shape else None]
            for op, ranks, shape in recorded]


class _Handles:
    """`to_handle` and `update` of `send_weight_stream` for a CPU run: a handle is (rank, tensor sum); rank 0
    keeps each merged payload as {uuid: [[name, rank, sum], ...]}."""

    def __init__(self, rank: int):
        self.rank, self.updates, self.dead_at_next_bucket, self.dead_at_update = rank, [], 0, 0
        self.current, self.previous = [], []

    def to_handle(self, tensor: torch.Tensor):
        if not self.current:  # the first tensor of a bucket: the previous bucket's must still be alive
            self.dead_at_next_bucket += sum(ref() is None for ref in self.previous)
        self.current.append(weakref.ref(tensor))
        return self.rank, float(tensor.double().sum())

    def next_bucket(self) -> None:
        if self.current:
            self.previous, self.current = self.current, []

    def update(self, payload) -> None:  # rank 0: the handles of this bucket (or, finishing, of the last) are in use
        self.dead_at_update += sum(ref() is None for ref in self.current)
        self.updates.append(None if payload is None else
                            {uuid: [[name, *handle] for name, handle in handles] for uuid, handles in payload.items()})


def main(argv: list[str]) -> None:
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig
    from aligner.generation.trtllm_engine import send_weight_stream
    from aligner.generation.weights import load_weight_stream
    from aligner.models import hf_weights as hw
    from aligner.models.gpt import build_gpt
    from aligner.models.weight_stream import iter_hf_weights
    from aligner.runtime import collectives
    from aligner.runtime.distributed import init_model_parallel, init_process_group, shutdown
    from aligner.runtime.seeding import seed_everything

    workdir = Path(argv[0])
    init_process_group(timeout_s=120)  # a rank that skips a call fails the test in minutes, not hours
    torch.set_num_threads(1)
    rank = dist.get_rank()
    hf = torch.load(workdir / "hf.pt")
    fields = hw.model_fields_from_hf(hf["config"])
    vocab = fields["vocab_size"]
    for tp, pp in json.loads(argv[1]):
        init_model_parallel(tp, pp)
        cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), fields,
                              {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp})
        seed_everything(0)
        model = build_gpt(cfg, vocab)
        load_weight_stream(model, [hf["state"]], cfg, vocab)
        out = {}
        for all_ranks in (False, True):
            def stream():
                return iter_hf_weights(model, cfg, vocab, bucket_bytes=BUCKET_BYTES, all_ranks=all_ranks)

            with collectives.record() as recorded:
                streamed, buckets = {}, 0
                for bucket in stream():
                    streamed.update(bucket)
                    buckets += 1
            receiver = all_ranks or rank == 0
            equal = set(streamed) == set(hf["state"]) and all(torch.equal(t, hf["state"][k]) for k, t in streamed.items())
            handles = _Handles(rank)

            def transposed_buckets():  # non-contiguous tensors: `send_weight_stream` makes contiguous temporaries
                for bucket in stream():
                    handles.next_bucket()
                    yield {name: t.t() if t.dim() == 2 else t for name, t in bucket.items()}

            with collectives.record() as refit_calls:
                refit_buckets = send_weight_stream(transposed_buckets(), f"rank{rank}", "cpu", handles.to_handle,
                                                   handles.update)
            handles.next_bucket()
            out[f"all_ranks={all_ranks}"] = {
                "stream_calls": _calls(recorded), "buckets": buckets, "received": bool(streamed),
                "equal": equal if receiver else None, "refit_calls": _calls(refit_calls),
                "refit_buckets": refit_buckets, "updates": handles.updates,
                "dead_at_next_bucket": handles.dead_at_next_bucket, "dead_at_update": handles.dead_at_update,
                "dead_after": sum(ref() is None for ref in handles.previous), "handed": len(handles.previous)}
        (workdir / f"tp{tp}pp{pp}.rank{rank}.json").write_text(json.dumps(out))
    shutdown()
