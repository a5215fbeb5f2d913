"""`aligner plan ALGORITHM [overrides] [--json]`: whether a run fits its GPUs, and how long a step takes.

    aligner plan ppo model=llama3_70b model.tensor_model_parallel_size=8 model.pipeline_model_parallel_size=4 \
        cluster.nodes=8 cluster.service_nodes=4 plan.prompt_length=512 plan.response_length=350 --json

Overrides are the training config's own keys (composed with conf/<algorithm>.yaml and type-checked by
aligner/config, as `aligner train` does), plus the planner's:
    cluster.gpu=h100-80gb|h200|a100-80gb|cpu   cluster.memory_gib=G (cpu only: memory per rank)
    cluster.gpus_per_node=8 (cpu: launcher.nproc_per_node)   cluster.nodes=1 (the trainer's)   cluster.service_nodes=0 (PPO's critic/reward)
    plan.prompt_length, plan.response_length   mean tokens per prompt / generated per sample (RL step time;
                                               default: data.max_length and sampling.max_new_tokens)
Activation recomputation is the run's own model.recompute (none | selective | full).
LoRA is the run's own model.lora.rank (PPO's critic: critic.lora.rank): the frozen base, the adapters and no
reference copy (aligner/plan/memory.py's LoRA note); the table names the rank and the adapter parameters.
Online RL's generation.placement=separate adds generation.workers x generation.tensor_model_parallel_size GPUs
of rollout workers (counted in the header's GPUs) and the weight broadcast to the step, overlapped with
training at algorithm.async.max_lag >= 1; model.context_parallel_size > 1 is planned for RL as for SFT.
The model's vocabulary is model.vocab_size, else the tokenizer's at tokenizer.path.
Exit status: 0 the run fits, 1 it does not (each reason in `errors`, with its fix), 2 a usage error.
"""
from __future__ import annotations

import json

from omegaconf import OmegaConf

from aligner.config.load import compose_config
from aligner.config.registry import ALGORITHMS
from aligner.errors import UsageError
from aligner.plan.estimate import Lengths, gpu_count, plan_run
from aligner.plan.hardware import detect
from aligner.plan.layout import Cluster, accelerator, layout_errors

PLANNER_KEYS = {"cluster.gpu": str, "cluster.memory_gib": float, "cluster.gpus_per_node": int, "cluster.nodes": int,
                "cluster.service_nodes": int, "plan.prompt_length": int, "plan.response_length": int}
DEFAULTS = {"cluster.gpu": "h100-80gb", "cluster.memory_gib": None, "cluster.gpus_per_node": 8, "cluster.nodes": 1,
            "cluster.service_nodes": 0, "plan.prompt_length": None, "plan.response_length": None}
PLANNABLE = tuple(name for name, algorithm in ALGORITHMS.items() if algorithm.plannable)
PLACEHOLDERS = {"tokenizer.path": "unused-by-plan", "data.train_path": "unused-by-plan"}


def split_overrides(overrides: list[str]) -> tuple[dict, list[str]]:
    """(the planner's options, the training config's overrides). UsageError for an unknown or bad planner key."""
    options, rest = dict(DEFAULTS), []
    for item in overrides:
        key, sep, value = item.lstrip("+").partition("=")
        if not key.startswith(("cluster.", "plan.")):
            rest.append(item)
            continue
        if key not in PLANNER_KEYS or not sep:
            raise UsageError(f"unknown planner option {item!r}", "aligner plan",
                             f"use key=value with one of {', '.join(PLANNER_KEYS)}")
        try:
            options[key] = PLANNER_KEYS[key](value)
        except ValueError:
            raise UsageError(f"{key}={value} is not a {PLANNER_KEYS[key].__name__}", "aligner plan",
                             f"pass {key}=<{PLANNER_KEYS[key].__name__}>") from None
        if PLANNER_KEYS[key] is int and options[key] < (0 if key == "cluster.service_nodes" else 1):
            raise UsageError(f"{key}={value} must be >= {0 if key == 'cluster.service_nodes' else 1}", "aligner plan")
    return options, rest


