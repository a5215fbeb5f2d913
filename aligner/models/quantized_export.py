"""`aligner export --quantize`: post-training quantisation of an aligner checkpoint with NVIDIA ModelOpt,
written as a Hugging Face directory that TensorRT-LLM and vLLM load (ModelOpt's unified HF export).

    aligner checkpoint --mcore_to_hf--> HF directory (a temporary one) --transformers--> *ForCausalLM
      --modelopt.torch.quantization.quantize(model, config, forward_loop over the calibration set)-->
      fake-quantised model --modelopt.torch.export.export_hf_checkpoint--> <out>/ (+ the tokenizer)

Formats (`--quantize`) and what ModelOpt writes into hf_quant_config.json / config.json's
`quantization_config.quant_algo`:
  fp8       FP8_DEFAULT_CFG        FP8        e4m3 weights and activations, per-tensor scales
  int8_sq   INT8_SMOOTHQUANT_CFG   W8A8_SQ_PER_CHANNEL  int8 weights (per channel) and activations,
                                              SmoothQuant pre-scales
  int4_awq  INT4_AWQ_CFG           W4A16_AWQ  int4 weights in blocks of 128 along the input dim (AWQ
                                              scale search), 16-bit activations
lm_head and the embeddings stay unquantised, in `--dtype`.

Calibration (`--calib FILE.jsonl`): prompt records (`{"prompt": str | [messages]}`, as for `aligner train
grpo`) or SFT records (`{"messages": [...]}` or `{"input", "output"}`), tokenized as training does, cut
to `--max-length` tokens; the first `--calib-size` records are used. Without `--calib`, CALIBRATION_TEXTS
below (a small generic English/code/maths set) is used: fine for a smoke test, not for a deployment.

The unquantised and the fake-quantised model are both run on the first EVAL_SEQUENCES calibration
sequences, and the logit error is printed: max |dq - d| / max |d| and mean |dq - d| / mean |d| over
all positions, and the fraction of positions whose argmax token is unchanged.

The model is calibrated on one device: CUDA when there is one (bf16), else the CPU (fp32). On a CPU every
format calibrates and exports (ModelOpt's fake quantisation is plain torch); the int8/int4/fp8 kernels
that run the exported checkpoint exist only in TensorRT-LLM and vLLM on GPUs.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from aligner.data.jsonl import DataError, read_jsonl
from aligner.data.prompts import tokenize_prompt
from aligner.data.sft import adds_bos, encode_text, tokenize_record
from aligner.data.tokenizer import load_tokenizer
from aligner.errors import UsageError
from aligner.files import partial_path
from aligner.models.checkpoint import read_metadata
from aligner.runtime.optional import require

log = logging.getLogger(__name__)

# --quantize -> (ModelOpt config name, the quant_algo ModelOpt records in the export)
FORMATS = {"fp8": ("FP8_DEFAULT_CFG", "FP8"),
           "int8_sq": ("INT8_SMOOTHQUANT_CFG", "W8A8_SQ_PER_CHANNEL"),
           "int4_awq": ("INT4_AWQ_CFG", "W4A16_AWQ")}
INT4_BLOCK = 128  # INT4_AWQ_CFG's weight block along the input dimension
EVAL_SEQUENCES = 8
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# The default calibration set (no --calib): varied, generic text, written for this module.
CALIBRATION_TEXTS = (
    "The committee met on Tuesday to review the budget for the coming year and agreed to postpone the vote.",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
    "    return out + a + b",
    "Question: A train travels 120 km in 1.5 hours. What is its average speed? Answer: 80 km/h.",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen.",
    "User: Can you summarise the plot of the novel in two sentences?\nAssistant: A young sailor is shipwrecked, "
    "survives alone on an island for years, and returns home changed.",
    "SELECT name, COUNT(*) AS n FROM orders JOIN customers USING (customer_id) GROUP BY name ORDER BY n DESC;",
    "The derivative of x^3 + 2x is 3x^2 + 2, and its integral is x^4/4 + x^2 + C.",
    "Please find attached the revised contract; the changes to clauses 4 and 7 are highlighted in yellow.",
    "In 1969 the Apollo 11 mission landed two astronauts on the Moon, where they spent about 21 hours.",
    "Error: connection refused (port 8080). Check that the server is running and that the firewall allows it.",
    "Mix the flour and the butter until crumbly, add the sugar and one egg, then bake for 25 minutes at 180 C.",
    "The court held that the clause was unenforceable because it had not been brought to the buyer's attention.",
    "for i in range(10):\n    if i % 3 == 0:\n        print(i, 'fizz')",
    "Rainfall in the region has declined by roughly a fifth since 1990, while average temperatures rose 0.8 C.",
    "Dear Ms. Patel, thank you for your application. We would like to invite you to an interview next week.",
    "The eigenvalues of a symmetric real matrix are real, and its eigenvectors can be chosen orthonormal.",
)


@dataclass(frozen=True)
class LogitError:
    """The fake-quantised model's logits against the unquantised model's, on the same sequences."""

    max_rel: float  # max |q - r| / max |r|
    mean_rel: float  # mean |q - r| / mean |r|
    top1_agreement: float  # fraction of positions whose argmax is unchanged
    positions: int

    def __str__(self) -> str:
        return (f"max rel {self.max_rel:.4f}, mean rel {self.mean_rel:.4f}, top-1 agreement "
                f"{self.top1_agreement:.3f} over {self.positions} positions")


def logit_error(reference: list[torch.Tensor], quantised: list[torch.Tensor]) -> LogitError:
    r = torch.cat([t.reshape(-1, t.shape[-1]).float() for t in reference])
    q = torch.cat([t.reshape(-1, t.shape[-1]).float() for t in quantised])
    diff = (q - r).abs()
    return LogitError(max_rel=(diff.max() / r.abs().max()).item(), mean_rel=(diff.mean() / r.abs().mean()).item(),
                      top1_agreement=(q.argmax(-1) == r.argmax(-1)).float().mean().item(), positions=r.shape[0])


# ---------------------------------------------------------------------------------------------
# calibration data
# ---------------------------------------------------------------------------------------------
def calibration_ids(path, tokenizer, max_length: int, size: int) -> list[list[int]]:
    """Token ids of the first `size` records of `path` (see the module doc), or of CALIBRATION_TEXTS
    when `path` is None; malformed records raise DataError(`path:line: ...`)."""
    if path is None:
        bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
        return [(bos + encode_text(tokenizer, text))[:max_length] for text in CALIBRATION_TEXTS[:size]]
    sequences = []
    for line_no, obj in read_jsonl(path):
        try:
            if "prompt" in obj:
                ids = tokenize_prompt(obj["prompt"], tokenizer)[0]
            elif "messages" in obj or "input" in obj or "output" in obj:
                ids = tokenize_record(obj, tokenizer)[0]
            else:
                raise DataError(f"expected a prompt record ('prompt') or an SFT record ('messages', or 'input' "
                                f"and 'output'), got keys {sorted(obj)}")
        except DataError as e:
            raise DataError(f"{path}:{line_no}: {e.what}", fix=e.fix) from None
        sequences.append(ids[:max_length])
        if len(sequences) == size:
            break
    if not sequences:
        raise DataError(f"{path}: no calibration record: the file holds none")
    return sequences


# ---------------------------------------------------------------------------------------------
# quantise + export
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportResult:
    out: Path
    quantize: str
    quant_algo: str
    calibration: str  # the --calib path, or "builtin"
    sequences: int
    error: LogitError


def _check_format(quantize: str) -> None:
    if quantize not in FORMATS:
        raise UsageError(f"unknown quantisation format {quantize!r}", "--quantize",
                         f"use one of {', '.join(FORMATS)}")


def _fresh_out(out) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists and is not empty", "--out", "choose a new output directory")
    return out


def _check_shapes(quantize: str, config) -> None:
    """INT4-AWQ packs weights in blocks of INT4_BLOCK along each linear layer's input dimension."""
    if quantize != "int4_awq":
        return
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inputs = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
              "num_attention_heads * head_dim": config.num_attention_heads * head_dim}
    bad = {k: v for k, v in inputs.items() if v % INT4_BLOCK}
    if bad:
        raise UsageError(f"int4_awq needs every linear layer's input size to be a multiple of {INT4_BLOCK}, and "
                         f"this model has {', '.join(f'{k}={v}' for k, v in bad.items())}", "--quantize",
                         "use fp8 or int8_sq for this model")


