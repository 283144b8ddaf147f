"""The full HyMo model: forward/backward, causality, packed documents, learning, initialisation, accounting."""
import math

import pytest
import torch

from hymo.config import load_config
from hymo.models.gdn import GatedDeltaNetBlock
from hymo.models.mla import MLABlock, MLACache
import hymo.models.model as model_module
from hymo.models.model import DecodeGraph, HyMo, build_hymo, flops_breakdown, param_breakdown, state_breakdown
from hymo.models.moe import DeepSeekMoE


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    "The tiny model's tensors are small: on a shared 2-core machine, extra threads only add contention."
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    return load_config("hymo_tiny").model


@pytest.fixture(scope="module")
def dropless():
    "Capacity dropping depends on the whole batch (later tokens included), so exactness tests route dropless."
    return load_config("hymo_tiny", moe_capacity_factor=None).model


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    return build_hymo(cfg)


def test_layout_and_parts(tiny):
    m = _model(tiny)
    kinds = ["mla" if isinstance(l, MLABlock) else "gdn" for l in m.layers]
    assert kinds == tiny.layer_types
    assert all(isinstance(l, (MLABlock, GatedDeltaNetBlock)) for l in m.layers)
    assert len(m.moe_layers()) == tiny.layer_types.count("mla")
    assert all(isinstance(l.ffn, DeepSeekMoE) for l in m.layers if isinstance(l, MLABlock))


def test_forward_backward_every_parameter_gets_a_gradient(tiny):
    m = _model(tiny)
    B, T, V = 2, 40, tiny.vocab_size
    tokens, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    assert m(tokens).shape == (B, T, V)
    loss, parts = m(tokens, targets)
    assert set(parts) == {"main", "mtp_1", "mtp_2"}
    assert abs(parts["main"].item() - math.log(V)) < 0.3  # near-uniform predictions at init
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, f"no gradient reaches {missing}"
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_tied_head(tiny):
    m = _model(tiny)
    logits, h = m.forward_with_hidden(torch.randint(0, tiny.vocab_size, (1, 12)))
    torch.testing.assert_close(logits, h @ m.embed.weight.T)
    big = [n for n, p in m.named_parameters() if p.shape[0] == tiny.vocab_size]
    assert big == ["embed.weight"], "the output head must reuse the embedding, not own a matrix"


def test_causal(dropless):
    m = _model(dropless)
    V = dropless.vocab_size
    x = torch.randint(0, V, (1, 40))
    ref = m(x)
    for t in (5, 39):
        x2 = x.clone(); x2[0, t] = (x2[0, t] + 7) % V
        out = m(x2)
        assert torch.equal(out[:, :t], ref[:, :t]), f"changing token {t} changed earlier logits"
        assert not torch.equal(out[:, t], ref[:, t])


def test_packed_documents_equal_separate_runs(dropless):
    m = _model(dropless)
    docs = [torch.randint(0, dropless.vocab_size, (1, n)) for n in (7, 66, 3)]
    cu = torch.tensor([0, 7, 73, 76])
    packed = m(torch.cat(docs, 1), cu_seqlens=cu)
    for n, d in enumerate(docs):
        torch.testing.assert_close(packed[:, cu[n]:cu[n + 1]], m(d), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("loss_impl", ["logits", "fused"])
def test_packed_losses_equal_separate_runs(dropless, loss_impl):
    """Every loss part of a packed row is the per-document losses pooled: MTP head k never trains a
    position on a target past its document's end-of-text token (nor on the next packed window)."""
    m = _model(dropless).eval(); m.loss_impl = loss_impl
    lens, V = (7, 66, 5), dropless.vocab_size
    x = torch.randint(1, V, (1, sum(lens) + 1))
    tokens, targets = x[:, :-1], x[:, 1:]
    cu = torch.tensor([0, 7, 73, 78])
    with torch.no_grad():
        _, packed = m(tokens, targets=targets, cu_seqlens=cu)
        sums = {k: 0.0 for k in packed}
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            for k, v in m(tokens[:, s:e], targets=targets[:, s:e])[1].items(): sums[k] += v.item() * (e - s - ahead(k))
    for k, v in packed.items():  # a mean over the positions head k trains: sum(len - k) of them
        assert v.item() * sum(l - ahead(k) for l in lens) == pytest.approx(sums[k], rel=1e-5), k


def ahead(part: str) -> int:
    "How many positions at a document's end a loss part cannot train: 0 for 'main', k for 'mtp_k'."
    return 0 if part == "main" else int(part.split("_")[1])


def test_overfits_one_batch(tiny):
    m = _model(tiny)
    x = torch.randint(0, tiny.vocab_size, (1, 17))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss, _ = m(x[:, :-1], x[:, 1:])
        opt.zero_grad(); loss.backward(); opt.step()
        for moe in m.moe_layers(): moe.update_gate_bias()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses


def test_meta_build_equals_direct_build(tiny):
    torch.manual_seed(3); a = build_hymo(tiny)
    torch.manual_seed(3); b = HyMo(tiny); torch.manual_seed(3); b.init_weights()
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, msg=n)


def test_init_scales():
    cfg = load_config("hymo_tiny", dim=256, ffn_inter_dim=512, moe_inter_dim=512, n_layers=8).model
    m = _model(cfg)
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    outs = {n: p for n, p in m.named_parameters() if any(k in n.split(".")[-2:] for k in ("o_proj", "w2", "proj_out"))}
    assert len(outs) == cfg.n_layers * 2 + cfg.layer_types.count("mla") + cfg.mtp_depth  # o_proj + w2 per block, shared w2, MTP
    for n, p in outs.items(): assert abs(p.std().item() / out_std - 1) < 0.15, n
    assert abs(m.embed.weight.std().item() / cfg.init_std - 1) < 0.05
    assert all((p == 1).all() for n, p in m.named_parameters() if "norm" in n)
    ins = [n for n in m.state_dict() if n.endswith(("proj_in.weight", "w1.weight", "w3.weight", "q_proj.weight"))]
    assert sum("proj_in" in n for n in ins) == cfg.mtp_depth and len(ins) > 2 * cfg.n_layers, ins
    for n in ins: assert abs(m.get_parameter(n).std().item() / cfg.init_std - 1) < 0.15, n  # hidden matrices: init_std


