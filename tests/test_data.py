"""The data pipeline: documents, tokenizer, shards and manifest, idempotent prepare, the loader's order and resumption."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import hymo.training.data as D
from hymo.training.data import (CORPUS, EOT, DataError, TokenLoader, check_compatible, doc_cu_seqlens, load_manifest,
                                load_tokenizer, prepare, prepare_default, split_text, split_train_val, token_dtype,
                                train_tokenizer)

VOCAB = 300


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    "The first ~40 KB of Shakespeare (whole lines) as a file: speeches separated by blank lines."
    raw = CORPUS.read_text()[:40_000]
    p = tmp_path_factory.mktemp("src") / "play.txt"
    p.write_text(raw[:raw.rindex("\n") + 1])
    return p


@pytest.fixture(scope="module")
def ds(text, tmp_path_factory):
    "A prepared dataset with small shards, so windows cross shard boundaries."
    return prepare(text, tmp_path_factory.mktemp("ds") / "data", vocab_size=VOCAB, shard_tokens=1000, progress=False)


def stream_of(ds, split):
    m = load_manifest(ds)
    return np.concatenate([np.load(ds / s["file"]) for s in m["splits"][split]["shards"]])


def test_round_trip_text_tokens_text():
    docs = split_text(CORPUS.read_text()[:20_000])
    tok = train_tokenizer(docs, VOCAB)
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id(EOT) == 0
    for s in docs[:50] + ["Héllo,\r\n\twörld ☃ 𝄞", "tabs\tand  spaces  \n\n\n"]:
        assert tok.decode(tok.encode(s).ids) == s
    ids = tok.encode("a <|endoftext|> b").ids  # the literal string in text is not a document boundary
    assert 0 not in ids and tok.decode(ids) == "a <|endoftext|> b"


def test_a_byte_order_mark_is_not_text(tmp_path):
    from hymo.training.data import read_documents
    (tmp_path / "bom.txt").write_bytes("\ufeffFirst speech.\n\nSecond.\n".encode("utf-8"))
    (tmp_path / "bom.jsonl").write_bytes('\ufeff{"text": "one"}\n{"text": "two"}\n'.encode("utf-8"))
    assert list(read_documents(tmp_path / "bom.txt")) == ["First speech.\n", "Second.\n"]
    assert list(read_documents(tmp_path / "bom.jsonl")) == ["one", "two"]


def test_documents_of_plain_text():
    assert split_text("A:\nx\n\n \n\nB:\ny") == ["A:\nx\n", "B:\ny\n"]
    assert split_text("A\n\x0c\nB\n\u00a0\nC\n") == ["A\n", "B\n", "C\n"]  # a form feed or no-break space alone is blank
    assert split_text("A\n\nB\n", "file") == ["A\n\nB\n"]
    with pytest.raises(DataError, match="choose 'blank' or 'file'"): split_text("a", "lines")


def test_shards_and_manifest(ds, text):
    m = load_manifest(ds)
    docs = split_text(text.read_text())
    assert m["vocab_size"] == VOCAB and m["dtype"] == "uint16" and m["eot_id"] == 0 and m["inputs"] == ["play.txt"]
    assert m["tokenizer_sha256"] == hashlib.sha256((ds / "tokenizer.json").read_bytes()).hexdigest()
    tok = load_tokenizer(ds)
    decoded = []
    for split in ("train", "val"):
        info, s = m["splits"][split], stream_of(ds, split)
        assert len(info["shards"]) == -(-info["tokens"] // 1000) and all(x["tokens"] == 1000 for x in info["shards"][:-1])
        assert s.dtype == np.uint16 and len(s) == info["tokens"]
        assert int((s == 0).sum()) == info["documents"] and s[-1] == 0  # one EOT after every document
        decoded += [tok.decode(d.tolist()) for d in np.split(s, np.flatnonzero(s == 0) + 1)[:-1]]
    assert "".join(decoded) == "".join(docs)  # the split only cuts one document at a newline
    tr, va = m["splits"]["train"]["bytes"], m["splits"]["val"]["bytes"]
    assert abs(va / (tr + va) - 0.1) < 0.01 and decoded[m["splits"]["train"]["documents"] - 1].endswith("\n")
    assert token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32


def test_rerun_is_idempotent_and_deterministic(ds, text, tmp_path):
    before = {p.name: (p.stat().st_mtime_ns, D.sha256_file(p)) for p in ds.iterdir()}
    assert prepare(text, ds, vocab_size=VOCAB, shard_tokens=1000, progress=False) == ds
    assert {p.name: (p.stat().st_mtime_ns, D.sha256_file(p)) for p in ds.iterdir()} == before
    other = prepare(text, tmp_path / "again", vocab_size=VOCAB, shard_tokens=1000, progress=False)
    assert {p.name: D.sha256_file(p) for p in other.iterdir()} == {k: v[1] for k, v in before.items()}
    with pytest.raises(DataError, match="overwrite=True"): prepare(text, ds, vocab_size=VOCAB + 1, progress=False)
    assert not [p for p in ds.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_interrupted_prepare_leaves_nothing(text, tmp_path, monkeypatch):
    def boom(folder, *a, **k):
        np.save(folder / "train_0000.npy", np.zeros(3, np.uint16))
        raise KeyboardInterrupt
    monkeypatch.setattr(D, "_write_dataset", boom)
    with pytest.raises(KeyboardInterrupt): prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_ctrl_c_in_the_prepare_command_is_one_line(text, tmp_path, monkeypatch, capsys):
    "`python -m hymo.data prepare` cut short by Ctrl-C: exit status 130, one line on stderr, no traceback, no output folder."
    from hymo.data import main
    monkeypatch.setattr(D, "_write_dataset", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    out = tmp_path / "ds"
    assert main(["prepare", "--input", str(text), "--out", str(out), "--vocab-size", str(VOCAB), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted; ") and err.count("\n") == 1 and "the same command prepares it again" in err, err
    assert not out.exists()


def test_a_ctrl_c_as_the_old_dataset_is_deleted_says_the_new_one_is_installed(text, tmp_path, monkeypatch, capsys):
    "It said the folder was 'as it was' while it held the new dataset, and left the old one's remains unnamed."
    from hymo.data import main
    out = prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    real = D.shutil.rmtree
    monkeypatch.setattr(D.shutil, "rmtree", lambda p, *a, **k: (_ for _ in ()).throw(KeyboardInterrupt) if ".old-" in str(p)
                        else real(p, *a, **k))
    assert main(["prepare", "--input", str(text), "--out", str(out), "--vocab-size", str(VOCAB + 20), "--overwrite",
                 "--no-progress"]) == 130
    err = capsys.readouterr().err
    old = [p for p in tmp_path.iterdir() if ".old-" in p.name]
    assert load_manifest(out)["vocab_size"] == VOCAB + 20 and len(old) == 1
    assert "holds the new dataset (installed before the stop)" in err and f"is in {old[0]}: delete it" in err, err


def test_overwrite_replaces_dataset(text, tmp_path):
    out = prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    prepare(text, out, vocab_size=VOCAB + 20, overwrite=True, progress=False)
    assert load_manifest(out)["vocab_size"] == VOCAB + 20 and sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_resumption_gives_the_same_batches(ds):
    mk = lambda: TokenLoader(ds, seq_len=16, micro_batch_size=4, seed=7)
    full = mk()
    S = full.steps_per_epoch
    ref = [next(full) for _ in range(S + 3)]  # crosses an epoch boundary
    first = mk()
    for _ in range(S - 2): next(first)
    resumed = mk()
    resumed.load_state_dict(first.state_dict())
    for i in range(S - 2, S + 3):
        x, y = next(resumed)
        assert torch.equal(x, ref[i][0]) and torch.equal(y, ref[i][1])
    assert not torch.equal(TokenLoader(ds, seq_len=16, micro_batch_size=4, seed=8).batch(0)[0], ref[0][0])
    with pytest.raises(DataError, match="seq_len: saved 16, now 32"):
        TokenLoader(ds, seq_len=32, micro_batch_size=4, seed=7).load_state_dict(first.state_dict())


def test_windows_are_slices_of_the_stream(ds):
    s, T = stream_of(ds, "train"), 16
    loader = TokenLoader(ds, seq_len=T, micro_batch_size=4, seed=1)
    for step in (0, 5, loader.steps_per_epoch + 1):
        x, y = loader.batch(step)
        for row, k in enumerate(loader.window_ids(step)):
            assert np.array_equal(x[row].numpy(), s[k * T:k * T + T]) and np.array_equal(y[row].numpy(), s[k * T + 1:k * T + T + 1])
    assert loader.n_windows == (len(s) - 1) // T


def test_an_epoch_is_whole_optimiser_steps_the_same_windows_however_the_batch_is_split(ds):
    "With accumulation an epoch ends on an optimiser step, and 4 micro-batches of 1 read what 1 micro-batch of 4 reads."
    split = TokenLoader(ds, seq_len=16, micro_batch_size=1, accum=4, seed=3)
    whole = TokenLoader(ds, seq_len=16, micro_batch_size=4, accum=1, seed=3)
    assert split.steps_per_epoch % 4 == 0 and split.steps_per_epoch == 4 * whole.steps_per_epoch
    for step in (0, 1, whole.steps_per_epoch + 1):  # one optimiser step's windows, also in the next epoch
        assert np.array_equal(np.concatenate([split.window_ids(4 * step + i) for i in range(4)]), whole.window_ids(step))


def test_the_validation_cut_is_the_first_line_boundary_at_or_after_the_fraction():
    from hymo.training.data import split_train_val
    assert list(split_train_val(["aaaa\nbbbb\n"], 10, 0.5)) == [("train", "aaaa\n"), ("val", "bbbb\n")]
    assert list(split_train_val(["aa\n", "bb\n", "cc\n"], 9, 0.4)) == [("train", "aa\n"), ("train", "bb\n"), ("val", "cc\n")]


def test_ranks_are_disjoint_and_cover_an_epoch(ds):
    W, B, T = 3, 2, 16
    loaders = [TokenLoader(ds, seq_len=T, micro_batch_size=B, rank=r, world_size=W, seed=0) for r in range(W)]
    S, K = loaders[0].steps_per_epoch, loaders[0].n_windows
    seen = [np.concatenate([l.window_ids(t) for t in range(S)]) for l in loaders]
    allw = np.concatenate(seen)
    assert len(np.unique(allw)) == len(allw) == S * W * B and K - len(allw) < W * B
    for t in (0, S + 2):  # the batches too, not only the ids
        rows = torch.cat([l.batch(t)[0] for l in loaders])
        assert len({tuple(r.tolist()) for r in rows}) == W * B


def test_cu_seqlens_match_known_boundaries(tmp_path):
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    docs = [" ".join(rng.choice(words, rng.integers(1, 30))) + "\n" for _ in range(300)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ds = prepare(tmp_path / "docs.jsonl", tmp_path / "ds", vocab_size=VOCAB, val_fraction=0.0, progress=False)
    tok = load_tokenizer(ds)
    ends = np.cumsum([len(tok.encode(d).ids) + 1 for d in docs])  # EOT positions + 1 in the stream
    eot_pos = set((ends - 1).tolist())
    T, B = 24, 3
    loader = TokenLoader(ds, seq_len=T, micro_batch_size=B, seed=0, doc_masking=True)
    for step in range(5):
        x, y, cu = loader.batch(step)
        expect = [0]
        for row, k in enumerate(loader.window_ids(step)):
            if row: expect.append(row * T)
            expect += [row * T + p - k * T for p in range(k * T, k * T + T) if p in eot_pos and p != k * T]
        assert cu.dtype == torch.int32 and cu.tolist() == expect + [B * T]
    x = torch.tensor([[3, 0, 4], [0, 5, 0]])
    assert doc_cu_seqlens(x, 0).tolist() == [0, 1, 3, 5, 6]


def test_validation_iterator_is_fixed_and_sharded(ds):
    T, B = 16, 2
    a = TokenLoader(ds, "val", seq_len=T, micro_batch_size=B, rank=0, world_size=2)
    b = TokenLoader(ds, "val", seq_len=T, micro_batch_size=B, rank=1, world_size=2)
    first = [x for x, _ in a.eval_batches(3)]
    next(a); next(a)
    assert all(torch.equal(u, v) for u, v in zip(first, [x for x, _ in a.eval_batches(3)]))
    s = stream_of(ds, "val")
    x1 = next(iter(b.eval_batches(2)))[0]
    assert np.array_equal(first[0][0].numpy(), s[:T]) and np.array_equal(x1[0].numpy(), s[2 * T:3 * T])
    assert len(list(a.eval_batches())) == -(-(a.n_windows // B) // 2)  # every rank runs the same number of forwards


@pytest.mark.parametrize("world,n", [(2, 3), (3, 7), (4, 2), (2, None)])
def test_a_validation_pass_is_the_same_windows_on_any_number_of_ranks(ds, world, n):
    """The windows a pass counts, over all ranks, are the one-rank pass's (a validation loss must not move with the number
    of GPUs); every rank runs as many forwards as the others (FSDP), and the repeats that pad a rank are not counted."""
    T, B = 16, 2
    one = [x for x, _ in TokenLoader(ds, "val", seq_len=T, micro_batch_size=B).eval_batches(n)]
    ranks = [TokenLoader(ds, "val", seq_len=T, micro_batch_size=B, rank=r, world_size=world) for r in range(world)]
    counted = [x for L in ranks for (_, c), (x, _) in zip(L.eval_plan(n), L.eval_batches(n)) if c]
    key = lambda t: t.flatten().tolist()
    assert sorted(map(key, counted)) == sorted(map(key, one)) and len(counted) == len(one)
    assert len({len(L.eval_plan(n)) for L in ranks}) == 1


def test_jsonl_and_parquet_inputs(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = [f"Row {i} says {'hello ' * (i % 5)}there.\nSecond line {i}." for i in range(60)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(rows[:30]))
                                             + '{"text": null}\n{"text": "  "}\n')  # empty documents, skipped
    pq.write_table(pa.table({"text": rows[30:] + [None, ""], "n": list(range(32))}), tmp_path / "in" / "b.parquet")
    (tmp_path / "in" / "notes.csv").write_text("ignored in a folder\n")
    ds = prepare(tmp_path / "in", tmp_path / "ds", vocab_size=VOCAB, val_fraction=0.0, progress=False)
    m = load_manifest(ds)
    assert m["inputs"] == ["in/a.jsonl", "in/b.parquet"] and m["splits"]["train"]["documents"] == 60
    s, tok = stream_of(ds, "train"), load_tokenizer(ds)
    assert [tok.decode(d.tolist()) for d in np.split(s, np.flatnonzero(s == 0) + 1)[:-1]] == rows
    pq.write_table(pa.table({"url": ["http://a"], "n": [1]}), tmp_path / "one.parquet")  # its one string column is not the text
    with pytest.raises(DataError, match="no 'text' column"): prepare(tmp_path / "one.parquet", tmp_path / "x", progress=False)
    for bad in ('{"body": "no text"}', '{"text": 3}', '["text"]'):
        (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n' + bad + '\n')
        with pytest.raises(DataError, match=r"bad.jsonl:2 has no string field 'text'"): prepare(tmp_path / "bad.jsonl", tmp_path / "x", progress=False)


def test_given_tokenizer_is_used(ds, text, tmp_path):
    out = prepare(text, tmp_path / "ds", tokenizer=ds / "tokenizer.json", progress=False)
    assert load_manifest(out)["tokenizer_sha256"] == load_manifest(ds)["tokenizer_sha256"]
    assert np.array_equal(stream_of(out, "train"), stream_of(ds, "train"))
    with pytest.raises(DataError, match="drop --vocab-size"): prepare(text, tmp_path / "x", vocab_size=512, tokenizer=ds / "tokenizer.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(DataError, match=r"tokenizer .*bin.json is not text \(not UTF-8\)"): prepare(text, tmp_path / "x", tokenizer=tmp_path / "bin.json")
    from tokenizers import Tokenizer, models
    Tokenizer(models.BPE()).save(str(tmp_path / "no_eot.json"))
    with pytest.raises(DataError, match="has no <|endoftext|> token"): prepare(text, tmp_path / "y", tokenizer=tmp_path / "no_eot.json")


def test_a_given_tokenizer_that_would_cut_pad_or_mark_documents_is_made_plain(ds, text, tmp_path):
    """A published tokenizer.json may truncate, pad, or add special tokens around every text: applied to whole documents
    that silently dropped most tokens or filled the stream with padding. They are turned off (and said), and the
    dataset is the one the plain tokenizer makes; its tokenizer.json, which training and generation read, is plain too."""
    from tokenizers import Tokenizer, processors
    from hymo.training.data import DataWarning
    tok = Tokenizer.from_file(str(ds / "tokenizer.json"))
    tok.enable_truncation(8); tok.enable_padding(length=256, pad_id=0, pad_token="<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(tmp_path / "published.json"))
    with pytest.warns(DataWarning, match="truncation, padding, special tokens its post-processor adds .* turned off"):
        out = prepare(text, tmp_path / "ds", tokenizer=tmp_path / "published.json", progress=False)
    assert np.array_equal(stream_of(out, "train"), stream_of(ds, "train"))
    kept = Tokenizer.from_file(str(out / "tokenizer.json"))
    plain = Tokenizer.from_file(str(ds / "tokenizer.json"))
    assert kept.truncation is None and kept.padding is None and kept.encode("a b c d e f g h i").ids == plain.encode("a b c d e f g h i").ids


def test_a_validation_fraction_that_leaves_no_training_text_is_refused(tmp_path):
    (tmp_path / "tiny.txt").write_text("one line of text\n\nanother doc here\n")
    with pytest.raises(DataError, match="val_fraction=0.99 leaves no text for training"):
        prepare(tmp_path / "tiny.txt", tmp_path / "ds", val_fraction=0.99, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.txt"]


def test_input_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"): prepare(tmp_path / "missing.txt", tmp_path / "o")
    (tmp_path / "empty.txt").write_text("\n \n\n")
    with pytest.raises(DataError, match="the inputs are empty"): prepare(tmp_path / "empty.txt", tmp_path / "o")
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown file type '\.csv'"): prepare(tmp_path / "t.csv", tmp_path / "o")
    (tmp_path / "sub").mkdir()
    with pytest.raises(DataError, match="holds no"): prepare(tmp_path / "sub", tmp_path / "o")
    (tmp_path / "ok.txt").write_text("hello\n")
    (tmp_path / "busy").mkdir(); (tmp_path / "busy" / "mine.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a HyMo dataset"): prepare(tmp_path / "ok.txt", tmp_path / "busy")
    with pytest.raises(DataError, match="at least 257"): prepare(tmp_path / "ok.txt", tmp_path / "o", vocab_size=100, progress=False)
    assert not (tmp_path / "o").exists()
    with pytest.raises(DataError, match="is a file"): prepare(tmp_path / "ok.txt", tmp_path / "ok.txt")
    (tmp_path / "tok.json").write_text("{")
    with pytest.raises(DataError, match="is not a Hugging Face tokenizer.json"):
        prepare(tmp_path / "ok.txt", tmp_path / "o", tokenizer=tmp_path / "tok.json")
    assert not (tmp_path / "o").exists() and (tmp_path / "ok.txt").read_text() == "hello\n"
    # the same file twice (here once directly, once in its folder) would be trained on twice: refused
    with pytest.raises(DataError, match="is given twice"): prepare([tmp_path / "ok.txt", tmp_path / "ok.txt"], tmp_path / "o")
    (tmp_path / "docs").mkdir(); (tmp_path / "docs" / "a.txt").write_text("one\n")
    with pytest.raises(DataError, match=r"given twice \(as docs/a.txt and as a.txt\)"):
        prepare([tmp_path / "docs", tmp_path / "docs" / "a.txt"], tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_dataset_errors(ds, text, tmp_path):
    assert check_compatible(ds, VOCAB)["vocab_size"] == VOCAB and check_compatible(ds, 4 * VOCAB)
    with pytest.raises(DataError, match=f"set model.vocab_size >= {VOCAB}"): check_compatible(ds, 256)
    with pytest.raises(DataError, match="use a shorter seq_len"): TokenLoader(ds, "val", seq_len=10**6, micro_batch_size=1)
    with pytest.raises(DataError, match="python -m hymo.data prepare"): TokenLoader(tmp_path, "train")
    (tmp_path / "texts").mkdir(); (tmp_path / "texts" / "a.txt").write_text("some text\n")  # texts, not yet prepared
    with pytest.raises(DataError, match=f"--input {tmp_path / 'texts'} --out {tmp_path / 'texts_prepared'}`, then give"):
        TokenLoader(tmp_path / "texts", "train")
    bad = prepare(text, tmp_path / "bad", vocab_size=VOCAB, progress=False)
    (bad / "tokenizer.json").write_text((bad / "tokenizer.json").read_text().replace('"Ġthe"', '"Ġteh"'))
    with pytest.raises(DataError, match="not the tokenizer the shards were encoded with"): check_compatible(bad, VOCAB)
    (bad / "tokenizer.json").write_bytes(b"\x8b\x1f" + (bad / "tokenizer.json").read_bytes()[2:])  # damaged: not UTF-8
    with pytest.raises(DataError, match="not the tokenizer the shards were encoded with"): check_compatible(bad, VOCAB)
    bad2 = prepare(text, tmp_path / "bad2", vocab_size=VOCAB, progress=False)
    np.save(bad2 / "val_0000.npy", np.load(bad2 / "val_0000.npy")[:-5])
    with pytest.raises(DataError, match="damaged"): check_compatible(bad2, VOCAB)
    for size in (5000, 100):  # a shard cut short: shorter than its header says, or inside the header (a traceback before)
        bad3 = prepare(text, tmp_path / f"bad3_{size}", vocab_size=VOCAB, shard_tokens=10**6, progress=False)
        os.truncate(bad3 / "train_0000.npy", size)
        with pytest.raises(DataError, match="train_0000.npy cannot be read .*prepare it again"): check_compatible(bad3, VOCAB)
    (bad2 / "manifest.json").write_text('{"format": ')  # cut short
    with pytest.raises(DataError, match="manifest.json is damaged"): check_compatible(bad2, VOCAB)


def test_prepare_default_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HYMO_CACHE", str(tmp_path))
    out = prepare_default(vocab_size=VOCAB, progress=False)
    assert out == tmp_path / "data" / f"tinyshakespeare-bpe{VOCAB}"
    m = check_compatible(out, VOCAB)
    assert m["inputs"] == ["tinyshakespeare.txt"] and m["splits"]["val"]["tokens"] > 0
    t = (out / "manifest.json").stat().st_mtime_ns
    assert prepare_default(vocab_size=VOCAB, progress=False) == out and (out / "manifest.json").stat().st_mtime_ns == t


def test_cli(ds, text, tmp_path, capsys):
    from hymo.data import main
    run = lambda *a: subprocess.run([sys.executable, "-m", "hymo.data", *a], capture_output=True, text=True)
    r = run("prepare", "--input", str(text), "--out", str(tmp_path / "cli"), "--vocab-size", str(VOCAB),
            "--shard-tokens", "1000", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert load_manifest(tmp_path / "cli") == load_manifest(ds)  # another process: the same dataset
    assert main(["info", str(tmp_path / "cli")]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["vocab_size"] == VOCAB and "intact" in got.err
    assert main(["info", str(tmp_path)]) == 1 and "not a prepared dataset" in capsys.readouterr().err
    import shutil
    shutil.copytree(tmp_path / "cli", tmp_path / "cli2"); (tmp_path / "cli2" / "train_0001.npy").unlink()
    assert main(["info", str(tmp_path / "cli2")]) == 1  # damaged: the manifest printed, then what training would say
    got = capsys.readouterr()
    assert json.loads(got.out)["vocab_size"] == VOCAB and "train_0001.npy is missing" in got.err
    shutil.copytree(tmp_path / "cli", tmp_path / "cli3")  # another tokenizer beside the shards: info said "intact"
    tj = tmp_path / "cli3" / "tokenizer.json"; tj.write_text(tj.read_text().replace('"Ġthe"', '"Ġteh"', 1))
    assert main(["info", str(tmp_path / "cli3")]) == 1 and "is not the tokenizer the shards were encoded with" in capsys.readouterr().err
    r = run("prepare", "--input", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "x"))
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    closed = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from hymo.data import main; "
              f"sys.exit(main(['info', {str(tmp_path / 'cli')!r}]))")  # `... info DIR | head`, the reader gone before
    r = subprocess.run([sys.executable, "-c", closed], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr  # no BrokenPipeError traceback


def test_concurrent_prepares_agree(text, tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda _: prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False), range(3)))
    assert outs == [tmp_path / "ds"] * 3 and sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    check_compatible(tmp_path / "ds", VOCAB)


def test_an_install_whose_rename_meets_another_installs_swap_retries(text, tmp_path, monkeypatch):
    """Three prepares of one dataset at once: B's rename onto `out` fails (C has just installed its copy there), and
    before B looks, D moves C's copy aside to put its own in. B then saw no dataset and raised ENOTEMPTY; now it tries
    the rename again."""
    import shutil
    from pathlib import Path
    src = prepare(text, tmp_path / "src", vocab_size=VOCAB, progress=False)
    out, tmp = tmp_path / "ds", tmp_path / ".ds.tmp-B"
    shutil.copytree(src, tmp)
    real, fp, raced = os.replace, load_manifest(src)["fingerprint"], []
    def swap(a, b):
        if Path(a) == tmp and not raced:
            raced.append(1)
            shutil.copytree(src, out)  # C installs
            try: return real(a, b)  # ENOTEMPTY
            finally: real(out, tmp_path / ".ds.old-D")  # D moves C's copy aside
        return real(a, b)
    monkeypatch.setattr(D.os, "replace", swap)
    D._install(tmp, out, fp)
    assert raced and not tmp.exists() and load_manifest(out)["fingerprint"] == fp


def test_an_install_that_reads_a_dataset_another_prepare_moves_aside_goes_on(text, tmp_path, monkeypatch):
    """Another prepare of the same dataset moves --out aside (to put its copy in) just as this one reads the manifest
    there: the read's FileNotFoundError ended this prepare, its work deleted; a folder listed as it goes, the same."""
    import shutil
    src = prepare(text, tmp_path / "src", vocab_size=VOCAB, progress=False)
    fp, out, tmp = load_manifest(src)["fingerprint"], tmp_path / "ds", tmp_path / ".ds.tmp-B"
    shutil.copytree(src, out); (out / "tokenizer.json").write_text("damaged")  # this dataset, damaged: prepared again
    shutil.copytree(src, tmp)
    real, moved = Path.read_text, []
    def read_text(self, *a, **k):
        if self == out / "manifest.json" and not moved:
            moved.append(1); os.replace(out, tmp_path / ".ds.old-C")  # C moves the damaged copy aside ...
            try: return real(self, *a, **k)
            finally: shutil.copytree(src, out)  # ... and installs its own
        return real(self, *a, **k)
    monkeypatch.setattr(Path, "read_text", read_text)
    D._install(tmp, out, fp)
    assert moved and not tmp.exists() and D._same_dataset(out, fp)
    real_iterdir = Path.iterdir
    def gone_as_listed(self):  # the listing of a folder moved aside as it is read
        if self == out: raise FileNotFoundError(2, "No such file or directory", str(out))
        return real_iterdir(self)
    monkeypatch.setattr(Path, "iterdir", gone_as_listed)
    assert not D._filled(out) and D._not_written_by_prepare(out) == []
    monkeypatch.setattr(Path, "iterdir", lambda self: iter([*real_iterdir(self), self / "train_0999.npy"]) if self == out
                        else real_iterdir(self))  # a shard's name gone as it is looked at is no one's file
    assert D._not_written_by_prepare(out) == []


