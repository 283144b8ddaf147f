"""The cross-entropy chunk kernel (chapter 42) against `ce_chunk`, on CPU through Triton's interpreter.

The kernel runs in a fresh process (`_interpret.run_child`), which prints the errors as JSON; the tests judge them.
"""
import math
import textwrap

import pytest
import torch
from _interpret import run_child

import hymo.models.ce_triton as ce

# The references are fp64: torch's fp32 logsumexp on CPU came out a few ulps apart from one process to the next
# (a relative gradient error of 4.6e-6 against the kernel in some runs, 1.3e-7 in others).
CHILD = textwrap.dedent('''
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import hymo.models.ce_triton as ce
    from hymo.models.mtp import ce_chunk

    out = {}
    for name, (c, V, dt, BV) in dict(fp32=(6, 1000, torch.float32, 256), bf16=(4, 777, torch.bfloat16, 128),
                                     one_block=(3, 100, torch.float32, 4096)).items():
        gen = torch.Generator().manual_seed(len(name))
        z = (torch.randn(c, V, generator=gen) * 3).to(dt)
        y = torch.randint(0, V, (c,), generator=gen); y[0] = V - 1              # a target in the masked last block
        w = torch.full((c,), 1 / (c - 1)); w[1] = 0                            # row 1 ignored
        ce.LAUNCH["BV"] = BV
        (lt, gt), (lr, gr) = ce.triton_ce_chunk(z, y, w, True), ce_chunk(z.double(), y, w.double(), True)
        lt2, g2 = ce.triton_ce_chunk(z, y, w, False)
        steps = (gt.double() - gr).abs() / (gr.abs() * 2 ** -7 + 1e-9 * gr.abs().max())  # errors in bf16 steps of the reference
        out[name] = dict(loss=abs(lt.item() - lr.item()) / abs(lr.item()), dz=((gt.double() - gr).norm() / gr.norm()).item(),
                         dz_steps=steps.max().item(),
                         ignored_row=gt[1].abs().max().item(), dtype=str(gt.dtype), no_grad_loss=abs(lt2.item() - lt.item()),
                         no_grad_is_none=g2 is None)
    gen = torch.Generator().manual_seed(7)                                # logits a column slice of a wider tensor
    wide = torch.randn(5, 300 + 13, generator=gen) * 3
    z, y, w = wide[:, :300], torch.randint(0, 300, (5,), generator=gen), torch.full((5,), 0.2)
    ce.LAUNCH["BV"] = 128
    (lt, gt), (lr, gr) = ce.triton_ce_chunk(z, y, w, True), ce_chunk(z.double(), y, w.double(), True)
    out["row_stride"] = dict(loss=abs(lt.item() - lr.item()) / abs(lr.item()), dz=((gt - gr).norm() / gr.norm()).item(),
                             stride=z.stride(0))
    gen = torch.Generator().manual_seed(11)                               # logits far from zero, the largest in the last
    z = torch.randn(4, 300, generator=gen) * 30 + 1000; z[:, 290] += 100  # block: exp overflows without the running max
    y, w = torch.randint(0, 300, (4,), generator=gen), torch.full((4,), 0.25)
    (lt, gt), (lr, gr) = ce.triton_ce_chunk(z, y, w, True), ce_chunk(z.double(), y, w.double(), True)
    out["far_from_zero"] = dict(loss=abs(lt.item() - lr.item()) / abs(lr.item()), dz=((gt - gr).norm() / gr.norm()).item())
    gen = torch.Generator().manual_seed(3)                                # class 0 as a target; targets and weights strided
    z = torch.randn(6, 200, generator=gen) * 3
    y = torch.randint(1, 200, (6,), generator=gen); y[2] = 0              # a real target of class 0
    w = torch.full((6,), 0.2); w[4] = 0; y[4] = 0                         # an ignored row, clamped to 0 as linear_cross_entropy does
    yy = torch.stack([y, torch.randint(0, 200, (6,), generator=gen)], 1)  # y = yy[:, 0], a view with stride 2
    ww = torch.stack([w, torch.rand(6, generator=gen)], 1)
    lr, gr = ce_chunk(z.double(), y, w.double(), True)
    for name, (yi, wi) in dict(class_0=(y, w), strided_targets=(yy[:, 0], ww[:, 0])).items():
        lt, gt = ce.triton_ce_chunk(z, yi, wi, True)
        out[name] = dict(loss=abs(lt.item() - lr.item()) / lr.item(), dz=((gt - gr).norm() / gr.norm()).item())
    z, y, w = wide[:, :300], torch.randint(0, 300, (5,), generator=gen), torch.full((5,), 0.2)
    lt, gt = ce.triton_ce_chunk(z, y, torch.zeros(5), True)               # every row ignored
    out["all_ignored"] = dict(loss=lt.item(), dz_max=gt.abs().max().item())
    z, y = torch.randn(3, 50, generator=gen), torch.tensor([55, 2, -1, 50])  # targets outside the vocabulary: NaN, not a neighbour
    out["outside"] = [ce.triton_ce_chunk(z[i % 3:i % 3 + 1], y[i:i + 1], torch.ones(1), False)[0].item() for i in range(4)]
    try: ce.triton_ce_chunk(z, y[:2], torch.ones(3), False); out["short_targets"] = "read past them"
    except ValueError as e: out["short_targets"] = str(e)  # the kernel would read a target past the tensor's end
    z = torch.randn(3, 50, generator=gen)
    try: ce.triton_ce_chunk(z, torch.tensor([1, 2, 3]), torch.ones(2), False); out["short_weights"] = "read past them"
    except ValueError as e: out["short_weights"] = str(e)
    lt, gt = ce.triton_ce_chunk(z[:0], torch.zeros(0, dtype=torch.long), torch.zeros(0), True)  # a chunk of no rows
    out["no_rows"] = dict(loss=lt.item(), dz=list(gt.shape))
    try: ce.triton_ce_chunk(torch.randn(3, 0), torch.zeros(3, dtype=torch.long), torch.ones(3), False); out["no_classes"] = "ran"
    except ValueError as e: out["no_classes"] = str(e)
    print("RESULT", json.dumps(out))
''')


