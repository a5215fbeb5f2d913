"""Knowledge distillation end to end: `aligner teacher-logits` (TP=2 and PP=2 against TP=1, resumable),
`aligner train kd` offline and online through the CLI (metrics, resume, an error), and the learning comparison
on the tiny arithmetic task: a student distilled from the SFT model reaches a lower validation NLL than SFT
alone in the same steps. The loss by hand: tests/unit/test_kd_loss.py; at TP=2: tests/integration/test_kd_parity.py."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from aligner.algorithms.distillation import teacher_store as store
from tests.conftest import assert_cli_ok, assert_metrics_match_by_step, read_metrics, run_cli, start_cli

TOP_K = 32


# ---- aligner teacher-logits --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def assets(tiny_assets, rl_assets, tmp_path_factory):
    """The arithmetic SFT policy of the RL tests as the teacher, its training data, a validation file."""
    from aligner.data.synthetic import write_sft_chat

    root = tmp_path_factory.mktemp("kd")
    write_sft_chat(root / "val.jsonl", 64, seed=2, max_operand=9)
    lines = (rl_assets / "sft.jsonl").read_text().splitlines()
    (root / "small.jsonl").write_text("\n".join(lines[:36]) + "\n")
    return SimpleNamespace(root=root, teacher=rl_assets / "sft" / "checkpoints" / "step_000040",
                           train=rl_assets / "sft.jsonl", val=root / "val.jsonl", small=root / "small.jsonl",
                           tokenizer=tiny_assets / "tokenizer")


class Interrupted(Exception):
    pass


def test_teacher_logits_resume_after_an_interruption_and_tp2_pp2_equal_tp1(assets, tmp_path, monkeypatch):
    from aligner.algorithms.distillation.teacher_logits import write_teacher_logits

    args = (assets.teacher, assets.small, TOP_K)
    write_teacher_logits(args[0], args[1], tmp_path / "tp1", TOP_K, chunk_size=8)  # 36 samples: 5 chunks
    written, save = [], store.save_chunk

    def save_then_stop(out_dir, index, *tensors):
        written.append(index)
        save(out_dir, index, *tensors)
        if len(written) == 2:
            raise Interrupted

    monkeypatch.setattr(store, "save_chunk", save_then_stop)
    with pytest.raises(Interrupted):
        write_teacher_logits(*args[:2], tmp_path / "resumed", TOP_K, chunk_size=8)
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == [
        "chunk_00000.safetensors", "chunk_00001.safetensors", "manifest.json"]
    written.clear()
    monkeypatch.setattr(store, "save_chunk", lambda out_dir, index, *tensors: (written.append(index),
                                                                                 save(out_dir, index, *tensors)))
    write_teacher_logits(*args[:2], tmp_path / "resumed", TOP_K, chunk_size=8)
    assert written == [2, 3, 4]  # continued from the first missing chunk
    names = sorted(p.name for p in (tmp_path / "tp1").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "resumed").iterdir()) and len(names) == 6
    for name in names:
        assert (tmp_path / "tp1" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name
    write_teacher_logits(*args[:2], tmp_path / "resumed", TOP_K, chunk_size=8)  # complete: nothing to do
    assert written == [2, 3, 4]

    # TP=2 and PP=2 through the CLI, side by side
    layouts = {"tp2": ("--tp", "2"), "pp2": ("--pp", "2")}
    procs = {name: start_cli("teacher-logits", "--teacher", str(assets.teacher), "--data", str(assets.small),
                             "--top-k", str(TOP_K), "--out", str(tmp_path / name), "--chunk-size", "8", *flags)
             for name, flags in layouts.items()}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, stderr[-3000:])
    one = store.TeacherLogits(tmp_path / "tp1")
    for name in layouts:
        other = store.TeacherLogits(tmp_path / name)
        assert one.manifest == other.manifest and len(one) == 36
        worst, rows = 0.0, 0
        for i in range(len(one)):
            (ids1, v1), (ids2, v2) = one[i], other[i]
            rows += len(ids1)
            worst = max(worst, (v1 - v2).abs().max().item())
            assert torch.equal(ids1, ids2), (name, i)  # no near-ties in this data: the same ids in the same order
        print(f"teacher-logits {name} vs TP=1: {rows} positions x {TOP_K}, ids equal, max |value diff| {worst:.2e}")
        assert rows > 36 and worst < 1e-4


def test_teacher_logits_refuses_what_does_not_fit(assets, tmp_path, tokenizer):
    from aligner.algorithms.distillation.teacher_logits import write_teacher_logits
    from aligner.data.jsonl import DataError
    from aligner.errors import UsageError, UserError

    with pytest.raises(UsageError, match="--top-k 600 is not in"):
        write_teacher_logits(assets.teacher, assets.small, tmp_path / "big_k", 600)
    out = tmp_path / "made"
    write_teacher_logits(assets.teacher, assets.small, out, 4, chunk_size=64)
    with pytest.raises(DataError, match="made from .*small.jsonl"):  # another data file into the same --out
        write_teacher_logits(assets.teacher, assets.val, out, 4, chunk_size=64)
    with pytest.raises(UserError, match="another top_k"):
        write_teacher_logits(assets.teacher, assets.small, out, 5, chunk_size=64)
    manifest = store.read_manifest(out)
    same = store.data_identity(assets.small, tokenizer, "tok", "auto", 256, "truncate")
    store.check_matches(manifest, same, "kd.teacher_logits", "fix")  # the same data and tokenizer (another copy)
    with pytest.raises(DataError, match="max_length=256, this run has max_length=64"):
        store.check_matches(manifest, {**same, "data": {**same["data"], "max_length": 64}}, "kd.teacher_logits", "fix")
    with pytest.raises(DataError, match="another tokenizer"):
        store.check_matches(manifest, {**same, "tokenizer": {"path": "x", "fingerprint": "0"}}, "kd.teacher_logits", "f")
    (out / "chunk_00000.safetensors").unlink()
    with pytest.raises(UserError, match="incomplete"):
        store.TeacherLogits(out)
    with pytest.raises(UserError, match="does not exist"):
        store.TeacherLogits(tmp_path / "nowhere")


# ---- aligner train kd: the learning comparison, offline and online, resume, errors --------------------------
def common(assets, run_dir, steps: int = 20):
    return (f"run_dir={run_dir}", f"data.train_path={assets.train}", f"data.val_path={assets.val}",
            f"tokenizer.path={assets.tokenizer}", f"trainer.max_steps={steps}", f"trainer.val_interval={steps // 2}",
            "optim.lr=3e-3", "optim.warmup_steps=5", "logging.progress=false", "logging.tensorboard=false")


@pytest.fixture(scope="module")
def runs(assets):
    """SFT alone and offline KD (weights 1 and 1) from the same initial weights, 20 steps, the same data
    and seed; the teacher is the SFT model trained 40 steps."""
    from aligner.algorithms.distillation.teacher_logits import write_teacher_logits

    root = assets.root
    write_teacher_logits(assets.teacher, assets.train, root / "train_logits", TOP_K, chunk_size=128)
    write_teacher_logits(assets.teacher, assets.val, root / "val_logits", TOP_K, chunk_size=128)
    baseline = start_cli("train", "sft", *common(assets, root / "sft"))
    kd = run_cli("train", "kd", *common(assets, root / "kd"), f"kd.teacher_logits={root / 'train_logits'}",
                 f"kd.val_teacher_logits={root / 'val_logits'}", "kd.sft_loss_weight=1", "trainer.save_interval=10")
    _, stderr = baseline.communicate(timeout=600)
    assert baseline.returncode == 0, stderr[-3000:]
    assert_cli_ok(kd)
    return SimpleNamespace(root=root, sft=read_metrics(root / "sft"), kd=read_metrics(root / "kd"))


def test_distilled_student_beats_sft_alone_in_the_same_steps(runs):
    sft_val, kd_val = runs.sft[-1]["val/loss"], runs.kd[-1]["val/sft/loss"]
    print(f"validation NLL after 20 steps: SFT {sft_val:.4f}, KD from the SFT model {kd_val:.4f}")
    assert runs.sft[-1]["step"] == runs.kd[-1]["step"] == 20
    assert kd_val < sft_val - 0.02


def test_offline_metrics_and_resume(runs, assets):
    for m in runs.kd:
        assert m["loss"] == pytest.approx(m["kd/loss"] + m["sft/loss"], rel=1e-5)  # both weights 1
        assert m["kd/loss"] >= 0
    val = {m["step"]: m for m in runs.kd if "val/loss" in m}
    assert sorted(val) == [10, 20]
    assert val[20]["val/loss"] == pytest.approx(val[20]["val/kd/loss"] + val[20]["val/sft/loss"], rel=1e-5)
    assert runs.kd[-1]["kd/loss"] < 0.5 * runs.kd[0]["kd/loss"]  # it learns the teacher
    # resume from the step-10 checkpoint: steps 11..20 again, bitwise
    run_dir = runs.root / "kd"
    shutil.rmtree(run_dir / "checkpoints" / "step_000020")
    again = run_cli("train", "kd", *common(assets, run_dir), f"kd.teacher_logits={runs.root / 'train_logits'}",
                    f"kd.val_teacher_logits={runs.root / 'val_logits'}", "kd.sft_loss_weight=1",
                    "trainer.save_interval=10")
    assert_cli_ok(again)
    resumed = read_metrics(run_dir)
    assert [m["step"] for m in resumed] == list(range(1, 21))
    assert_metrics_match_by_step(resumed[10:], runs.kd, ["loss", "kd/loss", "sft/loss", "grad_norm"])
    assert resumed[-1]["val/loss"] == runs.kd[-1]["val/loss"]
    # continuing with other teacher logits of the same data is refused
    from aligner.algorithms.distillation.teacher_logits import write_teacher_logits

    write_teacher_logits(assets.teacher, assets.train, runs.root / "train_logits_top8", 8, chunk_size=128)
    other = run_cli("train", "kd", *common(assets, run_dir, steps=30),
                    f"kd.teacher_logits={runs.root / 'train_logits_top8'}", "kd.sft_loss_weight=1")
    lines = [line for line in other.stderr.splitlines() if line.startswith("error: ")]
    assert other.returncode == 1 and len(lines) == 1, other.stderr[-2000:]
    assert "was trained with the top-32 logits" in lines[0] and "this run has the top-8 logits" in lines[0]


@pytest.mark.dist
def test_online_teacher_at_tp2_and_pp2_matches_the_precomputed_logits(runs, assets):
    """kd.teacher=CKPT (the teacher resident in each rank, top-k on the fly) at TP=2 and at PP=2 trains like
    kd.teacher_logits=DIR at TP=1: from the same weights (a checkpoint, since PP changes the initialisation),
    data and top-k, the same two steps."""
    start = runs.root / "kd" / "checkpoints" / "step_000010"
    online = (f"kd.teacher={assets.teacher}", f"kd.top_k={TOP_K}", "launcher.nproc_per_node=2")
    layouts = {"offline_tp1": (f"kd.teacher_logits={runs.root / 'train_logits'}",
                               f"kd.val_teacher_logits={runs.root / 'val_logits'}"),
               "online_tp2": (*online, "model.tensor_model_parallel_size=2"),
               "online_pp2": (*online, "model.pipeline_model_parallel_size=2", "trainer.micro_batch_size=2")}
    procs = {name: start_cli("train", "kd", *common(assets, runs.root / name, steps=2), f"model.pretrained={start}",
                             "kd.sft_loss_weight=1", *extra) for name, extra in layouts.items()}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, stderr[-3000:])
    reference = read_metrics(runs.root / "offline_tp1")
    for name in ("online_tp2", "online_pp2"):
        metrics = read_metrics(runs.root / name)
        for step in (0, 1):
            for key in ("loss", "kd/loss", "sft/loss"):
                assert metrics[step][key] == pytest.approx(reference[step][key], rel=1e-4, abs=1e-5), (name, step, key)
        assert metrics[1]["val/kd/loss"] == pytest.approx(reference[1]["val/kd/loss"], rel=1e-4, abs=1e-5), name
        print(name, {k: metrics[1][k] for k in ("loss", "kd/loss", "sft/loss")}, "TP=1 offline:",
              {k: reference[1][k] for k in ("loss", "kd/loss", "sft/loss")})


@pytest.mark.parametrize("overrides, error, fragment", [
    ([], "ConfigError", "no teacher: set kd.teacher_logits=DIR"),
    (["kd.teacher={teacher}", "kd.teacher_logits={root}"], "ConfigError", "kd.teacher and kd.teacher_logits both set"),
    (["kd.teacher={teacher}", "kd.val_teacher_logits={root}"], "ConfigError", "needs kd.teacher_logits and data.val"),
    (["kd.teacher={teacher}", "kd.loss_weight=0"], "ConfigError", "not both 0"),
    (["kd.teacher={teacher}", "kd.teacher_logits_scale=0"], "ConfigError", "must be > 0"),
    (["kd.teacher={teacher}", "kd.loss=jsd"], "ConfigError", "kd.loss"),
    (["kd.teacher={teacher}", "kd.top_k=513"], "ConfigError", "kd.top_k=513 is larger than the teacher's vocabulary"),
    (["kd.teacher={root}"], "UserError", "is not an aligner checkpoint"),
    (["kd.teacher_logits={root}/nowhere"], "UserError", "nowhere is not a directory, kd.teacher_logits"),
])
def test_config_rules(assets, overrides, error, fragment):
    from aligner.config import load_config
    from aligner.errors import UserError

    overrides = [o.format(teacher=assets.teacher, root=assets.root) for o in overrides]
    with pytest.raises(UserError, match=fragment) as caught:
        load_config("kd", ["data.train_path=train.jsonl", "tokenizer.path=tok", *overrides], world_size=1)
    assert type(caught.value).__name__ == error


@pytest.mark.parametrize("overrides, code, fragment", [
    ([], 2, "no teacher: set kd.teacher_logits=DIR"),
    (["model.vocab_size=600", "kd.teacher={teacher}"], 1,
     "the teacher's vocabulary has 512 tokens, the student's 600, kd.teacher, distil between models of one tokenizer"),
])
def test_kd_mistakes_through_the_cli(assets, tmp_path, overrides, code, fragment):
    result = run_cli("train", "kd", *common(assets, tmp_path / "run", steps=2),
                     *[o.format(teacher=assets.teacher) for o in overrides])
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == code and len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and fragment in lines[0], lines