def test_an_install_whose_rename_meets_another_dataset_keeps_its_own_beside(text, tmp_path, monkeypatch):
    """Another prepare installs a dataset of other inputs in the moment between this one moving --out's old dataset
    aside and renaming its own in: the rename failed (ENOTEMPTY), and the finished dataset was deleted with a traceback.
    Theirs stays; this one is kept beside it, as when theirs arrives earlier, and the one it moved aside (perhaps a third
    prepare's, just installed) under the next number: nothing is deleted, nor renamed back over the newcomer.
    A copy of this very dataset arriving there instead is kept, and this one's work folder removed."""
    import shutil
    src = prepare(text, tmp_path / "src", vocab_size=VOCAB, progress=False)
    other = prepare(text, tmp_path / "other", vocab_size=VOCAB + 8, progress=False)
    fp, out, tmp = load_manifest(src)["fingerprint"], tmp_path / "ds", tmp_path / ".ds.tmp-B"
    prepare(text, out, vocab_size=VOCAB + 16, progress=False)  # the old dataset, replaced with --overwrite
    shutil.copytree(src, tmp)
    real, raced = os.replace, []
    def swap(a, b):
        if Path(a) == tmp and Path(b) == out and not raced: raced.append(1); shutil.copytree(arrives, out)
        return real(a, b)
    monkeypatch.setattr(D.os, "replace", swap)
    arrives = other
    with pytest.raises(DataError, match=rf"ds now holds a dataset from other inputs or options, which another prepare "
                                        rf"installed while this prepare ran; .* kept at {out}-2: .*The dataset {out} held "
                                        rf"when this prepare moved it aside is at {out}-3, as it was$"):
        D._install(tmp, out, fp, overwrite=True, found=load_manifest(out)["fingerprint"])  # what --overwrite replaces
    assert raced and load_manifest(out)["vocab_size"] == VOCAB + 8 and D._same_dataset(tmp_path / "ds-2", fp)
    assert load_manifest(tmp_path / "ds-3")["vocab_size"] == VOCAB + 16 and check_compatible(tmp_path / "ds-3", VOCAB + 16)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work folder, nothing hidden
    shutil.rmtree(out); shutil.copytree(src, tmp); raced.clear()
    arrives = src  # an identical dataset arrives first: kept, nothing beside it
    D._install(tmp, out, fp)
    assert raced and D._same_dataset(out, fp) and not tmp.exists() and not (tmp_path / "ds-4").exists()


