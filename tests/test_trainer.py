"""The DSpark trainer (docs/training.md) on a tiny target: learning, kill-and-resume, torchrun, checkpoints, config."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specforge.features import write_feature_cache
from specforge.features.cache import FeatureCache
from specforge.training.checkpoint import CheckpointError, find_checkpoints, read_checkpoint
from specforge.training.config import TrainConfigError, load_train_config
from specforge.training.data import OfflineSource
from specforge.training.trainer import Trainer, lr_at

from train_fixtures import (  # noqa: F401 - one_thread and target are fixtures
    LAYERS,
    one_thread,
    target,
    tiny_config,
    tiny_sequences,
    tiny_source,
)

HERE = Path(__file__).parent
# Relative tolerance of torchrun's per-step losses against one process: the two ranks' partial
# sums and differently padded batches only reorder float32 additions (measured ≲ 1e-6).
DIST_RTOL = 1e-5
LOSS_KEYS = ("loss", "ce", "tv", "conf", "tau", "accept_rate@1", "accept_rate@4")


@pytest.fixture(scope="module")
def source(target):
    return tiny_source(target)


def losses(path: Path, split: str = "train") -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["split"] == split]


def test_loss_decreases_on_a_tiny_repeated_dataset(target, source, tmp_path):
    trainer = Trainer(tiny_config(tmp_path, steps=30), target=target, source=source, log=lambda _: None)
    hist = trainer.train()
    assert [r["step"] for r in hist] == list(range(1, 31))
    first = sum(r["loss"] for r in hist[:5]) / 5
    last = sum(r["loss"] for r in hist[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert hist[-1]["tau"] > hist[0]["tau"]
    rec = hist[-1]
    for key in ("loss", "ce", "tv", "conf", "tau", "lr", "grad_norm", "tokens_per_s", "accept_rate@1",
                "accept_rate@4"):
        assert key in rec and rec[key] == rec[key]  # present and not NaN
    # The end of a run leaves a checkpoint and the drafter alone, in save_drafter's format.
    assert [s for s, _ in find_checkpoints(tmp_path / "checkpoints")] == [30]
    assert (tmp_path / "drafter" / "model.safetensors").is_file()


def test_schedule_warms_up_then_follows_a_cosine_to_min_lr(tmp_path):
    cfg = tiny_config(tmp_path, steps=12)
    lrs = [lr_at(s, cfg, 12) for s in range(12)]
    assert lrs[0] == pytest.approx(cfg.optimizer.lr / 2) and lrs[1] == pytest.approx(cfg.optimizer.lr)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert lr_at(12, cfg, 12) == pytest.approx(cfg.schedule.min_lr)


def test_killed_run_resumes_to_the_same_parameters(target, tmp_path):
    # Offline features, as the main job uses: a tiny cache of 3 shards read back shard by shard.
    cache = write_feature_cache(target, tiny_sequences(), tmp_path / "cache", LAYERS, sequences_per_shard=3,
                                progress=False, log=lambda *_: None)
    source = lambda: OfflineSource(FeatureCache(cache.directory, target), keep_shards=2)  # noqa: E731
    cfg = lambda d: tiny_config(d, steps=9, checkpoint_interval=3)  # noqa: E731

    whole = Trainer(cfg(tmp_path / "whole"), target=target, source=source(), log=lambda _: None)
    whole.train()

    # Killed after step 7: the checkpoints of steps 3 and 6 exist, step 7 is lost.
    killed = Trainer(cfg(tmp_path / "killed"), target=target, source=source(), log=lambda _: None)
    killed.train(max_steps=7)
    assert [s for s, _ in find_checkpoints(tmp_path / "killed" / "checkpoints")] == [3, 6]
    assert len(losses(tmp_path / "killed" / "metrics.jsonl")) == 7

    resumed = Trainer.resume(tmp_path / "killed", target=target, source=source(), log=lambda _: None)
    assert resumed.step == 6 and (resumed.epoch, resumed.batch_index) == (3, 0)
    resumed.train()
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise
    # The log of the lost step was dropped and redone: the same losses as the uninterrupted run.
    la, lb = losses(tmp_path / "whole" / "metrics.jsonl"), losses(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in lb] == list(range(1, 10))
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_processes_match_one_process(tmp_path):
    steps = 4
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(HERE / "train_fixtures.py"), str(tmp_path / "dist"), str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]

    import train_fixtures

    train_fixtures.run(tmp_path / "single", steps)  # one thread, as the workers (one_thread fixture)
    one, two = losses(tmp_path / "single" / "metrics.jsonl"), losses(tmp_path / "dist" / "metrics.jsonl")
    assert len(one) == len(two) == steps
    worst = 0.0
    for r1, r2 in zip(one, two):
        assert r1["blocks"] == r2["blocks"] and r1["tokens"] == r2["tokens"]  # the same global batch
        for key in LOSS_KEYS:
            rel = abs(r1[key] - r2[key]) / max(abs(r1[key]), 1e-12)
            worst = max(worst, rel)
            assert rel <= DIST_RTOL, (r1["step"], key, r1[key], r2[key])
    w1 = load_file(str(tmp_path / "single" / "drafter" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "dist" / "drafter" / "model.safetensors"))
    param_diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    print(f"torchrun vs single process: max relative loss difference {worst:.2e}, "
          f"max parameter difference after {steps} steps {param_diff:.2e}")
    assert param_diff < 1e-5


def test_checkpoints_hold_no_pickle_and_a_damaged_one_is_skipped_and_kept(target, source, tmp_path):
    cfg = tiny_config(tmp_path, steps=6, checkpoint_interval=3)
    Trainer(cfg, target=target, source=source, log=lambda _: None).train()
    root = tmp_path / "checkpoints"
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files and {p.suffix for p in files} == {".safetensors", ".json"}
    assert not any(p.read_bytes()[:1] == b"\x80" for p in files)  # no pickle protocol header
    state = json.loads((root / "step-00000006" / "trainer.json").read_text())
    assert (state["epoch"], state["batch"], state["seed"]) == (3, 0, 0)
    rng = load_file(str(root / "step-00000006" / "rng.safetensors"))
    assert rng["torch_cpu"].dtype == torch.uint8
    opt = load_file(str(root / "step-00000006" / "optimizer.safetensors"))
    assert "backbone.fc.weight/exp_avg" in opt and "head.w1/exp_avg_sq" in opt

    # Truncate the newest checkpoint's optimizer state: reading it says what is wrong ...
    damaged = root / "step-00000006"
    opt_file = damaged / "optimizer.safetensors"
    opt_file.write_bytes(opt_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"step-00000006 is damaged: optimizer.safetensors is truncated"):
        read_checkpoint(damaged)
    # ... and resume reports it and falls back to the previous complete checkpoint, ignoring what a
    # run killed while writing a checkpoint left behind (removed with the next checkpoint).
    partial = root / ".step-00000009.tmp4242"
    (partial / "drafter").mkdir(parents=True)
    (partial / "optimizer.safetensors").write_bytes(b"\0" * 10)
    messages = []
    resumed = Trainer.resume(tmp_path, target=target, source=source, log=messages.append)
    assert resumed.step == 3
    assert any("step-00000006 is damaged: optimizer.safetensors is truncated" in m for m in messages)
    assert (root / "step-00000003" / "trainer.json").is_file()
    # Finishing the run writes a new step 6; the damaged one is set aside, not deleted.
    resumed.train()
    assert read_checkpoint(root / "step-00000006").step == 6
    assert len(list(root.glob("step-00000006.damaged-*"))) == 1
    assert not partial.exists()

    # A damaged only-checkpoint is an error that names it.
    (root / "step-00000003").rename(tmp_path / "elsewhere")
    (root / "step-00000006" / "trainer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint.*step-00000006 is damaged"):
        Trainer.resume(tmp_path, target=target, source=source, log=lambda _: None)


def test_config_errors_name_the_key_and_the_valid_keys(tmp_path):
    with pytest.raises(TrainConfigError) as e:
        load_train_config("quick", ["optimizer.lrr=1", "drafter.head.rnak=8", "batch.sequences=0", "bogus=1"])
    msg = str(e.value)
    assert "optimizer.lrr: unknown key; valid keys: lr, betas, eps, weight_decay" in msg
    assert "drafter.head.rnak: unknown key; valid keys: name, rank," in msg
    assert "batch.sequences: Input should be greater than or equal to 1" in msg
    assert "bogus: unknown key; valid keys: target, data," in msg
    with pytest.raises(TrainConfigError, match="drafter.head.name: 'lstm' is not a trainable correction head; "
                                               "choose one of: gated, markov, none, rnn"):
        load_train_config("quick", ["drafter.head.name=lstm"])
    with pytest.raises(TrainConfigError, match="no such config file or training preset; presets: cpu, full, medium, quick"):
        load_train_config("quik")

    # YAML files compose over presets; overriding total_steps replaces the preset's epochs.
    yaml = tmp_path / "run.yaml"
    yaml.write_text("drafter:\n  layers: 3\n  head: {name: rnn, rank: 64}\noptimizer: {lr: 1.0e-4}\n")
    cfg = load_train_config(["quick", str(yaml)], ["schedule.total_steps=50", "drafter.gamma=4"])
    d = cfg.drafter.options()
    assert (d["layers"], d["head"]["name"], d["head"]["rank"], d["gamma"]) == (3, "rnn", 64, 4)
    assert (cfg.optimizer.lr, cfg.schedule.total_steps, cfg.schedule.epochs) == (1e-4, 50, None)
    full = load_train_config("full")
    assert full.drafter.options()["layers"] == 5 and full.data.limit is None


def test_the_learning_curve_counts_training_time_only_and_scales_it_by_threads(tmp_path):
    from specforge.training.curve import learning_curve, plot_learning_curve

    records = [{"split": "train", "step": 2, "step_time": 3.0, "threads": 2},   # steps 1-2: 2 × 3 s
               {"split": "eval", "step": 2, "tau": 1.5, "loss": 4.0},
               {"split": "train", "step": 4, "step_time": 1.5, "threads": 2},   # steps 3-4: 2 × 1.5 s
               {"split": "eval", "step": 4, "tau": 1.75, "loss": 3.0}]
    points = learning_curve(records)
    assert [p["step"] for p in points] == [2, 4] and [p["tau"] for p in points] == [1.5, 1.75]
    assert points[0]["hours"] * 3600 == pytest.approx(6.0) and points[1]["hours"] * 3600 == pytest.approx(9.0)
    assert points[1]["cpu_hours"] == pytest.approx(2 * points[1]["hours"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert learning_curve(path) == points
    assert plot_learning_curve(points, tmp_path / "curve.png").stat().st_size > 0