def test_ce_kernel_matches_ce_chunk():
    res = run_child(CHILD, timeout=300)
    rs, ig, outside = res.pop("row_stride"), res.pop("all_ignored"), res.pop("outside")
    far = res.pop("far_from_zero")
    assert far["loss"] < 1e-6 and far["dz"] < 1e-4, far  # the running max: e^1000 is past fp32 (z - lse in fp32 at 1000: 6e-5 ulps)
    for name in ("class_0", "strided_targets"):  # class 0 is a class like any other; strided y and w are read as such
        r = res.pop(name)
        assert r["loss"] < 1e-6 and r["dz"] < 1e-6, (name, r)
    assert res.pop("short_targets").startswith("y and w must be [3], one per row of z"), "targets shorter than the rows"
    assert res.pop("short_weights").startswith("y and w must be [3], one per row of z"), "weights shorter than the rows"
    assert res.pop("no_rows") == dict(loss=0.0, dz=[0, 50])
    assert res.pop("no_classes").startswith("z has no classes")
    assert math.isnan(outside[0]) and math.isfinite(outside[1]) and math.isnan(outside[2]) and math.isnan(outside[3]), outside  # 50 = V
    assert rs["stride"] == 313 and rs["loss"] < 1e-6 and rs["dz"] < 1e-6, rs  # reads with the row stride, writes dense
    assert ig == dict(loss=0.0, dz_max=0.0), ig
    for name, r in res.items():
        assert r["loss"] < 1e-6, (name, r)                         # the loss is computed in fp32 in both
        assert r["dz"] < (1e-6 if name != "bf16" else 8e-3), (name, r)  # bf16: the gradient is rounded to bf16
        assert r["dz_steps"] <= 1, (name, r)  # computed in fp32, rounded once: each element within one bf16 step (2^-7)
        assert r["ignored_row"] == 0.0 and r["no_grad_is_none"] and r["no_grad_loss"] == 0.0, (name, r)
    assert res["bf16"]["dtype"] == "torch.bfloat16" and res["fp32"]["dtype"] == "torch.float32"


def test_ce_kernel_refuses_what_it_would_misread():
    from hymo.models.ce_triton import triton_ce_chunk
    y, w = torch.zeros(4, dtype=torch.long), torch.ones(4)
    with pytest.raises(ValueError, match="class stride 1"): triton_ce_chunk(torch.randn(50, 4).t(), y, w, False)
    with pytest.raises(ValueError, match="class stride 1"): triton_ce_chunk(torch.randn(4, 5, 10), y, w, False)
    with pytest.raises(ValueError, match=r"y and w must be on z's device \(cpu\); got meta and cpu"):
        triton_ce_chunk(torch.randn(4, 10), y.to("meta"), w, False)
    with pytest.raises(TypeError, match="fp32 or bf16 logits, got torch.float16; use ce_chunk"):
        triton_ce_chunk(torch.randn(4, 50).half(), y, w, False)
    with pytest.raises(TypeError, match="y must hold integer class ids"): triton_ce_chunk(torch.randn(4, 50), y.float(), w, False)
    import hymo.models.ce_triton as ce
    if not ce.INTERPRET:  # (this process runs no kernel in the interpreter)
        with pytest.raises(RuntimeError, match="Triton kernels need a GPU; on CPU set TRITON_INTERPRET=1 .* or use ce_chunk"):
            triton_ce_chunk(torch.randn(4, 50), y, w, False)