def test_an_install_whose_look_at_what_arrived_meets_a_swap_looks_again(text, tmp_path, monkeypatch):
    """The manifest of what arrived in --out is read as another prepare moves it aside: with this same dataset put in
    meanwhile, it is this one's, kept (it was kept beside as 'a manifest that cannot be read'); with nothing put in, this
    one installs; a manifest that cannot be read at all (another user's, EACCES) keeps the work beside (it was deleted)."""
    import shutil
    src = prepare(text, tmp_path / "src", vocab_size=VOCAB, progress=False)
    fp, out, tmp = load_manifest(src)["fingerprint"], tmp_path / "ds", tmp_path / ".ds.tmp-B"
    real_read, real_names, armed = Path.read_text, D._not_written_by_prepare, []
    monkeypatch.setattr(D, "_not_written_by_prepare", lambda o: (armed.append(1), real_names(o))[1])  # just before
    def swapped(refill):
        def read_text(self, *a, **k):
            if self == out / "manifest.json" and armed == [1]:
                armed.append(2); os.replace(out, tmp_path / f".ds.old-C{len(list(tmp_path.iterdir()))}")
                try: return real_read(self, *a, **k)
                finally:
                    if refill: shutil.copytree(src, out)
            return real_read(self, *a, **k)
        return read_text
    for refill in (True, False):
        shutil.copytree(src, out); (out / "tokenizer.json").write_text("damaged")
        shutil.copytree(src, tmp); armed.clear()
        monkeypatch.setattr(Path, "read_text", swapped(refill))
        D._install(tmp, out, fp)
        assert armed == [1, 2] and not tmp.exists() and D._same_dataset(out, fp) and not (tmp_path / "ds-2").exists()
        monkeypatch.setattr(Path, "read_text", real_read)
        shutil.rmtree(out)
    prepare(text, out, vocab_size=VOCAB + 8, progress=False)
    shutil.copytree(src, tmp)
    def denied(self, *a, **k):
        if self == out / "manifest.json": raise PermissionError(13, "Permission denied", str(self))
        return real_read(self, *a, **k)
    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(DataError, match=rf"a dataset whose manifest cannot be read, .* kept at {out}-2"): D._install(tmp, out, fp)
    monkeypatch.setattr(Path, "read_text", real_read)
    assert D._same_dataset(tmp_path / "ds-2", fp) and load_manifest(out)["vocab_size"] == VOCAB + 8


def test_a_live_prepare_of_another_user_is_left_alone(tmp_path, monkeypatch):
    "A work folder whose process cannot be signalled (another user's: EPERM) is a running prepare's: warned of, not deleted."
    out, work = tmp_path / "ds", tmp_path / f".ds.tmp-{D._HOST}-{os.getpid() + 1}-deadbeef"
    work.mkdir()
    def kill(pid, sig): raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(D.os, "kill", kill)
    with pytest.warns(D.DataWarning, match="left by another prepare"): D._clean_left_behind(out)
    assert work.exists()


def test_ids_above_65535_are_stored_as_uint32(tmp_path):
    "A vocabulary of more than 65 536 tokens: ids cast to uint16 would wrap, the batches wrong without an error."
    import warnings
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({EOT: 0, **{f"w{i}": i for i in range(1, 70_000)}}, unk_token=EOT))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOT]); tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("w69999 w1\n\n" * 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = prepare(tmp_path / "a.txt", tmp_path / "ds", tokenizer=tmp_path / "tok.json", val_fraction=0, progress=False)
    m = load_manifest(out)
    a = np.load(out / m["splits"]["train"]["shards"][0]["file"])
    assert m["dtype"] == "uint32" and a.dtype == np.uint32 and 69999 in a and 1 in a


def test_prepare_refuses_a_folder_named_like_a_shard_and_a_bad_fraction_before_reading(text, tmp_path, monkeypatch):
    "Someone's folder `val_9999.npy/` is no shard of prepare's (--overwrite would delete it); val_fraction=1 is refused first."
    out = prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    (out / "val_9999.npy").mkdir(); (out / "val_9999.npy" / "mine.txt").write_text("x")
    with pytest.raises(DataError, match=r"prepare did not write \(val_9999.npy/\)"):
        prepare(text, out, vocab_size=VOCAB + 8, overwrite=True, progress=False)
    assert (out / "val_9999.npy" / "mine.txt").read_text() == "x"
    monkeypatch.setattr(D, "find_files", lambda *a, **k: pytest.fail("the inputs were read"))
    with pytest.raises(DataError, match=r"val_fraction=1 must be in \[0, 1\)"): prepare(text, tmp_path / "o", val_fraction=1)


def test_an_overwrite_replaces_only_the_dataset_it_found(text, tmp_path, monkeypatch):
    """Two `prepare --overwrite` of other options into one --out that held a dataset: the later to finish replaced the
    dataset the other had just installed (not the one it was asked to replace), and both said done."""
    out = prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    real, others = D._write_dataset, []
    def meanwhile(*a, **k):
        real(*a, **k)
        if not others: others.append(1); prepare(text, out, vocab_size=VOCAB + 8, overwrite=True, progress=False)  # first
    monkeypatch.setattr(D, "_write_dataset", meanwhile)
    with pytest.raises(DataError, match="now holds a dataset from other inputs or options, which another prepare installed "
                                        rf"while this prepare ran; it is left as it is. This prepare's dataset is kept at {out}-2"):
        prepare(text, out, vocab_size=VOCAB + 16, overwrite=True, progress=False)
    assert load_manifest(out)["vocab_size"] == VOCAB + 8 and load_manifest(tmp_path / "ds-2")["vocab_size"] == VOCAB + 16
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work folder or old dataset left behind


def test_a_dataset_another_prepare_installs_meanwhile_is_kept(text, tmp_path, monkeypatch):
    "Two prepares of other inputs into one new --out: the later to finish replaced the other's dataset, and both said done."
    out, real, others = tmp_path / "ds", D._write_dataset, []
    def meanwhile(*a, **k):
        real(*a, **k)
        if not others: others.append(1); prepare(text, out, vocab_size=VOCAB + 8, progress=False)  # it finishes first
    monkeypatch.setattr(D, "_write_dataset", meanwhile)
    with pytest.raises(DataError, match="now holds a dataset from other inputs or options, which another prepare installed "
                                        rf"while this prepare ran; it is left as it is. This prepare's dataset is kept at {out}-2"):
        prepare(text, out, vocab_size=VOCAB, progress=False)
    assert load_manifest(out)["vocab_size"] == VOCAB + 8 and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert check_compatible(tmp_path / "ds-2", VOCAB) and load_manifest(tmp_path / "ds-2")["vocab_size"] == VOCAB  # whole
    assert load_manifest(prepare(text, out, vocab_size=VOCAB, overwrite=True, progress=False))["vocab_size"] == VOCAB
    others.clear()
    def notes(*a, **k):  # someone's file, then Finder's, in the new --out while the work runs
        real(*a, **k)
        (tmp_path / "new").mkdir(exist_ok=True); (tmp_path / "new" / ".DS_Store").write_bytes(b"\0")
        if not others: others.append(1); (tmp_path / "new" / "NOTES.md").write_text("mine\n")
    monkeypatch.setattr(D, "_write_dataset", notes)
    with pytest.raises(DataError, match=rf"new now holds NOTES.md, which no prepare wrote, while .* kept at {tmp_path / 'new-2'}"):
        prepare(text, tmp_path / "new", vocab_size=VOCAB, progress=False)
    (tmp_path / "new" / "NOTES.md").unlink()  # Finder's alone is nobody's: installed over
    assert load_manifest(prepare(text, tmp_path / "new", vocab_size=VOCAB, progress=False))["vocab_size"] == VOCAB
    def notes_again(*a, **k):  # with --overwrite too: the dataset it found goes, what arrived since is someone's
        real(*a, **k)
        (out / "NOTES.md").write_text("mine\n")
    monkeypatch.setattr(D, "_write_dataset", notes_again)
    with pytest.raises(DataError, match=rf"ds now holds NOTES.md, which no prepare wrote, while .* kept at {out}-3"):
        prepare(text, out, vocab_size=VOCAB + 16, overwrite=True, progress=False)
    assert (out / "NOTES.md").read_text() == "mine\n" and load_manifest(tmp_path / "ds-3")["vocab_size"] == VOCAB + 16


def test_utf16_text_is_refused_with_a_line_that_converts_it(tmp_path):
    "Every other byte NUL, and valid UTF-8 all the same: it was tokenized as 'F\\x00i\\x00r\\x00s\\x00t...'."
    import subprocess
    text = "First Citizen:\nBefore we proceed.\n"
    for enc, at in (("le", 1), ("be", 0)):
        (tmp_path / "u16.txt").write_bytes(text.encode(f"utf-16-{enc}"))
        with pytest.raises(DataError, match=rf"u16.txt holds 34 NUL characters \(the first at character {at}\).*convert it: "
                                            rf"iconv -f UTF-16{enc.upper()} -t UTF-8 < \S*u16.txt > \S*u16.txt.new && mv ") as e:
            prepare(tmp_path / "u16.txt", tmp_path / "o", vocab_size=VOCAB, progress=False)
        assert not (tmp_path / "o").exists()
        fix = str(e.value).split("convert it: ")[1].split("; if it is not text")[0]
        subprocess.run(fix, shell=True, check=True)  # the line given works as pasted
        assert (tmp_path / "u16.txt").read_text() == text
    for enc in ("utf-16", "utf-16-be"):  # with its byte-order mark (this machine's order, then big-endian): not UTF-8
        (tmp_path / "bom.txt").write_bytes(("\ufeff" * (enc != "utf-16") + text).encode(enc))
        with pytest.raises(DataError, match=r"bom.txt is UTF-16 text .*: convert it: iconv -f UTF-16 -t UTF-8 < ") as e:
            prepare(tmp_path / "bom.txt", tmp_path / "o", vocab_size=VOCAB, progress=False)
        subprocess.run(str(e.value).split("convert it: ")[1], shell=True, check=True)
    assert (tmp_path / "bom.txt").read_text() == text
    (tmp_path / "u16.txt").rename(tmp_path / "u 16's.txt")  # a name the shell must have quoted
    (tmp_path / "u 16's.txt").write_bytes(text.encode("utf-16-le"))
    with pytest.raises(DataError, match="convert it") as e: prepare(tmp_path / "u 16's.txt", tmp_path / "o", vocab_size=VOCAB, progress=False)
    subprocess.run(str(e.value).split("convert it: ")[1].split("; if it is not text")[0], shell=True, check=True)
    assert (tmp_path / "u 16's.txt").read_text() == text
    (tmp_path / "u16.txt").write_text("First\x00 Citizen:\n" * 20)  # a few stray NULs: drop them
    with pytest.raises(DataError, match=r"holds 20 NUL characters \(the first at character 5\).*drop them: tr -d") as e:
        prepare(tmp_path / "u16.txt", tmp_path / "o", vocab_size=VOCAB, progress=False)
    subprocess.run(str(e.value).split("drop them: ")[1].split("; if it is not text")[0], shell=True, check=True)
    assert (tmp_path / "u16.txt").read_text() == "First Citizen:\n" * 20


def test_the_prepare_command_says_a_skipped_file_before_the_long_work(text, tmp_path, monkeypatch, capsys):
    "Its warnings came after all the tokenizing (caught, then printed at the end): hours late on a large corpus."
    import shutil
    from hymo.data import main
    (tmp_path / "in").mkdir()
    shutil.copy(text, tmp_path / "in" / "play.txt"); (tmp_path / "in" / "extra.txt.gz").write_bytes(b"\x1f\x8b")
    real, seen = D._write_dataset, []
    def writing(*a, **k):
        seen.append(capsys.readouterr().err)
        return real(*a, **k)
    monkeypatch.setattr(D, "_write_dataset", writing)
    args = ["prepare", "--input", str(tmp_path / "in"), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB), "--no-progress"]
    assert main(args) == 0
    assert seen[0].startswith("warning: folder ") and "skipped 1 file of other types (.gz 1)" in seen[0], seen
    again = [a if a != str(tmp_path / "ds") else str(tmp_path / "ds2") for a in args]
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "hymo.data", *again],
                       capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0 and "skipped 1 file of other types (.gz 1)" in r.stderr, r.stderr  # not silenced by -W ignore


def test_a_dataset_inside_its_input_folder_is_not_counted_as_skipped(text, tmp_path):
    "--out inside --input: the next run warned of 'skipped files of other types', the dataset's own .npy and .json."
    import shutil, warnings
    (tmp_path / "in").mkdir(); shutil.copy(text, tmp_path / "in" / "play.txt")
    first = prepare(tmp_path / "in", tmp_path / "in" / "ds", vocab_size=VOCAB, progress=False)
    def skipped(out):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            prepare(tmp_path / "in", out, vocab_size=VOCAB, progress=False)
        return [str(w.message) for w in said if issubclass(w.category, D.DataWarning)]
    assert skipped(first) == []  # the same dataset again: nothing to say
    (first / "extra.txt").write_text("More text.\n")  # but a text put into the dataset folder is an input like any other
    with pytest.raises(DataError, match=r"extra.txt added.*pass --overwrite"): prepare(tmp_path / "in", first, vocab_size=VOCAB, progress=False)
    (first / "extra.txt").unlink()
    (tmp_path / "in" / "notes.rst").write_text("x")
    said = skipped(tmp_path / "other")  # another --out: in/ds is then a folder of other files, and counted
    assert len(said) == 1 and ".json 2" in said[0] and ".rst 1" in said[0], said


