"""The device kit's model-FLOPs formula (bench/accept_checks.py) by hand.
The kit's dry run: tests/e2e/test_device_kit.py."""
from __future__ import annotations

from bench.accept_checks import train_flops_per_token


def test_train_flops_per_token_by_hand():
    """1 layer, hidden 4, 2 heads of dim 2 in 1 KV group, FFN 8, vocab 10, rows of 3 tokens. Weights a token
    multiplies: q 4x4 + k 4x2 + v 4x2 + o 4x4 + FFN 3x4x8 + head 4x10 = 184, 2 FLOPs each; attention at the mean
    context (3 + 1) / 2 = 2 keys: QK^T 2 heads x 2 dims x 2 keys and AV the same, 2 FLOPs per multiply-add = 32;
    training = 3 x (368 + 32)."""
    arch = {"num_layers": 1, "hidden_size": 4, "num_attention_heads": 2, "num_query_groups": 1, "ffn_hidden_size": 8,
            "vocab_size": 10}
    assert train_flops_per_token(arch, 3) == 1200