def test_param_accounting(tiny):
    m = _model(tiny)
    n = m.num_params()
    assert n == sum(p.numel() for p in m.parameters())
    assert sum(param_breakdown(m).values()) == n
    n_mla = tiny.layer_types.count("mla")
    expert = 3 * tiny.dim * tiny.moe_inter_dim
    assert n - m.num_params(active=True) == n_mla * (tiny.moe_n_routed - tiny.moe_top_k) * expert


def test_750m_on_meta_device():
    c = load_config("hymo_750m").model
    with torch.device("meta"):
        m = HyMo(c)
    assert all(p.is_meta for p in m.parameters())
    n_mla, n_gdn = c.layer_types.count("mla"), c.layer_types.count("gdn")
    H, K, V = c.gdn_n_heads, c.gdn_head_k_dim, c.gdn_head_v_dim
    gdn = (2 * c.dim * H * K + 2 * c.dim * H * V + 2 * c.dim * H + H * V * c.dim  # q, k; v, g; a, b; o
           + c.gdn_conv_size * (2 * H * K + H * V) + 2 * H + V  # convs, A_log and dt_bias, o_norm
           + 3 * c.dim * c.ffn_inter_dim + 2 * c.dim)  # dense SwiGLU, two block norms
    G, dn, dr, dv, dc, r = (c.mla_n_kv_groups, c.mla_qk_nope_dim, c.mla_qk_rope_dim, c.mla_v_head_dim,
                            c.mla_kv_lora_rank, c.mla_q_lora_rank)
    mla = (c.dim * r + r + r * c.mla_n_heads * (dn + dr) + c.dim * (dc + dr) + dc + dc * G * (dn + dv)
           + c.mla_n_heads * dv * c.dim + 2 * c.dim)
    moe = (c.moe_n_routed + c.moe_n_shared) * 3 * c.dim * c.moe_inter_dim + c.dim * c.moe_n_routed
    mtp = c.mtp_depth * (2 * c.dim * c.mtp_inter_dim + 2 * c.dim)
    expected = c.vocab_size * c.dim + n_gdn * gdn + n_mla * (mla + moe) + c.dim + mtp
    assert m.num_params() == expected
    active = m.num_params(active=True)
    assert (m.num_params(), active) == (1_235_166_976, 541_533_952)  # quoted by chapters 00 and 41, the slides and results
    assert m.num_params() - active == n_mla * (c.moe_n_routed - c.moe_top_k) * 3 * c.dim * c.moe_inter_dim
    f4k = m.flops_per_token(4096)
    assert f4k > 6 * (active - c.vocab_size * c.dim)  # 6N is a lower bound: head, MTP, attention, GDN come on top
    assert m.flops_per_token(8192) - f4k == pytest.approx(3 * n_mla * c.mla_n_heads * (dn + dr + dv) * 4096)
    assert flops_breakdown(m, 4096)["output head"] == 6 * c.vocab_size * c.dim
    s = state_breakdown(m, 4096, torch.bfloat16)
    assert s["GDN recurrent state (fp32)"] == n_gdn * H * K * V * 4
    assert s["GDN convolution windows"] == n_gdn * (c.gdn_conv_size - 1) * (2 * H * K + H * V) * 2  # the last W-1 inputs, bf16
    assert m.state_bytes(8192) - m.state_bytes(4096) == n_mla * 4096 * (dc + dr) * 2
    print(f"750M: {m.num_params()/1e9:.3f} B stored, {active/1e6:.1f} M active, {f4k/1e9:.2f} GFLOPs/token, "
          f"{m.state_bytes(4096)/2**20:.1f} MiB state at T=4096")


