"""The layer spec without Transformer Engine installed: which spec `transformer_impl` builds on every
kind of host (and the one line that says why), sequence parallelism on the local spec with no CPU shim,
and checkpoints across specs: the keys each spec requests, and the only mismatches a load lets through.
What needs TE itself (building its spec, FP8 extra state) is checked by the device kit on a GPU."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from aligner.models import checkpoint_keys as ck
from aligner.models.gpt import SpecChoice, choose_layer_spec
from aligner.runtime.optional import Availability, MissingOptionalDependency
from tests import hf_workers as hfw
from tests.conftest import build_single_process_gpt, init_single_process

NOT_INSTALLED = Availability("transformer_engine", False, False, "not installed")
BROKEN = Availability("transformer_engine", True, False, "OSError: libcuda.so.1: cannot open shared object file")
IMPORTABLE = Availability("transformer_engine", True, True, None)


# ---- which spec, and why ------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl, cuda, te, expected", [
    ("local", cuda, te, SpecChoice(False, "model.transformer_impl=local"))
    for cuda in (False, True) for te in (NOT_INSTALLED, BROKEN, IMPORTABLE)] + [
    ("transformer_engine", cuda, IMPORTABLE, SpecChoice(True, "model.transformer_impl=transformer_engine"))
    for cuda in (False, True)] + [
    ("auto", False, te, SpecChoice(False, "no CUDA device")) for te in (NOT_INSTALLED, BROKEN, IMPORTABLE)] + [
    ("auto", True, NOT_INSTALLED, SpecChoice(False, "transformer_engine not installed")),
    ("auto", True, IMPORTABLE, SpecChoice(True, "CUDA + TE importable")),
])
def test_spec_choice(impl, cuda, te, expected):
    assert choose_layer_spec(impl, cuda, te) == expected


def test_auto_on_a_cuda_host_with_a_broken_te_warns_with_the_import_error():
    choice = choose_layer_spec("auto", True, BROKEN)
    assert not choice.transformer_engine and choice.warn
    assert choice.line().startswith("layer spec: local (transformer_engine is installed but does not import: "
                                    "OSError: libcuda.so.1") and "model.transformer_impl=local" in choice.line()
    assert "\n" not in choice.line()


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("te, hint", [(NOT_INSTALLED, "pip install 'aligner[te]'"),
                                      (BROKEN, "cannot load on this host")])
def test_transformer_engine_that_cannot_load_is_an_error(cuda, te, hint):
    with pytest.raises(MissingOptionalDependency, match="transformer_engine is needed") as error:
        choose_layer_spec("transformer_engine", cuda, te)
    assert hint in str(error.value) and "\n" not in str(error.value)


def test_the_choice_is_logged_once_per_process(caplog):
    from aligner.models import gpt
    from aligner.runtime.optional import probe

    assert not probe("transformer_engine").installed  # TE must never be in the CPU environment (it breaks megatron)
    gpt._layer_spec_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="aligner.models.gpt"):
        assert not gpt.use_transformer_engine("auto") and not gpt.use_transformer_engine("auto")
    assert [r.getMessage() for r in caplog.records] == ["layer spec: local (no CUDA device)"]


# ---- sequence parallelism on the local spec -------------------------------------------------------------------
def _model_config(**fields):
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig

    cfg = OmegaConf.structured(ModelConfig)
    cfg.update(fields)
    return cfg


def test_local_norms_take_sequence_parallelism_without_a_shim():
    """megatron's torch norm still refuses SP here, with the CPU shims applied: the local spec's norms do
    not depend on them, so a GPU (where no shim runs) builds the same model."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from aligner.models.gpt import SequenceParallelTorchNorm, decoder_spec, layer_spec, transformer_config

    init_single_process()  # applies the CPU shims
    m = _model_config(tensor_model_parallel_size=2, sequence_parallel=True, transformer_impl="local")
    config = transformer_config(m)
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(config, 8)
    layer = layer_spec(m).submodules
    assert layer.input_layernorm is SequenceParallelTorchNorm and layer.pre_mlp_layernorm is SequenceParallelTorchNorm
    block = decoder_spec(m, transformer_config(_model_config(transformer_impl="local")))
    assert block.layer_norm is SequenceParallelTorchNorm and len(block.layer_specs) == m.num_layers
    x = torch.randn(5, 2, 8)
    for sp in (True, False):
        config.sequence_parallel = sp
        norm = SequenceParallelTorchNorm(config, 8, eps=1e-5)
        assert type(norm) is torch.nn.RMSNorm and norm.weight.sequence_parallel is sp
        assert config.sequence_parallel is sp  # the caller's config is left alone
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        reference = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
        torch.testing.assert_close(norm(x), reference)


