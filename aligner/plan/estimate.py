"""The plan of one run: memory per GPU of each component and the step time, from a composed training
config and a cluster (aligner/plan/layout.py). Formulas: memory.py and timing.py.

Components and where they live:
* `actor`: the trained policy on the trainer's GPUs (weights, fp32 gradient buffer, Adam, activations);
  with LoRA (model.lora.rank > 0) the frozen base's weights, and its adapters' weights, gradients and Adam
  states (memory.py's LoRA note); its `lora` entry gives the rank and the adapter parameters;
* `reference`: the frozen reference (weights only) on the same GPUs with `reference.mode=model`; its
  weights in host memory with `cpu_swap` (swapped in over PCIe for its pass); absent when precomputed or
  without a KL term; in a LoRA run the actor's base with its adapters off: no memory of its own (its
  forward pass still costs its time);
* `generation` (online RL): the in-process Megatron engine decodes with the actor's own weights (refit
  moves no bytes); its KV cache (of at most `generation.batch_size` of the rank's sequences) and the last
  slot's logits exist only while it generates, when the training step's activations do not: its
  memory_gib_per_gpu is what they need beyond the actor's activations (kv_cache_gib shows the cache); a
  LoRA actor's merged weights (merged_gib) exist then too; each context-parallel rank is one more replica
  of the engine (it generates whole sequences with its TP shard's whole weights);
* with generation.placement=separate: `generation` is the rollout workers' own GPUs (`_workers`; `workers`
  gives their count) and the trainer's engine, which still generates validation's samples and DAPO's
  refills, is `validation`; the step adds the weight broadcast and overlaps generation with training at
  algorithm.async.max_lag >= 1 (`step_seconds`);
* `critic` and `reward` (PPO): the service's GPUs (cluster.service_nodes), the critic trained there (LoRA
  with critic.lora.rank > 0: its adapters and value head train), the reward model's weights in host
  memory, swapped into the critic's parameters to score (PCIe); a LoRA critic whose base is the reward
  model (critic.checkpoint unset or reward.checkpoint) scores with its adapters off: nothing swapped or held.
Memory uses the longest sequences the config allows (data.max_length + sampling.max_new_tokens for RL,
data.max_length otherwise); time uses the mean lengths plan.prompt_length and plan.response_length.
"""
from __future__ import annotations

from dataclasses import dataclass

from aligner.plan import memory as M
from aligner.plan import timing as T
from aligner.plan.layout import Cluster

GIB = 1024 ** 3
PAIRED = ("dpo", "orpo", "simpo", "rm")  # each sample is a (chosen, rejected) pair of sequences


@dataclass(frozen=True)
class Lengths:
    prompt: int  # mean prompt tokens (RL) — time only
    response: int  # mean generated tokens per sample (RL) — time only


def _impl(cfg, cluster: Cluster, algorithm: str) -> str:
    """Which attention keeps what (memory.layer_activation_elements)."""
    if cluster.hw.name != "cpu" and cfg.model.transformer_impl != "local":
        return "te"
    packed = bool(cfg.data.get("packing"))
    return "local" if algorithm == "sft" and not packed else "local_sdpa"


def _model_state(params: int, dtype: str, dp: int, distributed: bool, adapters: int | None = None,
                 head: int = 0) -> dict:
    """A trained model's weights, gradients and Adam states per GPU; with LoRA (`adapters`: this GPU's adapter
    parameters) only the adapters and a scalar `head` train, the base's `params` frozen."""
    trained = params if adapters is None else adapters + head
    out = {"parameters": params, "params_gib": M.weight_bytes(params + (adapters or 0), dtype) / GIB,
           "grads_gib": M.gradient_bytes(trained) / GIB,
           "optimizer_gib": M.optimizer_bytes(trained, dtype, dp, distributed) / GIB}
    if adapters is not None:
        out["adapter_parameters"] = adapters
    return out


def _lora_entry(shape, lora: M.Lora) -> dict:
    """The `lora` entry of a LoRA component: what trains, over the whole model."""
    adapters = M.adapter_parameter_count(shape, lora)
    return {"rank": lora.rank, "target_modules": list(lora.targets), "adapter_parameters": adapters,
            "base_parameters": M.parameter_count(shape)}


