"""`swiglu` and `SwiGLUMLP` (aligner/models/swiglu.py): bitwise equal to megatron's unfused SwiGLU MLP,
forward and backward, and megatron's own forward for the configurations it does not cover."""
import torch
import torch.nn.functional as F

from aligner.models.swiglu import swiglu
from tests.conftest import init_single_process


def test_swiglu_equals_silu_gate_times_up_bitwise():
    x = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    grad = torch.randn(7, 2, 32, generator=torch.Generator().manual_seed(1))
    ours = swiglu(x)
    (ours_grad,) = torch.autograd.grad(ours, x, grad)
    gate, up = torch.chunk(x, 2, dim=-1)
    theirs = F.silu(gate) * (up + 0.0)  # megatron's glu with glu_linear_offset = 0
    (theirs_grad,) = torch.autograd.grad(theirs, x, grad)
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)


def _mlps(**config_overrides):
    from aligner.config.schema import ModelConfig
    from aligner.models.gpt import transformer_config
    from aligner.models.swiglu import SwiGLUMLP
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP
    from omegaconf import OmegaConf

    init_single_process()
    config = transformer_config(OmegaConf.structured(ModelConfig), **config_overrides)
    submodules = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.mlp.submodules
    torch.manual_seed(2)
    theirs = MLP(config, submodules)
    ours = SwiGLUMLP(config, submodules)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _forward_backward(mlp, x, grad):
    mlp.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, bias = mlp(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters()}


def test_swiglu_mlp_equals_megatrons_mlp():
    ours, theirs = _mlps()
    x = torch.randn(9, 2, ours.config.hidden_size, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(9, 2, ours.config.hidden_size, generator=torch.Generator().manual_seed(4))
    a, b = _forward_backward(ours, x, grad), _forward_backward(theirs, x, grad)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][n], b[2][n]) for n in b[2])


def test_other_configurations_take_megatrons_forward():
    ours, theirs = _mlps(glu_linear_offset=1.0)
    x = torch.randn(5, 1, ours.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(ours(x)[0], theirs(x)[0])
        assert not torch.equal(ours(x)[0], ours.linear_fc2(swiglu(ours.linear_fc1(x)[0]))[0])  # the offset counts