def test_unreadable_inputs_are_data_errors(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl is not UTF-8 text \(line 1, byte 13: .*\): convert it \(iconv -f ENCODING "
                                        r"-t UTF-8 < \S*latin1.jsonl > \S*latin1.jsonl.new && mv \S*latin1.jsonl.new \S*latin1.jsonl, "):
        prepare(tmp_path / "latin1.jsonl", tmp_path / "o")
    (tmp_path / "notes.parquet").write_text("not a parquet file\n")
    with pytest.raises(DataError, match=r"notes.parquet cannot be read as Parquet \(.*magic bytes"): prepare(tmp_path / "notes.parquet", tmp_path / "o")
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(500)]}), tmp_path / "good.parquet")
    raw = bytearray((tmp_path / "good.parquet").read_bytes())
    footer = int.from_bytes(raw[-8:-4], "little")
    raw[4:len(raw) - 8 - footer] = bytes(len(raw) - 12 - footer)  # the pages zeroed, the footer intact: a bare OSError
    (tmp_path / "pages.parquet").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"pages.parquet cannot be read as Parquet"): prepare(tmp_path / "pages.parquet", tmp_path / "o")
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "good.parquet").read_bytes()[:100])
    with pytest.raises(DataError, match=r"cut.parquet cannot be read as Parquet"): prepare(tmp_path / "cut.parquet", tmp_path / "o")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match=r"column 'text' holds int values, not text"): prepare(tmp_path / "ints.parquet", tmp_path / "o")
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nor a temporary folder


def test_options_are_checked_before_any_input_is_read(ds, text, tmp_path, monkeypatch):
    read = []
    monkeypatch.setattr(D, "sha256_file", lambda p: read.append(p))
    monkeypatch.setattr(D, "read_documents", lambda p, *a: read.append(p))
    for kw, msg in [(dict(val_fraction=1.5), r"val_fraction=1.5 must be in \[0, 1\)"), (dict(vocab_size=0), "vocab_size=0 must be at least 257"),
                    (dict(vocab_size=-5), "at least 257"), (dict(vocab_size=2**33), r"is above 2\*\*24"),
                    (dict(shard_tokens=0), "shard_tokens=0 must be positive")]:
        with pytest.raises(DataError, match=msg): prepare(text, tmp_path / "o", progress=False, **kw)
        with pytest.raises(DataError, match=msg): prepare(text, ds, progress=False, **kw)  # not "holds a dataset prepared from other inputs"
    assert read == [] and not (tmp_path / "o").exists()


def test_out_that_cannot_be_written(text, tmp_path, monkeypatch, capsys):
    from hymo.data import main
    read, real = [], D.read_documents
    def reading(p, *a):
        read.append(p); yield from real(p, *a)
    monkeypatch.setattr(D, "read_documents", reading)
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile" / "ds", tmp_path / "afile" / "a" / "ds"):  # EEXIST and ENOTDIR from mkdir
        with pytest.raises(OSError): prepare(text, out, vocab_size=VOCAB, progress=False)  # the trainer reports the OSError itself
        assert main(["prepare", "--input", str(text), "--out", str(out), "--vocab-size", str(VOCAB), "--no-progress"]) == 1
        assert capsys.readouterr().err == f"error: cannot write {out}: {tmp_path / 'afile'} is a file, not a folder: choose another --out\n"
    assert read == []  # refused before reading the inputs
    if os.path.isdir("/proc/self"):
        assert main(["prepare", "--input", str(text), "--out", "/proc/hymo-ds", "--no-progress"]) == 1
        assert capsys.readouterr().err == "error: cannot write /proc/hymo-ds: No such file or directory: choose another --out\n"

    def full(self, n): raise OSError(28, "No space left on device")  # a write() that fails names no file
    monkeypatch.setattr(D._ShardWriter, "_flush", full)
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB), "--no-progress"]) == 1
    assert capsys.readouterr().err.endswith("No space left on device: free space or choose another --out\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # the temporary folder is gone

    def other(self, n): raise OSError(5, "Input/output error", str(text))  # an input's error is not --out's: a traceback
    monkeypatch.setattr(D._ShardWriter, "_flush", other)
    with pytest.raises(OSError, match="Input/output error"):
        main(["prepare", "--input", str(text), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB), "--no-progress"])


def test_out_may_not_be_the_current_folder_or_hold_it(text, tmp_path, monkeypatch):
    "Installing renames a new folder into place: the shell would be left in the deleted one. Refused before any work."
    (tmp_path / "here" / "deeper").mkdir(parents=True)
    for cwd, out in ((tmp_path / "here" / "deeper", "."), (tmp_path / "here" / "deeper", str(tmp_path / "here" / "deeper"))):
        monkeypatch.chdir(cwd)
        with pytest.raises(DataError, match=r"is the current folder.*Give another folder"): prepare(text, out, vocab_size=VOCAB, progress=False)
        assert os.path.samefile(os.getcwd(), cwd)
    with pytest.raises(DataError, match=r"exists and is not a HyMo dataset"): prepare(text, "..", vocab_size=VOCAB, progress=False)
    assert (tmp_path / "here" / "deeper").is_dir()
    monkeypatch.chdir(tmp_path / "here" / "deeper")
    assert prepare(text, "../ds", vocab_size=VOCAB, progress=False) == tmp_path / "here" / "ds"  # beside it: fine
    assert load_manifest(tmp_path / "here" / "ds")["vocab_size"] == VOCAB
    monkeypatch.chdir(tmp_path / "here" / "ds")  # inside an intact dataset, the same command replaces nothing: allowed
    assert prepare(text, ".", vocab_size=VOCAB, progress=False) == tmp_path / "here" / "ds"
    with pytest.raises(DataError, match="is the current folder"): prepare(text, ".", vocab_size=VOCAB + 1, overwrite=True, progress=False)
    (tmp_path / "gone").mkdir(); monkeypatch.chdir(tmp_path / "gone"); (tmp_path / "gone").rmdir()
    with pytest.raises(DataError, match="current folder was deleted.*absolute"): prepare(text, "ds", vocab_size=VOCAB, progress=False)
    with pytest.raises(DataError, match="current folder was deleted"): load_manifest("ds")


def test_out_through_a_link_replaces_the_folder_it_names_and_a_mount_point_is_refused(text, tmp_path, monkeypatch):
    real = tmp_path / "disk" / "ds"; real.mkdir(parents=True)
    link = tmp_path / "ds"; link.symlink_to(real)
    assert prepare(text, link, vocab_size=VOCAB, progress=False) == real
    prepare(text, link, vocab_size=VOCAB + 10, overwrite=True, progress=False)  # the swap happens beside `real`
    assert link.is_symlink() and link.resolve() == real and load_manifest(link)["vocab_size"] == VOCAB + 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "ds"]
    old = real.parent / ".ds.old-1234"; real.rename(old)  # stopped between the swap's renames: the link names nothing
    with pytest.raises(DataError, match=r"does not exist, but .*\.ds\.old-1234 holds the dataset"): load_manifest(link)
    old.rename(real)
    assert [p.name for p in real.parent.iterdir()] == ["ds"]  # no temporary or old folder left on either side
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(DataError, match="a link that leads to itself"): prepare(text, tmp_path / "loop", vocab_size=VOCAB, progress=False)
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == os.fspath(tmp_path / "vol"))
    with pytest.raises(DataError, match=r"is a mount point.*--out .*vol/data"):
        prepare(text, tmp_path / "vol", vocab_size=VOCAB, progress=False)


def test_an_option_given_twice_is_refused_and_inputs_are_collected(text, tmp_path, capsys):
    from hymo.data import main
    other = tmp_path / "other.txt"; other.write_text("Another speech.\n\nAnd one more.\n")
    assert main(["prepare", "--input", str(text), "--input", str(other), "--out", str(tmp_path / "ds"),
                 "--vocab-size", str(VOCAB), "--no-progress"]) == 0
    assert load_manifest(tmp_path / "ds")["inputs"] == ["play.txt", "other.txt"]
    for twice in (["--out", "a", "--out", "b"], ["--out", "a", "--vocab-size", "300", "--vocab-size", "400"],
                  ["--out", "a", "--doc-split", "file", "--doc-split", "blank"], ["--out", "a", "--val-fraction", ".1", "--val-fraction", ".2"]):
        with pytest.raises(SystemExit) as e: main(["prepare", "--input", str(text), *twice])
        assert e.value.code == 2 and f"{twice[-2]} is given twice" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_not_a_dataset_folder_named_dot_or_a_manifest(tmp_path, monkeypatch, ds):
    (tmp_path / "texts").mkdir(); (tmp_path / "texts" / "a.txt").write_text("A speech.\n")
    monkeypatch.chdir(tmp_path / "texts")
    with pytest.raises(DataError, match=r"\. is not a prepared dataset .*--input \. --out .*texts_prepared"): load_manifest(".")
    with pytest.raises(DataError, match=r"/ is not a prepared dataset"): load_manifest("/")
    with pytest.raises(DataError, match=f"give its folder, {ds}$"): load_manifest(ds / "manifest.json")
    with pytest.raises(DataError, match=f"give its folder, {ds}$"): load_manifest(ds / "tokenizer.json")
    monkeypatch.chdir(tmp_path / "texts")
    with pytest.raises(DataError, match=f"--input \\.\\. --out {tmp_path}_prepared`"): load_manifest("..")
    (tmp_path / "empty").mkdir(); monkeypatch.chdir(tmp_path / "empty")  # `prepare --out .` is refused: suggest a folder
    with pytest.raises(DataError, match=r"--input TEXT\.\.\. --out data/mine`, then give data_dir=data/mine"): load_manifest(".")
    with pytest.raises(DataError, match=r"vocab_size=200: .*at least 257"): check_compatible(ds, 200)
    with pytest.raises(DataError, match=r"vocab_size=299: .*with --vocab-size 299$"): check_compatible(ds, 299)


def test_a_short_write_of_a_shard_on_a_full_disk_is_said_to_be_one(text, tmp_path, monkeypatch, capsys):
    "numpy reports a short write without an errno ('N requested and M written'): on a full disk it is ENOSPC, --out's error."
    import shutil
    from hymo.data import main
    def short(f, a): raise OSError(f"{a.nbytes} requested and 4096 written")
    monkeypatch.setattr(D.np, "save", short)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(D.shutil, "disk_usage", lambda p: usage._replace(free=100))
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB), "--no-progress"]) == 1
    assert "No space left on device" in (err := capsys.readouterr().err) and "free space or choose another --out" in err, err
    (tmp_path / "real").mkdir(); (tmp_path / "link").symlink_to(tmp_path / "real")  # written beside the folder it names
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / "link"), "--vocab-size", str(VOCAB), "--no-progress"]) == 1
    assert "No space left on device" in (err := capsys.readouterr().err) and "choose another --out" in err, err
    (tmp_path / "link").unlink(); (tmp_path / "real").rmdir()
    monkeypatch.setattr(D.shutil, "disk_usage", lambda p: usage._replace(free=10**12))  # space left: some other failure
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "the write was cut short: a disk quota reached, or a failing disk (" in err and "4096 written" in err, err
    assert "free space" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary folder left


