"""The cluster a run is planned for, and the layout rules a run must obey before memory even matters.

Each refusal is one sentence that says what is wrong and how to fix it, in the keys `aligner plan` and
`aligner train` take (the rules are those of aligner/config/validate.py and of megatron's
parallel_state, stated for a cluster of `nodes x gpus_per_node` GPUs instead of one launcher)."""
from __future__ import annotations

from dataclasses import dataclass

from aligner.plan.hardware import ACCELERATORS, Accelerator, cpu


@dataclass(frozen=True)
class Cluster:
    hw: Accelerator
    gpus_per_node: int
    nodes: int  # the trainer's (actor's)
    service_nodes: int  # PPO's critic/reward service

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def service_gpus(self) -> int:
        return self.service_nodes * self.gpus_per_node


def accelerator(name: str, memory_gib: float | None) -> Accelerator:
    """The table's entry, or a CPU rank with the stated memory. ValueError names the choices."""
    if name == "cpu":
        if memory_gib is None or memory_gib <= 0:
            raise ValueError("cluster.gpu=cpu needs cluster.memory_gib=<memory per rank, GiB>")
        return cpu(memory_gib)
    if name not in ACCELERATORS:
        raise ValueError(f"cluster.gpu={name} is not one of {', '.join([*ACCELERATORS, 'cpu'])}")
    if memory_gib is not None:
        raise ValueError("cluster.memory_gib is only for cluster.gpu=cpu (a GPU's memory is in the table)")
    return ACCELERATORS[name]


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def model_layout_errors(m, gpus: int, who: str = "model", tp: int | None = None, pp: int | None = None,
                        cp: int = 1, gpus_key: str = "cluster.nodes") -> list[str]:
    """TP must divide the heads, query groups and FFN width, PP the layers, and TP x PP x CP the GPUs."""
    tp = m.tensor_model_parallel_size if tp is None else tp
    pp = m.pipeline_model_parallel_size if pp is None else pp
    key = "model" if who == "model" else f"{who}.parallel"
    errors = []
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    if heads % tp or groups % tp:
        fits = [d for d in _divisors(groups) if heads % d == 0]
        errors.append(f"{who}: TP={tp} does not divide the {heads} attention heads and {groups} query groups; "
                      f"set {key}.tensor_model_parallel_size to one of {fits}")
    elif m.ffn_hidden_size % tp:
        errors.append(f"{who}: TP={tp} does not divide ffn_hidden_size={m.ffn_hidden_size}; set "
                      f"{key}.tensor_model_parallel_size to a divisor of it")
    if m.num_layers % pp:
        errors.append(f"{who}: PP={pp} does not divide the {m.num_layers} layers; set "
                      f"{key}.pipeline_model_parallel_size to one of {_divisors(m.num_layers, 64)}")
    if gpus % (tp * pp * cp):
        errors.append(f"{who}: {gpus} GPUs cannot be split into TP={tp} x PP={pp} x CP={cp} = {tp * pp * cp}; "
                      f"set {gpus_key} so that the GPUs are a multiple of {tp * pp * cp}, or change the layout")
    if cp > 1 and m.seq_length % (2 * cp):
        errors.append(f"model.seq_length={m.seq_length} is not a multiple of 2 x CP = {2 * cp}; round it up to "
                      f"{-(-m.seq_length // (2 * cp)) * 2 * cp}")
    if who == "model" and m.sequence_parallel and tp == 1:  # the critic service runs without sequence parallelism
        errors.append("model.sequence_parallel=true needs model.tensor_model_parallel_size > 1; set it to false")
    return errors


def batch_errors(cfg, dp: int) -> list[str]:
    """The global batch must split into micro-batches over the data-parallel ranks (and RL steps into it)."""
    t, errors = cfg.trainer, []
    step = t.micro_batch_size * dp
    if t.global_batch_size % step:
        errors.append(f"trainer.global_batch_size={t.global_batch_size} is not a multiple of "
                      f"trainer.micro_batch_size={t.micro_batch_size} x data-parallel size {dp} = {step}; set "
                      f"trainer.global_batch_size={step * max(1, round(t.global_batch_size / step))} or change "
                      f"the micro-batch or the layout")
    if "algorithm" in cfg:
        samples = cfg.algorithm.prompts_per_step * cfg.algorithm.num_generations
        if samples % t.global_batch_size:
            errors.append(f"a step's algorithm.prompts_per_step x num_generations = {samples} samples do not split "
                          f"into optimizer steps of trainer.global_batch_size={t.global_batch_size}; use a divisor "
                          f"of {samples}")
    return errors


def placement_errors(cfg) -> list[str]:
    """Online RL's generation.placement and algorithm.async.max_lag (aligner/config/rl_schema.py's rules). Context
    parallelism is allowed: colocated, each CP rank generates whole sequences with the lean decoder (an extra
    data-parallel replica of the engine; megatron's decode would split them); separate workers run without it."""
    g, m, lag = cfg.generation, cfg.model, cfg.algorithm["async"].max_lag
    errors = []
    if m.context_parallel_size > 1 and g.decode == "megatron":
        errors.append("under context parallelism each CP rank generates whole sequences with the lean decoder; "
                      "set generation.decode=auto, or model.context_parallel_size=1")
    if lag < 0:
        errors.append(f"algorithm.async.max_lag={lag} is negative; set it to 0 (synchronous) or more")
    if g.placement == "colocated":
        if lag > 0:
            errors.append(f"algorithm.async.max_lag={lag} needs rollout workers of their own; set "
                          f"generation.placement=separate")
        return errors
    tp, groups = g.tensor_model_parallel_size, m.num_query_groups or m.num_attention_heads
    if g.workers < 1:
        errors.append(f"generation.placement=separate needs rollout workers; set generation.workers >= 1, got "
                      f"{g.workers}")
    if tp < 1 or m.num_attention_heads % tp or groups % tp:
        fits = [d for d in _divisors(groups) if m.num_attention_heads % d == 0]
        errors.append(f"generation: TP={tp} does not divide the {m.num_attention_heads} attention heads and {groups} "
                      f"query groups; set generation.tensor_model_parallel_size to one of {fits}")
    return errors


def layout_errors(cfg, cluster: Cluster) -> list[str]:
    """Every layout rule the run breaks (empty: the layout is possible)."""
    m = cfg.model
    errors = model_layout_errors(m, cluster.gpus, cp=m.context_parallel_size)
    lora = m.get("lora")
    if lora is not None and lora.rank > 0 and cfg.get("reference") is not None \
            and cfg.reference.mode in ("model", "cpu_swap"):  # as aligner/config/validate.py refuses it
        errors.append(f"reference.mode={cfg.reference.mode} contradicts model.lora.rank={lora.rank}: a LoRA run's "
                      f"reference is its frozen base (the adapters off), with no copy; set reference.mode=null")
    if "algorithm" in cfg:
        errors += placement_errors(cfg)
    if not errors:
        mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        errors += batch_errors(cfg, cluster.gpus // mp)
    if "critic" in cfg:
        if cluster.service_nodes < 1:
            errors.append("PPO's critic/reward service needs GPUs of its own; set cluster.service_nodes >= 1")
        else:
            p = cfg.critic.parallel
            errors += model_layout_errors(m, cluster.service_gpus, "critic", p.tensor_model_parallel_size,
                                          p.pipeline_model_parallel_size, gpus_key="cluster.service_nodes")
    elif cluster.service_nodes:
        errors.append("cluster.service_nodes is for PPO's critic/reward service; leave it out (0) for this "
                      "algorithm")
    return errors