def test_gdn_only_model_with_mla_every_0():
    "mla_every=0 is the all-GDN ablation: no MLA, no MoE; it trains, and its FLOPs have no attention or MoE part."
    c = load_config("hymo_tiny", mla_every=0).model
    m = HyMo(c)
    assert c.layer_types == ["gdn"] * c.n_layers and m.moe_layers() == []
    x = torch.randint(0, c.vocab_size, (2, 17))
    loss, parts = m(x[:, :-1], targets=x[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in m.parameters())
    assert m.flops_per_token(64) == m.flops_per_token(128)  # no attention: the cost per token does not grow with T


def test_flop_accounting_agrees_with_torchs_flop_counter(tiny):
    """`flops_breakdown` against PyTorch's own count of the matrix products in one forward (FlopCounterMode), block by
    block: every weight a token uses once, only the k chosen experts, the GDN rule's products. What the counter does
    not see is taken out by hand: the depthwise convolutions, the triangular inverse (not a product), attention (CPU
    SDPA is not counted), and the MTP heads' last k positions, which have no target (the accounting counts all T)."""
    from torch.utils.flop_counter import FlopCounterMode
    from hymo.models.model import _inactive_expert_params, _matrix_params
    c = tiny
    m = build_hymo(c).eval()  # eval: dropless routing, exactly k experts per token
    B, T = 2, 128
    x, y = torch.randint(0, c.vocab_size, (B, T)), torch.randint(0, c.vocab_size, (B, T))
    with FlopCounterMode(display=False) as fc, torch.no_grad(): m(x, targets=y)
    counts = {mod: {str(op): v / (B * T) for op, v in d.items()} for mod, d in fc.get_flop_counts().items()}
    fb = {k: v / 3 for k, v in flops_breakdown(m, T).items()}  # forward, per token
    n_gdn = sum(not c.is_mla(i) for i in range(c.n_layers))
    inverse = c.gdn_n_heads * c.gdn_chunk_size ** 2 / 3
    blocks = 0
    for i, layer in enumerate(m.layers):
        got = counts[f"HyMo.layers.{i}"]
        conv = sum(p.numel() for n, p in layer.named_parameters() if "conv" in n)
        want = 2 * (_matrix_params(layer) - conv - (_inactive_expert_params(m) / (c.n_layers - n_gdn) if c.is_mla(i) else 0))
        assert got["aten.mm"] == pytest.approx(want, rel=1e-12), i
        if not c.is_mla(i): assert got["aten.bmm"] == pytest.approx(fb["GDN chunked rule"] / n_gdn - inverse, rel=1e-12), i
        blocks += want + 2 * conv
    assert blocks == pytest.approx(fb["matrices (blocks)"], rel=1e-12)
    seen = sum(T - k for k in range(1, c.mtp_depth + 1)) / (c.mtp_depth * T)  # head k has targets for T - k positions
    mtp_and_head = counts["HyMo"]["aten.mm"] - sum(counts[f"HyMo.layers.{i}"]["aten.mm"] for i in range(c.n_layers))
    assert mtp_and_head == pytest.approx(fb["output head"] + seen * fb["MTP heads (MLP + vocabulary projection)"], rel=1e-12)


def test_generate(dropless):
    m = _model(dropless)
    prompt = torch.randint(0, dropless.vocab_size, (1, 6))
    torch.manual_seed(0)
    out = m.generate(prompt, 4, temperature=0.9, top_k=5)
    assert out.shape == (1, 10) and torch.equal(out[:, :6], prompt)
    greedy = m.generate(prompt, 3, temperature=0)
    logits = m.eval()(greedy[:, :-1])
    assert torch.equal(greedy[0, 6:], logits[0, 5:].argmax(-1))  # each greedy token is the argmax given its prefix
    m.train()
    assert m.generate(prompt, 1).shape == (1, 7) and m.training


@pytest.mark.parametrize("cache", [True, False])
def test_generate_stops_at_the_stop_token(dropless, cache):
    m = _model(dropless)
    head, calls = m.head, []
    def end_after_two(h):  # one head call per drawn token, cached or not: id 0 is impossible twice, then certain
        calls.append(1)
        logits = head(h).clone(); logits[..., 0] += 100 if len(calls) > 2 else -100
        return logits
    m.head = end_after_two
    prompt = torch.randint(1, dropless.vocab_size, (1, 4))
    out = m.generate(prompt, 10, temperature=0.8, stop=0, cache=cache)
    assert out.shape == (1, 7) and out[0, -1] == 0 and (out[0, :-1] != 0).all()
    assert m.generate(prompt, 10, temperature=0.8, cache=cache).shape == (1, 14)  # without `stop` it runs on


@pytest.mark.parametrize("cache", [True, False])
def test_generate_samples_only_ids_the_tokenizer_has(dropless, cache):
    """A model wider than its data's tokenizer (vocab padded up): `vocab=` keeps the extra rows out of every sample."""
    m, v = _model(dropless), dropless.vocab_size - 64
    head = m.head
    def boosted(h):  # the rows past v would win every draw
        logits = head(h).clone(); logits[..., v:] += 100
        return logits
    m.head = boosted
    prompt = torch.randint(0, v, (1, 4))
    for temperature, top_k in ((0, None), (1.0, None), (0.8, 5)):
        assert (m.generate(prompt, 6, temperature, top_k, cache=cache)[0, 4:] >= v).any()
        assert (m.generate(prompt, 6, temperature, top_k, vocab=v, cache=cache)[0, 4:] < v).all()


def _unit_scale(m, seed=0):
    "Matrices N(0, 1/fan_in): logits of order one that depend on the whole context, so a broken decode state shows."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2: p.copy_(torch.randn(p.shape, generator=g).to(p.device) / math.sqrt(p.shape[-1]))
    return m.eval()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_decode_with_state_equals_the_forward(device):
    """`decode` (GDN states carried, MLA latent caches, absorbed attention) gives each new token the logits of the
    whole-sequence forward: a prompt longer than a GDN chunk, then single tokens; a NoPE block; unit-scale weights.
    On a GPU the GDN rule is the Triton kernel (the recurrent one for single tokens). In bf16 the two paths round
    differently (and a near-tie may route a token to another expert), so there the test asks that `decode` be no
    further from the fp32 forward than the bf16 forward is."""
    cfg = load_config("hymo_tiny", n_layers=8, nope_layers=[3], moe_capacity_factor=None).model
    m = _unit_scale(_model(cfg).to(device))
    seq = torch.randint(0, cfg.vocab_size, (2, 75), device=device)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    def both(dtype):  # the whole-sequence forward, and the prompt then single tokens through `decode`
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            state = m.decode_state(2, 75, dtype)
            steps = [m.decode(seq[:, :67], state)] + [m.decode(seq[:, t:t + 1], state) for t in range(67, 75)]
            return m(seq).float(), torch.cat(steps, 1).float()
    full, dec = both(torch.float32)
    assert full.abs().max() > 1  # logits of order one: agreement means something
    assert rel(dec, full) < (1e-5 if device == "cpu" else 5e-3), rel(dec, full)  # a GPU's fp32 products are tf32
    if device == "cuda":
        full_bf, dec_bf = both(torch.bfloat16)
        assert rel(dec_bf, full) <= 1.5 * rel(full_bf, full) + 1e-3, (rel(dec_bf, full), rel(full_bf, full))


def test_bad_input_is_a_clear_error(tiny):
    m = _model(tiny)
    with pytest.raises(ValueError, match=r"\[B, T\]"): m(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"): m(torch.zeros(1, tiny.max_seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[1, T\]"): m(torch.zeros(2, 8, dtype=torch.long), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="shape of tokens"): m(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long))
    L = tiny.max_seq_len  # a packed row may be longer than max_seq_len, one of its documents may not
    with pytest.raises(ValueError, match=f"a packed document has {L + 1} tokens > max_seq_len={L}"):
        m(torch.zeros(1, L + 8, dtype=torch.long), cu_seqlens=torch.tensor([0, L + 1, L + 8]))
    with pytest.raises(ValueError, match=f"max_len={L + 1} must be in 1..max_seq_len={L}"): m.decode_state(1, L + 1)
    m(torch.zeros(1, 2 * L, dtype=torch.long), cu_seqlens=torch.tensor([0, L, 2 * L]))  # documents of max_seq_len: taken
    x = torch.zeros(1, 8, dtype=torch.long)
    for call, name in [(lambda: m(x.numpy()), "tokens"), (lambda: m([[1, 2, 3]]), "tokens"), (lambda: m(x, x.numpy()), "targets"),
                       (lambda: m(x, cu_seqlens=[0, 5, 8]), "cu_seqlens"), (lambda: m.generate([[1, 2]], 2), "tokens")]:
        with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got (ndarray|list): convert it with torch.as_tensor"):
            call()