def test_input_or_tokenizer_that_cannot_be_opened(text, tmp_path, monkeypatch, capsys):
    import builtins
    from pathlib import Path
    from hymo.data import main
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(text.read_text()[:2000])
    (tmp_path / "in" / "locked.txt").write_text(text.read_text()[:2000])
    real_open = builtins.open
    def fake_open(f, *a, **k):  # the tests run as root too, where chmod 000 does not stop a read
        if Path(f).name == "locked.txt": raise PermissionError(13, "Permission denied", str(f))
        return real_open(f, *a, **k)
    monkeypatch.setattr(D, "open", fake_open, raising=False)
    with pytest.raises(DataError, match=r"input .*locked.txt cannot be read \(Permission denied\): check its permissions"):
        prepare(tmp_path / "in", tmp_path / "o")
    assert main(["prepare", "--input", str(tmp_path / "in"), "--out", str(tmp_path / "o"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "locked.txt cannot be read" in err, err
    (tmp_path / "tok").mkdir()
    with pytest.raises(DataError, match=r"tokenizer .*tok is a folder: give a Hugging Face tokenizer.json"):
        prepare(tmp_path / "in" / "a.txt", tmp_path / "o", tokenizer=tmp_path / "tok")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra", [0, 1])
def test_a_stream_that_divides_into_windows_never_reads_past_its_end(ds, extra):
    """A window reads T + 1 tokens, so a stream of exactly K·T tokens holds K - 1 windows, not K; one of K·T + 1 holds
    K, the last ending on the stream's last token."""
    s = stream_of(ds, "train")
    T = next(t for t in range(8, 400) if len(s) % t == extra)
    loader = TokenLoader(ds, seq_len=T, micro_batch_size=1, seed=0)
    assert loader.n_windows == len(s) // T - 1 + extra
    for step in range(loader.steps_per_epoch):  # every window of an epoch, the last one included
        x, y = loader.batch(step)
        k = int(loader.window_ids(step)[0])
        assert x.shape == y.shape == (1, T) and np.array_equal(y[0].numpy(), s[k * T + 1:k * T + T + 1])


def test_each_epoch_has_its_own_order(ds):
    loader = TokenLoader(ds, seq_len=16, micro_batch_size=4, seed=0)
    S = loader.steps_per_epoch
    epochs = [[loader.window_ids(t) for t in range(e * S, (e + 1) * S)] for e in range(4)]
    orders = [np.concatenate(e) for e in epochs]
    assert all(not np.array_equal(a, b) for i, a in enumerate(orders) for b in orders[i + 1:])  # no epoch repeats another
    for e in epochs:  # each epoch: distinct windows (all but the few that do not fill a step)
        ids = np.concatenate(e)
        assert len(np.unique(ids)) == len(ids) and ids.max() < loader.n_windows and loader.n_windows - len(ids) < 4


def test_a_damaged_dataset_is_prepared_again_by_the_command_its_error_names(text, tmp_path, capsys):
    """A missing shard: the trainer's check says to prepare again, and the same `prepare` now rebuilds it (it used to see
    the matching manifest and return at once, leaving the shard missing). A damaged manifest is replaced with --overwrite,
    as its message says, and refused without it."""
    out = prepare(text, tmp_path / "ds", vocab_size=VOCAB, shard_tokens=1000, progress=False)
    want = {p.name: D.sha256_file(p) for p in out.iterdir()}
    (out / "val_0000.npy").unlink()
    with pytest.raises(DataError, match="is missing: prepare the dataset again"): check_compatible(out, VOCAB)
    with pytest.warns(D.DataWarning, match="preparing it again"): prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False)
    assert {p.name: D.sha256_file(p) for p in out.iterdir()} == want and check_compatible(out, VOCAB)
    (out / "manifest.json").write_text('{"format": "hymo-tok')  # cut short
    with pytest.raises(DataError, match="is damaged .*--overwrite"): prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False)
    prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, overwrite=True, progress=False)
    assert {p.name: D.sha256_file(p) for p in out.iterdir()} == want
    m = json.loads((out / "manifest.json").read_text()); del m["fingerprint"]; (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"is damaged \(missing or wrong: fingerprint\)"): load_manifest(out)
    (out / "manifest.json").unlink(); (out / "manifest.json").mkdir()
    with pytest.raises(DataError, match="manifest.json is damaged"): load_manifest(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temporary folder left


def test_a_manifest_missing_what_readers_use_is_damaged_and_replaced_with_overwrite(text, tmp_path):
    "Valid JSON without `splits` (or a shard's entry without `tokens`) is a DataError, not a KeyError, in prepare too."
    out = prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    good = json.loads((out / "manifest.json").read_text())
    for cut in ("splits", "vocab_size", "inputs"):
        m = dict(good); del m[cut]; (out / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(DataError, match=f"missing or wrong: {cut}\\).*--overwrite"): load_manifest(out)
        with pytest.raises(DataError, match=f"missing or wrong: {cut}"): prepare(text, out, vocab_size=VOCAB, progress=False)
    m = json.loads(json.dumps(good)); del m["splits"]["val"]["shards"][0]["tokens"]; (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="missing or wrong: splits.val\\)"): check_compatible(out, VOCAB)
    prepare(text, out, vocab_size=VOCAB, overwrite=True, progress=False)
    assert load_manifest(out) == good


def test_replacing_a_dataset_never_deletes_files_prepare_did_not_write(text, tmp_path):
    "Notes kept in the dataset folder, or an input stored there, stop a rebuild or an --overwrite; an intact one is left alone."
    out = prepare(text, tmp_path / "ds", vocab_size=VOCAB, shard_tokens=1000, progress=False)
    (out / "NOTES.md").write_text("mine\n")
    assert prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False) == out  # intact: nothing replaced
    (out / "val_0000.npy").unlink()  # damaged: rebuilt, but not over the notes
    with pytest.raises(DataError, match=r"also holds 1 thing prepare did not write \(NOTES.md\).*move them out"):
        prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False)
    assert (out / "NOTES.md").read_text() == "mine\n" and not (out / "val_0000.npy").exists()
    (out / "NOTES.md").unlink(); (out / ".DS_Store").write_bytes(b"\0")  # Finder's: nobody's work, as in run folders
    with pytest.warns(D.DataWarning, match="holds this dataset damaged .*: preparing it again"):
        prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False)
    assert check_compatible(out, VOCAB)
    (out / "mine").mkdir(); (out / "mine" / "more.txt").write_text("Another speech.\n")  # an input stored in the dataset
    with pytest.raises(DataError, match=r"prepare did not write \(mine/\)"):
        prepare([text, out / "mine"], out, vocab_size=VOCAB, overwrite=True, progress=False)
    assert (out / "mine" / "more.txt").read_text() == "Another speech.\n"
    (out / "mine" / "more.txt").unlink(); (out / "mine").rmdir()
    (out / ".git").mkdir(); (out / ".git" / "HEAD").write_text("ref\n"); (out / ".gitignore").write_text("*.npy\n")
    with pytest.raises(DataError, match=r"also holds 2 things prepare did not write \(\.git/, \.gitignore\)"):
        prepare(text, out, vocab_size=VOCAB + 1, overwrite=True, progress=False)  # hidden, but someone's work
    assert (out / ".git" / "HEAD").read_text() == "ref\n" and (out / ".gitignore").exists()


def test_a_folder_s_files_of_other_types_are_counted_in_a_warning(tmp_path):
    from hymo.training.data import find_files
    d = tmp_path / "mix"; d.mkdir()
    (d / "a.txt").write_text("one\n"); (d / "b.rst").write_text("two\n"); (d / "c.json").write_text("{}")
    (d / "d.json").write_text("{}"); (d / "e.txt.gz").write_bytes(b"\x1f\x8b"); (d / "README").write_text("x")
    with pytest.warns(D.DataWarning, match=r"skipped 5 files of other types \(\.json 2, .*\.gz 1.*no suffix 1.*\): only"):
        assert [n for _, n in find_files(d)] == ["mix/a.txt"]
    (d / "a.txt").unlink()
    with pytest.raises(DataError, match=r"holds no .* files, only 5 files of other types"): find_files(d)


def test_load_manifest_says_what_the_path_is(tmp_path):
    "A misspelt path does not exist (not 'prepare into it'); a run folder is not a folder of texts (its metrics.jsonl)."
    with pytest.raises(DataError, match="does not exist: check the path"): load_manifest(tmp_path / "dsvv")
    (tmp_path / "run").mkdir(); (tmp_path / "run" / "config.yaml").write_text("{}"); (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(DataError, match="holds a config.yaml \\(a run folder\\?\\): give the dataset folder"):
        load_manifest(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").unlink()
    with pytest.raises(DataError, match="holds no text to prepare"): load_manifest(tmp_path / "run")
    (tmp_path / "run" / "notes.md").write_text("words\n")  # texts with a config.yaml of their own: prepare them
    with pytest.raises(DataError, match=f"--input {tmp_path / 'run'} --out {tmp_path / 'run_prepared'}"):
        load_manifest(tmp_path / "run")


def test_inputs_and_tokenizers_that_would_give_wrong_ids_are_refused(text, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    gaps = Tokenizer(models.BPE(vocab={**{chr(97 + i): i for i in range(20)}, EOT: 5000}, merges=[]))
    gaps.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gaps.save(str(tmp_path / "gaps.json"))
    with pytest.raises(DataError, match="has 21 tokens but ids up to 5000"):
        prepare(text, tmp_path / "a", tokenizer=tmp_path / "gaps.json", progress=False)
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 surrogate"}\n')
    with pytest.raises(DataError, match=r"s.jsonl:2 has text that is not valid Unicode"):
        prepare(tmp_path / "s.jsonl", tmp_path / "b", vocab_size=VOCAB, progress=False)
    with pytest.raises(DataError, match=r"vocab_size=4294967296 is above 2\*\*24"):
        prepare(text, tmp_path / "c", vocab_size=2**32, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gaps.json", "s.jsonl"]


def test_an_empty_validation_split_is_said(tmp_path, capsys):
    "One line (no newline to cut at) with the default val_fraction: the cut falls inside it, and the command says so."
    from hymo.data import main
    (tmp_path / "one.txt").write_text(CORPUS.read_text()[:20_000].replace("\n", " "))
    assert main(["prepare", "--input", str(tmp_path / "one.txt"), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB),
                 "--no-progress"]) == 0
    cap = capsys.readouterr()
    assert "val 0 tokens" in cap.out and "warning: the validation split is empty" in cap.err, (cap.out, cap.err)


def test_a_folder_s_files_with_upper_case_suffixes_are_named_not_skipped_silently(tmp_path, capsys):
    "`A.TXT` is not read from a folder (reading it would change datasets already prepared): the command says so."
    from hymo.data import main
    from hymo.training.data import DataWarning, find_files
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text(CORPUS.read_text()[:20_000])
    (d / "B.TXT").write_text("never read\n")
    (d / "c.Md").write_text("never read\n")
    with pytest.warns(DataWarning, match=r"skipped 2 files \(B.TXT, c.Md\) whose suffix is not lower case: rename them"):
        assert [n for _, n in find_files(d)] == ["in/a.txt"]
    assert main(["prepare", "--input", str(d), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB), "--no-progress"]) == 0
    assert "warning: folder" in capsys.readouterr().err
    (d / "a.txt").unlink()
    with pytest.raises(DataError, match=r"holds no .* files, only 2 files \(B.TXT, c.Md\)"): find_files(d)


def test_what_a_stopped_prepare_leaves_is_named(tmp_path):
    "Stopped between `_install`'s renames, the dataset is only under `.out.old-*`: the error says to rename it back."
    import os
    from hymo.training.data import DataWarning, load_manifest
    text = tmp_path / "t.txt"
    text.write_text(CORPUS.read_text()[:20_000])
    ds = prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    old = tmp_path / ".ds.old-0123abcd"
    os.replace(ds, old)  # as if Ctrl-C came between the two renames
    with pytest.raises(DataError, match=r"ds does not exist, but .*\.ds\.old-0123abcd holds the dataset .*mv "):
        load_manifest(ds)
    os.replace(old, ds)
    assert load_manifest(ds)["vocab_size"] == VOCAB
    (tmp_path / ".ds2.tmp-99-abc").mkdir()  # a killed prepare's work in progress
    with pytest.warns(DataWarning, match=r"\.ds2\.tmp-99-abc in .* was left by another prepare of ds2, stopped or still running"):
        prepare(text, tmp_path / "ds2", vocab_size=VOCAB, progress=False)
    assert (tmp_path / ".ds2.tmp-99-abc").exists()  # named, not deleted: it may belong to a prepare still running


# Tests from mutation testing: each fails on a plausible change to the data pipeline that no other test caught.
def test_the_order_is_the_documented_one_and_seeds_are_independent(ds):
    a, b = (TokenLoader(ds, seq_len=16, micro_batch_size=4, seed=s) for s in (0, 1))
    S, K = a.steps_per_epoch, a.n_windows
    assert not np.array_equal(a.window_ids(S), b.window_ids(0))  # seed 0's 2nd epoch is not seed 1's 1st
    # pinned: a changed recipe would silently change the data order of every checkpoint being resumed
    assert np.array_equal(a.window_ids(S + 2), np.random.default_rng([0, 1]).permutation(K)[8:12])


def test_epoch_is_fractional(ds):
    loader = TokenLoader(ds, seq_len=16, micro_batch_size=4)
    loader.step = loader.steps_per_epoch + loader.steps_per_epoch // 2
    assert loader.epoch == loader.step / loader.steps_per_epoch and 1 < loader.epoch < 2


def test_batches_are_int64(ds):
    x, y = TokenLoader(ds, seq_len=16, micro_batch_size=4).batch(0)
    assert x.dtype == y.dtype == torch.int64


def test_a_document_that_starts_at_the_cut_is_all_validation():
    from hymo.training.data import split_train_val
    assert list(split_train_val(["aaaa\n", "bbbb\n"], 10, 0.5)) == [("train", "aaaa\n"), ("val", "bbbb\n")]


def test_a_whitespace_tail_is_no_validation_document():
    from hymo.training.data import split_train_val
    assert list(split_train_val(["aaaa\n  \n"], 8, 0.5)) == [("train", "aaaa\n")]


def test_a_shard_of_another_dtype_is_damaged(text, tmp_path):
    bad = prepare(text, tmp_path / "d", vocab_size=VOCAB, progress=False)
    np.save(bad / "val_0000.npy", np.load(bad / "val_0000.npy").astype(np.uint32))
    with pytest.raises(DataError, match="damaged"): check_compatible(bad, VOCAB)


def test_a_manifest_vocab_size_that_is_not_the_tokenizer_s_is_refused(text, tmp_path):
    bad = prepare(text, tmp_path / "m", vocab_size=VOCAB, progress=False)
    m = json.loads((bad / "manifest.json").read_text()); m["vocab_size"] = 256
    del m["manifest_crc32"]  # an older manifest, without its own sum (which refuses any edit: see below)
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=f"tokenizer.json has {VOCAB} tokens, the manifest says 256"): check_compatible(bad, 256)
    for key, value in (("eot_id", 7), ("dtype", "uint32")):  # a manifest edited (or another's): never read as intact
        (bad / "manifest.json").write_text(json.dumps({**m, "vocab_size": VOCAB, key: value}))
        with pytest.raises(DataError, match=f"manifest's eot_id .* not what its tokenizer gives"): check_compatible(bad, VOCAB)
    (bad / "manifest.json").write_text(json.dumps({**m, "vocab_size": VOCAB}))
    assert check_compatible(bad, VOCAB)["eot_id"] == 0


def test_a_changed_input_or_option_is_not_served_from_the_old_dataset(text, tmp_path):
    src = tmp_path / "play.txt"; src.write_text(text.read_text())
    out = prepare(src, tmp_path / "ds", vocab_size=VOCAB, shard_tokens=1000, progress=False)
    for kw in (dict(shard_tokens=500), dict(val_fraction=0.2), dict(doc_split="file"), dict(tokenizer_train_bytes=10**4)):
        with pytest.raises(DataError, match="overwrite=True"):
            prepare(src, out, vocab_size=VOCAB, progress=False, **{"shard_tokens": 1000, **kw})
    src.write_text(text.read_text().replace("Citizen", "Citizeness"))  # the same name, other text
    with pytest.raises(DataError, match="overwrite=True"): prepare(src, out, vocab_size=VOCAB, shard_tokens=1000, progress=False)


def test_the_first_window_of_a_sharded_split(ds):
    s, T = stream_of(ds, "train"), 16
    loader = TokenLoader(ds, seq_len=T, micro_batch_size=4)
    assert len(load_manifest(ds)["splits"]["train"]["shards"]) > 1
    x, y = next(iter(loader.eval_batches(1)))  # windows 0..3 in stream order
    assert np.array_equal(x[0].numpy(), s[:T]) and np.array_equal(y[0].numpy(), s[1:T + 1])


def test_a_rank_outside_the_world_is_refused(ds):
    with pytest.raises(DataError, match=r"rank=2 must be in \[0, world_size=2\)"):
        TokenLoader(ds, seq_len=16, micro_batch_size=2, rank=2, world_size=2)


def test_resuming_with_other_settings_or_data_is_refused(ds, text, tmp_path):
    base = dict(seq_len=16, micro_batch_size=4, seed=7)
    a = TokenLoader(ds, **base); next(a)
    for kw, msg in ((dict(world_size=2), "world_size: saved 1, now 2"), (dict(micro_batch_size=2), "micro_batch_size: saved 4, now 2"),
                    (dict(accum=2), "accum: saved 1, now 2"), (dict(split="val"), "split: saved 'train', now 'val'")):
        with pytest.raises(DataError, match=msg): TokenLoader(ds, **{**base, **kw}).load_state_dict(a.state_dict())
    other = prepare(text, tmp_path / "o", vocab_size=VOCAB + 20, progress=False)
    with pytest.raises(DataError, match="is not the one this run trained on"): TokenLoader(other, **base).load_state_dict(a.state_dict())


def test_the_tokenizer_never_sees_validation_text(tmp_path):
    train = "".join(f"speech {i} of the play.\n\n" for i in range(300))
    val = "".join("zqxjv " * 50 + "\n\n" for _ in range(20))
    (tmp_path / "t.txt").write_text(train + val)
    ds = prepare(tmp_path / "t.txt", tmp_path / "ds", vocab_size=VOCAB, val_fraction=0.5, progress=False)
    assert not any("qx" in t for t in load_tokenizer(ds).get_vocab())


def test_the_tokenizer_trains_on_at_most_tokenizer_train_bytes(text, tmp_path, monkeypatch):
    "At most, whole documents and the crossing one cut at a line break: one document per file came whole (54 kB for 1 000)."
    seen, real = [], D.train_tokenizer
    monkeypatch.setattr(D, "train_tokenizer", lambda docs, *a: real(seen.extend(docs) or seen, *a))
    prepare(text, tmp_path / "ds", vocab_size=VOCAB, tokenizer_train_bytes=5000, progress=False)
    n = sum(len(d.encode()) for d in seen)
    assert 5000 - max(len(d.encode()) for d in seen) < n <= 5000
    seen.clear()
    prepare(text, tmp_path / "ds1", vocab_size=VOCAB, doc_split="file", tokenizer_train_bytes=1010, progress=False)
    assert not text.read_text()[:1010].endswith("\n")  # (at 1000 the file's own text ends a line: no test of the cut)
    assert len(seen) == 1 and 900 < len(seen[0].encode()) <= 1010 and seen[0].endswith("\n")
    used = []
    monkeypatch.setattr(D, "_short_runs", lambda docs: used.append(1) or iter(list(docs)))
    prepare(text, tmp_path / "ds2", vocab_size=VOCAB, tokenizer_train_bytes=2000, progress=False)
    assert used == [1]  # the trainer is given its runs broken up


def test_the_smallest_vocabulary_is_accepted(text, tmp_path):
    assert load_manifest(prepare(text, tmp_path / "v", vocab_size=257, progress=False))["vocab_size"] == 257


def test_an_eval_only_loader_needs_one_micro_batch(ds):
    K = TokenLoader(ds, "val", seq_len=16, micro_batch_size=1, eval_only=True).n_windows
    with pytest.raises(DataError, match="fewer than one micro-batch"):
        TokenLoader(ds, "val", seq_len=16, micro_batch_size=K + 1, eval_only=True)


def test_cli_options_and_notes(text, tmp_path, capsys):
    from hymo.data import main
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / "f"), "--vocab-size", str(VOCAB),
                 "--doc-split", "file", "--val-fraction", "0", "--no-progress"]) == 0
    m, cap = load_manifest(tmp_path / "f"), capsys.readouterr()
    assert m["doc_split"] == "file" and m["splits"]["train"]["documents"] == 1
    assert "validation split is empty" not in cap.err  # asked for: --val-fraction 0
    assert m["vocab_size"] == VOCAB and "note: the tokenizer learned" not in cap.out  # all it asked for: no note
    (tmp_path / "small.txt").write_text("to be or not to be\n\nthat is the question\n" * 3)
    assert main(["prepare", "--input", str(tmp_path / "small.txt"), "--out", str(tmp_path / "s"), "--vocab-size", "2000",
                 "--val-fraction", "0", "--no-progress"]) == 0
    assert "note: the tokenizer learned" in capsys.readouterr().out


