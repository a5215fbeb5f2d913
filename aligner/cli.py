"""`aligner <command> ...`: the single entry point.

    aligner train sft [hydra overrides]           train (config: conf/sft.yaml; also rm, dpo, orpo, simpo,
                                                  kto, steerlm, spin, grpo, reinforce)
    aligner serve reward|critic|verifier [overrides]  PyTriton server (conf/serve_<kind>.yaml)
    aligner convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N]
    aligner convert mcore-to-hf --ckpt DIR --out DIR [--dtype bfloat16]
    aligner logprobs --model DIR --data FILE.jsonl --out FILE.jsonl [--tp N --pp N]
    aligner generate --model DIR --prompts FILE.jsonl --out FILE.jsonl [sampling.greedy=true ...]
    aligner label-attributes --rm DIR --data FILE.jsonl --out FILE.jsonl [--scale 4]   SteerLM labels
    aligner doctor                                 what this host can run (CUDA, optional GPU packages)
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# algorithm -> module with `main(argv)` (a launched rank) and `run(cfg)` (in this process)
TRAINERS = {"sft": "aligner.algorithms.sft", "rm": "aligner.algorithms.reward_model",
            "dpo": "aligner.algorithms.dpo", "orpo": "aligner.algorithms.orpo", "simpo": "aligner.algorithms.simpo",
            "kto": "aligner.algorithms.kto", "steerlm": "aligner.algorithms.steerlm",
            "spin": "aligner.algorithms.spin", "grpo": "aligner.algorithms.grpo",
            "reinforce": "aligner.algorithms.grpo", "ppo": "aligner.algorithms.ppo"}


def _under_external_launcher() -> bool:
    return "WORLD_SIZE" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def train(algorithm: str, overrides: list[str]) -> int:
    from omegaconf import OmegaConf

    from aligner.config import ConfigError, load_config
    from aligner.launch.local import RankFailed, RanksPreempted, launch
    from aligner.runtime.preemption import EXIT_PREEMPTED, Preempted

    if algorithm not in TRAINERS:
        print(f"aligner train: unknown algorithm '{algorithm}'; expected one of {sorted(TRAINERS)}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(algorithm, overrides)
        _check_paths(cfg)
        if "reward" in cfg:
            _check_rl_inputs(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"aligner train {algorithm}: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    config_path = run_dir / "config.yaml"
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, config_path)
    module = TRAINERS[algorithm]
    # torchrun / srun started every rank, or a single rank: run here with the config composed above.
    # A run stopped on SIGUSR1 (runtime/preemption.py) exits with EXIT_PREEMPTED: slurm/train.sbatch requeues it.
    try:
        if _under_external_launcher() or cfg.launcher.nproc_per_node == 1:
            import importlib

            importlib.import_module(module).run(cfg)
        else:
            launch(f"{module}:main", [str(config_path)], cfg.launcher.nproc_per_node, run_dir / "logs",
                   cfg.launcher.master_port, cfg.launcher.threads_per_rank)
    except (Preempted, RanksPreempted) as e:
        print(f"aligner train {algorithm}: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except RankFailed as e:
        print(f"aligner train {algorithm}: {e}", file=sys.stderr)
        return 1
    return 0


def _check_paths(cfg) -> None:
    for key, value in (("tokenizer.path", cfg.tokenizer.path), ("data.train_path", cfg.data.train_path),
                       ("data.val_path", cfg.data.val_path), ("model.pretrained", cfg.model.pretrained)):
        if value and not Path(value).exists():
            raise FileNotFoundError(f"{key}={value} does not exist")


def _check_rl_inputs(cfg) -> None:
    """Online RL: the reward functions load and every prompt record is valid, before any rank starts
    (a ValueError names the function, or the file:line and what is expected)."""
    from aligner.data.prompts import load_prompt_dataset
    from aligner.data.tokenizer import load_tokenizer
    from aligner.rewards.functions import resolve_reward_functions

    resolve_reward_functions(list(cfg.reward.functions))
    resolve_reward_functions(list(cfg.reward.val_functions))
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    for path in (cfg.data.train_path, cfg.data.val_path):
        if path:
            load_prompt_dataset(path, tokenizer, cfg.data.max_length, cfg.data.overlong)


def convert(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="aligner convert")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="import a Hugging Face checkpoint")
    to_mcore.add_argument("--hf", required=True)
    to_mcore.add_argument("--out", required=True)
    to_mcore.add_argument("--tp", type=int, default=1)
    to_mcore.add_argument("--pp", type=int, default=1)
    to_hf = sub.add_parser("mcore-to-hf", help="export an aligner checkpoint to Hugging Face format")
    to_hf.add_argument("--ckpt", required=True)
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    from aligner.models import hf_convert

    if args.direction == "hf-to-mcore":
        hf_convert.hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp)
    else:
        hf_convert.mcore_to_hf(args.ckpt, args.out, dtype=args.dtype)
    print(f"wrote {args.out}")
    return 0


def logprobs(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="aligner logprobs",
                                     description="per-token log-probs of texts under an aligner checkpoint")
    parser.add_argument("--model", required=True, help="aligner checkpoint directory")
    parser.add_argument("--data", required=True, help='JSONL with {"text": ...} or {"input_ids": [...]} per line')
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", default=None, help="default: <model>/tokenizer")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    from aligner.models.scoring import score_logprobs

    score_logprobs(args.model, args.data, args.out, tokenizer_path=args.tokenizer, tp=args.tp, pp=args.pp,
                   batch_size=args.batch_size)
    return 0


def generate(argv: list[str]) -> int:
    from aligner.generation.cli import generate_main

    return generate_main(argv)


def label_attributes(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="aligner label-attributes",
                                     description="SteerLM labels: score SFT records with a regression reward model")
    parser.add_argument("--rm", required=True, help="regression reward-model checkpoint (rm.loss=regression)")
    parser.add_argument("--data", required=True, help="SFT JSONL (chat messages, or input/output)")
    parser.add_argument("--out", required=True, help="the same records, each with an 'attributes' object")
    parser.add_argument("--scale", type=int, default=4, help="values are rounded and clipped to [0, scale]")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    from aligner.algorithms.steerlm import label_attributes as label

    try:
        out = label(args.rm, args.data, args.out, scale=args.scale, batch_size=args.batch_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"aligner label-attributes: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


SERVERS = {"reward": "aligner.servers.reward_server", "critic": "aligner.servers.critic_server",
           "verifier": "aligner.servers.verifier_server"}


def serve(argv: list[str]) -> int:
    """`aligner serve <kind> [overrides]`: one process, or the launcher's ranks for a parallel model.
    Runs until SIGTERM/SIGINT; SIGUSR1 (Slurm's time-limit warning for training ranks) is caught and
    ignored."""
    import importlib

    from omegaconf import OmegaConf

    from aligner.config import ConfigError
    from aligner.launch.local import RankFailed, launch

    if not argv or argv[0] not in SERVERS:
        print(f"usage: aligner serve <{'|'.join(SERVERS)}> [overrides]", file=sys.stderr)
        return 2
    kind, overrides = argv[0], argv[1:]
    try:
        from aligner.servers.config import load_serve_config

        cfg = load_serve_config(kind, overrides)
    except ConfigError as e:
        print(f"aligner serve {kind}: {e}", file=sys.stderr)
        return 2
    from aligner.servers.triton import check_ports_free, ports

    try:  # fail before loading a model; serving checks again
        check_ports_free(cfg.server.host, ports(cfg.server))
    except OSError as e:
        print(f"aligner serve {kind}: {e}", file=sys.stderr)
        return 1
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
    except RankFailed as e:
        print(f"aligner serve {kind}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # SIGTERM/SIGINT: the launcher has stopped the ranks
        return 0
    return 0


def doctor(argv: list[str]) -> int:
    import torch

    from aligner.runtime.optional import report

    print(f"torch {torch.__version__}; CUDA available: {torch.cuda.is_available()}")
    for name, a in report().items():
        print(f"{name:20s} installed={a.installed} importable={a.importable}" + (f"  ({a.reason})" if a.reason else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train", "serve"):  # before the heavy imports (runtime/preemption.py)
        from aligner.runtime import preemption

        preemption.install()
    from aligner.observe.logs import silence_expected_warnings

    silence_expected_warnings()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        if not rest:
            print(f"usage: aligner train <{'|'.join(TRAINERS)}> [overrides]", file=sys.stderr)
            return 2
        return train(rest[0], rest[1:])
    handlers = {"convert": convert, "logprobs": logprobs, "generate": generate, "serve": serve, "doctor": doctor,
                "label-attributes": label_attributes}
    if command not in handlers:
        print(f"aligner: unknown command '{command}'\n{__doc__}", file=sys.stderr)
        return 2
    return handlers[command](rest)


if __name__ == "__main__":
    sys.exit(main())