def _samples(cfg) -> int:
    """Sequences generated per step (all DP ranks): prompts x generations per prompt."""
    a = cfg.algorithm
    return int(a.get("prompts_per_step") or cfg.generation.batch_size) * int(a.get("num_generations") or 1)


def _component(gpus: int, layout: str, total_gib: float | None = None, **parts) -> dict:
    """memory_gib_per_gpu: the parts' sum (host memory apart), or `total_gib` where they do not coexist."""
    gib = total_gib if total_gib is not None else sum(
        v for k, v in parts.items() if k.endswith("_gib") and k != "host_gib")
    return {"gpus": gpus, "memory_gib_per_gpu": round(gib, 3), "layout": layout,
            **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in parts.items()}}


def _has_reference(cfg) -> bool:
    if "reference" not in cfg or cfg.reference.mode == "precompute":
        return False
    return not ("algorithm" in cfg and cfg.algorithm.kl.mode == "none")


def _separate(cfg) -> bool:
    """Online RL with rollout workers of their own (generation.placement=separate)."""
    return cfg.generation.get("placement", "colocated") == "separate"


def worker_shape(cfg, vocab_size: int) -> M.Shape:
    """The policy as a rollout worker holds it: the trainer's model at generation.tensor_model_parallel_size (its
    vocabulary padded for that TP), no pipeline or context parallelism."""
    return M.Shape.of(_with_tp(cfg.model, cfg.generation.tensor_model_parallel_size), vocab_size)