# From mutation testing of the wrapper.
FAR_ROWS_CHILD = textwrap.dedent('''
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import hymo.models.ce_triton as ce
    from hymo.models.mtp import ce_chunk
    V, S = 64, 2 ** 30 + 64                                   # row stride S: row 2 starts past 2**31
    try: base = torch.empty(2 * S + V, dtype=torch.bfloat16)  # 4 GiB of virtual memory (about 0.3 GB touched)
    except RuntimeError as e: print("RESULT" + json.dumps(dict(skip=str(e)[:200]))); raise SystemExit
    z = base.as_strided((3, V), (S, 1)); z.copy_(torch.randn(3, V, generator=torch.Generator().manual_seed(0)).bfloat16())
    y, w = torch.tensor([1, 5, 63]), torch.full((3,), 1 / 3)
    (lt, gt), (lr, gr) = ce.triton_ce_chunk(z, y, w, True), ce_chunk(z.float().contiguous(), y, w, True)
    print("RESULT" + json.dumps(dict(loss=abs(lt.item() - lr.item()), dz=(gt.float() - gr).abs().max().item())))
''')


def test_ce_rows_past_int32_offsets():
    r = run_child(FAR_ROWS_CHILD)
    if "skip" in r: pytest.skip(f"a 4 GiB virtual buffer cannot be had here: {r['skip']}")
    assert r["loss"] < 1e-5 and r["dz"] < 1e-2, r


# --- the host-side wrapper (from mutation testing) ----------------------------------------------------

class _Recorder:
    "Stands in for the kernel: records the grid, arguments and options of each launch."
    def __init__(self): self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **k: self.calls.append((grid, a, k))


@pytest.fixture
def recorder(monkeypatch):
    r = _Recorder()
    monkeypatch.setattr(ce, "_ce_kernel", r)
    monkeypatch.setattr(ce, "INTERPRET", True)  # the CPU check passes: the recorder launches nothing
    return r


def test_weights_on_another_device_are_refused():
    "w is read by the kernel like y: on another device the interpreter would read garbage (a GPU: fault)."
    z, y, w = torch.randn(4, 10), torch.zeros(4, dtype=torch.long), torch.ones(4)
    with pytest.raises(ValueError, match=r"y and w must be on z's device \(cpu\); got cpu and meta"):
        ce.triton_ce_chunk(z, y, w.to("meta"), False)


def test_logits_of_one_dimension_are_refused_with_the_layout_message():
    with pytest.raises(ValueError, match="must be \\[rows, classes\\] with class stride 1"):
        ce.triton_ce_chunk(torch.randn(10), torch.zeros(10, dtype=torch.long), torch.ones(10), False)


@pytest.mark.parametrize("y", [torch.zeros(5, dtype=torch.long), torch.zeros(4, 2, dtype=torch.long)])
def test_targets_of_the_wrong_shape_are_refused(y, recorder):
    "Extra targets, or [c, 2] targets read flat, would give the rows other rows' targets without a word."
    with pytest.raises(ValueError, match=r"y and w must be \[4\], one per row of z"):
        ce.triton_ce_chunk(torch.randn(4, 10), y, torch.ones(4), False)
    with pytest.raises(ValueError, match=r"y and w must be \[4\], one per row of z"):
        ce.triton_ce_chunk(torch.randn(4, 10), torch.zeros(4, dtype=torch.long), torch.ones(y.shape), False)
    assert not recorder.calls


def test_block_width_is_capped_by_launch_and_fits_small_vocabularies(recorder, monkeypatch):
    "BV = min(LAUNCH['BV'], next power of two of V): a 50k vocabulary is walked in 4096-wide blocks, not one 65536 block."
    monkeypatch.setitem(ce.LAUNCH, "BV", 4096)
    for V, BV in ((50_000, 4096), (100, 128), (4096, 4096), (1, 1)):
        recorder.calls.clear()
        ce.triton_ce_chunk(torch.randn(3, V), torch.zeros(3, dtype=torch.long), torch.ones(3), True)
        (grid, args, kw), = recorder.calls
        assert grid == (3,) and args[-1] == BV and kw == {"num_warps": ce.LAUNCH["num_warps"]}, (V, args[-2:], kw)


INT32_CHILD = textwrap.dedent('''
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import hymo.models.ce_triton as ce
    gen = torch.Generator().manual_seed(0)
    z, y, w = torch.randn(5, 300, generator=gen), torch.randint(0, 300, (5,), generator=gen), torch.full((5,), 0.2)
    (l64, g64), (l32, g32) = ce.triton_ce_chunk(z, y, w, True), ce.triton_ce_chunk(z, y.int(), w, True)
    print("RESULT" + json.dumps(dict(loss=abs(l64.item() - l32.item()), dz=(g64 - g32).abs().max().item())))
''')


def test_int32_targets_are_taken_and_read_as_int64_ones():
    "The signature says int64 or int32 targets: int32 ones give the same loss and gradient."
    r = run_child(INT32_CHILD, timeout=300)
    assert r == dict(loss=0.0, dz=0.0), r
