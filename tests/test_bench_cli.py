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
    g, = json.loads((tmp_path / "g.json").read_text())  # a list of rows, as the results page reads it
    assert (g["config"], g["new_tokens"], g["precision"]) == ("hymo_tiny", 12, "fp32") and 0 <= g["leading_tokens_alike"] <= 12, g
    assert g["date"] and g["torch"] and g["code"] and "triton" in g, g  # the row says what was measured
    assert g["with_state"]["tokens_per_s"] > 0 and g["forward_per_token"]["tokens_per_s"] > 0
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate_speed.py"), "--tokens", "3", "--out", str(tmp_path / "d.json")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-2000:]  # its defaults fit the CPU's preset (hymo_tiny: 256 tokens)
    assert [r["prompt_tokens"] for r in json.loads((tmp_path / "d.json").read_text())] == [128]
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
    (tmp_path / "rows.json").write_text('[{"older": "row"}]')  # the results page's list: the new row goes first, the old stay
    (tmp_path / "row.json").symlink_to(tmp_path / "rows.json")  # through a link: the file it names
    row = ckpt_save.main(["--repeat", "2", "--run-dir", str(tmp_path), "--out", str(tmp_path / "row.json")])
    assert json.loads((tmp_path / "rows.json").read_text()) == [row, {"older": "row"}] and (tmp_path / "row.json").is_symlink()
    assert len(row["save_s"]) == 2 and all(0 < c < s for s, c in zip(row["save_s"], row["save_crc_s"]))
    assert row["load_checked_bytes"] == row["checkpoint_bytes"] - row["meta_json_bytes"] > 0
    assert row["date"] and row["torch"] and row["code"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "row.json", "rows.json"]  # the timed run (a 750M one holds ~10 GB) removed


SCRIPTS_WITH_OUT = ["block_step.py", "ce_kernel.py", "ckpt_save.py", "gdn_conv_kernel.py", "gdn_kernel.py", "gdn_prep_solve.py",
                    "gdn_registers.py", "gdn_verify.py", "generate_speed.py", "host_launch.py", "optim_step.py", "train_step.py"]


def _run_all(cases: dict, cwd) -> dict:
    "Run each `name: (script, args)` at once (they only read their arguments); `name: CompletedProcess-like (rc, stderr)`."
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": ""}
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=cwd, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, (script, args) in cases.items()}
    return {name: (p.wait(timeout=300), p.communicate()[1]) for name, p in procs.items()}


def test_every_benchmark_refuses_an_out_it_could_not_write_before_it_runs(tmp_path):
    "A bad --out failed with a traceback after the whole measurement (minutes of GPU time); now it is refused first."
    assert set(SCRIPTS_WITH_OUT) == {p.name for p in (ROOT / "benchmarks").glob("*.py")} - {"need_gpu.py"}
    cases = {s: (s, ["--out", str(tmp_path / "missing" / "r.json")]) for s in SCRIPTS_WITH_OUT}
    cases["folder"] = ("gdn_kernel.py", ["--out", str(tmp_path)])
    cases["best-out"] = ("gdn_conv_kernel.py", ["--sweep", "--best-out", str(tmp_path / "missing" / "t.json")])
    for name, (rc, err) in _run_all(cases, tmp_path).items():
        assert rc == 2 and "Traceback" not in err, (name, rc, err[-1500:])
        says = {"folder": "is a folder; give the name of a file", "best-out": "--best-out"}.get(name, "--out")
        assert says in err and ("does not exist; create it" in err or name == "folder"), (name, err[-500:])
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refused benchmark wrote something"


