"""Scalar heads: shapes, the last-token reward convention, gradients, and checkpoint round trip."""
import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import init_single_process


def test_last_token_scores_hand_computed():
    from aligner.models.heads import last_token_scores

    values = torch.arange(2 * 4 * 2, dtype=torch.float32).view(2, 4, 2)
    scores = last_token_scores(values, torch.tensor([2, 4]))
    assert torch.equal(scores, torch.tensor([[2.0, 3.0], [14.0, 15.0]]))


def test_reward_head_replaces_lm_head_and_round_trips(tmp_path):
    from aligner.config.schema import ModelConfig
    from aligner.models import checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.models.heads import attach_scalar_head, last_token_scores
    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything

    init_single_process()
    seed_everything(3)
    cfg = OmegaConf.structured(ModelConfig)
    cfg.tie_embeddings = True  # the head must get its own weight even when embeddings are tied
    model = attach_scalar_head(build_gpt(cfg, 300), num_outputs=3)
    device = distributed.device()
    tokens = torch.randint(0, 300, (2, 10), device=device)
    positions = torch.arange(10, device=device).expand(2, -1)
    values = model(tokens, positions, None)
    assert values.shape == (2, 10, 3)
    scores = last_token_scores(values, torch.tensor([7, 10], device=device))
    scores.sum().backward()
    assert model.output_layer.weight.grad.abs().sum() > 0
    assert model.embedding.word_embeddings.weight.grad.abs().sum() > 0

    checkpoint.save_checkpoint(tmp_path / "rm", model, cfg, 300, head="reward")
    seed_everything(4)
    other = attach_scalar_head(build_gpt(cfg, 300), num_outputs=3)
    assert not torch.equal(other(tokens, positions, None), values)
    checkpoint.load_weights(tmp_path / "rm", other)
    assert torch.equal(other(tokens, positions, None), values)
    assert checkpoint.read_metadata(tmp_path / "rm")["head"] == "reward"
    two = attach_scalar_head(build_gpt(cfg, 300), num_outputs=2)  # a head of another size is not loaded into
    with pytest.raises(checkpoint.checkpoint_keys.CheckpointMismatch, match="no scalar head of 2 output"):
        checkpoint.load_weights(tmp_path / "rm", two)
