"""Counter-based random numbers for sampling: one uniform per (sample seed, generated-token index).

Why not one `torch.Generator` per sample: drawing from B generators needs a Python loop over the
batch at every step. Hashing counters gives the same guarantee (a sample's randomness depends only
on its own seed, never on its batch neighbours, its batch position or the batch size) with a few
vectorised integer ops, identical on every rank and on CPU and CUDA (integer arithmetic is exact).

All hashing is 32-bit, carried in int64 tensors (or Python ints): operands stay below 2**32 and
multipliers below 2**31, so no product overflows int64.
"""
from __future__ import annotations

from typing import Sequence

import torch

MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D  # odd multipliers < 2**31
_SEED_HI, _STEP = 0x9E3779B9, 0x632BE5AB  # domain separation constants


def mix32(x):
    """A 32-bit avalanche hash (xorshift-multiply rounds); int64 tensor or int in, same type out."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def sample_key(seed: int) -> int:
    """A 32-bit key from an arbitrary (64-bit, possibly negative) integer seed."""
    seed %= 1 << 64
    return mix32(mix32(seed & MASK32) ^ mix32((seed >> 32) ^ _SEED_HI))


def derive_seed(base_seed: int, index: int) -> int:
    """The seed of sample `index` of a call made with `SamplingParams.seed = base_seed`."""
    return (sample_key(base_seed) << 32) | mix32(index ^ mix32(base_seed ^ _STEP))


def step_keys(seeds: Sequence[int], num_steps: int, device=None) -> torch.Tensor:
    """[B, num_steps] int64 in [0, 2**32): the key of generated token j of each sample."""
    keys = torch.tensor([sample_key(s) for s in seeds], dtype=torch.int64, device=device)
    steps = mix32(torch.arange(num_steps, dtype=torch.int64, device=device) + _STEP)
    return mix32(keys[:, None] ^ steps[None, :])


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in the open interval (0, 1) from 32-bit keys (exact: 32 bits, bin-centred)."""
    return (keys.to(torch.float64) + 0.5) * (1.0 / (1 << 32))
