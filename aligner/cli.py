"""`aligner <command> ...`: the single entry point.

    aligner train sft [hydra overrides]           train (config: conf/sft.yaml; also rm, dpo, orpo, simpo,
                                                  kto, steerlm, spin, grpo, reinforce, ppo, rs, kd)
    aligner serve reward|critic|verifier [overrides]  PyTriton server (conf/serve_<kind>.yaml)
    aligner convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N] [--lora PEFT_DIR]
                                                  with --lora: the base at OUT/base, a LoRA checkpoint at OUT/lora
    aligner convert mcore-to-hf --ckpt DIR --out DIR [--dtype bfloat16] [--lora merged|adapter]
                                                  a LoRA checkpoint merged, or as a PEFT adapter directory
    aligner logprobs --model DIR --data FILE.jsonl --out FILE.jsonl [--tp N --pp N]
    aligner generate --model DIR --prompts FILE.jsonl --out FILE.jsonl [sampling.greedy=true ...]
    aligner rs-generate --model DIR --prompts FILE.jsonl --out FILE.jsonl [rs.top_n=1 reward.functions=[...] ...]
                                                  rejection sampling offline: the best samples as SFT records
    aligner teacher-logits --teacher DIR --data FILE.jsonl --top-k 100 --out DIR
                                                  knowledge distillation: the teacher's top-k logits per token
    aligner plan ALGORITHM [overrides] [--json]    whether a layout fits the GPUs and how long a step takes
    aligner export --ckpt DIR --out DIR --quantize fp8|int8_sq|int4_awq [--calib FILE.jsonl]
                                                  a quantised Hugging Face checkpoint (NVIDIA ModelOpt)
    aligner label-attributes --rm DIR --data FILE.jsonl --out FILE.jsonl [--scale 4]   SteerLM labels
    aligner doctor                                 what this host can run (CUDA, optional GPU packages)
    aligner doctor RUN_DIR [RUN_DIR ...]           a run's known failure symptoms, the step they started, what to try
    aligner report RUN_DIR [RUN_DIR ...] [--out FILE.html]   curves, config differences and rollouts in one HTML file

Mistakes end with one `error: <what>, <where>, <how to fix>` line (exit code 2 for usage and config, 1
otherwise); ALIGNER_DEBUG=1 shows the traceback too, which is always written under the run's logs/.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from aligner import errors
from aligner.errors import ArgumentParser, UsageError
from aligner.launch.local import RanksPreempted, launch
from aligner.launch.zygote_relay import run_forked
from aligner.launcher_env import outer_world_size
from aligner.observe.logs import send_warnings_to_log, silence_expected_warnings, use_run_log_dir
from aligner.runtime import preemption

# Each command imports what it runs (torch, megatron, hydra, transformers) inside its function, so that
# `aligner --help` and a mistyped command answer in a fraction of a second: the `# why: deferred` imports.


def algorithm_names() -> str:
    """`aligner train`'s algorithms, from aligner/config/registry.py."""
    from aligner.config.registry import ALGORITHMS  # why: deferred (hydra, ~0.3 s)

    return ", ".join(ALGORITHMS)


def _under_external_launcher() -> bool:
    return outer_world_size() is not None


def train(algorithm: str, overrides: list[str]) -> int:
    from omegaconf import OmegaConf  # why: deferred (hydra, omegaconf)

    from aligner.config import load_config
    from aligner.config.registry import ALGORITHMS

    if algorithm not in ALGORITHMS:
        raise UsageError(f"unknown algorithm '{algorithm}'", "aligner train <algorithm>",
                         f"use one of {algorithm_names()}")
    cfg = load_config(algorithm, overrides)
    _use_log_dir(Path(cfg.run_dir) / "logs")
    _check_paths(cfg)
    if "reward" in cfg:
        _check_rl_inputs(cfg)
    _check_memory(algorithm, cfg)
    run_dir = Path(cfg.run_dir)
    config_path = run_dir / "config.yaml"
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, config_path)
    module = ALGORITHMS[algorithm].entry
    # torchrun / srun started every rank, or a single rank: run here with the config composed above.
    # A run stopped on SIGUSR1 (runtime/preemption.py) exits with EXIT_PREEMPTED: slurm/train.sbatch requeues it.
    try:
        if _under_external_launcher() or cfg.launcher.nproc_per_node == 1:
            importlib.import_module(module).run(cfg)
        else:
            launch(f"{module}:main", [str(config_path)], cfg.launcher.nproc_per_node, run_dir / "logs",
                   cfg.launcher.master_port, cfg.launcher.threads_per_rank)
    except (preemption.Preempted, RanksPreempted) as e:
        print(f"aligner train {algorithm}: {e}", file=sys.stderr)
        return preemption.EXIT_PREEMPTED
    return 0


def _use_log_dir(log_dir: Path) -> None:
    """Tracebacks and dependencies' warnings of this run go to its logs/ (aligner/errors.py, observe/logs.py)."""
    errors.set_log_dir(log_dir)
    use_run_log_dir(log_dir)


