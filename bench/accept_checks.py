"""The checks of the device acceptance kit (bench/accept.py runs each in a process of its own).

A check fills `ctx.expected` and `ctx.measured` as it goes (so a failure half-way still reports what it
measured) and returns its verdict: `ctx.judge(...)` or `ctx.skip(reason)`. What each check runs is written
once, in the tables below (MODELS, SIZES, the gates, SFT_RUNS, RESUMES) and in `sft_args` / `rl_args`, so a
command or a size is changed in one place. Correctness gates apply on CPU too (the dry run checks them at
tiny sizes); speed and GPU-memory gates only on a GPU.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aligner.launch import zygote  # stdlib only: the kit checks the environment before it imports torch

REPO = Path(__file__).resolve().parent.parent
GIB = 1024 ** 3

# The ~1B Llama of the throughput and MFU checks: Llama-3.2-1B's geometry (hidden 2048, 32 heads in 8 KV groups,
# tied embeddings), random weights. The dry run's stand-in keeps its shape of parts (GQA, tied).
MODELS = {
    "llama_1b": {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_query_groups": 8,
                 "ffn_hidden_size": 8192, "vocab_size": 128256, "tie_embeddings": True, "rotary_base": 500000.0,
                 "norm_epsilon": 1e-5},
    "tiny_gqa": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
                 "ffn_hidden_size": 512, "vocab_size": 512, "tie_embeddings": True, "rotary_base": 10000.0,
                 "norm_epsilon": 1e-6},
}

# Sizes of every check: on the GPU (within the 8 minutes) and in the dry run (CPU, 2 cores, ~3 minutes in all).
SIZES = {
    "device": {"sft_steps": 20, "save_at": 10, "rl_steps": 10, "ppo_steps": 5,
               "gen_model": "llama_1b", "gen_prompt": 128, "gen_new": 128, "gen_batches": [1, 32, 128],
               "gen_repeats": 2,
               "mfu_model": "llama_1b", "mfu_seq": 2048, "mfu_micro_batch": 1, "mfu_global_batch": 8, "mfu_steps": 8,
               "mfu_warmup": 3, "trl_steps": 15, "trl_warmup": 5},
    "dry": {"sft_steps": 6, "save_at": 3, "rl_steps": 2, "ppo_steps": 2,
            "gen_model": "tiny_gqa", "gen_prompt": 16, "gen_new": 8, "gen_batches": [1, 4], "gen_repeats": 1,
            "mfu_model": "tiny_gqa", "mfu_seq": 256, "mfu_micro_batch": 2, "mfu_global_batch": 4, "mfu_steps": 3,
            "mfu_warmup": 1, "trl_steps": 3, "trl_warmup": 1},
}

# Gates (the record's `expected`): relative loss differences per step, the engine mismatch gate (NeMo-RL's, as
# aligner doctor's), and the speed floors a GPU run must reach.
FP32_CROSS_DEVICE = 1e-3
BF16_VS_FP32 = 3e-2
PACKED_VS_PADDED = 1e-3
SAME_DEVICE_RESUME = 1e-5
TOKEN_PROB_ERROR_MAX = 1.1
# fp32 logits of the TE spec against the local spec on the same weights. Not 1e-4: TE runs fp32 GEMMs in TF32
# (cuBLASLt's CUBLAS_COMPUTE_32F_FAST_TF32), and rounding only the tiny model's matrices to TF32 already moves its
# logits by 5.3e-4 (CPU); weights that did not load move them by ~1.4
TE_VS_LOCAL_FP32 = 5e-3
HF_LOGITS_REL = 5e-2  # bf16 megatron vs bf16 transformers on the same weights
GENERATE_RATIO_MIN = 1.0  # aligner's engine over transformers' generate
MFU_MIN = 0.2
PLAN_OVER_PEAK = (0.75, 1.5)  # aligner plan's memory per GPU over the measured peak (reserved)
TRL_RATIO_MIN = 1.0  # TRL's GRPO step time over aligner's

SFT_RUNS = {  # name -> (device: "cpu" or "gpu", overrides); all start from the same converted weights
    "cpu_fp32": ("cpu", []),
    "cuda_fp32": ("gpu", []),
    "cuda_bf16": ("gpu", ["model.params_dtype=bfloat16"]),
    "cuda_fp32_packed": ("gpu", ["data.packing=true"]),
}
RESUMES = {  # name -> (the SFT run whose mid-run checkpoint resumes, device, its gate)
    "cpu_to_cuda": ("cpu_fp32", "gpu", FP32_CROSS_DEVICE),
    "cuda_to_cpu": ("cuda_fp32", "cpu", FP32_CROSS_DEVICE),
    "cuda_to_cuda": ("cuda_fp32", "gpu", SAME_DEVICE_RESUME),
}


class CommandFailed(RuntimeError):
    pass


class Context:
    """What a check works with: its sizes, the shared assets, CLI runs on either device, and its record."""

    def __init__(self, work: Path, name: str, dry: bool):
        self.work, self.name, self.dry = work, name, dry
        self.size = SIZES["dry" if dry else "device"]
        self.dir = work / "checks" / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.expected: dict = {}
        self.measured: dict = {}
        self._runs = itertools.count()  # numbers the logs of its commands (Context.logged)

    # ---- verdicts -------------------------------------------------------------------------------------
    def judge(self, correct: dict[str, bool], on_gpu: dict[str, bool] | None = None) -> dict:
        """pass when every condition holds; `on_gpu` ones (speed, GPU memory) only on a GPU: the dry run
        reports their figures without judging them."""
        failed = [k for k, ok in correct.items() if not ok]
        if on_gpu and not self.dry:
            failed += [k for k, ok in on_gpu.items() if not ok]
        if failed:
            return {"status": "fail", "reason": "not met: " + "; ".join(failed)}
        if on_gpu and self.dry:
            return {"status": "pass", "reason": "dry run: the speed and memory gates apply on a GPU only"}
        return {"status": "pass"}

    @staticmethod
    def skip(reason: str) -> dict:
        return {"status": "skipped", "reason": reason}

    # ---- devices and commands --------------------------------------------------------------------------
    def device(self, which: str) -> str:
        """"gpu" is CUDA on the device and the CPU in the dry run."""
        return "cuda" if which == "gpu" and not self.dry else "cpu"

    def env(self, device: str) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # aligner picks CUDA whenever torch sees a device
        return env

    def cli(self, *args: str, device: str = "cpu", check: bool = True) -> subprocess.CompletedProcess:
        """`python -m aligner.cli ARGS` on `device`, its output appended to this check's log."""
        start = time.perf_counter()
        print(f"[{self.name}] {device}: aligner {' '.join(args)}", flush=True)
        # a session of its own: the zygote forks only into one (the check runs in a session of its own too)
        result = self.logged([sys.executable, "-m", "aligner.cli", *args], self.env(device), args[0], zygote.popen)
        print(result.stdout[-4000:] + result.stderr[-8000:], flush=True)
        print(f"[{self.name}] exit {result.returncode} after {time.perf_counter() - start:.1f} s", flush=True)
        if check and result.returncode:
            raise CommandFailed(f"aligner {' '.join(args[:2])} exited {result.returncode}: "
                                f"{(result.stderr or result.stdout)[-1500:]}")
        return result

    def logged(self, cmd: list[str], env: dict, label: str, popen=subprocess.Popen) -> subprocess.CompletedProcess:
        """`cmd` with its output written as it comes to `run<N>_<label>.out` / `.err` in this check's folder
        (bench/accept.py adds their tails to the log of a check that runs past its time, whose own output
        would otherwise end with the command line); the CompletedProcess holds both texts."""
        path = self.dir / f"run{next(self._runs):02d}_{label}"
        with open(path.with_suffix(".out"), "w") as out, open(path.with_suffix(".err"), "w") as err:
            with popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True) as process:
                returncode = process.wait()
        return subprocess.CompletedProcess(cmd, returncode, *(path.with_suffix(suffix).read_text(errors="replace")
                                                              for suffix in (".out", ".err")))

    # ---- shared assets (built once per work directory, by the first check that needs them) ----------------
    def assets(self) -> Path:
        """The tiny tokenizer, SFT chats, arithmetic prompts, and a tiny random Llama converted by
        `aligner convert hf-to-mcore`: every tiny run starts from the same weights."""
        root = self.work / "assets"
        if (root / "READY").exists():
            return root
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from aligner.data.synthetic import corpus, write_arithmetic_prompts, write_sft_chat
        from aligner.data.tokenizer import build_tiny_tokenizer, load_tokenizer

        build_tiny_tokenizer(corpus(2000, seed=0), root / "tokenizer", vocab_size=512)
        write_sft_chat(root / "sft.jsonl", 400, seed=1)
        write_arithmetic_prompts(root / "prompts.jsonl", 200, seed=3, max_operand=9)
        tokenizer = load_tokenizer(root / "tokenizer")
        torch.manual_seed(0)
        hf = LlamaForCausalLM(LlamaConfig(  # conf/model/tiny.yaml's shape, with GQA
            vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))
        hf.save_pretrained(root / "hf")
        tokenizer.save_pretrained(root / "hf")
        self.cli("convert", "hf-to-mcore", "--hf", str(root / "hf"), "--out", str(root / "converted"))
        (root / "READY").write_text("")
        return root

    def long_records(self, seq: int, count: int) -> Path:
        """`count` input/output records of more than `seq` tokens each (worked sums), so that every packed
        row of a run at seq_length `seq` holds one sequence of exactly `seq` tokens."""
        from aligner.data.tokenizer import load_tokenizer

        path = self.work / "assets" / f"long_{seq}.jsonl"
        if path.exists():
            return path
        tokenizer = load_tokenizer(self.assets() / "tokenizer")
        rng, lines = random.Random(0), seq // 2
        while True:
            records = [{"input": "Add up each line.\n",
                        "output": "".join(f"{a}+{b}={a + b}\n" for a, b in
                                          ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(lines)))}
                       for _ in range(count)]
            if min(len(tokenizer(r["output"])["input_ids"]) for r in records) > seq:
                break
            lines *= 2
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    # ---- SFT runs shared by the sft and checkpoint checks -----------------------------------------------------
    def sft_args(self, run_dir: Path, extra: list[str], save: bool = True) -> list[str]:
        """`aligner train sft` from the converted weights; with `save`, checkpoints at save_at and at the end."""
        a, s = self.assets(), self.size
        saves = [f"trainer.save_interval={s['save_at']}"] if save else ["trainer.save_interval=0",
                                                                         "trainer.save_last=false"]
        return ["train", "sft", f"run_dir={run_dir}", f"data.train_path={a / 'sft.jsonl'}",
                f"tokenizer.path={a / 'tokenizer'}", f"model.pretrained={a / 'converted'}",
                f"trainer.max_steps={s['sft_steps']}", *saves, "trainer.seed=1234", "logging.progress=false",
                "logging.tensorboard=false", *extra]

    def side_by_side(self, fn, items) -> list:
        """[fn(item) for item in items], two at a time: the runs of the sft and checkpoint checks are independent
        processes of one rank each, so on a CPU host the second core would otherwise idle (and a GPU holds two
        tiny runs at once). A run's exception is raised here, after the other run has ended."""
        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(fn, items))

    def sft_run(self, name: str) -> Path:
        """SFT_RUNS[name], run once per work directory (the checkpoint check reuses the sft check's runs)."""
        run_dir = self.work / "runs" / f"sft_{name}"
        if len(losses(run_dir)) == self.size["sft_steps"]:
            return run_dir
        shutil.rmtree(run_dir, ignore_errors=True)
        device, extra = SFT_RUNS[name]
        self.cli(*self.sft_args(run_dir, extra), device=self.device(device))
        return run_dir


