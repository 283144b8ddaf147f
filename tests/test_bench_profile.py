"""The profile arithmetic of benchmarks/train_step.py: idle gaps between GPU activity and the host work during them,
and the per-micro-batch timeline (`--timeline`).

The benchmark itself needs a GPU; these helpers take plain `(start, end, name)` intervals and are checked here, and
its step runs here on hymo_tiny with the CUDA calls stood in for.
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import torch  # noqa: E402
from train_step import host_during, idle_gaps, launched_by, time_micro_batches, timeline  # noqa: E402


def test_gaps_are_the_stretches_with_nothing_running():
    # overlapping kernels (two streams) leave no gap between them; a kernel nested in a longer one neither
    kernels = [(0, 10, "a"), (5, 20, "b"), (8, 12, "nested"), (30, 40, "c"), (40, 50, "d"), (150, 160, "e")]
    gaps, first, last = idle_gaps(kernels)
    assert (first, last) == (0, 160)
    assert gaps == [(10, 20, 30, "b", "c"), (100, 50, 150, "d", "e")]


def test_host_operators_are_ranked_by_their_overlap_with_a_gap():
    ops = [(0, 200, "step"), (25, 35, "aten::linear"), (60, 140, "guards"), (100, 149, "launch"), (150, 170, "after")]
    assert host_during(ops, 50, 150) == ["step (100 us)", "guards (80 us)", "launch (49 us)"]
    assert host_during(ops, 50, 150, top=1) == ["step (100 us)"]
    assert host_during(ops, 300, 400) == []


def test_kernels_are_counted_by_the_host_operators_that_launched_them():
    rows = [(["aten::zero_", "aten::zeros", "CompiledFunctionBackward"], ["Memset (Device)", "Memset (Device)"]),
            (["aten::add_", "AccumulateGrad"], ["add<float>"]),
            (["aten::zero_", "aten::zeros", "CompiledFunctionBackward"], ["Memset (Device)", "gemm"]),
            (["aten::fill_", "aten::zeros"], ["Memset (Device)"]),
            (["cudaMemsetAsync", "aten::fill_", "aten::zeros"], ["Memset (Device)"]),  # the runtime call: not counted again
            (["Command Buffer Full", "cudaLaunchKernel", "aten::sort"], ["Memset (Device)"])]
    assert launched_by(rows, r"^Memset") == ["aten::zero_ < aten::zeros < CompiledFunctionBackward: 3",
                                             "aten::fill_ < aten::zeros: 1"]
    assert launched_by(rows, r"add<float>", top=5) == ["aten::add_ < AccumulateGrad: 1"]
    assert launched_by(rows, r"nothing") == []


def test_a_profile_window_of_no_micro_batches_is_refused_before_anything_runs():
    import subprocess
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"
    r = subprocess.run([sys.executable, str(script), "--profile", "cuda", "--profile-micro-batches", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--profile-micro-batches must be at least 1" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--doc-masking", "-3"], "--doc-masking must be at least 0"),
    (["--compile-mode", "reduce-overhead"], "needs --compile"),
    (["--gdn", "torch", "--conv-launch", "tiles.json"], "which --gdn torch does not run"),
    (["--all-mla", "--conv-launch", "tiles.json"], "which --all-mla does not run"),
    (["--compile", "--warmup", "0"], "would time the compilation"),
    (["--conv-launch", "no_such_tiles.json"], "--conv-launch no_such_tiles.json: no such file"),
    (["--seq-len", "5000"], "cannot run: train.seq_len=5000 is longer than model.max_seq_len=4096"),
    (["--seq-len", "2"], "use seq_len > mtp_depth=2")])
def test_train_step_refuses_what_would_measure_something_else(argv, says, capsys):
    from train_step import build_parser, check_args
    p = build_parser()
    with pytest.raises(SystemExit) as e: check_args(p, p.parse_args(argv))
    assert e.value.code == 2 and says in capsys.readouterr().err
    check_args(p, p.parse_args(["--compile", "--compile-mode", "reduce-overhead", "--doc-masking", "0"]))  # fine


def test_train_step_refuses_torchrun_and_an_unusable_out_before_measuring(tmp_path, monkeypatch, capsys):
    "Under torchrun every rank counted the global batch at one GPU's peak; a bad --out failed after the whole run."
    from train_step import build_parser, check_args
    p = build_parser()
    def refused(argv, says):
        with pytest.raises(SystemExit) as e: check_args(p, p.parse_args(argv))
        assert e.value.code == 2 and says in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    refused([], "run it with python, not torchrun")
    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "cut.json").write_text('[{"code": ')
    refused(["--out", str(tmp_path / "cut.json")], "cannot be read as JSON")
    (tmp_path / "dict.json").write_text("{}")
    refused(["--out", str(tmp_path / "dict.json")], "holds a JSON dict, not a list of rows")
    refused(["--out", str(tmp_path / "nope" / "r.json")], "does not exist; create it")
    check_args(p, p.parse_args(["--out", str(tmp_path / "new.json")]))  # a new file in a folder that exists: fine


def test_the_h200_script_keeps_off_the_results_record(tmp_path):
    import subprocess
    root = Path(__file__).resolve().parents[1]
    for out in (None, "benchmarks/results", "./benchmarks/../benchmarks/results/"):
        env = {k: v for k, v in os.environ.items() if k != "OUT"} | ({"OUT": out} if out else {})
        before = {f: f.stat().st_mtime_ns for f in (root / "benchmarks" / "results").iterdir()}
        r = subprocess.run(["bash", "benchmarks/h200_train_step.sh", "main"], cwd=root, env=env, capture_output=True, text=True)
        assert r.returncode != 0 and ("scratch folder" in r.stderr), (out, r.stderr)
        assert {f: f.stat().st_mtime_ns for f in (root / "benchmarks" / "results").iterdir()} == before
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": "results"}  # run from benchmarks/: OUT is benchmarks/results
    r = subprocess.run(["bash", "h200_train_step.sh", "main"], cwd=root / "benchmarks", env=env, capture_output=True, text=True)
    assert r.returncode == 2 and f"OUT={root}/benchmarks/results is benchmarks/results" in r.stderr, r.stderr
    env["OUT"] = str(tmp_path / "new")  # elsewhere, and no GPU: said once, before any folder is made
    r = subprocess.run(["bash", "h200_train_step.sh", "host"], cwd=root / "benchmarks", env=env, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("these benchmarks need a CUDA GPU") and not (tmp_path / "new").exists(), r.stderr


class FakeEvent:
    "A CUDA event on a fake GPU clock: `record` stamps the clock's time; `query` is True once the clock has passed it."
    clock = 0.0

    def __init__(self, enable_timing=False): self.t = None
    def record(self): self.t = FakeEvent.clock
    def query(self): return FakeEvent.clock >= self.t + 5  # the GPU runs 5 ms behind the host: an event completes 5 ms later
    def elapsed_time(self, other): return other.t - self.t


def test_the_timeline_times_each_micro_batch_and_sees_when_the_gpu_ran_dry(monkeypatch):
    import hymo.training.trainer as tr
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "clock", 0.0)
    gpu_ms = iter([10.0, 12.0, 20.0])  # what each micro-batch advances the GPU clock by

    def plain(self, last):  # stands in for the trainer's forward_backward
        FakeEvent.clock += next(gpu_ms)
        return last
    monkeypatch.setattr(tr, "forward_backward", plain)
    rows, restore = time_micro_batches()
    assert tr.forward_backward is not plain
    s0 = FakeEvent(); s0.record()
    outs = []
    for i, host_gap in enumerate([0, 8, 2]):  # the host's time between micro-batches
        FakeEvent.clock += host_gap
        outs.append(tr.forward_backward(None, last=i == 2))
    assert outs == [False, False, True]
    FakeEvent.clock += 7; s1 = FakeEvent(); s1.record()  # the optimiser's 7 ms
    restore()
    assert tr.forward_backward is plain
    line = timeline(rows, s0, s1)
    assert line["micro_batches"] == 3 and line["boundaries"] == 2
    assert (line["gpu_span_ms_mean"], line["gpu_span_ms_min"], line["gpu_span_ms_max"]) == (14.0, 10.0, 20.0)
    assert (line["before_first_ms"], line["after_last_ms"]) == (0.0, 7.0)
    assert line["boundaries_gpu_drained"] == 1  # after 8 ms the 5 ms still queued had run out; after 2 ms they had not
    assert abs(line["host_ms_mean"] - sum(r["host_ms"] for r in rows) / 3) < 1e-9


def test_the_step_on_a_cpu_counts_packed_documents_and_labels_its_row(monkeypatch):
    """`run` on hymo_tiny (CUDA's clocks and memory stood in for): with --doc-masking its FLOPs per token are the
    trainer's, attention within documents, below the window's count; the MFU uses the peak the row records."""
    import train_step as ts
    from hymo.config import load_config
    def tiny(name, **over):  # the preset's split of the batch, at hymo_tiny's size and in fp32 on the CPU
        over.update(precision="fp32", gdn_kernel="torch", seq_len=64)
        return load_config("hymo_tiny", **over)
    monkeypatch.setattr(ts, "load_config", tiny)
    monkeypatch.setattr(ts, "peak_flops", lambda device: 1e12)
    for f in ("reset_peak_memory_stats", "synchronize", "empty_cache"): monkeypatch.setattr(torch.cuda, f, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "cpu")
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    p = ts.build_parser()
    rows = {docs: ts.run(p.parse_args(["--seq-len", "64", "--micro-batch", "2", "--accum", "2", "--warmup", "0", "--steps", "1",
                                       "--gdn", "torch", "--doc-masking", str(docs), "--code", "a test"]))
            for docs in (0, 16)}
    whole = rows[0]["flops_per_token"]
    assert rows[16]["flops_per_token"] < whole and "docs~16" in rows[16]["variant"]
    model = tiny("hymo_tiny")
    from hymo.models.model import build_hymo
    assert whole == pytest.approx(build_hymo(model.model, device="meta").flops_per_token(64))  # the model's own count
    for r in rows.values():
        assert r["code"] == "a test" and r["table_peak"] == 1e12 and r["mfu_formula"].endswith("/ 1e+12")
        assert r["tokens_per_s"] == pytest.approx(2 * 2 * 64 / r["step_s"])  # the step's tokens: micro-batch x accum x seq
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / 1e12)
        assert (r["seq_len"], r["micro_batch"], r["accum"], r["warmup"], r["steps"]) == (64, 2, 2, 0, 1)
        assert "batch=2x64" in r["variant"]  # not the preset's 4 x 4096: never read as a preset row


@pytest.mark.parametrize("argv, says", [(["--iters", "0"], "--iters must be at least 1, got 0"),
                                        (["--batch", "0"], "--batch must be at least 1"),
                                        (["--seq-len", "-4"], "--seq-len must be at least 1")])
def test_block_step_refuses_sizes_that_time_nothing(argv, says):
    "--iters 0 crashed with a ZeroDivisionError after compiling the block; --batch 0 timed an empty tensor."
    import subprocess, sys
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "block_step.py"), "--device", "cpu", "--config", "hymo_tiny", *argv],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "block_step.py"), "--device", "cpu", "--config", "hymo_tiny",
                        "--seq-len", "300"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--seq-len 300 is longer than hymo_tiny's max_seq_len=256" in r.stderr, r.stderr[-1500:]
