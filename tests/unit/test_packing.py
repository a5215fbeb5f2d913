"""Sequence packing: the row layout, pair trees (a pair's common prefix computed once), the tree
attention mask, explicit token positions, and packed batches giving the same per-sequence log-probs,
DPO loss, SFT loss and gradients as padded ones (one process)."""
import pytest
import torch

from aligner.data import packing
from aligner.data.packing import build_micro_batches, first_fit_decreasing, tree_attention_mask
from tests.conftest import build_single_process_gpt


def test_first_fit_decreasing():
    assert first_fit_decreasing([3, 5, 2, 4], capacity=7) == [[1, 2], [0, 3]]  # 5+2, 4+3
    assert first_fit_decreasing([7, 1, 1], capacity=7) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([8], capacity=7)


def test_packed_and_padded_layouts():
    a = ([10, 11, 12, 13], [0, 0, 1, 1])  # 3 positions, labels 11 12 13, trained on 12, 13
    b = ([20, 21, 22], [0, 1, 1])  # 2 positions
    c = ([30, 31], [0, 1])  # 1 position
    padded, length = build_micro_batches([[a, b], [c]], pad_id=0, multiple=4)
    assert length == 4 and [m["tokens"].shape for m in padded] == [(2, 4), (2, 4)]  # one shape per step
    assert padded[0]["tokens"].tolist() == [[10, 11, 12, 0], [20, 21, 0, 0]]
    assert padded[1]["sequence_index"].tolist() == [[0, -1, -1, -1], [-1, -1, -1, -1]]  # an empty filler row

    packed, length = build_micro_batches([[a, b, c]], pad_id=0, packed=True, capacity=7, multiple=7)
    m = packed[0]
    assert length == 7 and m["tokens"].shape == (1, 7) and m["packed"] and m["num_sequences"] == 3
    assert m["tokens"].tolist() == [[10, 11, 12, 20, 21, 30, 0]]
    assert m["labels"].tolist() == [[11, 12, 13, 21, 22, 31, 0]]
    assert m["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0]]
    assert m["sequence_index"].tolist() == [[0, 0, 0, 1, 1, 2, -1]]
    assert m["shared_index"].tolist() == [[-1] * 7]
    assert m["segments"].tolist() == [[0, 0, 0, 1, 1, 2, 3]]  # the padding is a block of its own
    assert m["parents"].tolist() == m["segments"].tolist()
    assert m["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0]]  # restart in every sequence


def test_a_packed_pair_shares_its_common_prefix():
    prompt = [1, 2, 3]
    chosen = (prompt + [4, 5, 6, 9], [0, 0, 0, 1, 1, 1, 1])
    rejected = (prompt + [4, 5, 7], [0, 0, 0, 1, 1, 1])
    m = build_micro_batches([[chosen, rejected]], pad_id=0, packed=True, pairs=True)[0][0]
    # common prefix 1 2 3 4 5 (5 tokens): the trunk holds 4 positions (inputs 1 2 3 4, labels 2 3 4 5);
    # position 4 (input 5) predicts 6 for chosen and 7 for rejected, so it starts both branches.
    assert m["tokens"].tolist() == [[1, 2, 3, 4, 5, 6, 5]]
    assert m["labels"].tolist() == [[2, 3, 4, 5, 6, 9, 7]]
    assert m["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1]]
    assert m["sequence_index"].tolist() == [[0, 0, 0, 0, 0, 0, 1]]
    assert m["shared_index"].tolist() == [[1, 1, 1, 1, -1, -1, -1]]  # trunk labels count for both
    assert m["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 4]]
    allowed = ~tree_attention_mask(m["segments"], m["parents"])[0, 0]
    assert allowed.int().tolist() == [[1, 0, 0, 0, 0, 0, 0],
                                      [1, 1, 0, 0, 0, 0, 0],
                                      [1, 1, 1, 0, 0, 0, 0],
                                      [1, 1, 1, 1, 0, 0, 0],
                                      [1, 1, 1, 1, 1, 0, 0],  # chosen branch: trunk + itself
                                      [1, 1, 1, 1, 1, 1, 0],
                                      [1, 1, 1, 1, 0, 0, 1]]  # rejected branch: trunk + itself only


def test_flat_layout_puts_bins_one_after_another():
    a = ([10, 11, 12, 13], [0, 0, 1, 1])  # 3 positions
    b = ([20, 21, 22], [0, 1, 1])  # 2 positions
    c = ([30, 31], [0, 1])  # 1 position
    (m, n), length = build_micro_batches([[a, b, c], [c]], pad_id=0, packed=True, capacity=4, flat=True, multiple=4)
    # bins (first fit decreasing, capacity 4): [a, c] and [b]; one row, no padding between them
    assert length == 8 and m["tokens"].shape == n["tokens"].shape == (1, 8)
    assert m["tokens"].tolist() == [[10, 11, 12, 30, 20, 21, 0, 0]]
    assert m["sequence_index"].tolist() == [[0, 0, 0, 2, 1, 1, -1, -1]]
    assert m["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    assert m["blocks"] == [0, 4, 6, 8] and n["blocks"] == [0, 1, 8]  # the tail padding is a block too
    assert m["segments"].tolist() == [[0, 0, 0, 1, 2, 2, 3, 3]]


def test_attention_blocks_split_bins_into_unit_runs(monkeypatch):

    monkeypatch.setattr(packing, "MIN_ATTENTION_BLOCK", 64)
    # bin 1: 100 | 30 + 40 (a run closes at >= 64 positions); bin 2: 50 (closed by the bin's end); padding
    assert packing.attention_blocks([[100, 30, 40], [50]], 230) == [0, 100, 170, 220, 230]
    assert packing.attention_blocks([[10, 10], [20]], 40) == [0, 20, 40]  # small units share their bin
    assert packing.attention_blocks([[70, 70]], 140) == [0, 70, 140]  # no padding block when full


def test_tree_attention_mask_rows_for_context_parallel():
    segments = torch.tensor([[0, 0, 1, 1, 2]])
    allowed = ~tree_attention_mask(segments, segments)[0, 0]
    assert allowed.int().tolist() == [[1, 0, 0, 0, 0],
                                      [1, 1, 0, 0, 0],
                                      [0, 0, 1, 0, 0],
                                      [0, 0, 1, 1, 0],
                                      [0, 0, 0, 0, 1]]
    rows = tree_attention_mask(segments, segments, torch.tensor([3, 1]))  # a context-parallel rank's queries
    assert rows.shape == (1, 1, 2, 5) and torch.equal(~rows[0, 0], allowed[[3, 1]])


@pytest.fixture(scope="module")
def model():
    return build_single_process_gpt(5, policy=True, num_query_groups=2)


def _sequences(n: int, seed: int):
    """n/2 pairs (chosen first, then rejected) whose two sequences share a prompt and part of the response."""
    g = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return torch.randint(3, 300, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    chosen, rejected = [], []
    for _ in range(n // 2):
        prompt, common = draw(1, 8), draw(0, 6)
        for side in (chosen, rejected):
            ids = prompt + common + draw(1, 8)
            side.append((ids, [0] * len(prompt) + [1] * (len(ids) - len(prompt))))
    return chosen + rejected


def _run_micro_batches(step, micro, model):
    """Forward and backward of each micro-batch with a megatron-style forward step:
    (loss total, gradients by parameter name, reports with each micro-batch's loss count)."""
    model.zero_grad()
    total, reports = 0.0, []
    for batch in micro:
        output, loss_func = step(iter([batch]), model)
        loss, count, report = loss_func(output)
        loss.backward()
        total += loss.item()
        reports.append({**report, "count": count})
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, reports


def _loss_and_grads(model, step_loss, micro):
    from aligner.algorithms.shared.sequence_logprobs import sequence_loss_step

    total, grads, reports = _run_micro_batches(sequence_loss_step(step_loss, 300), micro, model)
    return total, grads, [{k: v for k, v in r.items() if k != "count"} for r in reports]


@pytest.mark.parametrize("flat, unit_blocks", [(False, False), (True, False), (True, True)],
                         ids=["rows", "flat", "flat-unit-blocks"])
@pytest.mark.parametrize("algorithm", ["dpo", "sft"])
def test_packed_equals_padded(model, algorithm, flat, unit_blocks, monkeypatch):
    from aligner.algorithms.preference.losses import DPO
    from aligner.config.preference_schema import DPOConfig
    from omegaconf import OmegaConf

    if unit_blocks:  # every sequence or pair tree is attended on its own, not its whole bin
        monkeypatch.setattr(packing, "MIN_ATTENTION_BLOCK", 1)

    groups = [_sequences(8, seed=1), _sequences(8, seed=2)]  # two micro-batches of 4 pairs (8 sequences)
    if algorithm == "dpo":
        dpo = DPO(OmegaConf.structured(DPOConfig(beta=0.5, sft_weight=0.3)))

        def step_loss(sums, counts, batch):
            return dpo.loss(sums, counts, batch)
    else:
        def step_loss(sums, counts, batch):  # SFT: the NLL summed over tokens
            return -sums.sum(), counts.sum(), {"loss": -sums.sum()}

    results = []
    for packed in (False, True):
        micro, _ = build_micro_batches(groups, pad_id=0, packed=packed, capacity=40, pairs=algorithm == "dpo",
                                       flat=flat)
        for batch in micro:
            batch["reference"] = torch.linspace(-30.0, -10.0, 8)
        if packed:
            assert micro[0]["tokens"].shape[0] == 1 if flat else micro[0]["tokens"].shape[0] < 8  # rows are shared
            assert ("blocks" in micro[0]) == flat
            if flat:  # blocks: one per unit (+ the tail padding), or whole bins of several units
                units = 4 if algorithm == "dpo" else 8
                assert (len(micro[0]["blocks"]) - 1 >= units) == unit_blocks
        results.append(_loss_and_grads(model, step_loss, micro))
    (padded_loss, padded_grads, padded_reports), (packed_loss, packed_grads, packed_reports) = results
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    for key in padded_reports[0]:
        for a, b in zip(padded_reports, packed_reports):
            assert b[key].item() == pytest.approx(a[key].item(), rel=1e-5, abs=1e-5), key
    for name, grad in padded_grads.items():
        assert (packed_grads[name] - grad).abs().max().item() < 1e-5 * max(1.0, grad.abs().max().item()), name


@pytest.mark.parametrize("capacity", [80, 12])  # one row; a flat row of several blocks
def test_packed_rows_do_not_see_each_other(model, capacity):
    """Changing one packed sequence leaves the log-probs of its row neighbours unchanged."""
    from aligner.algorithms.shared.sequence_logprobs import logprob_sums

    seqs = _sequences(4, seed=3)
    changed = list(seqs)
    changed[2] = ([7] * len(seqs[2][0]), seqs[2][1])
    flat = capacity < 80
    micro = [build_micro_batches([s], 0, packed=True, capacity=capacity, flat=flat) for s in (seqs, changed)]
    sums = [logprob_sums(model, m, length, 300)[0] for m, length in micro]
    # flat: 3 blocks (capacity is raised to the longest sequence, and two of the others share one)
    assert micro[0][0][0]["tokens"].shape[0] == 1 and len(micro[0][0][0].get("blocks", [0, 0])) - 1 == (3 if flat else 1)
    assert torch.allclose(sums[0][[0, 1, 3]], sums[1][[0, 1, 3]], atol=1e-5)
    assert not torch.allclose(sums[0][2], sums[1][2])


@pytest.mark.parametrize("kind", ["margin_pairs", "regression"])
def test_packed_reward_model_equals_padded(model, kind):  # `model`: the process group
    """Reward-model losses, reports and gradients through packed pair trees (a pair's prompt computed
    once, each reward read at its sequence's last token) equal the padded reward-model forward step."""
    from aligner.algorithms.shared.sequence_logprobs import sequence_loss_step
    from aligner.models.forward_step import head_values
    from aligner.models.policy import build_policy
    from aligner.algorithms.preference.reward_model import (PackedRewardObjective, PairFormat, RegressionFormat,
                                                 make_rm_forward_step)
    from aligner.config.schema import ModelConfig
    from aligner.data.preference_rm import PairSample, RegressionSample
    from aligner.models.gpt import build_gpt
    from aligner.models.heads import attach_scalar_head
    from aligner.runtime.seeding import seed_everything
    from omegaconf import OmegaConf

    def reward_model(build):  # the same weights from the same seed (the packed one reads explicit positions)
        seed_everything(6)
        return attach_scalar_head(build(OmegaConf.structured(ModelConfig(num_query_groups=2)), 300), outputs)

    outputs = 2 if kind == "regression" else 1
    seqs = _sequences(8, seed=4)
    if kind == "regression":
        samples = [RegressionSample(ids, [0.5 * i, -1.0], [1.0, float(i % 2)]) for i, (ids, _) in enumerate(seqs)]
        padded_format = RegressionFormat(pad_id=0)
    else:
        samples = [PairSample(c, r, margin=0.25 * i) for i, ((c, _), (r, _)) in enumerate(zip(seqs[:4], seqs[4:]))]
        padded_format = PairFormat(pad_id=0)
    groups = [samples[:len(samples) // 2], samples[len(samples) // 2:]]

    length = max(padded_format.length(s) for s in samples)
    padded = _run_micro_batches(make_rm_forward_step(kind), [padded_format.collate(g, length) for g in groups],
                                reward_model(build_gpt))
    objective = PackedRewardObjective(kind, pad_id=0)
    micro, _ = build_micro_batches([[seq for j in range(len(objective.sequences(g[0])))
                                     for seq in (objective.sequences(s)[j] for s in g)] for g in groups],
                                   pad_id=0, packed=True, capacity=60, pairs=kind != "regression", flat=True)
    assert micro[0]["tokens"].shape[0] == 1  # every sample in one row
    objective.annotate(None, samples, groups, micro, 0)
    packed = _run_micro_batches(sequence_loss_step(objective.loss, 300, head_values), micro,
                                reward_model(build_policy))
    assert packed[0] == pytest.approx(padded[0], rel=1e-5)
    for a, b in zip(padded[2], packed[2]):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key].item() == pytest.approx(a[key].item(), rel=1e-5, abs=1e-5), key
    for name, grad in padded[1].items():
        assert (packed[1][name] - grad).abs().max().item() < 1e-5 * max(1.0, grad.abs().max().item()), name


def test_a_flat_rows_one_sequence_blocks_are_attended_together_as_each_alone(monkeypatch):
    """Blocks of one sequence are causal: FusedCoreAttention pads those of similar size into a few batched
    calls; each position's output equals its block attended alone, and a pair tree's block keeps its mask."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from aligner.models.sdpa_attention import BlockDiagonalMask, FusedCoreAttention

    monkeypatch.setattr(packing, "MIN_ATTENTION_BLOCK", 1)  # a block per unit: RL's short samples
    g = torch.Generator().manual_seed(3)
    sizes = [20, 3, 18, 7, 5, 16, 19]
    sequences = [(torch.randint(3, 300, (n,), generator=g).tolist(), [1] * n) for n in sizes]
    pair = _sequences(2, seed=4)
    (single,), _ = build_micro_batches([sequences], 0, packed=True, flat=True)
    (tree,), _ = build_micro_batches([pair], 0, packed=True, pairs=True, flat=True)
    segments = torch.cat([single["segments"], tree["segments"] + single["segments"].max() + 1], 1)
    parents = torch.cat([single["parents"], torch.where(tree["parents"] >= 0,
                                                        tree["parents"] + single["segments"].max() + 1, -1)], 1)
    bounds = single["blocks"] + [b + single["blocks"][-1] for b in tree["blocks"][1:]]
    mask = BlockDiagonalMask.from_tree(segments, parents, bounds)
    assert [m is None for m in mask.allowed] == [True] * len(sizes) + [False] * (len(tree["blocks"]) - 1)
    groups, _ = mask.causal_groups(torch.device("cpu"))
    # a sequence of n tokens is n - 1 positions; groups are within 4/3 of their longest: 19 18 17 15 | 6 | 4 | 2
    assert [tuple(g_.shape) for g_, _ in groups] == [(4, 19), (1, 6), (1, 4), (1, 2)]

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, kv_channels=16)
    core = FusedCoreAttention(config)
    length = bounds[-1]
    q, k, v = (torch.randn(length, 1, 4, 16, generator=g, requires_grad=True) for _ in range(3))
    out = core(q, k, v, mask)
    alone = torch.cat([core._attend(q[a:e], k[a:e], v[a:e], allowed)
                       for (a, e), allowed in zip(zip(bounds, bounds[1:]), mask.allowed)])
    assert out.shape == (length, 1, 64)
    assert torch.allclose(out, alone, atol=1e-6)
    weights = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((alone * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-6)
