"""The trainer and `python -m hymo.train`: the default command end to end, FSDP-2 on two CPU processes,
exact kill-and-resume, crash-safe checkpoints, skipped non-finite steps, and CLI errors."""
import json
import math
import re
import os
import shutil
import signal
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hymo.config import ConfigError, load_config
from test_data import _bare_loader  # a loader's epoch arithmetic without a dataset

# Small and fast: the tiny model on short windows. Data comes from the bundled corpus, prepared once
# per test session into a private cache.
FAST = dict(seq_len=32, micro_batch_size=4, global_batch_size=4, eval_every=0, ckpt_every=0, sample_tokens=8,
            warmup_steps=2, log_every=1)


@pytest.fixture(scope="session", autouse=True)
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("hymo_cache")
    old = os.environ.get("HYMO_CACHE")
    os.environ["HYMO_CACHE"] = str(d)
    yield d
    if old is None: os.environ.pop("HYMO_CACHE", None)
    else: os.environ["HYMO_CACHE"] = old


def make(run_dir, resume=True, **over):
    from hymo.training.trainer import Trainer
    cfg = load_config("hymo_tiny", **{**FAST, **over})
    return Trainer(cfg.model, cfg.train, run_dir=run_dir, resume=resume, quiet=True)


def edit_meta(path: Path, **changes):
    "Change fields of a checkpoint's meta.json as a save would have written them (with its own sum)."
    from hymo.training.trainer import meta_sum
    meta = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({**meta, "meta_crc32": meta_sum(meta)}))


def main_loss(t, batch) -> float:
    "The model's main loss on one loader batch as the trainer computes it: on its device, under its autocast (bf16 on a GPU)."
    from hymo.training.trainer import _to_device
    tokens, targets, cu = _to_device(t, batch)
    with torch.no_grad(), t.autocast():
        return float(t.model(tokens, targets=targets, cu_seqlens=cu)[1]["main"])


def losses(metrics):
    return [m["loss"] for m in metrics]


def read_jsonl(path):
    return [json.loads(l) for l in Path(path).read_text().splitlines()]


CPU_RANKS = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU, GPU or not
TWO_RANK_RUN = ["seq_len=32", "micro_batch_size=2", "global_batch_size=4", "eval_every=0", "ckpt_every=2", "sample_tokens=4",
                "warmup_steps=1"]  # a quick run for two ranks (each micro-batch 2 of the 4 windows), a checkpoint every 2 steps


def torchrun(*args, cwd, timeout=400):
    "`torchrun --standalone --nproc_per_node 2 ARGS` on the CPU (gloo), with this session's data cache."
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args],
                          cwd=cwd, env={**os.environ, "WANDB_MODE": "offline", **CPU_RANKS}, capture_output=True,
                          text=True, timeout=timeout)


def run_cli(*args, cwd, env_extra=None, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "hymo.train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_default_command_end_to_end(tmp_path):
    """The README's command, shortened by overrides: it trains, evaluates, samples and writes every artefact."""
    r = run_cli("max_steps=6", "warmup_steps=1", "eval_every=3", "sample_tokens=72", "seq_len=64", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "run folder:" in r.stdout and "sample" in r.stdout
    run = next((tmp_path / "runs").iterdir())
    assert run.name.startswith("hymo_tiny-")
    m = read_jsonl(run / "metrics.jsonl")
    assert [x["step"] for x in m] == list(range(1, 7))
    from hymo.training.trainer import peak_flops
    known = torch.cuda.is_available() and peak_flops(torch.device("cuda")) is not None  # a CPU's peak is not known
    assert all(x["tokens_per_s"] > 0 and (0 < x["mfu"] < 1 if known else x["mfu"] is None) for x in m)
    assert "val_loss" in m[2] and "val_loss" in m[5]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 6 and summary["val_loss"] < 8.0 and summary["sample"].startswith("ROMEO:")
    assert (run / "loss.png").stat().st_size > 1000
    from safetensors.torch import load_file
    w = load_file(str(run / "model.safetensors"))
    assert w["embed.weight"].shape == (2048, 128) and all(torch.isfinite(v).all() for v in w.values())
    # the folder alone generates; on a CPU, the trainer's own sample (same seed, top-k, temperature and precision, and
    # the same window: the 72 tokens outgrow the 64 the run trained on)
    g = subprocess.run([sys.executable, "-m", "hymo.generate", str(run), "--tokens", "72", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert g.returncode == 0 and g.stdout.startswith("ROMEO:"), g.stderr[-2000:]
    if not torch.cuda.is_available(): assert g.stdout.strip() == summary["sample"].strip(), (g.stdout, summary["sample"])


def test_wandb_logs_offline_and_a_resumed_run_continues_its_wandb_run_when_online(tmp_path, monkeypatch, capfd):
    """wandb=true without a login logs offline into run_dir/wandb, each part of a run (a resume starts one) in a group
    named after the run folder. Online, a resume used to open a new wandb run each time (resume="allow" without an id);
    now it continues the first one, and a run that starts afresh gets its own."""
    wandb = pytest.importorskip("wandb", reason="wandb, a dependency of hymo, is not installed here")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc of `wandb login`: not logged in
    monkeypatch.delenv("NETRC", raising=False)
    calls, real = [], wandb.init
    monkeypatch.setattr(wandb, "init", lambda **k: calls.append(k) or real(**k))
    capfd.readouterr()
    make(tmp_path / "a", max_steps=4, ckpt_every=2, warmup_steps=1, wandb=True).fit(2)
    make(tmp_path / "a", max_steps=4, warmup_steps=1, wandb=True).fit()  # resumes at step 2
    assert [(c["group"], c["id"], c["mode"]) for c in calls] == [("a", None, "offline"), ("a", None, "offline")]  # two runs, one group
    assert calls[0]["config"]["name"] == "hymo"  # the run's name (Trainer's name=), not Config's default 'custom'
    assert "deprecated" not in "".join(capfd.readouterr())  # wandb 0.31 warns of the login check through wandb.api
    parts = sorted((tmp_path / "a" / "wandb").glob("offline-run-*"))
    assert parts and all((p / f"run-{p.name.rsplit('-', 1)[1]}.wandb").stat().st_size > 0 for p in parts)  # logged

    class Online:  # what wandb.init returns, without a network
        def __init__(self, id): self.id = id or "first0id"
        def log(self, *a, **k): pass
        def finish(self): pass
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    calls.clear()
    monkeypatch.setattr(wandb, "init", lambda **k: calls.append(k) or Online(k["id"]))
    make(tmp_path / "b", max_steps=4, ckpt_every=2, warmup_steps=1, wandb=True).fit(2)
    make(tmp_path / "b", max_steps=4, warmup_steps=1, wandb=True).fit()
    make(tmp_path / "c", max_steps=4, warmup_steps=1, wandb=True).fit(1)
    assert [(c["group"], c["id"], c["mode"]) for c in calls] == [("b", None, "online"), ("b", "first0id", "online"),
                                                                  ("c", None, "online")]


def test_wandb_mode_follows_wandb_mode_and_else_a_saved_login(monkeypatch):
    """WANDB_MODE, where set, is the mode wandb.init gets (it overrides the environment's: a passed mode="offline" logged
    with WANDB_MODE=disabled); else a key in WANDB_API_KEY or saved by `wandb login` means online, asked without a prompt."""
    wandb = pytest.importorskip("wandb", reason="wandb, a dependency of hymo, is not installed here")
    from hymo.training.trainer import wandb_mode
    asked = []
    monkeypatch.setattr(wandb, "login", lambda **k: asked.append(k) or saved)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for mode in ("disabled", "offline", "Online "):
        monkeypatch.setenv("WANDB_MODE", mode)
        assert wandb_mode() == mode.strip().lower()
    monkeypatch.delenv("WANDB_MODE")
    for saved, want in ((True, "online"), (False, "offline")):
        assert wandb_mode() == want
    assert all(k.get("prompt") is False and k.get("verify") is False for k in asked) and len(asked) == 2
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert wandb_mode() == "online" and len(asked) == 2


def test_loss_falls(tmp_path):
    t = make(tmp_path / "a", max_steps=25, warmup_steps=3)
    m = t.fit()
    assert sum(losses(m)[-5:]) / 5 < sum(losses(m)[:5]) / 5 - 0.5


def test_prints_a_metric_line_every_log_every_steps(tmp_path, capsys):
    from hymo.training.trainer import Trainer
    cfg = load_config("hymo_tiny", **{**FAST, "log_every": 3, "max_steps": 7, "eval_every": 4})
    Trainer(cfg.model, cfg.train, run_dir=tmp_path / "run", quiet=False).fit()
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")]
    assert [l.split(" | ")[0] for l in lines] == ["step 1/7", "step 3/7", "step 4/7", "step 6/7", "step 7/7"]  # first, every 3rd, eval, last
    assert "val " in lines[2] and "val " not in lines[1] and "total loss" in lines[0] and "mtp_1" in lines[0]
    assert "val " in lines[-1]  # the last step validates: the final validation loss, also in summary.json


def test_no_progress_bar_is_drawn_into_a_file(tmp_path, capsys):
    "stderr not a terminal (a scheduler's log, pytest's capture): the metric lines only, no redrawn bar per step."
    from hymo.training.trainer import Trainer
    cfg = load_config("hymo_tiny", **{**FAST, "log_every": 3, "max_steps": 4})
    Trainer(cfg.model, cfg.train, run_dir=tmp_path / "run", quiet=False).fit()
    out, err = capsys.readouterr()
    assert "step 3/4" in out and "\r" not in err and "it/s" not in err and "s/it" not in err, err


def test_a_notebook_keeps_its_progress_widget():
    "tqdm.auto's bar in Jupyter is a widget (never written into a file): shown though stderr is not a terminal."
    import tqdm.notebook
    from tqdm import std
    from hymo.training.trainer import _bar_shows
    class InJupyter(tqdm.notebook.tqdm): pass  # what tqdm.auto gives inside an IPython kernel
    assert _bar_shows(InJupyter) and not _bar_shows(std.tqdm)  # pytest's stderr is not a terminal


def test_the_final_validation_loss_is_in_the_metrics_without_eval_every(tmp_path):
    "eval_every=0: no validation during the run, one at the end, written with the last step (metrics.jsonl, loss curve)."
    t = make(tmp_path / "run", max_steps=3, warmup_steps=1, eval_every=0)
    metrics = t.fit()
    assert [("val_loss" in m) for m in metrics] == [False, False, True]
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert last["step"] == 3 and last["val_loss"] == summary["val_loss"] == t.history[-1]["val_loss"]


@pytest.mark.parametrize("name", ["summary.json", "config.yaml"])
def test_summary_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch, name):
    """finish writes summary.json beside itself, on the disk, and renames it over: stopped there, the run has none, not
    a cut one; the folder's entry then goes to the disk too. config.yaml, which generate and --config read, likewise."""
    import hymo.training.trainer as tr
    class Cut(Exception): pass
    real, real_to_disk, events, cut = os.replace, tr.to_disk, [], [name]
    def replace(src, dst):
        events.append(("replace", Path(dst).name))
        if Path(dst).name in cut: raise Cut
        return real(src, dst)
    def to_disk(f):
        events.append(("to_disk", Path(getattr(f, "name", f)).name))
        return real_to_disk(f)
    monkeypatch.setattr(tr.os, "replace", replace)
    monkeypatch.setattr(tr, "to_disk", to_disk)
    with pytest.raises(Cut): make(tmp_path / "run", max_steps=2, warmup_steps=1).fit()
    assert not (tmp_path / "run" / name).exists() and not (tmp_path / "run" / f"{name}.tmp").exists()  # nothing beside it
    assert events[-2:] == [("to_disk", f"{name}.tmp"), ("replace", name)], events[-4:]
    cut.clear()
    tr._write_lines(tmp_path / "x.json", ["{}"])
    assert events[-3:] == [("to_disk", "x.json.tmp"), ("replace", "x.json"), ("to_disk", tmp_path.name)]
    import errno
    def full(f): raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tr, "to_disk", full)  # the disk fills as the new text is written: the old stays, nothing beside it
    with pytest.raises(OSError, match="No space"): tr._write_lines(tmp_path / "x.json", ['{"new": 1}'])
    assert (tmp_path / "x.json").read_text() == "{}" and not (tmp_path / "x.json.tmp").exists()


def test_document_masking_trains_on_rows_packed_past_max_seq_len(tmp_path):
    "doc_masking packs a micro-batch of 16 windows of 32 tokens into one row of 512 > max_seq_len=256: it must still train."
    t = make(tmp_path / "run", doc_masking=True, micro_batch_size=16, global_batch_size=16, max_steps=3, warmup_steps=1)
    assert t.cfg.micro_batch_size * t.cfg.seq_len > t.model.config.max_seq_len
    metrics = t.fit()
    assert len(metrics) == 3 and all(math.isfinite(m["loss"]) for m in metrics)


def test_document_masking_counts_attention_flops_within_documents(tmp_path):
    "The MFU's FLOPs of a packed micro-batch: attention over each document's own length, not the whole window."
    from hymo.models.model import doc_keys_per_query
    t = make(tmp_path / "run", doc_masking=True, micro_batch_size=16, global_batch_size=32, max_steps=3, warmup_steps=1)
    seen, batches = [], t._train_iter
    def recording():
        for b in batches: seen.append(b); yield b
    t._train_iter = recording()
    m = t.train_step()
    assert len(seen) == 2 and all(len(b) == 3 and b[2].numel() > 17 for b in seen)  # windows and documents
    want = sum(b[0].numel() * t.model.flops_per_token(t.cfg.seq_len, doc_keys_per_query(b[2])) for b in seen)
    assert m["flops"] == pytest.approx(want, rel=1e-12)
    assert m["flops"] < m["tokens"] * t.flops_per_token  # the window's count is larger
    plain = make(tmp_path / "plain", micro_batch_size=16, global_batch_size=32, max_steps=3, warmup_steps=1).train_step()
    assert plain["flops"] == plain["tokens"] * t.flops_per_token


def test_activation_checkpointing_trains_the_same_and_its_checkpoints_resume_without_it(tmp_path):
    "AC recomputes the blocks in the backward: the same losses and gradients; its checkpoints (wrapped names) load without it."
    straight = make(tmp_path / "plain", max_steps=4).fit()
    ac = make(tmp_path / "ac", max_steps=4, ckpt_every=2, activation_checkpointing=True)
    assert all(type(b).__name__ == "CheckpointWrapper" for b in ac.model.layers)
    part1 = ac.fit(num_steps=2)
    del ac
    part2 = make(tmp_path / "ac", max_steps=4, ckpt_every=2).fit()
    assert losses(part1 + part2) == losses(straight)
    assert [m["grad_norm"] for m in part1 + part2] == [m["grad_norm"] for m in straight]


def test_gradients_reach_the_optimisers_clipped_to_grad_clip(tmp_path):
    "The optimisers see the gradient scaled to norm `grad_clip` when it is larger (the logged norm is before clipping); 0 turns it off."
    for clip in (0.5, 0.0):
        t = make(tmp_path / f"clip{clip}", grad_clip=clip, max_steps=3)
        seen = []
        for opt in t.optimizers:
            def step(*a, _plain=opt.step, _opt=opt, **kw):
                seen.append(sum(float(p.grad.double().pow(2).sum()) for g in _opt.param_groups for p in g["params"] if p.grad is not None))
                return _plain(*a, **kw)
            opt.step = step
        m = t.train_step()
        assert len(seen) == len(t.optimizers) and m["grad_norm"] > 0.5, m  # the clip has work to do
        assert math.sqrt(sum(seen)) == pytest.approx(min(m["grad_norm"], clip) if clip else m["grad_norm"], rel=1e-4)  # fp32 norms


def test_a_second_ctrl_c_stops_at_once():
    """The first SIGINT (or SIGTERM) is noted for a stop after the step; a second SIGINT raises KeyboardInterrupt at once.
    A first Ctrl-C after a scheduler's SIGTERM is noted too (it raised at once, losing the step's checkpoint, unannounced)."""
    import signal, time
    from hymo.training.trainer import StopSignals
    before = signal.getsignal(signal.SIGINT)
    hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal (a test run under nohup inherits SIG_IGN)
    try:
        for first in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            got = []
            with StopSignals(got.append, announce=False):
                os.kill(os.getpid(), first); time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.05)  # a repeated SIGTERM is absorbed
                assert got == [first, signal.SIGTERM]
                if first != signal.SIGINT:
                    os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)
                    assert got == [first, signal.SIGTERM, signal.SIGINT]
                with pytest.raises(KeyboardInterrupt):
                    os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # under nohup: a hang-up stays ignored
        with StopSignals(got.append, announce=False): assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally: signal.signal(signal.SIGHUP, hup)


def test_output_that_loses_its_reader_asks_for_a_stop_once_and_then_goes_nowhere(monkeypatch):
    """`python -m hymo.train | head` (EPIPE) or a hung-up terminal (EIO): the first failed write turns that stream off
    and asks for a stop as SIGPIPE, with a line on the other stream; any other write error is raised."""
    import errno, io, signal
    from hymo.training.trainer import StopSignals
    def failing(code):
        class Stream(io.StringIO):
            def write(self, s): raise OSError(code, os.strerror(code))
        return Stream()
    for code in (errno.EPIPE, errno.EIO):
        out, err, got = failing(code), io.StringIO(), []
        monkeypatch.setattr(sys, "stdout", out); monkeypatch.setattr(sys, "stderr", err)
        with StopSignals(got.append) as s:
            print("step 1"); print("step 2", flush=True)
            assert got == [signal.SIGPIPE] and s.received == signal.SIGPIPE
        assert sys.stdout is out and sys.stderr is err  # put back
        assert err.getvalue().count("stdout was closed") == 1 and "stopping after this step with a checkpoint" in err.getvalue()
    got = []
    monkeypatch.setattr(sys, "stdout", io.StringIO()); monkeypatch.setattr(sys, "stderr", failing(errno.EPIPE))
    with StopSignals(got.append):
        os.kill(os.getpid(), signal.SIGTERM)  # a signal first: it stays the reason
        import time; time.sleep(0.05)
        print("x", file=sys.stderr)
    assert got == [signal.SIGTERM] and "stderr was closed" in sys.stdout.getvalue()
    monkeypatch.setattr(sys, "stdout", failing(errno.ENOSPC))
    with StopSignals(got.append), pytest.raises(OSError, match="No space"): print("x")  # a full disk is not a lost reader
    from hymo.training.trainer import guarded_output
    monkeypatch.setattr(sys, "stdout", failing(errno.EPIPE)); monkeypatch.setattr(sys, "stderr", io.StringIO())
    with guarded_output() as (out, _):  # as `python -m hymo.train` runs: lost before `fit` (a data preparation's lines)
        sys.stdout.writelines(["a\n", "b\n"]); assert out.gone
        got = []
        with StopSignals(got.append): assert got == [signal.SIGPIPE]  # ... stops after the first step
        assert out.on_lost is None  # the hook is put back
    assert not isinstance(sys.stdout, type(out))


def test_a_relative_data_dir_of_an_older_checkpoint_is_not_a_changed_setting(tmp_path, monkeypatch):
    "Runs before data_dir was kept absolute stored it as given: resumed from the same folder, it is the same setting."
    from hymo.config import Config
    from hymo.training.trainer import resume_changes
    monkeypatch.chdir(tmp_path)
    cfg = load_config("hymo_tiny", data_dir="data/sh")
    saved = json.loads(json.dumps(Config(cfg.model, cfg.train).to_dict()))
    now = load_config("hymo_tiny", data_dir=str(tmp_path / "data" / "sh"))
    assert not [n for n in resume_changes(saved, now.model, now.train, 0) if "data_dir" in n]
    other = load_config("hymo_tiny", data_dir=str(tmp_path / "data" / "other"))
    assert [n for n in resume_changes(saved, other.model, other.train, 0) if "data_dir" in n]


def test_validation_loss_is_the_eval_mode_mean_over_the_validation_windows(tmp_path):
    "`evaluate`: the mean main loss of the model in eval mode over `eval_batches` windows, moving no MoE statistics."
    t = make(tmp_path / "run", max_steps=4, eval_batches=3)
    t.fit(num_steps=2)
    moe = lambda: [torch.cat([m.gate_bias.flatten(), m.expert_counts.flatten().float()]) for m in t.model.moe_layers()]
    before = moe()
    got = t.evaluate()
    assert t.model.training and all(torch.equal(a, b) for a, b in zip(before, moe()))
    t.model.eval()
    want = [main_loss(t, b) for b in t.val_loader.eval_batches(3)]
    t.model.train()
    assert len(want) == 3 and got == pytest.approx(sum(want) / 3, rel=1e-6)
    assert got != pytest.approx(want[0], rel=1e-6)  # the windows differ: a pass of one would show
    calls = []
    for blk in t.model.mtp.heads: blk.register_forward_hook(lambda *a: calls.append(1))
    assert t.evaluate() == got and calls == []  # the MTP heads' losses are not reported: they are not computed


def test_validation_leaves_out_a_ranks_repeated_turn(tmp_path):
    "With more ranks than groups left, a rank's last turn repeats a group only to keep FSDP's gathers in step: it is not counted."
    t = make(tmp_path / "run", max_steps=4, eval_batches=3)  # one process: its share is not all-reduced
    t.val_loader.world_size = 2  # as rank 0 of 2: groups 0 and 2; rank 1: group 1, then group 0 again, not counted
    B = t.val_loader.micro_batch_size
    t.model.eval()
    loss = [main_loss(t, t.val_loader._batch(torch.arange(g * B, (g + 1) * B).numpy())) for g in range(3)]
    assert t.evaluate() == pytest.approx((loss[0] + loss[2]) / 2, rel=1e-6)
    t.val_loader.rank = 1
    assert t.val_loader.eval_plan(3) == [(1, True), (0, False)]
    assert loss[0] != pytest.approx(loss[1], rel=1e-5) and t.evaluate() == pytest.approx(loss[1], rel=1e-6)


def test_a_cpu_run_whose_steps_take_hours_says_so_before_it_starts(tmp_path, monkeypatch, capsys):
    "hymo_750m on a CPU is hours a step and ~15 GB: one warning line first. hymo_tiny's steps are quick: none."
    import hymo.training.trainer as tr
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run, on a machine with a GPU too
    cfg = load_config("hymo_tiny", **{**FAST, "max_steps": 1, "warmup_steps": 0})
    tr.Trainer(cfg.model, cfg.train, run_dir=tmp_path / "a").fit()
    assert "meant for GPUs" not in capsys.readouterr().out
    monkeypatch.setattr(tr, "CPU_FLOPS", 1e3)  # as slow as hymo_750m's steps would be
    t = tr.Trainer(cfg.model, cfg.train, run_dir=tmp_path / "b")
    t.fit()
    out = capsys.readouterr().out
    assert "warning: a step of this run is" in out and "meant for GPUs" in out and out.index("warning") < out.index("step 1/1")
    P = t.model.num_params() / 1e9  # 4 + 4 bytes of weight and gradient each; 4 more for NorMuon's momentum, 8 for AdamW's
    gb = float(re.search(r"optimiser states take some ([\d.e+-]+) GB", out)[1])
    assert 12 * P < gb < 15 * P  # most of the weights are NorMuon's


def test_a_small_validation_split_still_reports_on_many_ranks(tmp_path):
    "The trainer's validation loader needs one micro-batch of windows, not one optimiser step's on every rank (eval_plan shares them)."
    import dataclasses
    t = make(tmp_path / "run", max_steps=4, warmup_steps=1)
    n = t.val_loader.n_windows
    t.cfg = dataclasses.replace(t.cfg, micro_batch_size=n // 2, global_batch_size=4 * (n // 2))
    t.d, t.accum = dataclasses.replace(t.d, world_size=4), 1  # as rank 0 of 4: a training step reads 2n windows, validation has n
    t.setup_data()
    assert t.val_loader is not None and [c for _, c in t.val_loader.eval_plan()] == [True]


def test_resuming_a_run_whose_old_schedule_is_no_longer_valid_says_nothing_of_a_jump():
    "A checkpoint's config from before decay_fraction > 0 meant at least one decay step may not make a valid schedule now."
    from hymo.training.trainer import resume_changes
    old = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "warmup_steps": 3, "decay_fraction": 0.1})
    saved = old.to_dict()
    saved["train"].update(max_steps=3, decay_fraction=0.1, warmup_steps=3)  # round(0.3) = 0 decay steps then, 1 now
    notes = resume_changes(json.loads(json.dumps(saved)), old.model, old.train, step=3)
    assert notes and not any("jumps" in n for n in notes)


def test_a_setting_newer_than_the_checkpoint_is_its_default_there(tmp_path):
    "A checkpoint from before moe_route_scale existed trained as its default 1.0 does: no 'settings differ' note, the same run."
    from hymo.training.trainer import _how_it_trains, resume_changes
    now = load_config("hymo_tiny", **FAST)
    saved = json.loads(json.dumps(now.to_dict()))
    del saved["model"]["moe_route_scale"]
    assert resume_changes(saved, now.model, now.train, step=3) == []
    assert _how_it_trains(saved) == _how_it_trains(json.loads(json.dumps(now.to_dict())))
    scaled = load_config("hymo_tiny", **FAST, moe_route_scale=2.5)
    assert resume_changes(saved, scaled.model, scaled.train, step=3) == ["model settings differ from the checkpoint's: moe_route_scale: 1.0 -> 2.5"]


def test_a_resume_with_another_validation_size_says_so_and_how_to_keep_it():
    "Validation reads eval_batches × micro_batch_size windows: a smaller micro-batch at a resume shrinks it unless told."
    from hymo.training.trainer import resume_changes
    old = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "eval_batches": 10})
    saved = json.loads(json.dumps(old.to_dict()))
    half = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "eval_batches": 10, "micro_batch_size": 2})
    notes = resume_changes(saved, half.model, half.train, step=3)
    assert any("validation reads up to 20 windows (eval_batches × micro_batch_size), not 40" in n and "eval_batches=20" in n for n in notes)
    kept = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "eval_batches": 20, "micro_batch_size": 2})
    assert not any("validation reads" in n for n in resume_changes(saved, kept.model, kept.train, step=3))


def test_kill_and_resume_equals_straight_run(tmp_path):
    straight = make(tmp_path / "straight", max_steps=20, ckpt_every=10).fit()
    first = make(tmp_path / "resumed", max_steps=20, ckpt_every=10)
    part1 = first.fit(num_steps=10)  # "killed" right after the checkpoint at step 10
    del first
    second = make(tmp_path / "resumed", max_steps=20, ckpt_every=10)
    assert second.step == 10
    part2 = second.fit()
    assert losses(part1 + part2) == losses(straight)  # bit-identical on CPU
    assert [m["grad_norm"] for m in part1 + part2] == [m["grad_norm"] for m in straight]
    assert [(h["step"], h["loss"]) for h in second.history] == [(m["step"], m["loss"]) for m in straight]  # loss.png's record too


def test_resume_takes_the_new_optimiser_settings_and_keeps_the_moments(tmp_path):
    first = make(tmp_path / "run", max_steps=20, ckpt_every=4, muon_lr=0.03, adamw_lr=0.006, weight_decay=0.1)
    first.fit(num_steps=4)
    saved = [{k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items() if torch.is_tensor(v)}
             for opt in first.optimizers]
    second = make(tmp_path / "run", max_steps=20, ckpt_every=4, muon_lr=0.001, adamw_lr=1e-4, weight_decay=0.0,
                  adamw_betas=(0.8, 0.9))
    assert second.step == 4 and any("muon_lr: 0.03 -> 0.001" in w for w in second.resume_warnings)
    assert {g["peak_lr"] for opt in second.optimizers for g in opt.param_groups} == {0.001, 1e-4}  # saved: 0.03, 0.006
    assert {g["weight_decay"] for opt in second.optimizers for g in opt.param_groups} == {0.0}
    assert {tuple(g["betas"]) for opt in second.optimizers for g in opt.param_groups if "betas" in g} == {(0.8, 0.9)}
    for opt, before in zip(second.optimizers, saved):  # ... while the moments come from the checkpoint
        now = opt.state[opt.param_groups[0]["params"][0]]
        assert before and all(torch.equal(now[k], v) for k, v in before.items() if v.numel() > 1)
    m = second.fit(num_steps=1)[0]
    assert second.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001 * m["lr_mult"])


def test_resume_with_a_smaller_micro_batch_reads_the_same_windows(tmp_path):
    """Halving micro_batch_size (doubling the accumulation) at a resume, as after running out of memory, used to be
    refused ("cannot resume the data order"); the global batch is the same, so the next step reads the same windows."""
    dropless = dict(moe_capacity_factor=None)  # the capacity is per micro-batch: another split would drop other tokens
    straight = make(tmp_path / "a", max_steps=6, micro_batch_size=4, global_batch_size=8, ckpt_every=2, **dropless)
    straight.fit(2)
    loader = straight.train_loader
    want = sorted(int(k) for p in range(loader.step, loader.step + straight.accum) for k in loader.window_ids(p))
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the straight run goes on there: a folder trains one Trainer at a time
    halved = make(tmp_path / "a", max_steps=6, micro_batch_size=2, global_batch_size=8, **dropless)
    assert halved.step == 2 and halved.accum == 4
    assert any("micro-batches of 4, now 4 of 2" in w for w in halved.resume_warnings), halved.resume_warnings
    loader = halved.train_loader
    got = sorted(int(k) for p in range(loader.step, loader.step + halved.accum) for k in loader.window_ids(p))
    assert got == want
    m = halved.fit(1)[0]
    straight = make(tmp_path / "b", max_steps=6, micro_batch_size=4, global_batch_size=8, **dropless)
    assert abs(m["loss"] - straight.fit(1)[0]["loss"]) < 1e-4