def _bare_loader(n_windows, world_size, micro_batch_size, accum):
    "A loader's epoch arithmetic without a dataset: only what `step_after` reads."
    L = TokenLoader.__new__(TokenLoader)
    L.n_windows, L.world_size, L.micro_batch_size, L.accum = n_windows, world_size, micro_batch_size, accum
    L.steps_per_epoch = n_windows // (world_size * micro_batch_size * accum) * accum
    return L


def test_step_after_continues_after_the_windows_the_saved_run_read():
    "In the saved run's epoch, after the windows it read there (rounded up), or at the next epoch's start: from every kind of save."
    saved = lambda step, W=1, B=1, A=1: {"step": step, "world_size": W, "micro_batch_size": B, "accum": A}
    assert _bare_loader(10, 1, 4, 1).step_after(saved(9)) == 2  # 9 of 10 windows read: this epoch of 2 steps is done
    assert _bare_loader(10, 1, 4, 1).step_after(saved(5)) == 2  # 5 read: step 2 would read 8..11 of an epoch of 8
    assert _bare_loader(10, 1, 1, 1).step_after(saved(12, A=4)) == 14  # epochs of 8 micro-steps then; 4 into the second
    assert _bare_loader(10, 1, 1, 1).step_after({"optimizer_step": 3, "global_batch_size": 4}) == 14  # meta.json only
    assert _bare_loader(1000, 1, 4, 1).step_after(saved(3, W=2, B=2)) == 3  # 12 windows read, 4 a step now
    assert _bare_loader(1000, 2, 2, 1).step_after(saved(3, B=4)) == 3
    assert _bare_loader(1000, 1, 1, 4).step_after(saved(5)) == 8  # up to a whole optimiser step of 4


def test_the_loader_s_own_arguments_are_checked(ds):
    with pytest.raises(DataError, match="must be positive"): TokenLoader(ds, seq_len=0)
    with pytest.raises(DataError, match="choose one of"): TokenLoader(ds, "test")
    with pytest.raises(DataError, match="seed=-1 must be >= 0"): TokenLoader(ds, seed=-1)
    L = TokenLoader(ds, seq_len=16, micro_batch_size=2)
    with pytest.raises(DataError, match="step=-1 must be >= 0"): L.window_ids(-1)
    K = L.n_windows
    assert TokenLoader(ds, seq_len=16, micro_batch_size=K).steps_per_epoch == 1  # one step's worth of windows is enough
    V = TokenLoader(ds, "val", seq_len=16, micro_batch_size=1, eval_only=True).n_windows
    only = TokenLoader(ds, "val", seq_len=16, micro_batch_size=V, eval_only=True)
    assert only.eval_plan() == [(0, True)] and len(list(only.eval_batches(10**6))) == 1  # capped at the windows there are
    with pytest.raises(DataError, match="serves `eval_batches` only"): next(TokenLoader(ds, "val", seq_len=16, micro_batch_size=V // 2 + 1, accum=2, eval_only=True))
    assert L.check_same_data({"fingerprint": None, "seq_len": 16}, "x") is None  # a checkpoint from before fingerprints


def test_an_empty_validation_split_says_how_to_have_one(text, tmp_path):
    out = prepare(text, tmp_path / "ds", vocab_size=VOCAB, val_fraction=0, progress=False)
    assert load_manifest(out)["splits"]["val"]["shards"] == []  # no empty shard file either
    with pytest.raises(DataError, match=r"val split .* holds no tokens \(prepared with val_fraction=0\): .* a val_fraction"):
        TokenLoader(out, "val", seq_len=16)
    (tmp_path / "one.txt").write_text("a single line that is long enough to hold the whole cut\n")
    small = prepare(tmp_path / "one.txt", tmp_path / "small", vocab_size=VOCAB, val_fraction=1e-4, progress=False)
    with pytest.raises(DataError, match=r"the cut at val_fraction=0.0001 fell inside the last line\): .* a larger val_fraction"):
        TokenLoader(small, "val", seq_len=1)


def test_a_dataset_made_with_another_given_tokenizer_is_not_served_as_this_one(ds, text, tmp_path):
    "The tokenizer's hash is in the fingerprint: the same inputs and options with another tokenizer of the same size are other data."
    from tokenizers import Tokenizer
    out = prepare(text, tmp_path / "ds", tokenizer=ds / "tokenizer.json", progress=False)
    other = train_tokenizer(split_text(CORPUS.read_text()[-30_000:]), VOCAB)
    other.save(str(tmp_path / "other.json"))
    assert Tokenizer.from_file(str(tmp_path / "other.json")).get_vocab_size() == VOCAB
    with pytest.raises(DataError, match="overwrite=True"):
        prepare(text, tmp_path / "ds", tokenizer=tmp_path / "other.json", progress=False)


def test_a_literal_end_of_text_in_a_document_is_text_with_a_given_tokenizer(ds, tmp_path):
    (tmp_path / "t.txt").write_text("a <|endoftext|> b\n\nsecond\n" * 20)
    out = prepare(tmp_path / "t.txt", tmp_path / "ds", tokenizer=ds / "tokenizer.json", val_fraction=0, progress=False)
    assert (stream_of(out, "train") == 0).sum() == load_manifest(out)["splits"]["train"]["documents"]  # one per document
    assert 0 not in load_tokenizer(out).encode("a <|endoftext|> b").ids  # the trainer's `sample` encodes with it


def test_a_given_tokenizer_that_loses_text_is_said(tmp_path):
    "Without byte fallback or an unknown token, characters it has no token for vanish: a warning shows where."
    from tokenizers import Tokenizer, models, pre_tokenizers
    t = Tokenizer(models.BPE(vocab={EOT: 0, **{chr(97 + i): i + 1 for i in range(26)}}, merges=[]))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "letters.json"))
    (tmp_path / "t.txt").write_text("Hello, World! 42\n\nsecond doc\n")
    with pytest.warns(D.DataWarning, match=r"does not give back the text it encodes: 'Hello, World! 42\\n' comes back as 'e l l o"):
        prepare(tmp_path / "t.txt", tmp_path / "ds", tokenizer=tmp_path / "letters.json", val_fraction=0, progress=False)


def test_links_a_folder_search_does_not_follow_are_named(tmp_path):
    from hymo.training.data import find_files
    (tmp_path / "books").mkdir(); (tmp_path / "books" / "b.txt").write_text("A whole book.\n")
    d = tmp_path / "in"; d.mkdir(); (d / "a.txt").write_text("A note.\n")
    os.symlink(tmp_path / "books", d / "books"); os.symlink(tmp_path / "gone.txt", d / "dangling.txt")
    (d / "sub").mkdir(); os.symlink(d / "sub", d / "again"); os.symlink(tmp_path / "gone.rst", d / "notes.rst")  # not named
    with pytest.warns(D.DataWarning, match=r"skipped 2 links \(books, dangling.txt\) to a folder elsewhere or to a missing file"):
        assert [n for _, n in find_files(d)] == ["in/a.txt"]
    (d / "a.txt").unlink(); (d / "B.TXT").write_text("x\n")
    with pytest.raises(DataError, match=r"holds no .* files, only 1 file \(B.TXT\) whose .*; and 2 links \(books"): find_files(d)
    assert [n for _, n in find_files(d / "books")] == ["books/b.txt"]  # given on its own, it is read


def test_what_a_folder_search_skips_and_names(tmp_path):
    from hymo.training.data import find_files
    d = tmp_path / "corpus"; d.mkdir()
    (d / "a.txt").write_text("x\n"); (d / ".ipynb_checkpoints").mkdir(); (d / ".ipynb_checkpoints" / "a.txt").write_text("x\n")
    (d / "sub").mkdir()
    with pytest.warns(D.DataWarning, match=r"skipped 1 hidden file \(\.ipynb_checkpoints/a\.txt\) .*as inputs of its own"):
        assert [n for _, n in find_files(d)] == ["corpus/a.txt"]  # hidden folders are not read, but named
    (d / ".git").mkdir(); (d / ".git" / "HEAD").write_text("x"); (d / ".ipynb_checkpoints" / "a.txt").unlink()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hidden folder without text files: nothing to say
        assert [n for _, n in find_files(d)] == ["corpus/a.txt"]
    with pytest.raises(DataError, match="given twice"): find_files([d / "a.txt", d / "sub" / ".." / "a.txt"])
    (d / "a.txt").unlink(); (d / ".draft.md").write_text("x\n")
    with pytest.raises(DataError, match=r"holds no .* files, only 1 hidden file \(\.draft\.md\)"): find_files(d)
    assert split_text("  \n\nA\n\n \t") == ["A\n"]


def test_a_named_pipe_is_refused_as_an_input_and_named_in_a_folder(text, tmp_path):
    """A named pipe given as an input hung prepare (opened to check it can be read, it waits for a writer), and one in
    a folder was skipped without a word: refused, and named, each with what to do."""
    import os
    from hymo.training.data import find_files
    d = tmp_path / "corpus"; d.mkdir()
    (d / "a.txt").write_text("x\n"); os.mkfifo(d / "live.txt")
    with pytest.raises(DataError, match=r"input .*live\.txt is not a regular file \(a named pipe.*save what it gives to a file"):
        prepare(d / "live.txt", tmp_path / "out", vocab_size=VOCAB, progress=False)
    with pytest.warns(D.DataWarning, match=r"skipped 1 special file \(live\.txt\), a named pipe, socket or device"):
        assert [n for _, n in find_files(d)] == ["corpus/a.txt"]
    os.mkfifo(tmp_path / "elsewhere.txt"); (d / "linked.txt").symlink_to(tmp_path / "elsewhere.txt")
    import warnings
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        find_files(d)
    said = [str(w.message) for w in said]  # a link to a pipe is a special file, not "a link to a missing file" too
    assert len(said) == 1 and "2 special files (linked.txt, live.txt), a named pipe" in said[0], said
    assert not (tmp_path / "out").exists()


def test_small_helpers_of_prepare():
    assert list(D._head(["ab", "cd", "ef"], 4)) == ["ab", "cd"]  # stops once max_bytes are reached
    assert list(D._short_runs(["a" * 2500])) == ["a" * 1000 + " " + "a" * 1000 + " " + "a" * 500]
    with pytest.raises(DataError, match="at least 257"): D._check_vocab_size(256)
    D._check_vocab_size(257)