# ---- metrics ------------------------------------------------------------------------------------------------
def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    return {m["step"]: m[key] for m in metrics(run_dir) if key in m}


def max_rel_diff(ours: dict[int, float], reference: dict[int, float]) -> float:
    """Largest |ours - reference| / |reference| over the steps both have (inf when they share none)."""
    steps = sorted(set(ours) & set(reference))
    if not steps:
        return math.inf
    return max(abs(ours[s] - reference[s]) / max(abs(reference[s]), 1e-12) for s in steps)


def all_finite(rows: list[dict]) -> bool:
    return all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, (int, float)))


def median_after(rows: list[dict], key: str, warmup: int) -> float:
    values = [r[key] for r in rows if key in r][warmup:]
    return statistics.median(values) if values else math.nan


# ---- the checks -----------------------------------------------------------------------------------------------
def env(ctx: Context) -> dict:
    """GPU, driver, torch, CUDA, NCCL, megatron-core, TE / TensorRT-LLM present or absent, `aligner doctor`."""
    import importlib.metadata as md

    import torch

    from aligner.runtime.optional import report

    m = ctx.measured
    m["python"] = sys.version.split()[0]
    m["torch"] = torch.__version__
    m["cuda_available"] = torch.cuda.is_available()
    m["torch_cuda"] = torch.version.cuda
    # PyTriton's stub (the ppo check) needs a shared libpython (aligner/servers/triton.fix_libpython): known before
    # a device call is spent on it
    m["libpython"] = {key: sysconfig.get_config_var(key) for key in ("Py_ENABLE_SHARED", "LIBDIR", "LDLIBRARY")}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        m.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 2),
                 capability=list(torch.cuda.get_device_capability(0)), multiprocessors=props.multi_processor_count,
                 nccl=".".join(map(str, torch.cuda.nccl.version())))
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            m["driver"] = smi.stdout.strip() or smi.stderr.strip()[-200:]
    versions = {}
    for dist in ("megatron-core", "transformers", "tokenizers", "hydra-core", "omegaconf", "numpy", "math-verify",
                 "trl", "datasets", "accelerate", "nvidia-modelopt", "nvidia-pytriton", "transformer-engine",
                 "tensorrt-llm"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    m["versions"] = versions
    m["optional"] = {name: {"installed": a.installed, "importable": a.importable, "reason": a.reason}
                     for name, a in report().items()}
    doctor = ctx.cli("doctor", device=ctx.device("gpu"), check=False)
    m["doctor_exit"], m["doctor"] = doctor.returncode, doctor.stdout.strip().splitlines()
    ctx.expected.update(cuda_available=not ctx.dry, megatron_core="0.16.x", doctor_exit=0)
    verdict = ctx.judge({"megatron-core importable": (versions["megatron-core"] or "").startswith("0.16"),
                         "aligner doctor exits 0": doctor.returncode == 0,
                         "CUDA available": m["cuda_available"] or ctx.dry})
    if ctx.dry and verdict["status"] == "pass":
        verdict["reason"] = "dry run: a CPU host, so no GPU, driver or NCCL facts"
    return verdict


def pytest_gpu(ctx: Context) -> dict:
    """`pytest -m gpu` over the test files that hold a gpu-marked test; counts and failures from its JUnit XML."""
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("*/test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    xml = ctx.dir / "pytest_gpu.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
    print(" ".join(cmd), flush=True)
    result = ctx.logged(cmd, ctx.env("cuda" if not ctx.dry else "cpu"), "pytest")
    print(result.stdout[-6000:], result.stderr[-4000:], flush=True)
    m = ctx.measured
    m["files"], m["exit"] = files, result.returncode
    if not xml.exists():
        raise CommandFailed(f"pytest wrote no report (exit {result.returncode}): {result.stdout[-1500:]}")
    cases = list(ElementTree.parse(xml).getroot().iter("testcase"))
    outcome = {}
    for case in cases:
        name = f"{case.get('classname')}.{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        outcome[name] = ("failed: " + (bad.get("message") or "")[:300] if bad is not None
                         else "skipped: " + (skipped.get("message") or "")[:200] if skipped is not None else "passed")
    m["tests"] = outcome
    m["passed"] = sum(v == "passed" for v in outcome.values())
    m["skipped"] = sum(v.startswith("skipped") for v in outcome.values())
    m["failed"] = sum(v.startswith("failed") for v in outcome.values())
    ctx.expected.update(failed=0, passed=">= 1" if not ctx.dry else "0 (no CUDA: they skip themselves)")
    if ctx.dry and m["failed"] == 0 and m["passed"] == 0:
        return ctx.skip(f"no CUDA here: the {m['skipped']} gpu-marked tests skip themselves")
    return ctx.judge({"no gpu test failed": m["failed"] == 0 and result.returncode in (0, 5),
                      "a gpu test ran": m["passed"] >= 1})


def sft(ctx: Context) -> dict:
    """CPU fp32 against CUDA fp32 at every step, CUDA bf16 against CUDA fp32, packed against padded."""
    ctx.assets()  # built once, before the runs that start from it
    runs = dict(zip(SFT_RUNS, map(losses, ctx.side_by_side(ctx.sft_run, SFT_RUNS))))
    counts = {name: losses(ctx.work / "runs" / f"sft_{name}", "loss_count") for name in SFT_RUNS}
    m = ctx.measured
    m["steps"] = {name: len(r) for name, r in runs.items()}
    m["loss_first_last"] = {name: [r[min(r)], r[max(r)]] for name, r in runs.items()}
    m["cpu_vs_cuda_fp32_max_rel"] = max_rel_diff(runs["cuda_fp32"], runs["cpu_fp32"])
    m["bf16_vs_fp32_max_rel"] = max_rel_diff(runs["cuda_bf16"], runs["cuda_fp32"])
    m["bf16_finite"] = all_finite(metrics(ctx.work / "runs" / "sft_cuda_bf16"))
    m["packed_vs_padded_max_rel"] = max_rel_diff(runs["cuda_fp32_packed"], runs["cuda_fp32"])
    m["packed_loss_counts_equal"] = counts["cuda_fp32_packed"] == counts["cuda_fp32"]
    ctx.expected.update(steps=ctx.size["sft_steps"], cpu_vs_cuda_fp32_max_rel=f"<= {FP32_CROSS_DEVICE:g}",
                        bf16_vs_fp32_max_rel=f"<= {BF16_VS_FP32:g}", bf16_finite=True,
                        packed_vs_padded_max_rel=f"<= {PACKED_VS_PADDED:g}", packed_loss_counts_equal=True)
    return ctx.judge({
        "every run logged every step": all(n == ctx.size["sft_steps"] for n in m["steps"].values()),
        f"CPU fp32 vs CUDA fp32 within {FP32_CROSS_DEVICE:g}": m["cpu_vs_cuda_fp32_max_rel"] <= FP32_CROSS_DEVICE,
        "bf16 finite": m["bf16_finite"],
        f"bf16 vs fp32 within {BF16_VS_FP32:g}": m["bf16_vs_fp32_max_rel"] <= BF16_VS_FP32,
        f"packed vs padded within {PACKED_VS_PADDED:g}": m["packed_vs_padded_max_rel"] <= PACKED_VS_PADDED,
        "packed and padded train on the same tokens": m["packed_loss_counts_equal"]})


def checkpoint(ctx: Context) -> dict:
    """A mid-run checkpoint of one device resumed on the other (both ways) and on CUDA itself: the resumed
    steps' losses against the uninterrupted run's."""
    s, conditions = ctx.size, {}
    ctx.assets()
    names = sorted({source for source, _, _ in RESUMES.values()})  # the sft check's runs, or run here for --only
    sources = dict(zip(names, ctx.side_by_side(ctx.sft_run, names)))

    def resume(name: str) -> Path:
        source, device, _ = RESUMES[name]
        run_dir = ctx.work / "runs" / f"resume_{name}"
        shutil.rmtree(run_dir, ignore_errors=True)
        step = f"step_{s['save_at']:06d}"
        shutil.copytree(sources[source] / "checkpoints" / step, run_dir / "checkpoints" / step)
        ctx.cli(*ctx.sft_args(run_dir, SFT_RUNS[source][1], save=False), device=ctx.device(device))
        return run_dir

    for (name, (source, _, gate)), run_dir in zip(RESUMES.items(), ctx.side_by_side(resume, RESUMES)):
        resumed, reference = losses(run_dir), losses(sources[source])
        ctx.measured[name] = {"first_step": min(resumed, default=None), "steps": len(resumed),
                              "max_rel": max_rel_diff(resumed, reference)}
        ctx.expected[name] = {"first_step": s["save_at"] + 1, "steps": s["sft_steps"] - s["save_at"],
                              "max_rel": f"<= {gate:g}"}
        conditions[f"{name} resumed at step {s['save_at'] + 1}"] = (
            min(resumed, default=None) == s["save_at"] + 1 and len(resumed) == s["sft_steps"] - s["save_at"])
        conditions[f"{name} within {gate:g}"] = ctx.measured[name]["max_rel"] <= gate
    return ctx.judge(conditions)


# ---- te: Transformer Engine's layer spec, and checkpoints across the two specs -------------------------------
# a layer's Transformer Engine modules, each with its extra state (FP8 metadata)
TE_LAYER_MODULES = ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
                    "mlp.linear_fc1", "mlp.linear_fc2")


