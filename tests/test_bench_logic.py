"""need_gpu.provenance, ckpt_save's per-save CRC time and --repeat, gdn_kernel.full_timings' arithmetic: tests for mutants
that tests/test_bench_cli.py and test_bench_gdn.py let survive (each fails on its mutant)."""
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_provenance_marks_a_changed_checkout(tmp_path):
    repo = tmp_path / "repo"; repo.mkdir()
    shutil.copy(ROOT / "benchmarks" / "need_gpu.py", repo / "need_gpu.py")
    (repo / "model.py").write_text("x = 1\n")
    git = lambda *a: subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=t", *a], cwd=repo, check=True, capture_output=True)
    git("init", "-q"); git("add", "."); git("commit", "-qm", "c")
    spec = importlib.util.spec_from_file_location("need_gpu_copy", repo / "need_gpu.py")
    ng = importlib.util.module_from_spec(spec); spec.loader.exec_module(ng)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert ng.provenance()["code"] == head
    (repo / "model.py").write_text("x = 2\n")  # a tracked file changed: the row must not claim the clean commit
    assert ng.provenance()["code"] == head + " + changes"


def test_each_saves_crc_time_is_its_own(tmp_path, monkeypatch):
    "Each save's CRC time counts that save's files only (not the earlier saves' too)."
    monkeypatch.setenv("HYMO_CACHE", str(tmp_path / "cache"))
    import hymo.training.trainer as trm
    import ckpt_save
    real = trm.file_crc
    def slow(path): time.sleep(0.05); return real(path)
    monkeypatch.setattr(trm, "file_crc", slow)
    row = ckpt_save.main(["--repeat", "3", "--run-dir", str(tmp_path)])
    c = row["save_crc_s"]
    assert max(c) < 1.5 * min(c), c  # without a reset per save the third would be ~3x the first


def test_ckpt_save_refuses_repeat_zero(tmp_path, capsys):
    import ckpt_save
    with pytest.raises(SystemExit) as e: ckpt_save.main(["--repeat", "0", "--run-dir", str(tmp_path)])
    assert e.value.code == 2 and "--repeat must be at least 1" in capsys.readouterr().err


def test_gdn_kernel_full_timings_arithmetic(monkeypatch):
    import gdn_kernel as gk
    gt = gk.gt
    fwd = {gt.triton_gated_delta_rule: 1.0, gk.chunk_gated_delta_rule_torch: 10.0, gk.naive_gated_delta_rule: 100.0}
    monkeypatch.setattr(gk, "t_fwd", lambda rule, xs, **kw: fwd[rule])
    monkeypatch.setattr(gk, "t_fwd_bwd", lambda rule, xs, **kw: 2 * fwd[rule])
    monkeypatch.setattr(gk, "peak_memory", lambda rule, xs: ((3 if rule is gt.triton_gated_delta_rule else 6) * 2**20, 2**20))
    monkeypatch.setattr(gk, "kernel_breakdown", lambda xs: {})
    xs = [torch.zeros(1, 4096, 1) for _ in range(5)]
    r = {}
    gk.full_timings(r, xs, [x.clone().requires_grad_() for x in xs], 4096, 256)
    assert (r["triton_fwd_ms"], r["triton_fwd_bwd_ms"], r["torch_chunk_fwd_ms"], r["torch_chunk_fwd_bwd_ms"]) == (1.0, 2.0, 10.0, 20.0)
    assert (r["naive_fwd_ms_extrapolated"], r["naive_fwd_bwd_ms_extrapolated"]) == (1600.0, 3200.0) and r["naive_T_measured"] == 256
    assert (r["triton_fwd_bwd_peak_MB"], r["inputs_outputs_MB"], r["peak_over_io"], r["torch_chunk_fwd_bwd_peak_MB"]) == (3, 1, 3, 6)