def test_a_resplit_after_a_change_of_global_batch_continues_after_every_window_read(tmp_path):
    """2 steps of 8 windows, then 2 of 4: 24 windows read. Resuming with micro-batches of 2 continues at micro-step 12;
    the step count times the last global batch (16 windows) would read 8 windows again."""
    make(tmp_path / "a", max_steps=8, micro_batch_size=4, global_batch_size=8, ckpt_every=2).fit(2)
    make(tmp_path / "a", max_steps=8, micro_batch_size=4, global_batch_size=4, ckpt_every=2).fit(2)
    t = make(tmp_path / "a", max_steps=8, micro_batch_size=2, global_batch_size=4)
    assert (t.step, t.train_loader.step) == (4, 24 // 2)


def test_a_finished_run_whose_checkpoints_are_gone_is_not_trained_over(tmp_path):
    """checkpoints/ deleted to free space after a run finished: the same folder used to train again from step 0 and
    replace model.safetensors and summary.json. Refused, with the two ways on."""
    import shutil
    from hymo.config import ConfigError
    make(tmp_path / "run", max_steps=2, warmup_steps=1).fit()
    weights = (tmp_path / "run" / "model.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    for resume in (True, False):
        with pytest.raises(ConfigError, match="holds a finished run's model.safetensors and summary.json but no checkpoint"):
            make(tmp_path / "run", max_steps=4, warmup_steps=1, resume=resume)
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == weights


def test_a_checkpoint_past_max_steps_is_refused_not_exported_as_final(tmp_path):
    """Lowering max_steps below the checkpoint's step used to only warn, then export the undecayed model as final; down
    to exactly the checkpoint's step (of a longer run) it exported it silently. A finished run's checkpoint re-exports."""
    from hymo.config import ConfigError
    make(tmp_path / "run", max_steps=8, ckpt_every=4, warmup_steps=1).fit(4)
    for shorter in (3, 4):
        with pytest.raises(ConfigError, match=rf"at step 4 of a run planned for 8: with max_steps={shorter} there is nothing "
                                              r"to train, and its weights never had their decay\. Give max_steps=5"):
            make(tmp_path / "run", max_steps=shorter, warmup_steps=1)
    assert not (tmp_path / "run" / "model.safetensors").exists()
    t = make(tmp_path / "run", max_steps=5, warmup_steps=1)  # the advice: one step more, which decays
    t.fit()
    assert t.step == 5 and (tmp_path / "run" / "model.safetensors").exists()
    make(tmp_path / "run", max_steps=5, warmup_steps=1).fit()  # the finished run's own checkpoint: accepted


def test_a_resume_refuses_another_dataset_or_data_order_on_any_number_of_ranks(tmp_path):
    """The dataset's fingerprint is in meta.json, so a re-prepared data_dir is refused with a message that says so, also
    when rank0.pt cannot be used (another number of ranks); so are a changed seq_len or seed."""
    from hymo.training.data import DataError, prepare
    src = tmp_path / "a.txt"
    src.write_text("".join(f"Speech {i}: to be or not to be, that is the question.\n\n" for i in range(400)))
    data = prepare(src, tmp_path / "data", vocab_size=300, progress=False)
    over = dict(max_steps=4, ckpt_every=2, warmup_steps=1, vocab_size=300, data_dir=str(data))
    make(tmp_path / "run", **over).fit(2)
    with pytest.raises(DataError, match="cannot continue its data order with seq_len 32 -> 16"):
        make(tmp_path / "run", **over, seq_len=16)
    with pytest.raises(DataError, match="seed 0 -> 1"): make(tmp_path / "run", **over, seed=1)
    # the same texts and options encoded by another tokenizer (another tokenizers version may learn other merges): the
    # fingerprint names a trained tokenizer only by its inputs, so the tokenizer's own sha256 is compared too
    meta = tmp_path / "run" / "checkpoints" / "step_000002" / "meta.json"
    saved = json.loads(meta.read_text())
    assert saved["data_tokenizer_sha256"] == json.loads((data / "manifest.json").read_text())["tokenizer_sha256"]
    edit_meta(meta, data_tokenizer_sha256="0" * 64)
    with pytest.raises(DataError, match="prepared from the same texts .* encoded by another tokenizer"):
        make(tmp_path / "run", **over)
    meta.write_text(json.dumps(saved))
    src.write_text(src.read_text().replace("question", "answer"))
    prepare(src, data, vocab_size=300, overwrite=True, progress=False)
    meta = tmp_path / "run" / "checkpoints" / "step_000002" / "meta.json"  # as if written by 2 ranks: rank0.pt unused
    edit_meta(meta, world_size=2)
    with pytest.raises(DataError, match="is not the one .*step_000002 trained on .*prepared again") as e:
        make(tmp_path / "run", **over)
    assert "It trained with" not in str(e.value)  # the same data_dir: nothing more to say
    with pytest.raises(DataError, match=f"It trained with data_dir={data}: give that to resume it"):
        make(tmp_path / "run", **{**over, "data_dir": str(prepare(src, tmp_path / "other", vocab_size=300, progress=False))})
    make(tmp_path / "bundled", max_steps=4, ckpt_every=2, warmup_steps=1).fit(2)  # the bundled corpus, then other data
    with pytest.raises(DataError, match="It trained with the bundled corpus: leave out data_dir= to resume it"):
        make(tmp_path / "bundled", max_steps=4, ckpt_every=2, warmup_steps=1, data_dir=str(tmp_path / "other"))


def test_a_damaged_checkpoint_metadata_is_one_warning_line_without_dcps_tracebacks(tmp_path, capfd):
    make(tmp_path / "run", max_steps=6, ckpt_every=2, warmup_steps=1).fit(4)
    meta = tmp_path / "run" / "checkpoints" / "step_000004" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])  # cut short
    capfd.readouterr()
    t = make(tmp_path / "run", max_steps=6, warmup_steps=1)
    err = "".join(capfd.readouterr())
    assert t.step == 2 and "Traceback" not in err and "metadata is not found" not in err, err


@pytest.mark.parametrize("fault", ["rank file", "shard", "disk"])
def test_a_checkpoint_that_cannot_be_read_for_now_is_not_set_aside_as_damaged(tmp_path, monkeypatch, fault):
    """A permission error, a failing mount or too many open files says nothing of a checkpoint's contents: the run
    stops with one line and the checkpoint stays. Before, it was renamed damaged-... for good and the run went back a
    checkpoint. DCP wraps the shard's error (in a CheckpointException); the rank's own file raises it as it is."""
    import errno
    import torch.distributed.checkpoint as dcp
    from hymo.config import ConfigError
    make(tmp_path / "run", max_steps=8, ckpt_every=2, warmup_steps=1).fit(4)
    ckpts = tmp_path / "run" / "checkpoints"
    real_load, real_dcp = torch.load, dcp.load
    def no_access(f, *a, **k):
        if str(f).endswith("step_000004/rank0.pt"):
            if fault == "disk": raise OSError(errno.EIO, "Input/output error", str(f))
            raise PermissionError(errno.EACCES, "Permission denied", str(f))
        return real_load(f, *a, **k)
    def open_files(state, checkpoint_id, **k):  # as DCP reports a reader's error: wrapped
        if checkpoint_id.endswith("step_000004"):
            from torch.distributed.checkpoint.api import CheckpointException
            raise CheckpointException("load", {0: (OSError(errno.EMFILE, "Too many open files"), None)})
        return real_dcp(state, checkpoint_id=checkpoint_id, **k)
    if fault == "shard": monkeypatch.setattr(dcp, "load", open_files)
    else: monkeypatch.setattr(torch, "load", no_access)
    reason = {"rank file": "Permission denied.*permissions", "shard": "Too many open files.*too many open files",
              "disk": "Input/output error.*the disk or its mount may be failing"}[fault]
    with pytest.raises(ConfigError, match=f"step_000004 cannot be read now .*{reason}.*set it aside: "
                                          f"mv {ckpts / 'step_000004'} {ckpts / 'damaged-step_000004'}$"):
        make(tmp_path / "run", max_steps=8, warmup_steps=1)
    assert [p.name for p in sorted(ckpts.iterdir())] == ["step_000002", "step_000004"]
    monkeypatch.undo()  # the fault passes: the run resumes where it was
    assert make(tmp_path / "run", max_steps=8, warmup_steps=1).step == 4


def test_a_checkpoint_one_rank_cannot_read_for_now_stops_every_rank_with_one_line(tmp_path):
    "rank 1 meets a permission error on its own file: both ranks stop (none waits in a collective), the checkpoint stays."
    args = [*TWO_RANK_RUN, "run_dir=two", "max_steps=4"]
    assert torchrun("-m", "hymo.train", *args, cwd=tmp_path, timeout=300).returncode == 0
    script = tmp_path / "rank1_no_access.py"
    script.write_text(
        "import errno, os, sys, torch\nfrom hymo.train import main\n"
        "if os.environ['RANK'] == '1':\n"
        "    real = torch.load\n"
        "    def no_access(f, *a, **k):\n"
        "        if str(f).endswith('rank1.pt'): raise PermissionError(errno.EACCES, 'Permission denied', str(f))\n"
        "        return real(f, *a, **k)\n"
        "    torch.load = no_access\n"
        "main(sys.argv[1:])\n")
    r = torchrun(str(script), *args[:-1], "max_steps=6", cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "hymo/training/trainer.py" not in out and "distributed_c10d" not in out, out[-3000:]
    assert "step_000004 cannot be read now" in out and "Permission denied (on another rank)" in out, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


def test_a_trainer_whose_run_folder_a_newer_trainer_took_over_is_refused(tmp_path):
    """Two Trainers of one folder in one process (a notebook's cell run twice): the lock is this process's, so both
    could train, and the older would write over the newer's checkpoints and metrics. Only the one made last trains."""
    from hymo.config import ConfigError
    t1 = make(tmp_path / "run", max_steps=8, ckpt_every=2, warmup_steps=1)
    t1.fit(2)
    t2 = make(tmp_path / "run", max_steps=8, ckpt_every=2, warmup_steps=1)  # resumes at step 2
    with pytest.raises(ConfigError, match=r"a newer Trainer in this process took over .*at step 2"): t1.fit(2)
    t2.fit(4)
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    # a rewind: t4 goes back to step 4 and sets step 6 aside; t3, at step 6, is the stale one now
    t3 = make(tmp_path / "run", max_steps=8, ckpt_every=2, warmup_steps=1)
    t4 = make(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoints" / "step_000004"), max_steps=8, ckpt_every=2,
              warmup_steps=1)
    with pytest.raises(ConfigError, match="a newer Trainer"): t3.fit(2)
    assert t4.step == 4 and len(t4.fit(2)) == 2
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000004", "step_000006", "superseded-step_000006"]


def flip_a_byte(path: Path):
    "Damage that keeps a file's size and every file in place: one bit of its middle byte flipped."
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_checkpoint_records_the_size_and_crc_of_every_file_it_holds(tmp_path):
    import zlib
    make(tmp_path / "run", max_steps=4, ckpt_every=2, warmup_steps=1).fit(2)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    files = json.loads((ckpt / "meta.json").read_text())["files"]
    assert sorted(files) == sorted(p.name for p in ckpt.iterdir() if p.name != "meta.json")
    assert {".metadata", "rank0.pt", "__0_0.distcp"} <= set(files)
    for name, saved in files.items():
        data = (ckpt / name).read_bytes()
        assert saved == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


@pytest.mark.parametrize("name", ["__0_0.distcp", "rank0.pt", ".metadata"])
def test_a_checkpoint_whose_bytes_changed_since_the_save_is_damaged_not_loaded(tmp_path, name):
    """DCP loads a shard with a flipped bit into other weights without a word (and a rank file can unpickle so too):
    the CRC-32 the save recorded finds it, a given --resume says so, and a plain resume sets it aside for the one before."""
    make(tmp_path / "run", max_steps=6, ckpt_every=2, warmup_steps=1).fit(4)
    ckpts = tmp_path / "run" / "checkpoints"
    flip_a_byte(ckpts / "step_000004" / name)
    with pytest.raises(ConfigError, match=f"{re.escape(name)} has changed since it was saved"):
        make(tmp_path / "run", max_steps=6, warmup_steps=1, resume=str(ckpts / "step_000004"))
    t = make(tmp_path / "run", max_steps=6, warmup_steps=1)
    assert t.step == 2 and (ckpts / "damaged-step_000004").exists()


def test_a_checkpoint_file_of_another_size_or_missing_is_named(tmp_path):
    make(tmp_path / "run", max_steps=6, ckpt_every=2, warmup_steps=1).fit(4)
    ckpts = tmp_path / "run" / "checkpoints"
    shard = ckpts / "step_000004" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "ab") as f: f.write(b"\0")
    with pytest.raises(ConfigError, match=f"holds {size + 1} bytes, not the {size} it was saved with"):
        make(tmp_path / "run", max_steps=6, warmup_steps=1, resume=str(ckpts / "step_000004"))
    shard.unlink()
    with pytest.raises(ConfigError, match="__0_0.distcp is missing"):
        make(tmp_path / "run", max_steps=6, warmup_steps=1, resume=str(ckpts / "step_000004"))


def without_file_sums(ckpt: Path, **meta):
    "Make `ckpt` a checkpoint of a HyMo from before the saves recorded each file's size and CRC-32 (and set `meta`)."
    path = ckpt / "meta.json"
    old = json.loads(path.read_text())
    del old["files"], old["meta_crc32"]  # (meta.json's own sum came later still)
    path.write_text(json.dumps({**old, **meta}))


def test_a_checkpoint_saved_without_the_file_sums_still_loads(tmp_path):
    """Checkpoints written before HyMo recorded each file's CRC-32 have no 'files' in meta.json: they load unchecked."""
    make(tmp_path / "run", max_steps=6, ckpt_every=2, warmup_steps=1).fit(4)
    without_file_sums(tmp_path / "run" / "checkpoints" / "step_000004")
    assert make(tmp_path / "run", max_steps=6, warmup_steps=1).step == 4


def test_checkpoint_names_other_than_step_digits_are_left_alone(tmp_path):
    """A backup copy step_000002.bak used to crash every resume (int('000002.bak')); a checkpoint missing its meta.json
    was skipped silently and later overwritten instead of being kept as damaged."""
    import shutil
    from hymo.training.trainer import list_checkpoints
    make(tmp_path / "run", max_steps=8, ckpt_every=2, warmup_steps=1).fit(4)
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(ckpts / "step_000004", ckpts / "step_000004.bak")
    (ckpts / "step_4").mkdir()
    # .tmp names `save` never writes: a complete copy (its name crashed the start, int('best')) and a folder of files
    # (deleted as a cut-short checkpoint)
    shutil.copytree(ckpts / "step_000004", ckpts / "step_best.tmp")
    (ckpts / "step_000010-mine.tmp").mkdir(); (ckpts / "step_000010-mine.tmp" / "notes.txt").write_text("mine")
    (ckpts / "step_000009.tmp").mkdir()  # a cut-short write of `save`'s own name: removed
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_000002", "step_000004"]
    (ckpts / "step_000004" / "meta.json").unlink()
    t = make(tmp_path / "run", max_steps=8, warmup_steps=1)
    assert t.step == 2 and (ckpts / "damaged-step_000004").exists() and (ckpts / "step_000004.bak").exists()
    assert not (ckpts / "step_000009.tmp").exists()
    t.fit()
    assert (ckpts / "step_000004.bak").exists() and (ckpts / "step_4").exists()
    assert (ckpts / "step_best.tmp" / "meta.json").exists() and (ckpts / "step_000010-mine.tmp" / "notes.txt").exists()


def test_a_finished_run_is_not_finished_again(tmp_path):
    """Resuming a finished run (same max_steps, another learning rate) trains nothing and rewrites nothing: the final
    checkpoint's meta.json keeps the config the run trained with, as config.yaml does; raising max_steps trains on."""
    make(tmp_path / "run", max_steps=4).fit()
    meta = tmp_path / "run" / "checkpoints" / "step_000004" / "meta.json"
    before = meta.read_bytes()
    again = make(tmp_path / "run", max_steps=4, muon_lr=0.001)
    assert again.step == 4 and again.fit() == [] and meta.read_bytes() == before
    assert again.summary == json.loads((tmp_path / "run" / "summary.json").read_text()) and again.summary["step"] == 4
    assert [m["step"] for m in make(tmp_path / "run", max_steps=6).fit()] == [5, 6]