def expected_spec_line(cuda: bool, te) -> str:
    """The line `model.transformer_impl=auto` must log on a host with (`cuda`) or without a CUDA device, given
    `probe("transformer_engine")`'s finding `te`."""
    if not cuda:
        return "layer spec: local (no CUDA device)"
    if te.importable:
        return "layer spec: transformer_engine (CUDA + TE importable)"
    if not te.installed:
        return "layer spec: local (transformer_engine not installed)"
    return (f"layer spec: local (transformer_engine is installed but does not import: {te.reason}; fix the TE "
            f"install, or set model.transformer_impl=local to choose the local spec)")


class LogLines(logging.Handler):
    """The messages that `logger` logs from now on, INFO and up."""

    def __init__(self, logger: str):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logging.getLogger(logger).setLevel(logging.INFO)
        logging.getLogger(logger).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def spec_model(cfg, vocab: int, impl: str, seed: int):
    """The converted weights' architecture with `impl`'s layer spec, its weights drawn from `seed`."""
    from omegaconf import OmegaConf

    from aligner.models.gpt import build_gpt
    from aligner.runtime.seeding import seed_everything

    seed_everything(seed)
    return build_gpt(OmegaConf.merge(cfg, {"transformer_impl": impl}), vocab)


def spec_weights(model) -> dict:
    """A copy of `model`'s parameters under their TE-spec names (the local spec's through te_state_dict_name)."""
    from aligner.models.checkpoint import unwrap
    from aligner.models.checkpoint_keys import te_state_dict_name

    return {te_state_dict_name(n): p.detach().clone() for n, p in unwrap(model).named_parameters()}


