"""Sampling, decoding and `python -m hymo.generate` on a finished tiny run: the cases mutation testing of
hymo/models/model.py and hymo/generate.py found no other test catching (each fails on a plausible change)."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from hymo.config import ConfigError, load_config
from hymo.models.model import HyMo
from hymo.training.data import EOT
from test_model import _model, _unit_scale, dropless, one_thread  # test_model's helpers and fixtures: one thread, dropless routing


# ---------------------------------------------------------------- hymo/models/model.py

def test_top_k_larger_than_the_vocabulary_samples_from_all(dropless):
    "top_k >= vocab_size means 'all' (as `--top-k 5000` on a 2048-token model): same draws as top_k=None, no topk error."
    m = _model(dropless).eval()
    prompt = torch.randint(0, dropless.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1); every = m.generate(prompt, 4, temperature=1.0)
    torch.manual_seed(1); big_k = m.generate(prompt, 4, temperature=1.0, top_k=dropless.vocab_size + 100)
    assert torch.equal(every, big_k)


@pytest.mark.parametrize("temperature, top_k", [(0, None), (1.0, 1), (0.8, 3)])
def test_the_tokenizers_last_id_can_be_drawn(dropless, temperature, top_k):
    "`vocab=v` bans ids >= v only: id v - 1, the tokenizer's last token, stays drawable."
    m, v = _model(dropless), dropless.vocab_size - 64
    head = m.head
    def last_wins(h):
        logits = head(h).clone(); logits[..., v - 1] += 100; logits[..., v:] += 200
        return logits
    m.head = last_wins
    prompt = torch.randint(0, v, (1, 4), generator=torch.Generator().manual_seed(0))
    out = m.generate(prompt, 3, temperature, top_k, vocab=v)
    assert (out[0, 4:] == v - 1).all(), out


def test_a_decode_refused_for_room_leaves_the_state_usable():
    "A call that does not fit the caches raises before any layer runs: GDN states are not advanced, decoding goes on."
    cfg = load_config("hymo_tiny", n_layers=4, moe_capacity_factor=None).model
    m = _unit_scale(_model(cfg))
    seq = torch.randint(0, cfg.vocab_size, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = m(seq[:, :12])
        state = m.decode_state(1, 12)
        first = m.decode(seq[:, :5], state)
        before = list(state)
        with pytest.raises(ValueError, match="larger max_len"): m.decode(seq[:, 5:13], state)  # 5 + 8 > 12
        assert all(a is b for a, b in zip(state, before)), "the refused call replaced GDN states"
        rest = m.decode(seq[:, 5:12], state)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=1e-4, rtol=0)


def test_generate_keeps_eval_mode(dropless):
    "A model in eval mode (as `load_run` returns it) is still in eval mode after generate: forward routes dropless after."
    m = _model(dropless).eval()
    m.generate(torch.tensor([[1, 2, 3]]), 2)
    assert not m.training
    m.train()
    m.generate(torch.tensor([[1, 2, 3]]), 2)
    assert m.training


def test_a_packed_document_of_exactly_max_seq_len_is_accepted():
    "The trainer cuts documents at seq_len, which may equal max_seq_len: a document of exactly L tokens is allowed."
    cfg = load_config("hymo_tiny", max_seq_len=32, seq_len=32).model
    m = _model(cfg).eval()
    L = cfg.max_seq_len
    x = torch.randint(0, cfg.vocab_size, (1, L + 8))
    with torch.no_grad():
        out = m(x, cu_seqlens=torch.tensor([0, L, L + 8]))
        torch.testing.assert_close(out[:, :L], m(x[:, :L]), atol=1e-4, rtol=1e-4)


def test_mtp_proj_in_is_initialised_at_init_std():
    "init_weights' table: MTP proj_in ~ N(0, init_std²), proj_out at the residual scale init_std / sqrt(2 n_layers)."
    cfg = load_config("hymo_tiny", dim=256, mtp_inter_dim=512, n_layers=8).model
    m = _model(cfg)
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for blk in m.mtp.heads:
        assert abs(blk.proj_in.weight.std().item() / cfg.init_std - 1) < 0.1
        assert abs(blk.proj_out.weight.std().item() / out_std - 1) < 0.1


def test_the_smallest_temperatures_are_greedy(dropless):
    "τ down to the smallest double (5e-324): logits / τ would be ±inf; shifted by the max first they are <= 0, as greedy."
    m = _model(dropless).eval()
    with torch.no_grad(): m.embed.weight.normal_(0, 0.05)
    prompt = torch.randint(0, dropless.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    greedy = m.generate(prompt, 4, temperature=0)
    for tau in (1e-310, 5e-324):
        assert torch.equal(m.generate(prompt, 4, temperature=tau), greedy)


# ---------------------------------------------------------------- hymo/generate.py

def test_generate_refuses_what_it_cannot_honour(dropless):
    "Each would otherwise be silently wrong (a negative τ samples the least likely ids; window=0 reads as 'all'; an id past the model drawable) or fail deep inside."
    m, V = _model(dropless).eval(), dropless.vocab_size
    p = torch.tensor([[1, 2, 3]])
    for kw, match in ((dict(temperature=-0.5), "temperature >= 0"), (dict(top_k=0), "top_k None or an int >= 1"),
                      (dict(window=0), "window=0 must be"), (dict(vocab=V + 1), f"vocab={V + 1} must be"),
                      (dict(vocab=0), "vocab=0 must be")):
        with pytest.raises(ValueError, match=match): m.generate(p, 2, **kw)
    with pytest.raises(ValueError, match=r"one prompt \[1, T\]"): m.generate(p.repeat(2, 1), 2)


def test_generate_without_cache_runs_no_decode(dropless, monkeypatch):
    "cache=False (for a compiled or FSDP model) re-runs the forward; the decode path is not taken though it gives the same ids."
    m = _model(dropless).eval()
    monkeypatch.setattr(HyMo, "decode", lambda *a, **k: pytest.fail("cache=False took the decode path"))
    assert m.generate(torch.tensor([[1, 2, 3]]), 3, temperature=0, cache=False).shape == (1, 6)


def test_a_decode_graph_on_a_state_with_room_for_one_token():
    "The warm-up steps no more than the caches hold; the one step left gives the forward's logits."
    from hymo.models.model import DecodeGraph
    cfg = load_config("hymo_tiny", n_layers=4, moe_capacity_factor=None).model
    m = _unit_scale(_model(cfg)).eval()
    seq = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        state = m.decode_state(1, 9)
        m.decode(seq[:, :8], state)
        g = DecodeGraph(m, state, capture=False)
        torch.testing.assert_close(g(seq[:, 8:9], state)[:, 0], m(seq)[:, 8], atol=1e-4, rtol=0)
        other = m.decode_state(1, 9); m.decode(seq[:, :8], other)
        with pytest.raises(ValueError, match="the state it was built on"): g(seq[:, 8:9], other)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    "A finished hymo_tiny run of 2 steps (seq_len=32 < max_seq_len=256), its data prepared in a private cache."
    cache = tmp_path_factory.mktemp("hymo_cache")
    old = os.environ.get("HYMO_CACHE")
    os.environ["HYMO_CACHE"] = str(cache)
    try:
        from hymo.train import main
        d = tmp_path_factory.mktemp("gen") / "run"
        main([f"{k}={v}" for k, v in dict(seq_len=32, micro_batch_size=4, global_batch_size=4, eval_every=0, ckpt_every=0,
                                          sample_tokens=8, warmup_steps=1, log_every=1, max_steps=2, run_dir=d).items()])
        yield d
    finally:
        if old is None: os.environ.pop("HYMO_CACHE", None)
        else: os.environ["HYMO_CACHE"] = old


@pytest.fixture(scope="module")
def loaded(run):
    from hymo.generate import load_run
    return load_run(run)


def _copy_run(run, tmp_path):
    import shutil
    other = tmp_path / "copy"
    shutil.copytree(run, other, ignore=shutil.ignore_patterns("checkpoints", ".lock"))
    return other


@pytest.mark.parametrize("kernel, chunk, want", [("triton", 64, "auto"), ("auto", 32, "torch"), ("auto", 64, "auto"),
                                                 ("torch", 32, "torch"), ("naive", 64, "naive")])
def test_run_config_gives_a_kernel_that_loads_anywhere(tmp_path, kernel, chunk, want):
    "A GPU run (triton) loads on a CPU; a run whose chunks are not 64 keeps the PyTorch path (auto would pick Triton)."
    from hymo.generate import run_config
    (tmp_path / "config.yaml").write_text(str(load_config("hymo_tiny", gdn_kernel=kernel, gdn_chunk_size=chunk)))
    m = run_config(tmp_path).model
    assert (m.gdn_kernel, m.gdn_chunk_size) == (want, chunk)


def test_load_run_returns_the_model_in_eval_mode(loaded):
    model, _ = loaded
    assert not model.training and not any(m.training for m in model.modules())


def test_load_run_of_a_finished_run_without_its_model_says_how_to_write_it_again(run, tmp_path):
    """The command it gives writes the model again from the final checkpoint; without checkpoints it says there is nothing
    to write it from (the train command would refuse the folder)."""
    import shutil
    from hymo.generate import load_run
    from hymo.train import main
    other = _copy_run(run, tmp_path)
    shutil.copytree(run / "checkpoints", other / "checkpoints")
    (other / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=f"but the run finished .*--config {other / 'config.yaml'} run_dir={other} writes the "
                                          "missing files again from the final checkpoint") as e:
        load_run(other)
    main(e.value.args[0].split("python -m hymo.train ")[1].split(" writes")[0].split())  # the command, as given
    load_run(other)
    shutil.rmtree(other / "checkpoints"); (other / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no checkpoint left to write them from, so copy them back"):
        load_run(other)
    (other / "summary.json").unlink()
    with pytest.raises(ConfigError, match=f"resume it to the end, python -m hymo.train --config {other / 'config.yaml'}\\)"):
        load_run(other)
    kept = tmp_path / "finished-step_000002"  # a finished run's model set aside: not a run folder to train in
    kept.mkdir(); (kept / "config.yaml").write_text((run / "config.yaml").read_text()); (kept / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"has no model.safetensors, tokenizer.json: give the folder of a finished run .*to the end\)$"):
        load_run(kept)


def test_load_run_finds_a_changed_byte_in_the_model(run, tmp_path):
    "summary.json holds model.safetensors' size and CRC-32: a flipped bit, which loads without an error, is refused."
    from hymo.generate import load_run
    other = _copy_run(run, tmp_path)
    w = other / "model.safetensors"
    data = bytearray(w.read_bytes()); data[-6] ^= 0x40; w.write_bytes(bytes(data))  # inside the last tensor's numbers
    with pytest.raises(ConfigError, match="model.safetensors has changed since the run wrote it .*Copy it again, or delete it"):
        load_run(other)
    summary = json.loads((other / "summary.json").read_text())
    assert set(summary.pop("model_file")) == {"size", "crc32"}
    (other / "summary.json").write_text(json.dumps(summary))  # a run from before the sums: loads unchecked, as it did
    load_run(other)


def test_load_run_of_a_folder_a_run_trains_in_says_so(run, tmp_path):
    "No model.safetensors yet because a process trains there now (it holds .lock): the error says that, not 'resume it'."
    import subprocess, sys
    from hymo.generate import load_run
    other = _copy_run(run, tmp_path)
    (other / "model.safetensors").unlink(); (other / "summary.json").unlink()
    hold = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.write('pid 4242 on box\\n'); f.flush(); print('locked', flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", hold, str(other / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=r"no model.safetensors yet: a run is training there now \(pid 4242 on box\)"):
            load_run(other)
        shutil.copyfile(run / "model.safetensors", other / "model.safetensors")
        (other / "summary.json").write_text('{"step": 2, "val_lo')  # a finish writing it as generate reads it
        with pytest.raises(ConfigError, match=r"summary.json is being written: a run is training in .* \(pid 4242 on box\)"):
            load_run(other)
        (other / "model.safetensors").unlink(); (other / "summary.json").unlink()
    finally: p.kill(); p.wait()
    with pytest.raises(ConfigError, match="resume it to the end"): load_run(other)  # the lock is gone with the process


def test_load_run_given_a_checkpoint_names_its_run(run, tmp_path):
    "A checkpoint folder of a finished run points to the run; of an unfinished run, to resuming it (not 'has no config.yaml')."
    from hymo.generate import load_run
    other = _copy_run(run, tmp_path)
    (other / "checkpoints" / "step_000002").mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"is one of a run's checkpoints: give the run folder, {other}$"):
        load_run(other / "checkpoints" / "step_000002")
    (other / "model.safetensors").unlink()  # not finished: no exported weights yet
    with pytest.raises(ConfigError, match=f"{other} has not finished: resume it to the end .*run_dir={other}\\)$"):
        load_run(other / "checkpoints" / "step_000002")


def test_load_run_given_a_checkpoint_as_dot_or_copied_out_of_its_run(run, tmp_path, monkeypatch):
    "`.` inside a checkpoint names its run too; a checkpoint copied elsewhere is told it is one (meta.json, .metadata)."
    from hymo.generate import load_run
    other = _copy_run(run, tmp_path)
    ckpt = other / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    monkeypatch.chdir(ckpt)
    with pytest.raises(ConfigError, match=f"is one of a run's checkpoints: give the run folder, {other}$"): load_run(".")
    scratch = tmp_path / "scratch"  # checkpoints/ a link to other storage, as the trainer allows
    (other / "checkpoints").rename(scratch); (other / "checkpoints").symlink_to(scratch)
    with pytest.raises(ConfigError, match=f"is one of a run's checkpoints: give the run folder, {other}$"):
        load_run(other / "checkpoints" / "step_000002")
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "meta.json").write_text("{}"); (alone / ".metadata").write_bytes(b"")
    with pytest.raises(ConfigError, match=f"is a training checkpoint, not a run folder: .*--config {alone} --resume {alone} run_dir=NEW"):
        load_run(alone)


def test_a_finished_run_without_its_config_yaml_is_told_where_it_is(run, tmp_path):
    "The trainer command write_again suggests reads RUN/config.yaml itself: for a missing config.yaml it cannot help."
    from hymo.generate import load_run
    other = _copy_run(run, tmp_path)
    (other / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="has no config.yaml, but the run finished .*copy it back from a copy of the run folder"):
        load_run(other)


def test_a_finished_runs_config_yaml_damaged_or_edited_is_refused_with_the_way_back(run, tmp_path):
    """An edit that keeps every shape (moe_top_k 2 to 3) loaded into another model than the one trained, and an unreadable
    config.yaml was a generic config error: both are refused, with a command that writes it again, which works."""
    from hymo.generate import load_run
    from hymo.train import main
    other = _copy_run(run, tmp_path)
    shutil.copytree(run / "checkpoints", other / "checkpoints")
    text = (other / "config.yaml").read_text()
    (other / "config.yaml").write_text(text.replace("moe_top_k: 2", "moe_top_k: 3"))
    with pytest.raises(ConfigError, match=r"has model settings these weights did not train with \(moe_top_k: 3 \(trained: 2\);"):
        load_run(other)
    (other / "config.yaml").write_text(text.replace("gdn_kernel: auto", "gdn_kernel: naive")  # how it runs, and
                                       .replace("moe_bias_speed: 0.001", "moe_bias_speed: 0.01"))  # training only: free
    load_run(other)
    (other / "config.yaml").write_text("")
    final = sorted((other / "checkpoints").glob("step_*"))[-1]
    with pytest.raises(ConfigError, match=f"cannot be read .*the run finished .*`python -m hymo.train --config {final}` "
                                          r"\(the settings the run trained with, .*\), which writes config.yaml again"):
        load_run(other)
    main(["--config", str(final)])  # the command, as it is given: no settings to rebuild by hand
    assert (other / "config.yaml").read_text() == text.replace(str(run), str(other)) and (other / "config.yaml.damaged").read_text() == ""
    load_run(other)


def test_load_run_refuses_another_tokenizer(run, tmp_path):
    "A tokenizer.json whose sha256 is not summary.json's; without summary.json, one larger than the vocabulary."
    from tokenizers import Tokenizer
    from hymo.generate import load_run
    other = _copy_run(run, tmp_path)
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    tok.add_tokens(["zzqx"])  # a valid tokenizer, not the run's
    tok.save(str(other / "tokenizer.json"))
    with pytest.raises(ConfigError, match="is not the tokenizer this run trained with"): load_run(other)
    (other / "summary.json").unlink()
    with pytest.raises(ConfigError, match="tokens, more than the model's vocab_size=2048"): load_run(other)


def test_load_run_refuses_weights_with_missing_or_unexpected_tensors(run, tmp_path):
    "strict=False loading: a tensor missing (it would stay at its random init) or one too many is an error, not silence."
    from safetensors.torch import load_file, save_file
    from hymo.generate import load_run
    other = _copy_run(run, tmp_path)
    summary = json.loads((other / "summary.json").read_text()); del summary["model_file"]  # else its sum refuses first
    (other / "summary.json").write_text(json.dumps(summary))
    w = load_file(str(run / "model.safetensors"))
    save_file({k: v for k, v in w.items() if k != "norm.weight"}, str(other / "model.safetensors"))
    fix = "config.yaml's model: section is not the one these weights trained with: put back the run's own config.yaml"
    with pytest.raises(ConfigError, match=f"does not fit .*\\(missing \\['norm.weight'\\]\\): {fix}"): load_run(other)
    save_file({**w, "extra.weight": torch.zeros(2)}, str(other / "model.safetensors"))
    with pytest.raises(ConfigError, match=f"does not fit .*\\(unexpected \\['extra.weight'\\]\\): {fix}"): load_run(other)
    save_file({**w, "norm.weight": torch.zeros(3)}, str(other / "model.safetensors"))  # a setting changed: another shape
    with pytest.raises(ConfigError, match=f"does not fit .*\\(size mismatch for norm.weight.*\\): {fix}"): load_run(other)


def test_an_end_of_text_typed_in_a_prompt_is_text(loaded):
    "encode_special_tokens: '<|endoftext|>' in a prompt is not the EOT id; only the leading one is."
    from hymo.generate import prompt_ids
    from hymo.training.data import EOT
    _, tok = loaded
    ids = prompt_ids(tok, f"a{EOT}b")
    assert ids[0] == tok.token_to_id(EOT) and tok.token_to_id(EOT) not in ids[1:]


def test_trained_length_is_train_seq_len(run):
    from hymo.generate import trained_length
    assert trained_length(run) == 32  # not max_seq_len=256


def _eot_on_third_draw(model, eot, count=None):
    "Patch the head: EOT impossible on the first two draws, certain on the third, impossible after."
    head, calls = model.head, []
    def head_(h):
        calls.append(1)
        logits = head(h).clone(); logits[..., eot] += 1000 if len(calls) == 3 else -1000
        return logits
    model.head = head_
    return calls


def test_generate_text_stops_at_the_eot_token_and_cuts_there(run):
    "stop=True ends the loop at EOT (no wasted forwards); stop=False runs on and cuts: the same text."
    from hymo.generate import generate_text, load_run
    from hymo.training.data import EOT
    model, tok = load_run(run)
    eot = tok.token_to_id(EOT)
    calls = _eot_on_third_draw(model, eot)
    stopped = generate_text(model, tok, "ROMEO:", 20, seed=0, stop=True)
    assert len(calls) == 3, len(calls)  # three draws, then the loop ended
    calls.clear()
    ran_on = generate_text(model, tok, "ROMEO:", 20, seed=0, stop=False)
    assert len(calls) == 20
    assert ran_on == stopped and EOT not in stopped


def test_generate_text_draws_only_ids_the_tokenizer_has(loaded):
    "A model wider than its tokenizer (vocab padded up): generate_text passes vocab= so the extra rows are never drawn."
    from hymo.generate import generate_text
    _, tok = loaded
    V = tok.get_vocab_size()
    wide = _model(load_config("hymo_tiny", vocab_size=V + 64).model).eval()
    head = wide.head
    def boosted(h):  # the rows past V would win every draw
        logits = head(h).clone(); logits[..., V:] += 100
        return logits
    wide.head = boosted
    drawn, generate = [], wide.generate
    wide.generate = lambda *a, **k: drawn.append(generate(*a, **k)) or drawn[-1]
    generate_text(wide, tok, "ROMEO:", 5, seed=0, stop=False)
    assert (drawn[0] < V).all(), drawn[0]


def test_cli_top_k_0_samples_from_all(run, capsys):
    "--top-k 0 means all tokens (the help says so): it generates, and draws what top_k=None draws."
    from hymo.generate import generate_text, load_run, main
    text = main([str(run), "--tokens", "4", "--top-k", "0", "--device", "cpu"])
    model, tok = load_run(run)
    assert text == generate_text(model, tok, "ROMEO:", 4, top_k=None, window=32)


def test_cli_continues_the_runs_sample_prompt_by_default(run, tmp_path, capsys):
    "Without --prompt, the command continues the run's train.sample_prompt, as the end-of-run sample did (ROMEO: here)."
    from hymo.generate import main
    other = _copy_run(run, tmp_path)
    args = [str(other), "--tokens", "4", "--device", "cpu"]
    assert main(args) == main(args + ["--prompt", "ROMEO:"])  # the bundled corpus's
    cfg = load_config(other / "config.yaml")
    cfg.train.sample_prompt = "JULIET:"
    (other / "config.yaml").write_text(str(cfg))
    assert main(args) == main(args + ["--prompt", "JULIET:"]) != main(args + ["--prompt", "ROMEO:"])
    assert main(args).startswith("JULIET:")


def test_cli_reads_no_more_than_the_trained_length(run, monkeypatch, capsys):
    "A prompt longer than train.seq_len (32): every forward and decode call of the CLI reads at most 32 tokens."
    from hymo.generate import main
    sizes, forward, decode = [], HyMo.forward, HyMo.decode
    monkeypatch.setattr(HyMo, "forward", lambda self, tokens, *a, **k: sizes.append(tokens.shape[1]) or forward(self, tokens, *a, **k))
    monkeypatch.setattr(HyMo, "decode", lambda self, tokens, *a, **k: sizes.append(tokens.shape[1]) or decode(self, tokens, *a, **k))
    main([str(run), "--prompt", "ROMEO: " * 30, "--tokens", "3", "--device", "cpu"])
    assert sizes and max(sizes) <= 32, sizes
    assert "it sees only the last 32" in capsys.readouterr().err


def test_streamed_pieces_add_up_to_the_text_when_it_ends_inside_a_character(run):
    "The last ids are the first bytes of '☃' (held back while streaming as U+FFFD): `finish` still sends them."
    from hymo.generate import generate_text, load_run
    model, tok = load_run(run)
    want = tok.encode(" snow ☃").ids[:-1]
    assert tok.decode(want).endswith("\ufffd")
    head, calls = model.head, []
    def forced(h):
        logits = head(h).clone(); logits[..., want[len(calls)]] += 1000; calls.append(1)
        return logits
    model.head = forced
    pieces = []
    text = generate_text(model, tok, "ROMEO:", len(want), seed=0, stream=pieces.append)
    assert text.endswith("\ufffd") and "".join(pieces) == text, (pieces, text)


class _ByteTokens:
    "A tokenizer of byte strings, decoded as a byte-level BPE decodes: the bytes joined, then UTF-8 with U+FFFD for junk."
    def __init__(self, *tokens: bytes): self.tokens = tokens
    def decode(self, ids): return b"".join(self.tokens[i] for i in ids).decode("utf-8", "replace")


@pytest.mark.parametrize("tokens", [
    [bytes([b]) for b in (0xF0, 0xA9, 0x98, 0xE2, 0xA9, 0xE2, 0xC3, 0x20)],  # cut after 4 ids: the F0 A9 98 run split
    [bytes([b]) for b in (0xF0, 0x98, 0x98, 0xC3, 0xE2, 0xC3, 0x20, 0xC3, 0xE2, 0x61, 0x83, 0x83, 0xA9, 0xF0)],
    [b"\xf0", b"\xa9a", b"b\xc3", b"\x98\x80", b"\xe2", b"\xf0\x9f", b"\x98", b"b\xc3", b"\xf0\x9f", b"\x83\xe2"]])
def test_streamed_junk_bytes_add_up_to_the_text(tokens):
    "An undertrained model may draw bytes that are no UTF-8: the stream shows them as they come, and as the text has them."
    from hymo.generate import _Stream
    tok = _ByteTokens(*dict.fromkeys(tokens))
    ids = [list(dict.fromkeys(tokens)).index(t) for t in tokens]
    pieces = []
    s = _Stream(tok, [], None, pieces.append)
    for i in ids: s.add(i)
    shown = len(pieces)
    text = tok.decode(ids); s.finish(text)
    assert "".join(pieces) == text, (pieces, text)
    assert shown > 0 or len(ids) <= 4  # junk is streamed, not all held back to the end


def test_cli_refuses_a_seed_torch_cannot_take(run, capsys):
    "--seed 2**64 (past torch.manual_seed's range) is a one-line usage error, not a traceback from torch."
    from hymo.generate import main
    with pytest.raises(SystemExit) as e: main([str(run), "--seed", str(2 ** 64), "--device", "cpu"])
    assert e.value.code == 2 and "--seed must be in 0..2**64-1" in capsys.readouterr().err


def test_a_loaded_model_keeps_to_its_trained_length_as_the_command_line_does(run, capsys):
    "`load_run` records train.seq_len on the model: the library's default window is the command line's, not max_seq_len."
    from hymo.generate import generate_text, load_run, main, trained_length
    model, tok = load_run(run)
    assert model.trained_len == trained_length(run) < model.config.max_seq_len
    cli = main([str(run), "--tokens", "60", "--device", "cpu"])
    assert generate_text(model, tok, "ROMEO:", 60) == cli
    model.trained_len = None  # as built, not loaded: max_seq_len, which past the trained length reads other text
    assert generate_text(model, tok, "ROMEO:", 60) != cli
    model.trained_len = 10 ** 6
    with pytest.raises(ValueError, match=r"trained_len=1000000 must be an int in 1..max_seq_len=256"): generate_text(model, tok)


def test_seed_changes_the_text_and_leaves_the_callers_rng_alone(loaded):
    from hymo.generate import generate_text
    model, tok = loaded
    a, b = (generate_text(model, tok, "ROMEO:", 12, temperature=1.0, top_k=None, seed=s) for s in (0, 1))
    assert a != b and a == generate_text(model, tok, "ROMEO:", 12, temperature=1.0, top_k=None, seed=0)
    torch.manual_seed(123); want = torch.rand(3)
    torch.manual_seed(123); generate_text(model, tok, "ROMEO:", 4, seed=7); got = torch.rand(3)
    assert torch.equal(got, want)  # the caller's (the trainer's) random stream is not reseeded


def test_a_stream_shows_nothing_after_the_end_of_text_when_generation_runs_on(run):
    from hymo.generate import generate_text, load_run
    model, tok = load_run(run)
    _eot_on_third_draw(model, tok.token_to_id(EOT))
    pieces = []
    text = generate_text(model, tok, "ROMEO:", 12, seed=0, stop=False, stream=pieces.append)  # as every FSDP rank runs
    assert "".join(pieces) == text


def test_top_k_past_the_vocabulary_keeps_every_id_drawable(dropless, monkeypatch):
    m = _model(dropless).eval()
    seen, multinomial = [], torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda p, n: seen.append(p[0]) or multinomial(p, n))
    m.generate(torch.tensor([[1, 2, 3]]), 1, temperature=1.0, top_k=dropless.vocab_size + 100)
    assert (seen[0] > 0).all()


def test_on_token_sees_every_drawn_id_the_stop_token_included(dropless):
    m = _model(dropless).eval()
    head, calls = m.head, []

    def end_after_two(h):
        calls.append(1)
        logits = head(h).clone(); logits[..., 0] += 100 if len(calls) > 2 else -100
        return logits

    m.head = end_after_two
    got = []
    out = m.generate(torch.tensor([[5, 6, 7, 8]]), 10, temperature=0.8, stop=0, on_token=got.append)
    assert got == out[0, 4:].tolist() and got[-1] == 0 and len(got) < 10
    with pytest.raises(ValueError, match="finite temperature >= 0"): m.generate(torch.tensor([[1]]), 2, temperature=float("inf"))


def test_cli_seed_ends_and_flags_named(run, capsys):
    from hymo.generate import main
    assert main([str(run), "--seed", str(2 ** 64 - 1), "--tokens", "2", "--device", "cpu"]).startswith("ROMEO:")
    for flag, value in (("--temperature", "-1"), ("--top-k", "-3"), ("--tokens", "-1"), ("--temperature", "nan")):
        with pytest.raises(SystemExit) as e: main([str(run), flag, value, "--device", "cpu"])
        assert e.value.code == 2 and f"{flag} must be a number >= 0, got {value}" in capsys.readouterr().err


def test_cli_notes_only_a_prompt_longer_than_the_trained_length_and_counts_it_as_typed(run, loaded, capsys):
    from hymo.generate import main, prompt_ids, trained_length
    _, tok = loaded
    L, prompt = trained_length(run), "ROMEO:"
    while len(prompt_ids(tok, prompt)) < L: prompt += " a"
    assert len(prompt_ids(tok, prompt)) == L
    main([str(run), "--prompt", prompt, "--tokens", "1", "--device", "cpu"])
    assert "note:" not in capsys.readouterr().err  # exactly the trained length: all of it is read
    main([str(run), "--prompt", prompt + " a", "--tokens", "1", "--device", "cpu"])
    n = len(tok.encode(prompt + " a").ids)
    assert f"note: the prompt is {n + 1} tokens with the end-of-text token that opens it ({n} as typed), more than the {L}" in capsys.readouterr().err


def test_cli_prints_the_newer_checkpoint_note(run, tmp_path, capsys):
    from hymo.generate import main, newer_checkpoint_note
    other = _copy_run(run, tmp_path)
    step = json.loads((other / "summary.json").read_text())["step"]
    for s in (step - 1, step + 3): (other / "checkpoints" / f"step_{s:06d}").mkdir(parents=True, exist_ok=True)
    main([str(other), "--tokens", "1", "--device", "cpu"])
    assert f"is the model of step {step}, but the run has checkpoints up to step {step + 3}" in capsys.readouterr().err
    (other / "checkpoints" / f"step_{step + 3:06d}").rmdir()
    assert newer_checkpoint_note(other) is None


def test_a_reader_that_closes_the_pipe_ends_generation_quietly(run):
    "`python -m hymo.generate RUN | head -c 20`: no BrokenPipeError traceback, status 0, as `hymo.data info | head`."
    closed = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from hymo.generate import main; "
              f"main([{str(run)!r}, '--tokens', '8', '--device', 'cpu'])")  # the reader gone before the first piece
    r = subprocess.run([sys.executable, "-c", closed], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------- from mutation testing hymo/generate.py (second pass)

def test_cli_seed_and_top_k_reach_the_sampler(run, capsys):
    "--seed 5 draws other text than --seed 0; --top-k 1 at temperature 1 is the greedy text (top_k reaches `generate`)."
    from hymo.generate import main
    cli = lambda *a: main([str(run), "--tokens", "12", "--device", "cpu", *a])
    assert cli("--temperature", "1", "--top-k", "0", "--seed", "5") != cli("--temperature", "1", "--top-k", "0", "--seed", "0")
    assert cli("--temperature", "1", "--top-k", "1", "--seed", "3") == cli("--temperature", "0")


def test_top_k_1_is_greedy_and_the_prompts_whitespace_is_kept(loaded):
    from hymo.generate import generate_text
    model, tok = loaded
    assert generate_text(model, tok, "ROMEO:", 12, temperature=1.0, top_k=1, seed=3) == generate_text(model, tok, "ROMEO:", 12, temperature=0)
    assert generate_text(model, tok, "  ROMEO:\n", 0) == "  ROMEO:\n"


def test_the_first_streamed_piece_is_the_whole_prompt(loaded):
    "A prompt of many tokens is shown at once, before any drawn token (a Ctrl-C keeps it on the screen)."
    from hymo.generate import generate_text
    model, tok = loaded
    prompt = "ROMEO: But soft, what light through yonder window breaks?"
    assert len(tok.encode(prompt).ids) > 4
    pieces = []
    generate_text(model, tok, prompt, 3, stream=pieces.append)
    assert pieces[0] == prompt


@pytest.mark.parametrize("summary", ["[1, 2]", "null", "{cut"])
def test_a_damaged_summary_is_refused_not_read_as_a_run_without_sums(run, tmp_path, summary):
    "A damaged summary.json loses the model's CRC-32: a flipped bit would load unseen. Deleted, the run loads unchecked."
    from hymo.generate import load_run, newer_checkpoint_note
    other = _copy_run(run, tmp_path)
    (other / "summary.json").write_text(summary)
    with pytest.raises(ConfigError, match=r"summary.json cannot be read .*or delete it to load the model without those checks"):
        load_run(other)
    assert newer_checkpoint_note(other) is None  # (it reads only the step: none to compare)
    (other / "summary.json").unlink()
    model, tok = load_run(other)
    assert model.training is False


def test_a_summary_without_a_step_gives_no_newer_checkpoint_note(run, tmp_path):
    from hymo.generate import newer_checkpoint_note
    other = _copy_run(run, tmp_path)
    (other / "summary.json").write_text('{"step": null}')
    (other / "checkpoints" / "step_000009").mkdir(parents=True)
    assert newer_checkpoint_note(other) is None


def test_load_run_given_a_file_says_so(run):
    from hymo.generate import load_run
    with pytest.raises(ConfigError, match="config.yaml is a file: give a finished run's folder"): load_run(run / "config.yaml")


def test_cli_device_cuda_without_a_gpu_says_there_is_none(run, monkeypatch, capsys):
    from hymo.generate import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as e: main([str(run), "--device", "cuda"])
    assert e.value.code == 2 and "--device cuda, but this machine has no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e: main([str(run), "--device", "cuda:1"])  # the device given is the one named
    assert e.value.code == 2 and "--device cuda:1, but this machine has no CUDA GPU" in capsys.readouterr().err


def test_cli_output_ends_in_one_line_break(run, capsys):
    "The text and a line break; a text that ends in one (a speech's end) gets no second, empty line."
    from hymo.generate import main
    for prompt in ("ROMEO:", "ROMEO:\n"):
        text = main([str(run), "--tokens", "0", "--prompt", prompt])
        assert text == prompt and capsys.readouterr().out == "ROMEO:\n", prompt


def test_cli_device_cpu_0_is_the_cpu(run):
    "torch names the CPU cpu:0 too; safetensors took only 'cpu', and the error blamed the weights file."
    from hymo.generate import main
    assert main([str(run), "--tokens", "3", "--device", "cpu:0"]) == main([str(run), "--tokens", "3", "--device", "cpu"])


def test_a_prompt_without_its_flag_is_told_how_to_give_it(tmp_path, capsys):
    from hymo.generate import main
    with pytest.raises(SystemExit) as e: main([str(tmp_path), "JULIET:"])
    assert e.value.code == 2 and "unrecognized arguments: JULIET:; a prompt is given as --prompt" in capsys.readouterr().err


def test_cli_samples_with_the_runs_seed_unless_given_one(run, tmp_path):
    "generate drew with seed 0 whatever the run's train.seed, so its text was not the run's end-of-run sample (seed 1 there)."
    from hymo.generate import main
    other = _copy_run(run, tmp_path)
    (other / "config.yaml").write_text((other / "config.yaml").read_text().replace("\n  seed: 0\n", "\n  seed: 7\n", 1))
    assert "\n  seed: 7\n" in (other / "config.yaml").read_text()
    cli = lambda *a: main([str(other), "--tokens", "12", "--device", "cpu", "--temperature", "1", "--top-k", "0", *a])
    assert cli() == cli("--seed", "7") != cli("--seed", "0")


def test_top_p_narrows_the_draw_and_the_command_line_passes_it(run, capsys):
    """A nucleus too small for any second token is the argmax, whatever the seed; a nucleus of a few tokens draws only
    tokens the model ranks in it; `--top-p` reaches generate (and 1 leaves the default draw as it was)."""
    from hymo.generate import generate_text, load_run, main, prompt_ids
    model, tok = load_run(run)
    greedy = generate_text(model, tok, "ROMEO:", 24, temperature=0)
    free = [generate_text(model, tok, "ROMEO:", 24, temperature=1.0, top_k=None, seed=s) for s in (0, 1)]
    assert free[0] != free[1] and greedy not in free  # sampling does vary ...
    for s in (0, 1):  # ... but not within a nucleus of one token
        assert generate_text(model, tok, "ROMEO:", 24, temperature=1.0, top_k=None, top_p=1e-6, seed=s) == greedy
    ids = prompt_ids(tok, "ROMEO:")  # each token drawn from a nucleus of half the mass, checked against the model's ranking
    torch.manual_seed(3)
    out = model.generate(torch.tensor([ids]), 24, temperature=1.0, top_p=0.5, vocab=tok.get_vocab_size())[0].tolist()
    for t in range(len(ids), len(out)):
        probs = model(torch.tensor([out[:t]]))[0, -1, :tok.get_vocab_size()].float().softmax(-1)
        p = probs.sort(descending=True).values
        assert probs[out[t]] >= p[(p.cumsum(0) - p < 0.5).sum() - 1] - 1e-6  # at least the nucleus's least likely token
    cli = main([str(run), "--tokens", "24", "--temperature", "1", "--top-k", "0", "--top-p", "0.000001", "--device", "cpu"])
    assert cli == greedy
    assert main([str(run), "--tokens", "24", "--top-p", "1", "--device", "cpu"]) == main([str(run), "--tokens", "24", "--device", "cpu"])