# ---- checkpoint keys across specs ----------------------------------------------------------------------------
def test_name_mapping_matches_the_keys_megatron_writes():
    """Every entry of a local-spec model's sharded state dict maps, through the TE name of its tensor,
    to the key megatron writes, one to one; the TE spec requests those plus its final norm's extra state."""
    model = build_single_process_gpt(0, num_layers=2)
    sharded = model.sharded_state_dict()
    mapped = {name: ck.checkpoint_key(ck.te_state_dict_name(name)) for name in sharded}
    assert mapped == {name: entry.key for name, entry in sharded.items()}
    assert ck.te_state_dict_name("decoder.layers.1.input_layernorm.weight") == \
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert ck.te_state_dict_name("decoder.layers.0.pre_mlp_layernorm.weight") == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    layers = [[name for name in sharded if name.startswith(f"decoder.layers.{i}.")] for i in (0, 1)]
    assert len({mapped[name] for name in layers[0]}) == len(layers[0]) == 10  # one to one within a layer
    assert {mapped[name] for name in layers[0]} == {mapped[name] for name in layers[1]}  # one stack per tensor
    local_keys = {entry.key for entry in sharded.values()}
    te_keys = ck.te_checkpoint_keys(local_keys, final_norm=True)
    assert te_keys - local_keys == {ck.TE_FINAL_NORM_EXTRA_STATE}
    assert ck.te_checkpoint_keys(local_keys, final_norm=False) == local_keys
    assert ck.te_extra_state_names(model) == set()  # no TE module: no absent key is ever tolerated here


def test_key_rules():
    extra = "decoder.final_layernorm._extra_state"
    assert ck.check_checkpoint_keys({extra}, set(), {extra}, "ck") == ({extra}, set())  # local ckpt -> TE model
    assert ck.check_checkpoint_keys(set(), {extra}, set(), "ck") == (set(), {extra})  # TE ckpt -> local model
    with pytest.raises(ck.CheckpointMismatch, match=r"lacks 1 tensor\(s\) this model needs \(" + extra):
        ck.check_checkpoint_keys({extra}, set(), set(), "ck")  # extra state, but not of a TE module
    with pytest.raises(ck.CheckpointMismatch, match="lacks 1 tensor.*decoder.final_layernorm.weight"):
        ck.check_checkpoint_keys({"decoder.final_layernorm.weight"}, set(), {extra}, "ck")
    with pytest.raises(ck.CheckpointMismatch, match="holds 1 tensor.*decoder.extra.weight"):
        ck.check_checkpoint_keys(set(), {"decoder.extra.weight", extra}, set(), "ck")
    ck.check_module_keys(["decoder.layers.0.self_attention.core_attention._extra_state"], [],
                         {"decoder.layers.0.self_attention.core_attention._extra_state"}, "ck")
    with pytest.raises(ck.CheckpointMismatch, match="missing decoder.final_layernorm.weight, unexpected none"):
        ck.check_module_keys(["decoder.final_layernorm.weight"], [], set(), "ck")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`aligner convert hf-to-mcore` output of a tiny Llama, made in this process (world of one)."""
    from aligner.models.hf_convert import import_rank

    root = tmp_path_factory.mktemp("te_spec")
    hfw.make_hf_model("llama", root / "hf", seed=1)
    init_single_process()
    import_rank(root / "hf", root / "ck", tp=1, pp=1)
    return root / "ck"


def _local_model(path):
    from aligner.models.checkpoint import model_config_from_checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.runtime.seeding import seed_everything

    cfg, vocab = model_config_from_checkpoint(path)
    seed_everything(7)
    return build_gpt(cfg, vocab)


def _rewrite_weights(src, dst, change):
    """A copy of checkpoint `src` whose weights are the local model's sharded state dict after `change`."""
    from megatron.core import dist_checkpointing

    from aligner.models.checkpoint import load_weights

    shutil.copytree(src, dst)
    shutil.rmtree(dst / "weights")
    (dst / "weights").mkdir()
    model = _local_model(src)
    load_weights(src, model)
    sharded = model.sharded_state_dict()
    change(sharded)
    dist_checkpointing.save({"model": sharded}, str(dst / "weights"))
    return dst