def spec_logits(model, ids):
    """fp32 logits of `ids` (no padding, causal), on the CPU."""
    import torch

    from aligner.models.checkpoint import unwrap

    inner = unwrap(model).eval()
    device = next(inner.parameters()).device
    positions = torch.arange(ids.shape[1], device=device).expand(ids.shape[0], -1)
    with torch.no_grad():
        return inner(ids.to(device), positions, None)[..., :inner.true_vocab_size].float().cpu()


def with_optimizer(model, cfg):
    """(DDP-wrapped model, megatron's Adam) as the trainers make them, at a constant lr of 1e-3."""
    from omegaconf import OmegaConf

    from aligner.config.schema import OptimConfig
    from aligner.models.training import wrap_for_training

    optim = OmegaConf.structured(OptimConfig(lr=1e-3, warmup_steps=0, decay_steps=1, scheduler="constant"))
    ddp, optimizer, _ = wrap_for_training(model, cfg, optim)
    return ddp, optimizer


def trained_checkpoint(path: Path, model, cfg, vocab: int) -> Path:
    """One optimizer step on `model` (seeded gradients), then a checkpoint of it with its optimizer state."""
    import torch

    from aligner.models.checkpoint import save_checkpoint

    ddp, optimizer = with_optimizer(model, cfg)
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=generator))
    if not optimizer.step()[0]:
        raise RuntimeError("the optimizer step was skipped")
    return save_checkpoint(path, ddp, cfg, vocab, optimizer=optimizer, trainer_state={"step": 1})