def _workers(cfg, trainer_shape: M.Shape, seq: int, dtype: str, vocab_size: int) -> dict:
    """The rollout workers' GPUs (generation.workers x generation.tensor_model_parallel_size): each holds the whole
    policy at its TP (no PP), and while it generates the KV cache and last-slot logits of at most
    generation.batch_size of its share of the step's samples; between generate calls it receives the weight
    stream a bucket at a time, which never coexists with the cache: weights + the larger of the two."""
    g = cfg.generation
    wtp, shape = g.tensor_model_parallel_size, worker_shape(cfg, vocab_size)
    batch = max(min(g.batch_size, -(-_samples(cfg) // g.workers)), 1)
    kv = M.kv_cache_bytes(shape, seq, batch, wtp, 1, dtype)
    logits = batch * shape.vocab * 4
    bucket = M.bridge_bucket_bytes(trainer_shape, dtype)
    weights = M.weight_bytes(M.parameters_per_gpu(shape, wtp, 1), dtype)
    return {**_component(g.workers * wtp, f"{g.workers} worker(s) x TP{wtp} (a whole copy each)",
                         total_gib=(weights + max(kv + logits, bucket)) / GIB, params_gib=weights / GIB,
                         kv_cache_gib=kv / GIB, logits_gib=logits / GIB, bucket_gib=bucket / GIB),
            "workers": g.workers}


def gpu_count(result: dict) -> int:
    """Every GPU the run takes: the trainer's, PPO's service's and the rollout workers'."""
    c = result["components"]
    return sum(c[n]["gpus"] for n in ("actor", "critic", "generation") if n in c and (
        n != "generation" or "workers" in c[n]))


def plan_run(cfg, algorithm: str, cluster: Cluster, lengths: Lengths, vocab_size: int, recompute: str) -> dict:
    """{"components": {...}, "timing": {...}, "usable_gib": float} (no layout checks: layout.py's job)."""
    m, t, hw = cfg.model, cfg.trainer, cluster.hw
    tp, pp, cp, sp = (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size,
                      m.sequence_parallel)
    dtype = str(m.params_dtype)
    shape = M.Shape.of(m, vocab_size)
    dp = cluster.gpus // (tp * pp * cp)
    rl = "algorithm" in cfg
    per_sample = 2 if algorithm in PAIRED else 1
    seq = cfg.data.max_length + cfg.sampling.max_new_tokens if rl else cfg.data.max_length
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    impl = _impl(cfg, cluster, algorithm)
    layout = f"TP{tp} PP{pp} CP{cp} DP{dp}"
    params = M.parameters_per_gpu(shape, tp, pp)
    lora = M.Lora.of(m.get("lora"))
    adapters = None if lora is None else M.adapter_parameters_per_gpu(shape, lora, tp, pp)
    acts = M.activation_bytes(shape, seq, t.micro_batch_size * per_sample, micro, tp, pp, cp, sp, dtype, impl,
                              recompute, lora=lora, logit_tokens=M.response_rows_per_cp_rank(
                                  seq, cfg.sampling.max_new_tokens, cp) if rl else None)
    components = {"actor": _component(cluster.gpus, layout, **_model_state(params, dtype, dp,
                                                                         cfg.optim.distributed_optimizer, adapters),
                                      activations_gib=acts / GIB)}
    if lora is not None:
        components["actor"]["lora"] = _lora_entry(shape, lora)
    if _has_reference(cfg):
        weights = M.weight_bytes(params, dtype) / GIB
        swap = cfg.reference.mode == "cpu_swap"
        components["reference"] = (
            _component(cluster.gpus, layout + " (the actor's base, adapters off)", params_gib=0.0)
            if lora is not None else _component(cluster.gpus, layout, params_gib=0.0 if swap else weights,
                                                host_gib=weights if swap else 0.0))
    if rl:  # the engine decodes at most its batch of this replica's samples at once (each CP rank is a replica)
        separate = _separate(cfg)
        batch = max(min(cfg.generation.batch_size, _samples(cfg) // (dp * cp)), 1)
        kv = M.kv_cache_bytes(shape, seq, batch, tp, pp, dtype)
        logits = batch * shape.vocab * 4
        merged = 0.0 if lora is None else M.merged_weight_bytes(shape, lora, tp, pp, dtype)
        # The KV cache lives only inside a generate call (lean_decode: per call), when no activations are
        # held, and the training step's activations are freed before the next generation: the two never
        # coexist. The trainer's GPUs hold the larger, so generation adds only what exceeds the activations.
        # A LoRA actor's merged weights are made per generate call too. With separate workers the trainer's
        # engine still generates validation's samples and DAPO's refills (component `validation`).
        parts = {"kv_cache_gib": kv / GIB, "logits_gib": logits / GIB}
        if lora is not None:
            parts["merged_gib"] = merged / GIB
        what = "the actor's weights" + ("" if lora is None else ", merged") + (
            ": validation, DAPO's refills" if separate else "")
        components["validation" if separate else "generation"] = _component(
            cluster.gpus, f"{layout} ({what})", total_gib=max(0.0, (kv + logits + merged - acts) / GIB), **parts)
        if separate:
            components["generation"] = _workers(cfg, shape, seq, dtype, vocab_size)
    if "critic" in cfg:
        components.update(_service(cfg, cluster, shape, seq, dtype, impl, recompute, vocab_size))
    timing = _step_time(cfg, algorithm, cluster, shape, lengths, dtype, recompute, vocab_size)
    return {"components": components, "timing": timing, "usable_gib": hw.memory_gib - hw.reserve_gib}


def _service(cfg, cluster: Cluster, shape, seq: int, dtype: str, impl: str, recompute: str,
             vocab_size: int) -> dict:
    """PPO's critic (trained on the service's GPUs) and the reward model it co-hosts."""
    c, m = cfg.critic, cfg.model
    ctp, cpp = c.parallel.tensor_model_parallel_size, c.parallel.pipeline_model_parallel_size
    cdtype = str(c.parallel.params_dtype or dtype)
    gpus = cluster.service_gpus
    cdp = max(gpus // (ctp * cpp), 1)
    cshape = M.Shape.of(_with_tp(m, ctp), vocab_size)
    params = M.parameters_per_gpu(cshape, ctp, cpp)
    lora = M.Lora.of(c.get("lora"))
    adapters = None if lora is None else M.adapter_parameters_per_gpu(cshape, lora, ctp, cpp)
    micro = max(c.trainer.global_batch_size // (c.trainer.micro_batch_size * cdp), 1)
    acts = M.activation_bytes(cshape, seq, c.trainer.micro_batch_size, micro, ctp, cpp, 1, False, cdtype, impl,
                              recompute, lora=lora)
    layout = f"TP{ctp} PP{cpp} DP{cdp}"
    # a LoRA critic trains its value head too (hidden weights, on the last stage)
    critic = _component(gpus, layout, **_model_state(params, cdtype, cdp, c.optim.distributed_optimizer, adapters,
                                                      head=cshape.hidden), activations_gib=acts / GIB)
    if lora is not None:
        critic["lora"] = {**_lora_entry(cshape, lora), "reward_is_base": _reward_is_critic_base(cfg)}
    reward = (_component(gpus, layout + " (the critic's base, adapters off)", host_gib=0.0)
              if _reward_is_critic_base(cfg) else
              _component(gpus, layout + " (swapped into the critic's parameters)",
                         host_gib=M.weight_bytes(params, cdtype) / GIB))
    return {"critic": critic, "reward": reward}


def _reward_is_critic_base(cfg) -> bool:
    """A LoRA critic started from the reward model (aligner/servers/critic_server.py): it scores with its
    adapters off, and no weights are swapped or copied."""
    c = cfg.critic
    return M.Lora.of(c.get("lora")) is not None and (not c.checkpoint or c.checkpoint == cfg.reward.get("checkpoint"))


class _with_tp:
    """A ModelConfig seen with another tensor-parallel size (the critic's vocabulary padding)."""

    def __init__(self, m, tp: int):
        self._m, self.tensor_model_parallel_size = m, tp

    def __getattr__(self, name):
        return getattr(self._m, name)


def _step_time(cfg, algorithm: str, cluster: Cluster, shape, lengths: Lengths, dtype: str, recompute: str,
               vocab_size: int) -> dict:
    """Seconds per phase and `step_s`, with the overlaps the loops have (see each branch)."""
    m, t, hw = cfg.model, cfg.trainer, cluster.hw
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    gpus, dp = cluster.gpus, cluster.gpus // (tp * pp * cp)
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    weights_per_gpu = M.weight_bytes(M.parameters_per_gpu(shape, tp, pp), dtype)
    lora = M.Lora.of(m.get("lora"))
    adapters = 0 if lora is None else M.adapter_parameter_count(shape, lora)  # LoRA: the base's weight grads skipped
    out: dict[str, float] = {}
    swap_in = 2 * T.transfer_seconds(weights_per_gpu, hw.pcie_bytes_per_s)  # reference swap in and back
    if "algorithm" not in cfg:  # SFT, DPO and the other offline trainers: one optimizer step
        per_sample = 2 if algorithm in PAIRED else 1
        seqs, seq = t.global_batch_size * per_sample, cfg.data.max_length
        out["train_s"] = T.train_seconds(shape, seqs, seq, gpus, pp, micro, hw, recompute, adapters=adapters)
        if _has_reference(cfg):
            out["reference_s"] = T.forward_seconds(shape, seqs, seq, gpus, hw) + (
                swap_in if cfg.reference.mode == "cpu_swap" else 0.0)
        out["step_s"] = sum(out.values())
        return out
    a, g = cfg.algorithm, cfg.generation
    samples, tokens = a.prompts_per_step * a.num_generations, lengths.prompt + lengths.response
    separate = _separate(cfg)
    if separate:  # the workers: each a whole copy at its own TP, no PP; the step's samples split between them
        out["generate_s"] = T.generation_seconds(worker_shape(cfg, vocab_size), samples, lengths.prompt,
                                                 lengths.response, g.batch_size, g.tensor_model_parallel_size, 1,
                                                 g.workers, dtype, hw)
    else:  # colocated: every data-parallel replica's engine, each CP rank one more (whole sequences)
        out["generate_s"] = T.generation_seconds(shape, samples, lengths.prompt, lengths.response, g.batch_size,
                                                 tp, pp, dp * cp, dtype, hw)
    updates = a.ppo_epochs * samples // t.global_batch_size
    ppo = "critic" in cfg
    old = ppo or updates > 1 or (_has_reference(cfg) and a.kl.mode == "reward")
    out["logprobs_s"] = T.forward_seconds(shape, samples, tokens, gpus, hw) if old else 0.0
    out["reference_s"] = (T.forward_seconds(shape, samples, tokens, gpus, hw)
                          + (swap_in if cfg.reference.mode == "cpu_swap" else 0.0)) if _has_reference(cfg) else 0.0
    out["train_s"] = a.ppo_epochs * T.train_seconds(shape, samples, tokens, gpus, pp, micro, hw, recompute,
                                                    adapters=adapters)
    if separate:
        out["broadcast_s"] = broadcast_seconds(M.parameter_count(shape), dtype, hw)
    else:
        out["refit_s"] = 0.0  # the in-process engine reads the live weights
    if ppo:
        out.update(_service_time(cfg, cluster, lengths, out, separate, dtype, recompute, vocab_size))
    generate, broadcast = out["generate_s"], out.get("broadcast_s", 0.0)
    trainer = sum(v for k, v in out.items() if k not in ("generate_s", "broadcast_s", "critic_infer_s",
                                                             "critic_train_s"))
    out["step_s"] = step_seconds(generate, trainer, broadcast, a["async"].max_lag if separate else 0)
    return out


def broadcast_seconds(parameters: int, dtype: str, hw) -> float:
    """The new weights to the rollout workers after a step: the whole model (gathered over the trainer's TP and PP
    ranks, bucket by bucket) leaves global rank 0 as one broadcast; a pipelined broadcast moves the bytes once
    over its slowest link, rank 0's InfiniBand port (the workers are on nodes of their own, the hetjob's);
    on `cpu` every process is on one host, at the intra-node figure."""
    link = hw.nvlink_bytes_per_s if hw.name == "cpu" else hw.ib_bytes_per_s
    return T.transfer_seconds(M.weight_bytes(parameters, dtype), link)


def step_seconds(generate: float, trainer: float, broadcast: float, max_lag: int) -> float:
    """One RL step. Colocated (broadcast 0, max_lag 0) and separate at max_lag 0: the trainer waits for the step's
    rollouts, generated after the last weights arrived: generate + trainer + broadcast. Separate at max_lag >= 1:
    the workers generate the next steps' rollouts while this one trains, so in the steady state a step costs the
    slower of the two, plus the broadcast, which stops both (a collective between trainer and workers)."""
    if max_lag >= 1:
        return max(generate, trainer) + broadcast
    return generate + trainer + broadcast


def _service_time(cfg, cluster: Cluster, lengths: Lengths, out: dict, separate: bool, dtype: str, recompute: str,
                  vocab_size: int) -> dict:
    """PPO's service phases. It infers (critic values + reward scores) while the actor computes log-probs: colocated,
    one chunk of generation.batch_size prompts at a time, as each is generated (so during generation too); with
    separate workers the step's rollouts arrive whole, in one request. The critic trains while the actor updates.
    critic_wait, critic_tail and round_trips are the trainer's waits; critic_infer and critic_train overlap it."""
    m, a, c, hw = cfg.model, cfg.algorithm, cfg.critic, cluster.hw
    samples, tokens = a.prompts_per_step * a.num_generations, lengths.prompt + lengths.response
    cshape = M.Shape.of(_with_tp(m, c.parallel.tensor_model_parallel_size), vocab_size)
    sg = cluster.service_gpus
    cdtype = str(c.parallel.params_dtype or dtype)
    critic_weights = M.weight_bytes(M.parameters_per_gpu(cshape, c.parallel.tensor_model_parallel_size,
                                                         c.parallel.pipeline_model_parallel_size), cdtype)
    chunks = 1 if separate else -(-a.prompts_per_step // cfg.generation.batch_size)
    generating = 0.0 if separate else out["generate_s"]  # what the service overlaps before the log-probs
    swaps = 0 if _reward_is_critic_base(cfg) else chunks * 2
    t: dict[str, float] = {}
    t["critic_infer_s"] = (2 * T.forward_seconds(cshape, samples, tokens, sg, hw)
                           + swaps * T.transfer_seconds(critic_weights, hw.pcie_bytes_per_s))
    service_done = max(generating, generating / chunks + t["critic_infer_s"])
    t["critic_wait_s"] = max(0.0, service_done - (generating + out["logprobs_s"] + out["reference_s"]))
    cmicro = max(c.trainer.global_batch_size // (c.trainer.micro_batch_size * max(sg // (
        c.parallel.tensor_model_parallel_size * c.parallel.pipeline_model_parallel_size), 1)), 1)
    clora = M.Lora.of(c.get("lora"))
    t["critic_train_s"] = c.trainer.epochs * T.train_seconds(
        cshape, samples, tokens, sg, c.parallel.pipeline_model_parallel_size, cmicro, hw, recompute,
        adapters=0 if clora is None else M.adapter_parameter_count(cshape, clora))
    t["critic_tail_s"] = max(0.0, t["critic_train_s"] - (out["train_s"] + out.get("refit_s", 0.0)))
    t["round_trips_s"] = (chunks + 2) * T.ROUND_TRIP_S
    return t