def test_bad_targets_are_a_clear_error(tiny):
    "Targets are ids of the vocabulary or IGNORE_INDEX; -1 (a usual slip) or V would fail deep in the loss (a NaN on a GPU)."
    from hymo.models.mtp import IGNORE_INDEX
    m, V = _model(tiny), tiny.vocab_size
    x = torch.randint(0, V, (2, 12))
    for impl in ("fused", "logits"):
        m.loss_impl = impl
        for bad in (-1, V, -101):
            with pytest.raises(ValueError, match=rf"targets must be ids in 0\.\.{V - 1} \(vocab_size={V}\), or IGNORE_INDEX=-100.*got \[{bad}\]"):
                m(x, x.masked_fill(x == x[0, 3], bad))
        with pytest.raises(ValueError, match="targets must be integer ids"): m(x, x.float())
        with torch.no_grad():
            assert torch.isfinite(m(x, x.masked_fill(torch.arange(12) % 3 == 0, IGNORE_INDEX))[0])
    with pytest.raises(ValueError, match="loss_impl='chunked': choose 'fused' or 'logits'"): m.loss_impl = "chunked"
    assert m.loss_impl == "logits"  # the refused value was not kept
    m.loss_impl = "fused"


def test_without_mtp_the_loss_is_the_main_loss_and_the_heads_do_not_run(tiny):
    "`mtp=False` (validation): the same main loss, no MTP part, and no MTP head called, with either loss."
    m = _model(tiny).eval()
    assert tiny.mtp_depth > 0
    x = torch.randint(0, tiny.vocab_size, (2, 12))
    calls = []
    for blk in m.mtp.heads: blk.register_forward_hook(lambda *a: calls.append(1))
    for impl in ("fused", "logits"):
        m.loss_impl = impl
        with torch.no_grad():
            total, parts = m(x, x)
            n = len(calls)
            alone, main_only = m(x, x, mtp=False)
        assert n == tiny.mtp_depth and len(calls) == n  # the heads ran for the full loss only
        assert list(main_only) == ["main"] and set(parts) == {"main", *(f"mtp_{k + 1}" for k in range(tiny.mtp_depth))}
        torch.testing.assert_close(alone, parts["main"])
        torch.testing.assert_close(main_only["main"], parts["main"])
        assert not torch.allclose(alone, total)  # the MTP losses were added to the full one
        calls.clear()


def test_packed_boundaries_must_rise_strictly(tiny):
    m = _model(tiny)
    with pytest.raises(ValueError, match=r"must rise strictly from 0 to T=12 \(document boundaries of the row, no empty document\)"):
        m(torch.zeros(1, 12, dtype=torch.long), cu_seqlens=torch.tensor([0, 5, 5, 12]))


def test_boundaries_on_another_device_than_the_tokens_are_refused(tiny):
    "CPU boundaries with GPU tokens (a usual slip) would fail deep inside a layer; the meta device stands in for the GPU."
    m = _model(tiny)
    for tok_dev, cu_dev in (("meta", "cpu"), ("cpu", "meta")):
        with pytest.raises(ValueError, match=rf"cu_seqlens is on {cu_dev} but tokens on {tok_dev}: give both on one device"):
            m(torch.zeros(1, 12, dtype=torch.long, device=tok_dev), cu_seqlens=torch.tensor([0, 5, 12], device=cu_dev))