def test_a_manifest_of_another_format_or_shape_is_refused(ds, tmp_path):
    import shutil
    bad = tmp_path / "ds"; shutil.copytree(ds, bad)
    m = json.loads((ds / "manifest.json").read_text())
    for broken, msg in (({**m, "format": "hymo-tokens-v2"}, "this version reads"), ({**m, "eot_id": True}, "eot_id"), ([1], "")):
        (bad / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(DataError, match=msg): load_manifest(bad)
    shutil.copytree(ds, tmp_path / "ds2")
    first = load_manifest(ds)["splits"]["train"]["shards"][0]["file"]
    np.save(tmp_path / "ds2" / first, np.load(ds / first).reshape(-1, 1))
    with pytest.raises(DataError, match="damaged"): check_compatible(tmp_path / "ds2", VOCAB)


def test_a_folder_given_as_dot_is_named_as_itself(text, tmp_path, monkeypatch):
    "`--input .` inside `texts/` and `--input texts` beside it read the same files under the same names: the same dataset."
    from hymo.training.data import find_files
    (tmp_path / "texts").mkdir(); (tmp_path / "texts" / "a.txt").write_text("A speech.\n")
    monkeypatch.chdir(tmp_path / "texts")
    assert [n for _, n in find_files(".")] == ["texts/a.txt"]
    monkeypatch.chdir(tmp_path)
    assert [n for _, n in find_files("texts")] == [n for _, n in find_files("texts/../texts")] == ["texts/a.txt"]


# Found by mutation testing hymo/training/data.py
def test_the_validation_cut_counts_bytes_of_non_ascii_text(tmp_path):
    """val_fraction is a fraction of UTF-8 bytes: Cyrillic (2 bytes a letter) must get the same ~10% validation as
    English, not none (position counted in characters) nor half (total counted in characters)."""
    assert list(split_train_val(["ééé\n", "ééé\n"], 14, 0.5)) == [("train", "ééé\n"), ("val", "ééé\n")]
    line = "Быть или не быть, вот в чём вопрос.\n"
    src = tmp_path / "ru.txt"
    src.write_text("".join(f"{i}: {line}\n" for i in range(400)), encoding="utf-8")
    m = load_manifest(prepare(src, tmp_path / "ds", vocab_size=300, val_fraction=0.1, progress=False))
    train, val = m["splits"]["train"]["bytes"], m["splits"]["val"]["bytes"]
    cut = int(0.9 * (train + val))
    assert cut <= train < cut + len(f"399: {line}".encode("utf-8"))  # the first line boundary at or after the cut


def test_document_masking_uses_the_dataset_s_end_of_text_id(tmp_path):
    "A given tokenizer may put <|endoftext|> at an id other than 0: cu_seqlens must start documents at that id."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    docs = [f"doc {i} " + "word " * (i % 7 + 1) + "\n" for i in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", EOT], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eot = tok.token_to_id(EOT)
    assert eot != 0
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ds = prepare(tmp_path / "d.jsonl", tmp_path / "ds", tokenizer=tmp_path / "tok.json", val_fraction=0.0, progress=False)
    T, B = 16, 2
    x, _, cu = TokenLoader(ds, seq_len=T, micro_batch_size=B, doc_masking=True).batch(0)
    flat = x.reshape(-1)
    starts = sorted({r * T for r in range(B)} | set(torch.nonzero(flat == eot).squeeze(1).tolist()))
    assert (flat == eot).any() and cu.tolist() == starts + [B * T]


def test_a_window_longer_than_the_shards_before_the_last_reads_the_stream(tmp_path):
    "Window 0 of a split whose first shard is shorter than seq_len + 1: tokens 0..T of the stream, not of the last shard."
    src = tmp_path / "a.txt"
    src.write_text("".join(f"Speech {i}: to be or not to be, that is the question.\n\n" for i in range(60)))
    n = load_manifest(prepare(src, tmp_path / "one", vocab_size=300, val_fraction=0.0, progress=False))["splits"]["train"]["tokens"]
    S = n - n // 3  # two shards: S tokens, then n // 3
    ds = prepare(src, tmp_path / "two", vocab_size=300, val_fraction=0.0, shard_tokens=S, progress=False)
    m = load_manifest(ds)
    assert [s["tokens"] for s in m["splits"]["train"]["shards"]] == [S, n - S]
    stream = np.concatenate([np.load(ds / s["file"]) for s in m["splits"]["train"]["shards"]])
    x, y = next(iter(TokenLoader(ds, seq_len=S, micro_batch_size=1, eval_only=True).eval_batches(1)))  # window 0
    assert np.array_equal(x[0].numpy(), stream[:S]) and np.array_equal(y[0].numpy(), stream[1:S + 1])


def test_texts_inside_the_package_are_prepared_outside_it():
    "data_dir=.../hymo/assets/tinyshakespeare.txt: the suggested --out is not next to it, inside the installed package."
    with pytest.raises(DataError, match=f"--input {CORPUS} --out data/tinyshakespeare_prepared`, then give data_dir=data/tinyshakespeare_prepared"):
        load_manifest(CORPUS)


# ---------------------------------------------------------------- from mutation testing hymo/data.py and hymo/training/data.py

def test_cli_overwrite_is_what_lets_prepare_replace_a_dataset(text, tmp_path, capsys):
    from hymo.data import main
    (tmp_path / "b.txt").write_text(text.read_text()[:20_000])
    args = ["--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB), "--val-fraction", "0", "--no-progress"]
    assert main(["prepare", "--input", str(text), *args]) == 0
    assert main(["prepare", "--input", str(tmp_path / "b.txt"), *args]) == 1  # other inputs, no --overwrite: kept
    assert load_manifest(tmp_path / "ds")["inputs"] == [text.name] and "--overwrite" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["prepare", "--input", str(tmp_path / "b.txt"), *args, "--overwrite"]) == 0
    assert load_manifest(tmp_path / "ds")["inputs"] == ["b.txt"] and "nothing written" not in capsys.readouterr().out
    assert main(["prepare", "--input", str(tmp_path / "b.txt"), *args, "--overwrite"]) == 0  # now the same dataset
    assert "note: nothing written" in capsys.readouterr().out


def test_cli_tokenizer_and_val_fraction_reach_prepare(ds, text, tmp_path, capsys):
    "--tokenizer: that tokenizer, its own size (no --vocab-size, no 'learned N of 2048' note); --val-fraction 0: no val tokens."
    from hymo.data import main
    tok = tmp_path / "tok.json"
    tok.write_text((ds / "tokenizer.json").read_text())
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / "t"), "--tokenizer", str(tok),
                 "--val-fraction", "0", "--no-progress"]) == 0
    m, out = load_manifest(tmp_path / "t"), capsys.readouterr().out
    assert m["vocab_size"] == VOCAB and m["tokenizer_sha256"] == load_manifest(ds)["tokenizer_sha256"] and "note:" not in out
    assert m["val_fraction"] == 0 and m["splits"].get("val", {"tokens": 0})["tokens"] == 0


@pytest.mark.parametrize("args", [["prepare", "--out", "x"], ["prepare", "--input", "a.txt", "--out", "x", "--doc-split", "lines"]])
def test_cli_usage_errors_exit_2(args, capsys):
    "No --input, or a --doc-split it does not know: a usage line and status 2, not a traceback from prepare."
    from hymo.data import main
    with pytest.raises(SystemExit) as e: main(args)
    assert e.value.code == 2 and "usage: python -m hymo.data prepare" in capsys.readouterr().err


def test_the_order_of_the_inputs_is_part_of_the_dataset(text, tmp_path):
    "The documents follow the inputs' order: the same files in another order are another dataset, not the one prepared."
    (tmp_path / "b.txt").write_text("Another speech, short.\n\nAnd one more.\n" * 50)
    prepare([text, tmp_path / "b.txt"], tmp_path / "ds", vocab_size=VOCAB, progress=False)
    with pytest.raises(DataError, match="prepared from other inputs or options"):
        prepare([tmp_path / "b.txt", text], tmp_path / "ds", vocab_size=VOCAB, progress=False)


def test_a_vocab_size_other_than_the_given_tokenizers_is_refused(ds, text, tmp_path):
    with pytest.raises(DataError, match=f"vocab_size=280 but tokenizer .* has {VOCAB} tokens"):
        prepare(text, tmp_path / "o", tokenizer=ds / "tokenizer.json", vocab_size=280, progress=False)


def test_jsonl_blank_lines_and_markdown_files_are_read(ds, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n   \n{"text": "two"}\n\n')
    (tmp_path / "b.md").write_text("# Title\n\nA paragraph.\n")
    out = prepare([tmp_path / "a.jsonl", tmp_path / "b.md"], tmp_path / "o", tokenizer=ds / "tokenizer.json",
                  val_fraction=0, progress=False)
    assert load_manifest(out)["splits"]["train"]["documents"] == 2 + 2


def test_documents_keep_their_trailing_spaces():
    assert split_text("a  \n\nb\t") == ["a  \n", "b\t\n"]


def test_a_prepare_stopped_as_it_syncs_the_new_folder_leaves_the_old_dataset_in_place(text, tmp_path, monkeypatch):
    "--overwrite syncs the new dataset before moving the old one aside: stopped there, DIR still holds the old one."
    (tmp_path / "b.txt").write_text(text.read_text()[:20_000])
    ds = prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    sync = D.to_disk
    def stop_at_the_new_folder(f):
        if isinstance(f, Path) and f.name.startswith(".ds.tmp-"): raise KeyboardInterrupt
        return sync(f)
    monkeypatch.setattr(D, "to_disk", stop_at_the_new_folder)
    with pytest.raises(KeyboardInterrupt): prepare(tmp_path / "b.txt", ds, vocab_size=VOCAB, overwrite=True, progress=False)
    monkeypatch.setattr(D, "to_disk", sync)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt", "ds"]
    assert load_manifest(ds)["inputs"] == [text.name]


# From a user walk of the data pipeline (damaged bytes, killed preparations, misleading advice).
def _copy(ds, to):
    import shutil
    return Path(shutil.copytree(ds, to))


def test_changed_bytes_in_a_shard_are_found_by_info_and_by_the_next_prepare(ds, text, tmp_path, capsys):
    "A shard of the right size with other bytes: `info` used to say 'intact'; the same prepare used to keep it."
    from hymo.data import main
    from hymo.training.data import check_contents
    d = _copy(ds, tmp_path / "d")
    assert check_contents(d) is True
    a = np.load(d / "train_0001.npy", mmap_mode="r+")
    a[10:20] = (a[10:20] + 1) % VOCAB  # valid ids, wrong ones: no size or range check can see it
    a.flush(); del a
    with pytest.raises(DataError, match=r"shard .*train_0001\.npy is damaged \(its CRC-32"): check_contents(d)
    assert main(["info", str(d)]) == 1 and "train_0001.npy is damaged" in capsys.readouterr().err
    with pytest.warns(D.DataWarning, match="holds this dataset damaged"):
        prepare(text, d, vocab_size=VOCAB, shard_tokens=1000, progress=False)
    assert check_contents(d) is True
    assert np.array_equal(np.load(d / "train_0001.npy"), np.load(ds / "train_0001.npy"))


def test_a_manifest_without_checksums_still_reads_and_info_says_what_it_checked(ds, text, tmp_path, capsys):
    from hymo.data import main
    from hymo.training.data import check_contents
    d = _copy(ds, tmp_path / "d")
    m = json.loads((d / "manifest.json").read_text())
    del m["manifest_crc32"]  # older still than the manifest's own sum
    for v in m["splits"].values():
        for s in v["shards"]: del s["crc32"]
    (d / "manifest.json").write_text(json.dumps(m))
    assert check_contents(d) is False and TokenLoader(d, seq_len=16, micro_batch_size=2).n_tokens > 0
    assert main(["info", str(d)]) == 0 and "no shard checksums" in capsys.readouterr().err
    prepare(text, d, vocab_size=VOCAB, shard_tokens=1000, progress=False)  # the same command: prepared again, with them
    assert check_contents(d) is True
    (d / "manifest.json").write_text(json.dumps(m))
    m["splits"]["train"]["shards"][0]["crc32"] = "x"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match=r"damaged \(missing or wrong: splits\.train\)"): load_manifest(d)


def test_the_loader_names_the_shard_of_an_id_beyond_the_tokenizer(ds, tmp_path):
    "An id the tokenizer cannot have (a damaged shard) used to reach the model and fail there, hours into a run."
    d = _copy(ds, tmp_path / "d")
    L = TokenLoader(d, seq_len=16, micro_batch_size=4)
    k = int(L.window_ids(0)[2])  # a window the first batch reads
    at = k * 16 + 5  # its sixth token, in the stream
    i = int(np.searchsorted(L.offsets, at, side="right")) - 1
    a = np.load(d / f"train_{i:04d}.npy", mmap_mode="r+")
    a[at - L.offsets[i]] = 65535
    a.flush(); del a
    L = TokenLoader(d, seq_len=16, micro_batch_size=4)
    with pytest.raises(DataError, match=rf"shard .*train_{i:04d}\.npy holds id 65535 at token {at - L.offsets[i]:,}, "
                                        rf"beyond the tokenizer's {VOCAB}.*hymo\.data info"):
        L.batch(0)
    L.batch(1)  # the others are fine
    a = np.load(d / f"train_{i:04d}.npy", mmap_mode="r+"); a[at - L.offsets[i]] = VOCAB; a.flush(); del a  # the first id past it
    with pytest.raises(DataError, match=rf"holds id {VOCAB} at token"):
        TokenLoader(d, seq_len=16, micro_batch_size=4).batch(0)


def test_a_killed_prepare_on_this_machine_is_cleaned_up_and_others_are_left(text, tmp_path):
    "kill -9 leaves `.out.tmp-HOST-PID-*`: a dead PID of this host is removed; a live one, another host's or an old name stays."
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", "pass"]); p.wait()  # a PID that has ended
    dead = tmp_path / f".ds.tmp-{D._HOST}-{p.pid}-0123abcd"
    alive = tmp_path / f".ds.tmp-{D._HOST}-{os.getppid()}-0123abcd"
    other = tmp_path / f".ds.tmp-elsewhere-{p.pid}-0123abcd"
    for f in (dead, alive, other): (f / "sub").mkdir(parents=True)
    with pytest.warns(D.DataWarning) as said:
        prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    msgs = [str(w.message) for w in said]
    assert any(m.startswith(f"removed {dead.name} from {tmp_path}") for m in msgs), msgs
    assert any(alive.name in m and other.name in m and "stopped or still running" in m for m in msgs), msgs
    assert not dead.exists() and alive.exists() and other.exists()
    dead.mkdir()  # and when the dataset is there already (nothing to write), too
    with pytest.warns(D.DataWarning, match=f"removed {dead.name}"): prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    assert not dead.exists()
    assert D._WORK.fullmatch(D._work_folder(tmp_path / "x-y.z").name)["out"] == "x-y.z"
    assert D._stopped_here(D._work_folder(tmp_path / "x")) is False  # this process's own


def test_sigterm_during_prepare_cleans_up_and_exits_as_killed(text, tmp_path, monkeypatch, capsys):
    "A scheduler's SIGTERM used to kill `prepare` outright, leaving its work folder."
    import signal, time
    from hymo.data import main
    def stopped(folder, *a, **k):
        np.save(folder / "train_0000.npy", np.zeros(3, np.uint16))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    monkeypatch.setattr(D, "_write_dataset", stopped)
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB),
                 "--no-progress"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert err.startswith("stopped by SIGTERM; ") and "is as it was" in err, err
    assert list(tmp_path.iterdir()) == [] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    from hymo.data import _stop_signals_interrupt
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # under nohup: a closed terminal must not stop it
    try:
        with _stop_signals_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally: signal.signal(signal.SIGHUP, old)