def compose(algorithm: str, overrides: list[str]):
    """The training config as `aligner train` composes it (types and keys checked), with placeholders for the
    inputs a plan does not read."""
    given = {o.lstrip("+").partition("=")[0] for o in overrides}
    fill = [f"{k}={v}" for k, v in PLACEHOLDERS.items() if k not in given]
    return compose_config(algorithm, fill + list(overrides))


def vocab_size(cfg) -> int:
    if cfg.model.vocab_size:
        return int(cfg.model.vocab_size)
    if cfg.tokenizer.path != PLACEHOLDERS["tokenizer.path"]:
        from aligner.data.tokenizer import load_tokenizer, model_vocab_size  # why: deferred (torch, transformers)

        return model_vocab_size(cfg.model, load_tokenizer(cfg.tokenizer.path), cfg.tokenizer.path)
    raise UsageError("the model's vocabulary size is unknown", "model.vocab_size",
                     "pass model.vocab_size=N (the tokenizer's size) or tokenizer.path=DIR")


def plan(algorithm: str, overrides: list[str]) -> dict:
    """The JSON object of the contract: fits, step_time_s, components, errors (+ timing, cluster)."""
    if algorithm not in PLANNABLE:
        raise UsageError(f"unknown algorithm '{algorithm}'", "aligner plan <algorithm>",
                         f"use one of {', '.join(PLANNABLE)}")
    options, rest = split_overrides(overrides)
    try:
        hw = accelerator(options["cluster.gpu"], options["cluster.memory_gib"])
    except ValueError as e:
        raise UsageError(str(e), "aligner plan") from None
    cfg = compose(algorithm, rest)
    if hw.name == "cpu" and not any(o.lstrip("+").startswith("cluster.gpus_per_node=") for o in overrides):
        options["cluster.gpus_per_node"] = cfg.launcher.nproc_per_node  # the ranks `aligner train` starts here
    cluster = Cluster(hw, options["cluster.gpus_per_node"], options["cluster.nodes"], options["cluster.service_nodes"])
    errors = layout_errors(cfg, cluster)
    head = {"algorithm": algorithm, "cluster": {"gpu": hw.name, "gpus_per_node": cluster.gpus_per_node,
                                                "nodes": cluster.nodes, "service_nodes": cluster.service_nodes}}
    if errors:
        return {**head, "fits": False, "step_time_s": 0.0, "components": {}, "errors": errors}
    rl = "algorithm" in cfg
    lengths = Lengths(options["plan.prompt_length"] or (cfg.data.max_length if rl else 0),
                      options["plan.response_length"] or (cfg.sampling.max_new_tokens if rl else 0))
    result = plan_run(cfg, algorithm, cluster, lengths, vocab_size(cfg), str(cfg.model.get("recompute") or "none"))
    errors = memory_errors(cfg, result, hw.name)
    head["cluster"]["gpus"] = gpu_count(result)
    if "workers" in result["components"].get("generation", {}):
        g = cfg.generation
        head["cluster"].update(workers=g.workers, worker_tp=g.tensor_model_parallel_size,
                               max_lag=cfg.algorithm["async"].max_lag)
    return {**head, "fits": not errors, "step_time_s": round(result["timing"]["step_s"], 6),
            "components": result["components"], "errors": errors, "usable_gib_per_gpu": round(result["usable_gib"], 3),
            "timing": {k: round(v, 6) for k, v in result["timing"].items()}}


