"""`aligner export --quantize` (aligner/models/quantized_export.py) on CPU with a tiny SFT model.

Each format calibrates with ModelOpt (fake quantisation, plain torch), exports the unified Hugging Face
checkpoint, and is checked three ways: the quantisation config ModelOpt wrote names the algorithm; the
directory loads back (config, tokenizer, safetensors with the quantised dtypes); and the logits stay near
the original model's, both for the fake-quantised model (weights and activations quantised, as measured
by the export itself) and for a plain transformers model loaded with the *exported* weights dequantised
by hand (weight error only). What runs the exported checkpoint with int8/int4/fp8 kernels (TensorRT-LLM,
vLLM) needs a GPU and is not exercised here.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aligner.errors import UsageError
from aligner.models.quantized_export import FORMATS, quantize_checkpoint
from tests.conftest import run_cli, write_jsonl_lines

# Relative logit error bounds per format: max|dq - d| / max|d| and mean|dq - d| / mean|d| (about 3x what
# was measured here: fp8 0.03-0.09 / 0.004-0.006, int8_sq 0.02 / 0.002, int4_awq 0.12 / 0.014).
BOUNDS = {"fp8": (0.25, 0.03), "int8_sq": (0.1, 0.01), "int4_awq": (0.35, 0.05)}
QUANTISED_DTYPE = {"fp8": "F8_E4M3", "int8_sq": "I8", "int4_awq": "U8"}


@pytest.fixture(scope="module")
def world(tiny_assets, tmp_path_factory):
    """A 30-step SFT checkpoint of the tiny model, a prompt file and the HF export of the unquantised model."""
    from aligner.data.synthetic import write_arithmetic_prompts
    from aligner.models.hf_convert import mcore_to_hf

    root = tmp_path_factory.mktemp("quant")
    result = run_cli("train", "sft", f"run_dir={root / 'sft'}", f"data.train_path={tiny_assets / 'train.jsonl'}",
                     f"tokenizer.path={tiny_assets / 'tokenizer'}", "trainer.max_steps=30", "optim.lr=3e-3",
                     "optim.warmup_steps=5", "logging.progress=false", "logging.tensorboard=false")
    assert result.returncode == 0, result.stderr[-3000:]
    write_arithmetic_prompts(root / "prompts.jsonl", 32, seed=5)
    ckpt = root / "sft" / "checkpoints" / "step_000030"
    return {"root": root, "ckpt": ckpt, "hf": mcore_to_hf(ckpt, root / "hf", dtype="float32"),
            "prompts": root / "prompts.jsonl", "sft": tiny_assets / "val.jsonl"}


def _dequantised_state(out: Path, quantize: str) -> dict[str, torch.Tensor]:
    """The exported tensors as a plain float32 state dict: quantised weights times their scales (int4:
    two signed nibbles per byte along the output dim, one scale per 128 inputs), with any SmoothQuant/AWQ
    pre_quant_scale folded into the weight's input columns; activation scales dropped."""
    from safetensors.torch import load_file

    raw = load_file(str(out / "model.safetensors"))
    state = {}
    for name, t in raw.items():
        if name.endswith((".weight_scale", ".input_scale", ".pre_quant_scale")):
            continue
        prefix = name[: -len(".weight")]
        scale = raw.get(prefix + ".weight_scale")
        if scale is None:
            state[name] = t.float()
            continue
        if quantize == "int4_awq":
            low, high = (t & 0x0F).to(torch.int16), (t >> 4).to(torch.int16)
            ints = torch.stack([low, high], dim=1).reshape(-1, t.shape[1])  # rows 2k, 2k+1 from byte row k
            ints = torch.where(ints > 7, ints - 16, ints).float()
            w = ints * scale.float().repeat_interleave(ints.shape[1] // scale.shape[1], dim=1)
        elif quantize == "int8_sq":
            w = t.float() * scale.float()[:, None]
        else:
            w = t.float() * scale.float()
        pre = raw.get(prefix + ".pre_quant_scale")
        state[name] = w * pre.float()[None, :] if pre is not None else w
    return state


def _rel_errors(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    diff = (other - reference).abs()
    return (diff.max() / reference.abs().max()).item(), (diff.mean() / reference.abs().mean()).item()


@pytest.mark.parametrize("quantize, calib", [("fp8", "prompts"), ("int8_sq", "sft"), ("int4_awq", None)])
def test_quantised_export(world, quantize, calib, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / quantize
    size = 24 if calib else 4  # the AWQ search costs seconds per calibration sequence on CPU
    result = quantize_checkpoint(world["ckpt"], out, quantize, world[calib] if calib else None, calib_size=size,
                                 max_length=64, dtype="bfloat16")
    algo = FORMATS[quantize][1]
    max_bound, mean_bound = BOUNDS[quantize]
    err = result.error
    print(f"\n{quantize}: fake-quantised model vs original: {err}")
    assert 1e-4 < err.mean_rel <= mean_bound and err.max_rel <= max_bound, err  # quantised, and close
    assert err.top1_agreement >= 0.95, err
    assert result.sequences == size

    # the quantisation config ModelOpt writes, in both places serving engines read it
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == algo
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == algo
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert "lm_head" in config["quantization_config"]["ignore"]

    # it loads back: config, tokenizer, tensors in the quantised dtypes (lm_head left in bf16)
    assert AutoConfig.from_pretrained(str(out)).architectures == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tokenizer("What is 2+3?")["input_ids"] == \
        AutoTokenizer.from_pretrained(str(world["hf"]), local_files_only=True)("What is 2+3?")["input_ids"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        q_proj = f.get_slice("model.layers.0.self_attn.q_proj.weight")
        assert q_proj.get_dtype() == QUANTISED_DTYPE[quantize]
        assert q_proj.get_shape() == ([64, 128] if quantize == "int4_awq" else [128, 128])
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"

    # the exported weights, dequantised into a plain transformers model, against the original model
    original = AutoModelForCausalLM.from_pretrained(str(world["hf"]), dtype=torch.float32).eval()
    dequantised = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out)), dtype=torch.float32).eval()
    dequantised.load_state_dict(_dequantised_state(out, quantize), strict=True)
    ids = torch.tensor([tokenizer("What is 12+34? 46. What is 7+8? 15")["input_ids"]])
    with torch.no_grad():
        reference, logits = original(ids).logits, dequantised(ids).logits
    max_rel, mean_rel = _rel_errors(reference, logits)
    print(f"{quantize}: exported weights dequantised vs original: max rel {max_rel:.4f}, mean rel {mean_rel:.4f}")
    assert 1e-4 < mean_rel <= mean_bound and max_rel <= max_bound, (max_rel, mean_rel)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_calibration_file_errors_name_the_line(world, tmp_path):
    from aligner.data.jsonl import DataError

    bad = write_jsonl_lines(tmp_path / "calib.jsonl", [{"prompt": "What is 1+1?"}, {"question": "2+2"}])
    with pytest.raises(DataError, match=r"calib\.jsonl:2: expected a prompt record"):
        quantize_checkpoint(world["ckpt"], tmp_path / "out", "fp8", bad)
    broken = write_jsonl_lines(tmp_path / "broken.jsonl", [{"prompt": "ok"}, "{not json"])
    with pytest.raises(DataError, match=r"broken\.jsonl:2"):
        quantize_checkpoint(world["ckpt"], tmp_path / "out", "fp8", broken)
    with pytest.raises(DataError, match="missing.jsonl"):
        quantize_checkpoint(world["ckpt"], tmp_path / "out", "fp8", tmp_path / "missing.jsonl")
    assert not (tmp_path / "out").exists()


def test_cli_errors(world, tmp_path):
    unknown = run_cli("export", "--ckpt", str(world["ckpt"]), "--out", str(tmp_path / "o"), "--quantize", "nf4")
    assert unknown.returncode == 2 and "unknown quantisation format 'nf4'" in unknown.stderr
    assert "fp8, int8_sq, int4_awq" in unknown.stderr
    missing = run_cli("export", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--quantize", "fp8")
    assert missing.returncode == 1 and "is not a complete aligner checkpoint" in missing.stderr
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(UsageError, match="already exists and is not empty"):
        quantize_checkpoint(world["ckpt"], tmp_path / "taken", "fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 tensor cores")
def test_fp8_export_runs_a_real_fp8_gemm(world, tmp_path):
    """Each exported FP8 linear layer through torch._scaled_mm (tensor cores) on the activations the
    unquantised model feeds it equals the layer's fake quantisation from the same tensors (measured on an
    H200 with this check's logic: 5e-4 max relative, 3.6e-2 against the unquantised layer)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = quantize_checkpoint(world["ckpt"], tmp_path / "fp8", "fp8", world["prompts"], calib_size=24).out
    raw = load_file(str(out / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(world["hf"]), dtype=torch.float32).eval()
    inputs = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name + ".weight_scale" in raw:
            module.register_forward_hook(lambda m, a, o, n=name: inputs.__setitem__(n, a[0].flatten(0, -2)))
    with torch.no_grad():
        model(torch.tensor([list(range(3, 67))]))  # 64 tokens: _scaled_mm wants multiples of 16
    assert len(inputs) == 28
    for name, x in inputs.items():
        w, w_scale, x_scale = (raw[name + suffix] for suffix in (".weight", ".weight_scale", ".input_scale"))
        w_scale, x_scale = w_scale.float(), x_scale.float()
        xq = (x / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        fake = (xq.float() * x_scale) @ (w.float() * w_scale).T
        real = torch._scaled_mm(xq.cuda(), w.cuda().t(), scale_a=x_scale.cuda(), scale_b=w_scale.cuda(),
                                out_dtype=torch.float32).cpu()
        assert ((real - fake).abs().max() / fake.abs().max()).item() < 1e-3, name