def test_benchmark_options_that_would_measure_nothing_or_be_ignored_are_refused(tmp_path):
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "dict.json").write_text("{}")
    (tmp_path / "a_file").write_text("")
    cases = {  # a result written whole is refused an existing file (a rerun replaced the record); rows are added to a list
        **{f"{s} over a file": (s, ["--out", str(tmp_path / "dict.json")], "exists, and this result would replace it")
           for s in SCRIPTS_WITH_OUT if s not in ("ckpt_save.py", "generate_speed.py", "gdn_registers.py", "train_step.py")},
        "rows into a table": ("ckpt_save.py", ["--out", str(tmp_path / "dict.json")], "holds a JSON dict, not a list of rows"),
        "rows into a broken file": ("generate_speed.py", ["--out", str(tmp_path / "a_file")], "cannot be read as JSON"),
        "train_step into a folder": ("train_step.py", ["--out", str(tmp_path)], "is a folder; give the name of a file"),
        "tiles not JSON": ("train_step.py", ["--conv-launch", str(tmp_path / "a_file")], "cannot be read as JSON"),
        "tiles a list": ("train_step.py", ["--conv-launch", str(tmp_path / "list.json")], "is not tiles by kernel"),
        "unknown decays": ("gdn_verify.py", ["--decays", "strong,bogus"], "--decays: unknown ['bogus']"),
        "device mps": ("block_step.py", ["--device", "mps"], "the benchmarks run on cpu or cuda"),
        "naive-T 0": ("gdn_kernel.py", ["--naive-T", "0"], "--naive-T 0: give 1 to 4096"),
        "naive-T past T": ("gdn_kernel.py", ["--naive-T", "8192"], "--naive-T 8192: give 1 to 4096"),
        "optim steps 0": ("optim_step.py", ["--steps", "0"], "--steps must be at least 1, got 0"),
        "optim warmup -1": ("optim_step.py", ["--warmup", "-1"], "--warmup must be at least 0, got -1"),
        "device gpu": ("generate_speed.py", ["--device", "gpu"], "argument --device: Expected one of cpu, cuda"),
        "ckpt config": ("ckpt_save.py", ["--config", "nope"], "nope"),
        "ckpt run-dir file": ("ckpt_save.py", ["--run-dir", str(tmp_path / "a_file")], "is not a folder"),
        "profile rows alone": ("train_step.py", ["--profile-rows", "5"], "--profile-rows sets the profiler table's rows: it needs --profile"),
        "micro-batches in a step profile": ("train_step.py", ["--profile", "--profile-micro-batches", "5"], "give --profile micro or --profile cuda"),
        "best-out without sweep": ("gdn_conv_kernel.py", ["--best-out", str(tmp_path / "t.json")], "--best-out writes the sweep's fastest tiles: it needs --sweep"),
        "registers into a list": ("gdn_registers.py", ["--out", str(tmp_path / "list.json")], "holds a JSON list, not tables by key"),
    }
    results = _run_all({n: c[:2] for n, c in cases.items()}, tmp_path)
    for name, (rc, err) in results.items():
        assert rc == 2 and "Traceback" not in err and cases[name][2] in err, (name, rc, err[-1500:])


@pytest.mark.parametrize("script", ["gdn_kernel.py", "ce_kernel.py", "gdn_verify.py", "gdn_registers.py"])
def test_a_triton_benchmark_without_triton_says_so_in_one_line(script):
    "Triton installs only on Linux; these scripts imported it before anything could say what was missing."
    code = (f"import runpy, sys; sys.modules['triton'] = None; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"sys.argv = [{script!r}, '--help']; runpy.run_path({str(ROOT / 'benchmarks' / script)!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert r.stderr.strip().splitlines()[-1].startswith("this benchmark needs Triton"), r.stderr[-500:]


def test_add_row_leaves_the_old_list_when_the_write_is_cut(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import json
    import need_gpu
    f = tmp_path / "rows.json"; f.write_text('[{"old": 1}]')
    class Cut(Exception): pass
    def cut(*a): raise Cut
    monkeypatch.setattr(need_gpu.os, "replace", cut)
    with pytest.raises(Cut): need_gpu.add_row(f, {"new": 2})
    assert json.loads(f.read_text()) == [{"old": 1}]


def test_check_out_refuses_what_a_write_would_fail_on(tmp_path, monkeypatch, capsys):
    "A trailing slash, a file where the folder should be, a link into a missing folder; a file or a link to one is fine."
    import argparse
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from need_gpu import check_out
    p = argparse.ArgumentParser(prog="bench")
    (tmp_path / "afile").write_text("")
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere" / "x.json")
    for path, says in [(f"{tmp_path}/new.json/", "is a folder"), (str(tmp_path / "afile" / "x.json"), "afile is a file, not a folder"),
                       (str(tmp_path / "dangling.json"), "nowhere does not exist"), ("~/nope/x.json", "(~ is not expanded inside quotes)"),
                       ("", "is empty"), (f"{tmp_path}/nope/..", "is a folder")]:
        with pytest.raises(SystemExit): check_out(p, path)
        assert says in capsys.readouterr().err, path
    (tmp_path / "kept.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "kept.json")
    for kept in ("kept.json", "link.json"):  # a result written whole would replace it; one added to it needs its kind of JSON
        with pytest.raises(SystemExit): check_out(p, str(tmp_path / kept))
        assert "exists, and this result would replace it" in capsys.readouterr().err
        with pytest.raises(SystemExit): check_out(p, str(tmp_path / kept), adds=list)
        assert "holds a JSON dict, not a list of rows" in capsys.readouterr().err
        check_out(p, str(tmp_path / kept), adds=dict)
    check_out(p, str(tmp_path / "new.json"))
    assert sorted(f.name for f in tmp_path.iterdir()) == ["afile", "dangling.json", "kept.json", "link.json"]  # nothing written
