"""benchmarks/train_step.py's arithmetic and timing, on a CPU: idle gaps, host time, timelines, optimiser spans, the
profile's bins, synthetic data, and `run` itself under a simulated clock where `synchronize` waits for queued GPU work."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_step as ts  # noqa: E402


class E:  # a recorded CUDA event at GPU time t (ms)
    def __init__(self, t=None, enable_timing=False): self.t = t
    def elapsed_time(self, other): return other.t - self.t


def test_idle_gaps_sorts_its_input_and_ends_at_the_latest_end():
    gaps, first, last = ts.idle_gaps([(30, 40, "c"), (0, 100, "long"), (50, 60, "inside"), (120, 130, "e")])
    assert (first, last) == (0, 130) and gaps == [(20, 100, 120, "long", "e")]
    gaps, first, last = ts.idle_gaps([(0, 100, "long"), (10, 20, "short")])  # the last to start ends first
    assert (gaps, first, last) == ([], 0, 100)


def test_host_during_leaves_out_operators_that_only_touch_the_gap():
    ops = [(0, 50, "before"), (60, 70, "in"), (150, 200, "after")]
    assert ts.host_during(ops, 50, 150, top=5) == ["in (10 us)"]


def test_timeline_min_max_and_the_signs_of_the_edges():
    rows = [dict(e0=E(3), e1=E(23), host_ms=1.0, drained=None), dict(e0=E(23), e1=E(33), host_ms=3.0, drained=True),
            dict(e0=E(40), e1=E(52), host_ms=2.0, drained=False)]
    line = ts.timeline(rows, E(0), E(60))
    assert (line["gpu_span_ms_mean"], line["gpu_span_ms_min"], line["gpu_span_ms_max"]) == (14.0, 10.0, 20.0)
    assert (line["before_first_ms"], line["after_last_ms"]) == (3.0, 8.0)
    assert (line["boundaries_gpu_drained"], line["boundaries"], line["host_ms_mean"]) == (1, 2, 2.0)


def test_time_micro_batches_reports_host_time_in_ms(monkeypatch):
    import hymo.training.trainer as tr
    clock = [0.0]
    monkeypatch.setattr(ts.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "Event", E)
    monkeypatch.setattr(E, "record", lambda self: setattr(self, "t", 0.0), raising=False)
    monkeypatch.setattr(E, "query", lambda self: True, raising=False)
    def plain(self, last): clock[0] += 0.004  # 4 ms of host time
    monkeypatch.setattr(tr, "forward_backward", plain)
    rows, restore = ts.time_micro_batches()
    tr.forward_backward(None, last=True); restore()
    assert rows[0]["host_ms"] == pytest.approx(4.0)


def test_optimizer_ms_is_the_median_and_spans_are_positive(monkeypatch):
    spans = {"A": [(E(0), E(5), 1.0), (E(0), E(1), 9.0), (E(0), E(3), 2.0)]}
    assert ts.optimizer_ms(spans) == {"A": {"gpu_span_ms": 3, "host_ms": 2.0}}
    gpu = [0.0]
    class Ev(E):
        def record(self): self.t = gpu[0]
    monkeypatch.setattr(torch.cuda, "Event", Ev)
    class Opt:
        def step(self): gpu[0] += 7.0
    opt = Opt(); rec = ts.time_optimizers([opt]); opt.step()
    assert ts.optimizer_ms(rec)["Opt"]["gpu_span_ms"] == 7.0


class Prof:
    def __init__(self, cuda, cpu=()):
        ev = lambda s, e, n, d: SimpleNamespace(time_range=SimpleNamespace(start=s, end=e), name=n, device_type=d)
        self._ev = [ev(*k, torch.autograd.DeviceType.CUDA) for k in cuda] + [ev(*o, torch.autograd.DeviceType.CPU) for o in cpu]
    def events(self): return self._ev
    def key_averages(self):
        return [SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, key="nvjet_gemm", self_device_time_total=4000.0),
                SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, key="_ce_kernel", self_device_time_total=2000.0),
                SimpleNamespace(device_type=torch.autograd.DeviceType.CPU, key="aten::mm", self_device_time_total=9e9)]


def test_gpu_idle_bins_gaps_by_length_per_micro_batch():
    p = Prof([(0, 10, "a"), (20, 30, "b"), (130, 140, "c")], [(0, 200, "step")])  # gaps of exactly 10 and 100 us
    g = ts.gpu_idle(p, n_micro=2)
    assert g["span_ms"] == pytest.approx(0.070) and g["idle_ms"] == pytest.approx(0.055)
    assert g["idle_ms_by_gap"] == pytest.approx({"< 10 us": 0, "10-100 us": 0.005, ">= 100 us": 0.050})
    assert g["gaps_per_micro_batch"] == 1 and g["longest"][0]["host"] == ["step (100 us)"]


def test_breakdown_is_ms_per_micro_batch_of_cuda_kernels_only():
    assert ts.breakdown(Prof([]), n_micro=2) == {"matrix multiplies": 2.0, "cross-entropy softmax pass": 1.0}


def test_synthetic_targets_are_the_next_tokens_and_documents_have_the_mean_length(monkeypatch):
    t = ts.SyntheticTrainer.__new__(ts.SyntheticTrainer)
    t.mcfg, t.cfg = SimpleNamespace(vocab_size=100), SimpleNamespace(seq_len=4096, micro_batch_size=4)
    monkeypatch.setattr(ts, "DOC_LEN", 0)  # as a process starts (a test's `run --doc-masking` may have set it)
    t.setup_data()
    tok, tgt = next(t.train_loader)
    assert tok.shape == tgt.shape == (4, 4096) and torch.equal(tok[:, 1:], tgt[:, :-1]) and int(tok.min()) >= 1
    monkeypatch.setattr(ts, "DOC_LEN", 64)
    t.setup_data()
    tok, tgt, cu = next(t.train_loader)
    assert abs((tok == 0).float().mean().item() * 64 - 1) < 0.25  # ~1 document start per 64 tokens


@pytest.mark.parametrize("argv, says", [(["--accum", "0"], "--accum must be at least 1"),
                                        (["--micro-batch", "0"], "--micro-batch must be at least 1")])
def test_train_step_refuses_empty_batches(argv, says, capsys):
    p = ts.build_parser()
    with pytest.raises(SystemExit) as e: ts.check_args(p, p.parse_args(argv))
    assert e.value.code == 2 and says in capsys.readouterr().err


def _fake_gpu_run(monkeypatch, argv, step_gpu_s, skipped=()):
    """`run` on hymo_tiny with a simulated clock: each train_step takes 0.01 s of host time and queues `step_gpu_s[i]`
    of GPU work, which only `torch.cuda.synchronize` waits for; memory as a fake allocator."""
    from hymo.config import load_config
    monkeypatch.setattr(ts, "DOC_LEN", ts.DOC_LEN)  # run() sets the module's global: restored after the test
    monkeypatch.setattr(ts, "load_config", lambda name, **o: load_config("hymo_tiny", **{**o, "precision": "fp32",
                                                                                         "gdn_kernel": "torch", "seq_len": 64}))
    monkeypatch.setattr(ts, "peak_flops", lambda device: 1e12)
    st = dict(host=0.0, gpu=0.0, calls=0, log=[], per_step=[])
    monkeypatch.setattr(ts.time, "perf_counter", lambda: st["host"])
    def sync(*a, **k): st["host"] = max(st["host"], st["gpu"]); st["log"].append("sync")
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: st["log"].append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 12_345_678_900)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a, **k: 13_000_000_000)
    for f in ("empty_cache",): monkeypatch.setattr(torch.cuda, f, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "cpu")
    class Ev(E):
        def record(self): self.t = st["gpu"] * 1e3
        def query(self): return True
    monkeypatch.setattr(torch.cuda, "Event", Ev)
    init, real = ts.SyntheticTrainer.__init__, ts.SyntheticTrainer.train_step
    def built(self, *a, **k): st["log"].append("build"); init(self, *a, **k)
    def step(self):
        m = real(self); i = st["calls"]; st["calls"] += 1; st["log"].append("step")
        st["host"] += 0.01; st["gpu"] = max(st["gpu"], st["host"]) + step_gpu_s[i]
        st["per_step"].append(m["flops"] / m["tokens"])
        if i in skipped: m["skipped"] = True
        return m
    monkeypatch.setattr(ts.SyntheticTrainer, "__init__", built)
    monkeypatch.setattr(ts.SyntheticTrainer, "train_step", step)
    p = ts.build_parser()
    return ts.run(p.parse_args(["--seq-len", "64", "--micro-batch", "2", "--accum", "2", "--gdn", "torch", *argv])), st


def test_run_times_whole_gpu_steps_after_warmup_and_reports_their_median(monkeypatch):
    r, st = _fake_gpu_run(monkeypatch, ["--warmup", "1", "--steps", "3", "--doc-masking", "16"], [100.0, 2.0, 3.0, 1.0])
    assert st["calls"] == 4 and r["step_times_s"] == pytest.approx([2.01, 3.01, 1.01])  # the warm-up's 100 s not timed
    assert r["step_s"] == pytest.approx(2.01)  # the median, the GPU's time (not the host's 0.01 s)
    assert r["tokens_per_s"] == pytest.approx(2 * 2 * 64 / r["step_s"])
    assert r["flops_per_token"] == pytest.approx(sum(st["per_step"][1:]) / 3)  # the timed steps' mean
    assert st["log"][:2] == ["reset", "build"] and r["peak_mem_gb"] == pytest.approx(12.3456789)  # 1e9 bytes, from the start
    assert r["peak_reserved_gb"] == pytest.approx(13.0) and r["step_stat"] == "median"


def test_run_timeline_has_one_line_per_step_of_accum_micro_batches(monkeypatch):
    r, st = _fake_gpu_run(monkeypatch, ["--warmup", "0", "--steps", "2", "--timeline"], [1.0, 1.0])
    assert [l["micro_batches"] for l in r["timeline"]] == [2, 2]


def test_run_refuses_a_timed_step_that_skipped_its_optimiser_step(monkeypatch):
    "A non-finite step skips the optimisers and the bias update: a faster step that is not training's."
    with pytest.raises(SystemExit, match="a timed step skipped its optimiser step"):
        _fake_gpu_run(monkeypatch, ["--warmup", "0", "--steps", "2"], [1.0, 1.0], skipped={1})


def test_a_warm_up_step_that_skipped_is_no_matter(monkeypatch):
    r, st = _fake_gpu_run(monkeypatch, ["--warmup", "1", "--steps", "1"], [1.0, 1.0], skipped={0})
    assert st["calls"] == 2 and len(r["step_times_s"]) == 1


def test_every_run_warms_up(capsys):
    "The first step compiles the Triton kernels and NorMuon's update, compiled blocks or not: it is never timed."
    p = ts.build_parser()
    with pytest.raises(SystemExit) as e: ts.check_args(p, p.parse_args(["--warmup", "0"]))
    assert e.value.code == 2 and "--warmup 0 would time the compilation" in capsys.readouterr().err


# From mutation testing of train_step.py (each test failed on a mutant the others let through)


def test_step_s_is_the_median_not_the_mean(monkeypatch):
    r, _ = _fake_gpu_run(monkeypatch, ["--warmup", "1", "--steps", "3"], [100.0, 2.0, 3.0, 10.0])
    assert r["step_s"] == pytest.approx(3.01)  # the mean would be 5.01


def test_an_even_count_takes_the_upper_median(monkeypatch):
    r, _ = _fake_gpu_run(monkeypatch, ["--warmup", "1", "--steps", "2"], [100.0, 2.0, 5.0])
    assert r["step_s"] == pytest.approx(5.01)  # the docstring: "the upper one of an even count"


def test_tokens_per_s_counts_micro_batch_times_accum(monkeypatch):
    r, _ = _fake_gpu_run(monkeypatch, ["--warmup", "1", "--steps", "1", "--micro-batch", "1", "--accum", "3"], [1.0, 2.0])
    assert r["tokens_per_s"] == pytest.approx(1 * 3 * 64 / 2.01)
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / 1e12)


class FakeProfile:
    "Stands in for torch.profiler.profile: records its activities, returns the test file's Prof."
    seen = []

    def __init__(self, activities):
        FakeProfile.seen.append(list(activities))
        self.p = Prof([(0, 10, "nvjet_gemm"), (20, 30, "_ce_kernel")], [(0, 40, "step")])
        for e in self.p._ev: e.kernels, e.cpu_parent = [], None

    def __enter__(self): return self
    def __exit__(self, *a): return False
    def events(self): return self.p.events()

    def key_averages(self):
        class KA(list):
            def table(self, **kw): return "TABLE"
        return KA(self.p.key_averages())


@pytest.mark.parametrize("argv, per, acts", [
    (["--profile", "step", "--accum", "2", "--profile-micro-batches", "5"], 2, "cpu+cuda"),  # a step: accum micro-batches
    (["--profile", "cuda", "--accum", "2", "--profile-micro-batches", "4"], 4, "cuda"),
    (["--profile", "micro", "--accum", "2", "--profile-micro-batches", "4"], 4, "cpu+cuda")])
def test_the_profile_is_per_micro_batch_of_what_it_ran(monkeypatch, argv, per, acts):
    import torch.profiler
    FakeProfile.seen = []
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    r, _ = _fake_gpu_run(monkeypatch, ["--warmup", "1", "--steps", "1", *argv], [1.0] * 4)
    assert r["profile_ms_per_micro_batch"] == pytest.approx({"matrix multiplies": 4.0 / per, "cross-entropy softmax pass": 2.0 / per})
    want = [torch.profiler.ProfilerActivity.CUDA] if acts == "cuda" else [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    assert FakeProfile.seen == [want] and r["profile_host_recorded"] is (acts != "cuda")


def _keys(*names):
    p = Prof([])
    p.key_averages = lambda: [SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, key=k, self_device_time_total=1000.0)
                              for k in names]
    return p


@pytest.mark.parametrize("key, cat", [
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", "attention (cuDNN SDPA)"),   # a cutlass attention kernel is attention
    ("triton_poi_fused_cat_copy_0", "compiled elementwise (inductor)"),        # an inductor kernel fusing a cat
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matrix multiplies"),  # the pattern anywhere in the name
    ("void at::native::reduce_kernel<512, 1>", "eager elementwise, copies, reductions")])
def test_profile_categories(key, cat):
    assert ts.breakdown(_keys(key), n_micro=1) == {cat: 1.0}


def test_breakdown_is_largest_first():
    p = _keys("nvjet_a", "_ce_kernel", "_ce_kernel2", "_ce_kernel3")
    assert list(ts.breakdown(p, 1)) == ["cross-entropy softmax pass", "matrix multiplies"]


def test_optimizer_gpu_span_is_the_median():
    spans = {"A": [(E(0), E(1), 1.0), (E(0), E(2), 1.0), (E(0), E(9), 1.0)]}
    assert ts.optimizer_ms(spans)["A"]["gpu_span_ms"] == 2  # the mean would be 4


@pytest.mark.parametrize("mb, T, shown", [(4, 2048, True), (2, 4096, True), (4, 4096, False)])
def test_a_batch_other_than_the_presets_is_in_the_label(mb, T, shown):
    p = ts.build_parser()
    v = ts.variant(p.parse_args(["--micro-batch", str(mb), "--seq-len", str(T)]))
    assert (f"batch={mb}x{T}" in v) is shown, v


def test_profile_rows_zero_is_refused(capsys):
    p = ts.build_parser()
    with pytest.raises(SystemExit) as e: ts.check_args(p, p.parse_args(["--profile", "--profile-rows", "0"]))
    assert e.value.code == 2 and "--profile-rows must be at least 1" in capsys.readouterr().err