def _check_memory(algorithm: str, cfg) -> None:
    """On a GPU host, the planner's memory check (aligner/plan) before any rank starts."""
    import torch  # why: deferred (torch)

    if torch.cuda.is_available():
        from aligner.config.load import expected_world_size  # why: deferred (hydra)
        from aligner.plan.cli import preflight

        preflight(algorithm, cfg, expected_world_size(cfg), int(os.environ.get("SLURM_NNODES", "1")))


def _check_paths(cfg) -> None:
    for key, value in (("tokenizer.path", cfg.tokenizer.path), ("data.train_path", cfg.data.train_path),
                       ("data.val_path", cfg.data.val_path), ("model.pretrained", cfg.model.pretrained)):
        if value and not Path(value).exists():
            raise errors.UserError(f"{value} does not exist", key, f"pass {key}= an existing path")


def _check_rl_inputs(cfg) -> None:
    """Online RL: the reward functions load and every prompt record is valid, before any rank starts
    (a ValueError names the function, or the file:line and what is expected)."""
    from omegaconf import OmegaConf  # why: deferred (omegaconf, torch, transformers, sympy)

    from aligner.data.prompts import load_prompt_dataset
    from aligner.data.tokenizer import load_tokenizer
    from aligner.rewards.functions import resolve_reward_functions

    for key in ("reward.functions", "reward.val_functions"):
        try:
            resolve_reward_functions(list(OmegaConf.select(cfg, key)))
        except ValueError as e:
            raise UsageError(str(e), key, "name a builtin or an importable package.module:function") from None
    if OmegaConf.select(cfg, "env.name") is not None:
        from aligner.envs import resolve_environment  # why: deferred (the reward functions' imports)

        try:
            resolve_environment(cfg.env.name)
        except ValueError as e:
            raise UsageError(str(e), "env.name", "name a builtin (calculator, python) or an importable "
                             "package.module:Class with reset and step") from None
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    for path in (cfg.data.train_path, cfg.data.val_path):
        if path:
            load_prompt_dataset(path, tokenizer, cfg.data.max_length, cfg.data.overlong)


def convert(argv: list[str]) -> int:
    parser = ArgumentParser(prog="aligner convert")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="import a Hugging Face checkpoint")
    to_mcore.add_argument("--hf", required=True)
    to_mcore.add_argument("--out", required=True)
    to_mcore.add_argument("--tp", type=int, default=1)
    to_mcore.add_argument("--pp", type=int, default=1)
    to_mcore.add_argument("--lora", default=None, metavar="PEFT_DIR",
                          help="also import this PEFT LoRA adapter of --hf: the base is written to OUT/base and a "
                               "LoRA checkpoint starting from the adapter to OUT/lora (OUT must be new or empty)")
    to_hf = sub.add_parser("mcore-to-hf", help="export an aligner checkpoint to Hugging Face format")
    to_hf.add_argument("--ckpt", required=True)
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    to_hf.add_argument("--lora", default="merged", choices=["merged", "adapter"],
                       help="a LoRA checkpoint: 'merged' (default) writes its base with the adapters added; "
                            "'adapter' writes a PEFT adapter directory (adapter_config.json, "
                            "adapter_model.safetensors) to load on the export of its base")
    args = parser.parse_args(argv)
    from aligner.models import hf_convert  # why: deferred (torch)

    if args.direction == "hf-to-mcore":
        hf_convert.hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, lora_dir=args.lora)
        if args.lora:
            print(f"wrote {Path(args.out) / 'base'} (the base) and {Path(args.out) / 'lora'} (the LoRA checkpoint)")
            return 0
    else:
        hf_convert.mcore_to_hf(args.ckpt, args.out, dtype=args.dtype, lora_mode=args.lora)
    print(f"wrote {args.out}")
    return 0


def logprobs(argv: list[str]) -> int:
    parser = ArgumentParser(prog="aligner logprobs",
                                     description="per-token log-probs of texts under an aligner checkpoint")
    parser.add_argument("--model", required=True, help="aligner checkpoint directory")
    parser.add_argument("--data", required=True, help='JSONL with {"text": ...} or {"input_ids": [...]} per line')
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", default=None, help="default: <model>/tokenizer")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    from aligner.models.scoring import score_logprobs  # why: deferred (torch, megatron)

    score_logprobs(args.model, args.data, args.out, tokenizer_path=args.tokenizer, tp=args.tp, pp=args.pp,
                   batch_size=args.batch_size)
    return 0


def generate(argv: list[str]) -> int:
    from aligner.generation.cli import generate_main  # why: deferred (torch)

    return generate_main(argv)


def rs_generate(argv: list[str]) -> int:
    from aligner.algorithms.online.rs_generate import rs_generate_main  # why: deferred (torch, megatron)

    return rs_generate_main(argv)


def teacher_logits(argv: list[str]) -> int:
    from aligner.algorithms.distillation.teacher_logits import main as write_teacher_logits  # why: deferred (torch)

    return write_teacher_logits(argv)


def plan(argv: list[str]) -> int:
    from aligner.plan.cli import main as plan_main  # why: deferred (hydra)

    return plan_main(argv)