def requested_vs_saved(path: Path, model) -> tuple[list[str], list[str]]:
    """megatron's own account of loading `model`'s weights from checkpoint `path`, before any rule of ours: the
    keys the model requests that the checkpoint lacks, and the checkpoint's model keys it does not request."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from aligner.models.checkpoint import unwrap

    _, left_over, absent = dist_checkpointing.load({"model": unwrap(model).sharded_state_dict()},
                                                   str(path / "weights"), strict=StrictHandling.RETURN_ALL)
    return sorted(absent), sorted(k for k in left_over if not k.startswith("optimizer."))


def load_report(path: Path, model, load, weights: dict, logits, ids) -> dict:
    """`load()` (aligner's load of `path` into `model`), then what it gave: the parameters that differ from
    `weights`, the logits' relative difference from `logits`, and megatron's key account of the load."""
    load()
    now = spec_weights(model)
    differ = sorted(k for k in weights.keys() | now.keys()
                    if k not in now or k not in weights or not now[k].equal(weights[k].to(now[k].device)))
    ours = spec_logits(model, ids)
    absent, left_over = requested_vs_saved(path, model)  # after the load: megatron's load writes in place
    return {"weights_differ": differ, "logits_rel": ((ours - logits).norm() / logits.norm()).item(),
            "absent": absent, "left_over": left_over}


def te(ctx: Context) -> dict:
    """Transformer Engine's layer spec: which spec `model.transformer_impl=auto` builds and the line that says
    why; the checkpoint keys and extra state the TE spec has against the local spec's; then four loads:
    `aligner convert`'s output and a local checkpoint into the TE spec, a TE checkpoint into the local spec
    and, with its optimizer (load_training_state), into the TE spec again. Each load: every weight equal
    (through the names' mapping), fp32 logits within TE_VS_LOCAL_FP32 across specs, and in megatron's own
    account nothing absent or left over but the TE extra state the strictness rule lets through
    (aligner/models/checkpoint_keys.py). Without TE on a CUDA host (the dry run's CPU, the lent GPUs' image),
    the local spec stands in for TE's: the spec `auto` picks and why are checked, the four loads are a local
    checkpoint's round trips through the same rule (and exercise this code), and the check reports skipped
    with the probe's reason."""
    import torch

    from aligner.models import checkpoint_keys as ck
    from aligner.models.checkpoint import load_training_state, load_weights, model_config_from_checkpoint
    from aligner.models.gpt import use_transformer_engine
    from aligner.runtime import distributed
    from aligner.runtime.optional import probe

    m, expected, conditions = ctx.measured, ctx.expected, {}
    spec_log = LogLines("aligner.models.gpt")
    found, cuda = probe("transformer_engine"), torch.cuda.is_available()
    with_te = cuda and found.importable
    spec = "transformer_engine" if with_te else "local"  # the spec loaded into and saved from beside the local one
    m["transformer_engine"] = {"installed": found.installed, "importable": found.importable, "reason": found.reason}
    m["auto_uses_te"] = use_transformer_engine("auto")
    m["spec_lines"] = list(spec_log.lines)
    m["spec"] = spec
    expected.update(auto_uses_te=with_te, spec_lines=[expected_spec_line(cuda, found)])
    conditions[f"auto builds the {'TE' if with_te else 'local'} spec"] = m["auto_uses_te"] == with_te
    conditions["auto logs one line that says why"] = m["spec_lines"] == expected["spec_lines"]

    distributed.init_process_group()
    distributed.init_model_parallel(1, 1, 1)
    converted = ctx.assets() / "converted"
    cfg, vocab = model_config_from_checkpoint(converted, params_dtype="float32")
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))

    # the keys and extra state of each spec
    local, other = spec_model(cfg, vocab, "local", seed=1), spec_model(cfg, vocab, spec, seed=2)
    local_keys = {e.key for e in local.sharded_state_dict().values()}
    other_keys = {e.key for e in other.sharded_state_dict().values()}
    extra_state = ck.te_extra_state_names(other)
    needed = ({f"decoder.layers.{i}.{module}.{ck.EXTRA_STATE}" for i in range(cfg.num_layers)
               for module in TE_LAYER_MODULES} | {ck.TE_FINAL_NORM_EXTRA_STATE}) if with_te else set()
    other_only = other_keys - local_keys
    m["keys"] = {"spec_only": sorted(other_only), "local_only": sorted(local_keys - other_keys),
                 "te_extra_state": len(extra_state), "te_extra_state_lacks": sorted(needed - extra_state),
                 "parameters_spec_only": sorted(spec_weights(other).keys() - spec_weights(local).keys()),
                 "parameters_local_only": sorted(spec_weights(local).keys() - spec_weights(other).keys())}
    expected["keys"] = {"spec_only": [ck.TE_FINAL_NORM_EXTRA_STATE] if with_te else [], "local_only": [],
                        "te_extra_state": f">= {len(needed)}", "te_extra_state_lacks": [], "parameters_spec_only": [],
                        "parameters_local_only": []}
    conditions["keys = te_checkpoint_keys(local keys, final_norm=True)" if with_te else "keys = local keys"] = (
        other_keys == (ck.te_checkpoint_keys(local_keys, final_norm=True) if with_te else local_keys))
    conditions["te_extra_state_names: every TE module's extra state"] = not m["keys"]["te_extra_state_lacks"]
    conditions["local parameter names map onto the spec's"] = not (m["keys"]["parameters_spec_only"]
                                                                   or m["keys"]["parameters_local_only"])

    def judge_load(name: str, report: dict, absent: set[str], left_over: set[str], logits_gate: float) -> None:
        m[name] = report
        expected[name] = {"weights_differ": [], "logits_rel": f"<= {logits_gate:g}", "absent": sorted(absent),
                          "left_over": sorted(left_over)}
        conditions[f"{name}: every weight equal"] = report["weights_differ"] == []
        conditions[f"{name}: logits within {logits_gate:g}"] = report["logits_rel"] <= logits_gate
        conditions[f"{name}: absent {sorted(absent)}, left over {sorted(left_over)}"] = (
            report["absent"], report["left_over"]) == (sorted(absent), sorted(left_over))

    # the converted weights into the local spec (the reference), then a local checkpoint one step on
    load_weights(converted, local)
    converted_weights, converted_logits = spec_weights(local), spec_logits(local, ids)
    local_ck = trained_checkpoint(ctx.dir / "local_ck", local, cfg, vocab)
    local_weights, local_logits = spec_weights(local), spec_logits(local, ids)
    # the two local checkpoints into the spec, then the spec's checkpoint into the local spec and, resumed, its own
    judge_load("converted_into_spec", load_report(converted, other, lambda: load_weights(converted, other),
                                                  converted_weights, converted_logits, ids),
               other_only, set(), TE_VS_LOCAL_FP32)
    other = spec_model(cfg, vocab, spec, seed=3)
    judge_load("local_checkpoint_into_spec", load_report(local_ck, other, lambda: load_weights(local_ck, other),
                                                         local_weights, local_logits, ids),
               other_only, set(), TE_VS_LOCAL_FP32)
    spec_ck = trained_checkpoint(ctx.dir / "spec_ck", other, cfg, vocab)
    spec_weights_now, spec_logits_now = spec_weights(other), spec_logits(other, ids)
    local = spec_model(cfg, vocab, "local", seed=4)
    judge_load("spec_checkpoint_into_local", load_report(spec_ck, local, lambda: load_weights(spec_ck, local),
                                                         spec_weights_now, spec_logits_now, ids),
               set(), other_only, TE_VS_LOCAL_FP32)
    resumed, optimizer = with_optimizer(spec_model(cfg, vocab, spec, seed=5), cfg)
    judge_load("spec_checkpoint_resumed", load_report(spec_ck, resumed,
                                                      lambda: load_training_state(spec_ck, resumed, optimizer),
                                                      spec_weights_now, spec_logits_now, ids),
               set(), set(), SAME_DEVICE_RESUME)
    distributed.shutdown()
    verdict = ctx.judge(conditions)
    if with_te or verdict["status"] != "pass":
        return verdict
    why = "; ".join(([] if cuda else ["no CUDA device"]) + ([] if found.importable
                                                             else [f"transformer_engine: {found.reason}"]))
    return ctx.skip(f"the TE part needs Transformer Engine on a CUDA host ({why}): the spec choice passed, and the "
                    f"four loads passed with the local spec standing in for TE's")


