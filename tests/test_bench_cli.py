"""Every GPU benchmark, run on a machine without a GPU, exits with one line that says so (and what a CPU can run
instead), not with a traceback from deep inside PyTorch."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = {"train_step.py": "python -m hymo.train", "optim_step.py": "tests/test_optim.py", "ce_kernel.py": "tests/test_ce_triton.py",
            "gdn_conv_kernel.py": "tests/test_gdn_conv_triton.py", "gdn_kernel.py": "tests/test_bench_gdn.py",
            "host_launch.py": "no equivalent", "block_step.py": "--device cpu --config hymo_tiny",
            "gdn_prep_solve.py": "TRITON_INTERPRET=1", "gdn_verify.py": "TRITON_INTERPRET=1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_gpu_benchmarks_say_they_need_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = {name: subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / name)], cwd=tmp_path, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in GPU_ONLY}
    for name, p in runs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 1, (name, p.returncode, err[-2000:])
        assert "Traceback" not in err, (name, err[-2000:])
        assert err.strip().splitlines()[-1].startswith("this benchmark needs a CUDA GPU"), (name, err[-500:])
        assert GPU_ONLY[name] and GPU_ONLY[name] in err, (name, err)  # and what a CPU can run instead
    assert not list(tmp_path.iterdir()), "a benchmark wrote files before checking for a GPU"


def test_every_benchmark_explains_itself():
    """`--help` of every script in benchmarks/ prints its usage (a stray % in a help string made argparse crash)."""
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "need_gpu.py")
    assert set(GPU_ONLY) <= set(scripts)
    runs = {n: subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / n), "--help"], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in scripts}
    for name, p in runs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "Traceback" not in err, (name, err[-2000:])
        assert out.startswith("usage: ") and "--out" in out, (name, out[:500])
        doc = (ROOT / "benchmarks" / name).read_text().split('"""')[1].strip().splitlines()[0]
        assert doc[:40] in " ".join(out.split()), (name, doc)  # what the script measures, from its docstring


def test_generate_speed_runs_on_a_cpu(tmp_path):
    """benchmarks/generate_speed.py on hymo_tiny: the JSON it writes, and a clear refusal of a prompt that does not fit. (Its
    count of tokens drawn alike is informative only: at initial weights a broken state would draw the same; the parity
    test is tests/test_model.py's, on unit-scale weights.)"""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate_speed.py"), "--device", "cpu", "--prompt", "70",
                        "--tokens", "12", "--out", str(tmp_path / "g.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import json
    g = json.loads((tmp_path / "g.json").read_text())
    assert (g["config"], g["new_tokens"], g["precision"]) == ("hymo_tiny", 12, "fp32") and 0 <= g["leading_tokens_alike"] <= 12, g
    assert g["with_state"]["tokens_per_s"] > 0 and g["forward_per_token"]["tokens_per_s"] > 0
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate_speed.py"), "--tokens", "3", "--out", str(tmp_path / "d.json")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-2000:]  # its defaults fit the CPU's preset (hymo_tiny: 256 tokens)
    assert json.loads((tmp_path / "d.json").read_text())["prompt_tokens"] == 128
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate_speed.py"), "--device", "cpu", "--prompt", "250",
                        "--tokens", "12"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "at most max_seq_len=256" in r.stderr and "Traceback" not in r.stderr


def test_ckpt_save_times_the_trainers_save_and_resume_check(tmp_path, monkeypatch):
    """benchmarks/ckpt_save.py on hymo_tiny: each save's CRC-32 time is a part of it, and the resume's check reads every
    file of the checkpoint but meta.json, which holds the sums (the wrapped `file_crc` is what the trainer calls)."""
    import json
    monkeypatch.setenv("HYMO_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ckpt_save
    row = ckpt_save.main(["--repeat", "2", "--run-dir", str(tmp_path), "--out", str(tmp_path / "row.json")])
    assert json.loads((tmp_path / "row.json").read_text()) == row
    assert len(row["save_s"]) == 2 and all(0 < c < s for s, c in zip(row["save_s"], row["save_crc_s"]))
    ckpt = max((tmp_path / "run" / "checkpoints").iterdir())
    files = json.loads((ckpt / "meta.json").read_text())["files"]
    assert row["files"] == len(files) + 1 and row["load_checked_bytes"] == sum(s["size"] for s in files.values())
    assert row["load_checked_bytes"] == row["checkpoint_bytes"] - (ckpt / "meta.json").stat().st_size
