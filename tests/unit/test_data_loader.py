"""Global batch sampling, collation (the next-token shift) and the data-parallel split."""
import pytest
import torch

from aligner.data import GlobalBatchSampler, Sample, collate, pad_length, split_for_rank

SAMPLES = [Sample([5, 6, 7, 8], [0, 0, 1, 1]), Sample([9, 10], [0, 1])]


def test_collate_shifts_and_pads():
    batch = collate(SAMPLES, pad_id=0, length=4)
    assert batch["tokens"].tolist() == [[5, 6, 7, 0], [9, 0, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, 8, 0], [10, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert (batch["tokens"].dtype, batch["labels"].dtype, batch["loss_mask"].dtype) == \
        (torch.int64, torch.int64, torch.float32)


def test_collate_pad_id_and_exact_length():
    batch = collate(SAMPLES, pad_id=99, length=3)
    assert batch["tokens"].tolist() == [[5, 6, 7], [9, 99, 99]]
    assert batch["labels"].tolist() == [[6, 7, 8], [10, 99, 99]]
    with pytest.raises(ValueError, match="more than length=2"):
        collate(SAMPLES, pad_id=0, length=2)


@pytest.mark.parametrize("multiple,expected", [(1, 3), (2, 4), (4, 4), (8, 8)])
def test_pad_length(multiple, expected):
    assert pad_length(SAMPLES, multiple) == expected


def test_split_for_rank():
    batch = list(range(8))
    parts = [split_for_rank(batch, r, 4) for r in range(4)]
    assert parts == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_for_rank(SAMPLES, 1, 2) == [SAMPLES[1]]
    with pytest.raises(ValueError, match="does not split evenly"):
        split_for_rank(batch, 0, 3)
    with pytest.raises(ValueError, match="outside"):
        split_for_rank(batch, 4, 4)


def draw(sampler, n):
    return [sampler.next_global_batch() for _ in range(n)]


def test_sampler_without_shuffle_drops_the_tail():
    sampler = GlobalBatchSampler(10, 3, seed=0, shuffle=False)
    assert sampler.batches_per_epoch == 3
    assert draw(sampler, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]
    assert sampler.state_dict()["epoch"] == 1


def test_sampler_epochs_are_seeded_permutations():
    sampler = GlobalBatchSampler(10, 5, seed=7)
    epoch0, epoch1 = sum(draw(sampler, 2), []), sum(draw(sampler, 2), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1 and epoch0 != list(range(10))
    again = GlobalBatchSampler(10, 5, seed=7)
    assert sum(draw(again, 4), []) == epoch0 + epoch1
    assert sum(draw(GlobalBatchSampler(10, 5, seed=8), 2), []) != epoch0
    assert all(len(b) == 5 and all(isinstance(i, int) for i in b) for b in draw(again, 10))


def test_sampler_resume_continues_exactly():
    sampler = GlobalBatchSampler(10, 3, seed=1)
    draw(sampler, 7)
    state = sampler.state_dict()
    assert (state["consumed_samples"], state["epoch"], state["epoch_offset"]) == (21, 2, 3)
    expected = draw(sampler, 5)
    resumed = GlobalBatchSampler(10, 3, seed=1)
    resumed.load_state_dict(state)
    assert draw(resumed, 5) == expected
    assert resumed.state_dict() == sampler.state_dict()


def test_sampler_resume_with_a_new_batch_size():
    sampler = GlobalBatchSampler(10, 2, shuffle=False)
    draw(sampler, 1)
    bigger = GlobalBatchSampler(10, 4, shuffle=False)
    bigger.load_state_dict(sampler.state_dict())
    assert draw(bigger, 3) == [[2, 3, 4, 5], [6, 7, 8, 9], [0, 1, 2, 3]]
    assert bigger.state_dict()["consumed_samples"] == 2 + 12


def test_sampler_rejects_bad_setups():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(3, 4)
    sampler = GlobalBatchSampler(10, 2, seed=1)
    with pytest.raises(ValueError, match="saved with num_samples=10, now num_samples=11"):
        GlobalBatchSampler(11, 2, seed=1).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="seed=1, now seed=2"):
        GlobalBatchSampler(10, 2, seed=2).load_state_dict(sampler.state_dict())