def test_converted_checkpoint_loads_into_the_local_spec_and_is_what_te_requests(converted):
    """Into the local spec: every weight; the TE spec's request (the local one through the mapping) finds
    everything but its final norm's extra state, which the rule lets through for TE modules only."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    from aligner.models.checkpoint import load_weights

    model = _local_model(converted)
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    load_weights(converted, model)
    changed = [k for k, v in model.state_dict().items() if torch.is_tensor(v) and not torch.equal(v, before[k])]
    assert len(changed) == len(before)

    te_request = model.sharded_state_dict()
    te_request[ck.TE_FINAL_NORM_EXTRA_STATE] = make_sharded_object_for_checkpoint(
        torch.empty(0, dtype=torch.uint8), ck.TE_FINAL_NORM_EXTRA_STATE)  # TE's extra state without FP8
    assert {e.key for e in te_request.values()} == ck.te_checkpoint_keys({e.key for e in model.sharded_state_dict()
                                                                          .values()}, final_norm=True)
    _, left_over, absent = dist_checkpointing.load({"model": te_request}, str(converted / "weights"),
                                                   strict=StrictHandling.RETURN_ALL)
    assert (absent, left_over) == ({ck.TE_FINAL_NORM_EXTRA_STATE}, set())
    assert ck.check_checkpoint_keys(absent, left_over, {ck.TE_FINAL_NORM_EXTRA_STATE}, "ck")[0] == absent
    with pytest.raises(ck.CheckpointMismatch):  # the same key on a model without TE modules
        ck.check_checkpoint_keys(absent, left_over, set(), "ck")


def test_te_extra_state_in_a_checkpoint_is_ignored_and_said(converted, tmp_path, caplog):
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    from aligner.models.checkpoint import load_weights

    def add_te_final_norm_state(sharded):
        sharded["te"] = make_sharded_object_for_checkpoint(torch.empty(0, dtype=torch.uint8),
                                                           ck.TE_FINAL_NORM_EXTRA_STATE)

    path = _rewrite_weights(converted, tmp_path / "te_written", add_te_final_norm_state)
    model = _local_model(converted)
    with caplog.at_level(logging.INFO, logger="aligner.models.checkpoint"):
        load_weights(path, model)
    assert any(f"ignored its Transformer Engine extra state {ck.TE_FINAL_NORM_EXTRA_STATE}" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("case, match", [
    ("unexpected weight", r"holds 1 tensor\(s\) this model does not have \(decoder.extra.weight\)"),
    ("missing weight", r"lacks 1 tensor\(s\) this model needs \(decoder.final_layernorm.weight\)"),
    ("missing local extra state", r"lacks 1 tensor\(s\) this model needs "
                                  r"\(decoder.layers.self_attention.linear_qkv._extra_state\)"),
])
def test_mismatches_fail_naming_the_keys(converted, tmp_path, case, match):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from aligner.models.checkpoint import load_weights

    def change(sharded):
        if case == "unexpected weight":
            sharded["extra"] = ShardedTensor.from_rank_offsets("decoder.extra.weight", torch.ones(4))
        elif case == "missing weight":
            del sharded["decoder.final_layernorm.weight"]
        else:  # extra state may be absent for TE modules only; these are megatron's local linears
            for name in [n for n in sharded if n.endswith("linear_qkv._extra_state")]:
                del sharded[name]

    path = _rewrite_weights(converted, tmp_path / case.replace(" ", "_"), change)
    with pytest.raises(ck.CheckpointMismatch, match=match) as error:
        load_weights(path, _local_model(converted))
    assert str(path) in str(error.value) and "\n" not in str(error.value)