def export(argv: list[str]) -> int:
    from aligner.models.quantized_export import main as export_main  # why: deferred (torch)

    return export_main(argv)


def label_attributes(argv: list[str]) -> int:
    parser = ArgumentParser(prog="aligner label-attributes",
                                     description="SteerLM labels: score SFT records with a regression reward model")
    parser.add_argument("--rm", required=True, help="regression reward-model checkpoint (rm.loss=regression)")
    parser.add_argument("--data", required=True, help="SFT JSONL (chat messages, or input/output)")
    parser.add_argument("--out", required=True, help="the same records, each with an 'attributes' object")
    parser.add_argument("--scale", type=int, default=4, help="values are rounded and clipped to [0, scale]")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    from aligner.algorithms.preference.steerlm import label_attributes as label  # why: deferred (torch, megatron)

    out = label(args.rm, args.data, args.out, scale=args.scale, batch_size=args.batch_size)
    print(f"wrote {out}")
    return 0


SERVERS = {"reward": "aligner.servers.reward_server", "critic": "aligner.servers.critic_server",
           "verifier": "aligner.servers.verifier_server"}


def serve(argv: list[str]) -> int:
    """`aligner serve <kind> [overrides]`: one process, or the launcher's ranks for a parallel model.
    Runs until SIGTERM/SIGINT; SIGUSR1 (Slurm's time-limit warning for training ranks) is caught and
    ignored."""
    from omegaconf import OmegaConf  # why: deferred (omegaconf)

    if not argv or argv[0] not in SERVERS:
        raise UsageError(f"expected a server kind, got {argv[0] if argv else 'nothing'!r}", "aligner serve <kind>",
                         f"use one of {', '.join(SERVERS)}")
    kind, overrides = argv[0], argv[1:]
    from aligner.servers.config import load_serve_config  # why: deferred (hydra)

    cfg = load_serve_config(kind, overrides)
    _use_log_dir(Path(cfg.run_dir) / "logs")
    from aligner.servers.triton import check_ports_free, ports  # why: deferred (numpy)

    check_ports_free(cfg.server.host, ports(cfg.server))  # fail before loading a model; serving checks again
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    nproc = cfg.launcher.nproc_per_node if "launcher" in cfg else 1
    if _under_external_launcher() or nproc == 1:
        importlib.import_module(SERVERS[kind]).run(cfg)
        return 0
    try:
        launch(f"{SERVERS[kind]}:main", [str(run_dir / "config.yaml")], nproc, run_dir / "logs",
               cfg.launcher.master_port, cfg.launcher.threads_per_rank)
    except KeyboardInterrupt:  # SIGTERM/SIGINT: the launcher has stopped the ranks
        return 0
    return 0


def doctor(argv: list[str]) -> int:
    """`aligner doctor`: what this host can run; `aligner doctor RUN_DIR ...`: a run's failure symptoms."""
    if argv:
        from aligner.observe.doctor import main as diagnose_runs  # why: deferred (yaml)

        return diagnose_runs(argv)
    import torch  # why: deferred (torch)

    from aligner.runtime.optional import report

    print(f"torch {torch.__version__}; CUDA available: {torch.cuda.is_available()}")
    for name, a in report().items():
        print(f"{name:20s} installed={a.installed} importable={a.importable}" + (f"  ({a.reason})" if a.reason else ""))
    return 0


def report(argv: list[str]) -> int:
    from aligner.observe.report import main as write_report  # why: deferred (hydra, tqdm)

    return write_report(argv)


HANDLERS = {"convert": convert, "logprobs": logprobs, "generate": generate, "serve": serve, "doctor": doctor,
            "report": report, "label-attributes": label_attributes, "rs-generate": rs_generate,
            "teacher-logits": teacher_logits, "plan": plan, "export": export}


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        if not rest:
            raise UsageError("expected an algorithm", "aligner train <algorithm> [overrides]",
                             f"use one of {algorithm_names()}")
        return train(rest[0], rest[1:])
    if command not in HANDLERS:
        raise UsageError(f"unknown command '{command}'", "aligner <command>",
                         f"use one of train, {', '.join(HANDLERS)} (aligner --help)")
    return HANDLERS[command](rest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _shield_from_stops(argv)
    silence_expected_warnings()
    send_warnings_to_log()  # the run's logs/ once a command knows its run directory
    try:
        return dispatch(argv)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a user's mistake as one line, a bug with its traceback
        return errors.handle(e)


def _shield_from_stops(argv: list[str]) -> None:
    if argv and argv[0] in ("train", "serve"):  # before the heavy imports (runtime/preemption.py)
        preemption.install()


def console() -> int:
    """The command line's entry point (`aligner`, `python -m aligner.cli`): in a process forked from a live zygote
    where there is one (aligner/launch/zygote_relay.py), else here."""
    argv = sys.argv[1:]
    _shield_from_stops(argv)  # SIGUSR1 blocked in the child from its start, as in the ranks `train` starts
    code = run_forked("aligner.cli", argv)
    return main(argv) if code is None else code


if __name__ == "__main__":
    sys.exit(console())