def test_a_finished_run_trained_further_keeps_its_final_model(tmp_path):
    """Raising max_steps of a finished run: its model.safetensors, config.yaml, summary.json and tokenizer are copied to
    finished-step_000004/ at the first new step, once (generate loads them there); before, pruning and the new finish lost them."""
    from safetensors.torch import load_file
    from hymo.generate import load_run
    run = tmp_path / "run"
    make(run, max_steps=4, ckpt_every=1, keep_last_k=1).fit()
    want = {n: (run / n).read_bytes() for n in ("model.safetensors", "config.yaml", "summary.json", "tokenizer.json")}
    t = make(run, max_steps=6, ckpt_every=1, keep_last_k=1)
    assert [m["step"] for m in t.fit(1)] == [5]
    kept = run / "finished-step_000004"
    assert {n: (kept / n).read_bytes() for n in want} == want  # the run's own stay until the new finish (config.yaml: the new one's)
    assert all((run / n).read_bytes() == want[n] for n in ("model.safetensors", "summary.json", "tokenizer.json"))
    assert sorted(c.name for c in (run / "checkpoints").iterdir()) == [  # step 4's pruned: its weights are in kept
        "before-decay-step_000003", "step_000005"]                      # (3 trained no decayed step: kept from before it)
    model, _ = load_run(kept)
    saved = load_file(str(kept / "model.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    t.fit()  # a second fit call: its first step does not copy again
    assert [p.name for p in run.iterdir() if p.name.startswith("finished")] == ["finished-step_000004"]
    assert json.loads((run / "summary.json").read_text())["step"] == 6 and (kept / "model.safetensors").read_bytes() == want["model.safetensors"]
    assert "max_steps: 4" in (kept / "config.yaml").read_text() and "max_steps: 6" in (run / "config.yaml").read_text()


def test_a_rewind_that_trains_no_step_keeps_the_later_final_model(tmp_path):
    """--resume step_000004 (planned for 4) of a run that went on to finish at 6: no step is trained, and the finish
    would have replaced the step-6 model and summary (and kept steps 5 and 6 in metrics.jsonl)."""
    run = tmp_path / "run"
    make(run, max_steps=4, ckpt_every=1, keep_last_k=10).fit()
    make(run, max_steps=6, ckpt_every=1, keep_last_k=10).fit()
    six = (run / "model.safetensors").read_bytes()
    make(run, resume=run / "checkpoints" / "step_000004", max_steps=4, ckpt_every=1, keep_last_k=10).fit()
    assert (run / "finished-step_000006" / "model.safetensors").read_bytes() == six
    assert json.loads((run / "summary.json").read_text())["step"] == 4
    assert max(m["step"] for m in read_jsonl(run / "metrics.jsonl")) == 4


def test_a_finished_run_whose_model_is_gone_writes_it_again(tmp_path):
    "summary.json but no model.safetensors (deleted to save space, say): the same command exports it again, not 'finished'."
    from safetensors.torch import load_file
    run = tmp_path / "run"
    make(run, max_steps=4).fit()
    want = load_file(str(run / "model.safetensors"))
    (run / "model.safetensors").unlink(); (run / "tokenizer.json").unlink()
    t = make(run, max_steps=4)
    assert t.fit() == [] and t.step == 4
    got = load_file(str(run / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want) and (run / "tokenizer.json").exists()
    assert [p.name for p in run.iterdir() if p.name.startswith("finished")] == []  # nothing trained: nothing set aside


def test_a_meta_json_changed_since_the_save_is_damage_not_a_step_skipped(tmp_path):
    """One bit of meta.json's step ('"step": 6' to 7) resumed at step 7, a step never trained: its own CRC-32 refuses it,
    and the checkpoint before is resumed, as for any damaged file. One without the sum (older) is held to its folder's name."""
    straight = losses(make(tmp_path / "straight", max_steps=9, ckpt_every=3, keep_last_k=2).fit())
    make(tmp_path / "run", max_steps=9, ckpt_every=3, keep_last_k=2).fit(num_steps=6)
    for old in (False, True):
        run = tmp_path / f"copy{old}"
        shutil.copytree(tmp_path / "run", run, ignore=shutil.ignore_patterns(".lock"))
        meta = run / "checkpoints" / "step_000006" / "meta.json"
        text = meta.read_text().replace('"step": 6,', '"step": 7,', 1)
        if old: d = json.loads(text); del d["meta_crc32"]; text = json.dumps(d)
        meta.write_text(text)
        t = make(run, max_steps=9, ckpt_every=3, keep_last_k=2)
        assert t.step == 3 and (run / "checkpoints" / "damaged-step_000006").is_dir()
        assert losses(t.fit()) == straight[3:]


def finished_run(tmp_path, **over) -> Path:
    "A run of 4 steps, finished (checkpoints at 2 and 4)."
    make(tmp_path / "run", max_steps=4, ckpt_every=2, keep_last_k=1, **over).fit()
    return tmp_path / "run"


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.yaml"])
def test_a_finished_run_whose_final_file_is_damaged_writes_it_again_and_keeps_the_damaged_one(tmp_path, name):
    """A flipped bit in model.safetensors (or another tokenizer.json, or a config.yaml that cannot be read) said 'finished'
    and left generate to refuse it: now the final files are written again from the final checkpoint, the damaged one set aside."""
    from hymo.generate import load_run
    run = finished_run(tmp_path)
    want = {n: (run / n).read_bytes() for n in ("model.safetensors", "tokenizer.json", "config.yaml")}
    if name == "config.yaml": (run / name).write_text("model: [")
    elif name == "tokenizer.json": (run / name).write_text(want[name].decode().replace('"<|endoftext|>"', '"<|end|>"', 1))
    else: flip_a_byte(run / name)
    damaged = (run / name).read_bytes()
    assert damaged != want[name]
    t = make(run, max_steps=4, ckpt_every=2, keep_last_k=1)
    assert t.fit() == [] and t.step == 4
    assert {n: (run / n).read_bytes() for n in want} == want and (run / f"{name}.damaged").read_bytes() == damaged
    load_run(run)


def test_a_finish_written_again_keeps_config_yaml_edits_and_the_data_it_resumed(tmp_path):
    """A model written again rewrote config.yaml too: an edit it allows (the GDN kernel, a train setting) was lost; and
    it recorded the final checkpoint's data_dir, gone once the data moved (the resume had found it moved)."""
    from hymo.training.data import prepare_default
    d1 = tmp_path / "D1"
    shutil.copytree(prepare_default(progress=False), d1)
    run = finished_run(tmp_path, data_dir=str(d1))
    edited = (run / "config.yaml").read_text().replace("gdn_kernel: auto", "gdn_kernel: naive").replace("sample_tokens: 8", "sample_tokens: 9")
    (run / "config.yaml").write_text(edited)
    (run / "model.safetensors").unlink()
    make(run, max_steps=4, ckpt_every=2, keep_last_k=1, data_dir=str(d1)).fit()
    assert (run / "config.yaml").read_text() == edited and (run / "model.safetensors").exists()
    d1.rename(d2 := tmp_path / "D2")
    (run / "config.yaml").unlink(); (run / "model.safetensors").unlink()
    make(run, max_steps=4, ckpt_every=2, keep_last_k=1, data_dir=str(d2)).fit()
    assert load_config(str(run / "config.yaml")).train.data_dir == str(d2)


def test_a_finished_run_whose_config_yaml_was_edited_to_train_on_keeps_a_copy_that_loads(tmp_path):
    """config.yaml edited (moe_top_k: 3) to train on from an earlier checkpoint: its finished-step_ copy held the edited
    file beside the weights trained with 2, which generate (rightly) refused, with no copy left to put back."""
    from hymo.generate import load_run
    run = tmp_path / "run"
    make(run, max_steps=4, ckpt_every=2, keep_last_k=2).fit()
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("moe_top_k: 2", "moe_top_k: 3"))
    assert make(run, max_steps=4, ckpt_every=2, keep_last_k=2).fit() == []  # the user's to edit: not damage, nothing redone
    assert "moe_top_k: 3" in cfg.read_text() and not (run / "config.yaml.damaged").exists()
    make(run, resume=run / "checkpoints" / "step_000002", max_steps=4, ckpt_every=2, keep_last_k=2, moe_top_k=3).fit()
    model, _ = load_run(run / "finished-step_000004")
    assert {m.top_k for m in model.modules() if hasattr(m, "gate_bias")} == {2}


def test_a_finished_model_rank_0_cannot_read_stops_every_rank_with_one_line(tmp_path):
    "The check of a finished run's files ran on rank 0 alone: its EACCES left rank 1 in the next collective."
    args = [*TWO_RANK_RUN, "run_dir=two", "max_steps=2"]
    r = torchrun("-m", "hymo.train", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    script = tmp_path / "rank0_eacces.py"
    script.write_text(
        "import errno, os, sys\nfrom pathlib import Path\nfrom hymo.training import trainer\nfrom hymo.train import main\n"
        "if os.environ['RANK'] == '0':\n"
        "    real = trainer.file_crc\n"
        "    def crc(p):\n"
        "        if Path(p).name == 'model.safetensors': raise PermissionError(errno.EACCES, 'Permission denied', str(p))\n"
        "        return real(p)\n"
        "    trainer.file_crc = crc\n"
        "sys.exit(main(sys.argv[1:]))\n")
    r = torchrun(str(script), *args, cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Permission denied (on another rank)" in out, out[-3000:]
    assert "hymo/training/trainer.py" not in out and out.count("error: ") == 2, out[-3000:]  # one line a rank, no traceback of ours


def test_a_full_disk_while_a_finish_writes_tokenizer_json_keeps_the_old_one(tmp_path, monkeypatch):
    "It was written in place: cut short by a full disk, under a summary.json that still matched ('finished')."
    import errno
    from hymo.training import trainer as tr
    run = finished_run(tmp_path)
    want = (run / "tokenizer.json").read_bytes()
    (run / "model.safetensors").unlink()
    real = open
    def full(path, mode="r", *a, **k):
        f = real(path, mode, *a, **k)
        if Path(path).name.startswith("tokenizer.json") and "w" in mode:
            f.write("{"); f.close(); raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return f
    monkeypatch.setattr(tr, "open", full, raising=False)
    with pytest.raises(OSError, match="No space left"): make(run, max_steps=4, ckpt_every=2, keep_last_k=1).fit()
    monkeypatch.undo()
    assert (run / "tokenizer.json").read_bytes() == want


@pytest.mark.parametrize("damage", ["model", "summary", "no summary"])
def test_a_finished_run_trained_further_keeps_its_final_model_whatever_was_damaged(tmp_path, damage):
    """A damaged model.safetensors was copied as the kept final model while the final checkpoint, its one good copy, was
    pruned; a damaged or missing summary.json kept nothing, and the new finish wrote over the model."""
    from safetensors.torch import load_file
    run = finished_run(tmp_path)
    want = {k: v.clone() for k, v in load_file(str(run / "model.safetensors")).items()}  # (mapped: the flip below changes them)
    if damage == "model": flip_a_byte(run / "model.safetensors")
    elif damage == "summary": (run / "summary.json").write_text((run / "summary.json").read_text()[:30])
    else: (run / "summary.json").unlink()
    make(run, max_steps=6, ckpt_every=2, keep_last_k=1).fit()
    kept = [p for p in run.iterdir() if p.name.startswith("finished")]
    assert [p.name for p in kept] == ["finished-step_000004" if damage == "model" else "finished"]
    got = load_file(str(kept[0] / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert not (run / "checkpoints" / "step_000004").exists()  # pruned: the kept model is the one copy


def test_resuming_with_another_vocab_size_names_it_not_the_data(tmp_path):
    "A new vocab_size means other data too; the refusal names the changed setting (it blamed the data's fingerprint)."
    make(tmp_path / "run", max_steps=4, ckpt_every=2).fit(2)
    with pytest.raises(ConfigError, match=r"weights of other shapes \(vocab_size: 2048 -> 4096\).*--config RUN_DIR/config.yaml"):
        make(tmp_path / "run", max_steps=4, ckpt_every=2, vocab_size=4096)


def test_a_checkpoint_folder_given_as_run_dir_names_its_run(tmp_path):
    make(tmp_path / "run", max_steps=4, ckpt_every=2).fit(2)
    for d in (tmp_path / "run" / "checkpoints", tmp_path / "run" / "checkpoints" / "step_000002"):
        with pytest.raises(ConfigError, match=f"of the run in {tmp_path / 'run'}: give run_dir={tmp_path / 'run'} to continue"):
            make(d, max_steps=4)


def test_resume_given_a_folder_of_checkpoints_names_one_of_them(tmp_path):
    make(tmp_path / "run", max_steps=4, ckpt_every=2).fit(2)
    newest = tmp_path / "run" / "checkpoints" / "step_000002"
    for given, what in ((tmp_path / "run", "a run"), (tmp_path / "run" / "checkpoints", "the checkpoints")):
        with pytest.raises(ConfigError, match=f"{given} is {what} folder, not a checkpoint: give one of its checkpoints, e.g. {newest}"):
            make(tmp_path / "new", resume=str(given), max_steps=4)
    (tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match="half is not a complete checkpoint .no meta.json.: --resume takes a checkpoint folder"):
        make(tmp_path / "new", resume=str(tmp_path / "half"), max_steps=4)
    (tmp_path / "run" / "finished-step_000004").mkdir()  # (what a run trained further keeps of its final model)
    with pytest.raises(ConfigError, match="finished-step_000004 is a finished run's model, kept when the run was trained further "
                                          r"\(`python -m hymo.generate` reads it\), not a checkpoint: --resume takes"):
        make(tmp_path / "new", resume=str(tmp_path / "run" / "finished-step_000004"), max_steps=4)


def test_the_history_and_loss_curve_show_the_main_loss_beside_validation(tmp_path, monkeypatch):
    "Validation is the main loss alone: the curve (and the history it is drawn from) has the main training loss too."
    import matplotlib.axes
    from hymo.training.trainer import plot_losses
    t = make(tmp_path / "run", max_steps=3)
    metrics = t.fit()
    assert [h["loss/main"] for h in t.history] == [m["loss/main"] for m in metrics] and "val_loss" in t.history[-1]
    labels, plot = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, **k: (labels.append(k.get("label")), plot(self, *a, **k))[1])
    plot_losses([{"step": 0, "loss": 9.0}] + t.history, tmp_path / "loss.png")  # a step saved before the history kept it
    assert labels == ["train (main + MTP)", "train (main)", "validation (main)"] and (tmp_path / "loss.png").stat().st_size > 0


def test_a_checkpoint_is_on_the_disk_before_the_one_it_replaces_is_deleted(tmp_path, monkeypatch):
    """rank0.pt and meta.json are fsynced before the rename, and the folder holding the rename before an older
    checkpoint is deleted: a power cut at any instant leaves one whole checkpoint (before: no fsync at all)."""
    import shutil
    events, fsync, rmtree = [], os.fsync, shutil.rmtree
    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))); fsync(fd)
    def recording_rmtree(path, *a, **k):
        events.append(("rmtree", str(Path(path).resolve()))); rmtree(path, *a, **k)
    t = make(tmp_path / "run", max_steps=4, ckpt_every=1, keep_last_k=1, warmup_steps=1)
    t.fit(1)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(shutil, "rmtree", recording_rmtree)
    t.fit(1)  # step 2's checkpoint replaces step 1's
    root = str((tmp_path / "run" / "checkpoints").resolve())
    synced = [p for e, p in events if e == "fsync"]
    gone = events.index(("rmtree", f"{root}/step_000001"))
    assert f"{root}/step_000002.tmp/rank0.pt" in synced and f"{root}/step_000002.tmp/meta.json" in synced, synced
    assert f"{root}/step_000002.tmp" in synced, synced  # the folder's entries, before its rename
    assert ("fsync", root) in events[:gone], events
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000002"]


def test_a_complete_tmp_checkpoint_is_finished_and_an_incomplete_one_removed(tmp_path, capsys):
    """A .tmp folder with every file, of the step its name says, newer than every checkpoint: only its rename was cut
    short. The next start finishes the rename and resumes from it; before, it resumed from the checkpoint before and
    deleted the .tmp when it saved that step again. One that lacks a rank's file is removed; one whose meta.json names
    another step is left alone."""
    import shutil
    make(tmp_path / "run", max_steps=6, ckpt_every=2, keep_last_k=3, warmup_steps=1).fit(4)
    ckpts = tmp_path / "run" / "checkpoints"
    os.replace(ckpts / "step_000004", ckpts / "step_000004.tmp")  # killed between the last write and the rename
    t = make(tmp_path / "run", max_steps=6, ckpt_every=2, keep_last_k=3, warmup_steps=1)
    assert t.step == 4 and sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000004"]
    shutil.copytree(ckpts / "step_000004", ckpts / "step_000005.tmp")  # complete, but of step 4: not this step's
    from hymo.training.trainer import Trainer
    cfg = load_config("hymo_tiny", **{**FAST, "max_steps": 6, "warmup_steps": 1})
    Trainer(cfg.model, cfg.train, run_dir=tmp_path / "run")
    assert (ckpts / "step_000005.tmp").exists() and "names another step: it is left as it is" in capsys.readouterr().out
    (ckpts / "step_000005.tmp" / "rank0.pt").unlink()
    Trainer(cfg.model, cfg.train, run_dir=tmp_path / "run")
    assert not (ckpts / "step_000005.tmp").exists() and "cut short" in capsys.readouterr().out


def test_a_runs_folder_that_is_a_broken_link_is_an_error_not_an_endless_search(tmp_path, monkeypatch):
    from hymo.training import trainer as tr
    monkeypatch.chdir(tmp_path)
    os.symlink(tmp_path / "nowhere", tmp_path / "runs")
    with pytest.raises(OSError): tr._create_new_run_dir(Path("runs/x"))


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    "Without run_dir=, two runs whose clocks read the same second (a sweep launched at once) take -2, -3, ... folders."
    from hymo.training import trainer as tr
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tr.time, "strftime", lambda fmt, *a: "20261205-120000")
    first, second = make(None), make(None)
    assert (first.run_dir, second.run_dir) == (Path("runs/hymo-20261205-120000"), Path("runs/hymo-20261205-120000-2"))
    assert first.run_dir.is_dir() and second.run_dir.is_dir()
    # the race: another run creates the folder between choosing the name and creating it
    (tmp_path / "runs" / "x").mkdir()
    assert tr._create_new_run_dir(Path("runs/x")) == Path("runs/x-2")
    # ... and has saved a checkpoint there before this run looked: this new run must not continue it
    first.fit(num_steps=2); first.save()
    monkeypatch.setattr(tr, "new_run_dir", lambda name, d: str(first.run_dir))
    third = make(None)
    assert third.step == 0 and third.run_dir == Path("runs/hymo-20261205-120000-3")


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    from hymo.training.trainer import list_checkpoints
    make(tmp_path / "run", max_steps=8, ckpt_every=2, keep_last_k=3).fit()  # step_4, 6, 8
    ckpts = tmp_path / "run" / "checkpoints"
    t = make(tmp_path / "run", resume=ckpts / "step_000004", max_steps=12, ckpt_every=2, keep_last_k=1)
    assert t.step == 4
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000004", "superseded-step_000006", "superseded-step_000008"]
    t.fit(num_steps=2)  # keep_last_k=1: the old run's step 8 would have outranked (and pruned) this one
    assert [p.name for p in list_checkpoints(t.run_dir)] == ["step_000006"]
    assert make(tmp_path / "run", max_steps=12, ckpt_every=2).step == 6  # a plain resume continues the new run
    # the rewinding command again (a requeued job), step_4 since pruned: it continues the new run, sets nothing aside
    again = make(tmp_path / "run", resume=ckpts / "step_000004", max_steps=12, ckpt_every=2, keep_last_k=1)
    assert again.step == 6 and sorted(p.name for p in ckpts.iterdir()) == ["step_000006", "superseded-step_000006",
                                                                          "superseded-step_000008"]
    # a rewind to a checkpoint that still exists, with another setting (a lower learning rate): a new rewind, honoured
    del again
    t = make(tmp_path / "run", max_steps=12, ckpt_every=2, keep_last_k=2)
    t.fit(num_steps=2)  # step_6, step_8, both begun from step_4 (pruned)
    rewind = make(tmp_path / "run", resume=ckpts / "step_000006", max_steps=12, ckpt_every=2, keep_last_k=2)
    rewind.fit(num_steps=2)  # step_8 again, begun from step_6
    same = make(tmp_path / "run", resume=ckpts / "step_000006", max_steps=12, ckpt_every=2, keep_last_k=2)
    assert same.step == 8  # the same command again: a requeue, continues
    lower = make(tmp_path / "run", resume=ckpts / "step_000006", max_steps=12, ckpt_every=2, keep_last_k=2, muon_lr=0.01)
    assert lower.step == 6 and (ckpts / "superseded-step_000008").exists()  # honoured; the newer one kept aside


def test_resuming_a_set_aside_checkpoint_leaves_the_branch_it_ends_and_its_metrics(tmp_path):
    """Run A trains steps 1-6; a rewind to step 2 with another learning rate trains branch B (steps 3-4); then A's
    superseded step 6 is resumed. B's step 4 is not on A's line of steps: left a checkpoint, a damaged newer one would
    fall back onto it, so it is set aside too; and metrics.jsonl holds A's steps again (B's step 4 set aside)."""
    from hymo.training.trainer import list_checkpoints
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    lines = lambda name: [json.loads(l) for l in (run / name).read_text().splitlines()]
    make(run, max_steps=12, ckpt_every=2, keep_last_k=5).fit(num_steps=6)  # (the same schedule throughout: no extension)
    a = {m["step"]: m["loss"] for m in lines("metrics.jsonl")}
    b = make(run, resume=ckpts / "step_000002", max_steps=12, ckpt_every=2, keep_last_k=5, muon_lr=0.005)
    b.fit(num_steps=2)
    b_loss = lines("metrics.jsonl")[-1]["loss"]
    assert lines("metrics.jsonl")[-1]["step"] == 4 and b_loss != a[4]
    assert [p.name for p in list_checkpoints(run)] == ["step_000002", "step_000004"]
    del b
    c = make(run, resume=ckpts / "superseded-step_000006", max_steps=12, ckpt_every=2, keep_last_k=5)
    # B's step 4 set aside; A's steps 4 and 6 renamed back: a crash now, then a plain resume, continues from step 6
    assert c.step == 6 and [p.name for p in list_checkpoints(run)] == ["step_000002", "step_000004", "step_000006"]
    assert json.loads((ckpts / "superseded-step_000004-2" / "meta.json").read_text())["history"][-1]["loss"] == b_loss
    del c
    c = make(run, resume=ckpts / "superseded-step_000006", max_steps=12, ckpt_every=2, keep_last_k=5)  # a requeued job
    assert c.step == 6 and [p.name for p in list_checkpoints(run)] == ["step_000002", "step_000004", "step_000006"]
    c.fit(num_steps=2)
    assert [p.name for p in list_checkpoints(run)] == ["step_000002", "step_000004", "step_000006", "step_000008"]
    got = lines("metrics.jsonl")
    assert [m["step"] for m in got] == list(range(1, 9))
    assert all(m["loss"] == a[m["step"]] for m in got if m["step"] <= 6)  # A's lines, back from the discarded ones
    discarded = lines("metrics.discarded.jsonl")
    assert [m["loss"] for m in discarded if m["step"] == 4] == [b_loss]  # B's, kept
    assert sorted(m["step"] for m in discarded) == [3, 4]  # A's step 3 line (B's, its twin, stayed): no line is lost
    del c  # the same command again, after the new checkpoint: continues it, keeps the ancestor step 2
    d = make(run, resume=ckpts / "superseded-step_000006", max_steps=12, ckpt_every=2, keep_last_k=5)
    assert d.step == 8 and [p.name for p in list_checkpoints(run)] == ["step_000002", "step_000004", "step_000006", "step_000008"]
    assert json.loads((ckpts / "step_000004" / "meta.json").read_text())["history"][-1]["loss"] == a[4]  # A's, not B's


def test_going_back_to_a_finished_line_writes_its_final_model_again(tmp_path):
    """A finished at step 6; a rewind to step 2 (B) finished at step 6 too. Resuming A's step 6 is not 'finished
    already' (summary.json's history sum is B's): B's final files are kept in finished-step_000006/, A's written."""
    from hymo.training.trainer import history_sum, list_checkpoints
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    make(run, max_steps=6, ckpt_every=2, keep_last_k=5).fit()
    a = json.loads((run / "summary.json").read_text())
    make(run, resume=ckpts / "step_000002", max_steps=6, ckpt_every=2, keep_last_k=5, muon_lr=0.005).fit()
    b = json.loads((run / "summary.json").read_text())
    assert b["step"] == 6 and b["history_crc32"] != a["history_crc32"]
    c = make(run, resume=ckpts / "superseded-step_000006", max_steps=6, ckpt_every=2, keep_last_k=5)
    assert history_sum(c.history) == a["history_crc32"]
    c.fit()
    now = json.loads((run / "summary.json").read_text())
    assert now["history_crc32"] == a["history_crc32"] and now["model_file"] == a["model_file"]  # A's model, bit for bit
    kept = [json.loads((d / "summary.json").read_text()) for d in sorted(run.glob("finished-step_000006*"))]
    assert kept == [a, b]  # each line's finish kept when the other's replaced it
    assert [p.name for p in list_checkpoints(run)] == ["step_000002", "step_000004", "step_000006"]  # A's step 4 back too
    assert make(run, max_steps=6, ckpt_every=2, keep_last_k=5).fit() == []  # now finished: nothing to do


def test_a_start_notes_the_set_aside_folders_pruning_keeps(tmp_path, capsys):
    "superseded-, damaged- and finished- folders are never deleted: a run that starts among them says what they hold."
    from hymo.training.trainer import Trainer
    run, over = tmp_path / "run", {**FAST, "max_steps": 6, "ckpt_every": 2, "keep_last_k": 5}
    cfg = load_config("hymo_tiny", **over)
    make(run, **over).fit(num_steps=4)
    Trainer(cfg.model, cfg.train, run_dir=run)  # a plain resume: nothing set aside
    assert "never prunes" not in capsys.readouterr().out
    Trainer(cfg.model, cfg.train, run_dir=run, resume=run / "checkpoints" / "step_000002")
    size = sum(f.stat().st_size for f in (run / "checkpoints" / "superseded-step_000004").rglob("*") if f.is_file())
    assert f"1 folder that keep_last_k never prunes ({size / 1e6:.1f} MB: superseded-step_000004)" in capsys.readouterr().out


def test_a_validation_split_too_small_is_named_at_the_end_too(tmp_path, capsys):
    "A val split smaller than one micro-batch: the start warns, and the end says why there is no validation loss."
    from hymo.config import load_config
    from hymo.training.data import prepare
    from hymo.training.trainer import Trainer
    src = tmp_path / "a.txt"
    src.write_text("".join(f"Speech {i}: to be or not to be, that is the question.\n\n" for i in range(400)))
    data = prepare(src, tmp_path / "data", vocab_size=300, val_fraction=0.005, progress=False)
    cfg = load_config("hymo_tiny", **{**FAST, "max_steps": 1, "warmup_steps": 0, "vocab_size": 300, "data_dir": str(data)})
    t = Trainer(cfg.model, cfg.train, run_dir=tmp_path / "run")
    t.fit()
    out = capsys.readouterr().out
    assert "warning: no validation loss is reported" in out
    assert "no validation loss: the val split has 1 window of seq_len=32, fewer than one micro-batch (micro_batch_size 4)\n" in out, out


@pytest.mark.parametrize("code, fix", [("EROFS", "The file system is read-only: make it writable"), ("ENOSPC", "Free space"),
                                       ("EDQUOT", "Free space (the disk quota is full)"), ("EACCES", "Fix the permissions")])
def test_a_run_folder_that_cannot_be_written_says_what_to_fix(tmp_path, monkeypatch, capsys, code, fix):
    "The one-line error fits the cause (a read-only file system is not fixed by freeing space), then how to resume."
    import errno
    from hymo.train import main
    from hymo.training import trainer as tr
    err = getattr(errno, code)
    def fit(self): raise OSError(err, os.strerror(err), str(self.run_dir / "metrics.jsonl"))
    monkeypatch.setattr(tr.Trainer, "fit", fit)
    with pytest.raises(SystemExit) as e:
        main([f"{k}={v}" for k, v in {**FAST, "max_steps": 4, "run_dir": tmp_path / "run"}.items()])
    out = capsys.readouterr().err
    assert e.value.code == 1 and f"{os.strerror(err)}. {fix} (or give another run_dir=...); no checkpoint was written" in out, out
    monkeypatch.undo()
    b = make(tmp_path / "b", max_steps=4); b.fit(num_steps=2); b.save(); del b  # step_000002
    monkeypatch.setattr(tr.Trainer, "fit", fit)
    with pytest.raises(SystemExit):
        main([f"{k}={v}" for k, v in {**FAST, "max_steps": 4, "run_dir": tmp_path / "b"}.items()])
    out = capsys.readouterr().err
    assert f"{fix} (or give another run_dir=...); once it is fixed, the same command resumes from {tmp_path / 'b' / 'checkpoints' / 'step_000002'}" in out, out


def test_a_damaged_meta_json_is_named(tmp_path):
    "meta.json cut short: the warning names the file, and the checkpoint before is used."
    t = make(tmp_path / "run", max_steps=6, ckpt_every=2, keep_last_k=5)
    t.fit(num_steps=4)
    meta = tmp_path / "run" / "checkpoints" / "step_000004" / "meta.json"
    meta.write_text(meta.read_text()[:100])
    logs = []
    from hymo.training import trainer as tr
    real = tr.Trainer.log
    tr.Trainer.log = lambda self, *a: logs.append(" ".join(map(str, a)))
    try: again = make(tmp_path / "run", max_steps=6, ckpt_every=2, keep_last_k=5)
    finally: tr.Trainer.log = real
    assert again.step == 2
    assert any(f"{meta} is damaged (" in l for l in logs), logs


def test_interrupted_checkpoint_never_replaces_the_last_good_one(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from hymo.training.trainer import list_checkpoints
    t = make(tmp_path / "run", max_steps=10, ckpt_every=3, keep_last_k=5)
    t.fit(num_steps=3)
    assert [p.name for p in list_checkpoints(t.run_dir)] == ["step_000003"]
    real_save = dcp.save

    def crash(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # the shards are written ...
        raise KeyboardInterrupt("killed mid-checkpoint")  # ... but the process dies before the rename

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        t.fit(num_steps=3)
    monkeypatch.setattr(dcp, "save", real_save)
    assert (t.run_dir / "checkpoints" / "step_000006.tmp").exists()
    assert [p.name for p in list_checkpoints(t.run_dir)] == ["step_000003"]
    again = make(tmp_path / "run", max_steps=10, ckpt_every=3, keep_last_k=5)
    assert again.step == 3


def test_keeps_only_last_k_checkpoints(tmp_path):
    from hymo.training.trainer import list_checkpoints
    t = make(tmp_path / "run", max_steps=8, ckpt_every=2, keep_last_k=2, decay_fraction=0)  # no decay: the newest two
    t.fit()
    assert [p.name for p in list_checkpoints(t.run_dir)] == ["step_000006", "step_000008"]
    t = make(tmp_path / "decays", max_steps=10, ckpt_every=2, keep_last_k=2)  # decayed steps from 7: 6 is kept from before
    t.fit()
    assert [p.name for p in list_checkpoints(t.run_dir)] == ["step_000006", "step_000008", "step_000010"]


def test_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    t = make(tmp_path / "run", max_steps=6, max_bad_steps=2, moe_capacity_factor=0.5)  # half the mean load: drops every step
    assert all(m["moe0/moe_drop_frac"] > 0 for m in t.fit(num_steps=2))
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    bias_before = [m.gate_bias.clone() for m in t.model.moe_layers()]
    real_forward = type(t.model).forward
    calls = {"n": 0}

    def nan_once(self, tokens, targets=None, cu_seqlens=None, **kw):
        out = real_forward(self, tokens, targets=targets, cu_seqlens=cu_seqlens, **kw)
        calls["n"] += 1
        if targets is not None and calls["n"] == 1:
            loss, parts = out
            return loss * float("nan"), {**parts, "main": parts["main"] * float("nan")}
        return out

    monkeypatch.setattr(type(t.model), "forward", nan_once)
    m = t.fit(num_steps=1)[0]
    assert m["skipped"] and m["bad_steps"] == 1 and t.bad_steps == 1
    for n, p in t.model.named_parameters(): assert torch.equal(p, before[n]), n  # nothing moved
    for b0, moe in zip(bias_before, t.model.moe_layers()):
        assert torch.equal(b0, moe.gate_bias) and moe.expert_counts.sum() == 0 and moe.dropped_tokens == 0
    m = t.fit(num_steps=1)[0]  # the next step is normal again
    assert not m["skipped"] and all(torch.isfinite(p).all() for p in t.model.parameters())
    assert json.loads((t.run_dir / "metrics.jsonl").read_text().splitlines()[2])["skipped"] is True


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_batch(tmp_path):
    "Two micro-batches of 4 windows and one of 8 read the same windows (dropless routing): the same loss and gradient norm."
    runs = [make(tmp_path / f"mb{mb}", micro_batch_size=mb, global_batch_size=8, moe_capacity_factor=None).train_step()
            for mb in (4, 8)]
    assert runs[0]["loss"] == pytest.approx(runs[1]["loss"], rel=1e-5)
    assert runs[0]["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=1e-4), [r["grad_norm"] for r in runs]


def test_the_optimisers_step_at_the_scheduled_learning_rate_and_the_log_says_which(tmp_path):
    "Step s (0-based) runs at peak_lr · wsd_schedule(s), through warmup and decay; its metrics line logs that multiplier."
    from hymo.training.optim import wsd_schedule
    t = make(tmp_path / "run", max_steps=8, warmup_steps=3, decay_fraction=0.5)
    seen = []
    for opt in t.optimizers:
        def step(*a, _plain=opt.step, _opt=opt, **kw):
            seen.append([g["lr"] / g["peak_lr"] for g in _opt.param_groups])
            return _plain(*a, **kw)
        opt.step = step
    for s in range(8):
        seen.clear()
        m = t.train_step()
        want = wsd_schedule(s, t.cfg)
        assert m["lr_mult"] == pytest.approx(want) and all(r == pytest.approx(want) for rs in seen for r in rs), (s, m["lr_mult"], seen)
    assert len({round(wsd_schedule(s, t.cfg), 6) for s in range(8)}) >= 5  # warmup, plateau and decay all seen


def test_a_good_step_updates_the_moe_bias_and_ends_a_run_of_bad_steps(tmp_path, monkeypatch):
    "The gate bias moves after every good step (its counts then start again); bad, good, bad, good never reaches max_bad_steps=1."
    t = make(tmp_path / "run", max_steps=8, max_bad_steps=1, ckpt_every=5)
    m = t.train_step()
    assert any(moe.gate_bias.abs().sum() > 0 for moe in t.model.moe_layers()) and "moe0/moe_load_max_mean" in m
    assert all(moe.expert_counts.sum() == 0 and moe.dropped_tokens == 0 for moe in t.model.moe_layers())
    real_forward, calls = type(t.model).forward, {"n": 0}

    def nan_every_other(self, tokens, targets=None, cu_seqlens=None, **kw):
        out = real_forward(self, tokens, targets=targets, cu_seqlens=cu_seqlens, **kw)
        calls["n"] += 1
        if targets is not None and calls["n"] % 2 == 1:
            return out[0] * float("nan"), out[1]
        return out

    monkeypatch.setattr(type(t.model), "forward", nan_every_other)
    ms = t.fit(num_steps=6)  # bad, good, bad, good, bad, good: steps 2 to 7; step 5, good, is due a checkpoint
    assert [m["skipped"] for m in ms] == [True, False] * 3 and t.bad_steps == 3
    assert (t.run_dir / "checkpoints" / "step_000005").is_dir()


def test_a_skipped_step_leaves_the_moe_bias_and_its_average_alone(tmp_path, monkeypatch):
    "A step whose loss is not finite teaches nothing: the balancing state stays as it was too, and its counts are dropped."
    t = make(tmp_path / "run", max_steps=4, max_bad_steps=3)
    t.train_step()
    before = [(m.gate_bias.clone(), m.ema_counts.clone()) for m in t.model.moe_layers()]
    assert t.model.moe_layers() and all(m.balance == "ema" and e.abs().sum() > 0 for m, (_, e) in zip(t.model.moe_layers(), before))
    real_forward = type(t.model).forward

    def nan_loss(self, tokens, targets=None, cu_seqlens=None, **kw):
        out = real_forward(self, tokens, targets=targets, cu_seqlens=cu_seqlens, **kw)  # routes and counts as usual
        return (out[0] * float("nan"), out[1]) if targets is not None else out

    monkeypatch.setattr(type(t.model), "forward", nan_loss)
    assert t.train_step()["skipped"]
    for moe, (bias, ema) in zip(t.model.moe_layers(), before):
        assert torch.equal(moe.gate_bias, bias) and torch.equal(moe.ema_counts, ema)
        assert moe.expert_counts.sum() == 0 and moe.dropped_tokens == 0


def test_the_bf16_copies_leave_the_routers_in_fp32(tmp_path):
    "BF16Matrices casts every matrix autocast would, but not the MoE routers, which run in fp32 (chapter 30)."
    import torch.nn as nn
    from hymo.training.trainer import BF16Matrices
    model = make(tmp_path / "run").model
    copied = {id(p) for p in BF16Matrices(model).masters}
    moes = model.moe_layers()
    routers = {id(m.gate.weight) for m in moes}
    assert moes and not copied & routers
    experts = {id(w) for m in moes for w in (m.w1, m.w2, m.w3)}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)} - routers
    assert copied == experts | linears and len(linears) > 10


@pytest.mark.parametrize("ac,compiled", [(False, False), (True, False), (True, True)])
def test_moe_counts_each_assignment_once_with_activation_checkpointing(tmp_path, ac, compiled):
    "Activation checkpointing re-runs each block's forward in backward: that second forward must not count its assignments again."
    from hymo.models.moe import DeepSeekMoE
    from hymo.training.trainer import forward_backward
    if compiled and not torch.cuda.is_available(): pytest.skip("compiled blocks: checked on a GPU (some 30 s to compile on a CPU)")
    t = make(tmp_path / "run", activation_checkpointing=ac, compile=compiled)
    t.model.train()
    _, n_tokens, _ = forward_backward(t, last=True)
    moes = [m for m in t.model.modules() if isinstance(m, DeepSeekMoE)]
    assert moes and [m.expert_counts.sum().item() for m in moes] == [n_tokens * m.top_k for m in moes]
    assert all(m.record_stats for m in moes)  # counting again for the next forward


def test_each_checkpoint_is_written_once(tmp_path, monkeypatch):
    "A step due a checkpoint that a stop also ends, and the last step (fit's final checkpoint, then finish), write one each."
    from hymo.training.trainer import Trainer
    written, real_save = [], Trainer.save

    def counted(self):
        written.append(self.step)
        return real_save(self)

    monkeypatch.setattr(Trainer, "save", counted)
    t = make(tmp_path / "run", max_steps=4, ckpt_every=2)
    real_step = Trainer.train_step

    def stop_at_2(self):
        m = real_step(self)
        if self.step == 2: self.request_stop()
        return m

    monkeypatch.setattr(Trainer, "train_step", stop_at_2)
    t.fit()
    assert written == [2] and t.stopped_by is not None
    monkeypatch.setattr(Trainer, "train_step", real_step)
    t.fit()  # steps 3 and 4, then the finish
    assert written == [2, 4] and (t.run_dir / "summary.json").exists()


def test_bad_step_counts_survive_a_resume(tmp_path, monkeypatch):
    "A run whose last step was non-finite resumes with its bad_steps and its streak: the next bad step ends it at max_bad_steps=1."
    from hymo.training.trainer import NonFiniteError, Trainer
    t = make(tmp_path / "run", max_steps=3, max_bad_steps=1)
    real_forward = type(t.model).forward

    def nan_at(steps):
        def forward(self, tokens, targets=None, cu_seqlens=None, **kw):
            loss, parts = real_forward(self, tokens, targets=targets, cu_seqlens=cu_seqlens, **kw)
            return (loss * float("nan"), parts) if targets is not None and t_now["step"] in steps else (loss, parts)
        return forward

    t_now = {"step": 0}
    real_step = Trainer.train_step

    def tracked(self):
        t_now["step"] = self.step + 1  # the step this call trains
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", tracked)
    monkeypatch.setattr(type(t.model), "forward", nan_at({1, 3}))
    t.fit()  # bad, good, bad: the final checkpoint is written at step 3, in a streak of one
    assert (t.bad_steps, t.consecutive_bad) == (2, 1)
    t2 = make(tmp_path / "run", max_steps=5, max_bad_steps=1)
    assert (t2.step, t2.bad_steps, t2.consecutive_bad) == (3, 2, 1)
    monkeypatch.setattr(type(t2.model), "forward", nan_at({4}))
    with pytest.raises(NonFiniteError, match="2 consecutive steps"):
        t2.fit()


def test_too_many_nonfinite_steps_stop_with_a_clear_message(tmp_path, monkeypatch):
    from hymo.training.trainer import NonFiniteError
    t = make(tmp_path / "run", max_steps=10, max_bad_steps=2, ckpt_every=2)
    t.fit(num_steps=2)
    real_forward = type(t.model).forward

    def always_nan(self, tokens, targets=None, cu_seqlens=None, **kw):
        loss, parts = real_forward(self, tokens, targets=targets, cu_seqlens=cu_seqlens, **kw)
        return loss * float("nan"), parts

    monkeypatch.setattr(type(t.model), "forward", always_nan)
    with pytest.raises(NonFiniteError, match="3 consecutive steps.*step_000002"):
        t.fit()


def test_two_processes_fsdp_equal_one_process(tmp_path):
    """torchrun with 2 CPU processes (gloo, FSDP-2) gives the losses of one process with the same global batch.
    Each rank accumulates 2 micro-batches and its gradients are reduced once per optimiser step, not per micro-batch."""
    steps = 5
    common = [f"max_steps={steps}", "seq_len=32", "micro_batch_size=2", "global_batch_size=8", "eval_every=0",
              "ckpt_every=0", "sample_tokens=4", "warmup_steps=1"]
    one = run_cli(*common, "run_dir=one", cwd=tmp_path, env_extra=CPU_RANKS)
    assert one.returncode == 0, one.stderr[-3000:]
    # `python -m hymo.train`, counting FSDP's all-gathers and gradient reductions in each optimiser step (private
    # functions of torch's FSDP-2, patched where its parameter groups call them), then whether the group is left
    script = tmp_path / "train_then_report.py"
    script.write_text(
        "import sys\nimport torch.distributed as dist\n"
        "import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg\n"
        "from hymo.training import trainer\nfrom hymo.train import main\n"
        "now, steps = None, []\n"
        "def counting(kind, f):\n"
        "    def run(*a, **k):\n"
        "        if now is not None: now[kind] += 1\n"
        "        return f(*a, **k)\n"
        "    return run\n"
        "pg.foreach_all_gather = counting('gathers', pg.foreach_all_gather)\n"
        "pg.foreach_reduce = counting('reductions', pg.foreach_reduce)\n"
        "plain_step = trainer.Trainer.train_step\n"
        "def step(self):\n"
        "    global now\n"
        "    now = {'gathers': 0, 'reductions': 0}\n"
        "    out = plain_step(self)\n"
        "    steps.append(now); now = None\n"
        "    return out\n"
        "trainer.Trainer.train_step = step\n"
        "main(sys.argv[1:])\n"  # each rank reports in its own file: two ranks printing to one pipe can interleave
        "import json, os\n"
        "open(f\"report_{os.environ['RANK']}.json\", 'w').write(json.dumps({'steps': steps, 'left': not dist.is_initialized()}))\n")
    r = torchrun(str(script), *common, "run_dir=two", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    reports = [json.loads((tmp_path / f"report_{rank}.json").read_text()) for rank in (0, 1)]
    assert all(rep["left"] for rep in reports)  # both ranks tear the process group down at the end
    # per rank and optimiser step of 2 micro-batches, each FSDP group (every block and the root) is gathered once and
    # reduced once; FSDP's defaults would gather each block twice per micro-batch and reduce every group per micro-batch
    groups = load_config("hymo_tiny").model.n_layers + 1
    for rep in reports: assert rep["steps"] == [{"gathers": groups, "reductions": groups}] * steps, rep["steps"]
    a, b = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5, (x["loss"], y["loss"])
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)  # the global norm over the shards (and the clip)
        assert x["tokens"] == y["tokens"]  # the step's tokens over every rank, not one rank's share
    assert "val_loss" in a[-1] and abs(a[-1]["val_loss"] - b[-1]["val_loss"]) <= 1e-5  # one validation pass over both ranks
    # a checkpoint written by 2 processes resumes in 1, and one written by 1 process in 2 (DCP reshards; the loader
    # continues where the saved run's optimiser steps left off): their steps 6 and 7 are those of 1 process resuming its own
    import shutil
    shutil.copytree(tmp_path / "one", tmp_path / "one_on_two")
    longer = [c if not c.startswith("max_steps") else "max_steps=7" for c in common]
    for resumed in (run_cli(*longer, "run_dir=one", cwd=tmp_path, env_extra=CPU_RANKS),
                    run_cli(*longer, "run_dir=two", cwd=tmp_path, env_extra=CPU_RANKS),
                    torchrun("-m", "hymo.train", *longer, "run_dir=one_on_two", cwd=tmp_path, timeout=600)):
        assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    same = read_jsonl(tmp_path / "one" / "metrics.jsonl")[5:]
    for other in ("two", "one_on_two"):
        after = read_jsonl(tmp_path / other / "metrics.jsonl")[5:]
        assert [m["step"] for m in after] == [m["step"] for m in same] == [6, 7]
        for x, y in zip(same, after): assert abs(x["loss"] - y["loss"]) <= 1e-5, (other, x["loss"], y["loss"])


def test_a_stop_on_one_rank_stops_both_and_only_rank_0_writes_the_run_files(tmp_path):
    """Two CPU ranks. Rank 1 alone asks to stop after its second step: both stop there together (a rank deciding alone
    would leave the other waiting in its next collective), exit 143 and save step 2. Evaluation after each step finds
    every block sharded again (the step's keep-gathered setting is undone). Resumed to the end, rank 1 writes nothing
    in the run folder but its own checkpoint shards: metrics, meta.json, the final model and summary are rank 0's."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import builtins, io, json, os, sys\nfrom pathlib import Path\nfrom torch.distributed.tensor import DTensor\n"
        "from hymo.training import trainer\nfrom hymo.train import main\n"
        "rank, calls, sharded, writes = int(os.environ['RANK']), [], [], []\n"
        "plain_step, plain_eval, real_open = trainer.Trainer.train_step, trainer.Trainer.evaluate, io.open\n"
        "def step(self):\n"
        "    out = plain_step(self); calls.append(1)\n"
        "    if rank == 1 and len(calls) == 2 and os.environ.get('PROBE_STOP'): self.request_stop('probe')\n"
        "    return out\n"
        "def evaluate(self):\n"
        "    out = plain_eval(self)\n"
        "    sharded.append(all(isinstance(p, DTensor) for b in self.model.layers for p in b.parameters()))\n"
        "    return out\n"
        "def spying(file, mode='r', *a, **k):\n"
        "    if any(c in mode for c in 'wax+'): writes.append(str(Path(file).resolve()))\n"
        "    return real_open(file, mode, *a, **k)\n"
        "trainer.Trainer.train_step, trainer.Trainer.evaluate, builtins.open, io.open = step, evaluate, spying, spying\n"
        "code = 0\n"
        "try: main(sys.argv[1:])\n"
        "except SystemExit as e: code = e.code; raise\n"
        "finally: real_open(f\"probe_{rank}.json\", 'w').write(json.dumps({'sharded': sharded, 'writes': writes, 'code': code}))\n")
    args = [str(script), "max_steps=4", "seq_len=32", "micro_batch_size=2", "global_batch_size=4", "eval_every=1",
            "eval_batches=2", "ckpt_every=0", "sample_tokens=0", "warmup_steps=1", "run_dir=two"]
    env = {**os.environ, "WANDB_MODE": "offline", **CPU_RANKS}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    r = subprocess.run(cmd + args, cwd=tmp_path, env={**env, "PROBE_STOP": "1"}, capture_output=True, text=True, timeout=400)
    assert r.returncode != 0 and "exitcode  : 143" in r.stderr, r.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(tmp_path / "two" / "metrics.jsonl") if "loss" in m] == [1, 2]
    assert {p.name for p in (tmp_path / "two" / "checkpoints" / "step_000002").iterdir()} >= {"rank0.pt", "rank1.pt"}
    first = [json.loads((tmp_path / f"probe_{rank}.json").read_text()) for rank in (0, 1)]
    assert [rep["code"] for rep in first] == [143, 143]  # both ranks end as a signal's stop, together
    r = subprocess.run(cmd + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    second = [json.loads((tmp_path / f"probe_{rank}.json").read_text()) for rank in (0, 1)]
    for rep in first + second: assert rep["sharded"] and all(rep["sharded"]), rep["sharded"]
    run = str((tmp_path / "two").resolve())
    mine = [w for w in second[1]["writes"] if w.startswith(run)]
    assert mine and all(Path(w).name == "rank1.pt" or w.endswith(".distcp") for w in mine), mine
    assert any(w.endswith("metrics.jsonl") for w in second[0]["writes"])  # rank 0's spy sees the run files


def test_ranks_whose_clocks_differ_share_the_new_run_folder(tmp_path):
    """Without run_dir= each rank used to name the timestamped folder from its own clock: a rank a second late wrote its
    checkpoint shards into a folder of its own, and every checkpoint of the run was missing them. Here rank 1's clock is
    a day ahead; rank 0's name is used by both, so the run has one folder and its checkpoint resumes."""
    script = tmp_path / "late_clock.py"
    script.write_text(
        "import os, sys, time\nfrom hymo.train import main\n"
        "if os.environ['RANK'] == '1':\n"
        "    real = time.strftime\n"
        "    time.strftime = lambda f, t=None: real(f, time.localtime((t or time.time()) + 86400) if t is None else t)\n"
        "main(sys.argv[1:])\n")
    args = [*TWO_RANK_RUN, "max_steps=2"]
    r = torchrun(str(script), *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    ckpt = runs[0] / "checkpoints" / "step_000002"
    assert (ckpt / "rank0.pt").exists() and (ckpt / "rank1.pt").exists(), sorted(p.name for p in ckpt.iterdir())
    again = torchrun("-m", "hymo.train", *args[:-1], "max_steps=3", f"run_dir={runs[0]}", cwd=tmp_path)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(runs[0] / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("damage", ["cut", "flipped"])
def test_two_ranks_fall_back_together_when_only_one_cannot_read_its_file(tmp_path, damage):
    """Damage that only rank 1 sees (its own rank1.pt cut short, or a bit of its DCP shard flipped, which only rank 1
    checks) sends both ranks back to the previous checkpoint, with no hang. One process resuming the same folder checks
    rank 1's files itself."""
    args = [*TWO_RANK_RUN, "run_dir=two"]
    first = torchrun("-m", "hymo.train", *args, "max_steps=4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    step4 = tmp_path / "two" / "checkpoints" / "step_000004"
    if damage == "cut": (step4 / "rank1.pt").write_bytes(b"cut short")
    else:
        flip_a_byte(step4 / "__1_0.distcp")
        shutil.copytree(tmp_path / "two", tmp_path / "alone")
        alone = run_cli(*TWO_RANK_RUN, "run_dir=alone", "max_steps=6", cwd=tmp_path, env_extra=CPU_RANKS)
        assert alone.returncode == 0, alone.stderr[-3000:]
        assert "__1_0.distcp has changed since it was saved" in alone.stdout and "at step 2" in alone.stdout, alone.stdout
    again = torchrun("-m", "hymo.train", *args, "max_steps=6", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "another rank cannot read" in again.stdout and "resumed from two/checkpoints/step_000002" in again.stdout
    assert (tmp_path / "two" / "checkpoints" / "damaged-step_000004").exists()
    assert [m["step"] for m in read_jsonl(tmp_path / "two" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_checkpoints_the_finished_step_and_the_same_command_resumes(tmp_path, sig):
    """Ctrl-C, a scheduler's SIGTERM or a hang-up mid-run: the step in flight finishes, its checkpoint is written, the
    exit code is 128 + the signal's number and there is no traceback; the same command then carries on."""
    import signal, time
    args = ["run_dir=run", "max_steps=100000", "seq_len=32", "micro_batch_size=4", "global_batch_size=4",
            "eval_every=0", "ckpt_every=0", "warmup_steps=1", "sample_tokens=4"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    proc = subprocess.Popen([sys.executable, "-m", "hymo.train", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # a hang-up's default, as in a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # (not nohup's SIG_IGN)
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + getattr(signal, sig), err[-3000:]
    assert "Traceback" not in err and f"stopped by {sig}" in out, (out[-2000:], err[-2000:])
    step = read_jsonl(metrics)[-1]["step"]
    assert f"the same command resumes from run/checkpoints/step_{step:06d}" in out, out[-2000:]
    assert [c.name for c in (tmp_path / "run" / "checkpoints").iterdir()] == [f"step_{step:06d}"]
    r = run_cli(*[a if not a.startswith("max_steps") else f"max_steps={step + 2}" for a in args], cwd=tmp_path)
    assert r.returncode == 0 and f"resumed from" in r.stdout and f"at step {step}" in r.stdout, r.stderr[-2000:]
    assert [m["step"] for m in read_jsonl(metrics)] == list(range(1, step + 3))


@pytest.mark.parametrize("both", [False, True])
def test_a_closed_output_checkpoints_the_finished_step(tmp_path, both):
    """`python -m hymo.train | head` (or `2>&1 | head`, where the progress bar meets the closed pipe too): once the
    reader has gone, the next write stops the run after that step with a checkpoint (before, a BrokenPipeError
    traceback lost every step since the last one); status 141, as SIGPIPE."""
    import signal, time
    args = ["run_dir=run", "max_steps=100000", "seq_len=32", "micro_batch_size=4", "global_batch_size=4",
            "eval_every=0", "ckpt_every=0", "warmup_steps=1", "log_every=1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    proc = subprocess.Popen([sys.executable, "-m", "hymo.train", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if both else subprocess.PIPE)
    lines = [proc.stdout.readline() for _ in range(3)]  # `head -3`
    proc.stdout.close()
    err = "" if both else proc.stderr.read()
    proc.wait(timeout=300)
    assert proc.returncode == 128 + signal.SIGPIPE, (lines, err[-3000:])
    step = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["step"]
    assert [c.name for c in (tmp_path / "run" / "checkpoints").iterdir()] == [f"step_{step:06d}"]
    if not both:
        assert "Traceback" not in err and "stdout was closed" in err, err[-3000:]
        assert f"stopped by SIGPIPE at step {step}; the same command resumes from run/checkpoints/step_{step:06d}" in err, err[-2000:]


def test_output_without_a_reader_from_the_start_stops_after_the_first_step(tmp_path):
    "stdout closed before anything is printed (the data preparation's lines, `run folder:`): no traceback, one step, a checkpoint."
    import signal
    code = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from hymo.train import main; "
            f"main({_cli_args(tmp_path / 'run', max_steps=50, warmup_steps=1, ckpt_every=0)!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "WANDB_MODE": "offline"})
    assert r.returncode == 128 + signal.SIGPIPE and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "stdout was closed" in r.stderr and "stopped by SIGPIPE at step 1" in r.stderr, r.stderr[-2000:]
    assert [c.name for c in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000001"]


def test_a_finished_run_keeps_the_tokenizer_it_trained_with(tmp_path, monkeypatch):
    """The tokenizer is read when the run starts: a dataset prepared again (another tokenizer), moved or deleted during
    the run does not change the finished run's tokenizer.json (it did: it was copied at the end), nor stop the export."""
    import hashlib, shutil
    from hymo.training.data import CORPUS, load_manifest, prepare
    text = tmp_path / "play.txt"; text.write_text(CORPUS.read_text()[:30_000])
    ds = prepare(text, tmp_path / "ds", vocab_size=300, progress=False)
    sha = load_manifest(ds)["tokenizer_sha256"]
    t = make(tmp_path / "run", data_dir=str(ds), max_steps=2, warmup_steps=1)
    prepare(text, ds, vocab_size=280, overwrite=True, progress=False)  # meanwhile: another tokenizer in data_dir
    assert load_manifest(ds)["tokenizer_sha256"] != sha
    t.fit()
    assert hashlib.sha256((tmp_path / "run" / "tokenizer.json").read_bytes()).hexdigest() == sha
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["tokenizer_sha256"] == sha
    t = make(tmp_path / "run2", data_dir=str(ds), max_steps=2, warmup_steps=1)
    shutil.move(ds, tmp_path / "moved")  # or deleted: the shards are open, the tokenizer read
    t.fit()
    assert (tmp_path / "run2" / "model.safetensors").exists() and json.loads((tmp_path / "run2" / "summary.json").read_text())["sample"]
    monkeypatch.chdir(tmp_path)  # a relative data_dir is kept absolute: `--config RUN/config.yaml` works from anywhere
    t = make(tmp_path / "run3", data_dir="moved", max_steps=2, warmup_steps=1)
    assert t.cfg.data_dir == str(tmp_path / "moved")
    t.fit()
    assert load_config(tmp_path / "run3" / "config.yaml").train.data_dir == str(tmp_path / "moved")


def test_the_end_of_run_sample_continues_sample_prompt(tmp_path):
    "ROMEO: fits only the bundled corpus: on other data the sample starts a document, unless sample_prompt gives a prompt."
    from hymo.training.data import CORPUS, prepare
    text = tmp_path / "play.txt"; text.write_text(CORPUS.read_text()[:30_000])
    ds = prepare(text, tmp_path / "ds", vocab_size=300, progress=False)
    summary = lambda run: json.loads((tmp_path / run / "summary.json").read_text())["sample"]
    t = make(tmp_path / "run", data_dir=str(ds), max_steps=2, warmup_steps=1); t.fit()
    assert summary("run") == t.sample("") and not summary("run").startswith("ROMEO:")
    t = make(tmp_path / "run2", data_dir=str(ds), max_steps=2, warmup_steps=1, sample_prompt="JULIET:"); t.fit()
    assert summary("run2").startswith("JULIET:") and summary("run2") == t.sample("JULIET:")


def test_a_new_sample_prompt_or_length_is_no_change_of_training(tmp_path):
    "The end-of-run sample is not how a run trains: resuming with another one says nothing."
    make(tmp_path / "run", max_steps=4, ckpt_every=2, warmup_steps=1).fit(2)
    t = make(tmp_path / "run", max_steps=4, ckpt_every=2, warmup_steps=1, sample_prompt="JULIET:", sample_tokens=4)
    assert t.step == 2 and not any("sample" in w for w in t.resume_warnings), t.resume_warnings
    t.fit()
    back = str(tmp_path / "run" / "checkpoints" / "step_000002")
    make(tmp_path / "run", resume=back, max_steps=4, ckpt_every=2, warmup_steps=1).fit()  # a rewind, trained on to the end
    t = make(tmp_path / "run", resume=back, max_steps=4, ckpt_every=2, warmup_steps=1, sample_prompt="JULIET:")
    assert t.step == 4  # the same command again, requeued with another prompt: not a new rewind (it went back to step 2)


def test_a_copied_config_that_names_a_run_folder_says_it_continues_that_run(tmp_path, capsys):
    from hymo.train import main
    main(_cli_args(tmp_path / "run1", max_steps=2, warmup_steps=1))
    (tmp_path / "exp.yaml").write_text((tmp_path / "run1" / "config.yaml").read_text())
    capsys.readouterr()
    main(["--config", str(tmp_path / "exp.yaml"), "max_steps=3"])
    assert f"note: {tmp_path / 'exp.yaml'} sets run_dir={tmp_path / 'run1'}, an existing run's folder: continuing that run" \
        in capsys.readouterr().out
    main(["--config", str(tmp_path / "exp.yaml"), "max_steps=4", f"run_dir={tmp_path / 'run2'}"])
    assert "an existing run's folder" not in capsys.readouterr().out and (tmp_path / "run2" / "summary.json").exists()


def test_the_ending_line_names_the_command_that_resumes(tmp_path):
    """After a stop, the line says how to resume: a timestamped folder must be named (the same command would start a new
    one), and --resume OLD (or --no-resume) must be left out (it would go back to OLD, or refuse the folder)."""
    from argparse import Namespace
    from types import SimpleNamespace
    from hymo.train import _resume_from
    run = tmp_path / "runs" / "hymo_tiny-20261204-201512"
    ck = run / "checkpoints" / "step_000009"
    def line(run_dir_given, resume=None, no_resume=False):
        cfg = load_config("hymo_tiny", **({"run_dir": str(run)} if run_dir_given else {}))
        return _resume_from(SimpleNamespace(run_dir=run), cfg, Namespace(config="hymo_tiny", resume=resume, no_resume=no_resume))
    assert line(True) == line(False) == "no checkpoint was written"
    ck.mkdir(parents=True); (ck / "meta.json").write_text("{}")
    assert line(True) == f"the same command resumes from {ck}"
    assert line(False) == f"the same command with run_dir={run} resumes from {ck}"
    assert line(True, resume=str(run / "checkpoints" / "step_000004")) == f"the same command without --resume resumes from {ck}"
    assert line(True, no_resume=True) == f"the same command without --no-resume resumes from {ck}"
    assert line(False, resume="other") == f"the same command without --resume and with run_dir={run} resumes from {ck}"


def _cli_args(run, **over):
    return [f"{k}={v}" for k, v in {**FAST, "max_steps": 4, "ckpt_every": 2, "run_dir": run, **over}.items()]


def test_the_console_script_exits_0_after_a_finished_run(tmp_path, monkeypatch, capsys):
    """`hymo-train` is `sys.exit(<its function>())`: a returned summary dict would be printed and exit with status 1."""
    import importlib, tomllib
    target = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]["hymo-train"]
    module, func = target.split(":")
    monkeypatch.setattr(sys, "argv", ["hymo-train", *_cli_args(tmp_path / "run", max_steps=2, warmup_steps=1)])
    with pytest.raises(SystemExit) as e: sys.exit(getattr(importlib.import_module(module), func)())
    assert e.value.code is None and (tmp_path / "run" / "summary.json").exists()  # None: status 0


def test_an_empty_resume_path_is_refused(tmp_path, capsys):
    "`--resume \"$CKPT\"` with CKPT unset used to start a fresh run without a word."
    from hymo.train import main
    with pytest.raises(SystemExit) as e: main(["--resume", "", *_cli_args(tmp_path / "run")])
    assert e.value.code == 2 and "--resume was given an empty path" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_full_disk_leaves_no_partial_checkpoint_and_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """The real DCP writer on a disk whose data file cannot be written (/dev/full: ENOSPC). DCP wraps the OSError in
    its own exception; the CLI still finds it, says so in one line, and the partial folder is gone."""
    import torch.distributed.checkpoint as dcp
    from hymo.train import main
    real = dcp.save
    def full(state, checkpoint_id):
        os.symlink("/dev/full", Path(checkpoint_id) / "__0_0.distcp")
        return real(state, checkpoint_id=checkpoint_id)
    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(SystemExit) as e: main(_cli_args(tmp_path / "run"))
    err = capsys.readouterr().err
    assert e.value.code == 1 and "No space left on device" in err and "no checkpoint was written" in err, err
    assert "Traceback" not in err and list((tmp_path / "run" / "checkpoints").iterdir()) == []  # no step_000002.tmp


def test_ctrl_c_while_a_checkpoint_loads_stops_and_damages_nothing(tmp_path, monkeypatch, capsys):
    """DCP wraps a KeyboardInterrupt too: it must stop the run (exit 130), not mark the checkpoint damaged and go on."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from hymo.train import main
    main(_cli_args(tmp_path / "run", max_steps=4, keep_last_k=2))
    def interrupted(self, *a, **k): raise KeyboardInterrupt
    monkeypatch.setattr(FileSystemReader, "read_data", interrupted)
    with pytest.raises(SystemExit) as e: main(_cli_args(tmp_path / "run", max_steps=6, keep_last_k=2))
    assert e.value.code == 130 and "interrupted before training began" in capsys.readouterr().err
    assert sorted(c.name for c in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


def test_ctrl_c_while_a_checkpoint_is_written_ends_in_one_line(tmp_path, monkeypatch, capsys):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from hymo.train import main
    def interrupted(self, *a, **k): raise KeyboardInterrupt
    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    with pytest.raises(SystemExit) as e: main(_cli_args(tmp_path / "run"))
    err = capsys.readouterr().err
    assert e.value.code == 130 and "interrupted at step 2; no checkpoint was written" in err and "Traceback" not in err, err


def test_a_stop_after_the_last_steps_check_still_checkpoints_and_skips_the_finish(tmp_path, monkeypatch):
    """A signal between the loop's last check and the handlers' removal: every rank still learns of it after the loop,
    the step is checkpointed, `finish` is left to the resumed run."""
    import signal
    from hymo.training.trainer import Trainer, list_checkpoints
    steps = Trainer._fit_steps
    def then_signal(self, *a):
        out = steps(self, *a)
        self.request_stop(signal.SIGTERM)  # what the handler does, after the loop
        return out
    monkeypatch.setattr(Trainer, "_fit_steps", then_signal)
    t = make(tmp_path / "run", max_steps=3, ckpt_every=2)
    assert len(t.fit()) == 3 and t.stopped_by == signal.SIGTERM
    assert [c.name for c in list_checkpoints(t.run_dir)] == ["step_000002", "step_000003"]
    assert not (t.run_dir / "summary.json").exists()
    monkeypatch.setattr(Trainer, "_fit_steps", steps)
    again = make(tmp_path / "run", max_steps=3, ckpt_every=2)
    assert again.fit() == [] and (t.run_dir / "summary.json").exists()  # resumed at the end: it finishes


def test_a_repeated_sigterm_does_not_kill_the_stop_checkpoint(tmp_path):
    """Schedulers may send SIGTERM twice (to the job step, and again through torchrun): the second one, arriving as the
    stop checkpoint is written, must be absorbed. In a subprocess: a regression would kill the process."""
    script = f"""
import os, signal, sys
from hymo.config import load_config
from hymo.training.trainer import Trainer, list_checkpoints
cfg = load_config("hymo_tiny", **{FAST!r}, max_steps=6)
t = Trainer(cfg.model, cfg.train, run_dir={str(tmp_path / "run")!r}, quiet=True)
step, save = t.train_step, t.save
def step_then_sigterm():
    m = step()
    if t.step == 3: os.kill(os.getpid(), signal.SIGTERM)
    return m
def save_after_another_sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
    return save()
t.train_step, t.save = step_then_sigterm, save_after_another_sigterm
t.fit()
print(t.stopped_by.name, [c.name for c in list_checkpoints(t.run_dir)])
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["SIGTERM", "['step_000003']"], (r.returncode, r.stdout, r.stderr[-2000:])


def test_a_sigterm_during_the_final_checkpoint_keeps_it_and_the_resume_finishes(tmp_path):
    """The last step's checkpoint is written under the stop handlers too: a SIGTERM as it is written (a scheduler's
    time limit) lets it complete, the run stops there with the stop line's exit code, and the same command finishes
    the run. Before, the default handler killed the process mid-save and every step since the last periodic
    checkpoint was lost. In a subprocess: a regression kills the process."""
    script = f"""
import os, signal
from hymo.config import load_config
from hymo.training.trainer import Trainer, list_checkpoints
cfg = load_config("hymo_tiny", **{dict(FAST, max_steps=5, ckpt_every=2)!r})
t = Trainer(cfg.model, cfg.train, run_dir={str(tmp_path / "run")!r}, quiet=True)
save = t.save
def sigterm_then_save():
    if t.step == 5: os.kill(os.getpid(), signal.SIGTERM)
    return save()
t.save = sigterm_then_save
t.fit()
print(t.stopped_by.name, [c.name for c in list_checkpoints(t.run_dir)], (t.run_dir / "summary.json").exists())
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["SIGTERM", "['step_000002',", "'step_000004',", "'step_000005']", "False"], r.stdout  # 2: before the decay
    again = make(tmp_path / "run", max_steps=5, ckpt_every=2)
    assert again.step == 5 and again.fit() == [] and (tmp_path / "run" / "summary.json").exists()  # resumed at the end


def test_a_checkpoint_from_before_the_loader_saved_its_accumulation_resumes(tmp_path):
    first = make(tmp_path / "run", max_steps=4, ckpt_every=2)
    first.fit(num_steps=2)
    extra = tmp_path / "run" / "checkpoints" / "step_000002" / "rank0.pt"
    state = torch.load(extra, weights_only=False); del state["loader"]["accum"]; torch.save(state, extra)
    without_file_sums(extra.parent)  # nor had it recorded its files' sums
    again = make(tmp_path / "run", max_steps=4, ckpt_every=2)
    assert again.step == 2 and again.train_loader.step == 2 and not again.resume_warnings


def test_a_refusal_while_resuming_stays_a_usage_error(tmp_path, monkeypatch, capsys):
    """parser.error's SystemExit passes through main's handler even when the refusal was caused by a permission error."""
    import errno
    from hymo.train import main
    main(_cli_args(tmp_path / "run", max_steps=2, warmup_steps=1))
    def forbidden(*a, **k): raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(SystemExit) as e:
        main(_cli_args(tmp_path / "run", max_steps=4) + ["--resume", str(tmp_path / "run" / "checkpoints" / "step_000002")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot be read" in err and "Free space" not in err, err


def test_a_second_process_cannot_train_in_a_locked_run_folder(tmp_path):
    """The same command started twice: the second is refused (naming the first's pid) and changes nothing."""
    run = tmp_path / "run"; run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from hymo.training.trainer import lock_run_dir; "
                               "assert lock_run_dir(Path(sys.argv[1])) is None; print('locked', flush=True); time.sleep(600)",
                               str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = run_cli("run_dir=run", "max_steps=2", "seq_len=32", "sample_tokens=4", "warmup_steps=1", cwd=tmp_path)
        assert r.returncode == 2 and f"is in use by another run (pid {holder.pid} on" in r.stderr, r.stderr[-2000:]
        assert sorted(p.name for p in run.iterdir()) == [".lock"]
    finally:
        holder.kill(); holder.wait()
    r = run_cli("run_dir=run", "max_steps=2", "seq_len=32", "sample_tokens=4", "warmup_steps=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]  # the lock went with the process that held it


def test_cli_help_lists_every_option(tmp_path):
    r = run_cli("--help", cwd=tmp_path)
    assert r.returncode == 0
    from dataclasses import fields
    from hymo.config import ModelConfig, TrainingConfig
    for f in fields(ModelConfig) + fields(TrainingConfig): assert f"  {f.name}=" in r.stdout, f.name
    for sec, cls in (("model", ModelConfig), ("train", TrainingConfig)):  # each section's descriptions form one column
        lines = [l for l in r.stdout.splitlines() if any(l.startswith(f"  {f.name}=") for f in fields(cls))]
        starts = {re.match(r"  \S+=.*?\s{2,}\S", l).end() for l in lines}  # values may hold one space: "[0.3, 0.1]"
        assert len(lines) == len(fields(cls)) and len(starts) == 1, (sec, starts)
    assert re.search(r"\n  dim=128 .*\[hymo_750m: 896\]\n", r.stdout) and re.search(r"\n  compile=false .*\[hymo_750m: true\]\n", r.stdout)
    assert not re.search(r"\n  gdn_head_k_dim=32 .*\[hymo_750m", r.stdout)  # a value the presets share has no note


def test_cli_prints_the_design_defaults_note_before_training(tmp_path, capsys):
    "A base-less YAML file gets its note from `main` itself, before anything else can go wrong (here: the data)."
    from hymo.train import main
    (tmp_path / "mine.yaml").write_text(f"train:\n  data_dir: {tmp_path / 'nowhere'}\n")
    with pytest.raises(SystemExit) as e: main(["--config", str(tmp_path / "mine.yaml")])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and "mine.yaml has no 'base:', so the" in out and "nowhere does not exist" in err, (out, err)


def test_a_base_less_yaml_file_that_fails_on_a_design_default_says_why_in_its_error(tmp_path, capsys):
    "The note is part of the error: a file meant to change hymo_tiny fails on hymo_750m's warmup_steps, which it never set."
    from hymo.train import main
    (tmp_path / "c.yaml").write_text("model:\n  dim: 64\n")
    with pytest.raises(SystemExit) as e: main(["--config", str(tmp_path / "c.yaml"), "max_steps=100"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "lower warmup_steps" in err and "c.yaml has no 'base:'" in err and "'base: hymo_tiny'" in err, err


def test_the_console_script_names_itself_in_its_usage(monkeypatch, capsys):
    from hymo.train import cli
    monkeypatch.setattr(sys, "argv", ["hymo-train", "--help"])
    with pytest.raises(SystemExit) as e: cli()
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: hymo-train ")


def test_an_os_error_that_is_not_the_disk_is_not_reported_as_one(tmp_path, monkeypatch):
    "Only a full disk or a permission error becomes the one-line 'free space' ending; any other OSError is raised as it is."
    import errno
    from hymo.train import main
    from hymo.training.trainer import Trainer
    def fit(self): raise OSError(errno.EINVAL, "Invalid argument", "somewhere")
    monkeypatch.setattr(Trainer, "fit", fit)
    with pytest.raises(OSError) as e: main(_cli_args(tmp_path / "run"))
    assert e.value.errno == errno.EINVAL


@pytest.mark.parametrize("args, expect", [
    (["--max-steps", "3"], "unknown option --max-steps"),
    (["--confg", "hymo_tiny"], "did you mean --config"),
    (["max_step=3"], "Did you mean 'max_steps'"),
    (["dim=wide"], "expected int"),
    (["--config", "hymo_nano"], "Presets: hymo_750m, hymo_tiny"),
    (["max_steps"], "write key=value"),
    (["--resume", "runs/x/step_4", "--no-resume"], "not allowed with argument --resume"),
    (["--confg=x"], "did you mean --config"),
    (["hymo_750m"], "'hymo_750m' is not an override: to train a preset or a YAML file, give --config hymo_750m"),
    (["--config", "hymo_tiny", "max_steps=3", "--config", "hymo_750m"], "--config is given twice (hymo_tiny, then hymo_750m): give it once"),
    (["--resum", "x"], "unknown option --resum; did you mean --resume?"),  # no abbreviations: --resum is not taken for --resume
    (["--bogus"], "unknown option --bogus. Config values are written key=value"),
    (["adamw_betas=[0.9,"], "quote it for the shell, e.g. 'adamw_betas=[0.9, 0.95]'"),  # the setting's own default, as the example
    (["mtp_loss_weights=0.3"], "expected a list of float, got float 0.3; write it as a list in brackets, [0.3, ...], as many values as it takes"),
    (["--resume", "a", "--resume", "b"], "--resume is given twice (a, then b)"),
    (["--config", "hymo_tiny.yaml"], "a preset is named without .yaml: hymo_tiny"),
    (["data_dir="], "'data_dir=' has no value"),
])
def test_cli_errors_say_what_to_do(tmp_path, args, expect):
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode == 2 and expect in r.stderr, r.stderr


def test_cli_config_of_a_run_folder_continues_that_run(tmp_path):
    """`--config RUN/config.yaml` alone, from another directory: the run in RUN continues (its run_dir was relative to
    where it was launched, or null for a timestamped folder, and a new run started from step 0 elsewhere); with
    --no-resume or run_dir=..., a new run starts from its settings."""
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    over = [f"{k}={v}" for k, v in {**FAST, "max_steps": 2, "ckpt_every": 1, "warmup_steps": 1}.items()]
    r = run_cli(*over, "run_dir=run", cwd=tmp_path / "a")
    assert r.returncode == 0, r.stderr[-2000:]
    from hymo.train import describe  # the run says what it trains, as --print-config does
    assert "model: " + "; ".join(describe(load_config(str(tmp_path / "a" / "run" / "config.yaml")))[:2]) in r.stdout
    assert "model: 4 blocks: 3 Gated DeltaNet + SwiGLU, 1 MLA + MoE" in r.stdout
    config = str(tmp_path / "a" / "run" / "config.yaml")
    r = run_cli("--config", config, "--no-resume", "max_steps=1", "warmup_steps=0", cwd=tmp_path / "b")
    assert r.returncode == 0 and "continuing that run" not in r.stdout, r.stderr[-2000:]  # in b/run, as its run_dir says
    assert os.listdir(tmp_path / "b") == ["run"] and read_jsonl(tmp_path / "b" / "run" / "metrics.jsonl")[0]["step"] == 1
    r = run_cli("--config", config, "max_steps=3", cwd=tmp_path / "b")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"continuing that run, run_dir={tmp_path / 'a' / 'run'}" in r.stdout and os.listdir(tmp_path / "b") == ["run"]
    assert [m["step"] for m in read_jsonl(tmp_path / "a" / "run" / "metrics.jsonl") if "loss" in m] == [1, 2, 3]
    r = run_cli("--config", config, "run_dir=new", "max_steps=1", "warmup_steps=0", cwd=tmp_path / "b")
    assert r.returncode == 0 and sorted(os.listdir(tmp_path / "b")) == ["new", "run"], r.stderr[-2000:]  # a new run
    ckpt = sorted((tmp_path / "a" / "run" / "checkpoints").glob("step_*"))[-1]  # one of its own checkpoints: still that run
    r = run_cli("--config", config, "--resume", str(ckpt), "max_steps=4", cwd=tmp_path / "b")
    assert r.returncode == 0 and sorted(os.listdir(tmp_path / "b")) == ["new", "run"], r.stderr[-2000:]
    assert f"run folder: {tmp_path / 'a' / 'run'}" in r.stdout  # (its config.yaml now names that folder itself)
    assert [m["step"] for m in read_jsonl(tmp_path / "a" / "run" / "metrics.jsonl") if "loss" in m][-1] == 4


@pytest.mark.parametrize("args, expect", [
    (["data_dir=nowhere"], "nowhere does not exist: check the path"),
    (["--resume", "nowhere"], "nowhere does not exist: --resume takes a checkpoint folder, RUN/checkpoints/step_NNNNNN"),
    (["run_dir=afile"], "is a file"),
    (["seq_len=512"], "longer than model.max_seq_len=256"),
    (["seq_len=2"], "use seq_len > mtp_depth=2"),
    (["gdn_kernel=triton"], "gdn_kernel=triton needs a CUDA GPU"),
    (["--config", "broken.yaml"], "broken.yaml is not valid YAML"),
    (["mtp_loss_weights=[0.3,"], "the value is not valid YAML"),
])
def test_cli_refusals_from_the_trainer_leave_no_run_folder(tmp_path, args, expect):
    """Mistakes found by the trainer (data, checkpoint, run folder) end in one line and exit 2, as config errors do."""
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "broken.yaml").write_text("model: {dim: [\n")
    r = run_cli(*args, cwd=tmp_path, env_extra={"CUDA_VISIBLE_DEVICES": ""})  # a CPU run, GPU or not (gdn_kernel=triton)
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["afile", "broken.yaml"]  # no run folder, default or named


def test_no_resume_refuses_a_folder_with_checkpoints_and_keeps_them(tmp_path):
    from hymo.config import ConfigError
    from hymo.training.trainer import list_checkpoints
    t = make(tmp_path / "run", max_steps=4, ckpt_every=2)
    t.fit()
    before = [p.name for p in list_checkpoints(t.run_dir)]
    with pytest.raises(ConfigError, match="--no-resume"):
        make(tmp_path / "run", resume=False, max_steps=4, ckpt_every=2)
    assert [p.name for p in list_checkpoints(t.run_dir)] == before == ["step_000002", "step_000004"]


def test_data_dir_that_does_not_match_the_model_is_refused(tmp_path):
    from hymo.training.data import prepare_default
    ds = prepare_default(vocab_size=2048, progress=False)
    with pytest.raises(Exception, match="vocab"):
        make(tmp_path / "run", data_dir=str(ds), vocab_size=1024)


def test_a_validation_split_too_small_for_a_batch_is_skipped_with_a_warning(tmp_path, capsys):
    from hymo.training.data import CORPUS, prepare
    from hymo.training.trainer import Trainer
    ds = prepare(CORPUS, tmp_path / "data", vocab_size=2048, val_fraction=0.0005, progress=False)  # ~150 val tokens
    cfg = load_config("hymo_tiny", **{**FAST, "data_dir": str(ds), "micro_batch_size": 8, "global_batch_size": 8,
                                      "max_steps": 2, "warmup_steps": 1})
    t = Trainer(cfg.model, cfg.train, run_dir=tmp_path / "run", quiet=False)
    assert t.val_loader is None and "warning: no validation loss is reported" in capsys.readouterr().out
    assert len(t.fit()) == 2 and t.summary["val_loss"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the single-GPU autocast path)")
def test_one_gpu_steps_through_bf16_copies_and_trains_as_autocast_does(tmp_path):
    """On one GPU the trainer casts the matrices once per step (`BF16Matrices`); its steps match plain autocast's."""
    over = dict(global_batch_size=8, precision="bf16", max_steps=3)  # 2 micro-batches per step
    a, b = make(tmp_path / "a", resume=False, **over), make(tmp_path / "b", resume=False, **over)
    assert a.matrices is not None and len(a.matrices.copies) > 0
    b.matrices = None  # autocast's own casts
    for _ in range(3):
        ma, mb = a.train_step(), b.train_step()
        assert abs(ma["loss"] - mb["loss"]) <= 2e-3 * abs(mb["loss"]), (ma["loss"], mb["loss"])
        assert abs(ma["grad_norm"] - mb["grad_norm"]) <= 2e-2 * mb["grad_norm"], (ma["grad_norm"], mb["grad_norm"])
    assert {p.dtype for p in a.model.parameters()} == {torch.float32}  # the masters, not the copies, stay in the model
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=2e-3)  # three optimiser steps later, the same weights


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_add_into_adds_bf16_into_fp32_exactly(device):
    """`add_into` (compiled on a GPU) gives the eager sums bit for bit: fp32 += bf16 converted, for mixed shapes."""
    if device == "cuda" and not torch.cuda.is_available(): pytest.skip("needs a CUDA GPU (the compiled path)")
    from hymo.training.trainer import add_into
    g = torch.Generator(device).manual_seed(0)
    dst = [torch.randn(s, device=device, generator=g) for s in [(3, 5), (64, 7), (2, 33, 9), (1,)]]
    src = [torch.randn(d.shape, device=device, generator=g).bfloat16() for d in dst]
    ref = [d + s.float() for d, s in zip(dst, src)]
    add_into(dst, src)  # compiled on a GPU
    assert all(torch.equal(a, b) for a, b in zip(dst, ref))
    add_into(dst, src, compiled=False)
    assert all(torch.equal(a, b + s.float()) for a, b, s in zip(dst, ref, src))
    add_into([], [])  # nothing to add: no error


def test_safetensors_io_errors_are_oserrors(tmp_path):
    """safetensors raises its own SafetensorError for a failed write; the export raises the OSError inside it, which
    `python -m hymo.train` reports in one line (a full disk, a read-only folder)."""
    import errno
    from hymo.training.trainer import write_safetensors
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError) as e: write_safetensors({"w": torch.zeros(2, 2)}, tmp_path / "a_file" / "model.safetensors")
    assert e.value.errno == errno.ENOTDIR and e.value.filename == str(tmp_path / "a_file" / "model.safetensors")
    write_safetensors({"w": torch.ones(2, 2).t()}, tmp_path / "model.safetensors")  # non-contiguous is fine
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["w"], torch.ones(2, 2))


def test_a_dataset_one_rank_cannot_read_stops_every_rank_with_one_line(tmp_path):
    """A data_dir that one node cannot read (not mounted there, say): that rank's one-line error, and the other ranks
    stop with one line too, instead of a gloo traceback from the next collective they waited in."""
    script = tmp_path / "rank1_cannot_read.py"
    script.write_text(
        "import os, sys\nfrom hymo.training import trainer\nfrom hymo.training.data import DataError\nfrom hymo.train import main\n"
        "if os.environ['RANK'] == '1':\n"
        "    def unreadable(data_dir, vocab_size): raise DataError(f'{data_dir} has no manifest.json (on rank 1)')\n"
        "    trainer.check_compatible = unreadable\n"
        "main(sys.argv[1:])\n")
    r = torchrun(str(script), "seq_len=32", "micro_batch_size=2", "global_batch_size=4", "max_steps=2", "warmup_steps=1",
                 "run_dir=two", cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr  # (torchrun adds a traceback of its own for a child's non-zero exit)
    assert r.returncode != 0 and "hymo/training/trainer.py" not in out and "distributed_c10d" not in out, out[-3000:]
    assert "has no manifest.json (on rank 1)" in out and "another rank stopped on" in out, out[-3000:]
    assert not (tmp_path / "two").exists()  # nothing was written


@pytest.mark.parametrize("where", ["rank 1's own file", "rank 0's rename", "rank 0's model file", "rank 0's metrics line"])
def test_a_disk_error_on_one_rank_stops_every_rank_with_one_line(tmp_path, where):
    """A full disk (or a refused rename) on one rank while a checkpoint is written: every rank stops promptly with
    the one-line error, none waits at a barrier; the previous checkpoint stays, and the same command resumes from it."""
    args = [*TWO_RANK_RUN, "run_dir=two", "max_steps=6"]
    script = tmp_path / "fail_at_step_4.py"
    script.write_text(
        "import errno, os, sys\nfrom hymo.training import trainer\nfrom hymo.train import main\n"
        "rank, where = int(os.environ['RANK']), sys.argv.pop(1)\n"
        "if where == '1' and rank == 1:  # its rank1.pt hits a full disk at the second checkpoint\n"
        "    plain = trainer._rng_state\n"
        "    def rng():\n"
        "        if os.path.exists('two/checkpoints/step_000002'): raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "        return plain()\n"
        "    trainer._rng_state = rng\n"
        "if where == '0' and rank == 0:  # the rename of the second checkpoint is refused\n"
        "    real = os.replace\n"
        "    def replace(a, b):\n"
        "        if str(b).endswith('step_000004'): raise PermissionError(errno.EACCES, 'Permission denied', str(b))\n"
        "        return real(a, b)\n"
        "    trainer.os.replace = replace\n"
        "if where == 'm' and rank == 0:  # the final export meets a full disk (as safetensors reports it)\n"
        "    import safetensors, safetensors.torch\n"
        "    def full(*a, **k): raise safetensors.SafetensorError('Error while serializing: I/O error: No space left on "
        "device (os error 28)')\n"
        "    safetensors.torch.save_file = full\n"
        "if where == 'j' and rank == 0:  # step 3's metrics line meets a full disk\n"
        "    line = trainer.json_line\n"
        "    def full(m):\n"
        "        if m['step'] == 3: raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "        return line(m)\n"
        "    trainer.json_line = full\n"
        "main(sys.argv[1:])\n")
    r = torchrun(str(script), {"rank 1's own file": "1", "rank 0's rename": "0", "rank 0's model file": "m",
                               "rank 0's metrics line": "j"}[where], *args, cwd=tmp_path, timeout=300)
    # before: rank 0 sat at a barrier until rank 1's exit broke the connection (gloo: a traceback) or torchrun killed it
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "hymo/training/trainer.py" not in out, out[-3000:]  # no traceback through HyMo's code
    reason = "Permission denied" if where == "rank 0's rename" else "No space left on device"
    assert out.count(reason) >= 2 and f"{reason} (on another rank)" in out, out[-3000:]  # each rank says it
    last = "step_000006" if where == "rank 0's model file" else "step_000002"  # the export follows the final checkpoint
    # a refused rename leaves step_000004.tmp complete: the next start finishes the rename and resumes from it
    resumes = "step_000004" if where == "rank 0's rename" else last
    assert f"the same command resumes from two/checkpoints/{resumes}" in out, out[-3000:]
    from hymo.training.trainer import list_checkpoints
    assert [p.name for p in list_checkpoints(tmp_path / "two")][-1] == last
    assert not (tmp_path / "two" / "summary.json").exists()  # not finished: the resume finishes it
    again = torchrun("-m", "hymo.train", *args, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from two/checkpoints/{resumes}" in again.stdout
    assert [m["step"] for m in read_jsonl(tmp_path / "two" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["step"] == 6
    assert (tmp_path / "two" / "model.safetensors").exists()


def test_a_rank_killed_while_writing_its_checkpoint_file_leaves_no_complete_looking_checkpoint(tmp_path):
    """rank 0's meta.json marks a checkpoint folder complete, so it is written only once every rank's file is in.
    Before, rank 0 wrote it right after its own file: a rank killed half-way through its rankN.pt left a folder that
    the next start took for a complete one cut short at its rename, named it a checkpoint and failed to read it."""
    args = [*TWO_RANK_RUN, "run_dir=two", "max_steps=6"]
    script = tmp_path / "killed_at_step_4.py"
    script.write_text(
        "import io, os, sys, time, torch\nfrom hymo.train import main\n"
        "open(f'pid{os.environ[\"RANK\"]}', 'w').write(str(os.getpid()))\n"
        "if os.environ['RANK'] == '1':  # half of rank1.pt at the second checkpoint, then the whole job is killed\n"
        "    real = torch.save\n"
        "    def half(obj, f, *a, **k):\n"
        "        if str(getattr(f, 'name', '')).endswith('step_000004.tmp/rank1.pt'):\n"
        "            b = io.BytesIO(); real(obj, b, *a, **k); f.write(b.getvalue()[:len(b.getvalue()) // 2]); f.flush()\n"
        "            time.sleep(3)  # time enough for rank 0 to write whatever it writes alone\n"
        "            for pid in (os.getppid(), int(open('pid0').read()), os.getpid()): os.kill(pid, 9)  # a job's kill -9\n"
        "        return real(obj, f, *a, **k)\n"
        "    torch.save = half\n"
        "main(sys.argv[1:])\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
                        *args], cwd=tmp_path, env={**os.environ, "WANDB_MODE": "offline", **CPU_RANKS},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9 and (tmp_path / "two" / "checkpoints" / "step_000004.tmp" / "rank1.pt").exists()
    assert not (tmp_path / "two" / "checkpoints" / "step_000004.tmp" / "meta.json").exists()
    again = torchrun("-m", "hymo.train", *args, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step_000004.tmp, a checkpoint whose writing was cut short" in again.stdout and "was complete" not in again.stdout
    assert "resumed from two/checkpoints/step_000002" in again.stdout
    assert not list((tmp_path / "two" / "checkpoints").glob("damaged-*"))
    assert [m["step"] for m in read_jsonl(tmp_path / "two" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_resuming_another_folders_checkpoint_into_a_run_is_refused(tmp_path):
    """--resume with a checkpoint of folder A into folder B that holds a run of its own would mix the two runs (and
    prune B's newer checkpoints as soon as A's lineage saved): refused, with B untouched. An empty B continues A."""
    from hymo.config import ConfigError
    make(tmp_path / "a", max_steps=4, ckpt_every=2).fit()
    make(tmp_path / "b", max_steps=6, ckpt_every=3).fit(num_steps=3)
    before = sorted(p.name for p in (tmp_path / "b").rglob("*"))
    with pytest.raises(ConfigError, match="not a checkpoint of run_dir=.*holds a run of its own.*step_000003"):
        make(tmp_path / "b", resume=tmp_path / "a" / "checkpoints" / "step_000002", max_steps=6, ckpt_every=3)
    assert sorted(p.name for p in (tmp_path / "b").rglob("*")) == before
    c = make(tmp_path / "c", resume=tmp_path / "a" / "checkpoints" / "step_000002", max_steps=6, ckpt_every=2)
    assert c.step == 2 and c.branched_from == str((tmp_path / "a" / "checkpoints" / "step_000002").resolve())
    c.fit(num_steps=2)  # the branch trains on (step_4), then its job is requeued with the same command
    again = make(tmp_path / "c", resume=tmp_path / "a" / "checkpoints" / "step_000002", max_steps=6, ckpt_every=2)
    assert again.step == 4 and again.branched_from == c.branched_from  # it continues the branch, not step 2 again
    make(tmp_path / "e", max_steps=6, seed=1).fit(num_steps=3)  # a run that crashed before its first checkpoint
    e = make(tmp_path / "e", resume=tmp_path / "a" / "checkpoints" / "step_000002", max_steps=6, ckpt_every=2)
    e.fit(num_steps=2)  # the branch's metrics.jsonl holds its own steps only; the crashed run's lines are set aside
    assert [m["step"] for m in read_jsonl(tmp_path / "e" / "metrics.jsonl")] == [3, 4]
    assert [m["step"] for m in read_jsonl(tmp_path / "e" / "metrics.discarded.jsonl")] == [1, 2, 3]
    make(tmp_path / "f", max_steps=6, seed=1).fit(num_steps=3)  # the same, branched from a finished run: no step to train
    f = make(tmp_path / "f", resume=tmp_path / "a" / "checkpoints" / "step_000004", max_steps=4)
    assert f.fit() == [] and json.loads((tmp_path / "f" / "summary.json").read_text())["step"] == 4
    assert not read_jsonl(tmp_path / "f" / "metrics.jsonl") and len(read_jsonl(tmp_path / "f" / "metrics.discarded.jsonl")) == 3
    with pytest.raises(ConfigError, match="nope does not exist"):
        make(tmp_path / "d", resume=tmp_path / "nope", max_steps=6)
    with pytest.raises(ConfigError, match="cut short"):  # a .tmp folder is never a checkpoint to resume
        shutil.copytree(tmp_path / "a" / "checkpoints" / "step_000004", tmp_path / "a" / "checkpoints" / "step_000006.tmp")
        make(tmp_path / "d", resume=tmp_path / "a" / "checkpoints" / "step_000006.tmp", max_steps=6)


def test_run_folders_that_cannot_be_used_are_refused_in_one_line(tmp_path, monkeypatch):
    from hymo.config import ConfigError
    from hymo.training.data import DataError, prepare_default
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=r"cannot create run_dir=.*a_file/run \(Not a directory\)"):
        make(tmp_path / "a_file" / "run")
    data = prepare_default(vocab_size=2048, progress=False)  # the bundled corpus, as the tiny preset trains on it
    with pytest.raises(ConfigError, match="run_dir and data_dir are the same folder"):
        make(data, data_dir=str(data))
    if not torch.cuda.is_available():  # one CPU process computes in fp32: bf16 would be silently ignored
        with pytest.raises(ConfigError, match="precision=bf16 on one CPU process"): make(tmp_path / "run", precision="bf16")
    monkeypatch.setenv("HYMO_CACHE", str(tmp_path / "a_file" / "cache"))  # a cache that cannot be made
    with pytest.raises(DataError, match=r"cannot write the data cache .*a_file.* \(Not a directory\): set HYMO_CACHE"):
        make(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_partial_checkpoint_folder_is_removed_when_the_run_resumes(tmp_path):
    """A kill, or a second Ctrl-C, while a checkpoint is written leaves step_N.tmp: never read, and at 750M many GB.
    The next start in that folder removes it (the lock says no other process is writing it)."""
    make(tmp_path / "run", max_steps=4, ckpt_every=2).fit(num_steps=2)
    ckpts = tmp_path / "run" / "checkpoints"
    partial = ckpts / "step_000003.tmp"
    partial.mkdir(); (partial / "__0_0.distcp").write_bytes(b"cut short")
    older = ckpts / "step_000001.tmp"
    shutil.copytree(ckpts / "step_000002", older)  # complete, but older than a checkpoint: nothing to keep
    t = make(tmp_path / "run", max_steps=4, ckpt_every=2)
    assert t.step == 2 and not partial.exists() and not older.exists()
    assert [p.name for p in ckpts.iterdir()] == ["step_000002"]
    # complete and newer than every checkpoint, but its meta.json is of another step: left (and said)
    shutil.copytree(ckpts / "step_000002", ckpts / "step_000005.tmp")
    make(tmp_path / "run", max_steps=4, ckpt_every=2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000005.tmp"]


def test_a_checkpoint_is_never_deleted_before_its_successor_is_in_place(tmp_path, monkeypatch):
    """Writing a step's checkpoint again (the end of a run resumed at its end) sets the old one aside until the new one is
    renamed into place: a Ctrl-C between the two leaves a complete copy. And `finish` does not write again the checkpoint
    it was just loaded from (deleting summary.json to export again must not put the run's only checkpoint at risk)."""
    from hymo.training import trainer as tr
    t = make(tmp_path / "run", max_steps=2, warmup_steps=1)
    t.fit()
    ckpts = tmp_path / "run" / "checkpoints"
    real = os.replace
    def interrupted(a, b):
        if str(a).endswith("step_000002.tmp"): raise KeyboardInterrupt
        return real(a, b)
    monkeypatch.setattr(tr.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt): t.save()
    assert (ckpts / "replaced-step_000002" / "meta.json").exists()  # the old copy, whole
    monkeypatch.setattr(tr.os, "replace", real)
    real_replace = ckpts / "replaced-step_000002"; real(real_replace, ckpts / "step_000002")
    t.save()  # uninterrupted: the new copy in place, the old one removed
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002"]
    (tmp_path / "run" / "summary.json").unlink()
    again = make(tmp_path / "run", max_steps=2, warmup_steps=1)
    monkeypatch.setattr(tr.Trainer, "save", lambda self: pytest.fail("finish wrote the loaded checkpoint again"))
    again.fit()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["step"] == 2


def test_metrics_lines_are_json_and_a_finished_run_has_its_final_config(tmp_path, monkeypatch):
    """A skipped step's NaN loss is written as null (JSON has no NaN, and jq refuses it); a run finished by a resume
    that trains no step (its finish was cut short after the final checkpoint) writes the config it finished with; the
    weights file is readable like the run's other files."""
    import stat
    t = make(tmp_path / "run", max_steps=2, warmup_steps=1)
    forward, finish = type(t.model).forward, type(t).finish
    def nan_at_step_2(self, tokens, targets=None, cu_seqlens=None, **kw):
        loss, parts = forward(self, tokens, targets, cu_seqlens, **kw)
        return (loss * float("nan"), parts) if t.step == 1 else (loss, parts)
    monkeypatch.setattr(type(t.model), "forward", nan_at_step_2)
    monkeypatch.setattr(type(t), "finish", lambda self: None)  # stopped after the final checkpoint, before the finish
    t.fit()
    monkeypatch.setattr(type(t.model), "forward", forward)
    monkeypatch.setattr(type(t), "finish", finish)
    assert not (tmp_path / "run" / "summary.json").exists()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert "NaN" not in lines[1] and json.loads(lines[1])["loss"] is None and json.loads(lines[0])["loss"] > 0
    make(tmp_path / "run", max_steps=2, warmup_steps=1, global_batch_size=8).fit()  # finishes at step 2 without training a step
    assert load_config(tmp_path / "run" / "config.yaml").train.global_batch_size == 8
    umask = os.umask(0); os.umask(umask)
    assert stat.S_IMODE((tmp_path / "run" / "model.safetensors").stat().st_mode) == 0o666 & ~umask


def test_generate_on_damaged_run_files_says_what_to_do_and_the_advice_works(tmp_path):
    from hymo.config import ConfigError
    from hymo.generate import load_run
    from hymo.train import main
    run = tmp_path / "run"
    main(_cli_args(run, max_steps=2, warmup_steps=1))
    good = (run / "tokenizer.json").read_bytes()
    (run / "tokenizer.json").write_text('{"cut')
    with pytest.raises(ConfigError, match="tokenizer.json cannot be read .*copy it again"): load_run(run)
    (run / "tokenizer.json").write_bytes(good)
    (run / "model.safetensors").write_bytes(b"cut short")
    with pytest.raises(ConfigError, match=r"model.safetensors has changed since the run wrote it \(9 bytes") as e: load_run(run)
    assert (f"Copy it again, or delete it: python -m hymo.train --config {run / 'config.yaml'} run_dir={run} writes the "
            "missing files again from the final checkpoint") in str(e.value)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "model_file"}))  # older run
    with pytest.raises(ConfigError, match="model.safetensors cannot be read .*or delete it: python -m hymo.train"): load_run(run)
    (run / "model.safetensors").unlink()  # the advice, followed: the final checkpoint is exported again
    main(["--config", str(run / "config.yaml"), f"run_dir={run}"])
    model, tok = load_run(run)
    assert json.loads((run / "summary.json").read_text())["step"] == 2 and tok.get_vocab_size() == 2048
    with pytest.raises(ConfigError, match="nope does not exist: give a finished run's folder"): load_run(tmp_path / "nope")
    import hymo.generate as gen
    def interrupted(*a, **k): raise KeyboardInterrupt
    gen_text = gen.generate_text
    try:
        gen.generate_text = interrupted  # Ctrl-C while it generates: one line, exit 130
        with pytest.raises(SystemExit) as e: gen.main([str(run), "--tokens", "5"])
        assert e.value.code == 130
    finally: gen.generate_text = gen_text
    with pytest.raises(SystemExit) as e: gen.main([str(run), "--prompt", b"\xff\xfe".decode("utf-8", "surrogateescape")])
    assert e.value.code == 2  # bytes that are not UTF-8, as argv gives them to Python: one line, not a TypeError


def test_metrics_lines_after_the_resumed_step_are_kept_aside_even_when_damaged(tmp_path):
    from hymo.training.trainer import trim_metrics
    garbage = b"\x8b\x00\xff garbage\n"
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2}\n' + garbage)
    trim_metrics(tmp_path, 1, log=lambda m: None)
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n'
    assert (tmp_path / "metrics.discarded.jsonl").read_bytes() == b'{"step": 2}\n' + garbage  # byte for byte


def test_ctrl_c_while_torch_is_imported_ends_in_one_line(tmp_path, monkeypatch, capsys):
    "The first seconds of `python -m hymo.train` import torch and the trainer: a Ctrl-C there is one line, exit 130."
    import importlib.abc
    from hymo.train import main
    class Interrupting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hymo.training.trainer": raise KeyboardInterrupt
    monkeypatch.delitem(sys.modules, "hymo.training.trainer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    with pytest.raises(SystemExit) as e: main(_cli_args(tmp_path / "run"))  # were it not interrupted: a tiny run here
    assert e.value.code == 130 and "interrupted before training began" in capsys.readouterr().err


def test_a_refusal_on_rank_0_alone_is_one_line_on_every_rank(tmp_path):
    """A run folder only rank 0 creates, and cannot (a file in its path): every rank ends in one line, exit 2, with no
    traceback from rank 1 (its error used to be a bare RuntimeError for any errno but the four disk ones)."""
    (tmp_path / "afile").write_text("")
    r = torchrun("-m", "hymo.train", *_cli_args("afile/run", micro_batch_size=2), cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "hymo/training/trainer.py" not in out, out[-3000:]
    assert "cannot create run_dir=afile/run (Not a directory)" in out, out[-3000:]
    assert "cannot create run_dir=afile/run (Not a directory (on another rank))" in out, out[-3000:]
    assert "usage:" not in out  # under torchrun a refusal is one line a rank, without the usage block


def test_overrides_may_come_after_the_options(tmp_path, capsys):
    "key=value before and after --no-resume (or --resume X, --config): every one is applied, none is an 'unknown option'."
    from hymo.train import main
    with pytest.raises(SystemExit) as e: main(["max_steps=100", "--no-resume", "seq_len=2", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "use seq_len > mtp_depth" in err and "unknown option" not in err, err


def test_a_folder_of_other_files_is_refused_not_overwritten(tmp_path):
    "run_dir that holds files but nothing of a run (a config.yaml of the user's): refused before anything is written."
    from hymo.config import ConfigError
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "config.yaml").write_text("my important config")
    with pytest.raises(ConfigError, match="not a HyMo run folder"): make(folder, max_steps=4)
    assert [p.name for p in folder.iterdir()] == ["config.yaml"] and (folder / "config.yaml").read_text() == "my important config"
    for common in ("wandb", "checkpoints"):  # a project's own folders of these names do not make it a run's
        (folder / common / "latest").mkdir(parents=True)
    with pytest.raises(ConfigError, match="not a HyMo run folder"): make(folder, max_steps=4)
    assert (folder / "config.yaml").read_text() == "my important config"
    (folder / "metrics.jsonl").write_text("")  # a run that crashed before its first checkpoint: its folder, accepted
    assert make(folder, max_steps=4).step == 0
    hidden = tmp_path / "fresh"
    hidden.mkdir()
    (hidden / ".DS_Store").write_text("")  # hidden files alone: nobody's work, the folder counts as empty
    assert make(hidden, max_steps=4).step == 0


def test_a_stop_during_the_last_step_says_the_final_model_is_still_to_write(tmp_path, monkeypatch, capsys):
    """The last step is trained and saved, but `finish` (validation, model.safetensors, summary.json) is left: the line
    says so, the same command writes it, and until then `generate` would say its model is older than the checkpoints."""
    import signal
    from hymo.generate import newer_checkpoint_note
    from hymo.train import main
    from hymo.training.trainer import Trainer
    run, real = tmp_path / "run", Trainer.train_step
    main(_cli_args(str(run), max_steps=3))  # a finished run ...
    def step_then_stop(self):
        if self.step == 4: self.request_stop(signal.SIGINT)  # ... resumed to 5 steps, Ctrl-C during the last
        return real(self)
    monkeypatch.setattr(Trainer, "train_step", step_then_stop)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e: main(_cli_args(str(run), max_steps=5))
    out = capsys.readouterr().out
    assert e.value.code == 130 and "stopped by SIGINT after the last step (5), before the final model was written; " \
        f"the same command resumes from {run / 'checkpoints' / 'step_000005'} and writes it" in out, out[-1500:]
    assert json.loads((run / "summary.json").read_text())["step"] == 3
    assert "is the model of step 3, but the run has checkpoints up to step 5" in newer_checkpoint_note(run)
    import fcntl
    from hymo.training import trainer as tr
    tr._HELD_LOCKS.pop(run.resolve()).close()  # this process's trainers are done with the folder ...
    assert newer_checkpoint_note(run) is not None and "training in" not in newer_checkpoint_note(run)
    with open(run / ".lock", "a+") as held:  # ... and another process trains in it now (its lock held)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 12345 on somehost\n"); held.flush()
        assert "a run is training in" in newer_checkpoint_note(run) and "pid 12345 on somehost" in newer_checkpoint_note(run)
    monkeypatch.setattr(Trainer, "train_step", real)
    main(_cli_args(str(run), max_steps=5))
    assert json.loads((run / "summary.json").read_text())["step"] == 5 and newer_checkpoint_note(run) is None


# ---------------------------------------------------------------- from mutation testing: each test fails on a
# plausible change to the trainer that no test above caught

def read_steps(path):
    return [json.loads(l)["step"] for l in Path(path).read_text().splitlines()]


def fake_ckpt(folder: Path, step: int, world_size: int = 1):
    "The files `Trainer._whole` looks for, with a meta.json of `step` (no weights: for the pure functions)."
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": step, "world_size": world_size}))
    (folder / ".metadata").write_bytes(b"")
    for r in range(world_size): (folder / f"rank{r}.pt").write_bytes(b"")
    return folder


# ---------------------------------------------------------------- pure functions

def test_trim_metrics_says_how_many_lines_it_set_aside(tmp_path):
    "M02: the note of trim_metrics not emitted."
    from hymo.training.trainer import trim_metrics
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    said = []
    trim_metrics(tmp_path, 1, log=said.append)
    assert said == ["metrics.jsonl: 2 lines after step 1 (steps this run redoes) moved to metrics.discarded.jsonl"]
    trim_metrics(tmp_path, 1, log=said.append)  # nothing more to set aside: no second note
    assert len(said) == 1


def test_is_run_folder_knows_every_name_this_code_gives_a_checkpoint(tmp_path):
    "M03: a folder whose checkpoints/ holds only a `replaced-step_...` copy (a Ctrl-C while a step was re-saved) is a run's."
    from hymo.training.trainer import is_run_folder
    for name in ("step_000002", "step_000002.tmp", "damaged-step_000002", "superseded-step_000002-2",
                 "replaced-step_000002"):
        d = tmp_path / name
        (d / "checkpoints" / name).mkdir(parents=True)
        assert is_run_folder(d), name
    d = tmp_path / "other"; (d / "checkpoints" / "latest").mkdir(parents=True)
    assert not is_run_folder(d)


def test_a_complete_tmp_of_a_step_that_has_its_checkpoint_is_not_a_cut_short_rename(tmp_path):
    """M06: `> newest` -> `>= newest`. A re-save of the newest step killed before its publish leaves step_N.tmp beside
    step_N: renaming it over step_N fails (a non-empty folder), so every start of the run would crash."""
    from hymo.training.trainer import cut_short_renames
    ck = tmp_path / "checkpoints"
    fake_ckpt(ck / "step_000004", 4)
    fake_ckpt(ck / "step_000004.tmp", 4)
    assert cut_short_renames(tmp_path) == []
    fake_ckpt(ck / "step_000006.tmp", 6)
    assert cut_short_renames(tmp_path) == [ck / "step_000006.tmp"]


def test_set_aside_never_renames_over_an_earlier_copy(tmp_path):
    "M09: `while dest.exists()` -> `if`: the third checkpoint of one name damaged stays in place (os.replace fails)."
    from hymo.training.trainer import Dist, Trainer
    ck = tmp_path / "checkpoints"
    for name in ("damaged-step_000004", "damaged-step_000004-2"): fake_ckpt(ck / name, 4)
    fake_ckpt(ck / "step_000004", 4)
    said = []
    Trainer._set_aside(SimpleNamespace(d=Dist(), log=said.append), [ck / "step_000004"], "damaged", "x")
    assert not (ck / "step_000004").exists() and (ck / "damaged-step_000004-3" / "meta.json").exists(), said


def test_step_after_reads_no_window_twice_and_starts_on_an_optimiser_step():
    """M16 (ceil -> floor) and M17 (no round-up to an optimiser step): a saved run that read 6 windows continues, in
    micro-batches of 4, at micro-step 2 (windows 8..), not 1 (windows 4, 5 read again); with 2 micro-steps a step it
    starts at a step boundary (micro-step 4 of 2 x 2 windows), not mid-step (3)."""
    saved = {"step": 3, "world_size": 1, "micro_batch_size": 2, "accum": 1}  # 6 windows read
    assert _bare_loader(1000, 1, 4, 1).step_after(saved) == 2
    assert _bare_loader(1000, 1, 2, 2).step_after(saved) == 4
    assert _bare_loader(1000, 1, 2, 2).step_after({"optimizer_step": 3, "global_batch_size": 2}) == 4  # meta.json's


def test_metric_line_says_a_step_was_skipped():
    "M19: the skipped-step note not emitted."
    from hymo.training.trainer import metric_line
    m = dict(step=3, loss=float("nan"), lr_mult=1.0, grad_norm=float("nan"), tokens_per_s=10.0, mfu=None, skipped=True)
    assert metric_line(m, 10).endswith("skipped: non-finite loss or gradient")
    assert "skipped" not in metric_line({**m, "loss": 1.0, "grad_norm": 1.0, "skipped": False}, 10)


def test_metric_line_shows_the_moe_blocks_drops_only_when_they_matter():
    "A capacity factor far too low (0.01 dropped 98 % of the routed assignments) was silent: only metrics.jsonl had it."
    from hymo.training.trainer import metric_line
    m = dict(step=3, loss=1.0, lr_mult=1.0, grad_norm=1.0, tokens_per_s=10.0, mfu=None, skipped=False)
    m |= {"moe0/moe_drop_frac": 0.0, "moe0/moe_load_max_mean": 1.2, "moe1/moe_drop_frac": 0.984}
    assert metric_line(m, 10).endswith(" | moe dropped 98.4%")
    assert "moe" not in metric_line({**m, "moe1/moe_drop_frac": 0.005}, 10)  # the few a capacity of 1.5 cuts: not news


def test_peak_of_finds_the_gpu_by_a_part_of_its_name():
    "M20: `k in gpu_name` reversed: every real device name (longer than the key) is unknown, and MFU is never shown."
    from hymo.training.trainer import peak_of
    assert peak_of("NVIDIA H100 80GB HBM3") == 989e12 and peak_of("NVIDIA H100 PCIe") == 756e12
    assert peak_of("NVIDIA A100-SXM4-80GB") == 312e12 and peak_of("AMD Instinct MI300X") is None
    assert peak_of("NVIDIA H200") == 989e12 and peak_of("NVIDIA H200 NVL") == 835e12  # the NVL's lower peak, not the SXM's


def test_the_lock_of_a_folder_made_again_is_taken_again(tmp_path):
    """M24: `_held_here` without its same-file check: a run folder deleted and made again in one process (a notebook) is
    taken as locked already, and its new .lock is never locked: another process could train in it at once."""
    from hymo.training.trainer import lock_run_dir, run_dir_holder
    run = tmp_path / "run"; run.mkdir()
    assert lock_run_dir(run) is None
    shutil.rmtree(run); run.mkdir()
    assert lock_run_dir(run) is None and run_dir_holder(run) is None  # ours, in this process
    r = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from hymo.training.trainer import "
                        "run_dir_holder; print(run_dir_holder(Path(sys.argv[1])))", str(run)],
                       capture_output=True, text=True, timeout=300)
    assert r.stdout.strip().startswith(f"pid {os.getpid()} on"), (r.stdout, r.stderr[-2000:])


def test_a_batch_that_does_not_split_over_the_ranks_gets_a_fix_that_does():
    """M26 (ceil -> floor: global_batch_size=0 for one micro-batch on two ranks) and M27 (micro_batch_size=G // W offered
    when G is not a multiple of W: it would change the global batch)."""
    from hymo.training.trainer import split_micro_batches
    def fix(W, **over):
        with pytest.raises(ConfigError) as e: split_micro_batches(load_config("hymo_tiny", **over).train, W)
        return str(e.value).split("e.g. ")[1]
    assert fix(global_batch_size=4, micro_batch_size=4, W=2) == "global_batch_size=8 or micro_batch_size=2"
    assert fix(global_batch_size=12, micro_batch_size=4, W=2) == "global_batch_size=16 or micro_batch_size=6"
    assert fix(global_batch_size=6, micro_batch_size=2, W=4) == "global_batch_size=8"


def test_an_override_value_may_hold_an_equals_sign():
    "M28: split at the last '=' instead of the first: data_dir=/data/v=2 becomes the unknown key 'data_dir=/data/v'."
    from hymo.train import parse_overrides
    assert parse_overrides(["data_dir=/data/v=2", "train.run_dir=a=b"]) == {"data_dir": "/data/v=2", "train.run_dir": "a=b"}


def test_the_ending_line_names_a_checkpoint_whose_rename_was_cut_short(tmp_path):
    """M31: a stop during a checkpoint's rename leaves a complete step_N.tmp, which the next start renames and resumes
    from: the ending line must name it, not say "no checkpoint was written" (or an older one)."""
    from hymo.train import _resume_from
    run = tmp_path / "run"
    cfg = load_config("hymo_tiny", run_dir=str(run))
    line = lambda: _resume_from(SimpleNamespace(run_dir=run), cfg, Namespace(config="hymo_tiny", resume=None, no_resume=False))
    fake_ckpt(run / "checkpoints" / "step_000009.tmp", 9)
    assert line() == f"the same command resumes from {run / 'checkpoints' / 'step_000009'}"
    fake_ckpt(run / "checkpoints" / "step_000004", 4)
    assert line() == f"the same command resumes from {run / 'checkpoints' / 'step_000009'}"


def test_a_resume_that_raises_the_learning_rate_says_it_jumps():
    """M33: `abs(a - b)` -> `a - b`: extending a finished (decayed) run to more steps jumps the learning rate back up,
    the case the note's advice is about; it was said only for a jump down."""
    from hymo.training.trainer import resume_changes
    old = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "warmup_steps": 2, "decay_fraction": 0.2})
    longer = load_config("hymo_tiny", **{**FAST, "max_steps": 40, "warmup_steps": 2, "decay_fraction": 0.2})
    notes = resume_changes(json.loads(json.dumps(old.to_dict())), longer.model, longer.train, step=20)
    assert any("learning rate after step 20 jumps from" in n and "to 1.000 of its peak" in n for n in notes), notes
    assert any("to extend a finished run without the jump" in n for n in notes), notes
    notes = resume_changes(json.loads(json.dumps(longer.to_dict())), old.model, old.train, step=18)  # and down
    assert any("jumps from 1.000" in n for n in notes), notes
    assert not any("extend" in n for n in notes), notes  # a lowered max_steps extends nothing: no advice to


def test_training_a_finished_run_further_keeps_its_checkpoint_from_before_the_decay(tmp_path):
    """Pruning keeps the newest checkpoint from before the decay; the warning of an extended run advised resuming one,
    which the extended run's saves then pruned: it is set aside as before-decay-step_..., named, and resuming it
    continues without a jump."""
    run, keep = tmp_path / "run", dict(ckpt_every=2, keep_last_k=2)
    jump = lambda t: next(w for w in t.resume_warnings if "jumps from" in w)
    make(run, max_steps=10, **keep).fit()  # the decay's first step is 7: 8 and 10 are the newest two, 6 the last before it
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000006", "step_000008", "step_000010"]
    branch = make(tmp_path / "branch", resume=str(ckpts / "step_000010"), max_steps=20, **keep)
    assert jump(branch).endswith(f": {ckpts / 'step_000006'} is one (continue from it with a new run_dir=...)"), jump(branch)
    assert (ckpts / "step_000006").is_dir()  # another run's folder is left as it is
    keep = dict(ckpt_every=0, keep_last_k=2)  # the extension saves only at its end
    t = make(run, max_steps=20, **keep)
    before = ckpts / "before-decay-step_000006"
    assert jump(t).endswith(f"to extend a finished run without the jump, resume a checkpoint from before its decay: "
                            f"{before} is one, kept for that (--resume {before})"), jump(t)
    t.fit()  # its save at 20 prunes 8, which trained decayed steps, as 10 did
    assert sorted(p.name for p in ckpts.iterdir()) == ["before-decay-step_000006", "step_000010", "step_000020"]
    twice = make(run, max_steps=40, **keep)  # extended again: the one kept is named, no other is set aside
    assert jump(twice).endswith(f"{before} is one, kept for that (--resume {before})"), jump(twice)
    assert sorted(p.name for p in ckpts.iterdir()) == ["before-decay-step_000006", "step_000010", "step_000020"]
    again = make(run, resume=str(before), max_steps=40, **keep)
    assert again.step == 6 and not any("jumps" in w for w in again.resume_warnings), again.resume_warnings
    assert sorted(p.name for p in ckpts.iterdir()) == [  # its plain name back; the newer ones set aside
        "step_000006", "superseded-step_000010", "superseded-step_000020"]
    again.fit()  # on to 40 from there; then its old name once more, with other settings: a new rewind to 6, not step 40
    third = make(run, resume=str(before), max_steps=24, **keep)
    assert third.step == 6 and (ckpts / "superseded-step_000040").is_dir(), sorted(p.name for p in ckpts.iterdir())


def test_a_damaged_checkpoint_from_before_the_decay_is_passed_over(tmp_path):
    "One whose files fail their CRC-32 is not named for an extension (its --resume would fail): the one before it is."
    run, keep = tmp_path / "run", dict(ckpt_every=2, keep_last_k=10)
    make(run, max_steps=8, **keep).fit()
    shard = next((run / "checkpoints" / "step_000006").glob("*.distcp"))  # the newest that trained no decayed step
    data = bytearray(shard.read_bytes()); data[len(data) // 2] ^= 0xFF; shard.write_bytes(bytes(data))
    t = make(run, max_steps=16, **keep)
    before = run / "checkpoints" / "before-decay-step_000004"
    assert next(w for w in t.resume_warnings if "jumps from" in w).endswith(f"{before} is one, kept for that (--resume {before})")
    assert before.is_dir() and (run / "checkpoints" / "step_000006").is_dir()
    shutil.rmtree(run / "checkpoints" / "step_000002"); shutil.rmtree(before)  # only the damaged one left from before
    t = make(run, max_steps=24, **keep)
    assert re.search(r"step_000006 is one, but cannot be read \(.*CRC-32.*\): restore it from a copy$",
                     next(w for w in t.resume_warnings if "jumps from" in w))


def test_an_extended_run_without_a_checkpoint_from_before_its_decay_says_so(tmp_path):
    "Only the final checkpoint kept (ckpt_every=0): the warning says none is kept, and nothing is set aside."
    run = tmp_path / "run"
    make(run, max_steps=8).fit()
    t = make(run, max_steps=16)
    jump = next(w for w in t.resume_warnings if "jumps from" in w)
    assert jump.endswith(f": {run / 'checkpoints'} keeps none (ckpt_every and keep_last_k decide which are kept)"), jump
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000008"]


def test_a_resume_in_another_folder_is_not_a_changed_setting():
    "M34: run_dir compared like a training setting: a run resumed under a renamed or given run_dir warns of it."
    from hymo.training.trainer import resume_changes
    cfg = load_config("hymo_tiny", **{**FAST, "max_steps": 20})
    saved = json.loads(json.dumps(load_config("hymo_tiny", **{**FAST, "max_steps": 20, "run_dir": "runs/old"}).to_dict()))
    assert resume_changes(saved, cfg.model, cfg.train, step=3) == []


# ---------------------------------------------------------------- with a tiny run (seconds each)

def test_a_finished_run_shorter_than_its_checkpoint_is_told_its_own_length(tmp_path):
    """M12: the advice of the max_steps refusal for a finished run's checkpoint: its own max_steps (which re-exports it),
    not one more step (which would train a step past the end of its decay)."""
    make(tmp_path / "run", max_steps=4, warmup_steps=1).fit()
    with pytest.raises(ConfigError, match=r"at step 4 of a run planned for 4: with max_steps=3 there is nothing to train\. "
                                          r"Give max_steps=4 or more"):  # it had its decay: not said otherwise
        make(tmp_path / "run", max_steps=3, warmup_steps=1)


def test_a_resharded_resume_continues_after_every_window_the_saved_loader_read(tmp_path):
    """M15: on another number of ranks (rank0.pt not this rank's), the position comes from rank 0's saved loader, not
    from meta.json's step x the last global batch (which reads again the windows of a change of global batch)."""
    make(tmp_path / "a", max_steps=8, micro_batch_size=4, global_batch_size=8, ckpt_every=2).fit(2)
    make(tmp_path / "a", max_steps=8, micro_batch_size=4, global_batch_size=4, ckpt_every=2).fit(2)  # 24 windows read
    meta = tmp_path / "a" / "checkpoints" / "step_000004" / "meta.json"
    edit_meta(meta, world_size=2)  # as if written by 2 ranks
    t = make(tmp_path / "a", max_steps=8, micro_batch_size=2, global_batch_size=4)
    assert (t.step, t.train_loader.step) == (4, 24 // 2)


def test_a_branch_keeps_its_metrics_over_several_fit_calls(tmp_path):
    """M21: `foreign_start` not reset after the branch's first write: the next `fit` call (a notebook's) sets the
    branch's own metrics aside as if they were the crashed run's."""
    make(tmp_path / "a", max_steps=4, ckpt_every=2).fit(2)
    make(tmp_path / "e", max_steps=6, seed=1).fit(num_steps=1)  # a run that crashed before its first checkpoint
    e = make(tmp_path / "e", resume=tmp_path / "a" / "checkpoints" / "step_000002", max_steps=6)
    e.fit(num_steps=1); e.fit(num_steps=1)
    assert read_steps(tmp_path / "e" / "metrics.jsonl") == [3, 4]
    assert read_steps(tmp_path / "e" / "metrics.discarded.jsonl") == [1]


def test_a_resume_sets_aside_the_metrics_of_the_steps_it_redoes(tmp_path):
    "M22: lines after the checkpoint's step (a crash after step 3, checkpoint at 2) must go; step 3 is trained again."
    make(tmp_path / "run", max_steps=6, ckpt_every=2).fit(3)
    make(tmp_path / "run", max_steps=6, ckpt_every=2).fit(1)
    assert read_steps(tmp_path / "run" / "metrics.jsonl") == [1, 2, 3]
    assert read_steps(tmp_path / "run" / "metrics.discarded.jsonl") == [3]


def test_a_stop_that_is_not_a_signal_exits_as_a_sigterm(tmp_path, monkeypatch, capsys):
    """M30: a stop with no signal of its own (another rank's signal, `request_stop()`) exits 143, as a scheduler's
    SIGTERM, not 130 (a Ctrl-C)."""
    from hymo.train import main
    from hymo.training.trainer import Trainer
    real = Trainer.train_step
    def step_then_stop(self):
        m = real(self)
        if self.step == 1: self.request_stop("a stop on another rank")
        return m
    monkeypatch.setattr(Trainer, "train_step", step_then_stop)
    args = [f"{k}={v}" for k, v in {**FAST, "max_steps": 4, "run_dir": tmp_path / "run"}.items()]
    with pytest.raises(SystemExit) as e: main(args)
    assert e.value.code == 128 + signal.SIGTERM and "stopped by a stop on another rank at step 1" in capsys.readouterr().out


def test_a_stop_asked_for_before_fit_does_not_stop_it(tmp_path):
    "M36: `stopped_by` not reset at the start of `fit`: after a stop, the next `fit()` in a notebook trains one step and stops."
    t = make(tmp_path / "run", max_steps=6)
    t.request_stop("a request")
    assert [m["step"] for m in t.fit(num_steps=2)] == [1, 2] and t.stopped_by is None


# Found by mutation testing trainer.py and train.py: each docstring names the mutant (an id of that pass) it fails on
def test_a_model_setting_of_the_same_shapes_is_a_warning_not_a_refusal():
    "rc3 (refuse any model change) and rc4 (model changes not warned): moe_capacity_factor=None after an OOM, say."
    from hymo.training.trainer import resume_changes
    old = load_config("hymo_tiny", **{**FAST, "max_steps": 20})
    new = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "moe_capacity_factor": None})
    notes = resume_changes(json.loads(json.dumps(old.to_dict())), new.model, new.train, step=3)
    assert any(n.startswith("model settings differ") and "moe_capacity_factor" in n and "-> None" in n for n in notes), notes


def test_a_small_jump_of_the_learning_rate_is_said_too():
    "rc8 (`> 1e-9` -> `> 0.5`): a longer decay at a resume moves the rate mid-decay from 0.553 to 0.423 of the peak."
    from hymo.training.trainer import resume_changes
    old = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "decay_fraction": 0.2})
    new = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "decay_fraction": 0.25})
    notes = resume_changes(json.loads(json.dumps(old.to_dict())), new.model, new.train, step=16)
    assert any("jumps from 0.553 to 0.423" in n for n in notes), notes


def test_checkpoints_past_six_digits_are_ordered_by_step(tmp_path):
    "lc3 (sorted by name) and cs1 (last 6 digits): step_1000000 is newer than step_999999, not older."
    from hymo.training.trainer import checkpoint_step, list_checkpoints
    ck = tmp_path / "checkpoints"
    for s in (100, 999999, 1000000): fake_ckpt(ck / f"step_{s:06d}", s)
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [100, 999999, 1000000]


def test_a_file_named_like_a_checkpoint_is_not_one(tmp_path):
    "lc2 (no is_dir): a stray file step_000010 was listed as the newest checkpoint."
    from hymo.training.trainer import list_checkpoints
    fake_ckpt(tmp_path / "checkpoints" / "step_000004", 4)
    (tmp_path / "checkpoints" / "step_000010").write_text("not a folder")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004"]


def test_a_tmp_missing_a_rank_file_or_metadata_is_not_a_cut_short_rename(tmp_path):
    "cr2 (no _whole), wh1 (only rank 0's file checked), wh2 (no .metadata check): an incomplete .tmp must not be renamed."
    from hymo.training.trainer import cut_short_renames
    tmp = fake_ckpt(tmp_path / "checkpoints" / "step_000006.tmp", 6, world_size=2)
    assert cut_short_renames(tmp_path) == [tmp]
    (tmp / "rank1.pt").unlink()
    assert cut_short_renames(tmp_path) == []
    (tmp / "rank1.pt").write_bytes(b""); (tmp / ".metadata").unlink()
    assert cut_short_renames(tmp_path) == []


def test_a_run_folder_with_only_its_wandb_id_is_a_run_folder(tmp_path):
    "ir1 (only metrics.jsonl counted): a wandb run that crashed before its first step is still a HyMo run folder."
    from hymo.training.trainer import is_run_folder
    (tmp_path / "a" / "wandb").mkdir(parents=True); (tmp_path / "a" / "wandb" / "hymo_run_id").write_text("x")
    (tmp_path / "b").mkdir(); (tmp_path / "b" / ".lock").write_text("")
    assert is_run_folder(tmp_path / "a") and is_run_folder(tmp_path / "b")


def test_a_complete_tmp_of_the_newest_step_is_removed_not_kept_as_newer(tmp_path):
    "rp1 (`>` -> `>=`): a re-save of the newest step killed before its rename is only space; it was kept with a false warning."
    from hymo.training.trainer import Dist, Trainer
    fake_ckpt(tmp_path / "checkpoints" / "step_000004", 4)
    tmp = fake_ckpt(tmp_path / "checkpoints" / "step_000004.tmp", 4)
    said = []
    Trainer._remove_partial_checkpoints(SimpleNamespace(d=Dist(), run_dir=tmp_path, _whole=Trainer._whole, log=said.append))
    assert not tmp.exists() and not any("newer than every checkpoint" in s for s in said), said


def test_a_resharded_resume_without_a_readable_rank0_file_continues_from_meta(tmp_path):
    "sl2 (no meta.json fallback): another number of ranks and no rank0.pt restarted the data at window 0."
    make(tmp_path / "a", max_steps=8, micro_batch_size=4, global_batch_size=8, ckpt_every=2).fit(2)  # 16 windows read
    ck = tmp_path / "a" / "checkpoints" / "step_000002"
    without_file_sums(ck, world_size=2)  # a checkpoint that records its files has rank0.pt missing as damage
    (ck / "rank0.pt").unlink()
    t = make(tmp_path / "a", max_steps=8, micro_batch_size=4, global_batch_size=8)
    assert (t.step, t.train_loader.step) == (2, 16 // 4)


def test_an_unchanged_accumulation_resumes_without_a_warning(tmp_path):
    "sl4 (the saved accum overridden by 1): a plain resume with 2 micro-batches a step warned of a changed split."
    make(tmp_path / "a", max_steps=6, micro_batch_size=4, global_batch_size=8, ckpt_every=2).fit(2)
    t = make(tmp_path / "a", max_steps=6, micro_batch_size=4, global_batch_size=8, ckpt_every=2)
    assert t.step == 2 and t.resume_warnings == []


def test_a_non_finite_gradient_with_a_finite_loss_is_skipped(tmp_path):
    "bs3 (only the losses checked): an inf gradient (an overflow in backward) was applied, and every weight became NaN."
    t = make(tmp_path / "run", max_steps=4)
    p = next(t.model.parameters())
    before = p.detach().clone()
    h = p.register_hook(lambda g: torch.full_like(g, float("inf")))
    m = t.train_step()
    h.remove()
    assert m["skipped"] and t.bad_steps == 1 and torch.equal(p, before)


def test_the_nonfinite_error_names_the_newest_checkpoint(tmp_path, monkeypatch):
    "bs5 (last[0]): with several checkpoints kept, the message sent the user to the oldest, not the last good one."
    from hymo.training.trainer import NonFiniteError
    t = make(tmp_path / "run", max_steps=10, max_bad_steps=1, ckpt_every=2, keep_last_k=3)
    t.fit(num_steps=4)
    real = type(t.model).forward
    monkeypatch.setattr(type(t.model), "forward", lambda self, tokens, targets=None, cu_seqlens=None: (
        lambda o: (o[0] * float("nan"), o[1]))(real(self, tokens, targets=targets, cu_seqlens=cu_seqlens)))
    with pytest.raises(NonFiniteError, match="The last good checkpoint is .*step_000004;"):
        t.fit()


def test_a_stop_during_a_non_finite_streak_keeps_the_good_steps(tmp_path, monkeypatch):
    """A stop right after a skipped step wrote no checkpoint, losing every good step since the last one; it writes one
    now, whose weights are the last good step's (a skipped step changes none) and which carries the streak on."""
    from hymo.training.trainer import Trainer, list_checkpoints
    t = make(tmp_path / "run", max_steps=6, max_bad_steps=3)
    real_forward, real_step = type(t.model).forward, Trainer.train_step
    def nan_forward(self, tokens, targets=None, cu_seqlens=None, **kw):
        loss, parts = real_forward(self, tokens, targets=targets, cu_seqlens=cu_seqlens, **kw)
        return (loss * float("nan"), parts) if t.step == 1 else (loss, parts)
    def step_then_stop(self):
        m = real_step(self)
        if self.step == 2: self.request_stop()
        return m
    monkeypatch.setattr(type(t.model), "forward", nan_forward)
    monkeypatch.setattr(Trainer, "train_step", step_then_stop)
    after_step_1 = {}
    def keep_weights(self):
        m = step_then_stop(self)
        if self.step == 1: after_step_1.update({k: v.clone() for k, v in self.model.state_dict().items()})
        return m
    monkeypatch.setattr(Trainer, "train_step", keep_weights)
    ms = t.fit()
    assert [m["skipped"] for m in ms] == [False, True] and [c.name for c in list_checkpoints(t.run_dir)] == ["step_000002"]
    monkeypatch.undo()
    back = make(tmp_path / "run", max_steps=6, max_bad_steps=3)
    assert (back.step, back.consecutive_bad, back.bad_steps) == (2, 1, 1)
    sd = back.model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in after_step_1.items() if "counts" not in k and "dropped" not in k)


def test_a_lowered_keep_last_k_prunes_down_to_k(tmp_path):
    "kk3 (at most one old checkpoint pruned per save): lowering keep_last_k at a resume to free space kept the others."
    from hymo.training.trainer import list_checkpoints
    make(tmp_path / "run", max_steps=8, ckpt_every=1, keep_last_k=5).fit(4)
    t = make(tmp_path / "run", max_steps=8, ckpt_every=1, keep_last_k=1)
    t.fit(1)
    assert [p.name for p in list_checkpoints(t.run_dir)] == ["step_000005"]


def test_discarded_metrics_accumulate_one_json_object_a_line(tmp_path):
    "tm5 (discarded file opened 'w'): a second resume lost the first one's lines; tm3: a cut-short line glued to the next."
    from hymo.training.trainer import trim_metrics
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1}\n{"step": 2}\n{"step": 3')  # a crash in the middle of step 3's line
    trim_metrics(tmp_path, 1, log=lambda m: None)
    f.write_text(f.read_text() + '{"step": 2}\n')
    trim_metrics(tmp_path, 1, log=lambda m: None)
    assert (tmp_path / "metrics.discarded.jsonl").read_text().splitlines() == ['{"step": 2}', '{"step": 3', '{"step": 2}']


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_not_restarted(tmp_path):
    "re1 (the all-damaged refusal disabled): the run silently started again at step 0 in its own folder."
    make(tmp_path / "run", max_steps=6, ckpt_every=2, keep_last_k=3).fit(4)
    for c in ("step_000002", "step_000004"): (tmp_path / "run" / "checkpoints" / c / ".metadata").unlink()
    with pytest.raises(ConfigError, match=r"no checkpoint in .* can be read \(step_000004, step_000002"):
        make(tmp_path / "run", max_steps=6)


def test_a_rewind_sets_aside_the_checkpoint_one_step_later(tmp_path):
    "re2 (`> step` -> `> step + 1`): with ckpt_every=1 the next step's checkpoint of the old lineage stayed a checkpoint."
    from hymo.training.trainer import list_checkpoints
    make(tmp_path / "run", max_steps=8, ckpt_every=1, keep_last_k=5).fit(3)
    ck = tmp_path / "run" / "checkpoints"
    t = make(tmp_path / "run", resume=ck / "step_000002", max_steps=8, ckpt_every=1, keep_last_k=5)
    assert t.step == 2 and [p.name for p in list_checkpoints(t.run_dir)] == ["step_000001", "step_000002"]
    assert (ck / "superseded-step_000003").is_dir()


def test_override_values_of_only_spaces_or_padded_text(tmp_path):
    "po2 (`not v`): 'data_dir= ' became None (the bundled corpus) without a word; po4: run_dir= 007 kept the space."
    from hymo.train import parse_overrides
    with pytest.raises(ConfigError, match="has no value"): parse_overrides(["data_dir= "])
    assert parse_overrides(["run_dir= 007"]) == {"run_dir": "007"}


def _small_dataset(tmp_path, vocab=300):
    from hymo.training.data import CORPUS, prepare
    text = tmp_path / "t.txt"
    text.write_text(CORPUS.read_text()[:30_000])
    return prepare(text, tmp_path / "ds", vocab_size=vocab, progress=False)


def test_the_run_says_what_data_it_reads_and_a_vocabulary_far_larger_than_the_data(tmp_path, capsys):
    "A model of 2048 rows on data of 300 tokens trained without a word; how many epochs max_steps reads was not said."
    from hymo.train import main
    ds = _small_dataset(tmp_path)
    main(_cli_args(tmp_path / "run", data_dir=ds, max_steps=3, warmup_steps=1))
    out = capsys.readouterr().out
    assert f"warning: {ds} was tokenized with 300 tokens and the model has vocab_size=2,048: 1,748 rows" in out
    assert "--vocab-size 2048, or set vocab_size=300" in out
    from hymo.training.data import TokenLoader
    L = TokenLoader(ds, seq_len=FAST["seq_len"], micro_batch_size=4)
    line = next(l for l in out.splitlines() if l.startswith("data: "))
    val = sum(s["tokens"] for s in L.manifest["splits"]["val"]["shards"])
    assert line == (f"data: {ds} (train {L.n_tokens:,} tokens, {L.n_windows:,} windows of seq_len 32; val {val:,} tokens): "
                    f"max_steps=3 reads {3 / L.steps_per_epoch:.3g} epochs"), line
    main(_cli_args(tmp_path / "run2", data_dir=ds, max_steps=3, warmup_steps=1, vocab_size=512))
    assert "warning:" not in capsys.readouterr().out  # 300 of 512: not far larger
    from hymo.training.data import CORPUS, load_manifest, prepare
    (tmp_path / "short.txt").write_text(CORPUS.read_text()[:3000])
    few = prepare(tmp_path / "short.txt", tmp_path / "few", vocab_size=2048, progress=False)  # learns fewer than asked
    v = load_manifest(few)["vocab_size"]
    assert v <= 1024
    main(_cli_args(tmp_path / "run3", data_dir=few, max_steps=3, warmup_steps=1))
    out = capsys.readouterr().out
    assert f"set vocab_size={v} (its tokenizer learned {v:,} of the 2,048 tokens asked for" in out and "--vocab-size" not in out


def test_a_relative_data_dir_that_is_not_there_says_where_it_was_looked_for(tmp_path, monkeypatch, capsys):
    from hymo.train import main
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e: main(_cli_args(tmp_path / "run", data_dir="../nowhere/ds"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"(data_dir=../nowhere/ds is relative: it is found from the current folder, {tmp_path}" in err


def test_a_shard_damaged_under_a_run_ends_in_one_line_that_says_how_to_resume(tmp_path, monkeypatch, capsys):
    "An id beyond the tokenizer found as training reads it: one line, the checkpoint kept, no traceback."
    import numpy as np
    from hymo.train import main
    from hymo.training import data as D
    ds = _small_dataset(tmp_path)
    real = D.TokenLoader._batch
    def damaged(self, windows):
        if self.split == "train" and self.step >= 3:  # the 4th micro-batch, after step 2's checkpoint
            self.shards = [np.full_like(np.asarray(a), 60000) for a in self.shards]
        return real(self, windows)
    monkeypatch.setattr(D.TokenLoader, "_batch", damaged)
    with pytest.raises(SystemExit) as e: main(_cli_args(tmp_path / "run", data_dir=ds, vocab_size=300))
    err = capsys.readouterr().err
    assert e.value.code == 1 and "train_0000.npy holds id 60000 at token" in err and "Traceback" not in err, err
    assert err.rstrip().endswith(f"then the same command resumes from {tmp_path / 'run' / 'checkpoints' / 'step_000002'}"), err


def test_a_gdn_kernel_the_device_cannot_run_is_refused_before_the_data():
    "'auto' takes the Triton kernels on a GPU, which run chunks of 64 only: refused there at the start, not at the first step."
    from hymo.config import ConfigError, load_config
    from hymo.training.trainer import check_gdn_kernel
    m = load_config("hymo_tiny", gdn_chunk_size=32).model
    check_gdn_kernel(m, torch.device("cpu"))  # the PyTorch path there: fine
    with pytest.raises(ConfigError, match=r"gdn_chunk_size=32 but the Triton GDN kernels \(which gdn_kernel: auto picks on a GPU\)"):
        check_gdn_kernel(m, torch.device("cuda"))
    check_gdn_kernel(load_config("hymo_tiny", gdn_chunk_size=32, gdn_kernel="torch").model, torch.device("cuda"))


def test_a_step_cut_short_leaves_nothing_to_the_next(tmp_path, monkeypatch):
    "An exception in a micro-batch (a second Ctrl-C in a notebook, an OOM) left its gradients and MoE counts to the next step."
    from hymo.training import trainer as tr
    clean = make(tmp_path / "clean", max_steps=4, global_batch_size=4, micro_batch_size=2)
    cut = make(tmp_path / "cut", max_steps=4, global_batch_size=4, micro_batch_size=2)
    real, calls = tr.forward_backward, []
    def second_fails(self, last):
        calls.append(1)
        if len(calls) == 2: raise KeyboardInterrupt
        return real(self, last)
    monkeypatch.setattr(tr, "forward_backward", second_fails)
    with pytest.raises(KeyboardInterrupt): cut.train_step()
    assert any(p.grad is not None for p in cut.model.parameters()) and any(m.expert_counts.sum() > 0 for m in cut.moes)
    monkeypatch.setattr(tr, "forward_backward", real)
    cut.train_loader.load_state_dict(clean.train_loader.state_dict())  # the same batches next (the cut step used two)
    a, b = clean.train_step(), cut.train_step()
    assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_a_resume_restores_the_random_state(tmp_path):
    "Nothing in training draws random numbers, so equal losses cannot show a lost restore: compare the generators."
    t = make(tmp_path / "run", max_steps=4, ckpt_every=2)
    torch.rand(7)  # the state saved is then not the one that building a Trainer leaves (seed, then initialisation)
    t.fit(num_steps=2)
    gpu = torch.cuda.is_available()  # there the trainer's GPU generator too (its own device's, `_rng_state`)
    saved, saved_gpu = torch.get_rng_state(), torch.cuda.get_rng_state() if gpu else None
    torch.rand(100)  # moved on after the save, as more training would
    if gpu: torch.rand(100, device="cuda")
    back = make(tmp_path / "run", max_steps=4, ckpt_every=2)
    assert back.step == 2 and torch.equal(torch.get_rng_state(), saved)
    assert not gpu or torch.equal(torch.cuda.get_rng_state(), saved_gpu)


def test_the_gpu_random_state_saved_is_this_ranks_own(monkeypatch):
    """Every visible GPU's state was saved and restored (get/set_rng_state_all): a resume shown fewer GPUs per process
    (one each under Slurm, eight each before) failed with an IndexError. Now one state, this rank's device's; a
    checkpoint holding the old list restores its entry for the current device, or nothing where it has none."""
    import hymo.training.trainer as tr
    states, device, restored = [torch.tensor([i], dtype=torch.uint8) for i in range(8)], [3], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[torch.cuda.current_device()])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append(int(s[0])))
    saved = tr._rng_state()
    assert torch.equal(saved["cuda"], states[3]) and torch.equal(saved["torch"], torch.get_rng_state())
    device[0] = 0; tr._set_rng_state(saved)  # resumed with one GPU shown: device 0 takes the rank's state
    tr._set_rng_state({"torch": saved["torch"], "cuda": states})  # an older checkpoint's list: device 0's entry
    device[0] = 5; tr._set_rng_state({"torch": saved["torch"], "cuda": states[:2]})  # device 5 of a list of 2: none
    tr._set_rng_state({"torch": saved["torch"]})  # saved on a CPU
    assert restored == [3, 0]


def test_resuming_another_runs_checkpoint_says_it_branches(tmp_path, capsys):
    "--resume of another folder's checkpoint trains in a new folder; it said only 'resumed from', as a rewind says."
    from hymo.training.trainer import Trainer
    make(tmp_path / "a", max_steps=4, ckpt_every=2).fit(2)
    cfg = load_config("hymo_tiny", **{**FAST, "max_steps": 4})
    Trainer(cfg.model, cfg.train, run_dir=tmp_path / "b", resume=tmp_path / "a" / "checkpoints" / "step_000002")
    out = capsys.readouterr().out
    assert f"in a new run folder (a branch: {(tmp_path / 'a').resolve()} is left as it is; give run_dir=" in out
    Trainer(cfg.model, cfg.train, run_dir=tmp_path / "a", resume=tmp_path / "a" / "checkpoints" / "step_000002")
    assert "resumed from" in (out := capsys.readouterr().out) and "a branch" not in out  # its own folder: a rewind


# ---------------------------------------------------------------- from mutation testing the trainer (third pass): each
# test fails on a change of the code that every test above let pass

def _steps(path): return [json.loads(l)["step"] for l in Path(path).read_text().splitlines()] if Path(path).exists() else []


def test_a_plain_resume_takes_the_newest_checkpoint(tmp_path):
    make(tmp_path / "run", max_steps=6, ckpt_every=2).fit(4)
    assert make(tmp_path / "run", max_steps=6, ckpt_every=2).step == 4


def test_a_resume_at_the_last_step_saves_no_checkpoint_again(tmp_path, monkeypatch):
    "The final checkpoint (10 GB at 750M) was written again, with the resuming command's config in its meta.json."
    from hymo.training.trainer import Trainer
    make(tmp_path / "run", max_steps=4, ckpt_every=2).fit()
    (tmp_path / "run" / "summary.json").unlink()  # the finish was cut short after the final checkpoint
    written, real = [], Trainer.save
    monkeypatch.setattr(Trainer, "save", lambda self: written.append(self.step) or real(self))
    make(tmp_path / "run", max_steps=4, ckpt_every=2).fit()
    assert written == [] and (tmp_path / "run" / "summary.json").exists()


def test_a_new_global_batch_of_the_same_micro_batch_is_said(tmp_path):
    make(tmp_path / "a", max_steps=8, micro_batch_size=4, global_batch_size=8, ckpt_every=2).fit(2)
    t = make(tmp_path / "a", max_steps=8, micro_batch_size=4, global_batch_size=4)
    assert any("2 micro-batches of 4, now 1 of 4" in w for w in t.resume_warnings), t.resume_warnings


def test_trim_metrics_loses_no_line_when_the_discarded_file_cannot_be_written(tmp_path, monkeypatch):
    import hymo.training.trainer as tr
    lines = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    real = open
    def failing(path, *a, **k):
        if Path(path).name.startswith("metrics.discarded.jsonl"): raise OSError(28, "No space left on device")
        return real(path, *a, **k)
    monkeypatch.setattr(tr, "open", failing, raising=False)
    with pytest.raises(OSError): tr.trim_metrics(tmp_path, 2, log=lambda *a: None)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True) == lines  # nothing moved, nothing lost


def test_cli_no_resume_refuses_a_folder_with_checkpoints(tmp_path, capsys):
    from hymo.train import main
    make(tmp_path / "run", max_steps=4, ckpt_every=2).fit(2)
    with pytest.raises(SystemExit) as e: main([*_cli_args(tmp_path / "run", max_steps=4, ckpt_every=2), "--no-resume"])
    assert e.value.code == 2 and "already holds checkpoints" in capsys.readouterr().err


def test_a_key_given_twice_on_the_command_line_is_refused():
    from hymo.train import parse_overrides
    with pytest.raises(ConfigError, match="given twice"): parse_overrides(["max_steps=5", "max_steps=6"])


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   torch.distributed.DistBackendError("Watchdog caught collective operation timeout"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered")])
def test_a_load_that_fails_for_the_machine_sets_no_checkpoint_aside(tmp_path, monkeypatch, error):
    """A collective's timeout or a GPU error while loading (the files' sums had passed) counted as damage: the newest
    checkpoint was set aside as damaged and the run resumed from an older one, its steps lost. Memory too."""
    import torch.distributed.checkpoint as dcp
    make(tmp_path / "run", max_steps=6, ckpt_every=2).fit(4)
    def fail(*a, **k): raise error
    monkeypatch.setattr(dcp, "load", fail)
    with pytest.raises(type(error)): make(tmp_path / "run", max_steps=6, ckpt_every=2)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


def _online_wandb(monkeypatch) -> list:
    "wandb.init as when logged in, recording its arguments; each run gets the id it is given, else a new one."
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False); monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    calls = []
    class Online:
        def __init__(self, id): self.id = id or f"id{len(calls)}"  # the first run started: id1
        def log(self, *a, **k): pass
        def finish(self): pass
    monkeypatch.setattr(wandb, "init", lambda **k: calls.append(k) or Online(k["id"]))
    return calls


def test_a_restart_from_step_0_is_a_new_wandb_run(tmp_path, monkeypatch):
    calls = _online_wandb(monkeypatch)
    make(tmp_path / "c", max_steps=4, wandb=True).fit(1)  # crashed before its first checkpoint
    make(tmp_path / "c", max_steps=4, wandb=True).fit(1)  # starts again at step 0
    assert [c["id"] for c in calls] == [None, None]


def test_a_rewind_or_changed_settings_start_a_new_wandb_run_and_a_plain_resume_continues_one(tmp_path, monkeypatch):
    """wandb ignores steps at or below the last it has: a rewind's steps (or those of a resume with a lower learning
    rate, as a NonFiniteError advises) were dropped and the chart kept the old line. A plain resume continues its run."""
    calls, run = _online_wandb(monkeypatch), tmp_path / "run"
    make(run, max_steps=10, ckpt_every=2, wandb=True).fit(4)
    make(run, max_steps=10, ckpt_every=2, wandb=True).fit(2)  # plain: the same wandb run
    make(run, resume=run / "checkpoints" / "step_000004", max_steps=10, ckpt_every=2, wandb=True).fit(2)  # a rewind
    make(run, max_steps=10, ckpt_every=5, wandb=True).fit(3)  # the rewound line, resumed plainly: steps 7-9 logged, then a crash
    make(run, max_steps=20, ckpt_every=5, wandb=True).fit(1)  # from step 6 again: the decay (steps 9-10) moved
    make(run, max_steps=20, ckpt_every=5, wandb=True, muon_lr=0.01).fit(1)  # and again, at another learning rate
    assert [c["id"] for c in calls] == [None, "id1", None, "id3", None, None]  # (the nth run started gets id<n>)


def test_a_branch_sets_aside_every_line_of_the_crashed_run_in_its_folder(tmp_path):
    "A branch into a folder where a run crashed before its first checkpoint: its metrics.jsonl kept that run's steps 1-2."
    make(tmp_path / "a", max_steps=6, ckpt_every=2).fit(2)
    make(tmp_path / "e", max_steps=6, seed=1).fit(num_steps=3)  # crashed before its first checkpoint, after 3 steps
    make(tmp_path / "e", resume=tmp_path / "a" / "checkpoints" / "step_000002", max_steps=6).fit(num_steps=1)
    assert _steps(tmp_path / "e" / "metrics.jsonl") == [3]
    assert _steps(tmp_path / "e" / "metrics.discarded.jsonl") == [1, 2, 3]


def test_the_end_of_run_sample_uses_the_runs_seed(tmp_path):
    from hymo.generate import generate_text
    from hymo.training.data import tokenizer_from_json
    t = make(tmp_path / "run", max_steps=2, warmup_steps=1, seed=1)
    t.fit()
    want = generate_text(t.model, tokenizer_from_json(t.tokenizer_json), t.cfg.prompt, t.cfg.sample_tokens,
                         temperature=0.8, top_k=50, seed=1, window=t.cfg.seq_len)
    assert t.summary["sample"] == want


def test_a_requeued_rewind_after_a_plain_resume_is_not_a_new_rewind(tmp_path):
    "The rewind's command run again after its line went on must continue that line, not rewind it again."
    run = tmp_path / "run"
    make(run, max_steps=8, ckpt_every=2).fit(4)
    back = run / "checkpoints" / "step_000002"
    make(run, resume=back, max_steps=8, ckpt_every=2).fit(2)  # a rewind, trained to a checkpoint
    make(run, max_steps=8, ckpt_every=2).fit(2)  # a plain resume of it, trained on
    assert make(run, resume=back, max_steps=8, ckpt_every=2).step == 6


def test_the_gpu_random_state_is_saved_from_and_restored_into_this_ranks_device(monkeypatch):
    "The test above's mocks ignore the device argument: saving device 0's state, or restoring into it, passed there."
    import hymo.training.trainer as tr
    states, current, restored = {i: torch.tensor([i], dtype=torch.uint8) for i in range(8)}, [3], []
    def index(device):
        if isinstance(device, int): return device
        d = torch.device(device)
        return current[0] if d.index is None else d.index
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[index(device)])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append((index(device), int(s[0]))))
    saved = tr._rng_state()
    assert int(saved["cuda"][0]) == 3
    current[0] = 1; tr._set_rng_state(saved)
    assert restored == [(1, 3)]
    current[0] = 2; tr._set_rng_state({"torch": saved["torch"], "cuda": [states[0], states[1]]})  # device 2, a list of 2
    assert restored == [(1, 3)]


def test_fit_with_more_steps_than_are_left_stops_at_max_steps(tmp_path):
    t = make(tmp_path / "run", max_steps=3, warmup_steps=1)
    assert [m["step"] for m in t.fit(num_steps=5)] == [1, 2, 3] and t.step == 3


# ---------------------------------------------------------------- from mutation testing the new-wandb-run rule

@pytest.mark.parametrize("first, then, new", [
    (3, dict(muon_lr=0.01), True),  # a lower learning rate after a crash, before the decay: step 3 redone otherwise
    (3, dict(max_steps=30, ckpt_every=3, micro_batch_size=2), False),  # settings that leave the steps as they were
    (2, dict(muon_lr=0.01), False),  # stopped at its checkpoint: nothing logged past it for wandb to drop
    (3, dict(rope_theta=50000.0), True),  # a model setting of the same shapes
])
def test_which_resumes_start_a_new_wandb_run(tmp_path, monkeypatch, first, then, new):
    calls, run = _online_wandb(monkeypatch), tmp_path / "run"
    make(run, max_steps=20, ckpt_every=2, wandb=True).fit(first)
    make(run, **{"max_steps": 20, "ckpt_every": 2, "wandb": True, **then}).fit(1)
    assert [c["id"] for c in calls] == [None, None if new else "id1"]


def test_settings_put_back_after_a_crashed_change_start_a_new_wandb_run(tmp_path, monkeypatch):
    "Compared with the checkpoint's settings, the first settings put back looked unchanged: the changed run's wandb run went on."
    calls, run = _online_wandb(monkeypatch), tmp_path / "run"
    make(run, max_steps=20, ckpt_every=2, wandb=True).fit(5)  # checkpoint 4, step 5 logged, a crash
    make(run, max_steps=20, ckpt_every=2, wandb=True, muon_lr=0.01).fit(1)  # step 5 at another rate: a new run; a crash
    make(run, max_steps=20, ckpt_every=2, wandb=True).fit(1)  # the first rate again: step 5 differs from the last logged
    assert [c["id"] for c in calls] == [None, None, None]


def test_an_out_of_memory_inside_dcps_load_sets_no_checkpoint_aside(tmp_path, monkeypatch):
    "DCP wraps a rank's error in a CheckpointException (its failures): the test above raised it bare."
    from torch.distributed.checkpoint import FileSystemReader
    make(tmp_path / "run", max_steps=6, ckpt_every=2).fit(4)
    real = FileSystemReader.read_data
    def oom(self, *a, **k):
        if "step_000004" in str(self.path): raise torch.OutOfMemoryError("CUDA out of memory")  # the newest only
        return real(self, *a, **k)
    monkeypatch.setattr(FileSystemReader, "read_data", oom)
    with pytest.raises(BaseException): make(tmp_path / "run", max_steps=6, ckpt_every=2)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


# From mutation testing of the trainer and its command line (each test below failed on a mutant the suite let through)

def test_a_checkpoint_at_the_first_decay_step_is_kept_as_before_decay(tmp_path):
    "max_steps=12 decays over its last 4 steps: step_000008 trained at lr(0..7), none decayed, so pruning keeps it."
    from hymo.training.trainer import list_checkpoints
    t = make(tmp_path / "run", max_steps=12, ckpt_every=2, keep_last_k=2)
    t.fit()
    assert [p.name for p in list_checkpoints(t.run_dir)] == ["step_000008", "step_000010", "step_000012"]


def test_one_step_logged_past_the_checkpoint_at_another_rate_is_a_new_wandb_run(tmp_path, monkeypatch):
    "Step 8 trained at lr_10(7) = 0.5; max_steps=11 redoes it at lr_11(7) = 1.0, a step wandb would drop."
    calls, run = _online_wandb(monkeypatch), tmp_path / "run"
    make(run, max_steps=10, ckpt_every=7, wandb=True).fit(8)
    make(run, max_steps=11, ckpt_every=7, wandb=True).fit(1)
    assert [c["id"] for c in calls] == [None, None]


def test_a_schedule_that_moves_only_after_the_logged_steps_continues_the_wandb_run(tmp_path, monkeypatch):
    "Step 7 trained at lr(6) = 1.0 under either schedule: the redone step is the same, so the wandb run goes on."
    calls, run = _online_wandb(monkeypatch), tmp_path / "run"
    make(run, max_steps=10, ckpt_every=6, wandb=True).fit(7)
    make(run, max_steps=11, ckpt_every=6, wandb=True).fit(1)
    assert [c["id"] for c in calls] == [None, "id1"]


def test_a_rewind_trainer_keeps_one_wandb_run_over_several_fit_calls(tmp_path, monkeypatch):
    "The rewind's first fit starts a new wandb run; its second continues that one (it started a third before)."
    calls, run = _online_wandb(monkeypatch), tmp_path / "run"
    make(run, max_steps=10, ckpt_every=2, wandb=True).fit(4)
    t = make(run, resume=run / "checkpoints" / "step_000002", max_steps=10, ckpt_every=2, wandb=True)
    t.fit(1); t.fit(1)
    assert [c["id"] for c in calls] == [None, None, "id2"]


def test_wandb_is_given_resume_allow_and_each_steps_number(tmp_path, monkeypatch):
    "Without resume='allow' an online wandb overwrites the run of that id; without step= its x axis drifts after a resume."
    wandb = pytest.importorskip("wandb")
    calls, logged = [], []
    monkeypatch.delenv("WANDB_MODE", raising=False); monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    class Online:
        def __init__(self, id): self.id = id or f"id{len(calls)}"
        def log(self, m, step=None): logged.append((step, m["step"]))
        def finish(self): pass
    monkeypatch.setattr(wandb, "init", lambda **k: calls.append(k) or Online(k["id"]))
    run = tmp_path / "run"
    make(run, max_steps=6, ckpt_every=2, wandb=True).fit(3)  # as if it crashed after step 3 was logged
    make(run, max_steps=6, ckpt_every=2, wandb=True).fit(2)  # resumes at step 2: steps 3 and 4
    assert [c["resume"] for c in calls] == ["allow", "allow"] and calls[1]["id"] == "id1"
    assert logged == [(s, s) for s in (1, 2, 3, 3, 4)]


def test_a_diverged_run_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    "A job script must see a run that stopped on non-finite losses as failed."
    from hymo.models.model import HyMo
    from hymo.train import main
    real = HyMo.forward
    def nan(self, *a, **k):
        out = real(self, *a, **k)
        return (out[0] * float("nan"), out[1]) if k.get("targets") is not None else out
    monkeypatch.setattr(HyMo, "forward", nan)
    with pytest.raises(SystemExit) as e: main(_cli_args(tmp_path / "run", max_bad_steps=1))
    assert e.value.code == 1 and "2 consecutive steps had a non-finite loss" in capsys.readouterr().err


def test_another_schedule_of_the_same_length_gives_no_advice_to_extend():
    "A decay_fraction changed at the same max_steps is a jump in the rate, not an extension."
    from hymo.training.trainer import resume_changes
    old = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "decay_fraction": 0.2})
    new = load_config("hymo_tiny", **{**FAST, "max_steps": 20, "decay_fraction": 0.25})
    notes = resume_changes(json.loads(json.dumps(old.to_dict())), new.model, new.train, step=16)
    assert any("jumps" in n for n in notes) and not any("extend" in n for n in notes), notes


def test_a_checkpoint_the_new_schedule_has_decayed_at_is_not_offered_for_extending(tmp_path):
    "Extended to 12 steps with decay_fraction 0.6, the rate decays from lr(5): step_000006 is no continuation of it."
    run = tmp_path / "run"
    make(run, max_steps=10, ckpt_every=2, keep_last_k=2).fit()  # keeps 6 (before the decay from lr(7)), 8, 10
    t = make(run, max_steps=12, decay_fraction=0.6, ckpt_every=2, keep_last_k=2)
    assert any("keeps none" in w for w in t.resume_warnings), t.resume_warnings
    assert (run / "checkpoints" / "step_000006").is_dir()


def test_a_branch_from_a_run_folders_config_goes_where_its_run_dir_says(tmp_path, monkeypatch):
    "--config A/run/config.yaml --resume B/checkpoint: the branch trains in the folder the config's run_dir names."
    from hymo.train import main
    (tmp_path / "a").mkdir(); (tmp_path / "c").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    main(_cli_args("run", max_steps=2, ckpt_every=1, warmup_steps=1))
    main(_cli_args(tmp_path / "b", max_steps=4, ckpt_every=2, warmup_steps=1))
    monkeypatch.chdir(tmp_path / "c")
    main(["--config", str(tmp_path / "a" / "run" / "config.yaml"),
          "--resume", str(tmp_path / "b" / "checkpoints" / "step_000002"), "max_steps=3"])
    assert (tmp_path / "c" / "run" / "summary.json").exists()


def test_a_given_checkpoint_that_fails_for_the_data_or_the_machine_is_not_called_unreadable(tmp_path, monkeypatch):
    "A changed seed or an OOM while loading is said as such, not as 'cannot be read' with the advice for a damaged one."
    import torch.distributed.checkpoint as dcp
    from hymo.training.data import DataError
    make(tmp_path / "a", max_steps=4, ckpt_every=2).fit(2)
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    with pytest.raises(DataError, match="seed 0 -> 1"): make(tmp_path / "b", resume=ckpt, max_steps=4, seed=1)
    def oom(*a, **k): raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(dcp, "load", oom)
    with pytest.raises(torch.OutOfMemoryError): make(tmp_path / "c", resume=ckpt, max_steps=4)


def test_training_mode_comes_back_after_a_validation_that_failed(tmp_path, monkeypatch):
    "A failure inside evaluate (Ctrl-C in a notebook, an OOM) leaves the model training: eval mode has no capacity limit and no bias updates."
    from hymo.models.model import HyMo
    t = make(tmp_path / "run", max_steps=4)
    real = HyMo.forward
    def fail(self, *a, **k):
        if not self.training: raise RuntimeError("out of memory")
        return real(self, *a, **k)
    monkeypatch.setattr(HyMo, "forward", fail)
    with pytest.raises(RuntimeError, match="out of memory"): t.evaluate()
    assert t.model.training
    monkeypatch.setattr(HyMo, "forward", real)
    t.model.eval()  # however it got there, a training step trains in training mode
    assert "moe0/moe_load_max_mean" in t.train_step() and t.model.training



ONE_RANK_FSDP = """
import json, os, socket
import torch
import torch.distributed as dist
from hymo.config import load_config
from hymo.training.trainer import Trainer
with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)  # one rank: the Trainer shards with FSDP-2, as under torchrun
def config(precision, **overrides):
    return load_config("hymo_tiny", seq_len=32, micro_batch_size=2, global_batch_size=4, max_steps=4, warmup_steps=1,
                       eval_every=0, ckpt_every=0, sample_tokens=4, precision=precision, **overrides)
"""


def one_rank_fsdp(body: str, tmp_path):
    "Run `body` after ONE_RANK_FSDP in a fresh process; what it printed after RESULT, read as JSON."
    script = ONE_RANK_FSDP + body + '\nprint("RESULT" + json.dumps(out), flush=True)\nos._exit(0)  # no teardown of gloo\'s threads (see test_optim)\n'
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "WANDB_MODE": "offline", **CPU_RANKS})
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line, r.stderr[-3000:]
    return json.loads(line[6:])


CUT_SHORT_FSDP = """
out = {}
for precision in ("fp32", "bf16"):  # bf16: FSDP sums the micro-batches in unsharded_accumulated_grad; fp32: in .grad
    cfg = config(precision)
    clean = Trainer(cfg.model, cfg.train, run_dir=f"clean_{precision}", resume=False, quiet=True)
    want = clean.train_step()
    cut = Trainer(cfg.model, cfg.train, run_dir=f"cut_{precision}", resume=False, quiet=True)
    batches = iter(cut.train_loader)
    def second_raises():
        yield next(batches)
        raise KeyboardInterrupt  # the step's second micro-batch never comes: a Ctrl-C in a notebook
    cut._train_iter = second_raises()
    try: cut.train_step()
    except KeyboardInterrupt: pass
    cut.train_loader.step = 0; cut._train_iter = iter(cut.train_loader)  # the same data again, from the start
    got = cut.train_step()
    out[precision] = dict(fsdp=hasattr(cut.model, "set_requires_gradient_sync"), accum=cut.accum,
                          loss=[want["loss"], got["loss"]], grad_norm=[want["grad_norm"], got["grad_norm"]])
"""


def test_an_fsdp_step_cut_short_leaves_no_gradient_for_the_next(tmp_path):
    """A step cut short after some micro-batches (a Ctrl-C in a notebook), then the step again: it equals a clean step.
    Its micro-batches had summed into FSDP's unsharded gradients, which zero_grad does not see: the next step added
    them in (grad norm 6.02 where 3.75 was right)."""
    for precision, res in one_rank_fsdp(CUT_SHORT_FSDP, tmp_path).items():
        assert res["fsdp"] and res["accum"] == 2, res
        assert res["loss"][1] == pytest.approx(res["loss"][0], rel=1e-6), (precision, res)
        assert res["grad_norm"][1] == pytest.approx(res["grad_norm"][0], rel=1e-5), (precision, res)


CUT_IN_BACKWARD = """
import itertools
from torch.distributed.fsdp import FSDPModule
from hymo.training.trainer import _param_groups, mid_iteration
out = {}
for reset in ("FSDP's", "HyMo's"):  # FSDP's reset_iter_state (torch 2.13), then HyMo's own, as on a torch without it
    if reset == "HyMo's" and hasattr(FSDPModule, "reset_iter_state"): del FSDPModule.reset_iter_state
    for precision, ckpt in itertools.product(("fp32", "bf16"), (False, True)):
        cfg = config(precision, activation_checkpointing=ckpt)
        want = Trainer(cfg.model, cfg.train, run_dir=f"clean_{precision}_{ckpt}", resume=False, quiet=True).train_step()
        # the step's first backward (its gradients kept unsharded) or its last (reduce-scattered); a GDN block or the MLA
        for micro_batch, layer in itertools.product((0, 1), (0, 3)):
            case = f"{reset} {precision} ckpt={ckpt} micro_batch={micro_batch} layer={layer}"
            cut = Trainer(cfg.model, cfg.train, run_dir=case.replace(" ", "_"), resume=False, quiet=True)
            drawn, armed = [], [True]
            def counted(batches):
                for batch in batches: drawn.append(1); yield batch
            block = cut.model.layers[layer]
            inner = block.mixer if layer == 0 else block.attn; forward = inner.forward
            def cut_in_backward(*a, **k):  # inside the block (its weights gathered for backward), in the chosen micro-batch
                y = forward(*a, **k)
                t = y[0] if isinstance(y, tuple) else y
                if len(drawn) == micro_batch + 1 and armed[0] and t.requires_grad:
                    armed[0] = False
                    t.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("cut in backward")))
                return y
            inner.forward, cut._train_iter = cut_in_backward, counted(iter(cut.train_loader))
            try: cut.train_step(); raised = None
            except RuntimeError as e: raised = str(e)
            inner.forward = forward
            states = cut.model._get_fsdp_state()._state_ctx.all_states  # after the clean-up: FSDP idle, every group sharded
            left = [mid_iteration(cut.model), not all(g.is_sharded for s in states for g in _param_groups(s))]
            cut.train_loader.step = 0; cut._train_iter = iter(cut.train_loader)  # the same data again
            got = cut.train_step()
            out[case] = dict(raised=raised, left=left, loss=[want["loss"], got["loss"]],
                             grad_norm=[want["grad_norm"], got["grad_norm"]])
"""


def test_an_fsdp_step_cut_in_backward_leaves_the_next_step_clean(tmp_path):
    """An exception inside backward (an OOM, a Ctrl-C) leaves FSDP mid-iteration: some blocks' weights gathered, some
    gradients reduced. After it the same step again equals a clean one, for cuts in the first and last micro-batch's
    backward, in a GDN and the MLA block, with and without activation checkpointing, fp32 and bf16; after FSDP's
    reset_iter_state (torch 2.13) and after HyMo's own (torch 2.11 has none: the next step's grad norm was 3.47 for 3.75)."""
    res = one_rank_fsdp(CUT_IN_BACKWARD, tmp_path)
    assert len(res) == 32, res
    for case, r in res.items():
        assert r["raised"] == "cut in backward" and r["left"] == [False, False], (case, r)
        assert r["loss"][1] == pytest.approx(r["loss"][0], rel=1e-6), (case, r)
        assert r["grad_norm"][1] == pytest.approx(r["grad_norm"][0], rel=1e-5), (case, r)


CUT_CLEAN_UP = """
from torch.distributed.fsdp import FSDPModule
import hymo.training.trainer as T
out = {}
resets = ("FSDP's", "HyMo's") if hasattr(FSDPModule, "reset_iter_state") else ("HyMo's",)  # torch 2.11 has HyMo's only
for reset in resets:  # a second Ctrl-C as the reset after a step cut in backward begins
    if reset == "HyMo's" and hasattr(FSDPModule, "reset_iter_state"): del FSDPModule.reset_iter_state
    owner, name = (FSDPModule, "reset_iter_state") if reset == "FSDP's" else (T, "reset_fsdp_iteration")
    real, calls = getattr(owner, name), []
    def second_ctrl_c(*a):
        calls.append(1)
        if len(calls) == 1: raise KeyboardInterrupt
        return real(*a)
    setattr(owner, name, second_ctrl_c)
    cfg = config("bf16")
    want = Trainer(cfg.model, cfg.train, run_dir=f"clean_{reset}", resume=False, quiet=True).train_step()
    cut = Trainer(cfg.model, cfg.train, run_dir=f"cut_{reset}", resume=False, quiet=True)
    block = cut.model.layers[3]; forward = block.forward
    def cut_in_backward(*a, **k):
        y = forward(*a, **k)
        if y.requires_grad: y.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("cut in backward")))
        return y
    block.forward = cut_in_backward
    try: cut.train_step(); raised = None
    except BaseException as e: raised = type(e).__name__
    block.forward = forward
    cut.train_loader.step = 0; cut._train_iter = iter(cut.train_loader)
    got = cut.train_step()
    setattr(owner, name, real)
    out[reset] = dict(raised=raised, resets=len(calls), grad_norm=[want["grad_norm"], got["grad_norm"]])
"""


def test_an_fsdp_step_whose_clean_up_is_cut_leaves_the_next_step_clean(tmp_path):
    """A second Ctrl-C as the reset after a cut step begins: the next step starts by finding FSDP mid-iteration and resets
    it (it only dropped gradients: grad norm 3.09 where 3.75 is right), with FSDP's reset (where torch has it) and HyMo's."""
    from torch.distributed.fsdp import FSDPModule
    out = one_rank_fsdp(CUT_CLEAN_UP, tmp_path)
    assert sorted(out) == ["FSDP's", "HyMo's"][not hasattr(FSDPModule, "reset_iter_state"):], out
    for reset, r in out.items():
        assert r["raised"] == "KeyboardInterrupt" and r["resets"] == 2, (reset, r)
        assert r["grad_norm"][1] == pytest.approx(r["grad_norm"][0], rel=1e-5), (reset, r)


CUT_BEFORE_FIRST_FORWARD = """
cfg = config("bf16")
clean = Trainer(cfg.model, cfg.train, run_dir="clean", resume=False, quiet=True)
want = clean.train_step()
t = Trainer(cfg.model, cfg.train, run_dir="cut", resume=False, quiet=True)  # no forward has run through it yet
def first_raises():
    raise KeyboardInterrupt  # Ctrl-C while the first step's first micro-batch loads
    yield
t._train_iter = first_raises()
try: t.train_step(); raised = None
except BaseException as e: raised = type(e).__name__
t._train_iter = iter(t.train_loader)
got = t.train_step()
out = dict(raised=raised, fsdp=hasattr(t.model, "set_requires_gradient_sync"), grad_norm=[want["grad_norm"], got["grad_norm"]])
"""


def test_a_step_cut_before_fsdps_first_forward_raises_its_own_exception(tmp_path):
    """A Ctrl-C (or a data error) before the first forward of an FSDP model: drop_unsharded_grads' reset_iter_state
    read FSDP's communication state, which lazy init had not made yet, and raised AttributeError in its place."""
    res = one_rank_fsdp(CUT_BEFORE_FIRST_FORWARD, tmp_path)
    assert res["fsdp"], res
    assert res["raised"] == "KeyboardInterrupt", res
    assert res["grad_norm"][1] == pytest.approx(res["grad_norm"][0], rel=1e-5), res


def test_sample_tokens_0_means_no_sample(tmp_path, capsys):
    "sample_tokens=0 is allowed ('0 or more'): the run's end printed an empty '--- sample ---' block and kept the prompt."
    t = make(tmp_path / "run", max_steps=2, warmup_steps=0, sample_tokens=0)
    t.quiet = False
    t.fit()
    assert t.summary["sample"] is None and json.loads((tmp_path / "run" / "summary.json").read_text())["sample"] is None
    out = capsys.readouterr().out
    assert "final val loss" in out or "no validation loss" in out
    assert "--- sample ---" not in out


def test_the_train_command_prints_a_data_warning_as_one_line(monkeypatch, capsys):
    "A DataWarning while training (the cache's dataset damaged, prepared again) came with Python's file, line and source."
    import warnings
    import hymo.train as train
    from hymo.training.data import DataWarning
    def warns(parser, args, cfg):
        warnings.warn("the cache holds this dataset damaged: preparing it again", DataWarning)
        warnings.warn("another library's warning", UserWarning)
        return {}
    monkeypatch.setattr(train, "_train", warns)
    with pytest.warns(UserWarning, match="another library's warning"): train.main([])  # others as Python shows them
    err = capsys.readouterr().err
    assert "warning: the cache holds this dataset damaged: preparing it again\n" in err and "DataWarning" not in err, err


def _changed_in_place(ds: Path, shard: str, vocab_size: int):
    "One token of a prepared dataset's shard changed on disk to another valid id: no size or range check can see it."
    import numpy as np
    a = np.load(ds / shard, mmap_mode="r+")
    a[100] = (a[100] + 1) % vocab_size
    a.flush()


def _small_dataset(tmp_path) -> Path:
    from hymo.training.data import CORPUS, prepare
    text = tmp_path / "play.txt"
    text.write_text(CORPUS.read_text()[:30_000])
    return prepare(text, tmp_path / "ds", vocab_size=300, progress=False)


def test_a_shard_changed_in_place_stops_the_run_before_anything_trained_on_it_is_saved(tmp_path):
    """A token changed on disk to another valid id trained silently (only `hymo.data info` read every byte): the trainer's
    background check of every shard's CRC-32 stops the run, before a checkpoint or the final model is written."""
    from hymo.training.data import DataError
    ds = _small_dataset(tmp_path)
    _changed_in_place(ds, "train_0000.npy", 300)
    t = make(tmp_path / "run", data_dir=str(ds), vocab_size=300, max_steps=3, ckpt_every=1, warmup_steps=1)
    with pytest.raises(DataError, match=r"train_0000\.npy is damaged .*The run stopped at step 1 without saving it"):
        t.fit()
    assert not list((tmp_path / "run").glob("checkpoints/step_*")) and not (tmp_path / "run" / "model.safetensors").exists()


def test_damage_in_one_ranks_share_of_the_check_stops_every_rank_with_one_line(tmp_path):
    """Each rank checks every second shard: the damaged val_0000.npy is rank 1's. Both ranks stop with one line (rank 0's
    says another rank stopped), nothing is saved, and the line says how to resume."""
    ds = _small_dataset(tmp_path)
    _changed_in_place(ds, "val_0000.npy", 300)
    r = torchrun("-m", "hymo.train", *TWO_RANK_RUN, f"data_dir={ds}", "vocab_size=300", "max_steps=3",
                 "run_dir=two", cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "hymo/training/trainer.py" not in out and "distributed_c10d" not in out, out[-3000:]
    assert "val_0000.npy is damaged" in out and f"another rank stopped on {ds}" in out, out[-3000:]
    assert "without saving it" in out and not list((tmp_path / "two").glob("checkpoints/step_*")), out[-3000:]


def test_a_checkpoint_folder_as_config_gives_the_settings_its_run_trained_with(tmp_path, capsys):
    """`--config RUN/checkpoints/step_N` (or its meta.json): the settings meta.json records, checked by its own sum; a
    run folder's lost config.yaml had no way back but retyping the command that trained it."""
    import dataclasses
    from hymo.config import Config
    from hymo.train import main
    t = make(tmp_path / "run", max_steps=2, warmup_steps=1, ckpt_every=1, dim=96)
    t.fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    want = Config(t.mcfg, t.cfg, name=t.name)
    assert load_config(str(ckpt)) == want and load_config(str(ckpt / "meta.json")) == want
    assert load_config(str(ckpt), max_steps=5).train.max_steps == 5  # overrides apply on top, as on a file's
    meta = (ckpt / "meta.json").read_text()
    (ckpt / "meta.json").write_text(meta.replace('"dim": 96', '"dim": 97'))  # a digit damaged: not a setting
    with pytest.raises(ConfigError, match=r"meta.json has changed since it was saved .*give another checkpoint's folder"):
        load_config(str(ckpt))
    (ckpt / "meta.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no settings"): load_config(str(ckpt))
    (ckpt / "meta.json").write_text(meta)
    (tmp_path / "run" / "config.yaml").unlink()  # lost: the command with the checkpoint writes it again
    capsys.readouterr()
    main(["--config", str(tmp_path / "run" / "checkpoints" / "step_000002")])
    assert "is a checkpoint of a run: continuing that run, run_dir=" in capsys.readouterr().out
    got = load_config(str(tmp_path / "run" / "config.yaml"))  # the settings trained with, in their folder
    assert got.model == t.mcfg and got.train == dataclasses.replace(t.cfg, run_dir=str(tmp_path / "run"))


def test_a_stop_while_the_data_check_reads_says_its_checkpoint_waits(tmp_path, monkeypatch, capsys):
    """A stop in the first steps (SIGTERM, Ctrl-C) saves once the check of the data's bytes has finished: minutes on a
    large dataset, which passed without a word (and a second signal, or the scheduler's kill, then lost the steps)."""
    import signal
    import time
    import hymo.training.data as D
    real = D._sums_match
    monkeypatch.setattr(D, "_sums_match", lambda shards: (time.sleep(4), real(shards))[1])  # a large dataset's check
    t = make(tmp_path / "run", data_dir=str(_small_dataset(tmp_path)), vocab_size=300, max_steps=50, warmup_steps=1)
    t.quiet = False
    real_step = t.train_step
    def stopped_after_one():
        m = real_step()
        if t.step == 1: t.request_stop(signal.SIGTERM)  # what the SIGTERM handler calls
        return m
    t.train_step = stopped_after_one
    capsys.readouterr()
    t.fit()
    assert t.saved_step == 1 and t.data_check.result is True
    assert "the checkpoint of step 1 waits for the check of" in capsys.readouterr().out


def test_a_dataset_without_checksums_trains_with_a_warning_that_its_bytes_are_not_checked(tmp_path, capsys):
    "A dataset prepared by an older HyMo (no crc32 in its manifest) cannot be checked as it trains: said, not silent."
    ds = _small_dataset(tmp_path)
    m = json.loads((ds / "manifest.json").read_text())
    for v in m["splits"].values():
        for s in v["shards"]: s.pop("crc32")
    m.pop("manifest_crc32")
    (ds / "manifest.json").write_text(json.dumps(m))
    from hymo.training.trainer import Trainer  # (not `make`, which builds a quiet one)
    cfg = load_config("hymo_tiny", **{**FAST, "data_dir": str(ds), "vocab_size": 300, "max_steps": 2, "warmup_steps": 1})
    capsys.readouterr()
    t = Trainer(cfg.model, cfg.train, run_dir=tmp_path / "run")
    assert "has no shard checksums, so bytes changed on disk are not found as it trains" in capsys.readouterr().out
    assert t.data_check.wait() is None and t.data_check.result is False


def test_each_node_checks_the_copy_it_reads(monkeypatch):
    """The ranks of a node share the check (torchrun's LOCAL_RANK of LOCAL_WORLD_SIZE), so a copy of the data on each
    node's own disk is checked whole; global ranks left each copy's other shares unchecked. Without torchrun's
    variables, a process checks everything."""
    from hymo.training.trainer import setup_distributed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (local rank 1 would pick a second GPU)
    monkeypatch.setenv("LOCAL_RANK", "1"); monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    d = setup_distributed()
    assert (d.local_rank, d.local_world_size, d.world_size) == (1, 4, 1)
    monkeypatch.delenv("LOCAL_RANK"); monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert (setup_distributed().local_rank, setup_distributed().local_world_size) == (0, 1)


def test_a_checkpoint_config_its_run_pruned_says_where_the_settings_are(tmp_path, capsys):
    """`--config RUN/checkpoints/step_N` continues RUN, whose saves prune step_N: 'the same command' then named a folder
    that is gone ('no preset or YAML file'). The error names RUN/config.yaml, and the ending line gives it."""
    from hymo.train import main
    run = tmp_path / "run"
    make(run, max_steps=3, ckpt_every=1, keep_last_k=1, warmup_steps=1).fit()
    ck = run / "checkpoints" / "step_000003"
    main(["--config", str(ck), "max_steps=5", "keep_last_k=1"])
    assert not ck.exists()  # pruned by the run it continued
    with pytest.raises(SystemExit): main(["--config", str(ck), "max_steps=6", "keep_last_k=1"])
    assert f"no checkpoint {ck} (deleted, or pruned as its run saved newer ones): the run's settings are in its " \
           f"config.yaml: give --config {run / 'config.yaml'}" in capsys.readouterr().err
    from hymo.train import _resume_from
    args = Namespace(config=str(ck), resume=None, no_resume=False)
    said = _resume_from(SimpleNamespace(run_dir=run), load_config(str(run / "config.yaml")), args)
    assert said == f"the same command with --config {run / 'config.yaml'} resumes from {run / 'checkpoints' / 'step_000005'}"


def test_a_checkpoint_in_a_linked_checkpoints_folder_continues_its_run(tmp_path, monkeypatch, capsys):
    """checkpoints/ moved to another disk and linked back: `--config RUN/checkpoints/step_N` resolved the link, found no
    folder named checkpoints, and trained a new run from step 0 in runs/ (meta.json's run_dir is null for a default
    folder), leaving RUN's lost config.yaml unwritten: the very command generate advises."""
    from hymo.train import main
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    make(run, max_steps=2, ckpt_every=1, warmup_steps=1).fit()
    (tmp_path / "scratch").mkdir()
    os.replace(run / "checkpoints", tmp_path / "scratch" / "ck")
    (run / "checkpoints").symlink_to(tmp_path / "scratch" / "ck")
    (run / "config.yaml").unlink()
    main(["--config", str(run / "checkpoints" / "step_000002")])
    assert not (tmp_path / "runs").exists() and (run / "config.yaml").is_file()


def test_a_checkpoint_config_leaves_out_a_setting_this_version_does_not_know(tmp_path):
    """A checkpoint of another HyMo version, with a setting this one lacks, resumes (the setting is left out); as
    --config it was refused, naming meta.json, which cannot be edited (its own CRC-32). Nor does it get the note about
    design defaults (it is no YAML file to add a base: to)."""
    from hymo.train import design_defaults_note
    run = tmp_path / "run"
    make(run, max_steps=2, ckpt_every=1, warmup_steps=1).fit()
    ck = run / "checkpoints" / "step_000002"
    config = json.loads((ck / "meta.json").read_text())["config"]
    config["train"]["old_knob"] = 3; del config["train"]["decay_fraction"]  # one setting added, one not yet there
    edit_meta(ck / "meta.json", config=config)
    assert load_config(str(ck)).train.max_steps == 2 and design_defaults_note(str(ck)) is None