@torch.no_grad()
def test_residual_stream_and_decode_caches_take_the_autocast_dtype(dropless):
    "Under autocast the trunk returns the compute dtype (as under FSDP's bf16 parameters), and decode caches are made in it."
    m = _model(dropless).eval()
    x = torch.randint(0, dropless.vocab_size, (1, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m.hidden_states(x).dtype == torch.bfloat16
        caches = [c for c in m.decode_state(1, 8) if c is not None]
    assert caches and all(c.c_kv.dtype == c.k_rope.dtype == torch.bfloat16 for c in caches)  # the rope keys too
    assert m.hidden_states(x).dtype == torch.float32
    assert all(c.c_kv.dtype == c.k_rope.dtype == torch.float32 for c in m.decode_state(1, 8) if c is not None)


def test_every_norm_uses_the_configured_eps():
    "MLA's latent and block norms, the GDN blocks', the MTP heads' and the final norm: none keeps RMSNorm's default."
    from hymo.models.layers import RMSNorm
    m = HyMo(load_config("hymo_tiny", norm_eps=1e-3).model)
    norms = {name: n for name, n in m.named_modules() if isinstance(n, RMSNorm)}
    assert {"norm", "q_a_layernorm", "kv_a_layernorm", "norm1", "norm2"} <= {name.split(".")[-1] for name in norms}
    assert {n.eps for n in norms.values()} == {1e-3}


def test_the_default_loss_never_builds_the_whole_logits():
    "The fused loss is the default (the [B, T, V] logits of 'logits' are for checking it)."
    assert HyMo(load_config("hymo_tiny").model).loss_impl == "fused"


def test_doc_keys_per_query_by_hand():
    "Σ L² / (2 Σ L), L/2 keys a query as for T/2: documents of 1 and 4 tokens give (1 + 16) / 10 = 1.7 (not the mean of L/2 per document)."
    from hymo.models.model import doc_keys_per_query
    assert doc_keys_per_query(torch.tensor([0, 1, 5])) == pytest.approx(1.7)
    assert doc_keys_per_query(torch.tensor([0, 4096])) == pytest.approx(2048)


@pytest.mark.parametrize("cache", [True, False])
def test_sampling_distribution_temperature_and_top_k(dropless, cache, monkeypatch):
    "The first draw samples softmax(logits / τ) over the k most likely ids exactly; top_k=1 is greedy."
    m = _model(dropless).eval()
    with torch.no_grad():  # logits of order one, so that τ matters
        m.embed.weight.normal_(0, 0.05)
    prompt = torch.randint(0, dropless.vocab_size, (1, 5))
    with torch.no_grad(): logits = m(prompt)[0, -1].double()
    assert logits.std() > 0.3 and logits.softmax(-1).max() < 0.5  # neither flat nor one-hot
    seen = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda p, n: seen.append(p[0].double()) or multinomial(p, n))
    for tau, k in ((0.5, None), (2.0, None), (0.7, 5)):
        seen.clear()
        m.generate(prompt, 1, temperature=tau, top_k=k, cache=cache)
        want = (logits / tau).softmax(-1)
        if k is not None:
            keep = torch.zeros_like(want, dtype=torch.bool); keep[logits.topk(k).indices] = True
            want = torch.where(keep, want, 0.0); want = want / want.sum()
        torch.testing.assert_close(seen[0], want, atol=1e-5, rtol=1e-4)
    monkeypatch.undo()
    torch.manual_seed(0)
    greedy = m.generate(prompt, 4, temperature=0, cache=cache)
    assert torch.equal(m.generate(prompt, 4, temperature=1.0, top_k=1, cache=cache), greedy)
    for tiny in (1e-45, 1e-300):  # logits / τ would overflow (inf - inf), or τ round to 0 in fp32 (0 / 0)
        assert torch.equal(m.generate(prompt, 4, temperature=tiny, cache=cache), greedy)


@pytest.fixture(scope="module")
def short_model():
    cfg = load_config("hymo_tiny", max_seq_len=24, seq_len=16, moe_capacity_factor=None).model
    return _unit_scale(_model(cfg))


@pytest.mark.parametrize("prompt_len", [1, 22, 23, 24, 25])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_cached_generate_equals_uncached_around_max_seq_len(short_model, prompt_len, n):
    "Prompts just under, at and over max_seq_len (24): with the state until the text fills it, then the window."
    prompt = torch.randint(0, short_model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    cached = short_model.generate(prompt, n, temperature=0)
    assert cached.shape == (1, prompt_len + n)
    assert torch.equal(cached, short_model.generate(prompt, n, temperature=0, cache=False))


def test_a_broken_state_would_be_seen(short_model, monkeypatch):
    "The test above can fail: dropping the GDN states between decoding calls changes the tokens drawn."
    prompt = torch.randint(0, short_model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    good = short_model.generate(prompt, 10, temperature=0)
    decode = type(short_model).decode
    def forgetful(self, tokens, state):
        for i in range(len(state)):
            if not self.config.is_mla(i): state[i] = None
        return decode(self, tokens, state)
    monkeypatch.setattr(type(short_model), "decode", forgetful)
    assert not torch.equal(short_model.generate(prompt, 10, temperature=0), good)


def test_decode_refuses_training_mode_and_runs_bf16_weights(dropless):
    m = _model(dropless)
    with pytest.raises(RuntimeError, match="call model.eval"): m.decode(torch.zeros(1, 3, dtype=torch.long), m.decode_state(1, 8))
    m = _unit_scale(m).eval()
    seq = torch.randint(0, dropless.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(seq)  # fp32
        m = m.to(torch.bfloat16)  # weights in bf16, no autocast: every rule returns the inputs' dtype
        state = m.decode_state(1, 12)  # the state's dtype follows the weights'
        assert {c.c_kv.dtype for c in state if isinstance(c, MLACache)} == {torch.bfloat16}
        got = torch.cat([m.decode(seq[:, :9], state)] + [m.decode(seq[:, t:t + 1], state) for t in (9, 10, 11)], 1)
        full = m(seq)
    assert got.dtype == torch.bfloat16 and ref.abs().max() > 1
    rel = lambda a: ((a.float() - ref).norm() / ref.norm()).item()
    assert rel(got) < 1.5 * rel(full) and rel(full) < 0.1, (rel(got), rel(full))  # decode errs as bf16's forward does (6 %)
    prompt = seq[:, :8]
    assert m.generate(prompt, 3, temperature=0).shape == m.generate(prompt, 3, temperature=0, cache=False).shape == (1, 11)


def test_bad_token_ids_and_decode_input_are_refused_in_one_line(dropless):
    """Ids outside the vocabulary (an IndexError on a CPU, a device-side assert that poisons a GPU's context), and
    decode inputs that do not fit the state, raise a ValueError that says what is wrong."""
    m = _model(dropless).eval()
    V = dropless.vocab_size
    for bad in (V, -1):
        with pytest.raises(ValueError, match=rf"token ids must be in 0\.\.{V - 1}"): m(torch.tensor([[1, bad, 2]]))
        with pytest.raises(ValueError, match=rf"token ids must be in 0\.\.{V - 1}"): m.generate(torch.tensor([[1, bad]]), 2)
    state = m.decode_state(1, 8)
    with pytest.raises(ValueError, match="integer ids of shape"): m.decode(torch.zeros(3, dtype=torch.long), state)
    with pytest.raises(ValueError, match="at least one new token"): m.decode(torch.zeros(1, 0, dtype=torch.long), state)
    with pytest.raises(ValueError, match="2 sequences, and the state has 4 layers made for batches of 1"): m.decode(torch.zeros(2, 3, dtype=torch.long), state)
    with pytest.raises(ValueError, match=rf"vocab=0 must be an int in 1\.\.{V}"): m.generate(torch.tensor([[1, 2]]), 2, vocab=0)
    with pytest.raises(ValueError, match="window=1000000 must be an int in 1..max_seq_len=256"): m.generate(torch.tensor([[1, 2]]), 2, window=10**6)
    with pytest.raises(ValueError, match="got max_new_tokens=2.5"): m.generate(torch.tensor([[1, 2]]), 2.5)
    import numpy as np  # numpy's integers are ints
    assert m.generate(torch.tensor([[1, 2]]), np.int64(2), top_k=np.int64(5), vocab=np.int64(V), window=np.int64(8)).shape == (1, 4)


@torch.no_grad()
def test_a_decode_past_max_seq_len_is_refused_before_any_layer_moves(dropless):
    "A cache made by hand longer than max_seq_len: the refusal came from the first MLA layer, after the GDN states had moved."
    import copy
    m = _model(dropless).eval()
    L = dropless.max_seq_len
    state = [MLACache.empty(dropless, 1, L + 8) if dropless.is_mla(i) else None for i in range(dropless.n_layers)]
    m.decode(torch.randint(0, 50, (1, L - 4)), state)
    before = copy.deepcopy(state)
    with pytest.raises(ValueError, match=f"decoding to position {L + 5}, beyond this model's 0..{L - 1}"):
        m.decode(torch.randint(0, 50, (1, 10)), state)
    for a, b in zip(state, before):
        parts = (a.c_kv, a.k_rope, a.pos) if isinstance(a, MLACache) else a
        assert all(torch.equal(x, y) for x, y in zip(parts, (b.c_kv, b.k_rope, b.pos) if isinstance(b, MLACache) else b))
        assert not isinstance(a, MLACache) or a.length == b.length == L - 4


@pytest.mark.parametrize("device", DEVICES)
def test_generate_checks_its_prompts_ids_on_any_device(dropless, device):
    "On a GPU the forward does not read ids back (a wait): `generate` checks its prompt once, before a device-side assert."
    m = _model(dropless).to(device).eval()
    with pytest.raises(ValueError, match="token ids must be in 0"):
        m.generate(torch.tensor([[1, dropless.vocab_size]], device=device), 2)
    assert m.generate(torch.tensor([[1, 2]], device=device), 2).shape == (1, 4)


def test_generate_reads_no_more_than_its_window(short_model):
    """`window` (the length the run trained on, train.seq_len) bounds what one forward reads, as max_seq_len does:
    with the state until the text fills the window, then the last `window` tokens; the same tokens either way."""
    prompt = torch.randint(0, short_model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(5))
    seen = []
    forward = type(short_model).forward
    def counting(self, tokens, *a, **k):
        seen.append(tokens.shape[1])
        return forward(self, tokens, *a, **k)
    type(short_model).forward = counting
    try:
        cached = short_model.generate(prompt, 14, temperature=0, window=16)
        assert cached.shape == (1, 24) and max(seen) == 16 and seen == [16] * 7, seen  # 16 tokens by decode, then 7 re-runs
        seen.clear()
        assert torch.equal(cached, short_model.generate(prompt, 14, temperature=0, window=16, cache=False))
        assert max(seen) == 16
    finally:
        type(short_model).forward = forward


@pytest.mark.parametrize("device", DEVICES)
def test_decode_graph_steps_as_decode_does(device):
    """`DecodeGraph` (a CUDA graph on a GPU; eager on the CPU, with the same warm-up and restore) gives every new token
    the logits the eager `decode` gives, for three sequences (more assignments than hymo_tiny's 4 experts: a step that
    sorts, eagerly), in fp32 and (on a GPU) bf16 autocast; the state it leaves is the eager one's."""
    cfg = load_config("hymo_tiny", n_layers=8, nope_layers=[3], moe_capacity_factor=None).model
    m = _unit_scale(_model(cfg).to(device))
    seq = torch.randint(0, cfg.vocab_size, (3, 80), device=device)
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        runs = []
        for graphed in (False, True):
            with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                state = m.decode_state(3, 80, dtype)
                m.decode(seq[:, :67], state)
                step = DecodeGraph(m, state) if graphed else m.decode
                runs.append((torch.cat([step(seq[:, t:t + 1], state).float() for t in range(67, 80)], 1),
                             [s.clone() for s in state[0]], state[3].length))
        (eager, s_eager, n_eager), (graphed, s_graph, n_graph) = runs
        assert eager.abs().max() > 1
        torch.testing.assert_close(graphed, eager, atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=0)
        for a, b in zip(s_graph, s_eager): torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)
        assert n_graph == n_eager == 80
    with torch.no_grad():  # a step given fewer sequences than the state holds (a copy into its buffer would broadcast)
        state = m.decode_state(3, 80); m.decode(seq[:, :5], state)
        with pytest.raises(ValueError, match=r"one token per sequence: \[3, 1\], got \(1, 1\)"):
            DecodeGraph(m, state)(seq[:1, 5:6], state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_on_a_gpu_replays_a_graph_and_draws_what_eager_steps_draw(monkeypatch):
    cfg = load_config("hymo_tiny", n_layers=8, nope_layers=[3], moe_capacity_factor=None).model
    m = _unit_scale(_model(cfg).cuda())
    built = []
    monkeypatch.setattr(model_module, "DecodeGraph", lambda *a, **k: built.append(1) or DecodeGraph(*a, **k))
    prompt = torch.randint(0, cfg.vocab_size, (1, 40), device="cuda")
    graphed = m.generate(prompt, 30, temperature=0)
    assert built == [1]
    assert torch.equal(graphed, m.generate(prompt, 30, temperature=0, graph=False)) and built == [1]


def test_decode_graph_restores_the_state_when_building_fails_and_refuses_eager_steps_between(monkeypatch):
    "A warm-up that fails leaves the state as it was; an eager decode between graph steps is refused, not ignored."
    cfg = load_config("hymo_tiny", n_layers=4, moe_capacity_factor=None).model
    m = _unit_scale(_model(cfg))
    seq = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        state = m.decode_state(1, 12)
        m.decode(seq[:, :8], state)
        before = [t.clone() for s in state for t in ((s.c_kv, s.pos) if isinstance(s, model_module.MLACache) else s)]
        calls = []
        decode = type(m).decode
        def fails_on_the_second(self, tokens, st):
            calls.append(1)
            if len(calls) == 2: raise RuntimeError("out of memory (simulated)")
            return decode(self, tokens, st)
        monkeypatch.setattr(type(m), "decode", fails_on_the_second)
        with pytest.raises(RuntimeError, match="simulated"): DecodeGraph(m, state, capture=False)
        monkeypatch.undo()
        after = [t for s in state for t in ((s.c_kv, s.pos) if isinstance(s, model_module.MLACache) else s)]
        assert all(torch.equal(a, b) for a, b in zip(after, before)) and state[3].length == 8
        full = m(seq)
        step = DecodeGraph(m, state, capture=False)
        torch.testing.assert_close(step(seq[:, 8:9], state), full[:, 8:9], atol=1e-4, rtol=0)
        m.decode(seq[:, 9:10], state)
        with pytest.raises(ValueError, match="stepped by something else"): step(seq[:, 10:11], state)


# From mutation testing of model.py: wiring that a wrong line would break without any other test noticing.

def test_nope_layers_reach_the_mla_blocks():
    "`nope_layers` names MLA blocks by their layer index; each block is built with its own index."
    m = _model(load_config("hymo_tiny", n_layers=8, nope_layers=[3]).model)
    assert [l.attn.use_rope for i, l in enumerate(m.layers) if m.config.is_mla(i)] == [False, True]


@pytest.mark.parametrize("impl", ["fused", "logits"])
def test_mtp_losses_train_the_trunk(impl):
    "The trunk's gradient is the main loss's plus w_k times MTP head k's: the MTP losses reach the blocks, not only the heads."
    x = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(0))
    tok, tgt = x[:, :-1], x[:, 1:]
    grads = {}
    for w in ((0.0, 0.0), (1.0, 0.0)):
        m = _model(load_config("hymo_tiny", moe_capacity_factor=None, mtp_loss_weights=list(w)).model).eval()
        m.loss_impl = impl
        m(tok, tgt)[0].backward()
        grads[w] = m.layers[0].mixer.q_proj.weight.grad.clone()
    from hymo.models.mtp import linear_cross_entropy
    m = _model(load_config("hymo_tiny", moe_capacity_factor=None).model).eval()  # head 1's loss alone, by hand
    o = m.mtp(m.hidden_states(tok), tgt)[0]
    (g1,) = torch.autograd.grad(linear_cross_entropy(o.hidden, m.embed.weight, o.targets), m.layers[0].mixer.q_proj.weight)
    assert g1.norm() > 0.01 * grads[(0.0, 0.0)].norm()
    torch.testing.assert_close(grads[(1.0, 0.0)] - grads[(0.0, 0.0)], g1, atol=1e-6, rtol=1e-3)


def test_the_tied_head_trains_the_embedding_in_both_loss_paths(dropless):
    "Rows of ids that never appear in the input get a gradient only through the output head; both loss paths give the same."
    x = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(1))
    g = {}
    for impl in ("fused", "logits"):
        m = _model(dropless).eval()
        m.loss_impl = impl
        m(x[:, :-1], x[:, 1:])[0].backward()
        g[impl] = m.embed.weight.grad
    assert (g["fused"][1000:].abs().sum(1) > 0).all()
    torch.testing.assert_close(g["fused"], g["logits"], atol=1e-7, rtol=1e-4)


def test_flops_with_unequal_head_sizes():
    "The presets have d_qk = d_v and K = V (and hymo_tiny as many GDN as MLA heads); a model where they differ must count each where it belongs."
    c = load_config("hymo_tiny", mla_v_head_dim=48, gdn_head_v_dim=64, gdn_n_heads=2).model
    with torch.device("meta"): m = HyMo(c)
    fb = flops_breakdown(m, 128)
    d_qk = c.mla_qk_nope_dim + c.mla_qk_rope_dim
    assert d_qk == 32 and c.gdn_head_k_dim == 32 and c.gdn_chunk_size == 64 and (c.mla_n_heads, c.gdn_n_heads) == (4, 2)
    # 3 (forward + backward) x 1 MLA block x 2 (multiply-add) x 4 heads x (d_qk + d_v) x 64 keys per query (causal half of 128)
    assert fb["MLA attention scores + values"] == 3 * 1 * 2 * 4 * (32 + 48) * 64
    C, K, V = 64, 32, 64
    # 3 x 3 GDN blocks x 2 GDN heads (not the MLA blocks' 4) x the chunked rule's products per token
    assert fb["GDN chunked rule"] == pytest.approx(3 * 3 * 2 * (6 * C * K + 4 * C * V + 6 * K * V + C * C / 3))
    assert state_breakdown(m, 100, torch.float32) == {  # 3 GDN blocks of 2 heads; the conv window holds q, k (K) and v (V)
        "GDN recurrent state (fp32)": 3 * 2 * K * V * 4, "GDN convolution windows": 3 * 3 * (2 * 2 * K + 2 * V) * 4,
        "MLA latent cache": 1 * 100 * (c.mla_kv_lora_rank + c.mla_qk_rope_dim) * 4}
    for bad in (lambda: flops_breakdown(m, 0), lambda: flops_breakdown(m, 128, keys=-1), lambda: state_breakdown(m, -1)):
        with pytest.raises(ValueError, match="must be"): bad()


def test_flops_750m_term_by_term():
    "The count every MFU on the results page rests on, each term written out from hymo_750m's numbers."
    c = load_config("hymo_750m").model
    with torch.device("meta"): m = HyMo(c)
    D, V, T = 896, 64256, 4096
    gdn_mixer = 5 * D * 1280 + 2 * D * 40 + 3 * 1280 * 4  # q, k, v, g, o; the a and b gates of 40 heads; three depthwise convs
    mla = D * 224 + 224 * 16 * 128 + D * (128 + 32) + 128 * 4 * (96 + 128) + 16 * 128 * D  # q down/up, kv down (+ rope), kv up (4 groups), out
    moe_active = D * 16 + 3 * D * 2304 * (1 + 2)  # router, the shared expert and the top 2 of 16 routed
    C, K, Vd = 64, 32, 32
    want = {"matrices (blocks)": 6 * (24 * (gdn_mixer + 3 * D * 2560) + 8 * (mla + moe_active)),
            "output head": 6 * V * D,
            "MTP heads (MLP + vocabulary projection)": 6 * 2 * (2 * D * 2304 + V * D),
            "MLA attention scores + values": 3 * 8 * 2 * 16 * (96 + 32 + 128) * T / 2,
            "GDN chunked rule": 3 * 24 * 40 * (6 * C * K + 4 * C * Vd + 6 * K * Vd + C * C / 3)}
    assert flops_breakdown(m, T) == pytest.approx(want, rel=1e-12)
    assert m.flops_per_token(T) == pytest.approx(4_422_942_720, rel=1e-12)  # the figure in the README, chapters and result rows


def test_param_breakdown_entry_by_entry(dropless):
    "Each entry written out for hymo_tiny (their sum alone would let two entries swap)."
    m = _model(dropless)
    D, H, K, V, W = 128, 4, 32, 32, 4
    assert param_breakdown(m) == {
        "embedding (= tied head)": 2048 * D,
        "GDN mixers": 3 * (2 * D * H * K + 2 * D * H * V + 2 * D * H + H * V * D + W * (2 * H * K + H * V) + 2 * H + V),
        "GDN dense SwiGLU FFNs": 3 * 3 * D * 384,
        "MLA attention": D * 64 + 64 + 64 * 4 * 32 + D * (32 + 16) + 32 + 32 * 2 * (16 + 32) + 4 * 32 * D,
        "MoE routed experts": 4 * 3 * D * 192,
        "MoE shared experts + routers": 3 * D * 192 + D * 4,
        "block norms + final norm": 4 * 2 * D + D,
        "MTP heads": 2 * (2 * D * 256 + 2 * D)}


def test_more_input_errors_are_clear(dropless):
    m = _model(dropless).eval()
    with pytest.raises(ValueError, match="holds no sequence"): m(torch.zeros(0, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"the state has 5 layers made for batches of 1 \(the model has 4\)"):
        m.decode(torch.zeros(1, 3, dtype=torch.long), m.decode_state(1, 8) + [None])
    with pytest.raises(ValueError, match=r"the state has 3 layers \(the model has 4\)"):  # GDN layers only: none started
        m.decode(torch.zeros(1, 3, dtype=torch.long), m.decode_state(1, 8)[:3])
    with pytest.raises(ValueError, match="max_len=0"): m.decode_state(1, 0)


@torch.no_grad()
def test_decode_runs_the_blocks_in_the_autocast_dtype(dropless):
    "Under autocast the residual stream entering each block is bf16 in decode as in the forward (fp32 drifts 3.5x further)."
    m = _model(dropless).eval()
    seen = []
    hooks = [l.norm1.register_forward_pre_hook(lambda mod, a: seen.append(a[0].dtype)) for l in m.layers]
    x = torch.randint(0, 2048, (1, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x); st = m.decode_state(1, 8); m.decode(x, st); m.decode(x[:, :1], st)
    for h in hooks: h.remove()
    assert seen == [torch.bfloat16] * (3 * len(m.layers))


def test_a_window_too_short_for_the_mtp_heads_is_refused_before_the_trunk_runs(monkeypatch):
    from hymo.config import load_config
    from hymo.models.model import HyMo
    torch.manual_seed(0)
    m = HyMo(load_config("hymo_tiny").model)
    ran = []
    monkeypatch.setattr(m.layers[0], "forward", lambda *a, **k: ran.append(1))
    tokens = torch.randint(0, 100, (1, m.config.mtp_depth))
    with pytest.raises(ValueError, match=f"sequence length {m.config.mtp_depth} is too short for {m.config.mtp_depth} MTP heads"):
        m(tokens, targets=tokens)
    assert ran == []