def preflight(algorithm: str, cfg, world_size: int, nodes: int) -> None:
    """`aligner train`'s check on a GPU host, before any rank starts: the trainer's GPUs of this run (its
    world over `nodes` nodes, this host's device) hold the actor, reference and generation engine.
    Raises a UsageError with the planner's sentences; layout rules are load_config's."""
    import torch  # why: deferred (torch): only `aligner train` on a GPU host calls this

    from aligner.models.gpt import use_transformer_engine  # why: deferred (megatron), as torch above

    transformer_engine = use_transformer_engine(cfg.model.transformer_impl)  # what auto builds on this host
    errors = spec_errors(cfg, transformer_engine)
    if errors:
        raise UsageError(errors[0], "model.transformer_impl", "or model.transformer_impl=local")
    if algorithm not in PLANNABLE:
        return
    if not transformer_engine and cfg.model.transformer_impl != "local":  # the planner counts what runs here
        cfg = OmegaConf.merge(cfg, {"model": {"transformer_impl": "local"}})
    props = torch.cuda.get_device_properties(0)
    cluster = Cluster(detect(props.name, props.total_memory / 1024 ** 3), max(world_size // nodes, 1), nodes,
                      1 if "critic" in cfg else 0)
    rl = "algorithm" in cfg
    lengths = Lengths(cfg.data.max_length if rl else 0, cfg.sampling.max_new_tokens if rl else 0)
    result = plan_run(cfg, algorithm, cluster, lengths, vocab_size(cfg), str(cfg.model.get("recompute") or "none"))
    errors = [e for e in memory_errors(cfg, result, cluster.hw.name) if e.startswith("the trainer's")]
    if errors:
        raise UsageError(errors[0], f"aligner plan {algorithm}", "see `aligner plan --help`")


def spec_errors(cfg, transformer_engine: bool) -> list[str]:
    """What a GPU host's layer spec (`transformer_engine`: model.transformer_impl resolved there) cannot run,
    which the config alone (auto) could not tell."""
    if not transformer_engine:
        return []
    errors = []
    if cfg.data.get("packing"):
        errors.append("data.packing=true needs the local layer spec, and this host builds Transformer Engine's "
                      "(its attention ignores the block-causal mask): set data.packing=null (padded batches here)")
    if cfg.model.context_parallel_size > 1 and str(cfg.model.params_dtype) == "float32":
        errors.append(f"model.context_parallel_size={cfg.model.context_parallel_size} on Transformer Engine's spec "
                      "needs bfloat16 or float16 weights (its only attention for float32 takes no context-parallel "
                      "group): set model.params_dtype=bfloat16")
    return errors


def memory_errors(cfg, result: dict, gpu: str) -> list[str]:
    """One sentence per group of GPUs over its memory: what is needed, what there is, what to change."""
    c, usable, errors = result["components"], result["usable_gib"], []
    trainer = [n for n in ("actor", "reference", "generation", "validation") if n in c and "workers" not in c[n]]
    need = sum(c[n]["memory_gib_per_gpu"] for n in trainer)
    if need > usable:
        parts = ", ".join(f"{n} {c[n]['memory_gib_per_gpu']:.1f}" for n in trainer)
        fixes = []
        if not cfg.optim.distributed_optimizer and not c["actor"]["layout"].endswith(" DP1"):
            fixes.append("optim.distributed_optimizer=true (shards the optimizer states over data-parallel ranks)")
        fixes.append("a larger model.tensor_model_parallel_size or model.pipeline_model_parallel_size")
        if c["actor"].get("activations_gib", 0) > 0.1 * need:
            smaller = [k for k, worth in (
                ("a smaller trainer.micro_batch_size", cfg.trainer.micro_batch_size > 1),
                ("model.sequence_parallel=true", cfg.model.tensor_model_parallel_size > 1
                 and not cfg.model.sequence_parallel),
                ("model.recompute=full (a third more compute)", cfg.model.recompute != "full"),
                ("a shorter model.seq_length", True)) if worth]
            fixes.append(" or ".join(smaller))
        if c.get("reference", {}).get("params_gib", 0) > 0:
            fixes.append("reference.mode=cpu_swap (its weights wait in host memory)")
        if sum(c[n].get("kv_cache_gib", 0) for n in trainer) > 0.1 * need:
            fixes.append("a smaller generation.batch_size (KV cache)")
        errors.append(f"the trainer's GPUs need {need:.1f} GiB each ({parts}) but a {gpu} has {usable:.1f} GiB "
                      f"usable; try " + "; or ".join(fixes) + ", or more cluster.nodes")
    workers = c.get("generation", {})
    if "workers" in workers and workers["memory_gib_per_gpu"] > usable:
        errors.append(f"the rollout workers' GPUs need {workers['memory_gib_per_gpu']:.1f} GiB each (weights "
                      f"{workers['params_gib']:.1f}, KV cache {workers['kv_cache_gib']:.1f}) but a {gpu} has "
                      f"{usable:.1f} GiB usable; try a larger generation.tensor_model_parallel_size or a smaller "
                      f"generation.batch_size")
    if "critic" in c and c["critic"]["memory_gib_per_gpu"] > usable:
        errors.append(f"the critic service's GPUs need {c['critic']['memory_gib_per_gpu']:.1f} GiB each but a {gpu} "
                      f"has {usable:.1f} GiB usable; try a larger critic.parallel.tensor_model_parallel_size or "
                      f"pipeline_model_parallel_size, critic.optim.distributed_optimizer=true, a smaller "
                      f"critic.trainer.micro_batch_size, or more cluster.service_nodes")
    return errors


def table(result: dict) -> str:
    """The readable form: per component its memory per GPU, then the step's phases."""
    lines = [f"aligner plan {result['algorithm']}: {result['cluster']['nodes']} node(s)"
             + (f" + {result['cluster']['service_nodes']} service node(s)" if result['cluster']['service_nodes'] else "")
             + f" x {result['cluster']['gpus_per_node']} {result['cluster']['gpu']}"
             + (f", + {result['cluster']['workers']} rollout worker(s) x TP{result['cluster']['worker_tp']} at lag "
                f"{result['cluster']['max_lag']}: {result['cluster']['gpus']} GPUs in all"
                if "workers" in result["cluster"] else "")]
    columns = ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "kv_cache_gib", "host_gib")
    if result["components"]:
        lines.append(f"{'component':<11}{'GPUs':>6}  {'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'KV':>8}"
                     f"{'host':>8}{'total':>9}  layout (GiB per GPU)")
        for name, comp in result["components"].items():
            cells = "".join(f"{comp[k]:>8.2f}" if k in comp else f"{'-':>8}" for k in columns)
            lines.append(f"{name:<11}{comp['gpus']:>6}  {cells}{comp['memory_gib_per_gpu']:>9.2f}  {comp['layout']}")
        lines += [lora_line(name, comp, result["components"]) for name, comp in result["components"].items()
                  if "lora" in comp]
        lines.append(f"usable memory per GPU: {result['usable_gib_per_gpu']:.2f} GiB")
        lines.append("step time: " + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in result["timing"].items()))
    lines.append("fits" if result["fits"] else "does not fit:\n  " + "\n  ".join(result["errors"]))
    return "\n".join(lines)


def lora_line(name: str, comp: dict, components: dict) -> str:
    """A LoRA component in words: its rank, what trains, and (the actor) that its reference costs nothing."""
    lora = comp["lora"]
    share = lora["adapter_parameters"] / lora["base_parameters"]
    line = (f"{name} is LoRA rank {lora['rank']} on {', '.join(lora['target_modules'])}: "
            f"{lora['adapter_parameters'] / 1e6:,.1f}M adapter parameters ({100 * share:.2f}% of the base's "
            f"{lora['base_parameters'] / 1e9:,.2f}B, frozen: no gradients or optimizer states)")
    if name == "actor" and "reference" in components:
        line += "; the reference is the base with the adapters off: no weights of its own"
    if lora.get("reward_is_base"):
        line += "; the reward model is its base with the adapters off: nothing swapped or held"
    return line


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    as_json = "--json" in argv
    args = [a for a in argv if a != "--json"]
    if any(a.startswith("--") for a in args):
        raise UsageError(f"unknown flag {next(a for a in args if a.startswith('--'))}", "aligner plan",
                         "the only flag is --json; the rest are key=value overrides")
    result = plan(args[0], args[1:])
    print(json.dumps(result) if as_json else table(result))
    return 0 if result["fits"] else 1