@torch.no_grad()
def _logits(model, sequences: list[list[int]], device) -> list[torch.Tensor]:
    return [model(torch.tensor([ids], device=device)).logits.float().cpu() for ids in sequences]


def quantize_checkpoint(ckpt, out, quantize: str, calib=None, *, calib_size: int = 64, max_length: int = 512,
                        dtype: str = "bfloat16") -> ExportResult:
    """Quantise the language model in aligner checkpoint `ckpt` with ModelOpt and write the HF export to `out`
    (see the module doc). Returns what was written and the logit error of the fake-quantised model."""
    # megatron (hf_convert): `aligner export` checks its arguments and the checkpoint before it pays for it
    from aligner.models.hf_convert import TOKENIZER_FILES, mcore_to_hf

    _check_format(quantize)
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", "--dtype", f"use one of {', '.join(DTYPES)}")
    if calib_size < 1 or max_length < 2:
        raise UsageError(f"--calib-size must be >= 1 and --max-length >= 2, got {calib_size} and {max_length}",
                         "the command line", "")
    head = read_metadata(ckpt).get("head", "lm")  # NotACheckpoint for a path that holds none
    if head != "lm":
        raise UsageError(f"{ckpt} has a '{head}' head; only language models are quantised for serving", "--ckpt",
                         "pass a policy / SFT checkpoint")
    out = _fresh_out(out)
    require("modelopt")
    # modelopt is optional (checked just above); transformers' model classes are heavy
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(Path(ckpt) / "tokenizer")
    sequences = calibration_ids(calib, tokenizer, max_length, calib_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="aligner-quant-") as tmp:
        hf_dir = mcore_to_hf(ckpt, Path(tmp) / "hf", dtype="float32")
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=work_dtype).to(device).eval()
        _check_shapes(quantize, model.config)
        evaluated = sequences[:EVAL_SEQUENCES]
        reference = _logits(model, evaluated, device)

        def forward_loop(m) -> None:
            for ids in sequences:
                m(torch.tensor([ids], device=device))

        log.info("calibrating %s on %d sequences (%s)", quantize, len(sequences), calib or "builtin texts")
        mtq.quantize(model, getattr(mtq, FORMATS[quantize][0]), forward_loop)
        error = logit_error(reference, _logits(model, evaluated, device))
        partial = partial_path(out)
        shutil.rmtree(partial, ignore_errors=True)
        model.to(DTYPES[dtype])  # the unquantised layers are written in this dtype; scales stay float32
        export_hf_checkpoint(model, dtype=DTYPES[dtype], export_dir=str(partial))
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, partial / name)
    algo = json.loads((partial / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
    if algo != FORMATS[quantize][1]:
        raise RuntimeError(f"ModelOpt exported quant_algo {algo!r} for {quantize}, expected {FORMATS[quantize][1]!r}")
    if out.exists():
        out.rmdir()  # checked empty above
    os.replace(partial, out)
    return ExportResult(out, quantize, algo, str(calib) if calib else "builtin", len(sequences), error)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="aligner export", description="quantise an aligner checkpoint with NVIDIA ModelOpt and write a "
        "Hugging Face checkpoint that TensorRT-LLM and vLLM load")
    parser.add_argument("--ckpt", required=True, help="aligner checkpoint directory (a language model)")
    parser.add_argument("--out", required=True, help="new output directory")
    parser.add_argument("--quantize", required=True, help=f"one of {', '.join(FORMATS)}")
    parser.add_argument("--calib", default=None, help="JSONL of prompt or SFT records (default: built-in texts)")
    parser.add_argument("--calib-size", type=int, default=64, help="calibration records used (default 64)")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per calibration sequence (default 512)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the layers left unquantised "
                        "(lm_head, embeddings, norms): bfloat16 | float16 | float32 (default bfloat16)")
    args = parser.parse_args(argv)
    _check_format(args.quantize)  # before any model is loaded
    result = quantize_checkpoint(args.ckpt, args.out, args.quantize, args.calib, calib_size=args.calib_size,
                                 max_length=args.max_length, dtype=args.dtype)
    print(f"logit error of the fake-quantised model vs the original: {result.error}")
    print(json.dumps({**asdict(result), "out": str(result.out), "error": asdict(result.error)}))
    print(f"wrote {result.out} ({result.quant_algo}; load it with TensorRT-LLM or vLLM on a GPU)")
    return 0