def rl_args(ctx: Context, command: str, run_dir: Path, steps: int, extra: list[str]) -> list[str]:
    a = ctx.assets()
    return ["train", command, f"run_dir={run_dir}", f"data.train_path={a / 'prompts.jsonl'}",
            f"tokenizer.path={a / 'tokenizer'}", f"model.pretrained={a / 'converted'}", "model.params_dtype=bfloat16",
            "reward.functions=[arithmetic]", "reward.workers=1", f"trainer.max_steps={steps}", "trainer.val_interval=0",
            "logging.progress=false", "logging.tensorboard=false", *extra]


def _rl_run(ctx: Context, command: str, steps: int, extra: list[str]) -> dict:
    """`aligner train COMMAND` in bf16 on the GPU, then `aligner doctor` on its run directory."""
    run_dir = ctx.work / "runs" / command
    shutil.rmtree(run_dir, ignore_errors=True)
    ctx.cli(*rl_args(ctx, command, run_dir, steps, extra), device=ctx.device("gpu"))
    rows = [r for r in metrics(run_dir) if "timing/step_s" in r]
    errors = [r["mismatch/token_prob_error"] for r in rows if "mismatch/token_prob_error" in r]
    doctor = ctx.cli("doctor", str(run_dir), check=False)
    m = ctx.measured
    m.update(steps=len(rows), finite=all_finite(rows), token_prob_error_max=max(errors, default=None),
             reward_mean=[r.get("reward/mean") for r in rows], kl_mean=[r.get("kl/mean") for r in rows],
             step_s_median=median_after(rows, "timing/step_s", 1), doctor_exit=doctor.returncode,
             doctor=doctor.stdout.strip().splitlines())
    ctx.expected.update(steps=steps, finite=True, token_prob_error_max=f"<= {TOKEN_PROB_ERROR_MAX}", doctor_exit=0)
    return ctx.judge({f"{steps} steps logged": len(rows) == steps, "metrics finite": m["finite"],
                      "mismatch/token_prob_error logged at every step": len(errors) == len(rows) > 0,
                      f"mismatch/token_prob_error <= {TOKEN_PROB_ERROR_MAX}":
                          bool(errors) and max(errors) <= TOKEN_PROB_ERROR_MAX,
                      "aligner doctor exits 0": doctor.returncode == 0})


def grpo(ctx: Context) -> dict:
    """GRPO (conf/grpo.yaml), bf16, the arithmetic reward."""
    return _rl_run(ctx, "grpo", ctx.size["rl_steps"], [])


def reinforce(ctx: Context) -> dict:
    """REINFORCE (conf/reinforce.yaml) with the KL in the reward: the path whose collectives took CPU tensors."""
    return _rl_run(ctx, "reinforce", ctx.size["rl_steps"], ["algorithm.kl.mode=reward"])


def rl_async(ctx: Context) -> dict:
    """GRPO with a separate rollout worker at lag 1 (generation.placement=separate), bf16: the worker's CUDA
    engine, the weights sent from the trainer's GPU every step, the lag schedule. On a one-GPU machine the worker
    shares the GPU and the bridge runs on gloo over CPU copies (NCCL refuses two processes on one GPU); the
    NCCL bridge needs a GPU per process and has not run here."""
    steps = ctx.size["rl_steps"] + 1
    run_dir = ctx.work / "runs" / "rl_async"
    shutil.rmtree(run_dir, ignore_errors=True)
    ctx.cli(*rl_args(ctx, "grpo", run_dir, steps, ["generation.placement=separate", "algorithm.async.max_lag=1",
                                                   "algorithm.importance_sampling.level=token"]),
            device=ctx.device("gpu"))
    rows = [r for r in metrics(run_dir) if "timing/step_s" in r]
    m = ctx.measured
    m.update(steps=len(rows), finite=all_finite(rows), lag=[r.get("async/lag") for r in rows],
             worker_busy=[r.get("async/worker_0_busy_fraction") for r in rows],
             broadcast_s=[r.get("timing/broadcast_s") for r in rows],
             step_s_median=median_after(rows, "timing/step_s", 1))
    lags = [float(min(t, 1)) for t in range(steps)]
    ctx.expected.update(steps=steps, finite=True, lag=lags)
    return ctx.judge({f"{steps} steps logged": len(rows) == steps, "metrics finite": m["finite"],
                      "async/lag = min(t-1, 1) at every step": m["lag"] == lags})


def ppo(ctx: Context) -> dict:
    """PPO with its embedded critic service (PyTriton), bf16, the critic from the same weights."""
    import importlib.util

    if importlib.util.find_spec("pytriton") is None:
        return ctx.skip("PyTriton is not installed here. It does not fit beside the kit's other wheels in one "
                        "call (scripts/device/wheels.sh: call main carries core+peer+fp8): run "
                        "`bash scripts/device/accept.sh --only ppo` in a second call with carry [.whl/core, .whl/ppo]")
    converted = ctx.assets() / "converted"
    return _rl_run(ctx, "ppo", ctx.size["ppo_steps"], [f"critic.checkpoint={converted}",
                                                       "critic.parallel.params_dtype=bfloat16"])


