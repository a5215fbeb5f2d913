"""The RL passes compute the output layer only at the response positions (`aligner.models.read_positions.
output_at`, through `forward_step.make_forward_step`): their per-token log-probs, the policy loss and every
gradient equal those of the full-logits pass within 1e-6, under TP=2 (vocab-parallel output layer; with
and without sequence parallelism) and PP=2 (the last stage, with the whole vocabulary), for padded,
packed and flat packed batches; under CP=2 the sequence log-prob sums do. The output layer sees only the
response positions. One 2-rank launch of tests/rl_output_positions_workers.py; one process for no read row."""
import json

import pytest
import torch

from aligner.launch.local import launch
from aligner.models.read_positions import at_rows, from_rows, masked_rows, output_at

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("rl_output_positions")
    launch("tests.rl_output_positions_workers:main", [str(workdir)], 2, log_dir=workdir / "logs")
    return json.loads((workdir / "results.json").read_text())


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "pp2"])
@pytest.mark.parametrize("packing", ["padded", "packed_rows", "packed_flat"])
def test_rl_passes_at_response_positions_equal_the_full_logits(results, layout, packing):
    ranks = results[layout]
    tag = f"{layout}_{packing}"
    print(tag, [{k.removeprefix(tag + "_"): v for k, v in r.items() if k.startswith(tag)} for r in ranks])
    for r in ranks:
        assert r[f"{tag}_logprobs"] < TOLERANCE and r[f"{tag}_logprobs_top_k"] < TOLERANCE
        assert r[f"{tag}_loss"] < TOLERANCE
        assert r[f"{tag}_grads"] < TOLERANCE
        assert r[f"{tag}_grads_complete"] and r[f"{tag}_grads_norm"] > 0
    last = ranks[-1] if layout == "pp2" else ranks[0]  # PP: rank 1 holds the last stage
    every = last[f"{tag}_positions"] // (2 if layout == "tp2_sp" else 1)  # SP: the full pass's input is split
    assert last[f"{tag}_rows"] == [last[f"{tag}_response_tokens"], every]
    assert last[f"{tag}_response_tokens"] < last[f"{tag}_positions"] / 2  # the prompts' logits are really skipped


@pytest.mark.dist
@pytest.mark.parametrize("packing", ["padded", "packed_rows"])
def test_sequence_sums_under_context_parallelism(results, packing):
    ranks, tag = results["cp2"], f"cp2_{packing}"
    assert all(r[f"{tag}_sums"] < TOLERANCE for r in ranks)
    # each CP rank computes the output at its own response positions
    read, every = (sum(r[f"{tag}_rows"][i] for r in ranks) for i in (0, 1))
    assert (read, every) == (ranks[0][f"{tag}_response_tokens"], ranks[0][f"{tag}_positions"])


def test_rows_round_trip_in_position_major_order():
    values = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)  # [b, s, extra]
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]])
    rows = masked_rows(mask)
    read = at_rows(values, rows)
    assert read.shape == (1, 4, 3)
    expected = torch.stack([values[1, 0], values[0, 1], values[0, 2], values[1, 3]])  # (t, i): (0, 1), (1, 0), ...
    assert torch.equal(read[0], expected)
    back = from_rows(read, rows, 2, 4)
    assert torch.equal(back, values * mask[..., None])


def test_no_read_row_computes_nothing():
    from tests.conftest import build_single_process_gpt

    gpt = build_single_process_gpt(11)
    tokens = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(4))
    with output_at(gpt, masked_rows(torch.zeros(2, 6))) as compact:  # e.g. a CP rank holding no response token
        assert compact
        assert gpt(tokens, None, None).shape[:2] == (1, 0)
    with output_at(gpt, torch.tensor([1, 4])) as compact:
        assert compact
        assert gpt(tokens, None, None).shape[:2] == (1, 2)
