"""Run a real `aligner train` on CPU ranks and record each rank's memory for tests/integration/test_plan_memory.py.

    python -m tests.plan_memory_worker ALGORITHM OUT_DIR [overrides...]

composes the config as `aligner train` does, then starts its ranks with the embedded launcher. Each rank
(`rank`) starts torch's profiler with memory recording just before megatron builds the first GPTModel,
runs the algorithm's own trainer (`aligner.config.registry.ALGORITHMS`) to its last step, stops the profiler and writes
OUT_DIR/rank_<RANK>.json:

* `tensor_peak`: the peak of CPU tensor bytes allocated since the profiler started and not yet freed.
  With profile_memory, c10's CPU allocator (ProfiledCPUMemoryReporter, c10/core/CPUAllocator.cpp) keeps a
  table of every block allocated while profiling and a running total, and reports each allocation and
  free to the profiler with that total (`total_allocated` of the Allocation events). Frees of blocks
  allocated before the start are not in the table and do not lower the total; so the total's maximum is
  exactly the peak of the tensor memory the run added over what existed before the model was built.
* `allocations`, `peak_in`: how many allocation events, and the ops enclosing the allocation that reached
  the peak (innermost first: where in the step the peak falls).
* `rss_before`, `rss_peak`: VmRSS at the same starting point and VmHWM at the end (the process's peak).
* `trainable`, `adapter_parameters`: the parameters of the rank's GPTModels that train (requires_grad) and
  those of them that are LoRA adapters (`<linear>.lora.a/b`), counted after the last step.

A LoRA run adapts a base checkpoint (model.pretrained): when the override `model.pretrained=DIR` names a
directory that does not exist yet, the worker first saves the seeded model of the run's architecture there
(one process, TP = PP = 1: loading reshards it), then trains from it as `aligner train` would.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def allocation_peak(prof) -> tuple[int, int, list[str]]:
    """(peak of the running total of CPU tensor bytes, how many allocation events, the names of the ops
    that enclose the allocation that reached the peak, innermost first) from the profiler's event tree."""
    from torch._C._profiler import _EventType

    peak, count, stack = None, 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        kind, fields = node.typed
        if kind == _EventType.Allocation and fields.device.type == "cpu":
            count += 1
            if peak is None or fields.total_allocated > peak[0]:
                peak = (fields.total_allocated, node)
    where, node = [], peak[1].parent
    while node is not None:
        where.append(node.name)
        node = node.parent
    return peak[0], count, where


def rank(argv: list[str]) -> None:
    config_path, algorithm, out_dir = argv
    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel

    from aligner.config.registry import ALGORITHMS

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    state: dict = {"models": []}
    build = GPTModel.__init__

    def profiled_build(self, *args, **kwargs):
        if "rss_before" not in state:
            state["rss_before"] = _status_bytes("VmRSS")
            prof.start()
        build(self, *args, **kwargs)
        state["models"].append(self)  # kept to count what trained: they live through the run anyway

    GPTModel.__init__ = profiled_build
    importlib.import_module(ALGORITHMS[algorithm].entry).main([config_path])
    prof.stop()
    rss_peak = _status_bytes("VmHWM")
    peak, count, where = allocation_peak(prof)
    trained = [(n, p) for model in state["models"] for n, p in model.named_parameters() if p.requires_grad]
    record = {"tensor_peak": peak, "allocations": count, "peak_in": where, "rss_before": state["rss_before"],
              "rss_peak": rss_peak, "trainable": sum(p.numel() for _, p in trained),
              "adapter_parameters": sum(p.numel() for n, p in trained if ".lora." in f".{n}")}
    Path(out_dir, f"rank_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


def base(argv: list[str]) -> None:
    """One rank: save the seeded model of the config (argv[0], of command argv[1]) at argv[2] (a LoRA run's base)."""
    from aligner.config.load import load_resolved  # why: deferred as in `rank`: only a launched rank builds models
    from aligner.data.tokenizer import load_tokenizer, model_vocab_size
    from aligner.models import checkpoint
    from aligner.models.policy import build_policy
    from aligner.runtime import distributed

    config_path, algorithm, path = argv
    cfg = load_resolved(config_path, algorithm)
    m = cfg.model
    distributed.start_training_rank(cfg)
    vocab_size = model_vocab_size(m, load_tokenizer(cfg.tokenizer.path), cfg.tokenizer.path)
    checkpoint.save_checkpoint(path, build_policy(m, vocab_size), m, vocab_size)
    distributed.shutdown()


def _save_base(algorithm: str, overrides: list[str]) -> None:
    """The base checkpoint a LoRA run's `model.pretrained=DIR` names, when DIR does not exist yet."""
    from omegaconf import OmegaConf  # why: deferred as in `main`

    from aligner.config.load import compose_config
    from aligner.launch.local import launch

    given = dict(o.partition("=")[::2] for o in overrides)
    path = given.get("model.pretrained")
    if not path or Path(path).exists():
        return
    cfg = compose_config(algorithm, [o for o in overrides if not o.startswith(("model.pretrained=", "model.lora."))])
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        cfg.model[key] = 1
    cfg.model.sequence_parallel = False
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "base_config.yaml")
    launch("tests.plan_memory_worker:base", [str(run_dir / "base_config.yaml"), algorithm, path], 1,
           run_dir / "base_logs")


def main(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    from aligner.config import load_config
    from aligner.launch.local import launch

    algorithm, out_dir, overrides = argv[0], argv[1], argv[2:]
    _save_base(algorithm, overrides)
    cfg = load_config(algorithm, overrides)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    launch("tests.plan_memory_worker:rank", [str(run_dir / "config.yaml"), algorithm, out_dir],
           cfg.launcher.nproc_per_node, run_dir / "logs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