def hf_twin(gpt, cfg, vocab: int):
    """transformers' LlamaForCausalLM holding `gpt`'s weights (aligner's own HF weight stream), bf16, on its device."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from aligner.models.hf_weights import hf_config_from_model
    from aligner.models.weight_stream import iter_hf_weights

    config = LlamaConfig(**hf_config_from_model(cfg, vocab, dtype="bfloat16"))
    with torch.device(next(gpt.parameters()).device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {}
    for bucket in iter_hf_weights(gpt, cfg, vocab):
        state.update(bucket)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if [k for k in missing if k != "lm_head.weight" or not cfg.tie_embeddings] or unexpected:
        raise RuntimeError(f"weight mapping: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def generate(ctx: Context) -> dict:
    """Generated tokens/s of aligner's engine against transformers' generate on the same bf16 weights, and
    batch 1 against the HBM bound (every weight read once per decode step)."""
    import torch
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.generation.types import SamplingParams
    from aligner.models.gpt import build_gpt
    from aligner.plan.hardware import cpu, detect
    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything
    from bench.generate import best_times

    s, m = ctx.size, ctx.measured
    prompt_len, new, eos = s["gen_prompt"], s["gen_new"], 1
    arch = MODELS[s["gen_model"]]
    distributed.init_process_group()
    distributed.init_model_parallel(1, 1, 1)
    seed_everything(1234)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {**arch, "params_dtype": "bfloat16",
                                                               "seq_length": prompt_len + new})
    vocab = arch["vocab_size"]
    gpt = build_gpt(cfg, vocab).eval()
    device = next(gpt.parameters()).device
    hf = hf_twin(gpt, cfg, vocab)
    with torch.no_grad():
        ids = torch.randint(0, vocab, (2, 32), device=device)
        ours = gpt(ids, torch.arange(32, device=device).expand(2, -1), None)[..., :vocab].float()
        theirs = hf(ids).logits.float()
    m["model"] = {**arch, "parameters": sum(p.numel() for p in gpt.parameters()), "device": str(device)}
    m["logits_rel_diff"] = ((ours - theirs).norm() / theirs.norm()).item()
    engine = MegatronEngine(gpt, cfg, vocab, eos_id=eos, pad_id=0, max_batch_size=max(s["gen_batches"]))
    params = SamplingParams(temperature=1.0, max_new_tokens=new, min_new_tokens=new, seed=0)
    m["engine_decode"] = engine.decode

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    rows = []
    for batch in s["gen_batches"]:
        prompts = torch.randint(2, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
        on_device = prompts.to(device)

        def aligner_engine():
            out = engine.generate(prompts.tolist(), params)
            assert int(out.response_lengths.min()) == new
            sync()

        def transformers_generate():
            with torch.inference_mode():
                out = hf.generate(on_device, attention_mask=torch.ones_like(on_device), do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new, use_cache=True,
                                  pad_token_id=0, eos_token_id=eos)
            assert out.shape[1] == prompt_len + new
            sync()

        t_ours, t_hf = best_times([aligner_engine, transformers_generate], s["gen_repeats"])
        rows.append({"batch": batch, "aligner_tokens_per_s": batch * new / t_ours,
                     "transformers_tokens_per_s": batch * new / t_hf, "ratio": t_hf / t_ours})
        print(rows[-1], flush=True)
    m["throughput"] = rows
    hw = (detect(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / GIB)
          if device.type == "cuda" else cpu(1.0))
    heads, groups = arch["num_attention_heads"], arch["num_query_groups"]
    head_dim = arch["hidden_size"] // heads
    weight_bytes = sum(p.numel() * p.element_size() for p in gpt.parameters())
    kv_bytes = 2 * arch["num_layers"] * groups * head_dim * (prompt_len + new / 2) * 2  # K and V, bf16, mean length
    m["hbm_bytes_per_s"] = hw.hbm_bytes_per_s
    m["batch1_hbm_bound_tokens_per_s"] = hw.hbm_bytes_per_s / (weight_bytes + kv_bytes)
    m["batch1_fraction_of_bound"] = rows[0]["aligner_tokens_per_s"] / m["batch1_hbm_bound_tokens_per_s"]
    ctx.expected.update(logits_rel_diff=f"<= {HF_LOGITS_REL:g}", ratio=f">= {GENERATE_RATIO_MIN:g} at every batch",
                        batch1_fraction_of_bound="reported")
    distributed.shutdown()
    return ctx.judge({f"logits within {HF_LOGITS_REL:g} of transformers'": m["logits_rel_diff"] <= HF_LOGITS_REL},
                     on_gpu={f"ratio >= {GENERATE_RATIO_MIN:g} at batch {r['batch']}": r["ratio"] >= GENERATE_RATIO_MIN
                            for r in rows})


def train_flops_per_token(arch: dict, seq: int) -> float:
    """Model FLOPs of one trained token: 3 x its forward's (the backward is twice the forward), the forward
    being 2 FLOPs per weight of every linear layer and of the LM head (embedding lookups are free) plus
    causal attention's QK^T and AV over the (seq + 1) / 2 keys a token of a full row sees on average."""
    h, heads, layers = arch["hidden_size"], arch["num_attention_heads"], arch["num_layers"]
    groups, head_dim = arch.get("num_query_groups") or heads, arch["hidden_size"] // heads
    linear = layers * (h * (heads + 2 * groups) * head_dim + heads * head_dim * h + 3 * h * arch["ffn_hidden_size"])
    linear += h * arch["vocab_size"]
    attention = layers * 4 * heads * head_dim * (seq + 1) / 2
    return 3 * (2 * linear + attention)


