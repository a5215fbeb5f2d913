"""Collective model execution behind the servers, also usable in-process.

A server job has one or more ranks (TP x PP x DP). Global rank 0 hosts PyTriton; when a request
arrives it broadcasts a command and the request's tensors (`Broadcaster`), and then every rank runs
the same collective code: the rows are split over data-parallel replicas, each replica runs
megatron's schedule over micro-batches, and the results are summed into a tensor on rank 0 (each
row is written by exactly one rank: the last pipeline stage's tensor-parallel rank 0 of the replica
that owns it). The other ranks sit in `follow`, waiting for the next broadcast.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STOP, REWARD, VALUES, TRAIN, SAVE = range(5)  # broadcast commands


class Broadcaster:
    """Rank 0 -> every rank: a command code and named tensors of any dtype and shape."""

    def __init__(self):
        from aligner.runtime.distributed import device

        self.device = device()

    def send(self, command: int, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """On rank 0: broadcast; returns the tensors as every rank holds them (on the device)."""
        tensors = {k: v.to(self.device).contiguous() for k, v in (tensors or {}).items()}
        if dist.get_world_size() > 1:
            dist.broadcast_object_list([command, {k: (str(v.dtype), tuple(v.shape)) for k, v in tensors.items()}], src=0)
            for value in tensors.values():
                dist.broadcast(value, src=0)
        return tensors

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """On the other ranks: wait for rank 0's next broadcast."""
        header = [None, None]
        dist.broadcast_object_list(header, src=0)
        tensors = {}
        for name, (dtype, shape) in header[1].items():
            tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype.replace("torch.", "")), device=self.device)
            dist.broadcast(tensors[name], src=0)
        return header[0], tensors


def follow(broadcaster: Broadcaster, handlers: dict[int, Callable[[dict], object]]) -> None:
    """The loop of every rank but 0: run each broadcast command until STOP."""
    while True:
        command, tensors = broadcaster.receive()
        if command == STOP:
            return
        handlers[command](tensors)


@contextlib.contextmanager
def on_device():
    """PyTriton calls us from its own threads, where CUDA's current device is not yet ours (and,
    on CPU, the thread-local megatron shims are not active yet)."""
    if torch.cuda.is_available():
        from aligner.runtime.distributed import device

        with torch.cuda.device(device()):
            yield
    else:
        from aligner.runtime import cpu_shims

        cpu_shims.enter_thread()
        yield


# ---- models ----------------------------------------------------------------------------------------
def build_scalar_model(checkpoint, parallel, num_outputs: int):
    """GPT + scalar head with `checkpoint`'s architecture at this job's TP/PP (weights not loaded)."""
    from aligner.models.checkpoint import model_config_from_checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.models.heads import attach_scalar_head

    layout = {"tensor_model_parallel_size": parallel.tensor_model_parallel_size,
              "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size}
    if parallel.params_dtype:
        layout["params_dtype"] = parallel.params_dtype
    cfg, vocab = model_config_from_checkpoint(checkpoint, **layout)
    return attach_scalar_head(build_gpt(cfg, vocab), num_outputs), cfg, vocab


# ---- collective forward -------------------------------------------------------------------------------
def _split_rows(rows: int, micro_batch_size: int) -> tuple[int, int, int]:
    """(rows per data-parallel rank, micro-batch size, padded total): every replica gets the same
    number of whole micro-batches (pipeline stages exchange fixed shapes)."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    per_rank = -(-rows // dp)
    mbs = max(1, min(micro_batch_size, per_rank))
    per_rank = -(-per_rank // mbs) * mbs
    return per_rank, mbs, per_rank * dp


def _pad_rows(tensor: torch.Tensor, rows: int, value=0) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    pad = tensor.new_full((rows - tensor.shape[0], *tensor.shape[1:]), value)
    return torch.cat([tensor, pad])


def _to_rank0(local: torch.Tensor | None, rows: slice, total: int, trailing: tuple, device) -> torch.Tensor | None:
    """Sum every replica's rows into one [total, *trailing] tensor on global rank 0."""
    from megatron.core import parallel_state as ps

    owner = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    if dist.get_world_size() == 1:
        return local
    full = torch.zeros((total, *trailing), dtype=torch.float32, device=device)
    if owner:
        full[rows] = local
    dist.reduce(full, dst=0)
    return full if dist.get_rank() == 0 else None


@torch.no_grad()
def forward_rows(model, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int,
                 head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], trailing: tuple) -> torch.Tensor | None:
    """Collective: `head(values [b, s, k] float32, lengths [b]) -> [b, *trailing]` for every row of
    `tokens` [B, S] (the same on every rank). Returns the [B, *trailing] result on rank 0, else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows, width = tokens.shape
    per_rank, mbs, total = _split_rows(rows, micro_batch_size)
    device = tokens.device
    tokens, lengths = _pad_rows(tokens, total), _pad_rows(lengths, total, 1)
    mine = slice(ps.get_data_parallel_rank() * per_rank, (ps.get_data_parallel_rank() + 1) * per_rank)
    micro = [{"tokens": tokens[mine][i:i + mbs], "lengths": lengths[mine][i:i + mbs]} for i in range(0, per_rank, mbs)]
    positions = torch.arange(width, device=device)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], positions.expand(batch["tokens"].shape[0], -1), None)

        def collect(values):
            return (torch.zeros((), device=device), torch.zeros((), dtype=torch.int, device=device),
                    {"out": head(values.float(), batch["lengths"])})

        return output, collect

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[model], num_microbatches=len(micro),
        seq_length=width, micro_batch_size=mbs, forward_only=True)
    local = torch.cat([o["out"] for o in outputs]) if outputs else None
    full = _to_rank0(local, mine, total, trailing, device)
    return None if full is None else full[:rows]


def last_token_head(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    from aligner.models.heads import last_token_scores

    return last_token_scores(values, lengths)


def token_values_head(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """values [b, s, 1] -> [b, s], zero at and after each row's length."""
    real = torch.arange(values.shape[1], device=values.device)[None, :] < lengths[:, None]
    return values[..., 0] * real


# ---- in-process scoring ------------------------------------------------------------------------------
def score_checkpoint(checkpoint, sequences: list[list[int]], per_token: bool = False,
                     micro_batch_size: int = 8) -> torch.Tensor:
    """A scalar-head checkpoint (reward or value) run in this process (TP=PP=1) on token sequences:
    rewards [n, A] at each sequence's last token, or with `per_token` values [n, longest] (0 past
    each sequence's end) from the first output."""
    from types import SimpleNamespace

    from aligner.algorithms.reward_model import head_outputs
    from aligner.models.checkpoint import load_weights
    from aligner.models.hf_convert import single_process
    from aligner.runtime.distributed import device
    from aligner.runtime.seeding import seed_everything
    from aligner.servers.protocol import pad_token_rows

    with single_process():
        seed_everything(0)
        outputs = head_outputs(checkpoint)
        parallel = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, params_dtype=None)
        model, _, _ = build_scalar_model(checkpoint, parallel, outputs)
        load_weights(checkpoint, model)
        model.eval()
        tokens, lengths = pad_token_rows(sequences)
        tokens, lengths = torch.from_numpy(tokens).to(device()), torch.from_numpy(lengths[:, 0]).to(device())
        if per_token:
            return forward_rows(model, tokens, lengths, micro_batch_size, token_values_head, (tokens.shape[1],)).cpu()
        return forward_rows(model, tokens, lengths, micro_batch_size, last_token_head, (outputs,)).cpu()