def test_a_disk_quota_reached_is_one_line(text, tmp_path, monkeypatch, capsys):
    "EDQUOT, as ENOSPC: --out's error, said in a line with what to do, not a traceback."
    import errno
    from hymo.data import main
    def over_quota(folder, *a, **k): raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(folder / "train_0000.npy"))
    monkeypatch.setattr(D, "_write_dataset", over_quota)
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert os.strerror(errno.EDQUOT) in err and "free space or choose another --out" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_refused_prepare_says_what_changed(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(CORPUS.read_text()[:8000]); b.write_text(CORPUS.read_text()[8000:12000])
    out = prepare([a], tmp_path / "ds", vocab_size=VOCAB, progress=False)
    a.write_text(a.read_text() + "More.\n")
    with pytest.raises(DataError, match=r"other inputs or options \(a\.txt changed; b\.txt added; vocab_size 300 -> 320; "
                                        r"val_fraction 0\.1 -> 0\.2\): pass --overwrite"):
        prepare([a, b], out, vocab_size=VOCAB + 20, val_fraction=0.2, progress=False)
    with pytest.raises(DataError, match=r"\(b\.txt added; a\.txt not given\)"): prepare([b], out, vocab_size=VOCAB, progress=False)
    assert D._what_changed(None, {"inputs": []}) == "" and D._what_changed({"inputs": 3}, {"inputs": []}) == ""
    src = lambda inputs, **kw: {"format": D.FORMAT, "inputs": inputs, "tokenizer": None, "vocab_size": 300,
                                "tokenizer_train_bytes": 2 ** 30, **kw}
    assert D._what_changed(src([["a", "1"], ["b", "2"]]), src([["b", "2"], ["a", "1"]])) == "the inputs in another order"
    assert D._what_changed(src([["a", "1"]]), src([["a", "1"]], tokenizer="f00", vocab_size=None,
                                                  tokenizer_train_bytes=None)) == "another tokenizer"


def test_what_a_folder_without_a_manifest_is_said_to_be(ds, text, tmp_path):
    "The advice used to be 'prepare --input THIS' for any non-empty folder, texts or not."
    parent = tmp_path / "data"
    _copy(ds, parent / "one"); _copy(ds, parent / "two")
    with pytest.raises(DataError, match=rf"{parent} is not a prepared dataset but holds 2 datasets: give one of them, {parent / 'one'}"):
        load_manifest(parent)
    half = tmp_path / "half"; half.mkdir()
    for f in ("train_0000.npy", "tokenizer.json"): (half / f).write_bytes((ds / f).read_bytes())
    with pytest.raises(DataError, match=r"holds part of a prepared dataset \(tokenizer\.json, train_0000\.npy\) but no manifest"):
        load_manifest(half)
    work = tmp_path / f".ds.tmp-{D._HOST}-1-0123abcd"; work.mkdir(); (work / "x").write_text("")
    with pytest.raises(DataError, match=rf"work folder of a prepare that did not finish .* installed as {tmp_path / 'ds'}"):
        load_manifest(work)
    other = tmp_path / "other"; other.mkdir(); (other / "notes.pdf").write_text("")
    with pytest.raises(DataError, match=r"holds no text to prepare"): load_manifest(other)
    with pytest.raises(DataError, match=r"is a file, not a prepared dataset"): load_manifest(other / "notes.pdf")
    (other / "sub").mkdir(); (other / "sub" / "t.md").write_text("words\n")
    with pytest.raises(DataError, match=rf"prepare --input {other} --out {tmp_path / 'other_prepared'}"): load_manifest(other)


def test_a_bad_out_is_refused_before_any_input_is_read(text, tmp_path, monkeypatch):
    monkeypatch.setattr(D, "sha256_file", lambda p: pytest.fail("read an input before checking --out"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataError, match="is a file: give a new or empty folder"): prepare(text, tmp_path / "f", progress=False)
    (tmp_path / "d").mkdir(); (tmp_path / "d" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="exists and is not a HyMo dataset"): prepare(text, tmp_path / "d", progress=False)


def test_what_the_prepare_command_says(text, tmp_path, capsys):
    "A second run says it wrote nothing; counts of one are singular; no bar is drawn into a file; a folder as --tokenizer."
    from hymo.data import main
    args = ["prepare", "--input", str(text), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB)]
    assert main(args) == 0  # progress on, but stderr is not a terminal
    out, err = capsys.readouterr()
    assert "nothing written" not in out and "tokenizing" not in err and "\r" not in err, err
    assert main(args) == 0 and "note: nothing written: it already held this dataset" in capsys.readouterr().out
    one = tmp_path / "one.txt"; one.write_text("One document only.\n")
    assert main(["prepare", "--input", str(one), "--out", str(tmp_path / "one"), "--val-fraction", "0", "--no-progress"]) == 0
    assert "1 input file, " in (o := capsys.readouterr().out) and " in 1 document," in o + ",", o
    assert main(["prepare", "--input", str(text), "--out", str(tmp_path / "t"), "--tokenizer", str(tmp_path / "ds")]) == 1
    assert f"(--tokenizer {tmp_path / 'ds' / 'tokenizer.json'})" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes("line one\nline two\nca\u00f1a ".encode() + b"\xff\xfe more\n")
    with pytest.raises(DataError, match=r"bad\.txt is not UTF-8 text \(line 3, byte 24: b'\\xff\\xfe m'\)"):
        list(D.read_documents(bad))


def test_a_link_in_a_folder_to_a_file_of_it_is_named(tmp_path):
    d = tmp_path / "c"; d.mkdir()
    (d / "a.txt").write_text("words\n")
    (d / "latest.txt").symlink_to(d / "a.txt")
    with pytest.raises(DataError, match=r"given twice \(as c/a\.txt and as c/latest\.txt; .*latest\.txt is a link to .*a\.txt\)"):
        D.find_files([d])


def test_a_stop_between_the_two_renames_puts_the_old_dataset_back(text, tmp_path, monkeypatch, capsys):
    "SIGTERM after the old dataset was moved aside used to leave DIR missing, the new one deleted, and say 'as it was'."
    import signal
    from hymo.data import main
    out = prepare(text, tmp_path / "ds", vocab_size=VOCAB, progress=False)
    before = (out / "manifest.json").read_text()
    real = os.replace
    def stopped(src, dst):
        if ".tmp-" in Path(src).name and Path(dst) == out: os.kill(os.getpid(), signal.SIGTERM)
        return real(src, dst)
    monkeypatch.setattr(D.os, "replace", stopped)
    assert main(["prepare", "--input", str(text), "--out", str(out), "--vocab-size", str(VOCAB + 20), "--overwrite",
                 "--no-progress"]) == 128 + signal.SIGTERM
    assert "is as it was" in capsys.readouterr().err
    assert (out / "manifest.json").read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_ctrl_c_does_not_wait_for_the_tokenizer_trainer(monkeypatch):
    "The Rust BPE trainer never looks for signals while it merges: a Ctrl-C waited for it (minutes on a GiB)."
    import signal, threading, time
    real, calls = D._in_a_thread, []
    monkeypatch.setattr(D, "_in_a_thread", lambda fn: calls.append(fn) or real(fn))
    assert D.train_tokenizer(["a few words", "and a few more"], 300).get_vocab_size() > 256
    assert len(calls) == 1  # the trainer runs in a worker thread
    monkeypatch.setattr(D, "_in_a_thread", real)
    assert D._in_a_thread(lambda: 7) == 7
    with pytest.raises(ValueError, match="from the worker"): D._in_a_thread(lambda: (_ for _ in ()).throw(ValueError("from the worker")))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job (CI's) starts with SIGINT ignored
    try:
        timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
        t0 = time.perf_counter()
        timer.start()
        with pytest.raises(KeyboardInterrupt): D._in_a_thread(lambda: time.sleep(8))  # a call that ignores signals, as Rust does
        assert time.perf_counter() - t0 < 4, "the interrupt waited for the worker"
    finally: signal.signal(signal.SIGINT, old)


def test_the_validation_cut_is_the_exact_floor_and_an_eval_loader_has_no_epoch(ds):
    "int((1 - 0.9) * 10) is 0 in floats: the cut at floor(0.1 * 10) = 1 byte put the first line in validation too."
    docs = ["a\n", "b\n", "c\n", "d\n", "e\n"]
    assert list(split_train_val(docs, 10, 0.9))[0] == ("train", "a\n")
    L = TokenLoader(ds, "val", seq_len=16, micro_batch_size=100, accum=2, eval_only=True)  # 175 windows: < one step
    with pytest.raises(DataError, match="serves `eval_batches` only"): L.epoch


def test_prepare_takes_what_the_exact_cut_leaves_and_any_number_type_for_the_fraction(tmp_path):
    "prepare still used the float cut for its no-training-text check: 10 bytes at 0.9 were refused; a numpy or bool fraction crashed."
    (tmp_path / "ten.txt").write_text("a\nb\nc\nd\ne\n")
    ds = prepare(tmp_path / "ten.txt", tmp_path / "ds", vocab_size=300, val_fraction=0.9, progress=False)
    assert load_manifest(ds)["splits"]["train"]["tokens"] > 0
    assert list(split_train_val(["ab\n", "cd\n"], 6, np.float32(0.5))) == list(split_train_val(["ab\n", "cd\n"], 6, 0.5))
    assert list(split_train_val(["ab\n"], 3, False)) == [("train", "ab\n")]
    # numpy's numbers reach the manifest as Python's (json cannot write numpy's: a TypeError before)
    ds = prepare(tmp_path / "ten.txt", tmp_path / "np", vocab_size=np.int64(300), val_fraction=np.float32(0.5),
                 shard_tokens=np.int64(1000), tokenizer_train_bytes=np.int64(10**6), progress=False)
    source = load_manifest(ds)["source"]
    assert (source["vocab_size"], source["val_fraction"], source["shard_tokens"]) == (300, 0.5, 1000)


def _copy_ds(ds, tmp_path):
    import shutil
    shutil.copytree(ds, tmp_path / "ds")
    return tmp_path / "ds"


def test_an_empty_shard_is_damage_that_prepare_repairs(text, ds, tmp_path):
    "numpy raises EOFError for an empty file, which escaped as a traceback from training, info and even prepare --overwrite."
    out = _copy_ds(ds, tmp_path)
    (out / "train_0000.npy").write_bytes(b"")
    with pytest.raises(DataError, match=r"train_0000.npy cannot be read \(.*\): the dataset is damaged"): check_compatible(out, VOCAB)
    with pytest.warns(D.DataWarning, match="holds this dataset damaged"):
        prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False)
    assert D.check_contents(out) is True


def test_a_shard_header_whose_byte_order_flipped_is_damage(text, ds, tmp_path):
    "'<u2' to '>u2' (one bit) swaps every token's bytes; dtype.name is 'uint16' either way, and the CRC covers the data only."
    out = _copy_ds(ds, tmp_path)
    p = out / "train_0000.npy"
    p.write_bytes(p.read_bytes().replace(b"'<u2'", b"'>u2'", 1))
    with pytest.raises(DataError, match=r"train_0000.npy holds 1000 >u2 tokens, the manifest says 1000 uint16"):
        check_compatible(out, VOCAB)
    with pytest.raises(DataError, match=">u2 tokens"): D.check_contents(out)  # `info` called it intact


@pytest.mark.parametrize("old, new, says", [('"train": {', '"tr`in": {', "splits \\['tr`in', 'val'\\], not train and val"),
                                           ('"val": {', '"~al": {', "splits \\['train', '~al'\\]"),
                                           ('"eot_token": "<|endoftext|>"', '"eot_token": "<|endoftext|?"', "its CRC-32"),
                                           ('"fingerprint": "', '"fingerprint": "0', "fingerprint \\(not its source's\\)")])
def test_a_manifest_changed_as_valid_json_is_damage(text, ds, tmp_path, old, new, says):
    """A flipped letter of a split's name read as a dataset without that split (no validation loss, without a word), one
    of the fingerprint as 'prepared from other inputs'; the manifest's own CRC-32 catches any change (older ones have none)."""
    out = _copy_ds(ds, tmp_path)
    m = out / "manifest.json"
    assert old in m.read_text()
    m.write_text(m.read_text().replace(old, new, 1))
    with pytest.raises(DataError, match=f"manifest.json is damaged \\(missing or wrong: .*{says}"): load_manifest(out)
    with pytest.raises(DataError, match="is damaged"): prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False)
    prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False, overwrite=True)
    assert D.check_contents(out) is True and load_manifest(out)["manifest_crc32"] == D.manifest_sum(load_manifest(out))


def test_a_dataset_that_lost_only_its_manifest_is_prepared_again_with_overwrite(text, ds, tmp_path):
    "It was 'not a HyMo dataset: choose an empty or new folder' even with --overwrite, and the bundled cache never recovered."
    out = _copy_ds(ds, tmp_path)
    (out / "manifest.json").unlink()
    with pytest.raises(DataError, match="holds part of a HyMo dataset, without its manifest.json: pass --overwrite"):
        prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False)
    prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False, overwrite=True)
    assert D.check_contents(out) is True
    (out / "manifest.json").unlink(); (out / "notes.md").write_text("mine")  # someone's file: never replaced
    with pytest.raises(DataError, match="exists and is not a HyMo dataset"):
        prepare(text, out, vocab_size=VOCAB, shard_tokens=1000, progress=False, overwrite=True)
    cache = prepare_default(tmp_path / "cache", vocab_size=VOCAB, progress=False)
    (cache / "manifest.json").unlink()
    assert prepare_default(tmp_path / "cache", vocab_size=VOCAB, progress=False) == cache and D.check_contents(cache) is True


def test_a_link_that_loops_in_an_input_folder_is_named_not_a_traceback(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("Some text.\n")
    (tmp_path / "in" / "loop.txt").symlink_to("loop.txt")
    with pytest.warns(D.DataWarning, match=r"skipped 1 link \(loop.txt\)"):
        assert [n for _, n in D.find_files([tmp_path / "in"])] == ["in/a.txt"]


def test_an_input_that_changes_while_it_is_prepared_is_refused(text, tmp_path, monkeypatch):
    "A download still appending: the shards held text the manifest's sha256 never saw, and nothing said so."
    src = tmp_path / "grow.txt"
    src.write_text(text.read_text())
    real = D._write_dataset
    def growing(*a, **k):
        with open(src, "a") as f: f.write("\n\nMore text arrives.\n")
        return real(*a, **k)
    monkeypatch.setattr(D, "_write_dataset", growing)
    with pytest.raises(DataError, match="grow.txt changed while it was being prepared .*nothing was written"):
        prepare(src, tmp_path / "out", vocab_size=VOCAB, progress=False)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