def mfu(ctx: Context) -> dict:
    """Packed SFT of the ~1B model in bf16 at its full sequence length: model FLOPs utilisation, and the peak
    memory against `aligner plan`'s estimate for the same configuration."""
    import torch

    from aligner.cli import main as aligner_main
    from aligner.plan.hardware import detect

    s, m = ctx.size, ctx.measured
    arch, seq = MODELS[s["mfu_model"]], s["mfu_seq"]
    config = [*(f"model.{k}={v}" for k, v in arch.items()), f"model.seq_length={seq}", "model.params_dtype=bfloat16",
              "data.packing=true", f"trainer.micro_batch_size={s['mfu_micro_batch']}",
              f"trainer.global_batch_size={s['mfu_global_batch']}", f"trainer.max_steps={s['mfu_steps']}",
              f"tokenizer.path={ctx.assets() / 'tokenizer'}"]
    data = ctx.long_records(seq, s["mfu_global_batch"] * s["mfu_steps"])
    run_dir = ctx.work / "runs" / "mfu"
    shutil.rmtree(run_dir, ignore_errors=True)
    cuda = torch.cuda.is_available()  # the dry run's checks see no CUDA device (bench/accept.py)
    argv = ["train", "sft", f"run_dir={run_dir}", f"data.train_path={data}", *config, "trainer.save_last=false",
            "trainer.val_interval=0", "logging.progress=false", "logging.tensorboard=false"]
    print("aligner " + " ".join(argv), flush=True)
    code = aligner_main(argv)  # in this process, so that its peak memory is this process's
    if code:
        raise CommandFailed(f"aligner train sft exited {code}")
    rows = [r for r in metrics(run_dir) if "timing/step_s" in r]
    tokens_per_s = median_after(rows, "throughput/tokens_per_s", s["mfu_warmup"])
    if cuda:
        props = torch.cuda.get_device_properties(0)
        hw = detect(props.name, props.total_memory / GIB)
        peak = torch.cuda.max_memory_reserved() / GIB
        m["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        plan_cluster = [f"cluster.gpu={hw.name}", "cluster.gpus_per_node=1"]
    else:
        from aligner.plan.hardware import cpu

        hw = cpu(1.0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # this process's RSS, torch included
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        plan_cluster = ["cluster.gpu=cpu", f"cluster.memory_gib={memory:.1f}", "cluster.gpus_per_node=1"]
    flops = train_flops_per_token(arch, seq)
    m.update(steps=len(rows), tokens_per_s=tokens_per_s, flops_per_token=flops, peak_flops=hw.bf16_flops,
             mfu=tokens_per_s * flops / hw.bf16_flops, peak_reserved_gib=peak, step_s_median=median_after(
                 rows, "timing/step_s", s["mfu_warmup"]), finite=all_finite(rows))
    plan = ctx.cli("plan", "sft", *config, *plan_cluster, "--json", check=False)
    estimate = json.loads(plan.stdout) if plan.stdout.strip().startswith("{") else {}
    actor = estimate.get("components", {}).get("actor", {})
    m["plan"] = {"exit": plan.returncode, "fits": estimate.get("fits"), "errors": estimate.get("errors"),
                 "actor": actor, "step_time_s": estimate.get("step_time_s")}
    m["plan_over_peak"] = actor.get("memory_gib_per_gpu", math.nan) / peak
    ctx.expected.update(mfu=f">= {MFU_MIN:g}", plan_over_peak=f"in [{PLAN_OVER_PEAK[0]:g}, {PLAN_OVER_PEAK[1]:g}]",
                        steps=s["mfu_steps"])
    return ctx.judge({f"{s['mfu_steps']} steps logged": len(rows) == s["mfu_steps"], "metrics finite": m["finite"],
                      "aligner plan answered": bool(actor)},
                     on_gpu={f"MFU >= {MFU_MIN:g}": m["mfu"] >= MFU_MIN,
                            "plan within its band of the peak":
                                PLAN_OVER_PEAK[0] <= m["plan_over_peak"] <= PLAN_OVER_PEAK[1]})


def trl(ctx: Context) -> dict:
    """bench/rl_vs_trl.py's GRPO case on this host's accelerator: TRL's GRPOTrainer (the peer baseline's
    bench_grpo.py, through bench/trl_device.py) against `aligner train grpo` on the same artifacts and
    configuration, in this run. bf16 on both sides on a GPU (TRL: autocast), fp32 on CPU."""
    import importlib.util

    baseline = Path(os.environ.get("ALIGNER_TRL_BENCH_DIR", REPO.parent / "shared" / "reference" / "bench-trl"))
    if not (baseline / "bench_grpo.py").exists():
        return ctx.skip(f"the TRL peer baseline's scripts are not at {baseline} (ALIGNER_TRL_BENCH_DIR; "
                        "scripts/device/wheels.sh carries them in .whl/peer/bench-trl)")
    wrapper = ctx.dir / "trl_python"  # rl_vs_trl runs `$ALIGNER_TRL_PYTHON SCRIPT` in the baseline's folder
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO / "bench" / "trl_device.py"}" "$@"\n')
    wrapper.chmod(0o755)
    gpu = not ctx.dry
    os.environ.update(ALIGNER_TRL_PYTHON=str(wrapper), ALIGNER_TRL_BENCH_DIR=str(baseline),
                      TRL_BENCH_BF16="1" if gpu else "0")
    from bench import rl_vs_trl

    s, m, out = ctx.size, ctx.measured, ctx.dir / "bench"
    out.mkdir(exist_ok=True)
    paths = rl_vs_trl.prepare(out, threads=1)
    extra = rl_vs_trl.cases()["aligner_grpo"][2] + (["model.params_dtype=bfloat16"] if gpu else [])
    ours = rl_vs_trl.run_aligner("aligner_grpo", "grpo", extra, paths, out, s["trl_steps"], s["trl_warmup"], 1, 0)
    keep = ("step_s", "min_step_s", "cpu_step_s", "generated_tokens_per_step", "phases", "reward_mean", "wall_s")
    m["configuration"] = {**rl_vs_trl.RUN, "steps": s["trl_steps"], "warmup": s["trl_warmup"],
                          "precision": "bf16" if gpu else "fp32"}
    m["aligner"] = {k: ours[k] for k in keep if k in ours}
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        return ctx.skip("trl or datasets is not installed here (scripts/device/wheels.sh carries them in .whl/peer); "
                        "aligner's side ran")
    theirs = rl_vs_trl.run_trl("trl_grpo", paths, out, s["trl_steps"], s["trl_warmup"], 1, 0)
    m["trl"] = {k: theirs[k] for k in keep if k in theirs}
    m["trl_over_aligner_wall"] = theirs["step_s"] / ours["step_s"]
    m["trl_over_aligner_cpu"] = theirs["cpu_step_s"] / ours["cpu_step_s"]
    ctx.expected.update(trl_over_aligner_wall=f">= {TRL_RATIO_MIN:g}")
    return ctx.judge({"both sides finished": True},
                     on_gpu={f"TRL's step over aligner's >= {TRL_RATIO_MIN:g}":
                            m["trl_over_aligner_wall"] >= TRL_RATIO_MIN})


# name -> (function, time limit in seconds on the device, in the dry run). In the order a lent GPU's few minutes
# need them: the limits add up to more than the run's budget; a check left with under 20 s of it is recorded
# as skipped, and one that the budget's end stops as "budget" (a run too short for it, not a hang or a failure).
# Correctness of training, resume and RL first, then the speed figures, then what is skipped or known to be slow
# to start on the lent machines (no Transformer Engine; pytest's FP8 export may build ModelOpt's CUDA
# extension), then the TRL peer, and PPO, which needs PyTriton's wheels and so a call of its own.
CHECKS = {
    "env": (env, 60, 60),
    "sft": (sft, 150, 150),
    "checkpoint": (checkpoint, 120, 120),
    "grpo": (grpo, 100, 90),
    "reinforce": (reinforce, 100, 90),
    "generate": (generate, 150, 90),
    "mfu": (mfu, 150, 90),
    "rl_async": (rl_async, 100, 90),
    "te": (te, 90, 90),
    "pytest_gpu": (pytest_gpu, 150, 120),
    "trl": (trl, 180, 150),
    "ppo": (ppo, 150, 150),
}
