# %% [markdown]
# # Data
#
# > Text in, token shards out, and a loader that hands every rank its own windows in an order that survives a restart.

# %%
#| default_exp training.data

# %% [markdown]
# A language model sees its data as one long stream of token ids. This chapter builds that stream
# and reads it back:
#
# 1. **Documents.** Read text files, folders, `.jsonl` and `.parquet`; cut them into documents.
# 2. **Split.** The last 10 % of the bytes (cut on a line boundary) is the validation split.
# 3. **Tokenizer.** Train a byte-level BPE on the training split (Hugging Face `tokenizers`), with
#    one special token, `<|endoftext|>` (EOT), that ends every document.
# 4. **Shards.** Encode, append an EOT after every document, and write `uint16` shards (`uint32` above 65 536 tokens; `.npy`)
#    plus a JSON manifest. Everything goes to a temporary folder that is renamed when complete, and
#    an input that was already prepared is not prepared again.
# 5. **Loader.** Memory-map the shards and cut them into windows of `seq_len + 1` tokens; shuffle
#    the windows per epoch from a seeded generator; give each data-parallel rank its own; return
#    the document boundaries (`cu_seqlens`) when asked; save and restore the position.
#
# `python -m hymo.data prepare` (the next chapter) runs steps 1–4 from the command line;
# `python -m hymo.train` with no data argument calls `prepare_default`, which prepares the bundled
# Shakespeare once into a cache folder.

# %%
#| export
from __future__ import annotations

import glob
import errno
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import socket
import sys
import threading
import uuid
import warnings
import zlib
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
from tqdm import tqdm

from hymo.config import package_dir, shell_word

# %% [markdown]
# `torch` is imported only where tensors are made (the loader), so that `python -m hymo.data
# prepare` starts without paying for it.

# %%
import tempfile
import time

import matplotlib.pyplot as plt
import torch
from fastcore.test import test_close, test_eq, test_fail, test_ne

# %% [markdown]
# The constants every other function refers to. The dataset format carries a version, so that a
# later change of layout is detected instead of misread.

# %%
#| export
EOT = "<|endoftext|>"  # The end-of-document token; it also opens the next document (see cu_seqlens)
FORMAT = "hymo-tokens-v1"  # Version of the shard + manifest layout
SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")  # File types `prepare` reads
DEFAULT_VOCAB_SIZE = 2048  # The vocabulary of hymo_tiny
CORPUS = package_dir() / "assets" / "tinyshakespeare.txt"  # The bundled corpus


class DataError(ValueError):
    "Data that cannot be used; the message says what to do."


class DataWarning(UserWarning):
    "Data that can be used, perhaps not as meant; the message says what was done and how to change it."


# %% [markdown]
# ## Documents
#
# A *document* is a unit the model should be able to tell apart from its neighbours: an EOT token
# follows each one, and with document masking attention never crosses from one to the next. Rows
# of `.jsonl` (the `text` field) and `.parquet` (the `text` column) are documents. Plain text
# (`.txt`, `.md`) has no such structure, so there is a choice:
#
# - `doc_split="blank"` (the default): a run of blank lines ends a document. In Shakespeare that
#   makes every speech a document (7 222 of them, 153 bytes on average), which gives the loader
#   real document boundaries to pack and mask.
# - `doc_split="file"`: every file is one document, right for books or source files whose
#   paragraphs belong together.
#
# A document keeps its inner newlines and ends with exactly one `"\n"`; the blank lines between
# documents are replaced by the EOT token. Text files are read with Python's universal newlines, so
# Windows' `"\r\n"` and a lone `"\r"` arrive as `"\n"` (a `"\r"` inside a `.jsonl` text is kept).

# %%
#| export
_BLANK_LINES = re.compile(r"\n\s*\n")


def split_text(text: str, # Plain text, e.g. a whole file
               doc_split: str = "blank", # 'blank': blank lines end a document; 'file': the text is one document
              ) -> list[str]:
    "Cut plain text into documents, each ending in one newline; whitespace-only pieces are dropped."
    if doc_split not in ("blank", "file"): raise DataError(f"doc_split={doc_split!r}: choose 'blank' or 'file'")
    pieces = _BLANK_LINES.split(text) if doc_split == "blank" else [text]
    return [p.rstrip("\r\n") + "\n" for p in pieces if p.strip()]


# %%
docs = split_text("First Citizen:\nSpeak, speak.\n\n\nAll:\n  Speak.\n\n")
test_eq(docs, ["First Citizen:\nSpeak, speak.\n", "All:\n  Speak.\n"])
test_eq(split_text("a\n\nb\n", "file"), ["a\n\nb\n"])


# %% [markdown]
# Inputs are files or folders. A folder is searched recursively for the four supported types, in
# sorted order of their relative paths (so the stream does not depend on the file system's
# listing order); a file of any other type given by name is an error rather than silently skipped.
# Hidden files and folders (`.git`, `.ipynb_checkpoints`) are skipped, with a warning that names the text files
# among them (a corpus kept as `.drafts/*.txt` is not lost without a word). So are `NOTES.TXT` and other suffixes not in lower case, with
# a warning that names them (reading them now would change datasets prepared before from such a
# folder); a folder with nothing else is an error that names them. Files of other types in a folder
# (`notes.rst`, `data.json`, `corpus.txt.gz`) are skipped with a warning that counts them by
# suffix, so that a corpus half of which is compressed does not quietly become its other half.
# The search does not follow links to folders (a link can make a cycle), and a link to a missing
# file has nothing to read: a link to a folder elsewhere, or to a missing text file, is skipped with
# a warning that names it, so a corpus whose books are linked in from elsewhere does not quietly lose
# them (give a linked folder as an input of its own; a link that loops is named so too). When `--out` is inside an input folder, the
# files `prepare` writes there (shards, manifest, tokenizer) are neither read nor counted; anything
# else in it is, as anywhere.
# Every file found is opened once before any work starts, so one that cannot be read (no
# permission) is a one-line error at once, not a traceback halfway through. `prepare` reads each input more than once
# (to count its bytes, to train the tokenizer, to encode it), so what is not a regular file (a named pipe, whose
# opening would wait for a writer, a socket, a device) is refused as an input and skipped, named, in a folder.

# %%
#| export
def _by_suffix(counts: Counter) -> str:
    "'3 files of other types (.json 2, .rst 1)'"
    n = sum(counts.values())
    return f"{n} file{'s' * (n > 1)} of other types ({', '.join(f'{k} {v}' for k, v in counts.most_common())})"


def find_files(inputs: Iterable, # Paths of files or folders
               out: Path | None = None, # The dataset's folder: not read, nor counted as skipped, when it is inside an input
              ) -> list[tuple[Path, str]]:
    "The files to read, in order, as `(path, name)`: `name` is the path from the input given (a folder's name first)."
    inputs = [Path(p) for p in ([inputs] if isinstance(inputs, (str, Path)) else inputs)]
    if not inputs: raise DataError("no input given: pass one or more text files, folders, .jsonl or .parquet files")
    files = []
    for p in inputs:
        if not p.exists(): raise DataError(f"input {p} does not exist: give a text file, a folder, a .jsonl or a .parquet file")
        if p.is_dir():
            mine = None  # --out inside this folder: its path as rglob gives it, p/...
            if out is not None and Path(os.path.abspath(out)).is_relative_to(os.path.abspath(p)):
                mine = p / Path(os.path.abspath(out)).relative_to(os.path.abspath(p))
            every = [f for f in p.rglob("*") if mine is None or not (_DATASET_FILE.fullmatch(f.name) and f.parent == mine)]
            hidden = lambda f: any(part.startswith(".") for part in f.relative_to(p).parts)  # .git, .ipynb_checkpoints
            entries = [f for f in every if not hidden(f)]
            visible = [f for f in entries if f.is_file()]
            found = sorted((f for f in visible if f.suffix in SUFFIXES), key=lambda f: f.relative_to(p).as_posix())
            skipped = []  # what is not read, each with what to do about it
            names = lambda what, fs: f"{len(fs)} {what}{'s' * (len(fs) > 1)} ({', '.join(fs[:3])}{', ...' * (len(fs) > 3)})"
            cased = sorted(f.relative_to(p).as_posix() for f in visible if f.suffix not in SUFFIXES and f.suffix.lower() in SUFFIXES)
            if cased:  # `A.TXT` is not read (reading it now would change the datasets already prepared from such folders)
                skipped.append(names("file", cased) + f" whose suffix is not lower case: rename "
                               f"{'them' if len(cased) > 1 else 'it'} to be read")
            def inside(f):  # a link into the folder: its files are read anyway
                try: return f.resolve().is_relative_to(p.resolve())
                except (RuntimeError, OSError): return False  # a link that loops (Python 3.11: RuntimeError; 3.13: OSError)
            links = sorted(f.relative_to(p).as_posix() for f in entries if f.is_symlink() and not f.is_file() and not inside(f)
                           and (f.is_dir() or not f.exists() and f.suffix.lower() in SUFFIXES))  # a folder, or a text file not there
            if links:
                skipped.append(names("link", links) + " to a folder elsewhere or to a missing file, not followed: "
                               "give a linked folder as an input of its own")
            unseen = sorted(f.relative_to(p).as_posix() for f in every if hidden(f) and f.suffix.lower() in SUFFIXES and f.is_file())
            special = sorted(f.relative_to(p).as_posix() for f in entries if f.exists() and not (f.is_file() or f.is_dir()))
            if special:  # opened, a named pipe would wait for a writer; and each input is read more than once
                skipped.append(names("special file", special) + ", a named pipe, socket or device: save what it gives to "
                               "a regular file to read it")
            if unseen:  # only text files are named: a .git folder's objects are nobody's corpus
                skipped.append(names("hidden file", unseen) + " (a name, or a folder's, starting with '.'): give "
                               f"{'them' if len(unseen) > 1 else 'it'} as inputs of {'their' if len(unseen) > 1 else 'its'} own to read {'them' if len(unseen) > 1 else 'it'}")
            other = Counter(f.suffix or "no suffix" for f in visible if f.suffix.lower() not in SUFFIXES)
            if other:
                skipped.append(f"{_by_suffix(other)}: only {', '.join(SUFFIXES)} files are read (decompress or convert the "
                               "others to read them)")
            if not found: raise DataError(f"folder {p} holds no {', '.join(SUFFIXES)} files" + (
                f", only {'; and '.join(skipped)}" if skipped else ""))
            for why in skipped: warnings.warn(f"folder {p}: skipped {why}", DataWarning, stacklevel=2)
            label = Path(os.path.abspath(p)).name  # `--input .` is named as the folder it is, as `--input ../here` would be
            files += [(f, f"{label}/{f.relative_to(p).as_posix()}") for f in found]
        elif not p.is_file():  # opened, a named pipe would wait for a writer; and each input is read more than once
            raise DataError(f"input {p} is not a regular file (a named pipe, socket or device): prepare reads each input "
                            "more than once; save what it gives to a file, and give that")
        elif p.suffix in SUFFIXES: files.append((p, p.name))
        else: raise DataError(f"unknown file type '{p.suffix}' of {p}: give {', '.join(SUFFIXES)} files, or a folder of them")
    seen = {}
    for f, name in files:
        key = f.resolve()
        if key in seen:
            how = next((f"{p} is a link to {key}" for p in (seen[key][0], f) if p.is_symlink()), "")  # in a folder, say
            raise DataError(f"input {f} is given twice (as {seen[key][1]} and as {name}{'; ' + how if how else ''}): its "
                            "documents would be trained on twice, and could be in both splits; give each file once (to "
                            "weight a file more on purpose, give a copy of it under another name)")
        seen[key] = f, name
    for f, _ in files: _check_readable(f, "input")
    return files


def _check_readable(path: Path, what: str):
    "A `DataError` if `path` cannot be opened for reading (no permission, a broken link), said before any work starts."
    try: open(path, "rb").close()
    except OSError as e: raise DataError(f"{what} {path} cannot be read ({e.strerror}): check its permissions, or leave it out") from None


# %% [markdown]
# Reading one file yields its documents. `.parquet` needs `pyarrow` (a dev dependency) and is
# read in record batches, so a large file is never fully in memory. A file pyarrow cannot read
# (not Parquet, cut short, a damaged page) raises `ArrowInvalid` when opened, or a bare `OSError`
# when a damaged page is decoded, possibly long after the first documents: both become a
# `DataError` naming the file. Text files and `.jsonl` must be UTF-8, with one message for both.
# A `.jsonl` line needs a `text` field; in both formats a null or blank text is an empty document, skipped.
# A UTF-8 byte-order mark at the start of a text or `.jsonl` file is dropped, not trained on. A NUL
# character is valid UTF-8 but no text has one: a text file that holds NULs is refused, since it is
# most often UTF-16 without its byte-order mark (every other byte NUL), which would train on garbage.
# The message gives the line that converts it (`iconv`), or, for a few stray NULs, the one that drops them.

# %%
#| export
def _not_utf8(path: Path) -> DataError:
    "The error for a file that is not UTF-8 text, with the line and byte where it stops being UTF-8."
    where, at = "", 0
    with open(path, "rb") as f:
        if f.read(2) in (b"\xff\xfe", b"\xfe\xff"):  # a UTF-16 byte-order mark: iconv reads the byte order from it
            return DataError(f"{path} is UTF-16 text (it starts with UTF-16's byte-order mark), not UTF-8: convert it: "
                             + _in_place(path, "iconv -f UTF-16 -t UTF-8"))
        f.seek(0)
        for i, line in enumerate(f, 1):
            try: line.decode("utf-8")
            except UnicodeDecodeError as e:
                where = f" (line {i}, byte {at + e.start:,}: {line[e.start:e.start + 4]!r})"; break
            at += len(line)
    return DataError(f"{path} is not UTF-8 text{where}: convert it ({_in_place(path, 'iconv -f ENCODING -t UTF-8')}, "
                     "ENCODING being the file's: latin1, cp1252, ...), or fix or drop that line")


def _in_place(path: Path, command: str) -> str:
    "A shell line that rewrites `path` through `command` (`command < path`), the new text replacing the old."
    new = path.with_name(path.name + ".new")  # (not a suffix prepare reads, should the mv not run)
    old, new = shell_word(path), shell_word(new)  # a name with spaces or quotes
    return f"{command} < {old} > {new} && mv {new} {old}"


def _parquet_docs(path: Path) -> Iterator[str]:
    try: import pyarrow as pa, pyarrow.parquet as pq
    except ImportError as e: raise DataError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    try:
        f = pq.ParquetFile(path)
        names, col = f.schema_arrow.names, "text"
        if col not in names:  # another string column may be a URL or an id: guessing could train on it
            raise DataError(f"{path}: no 'text' column (columns: {names}); rename the column that holds the documents to 'text'")
        for batch in f.iter_batches(columns=[col], batch_size=4096):
            for t in batch.column(0).to_pylist():
                if t is not None and not isinstance(t, str):  # a 'text' column of numbers or bytes
                    raise DataError(f"{path}: column {col!r} holds {type(t).__name__} values, not text: store the documents as strings")
                if t and t.strip(): yield t
    except (pa.ArrowException, OSError) as e:  # pyarrow's IOError is OSError, raised without a file name
        raise DataError(f"{path} cannot be read as Parquet ({e}): write it again, e.g. with pyarrow.parquet.write_table") from e


def _jsonl_docs(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8-sig") as fh:  # -sig: a byte-order mark (Windows editors write one) is not text
        try:
            for i, line in enumerate(fh, 1):
                if not line.strip(): continue
                try: row = json.loads(line)
                except json.JSONDecodeError as e: raise DataError(f"{path}:{i} is not valid JSON ({e.msg}): one JSON object per line") from e
                if not isinstance(row, dict) or not isinstance(row.get("text", 0), (str, type(None))):
                    raise DataError(f"{path}:{i} has no string field 'text': each line must be {{\"text\": \"...\"}}")
                t = row["text"]  # null, like a Parquet null, is an empty document: skipped
                if t and t.strip():
                    try: t.encode("utf-8")
                    except UnicodeEncodeError as e:  # a lone surrogate escape, "\ud800": JSON allows it, UTF-8 does not
                        raise DataError(f"{path}:{i} has text that is not valid Unicode ({e.reason}, {t[e.start:e.end]!r} "
                                        f"at character {e.start}): fix or drop that line") from None
                    yield t
        except UnicodeDecodeError as e: raise _not_utf8(path) from e


def read_documents(path: Path, # A .txt, .md, .jsonl or .parquet file
                   doc_split: str = "blank", # How plain text is cut: 'blank' or 'file' (see `split_text`)
                  ) -> Iterator[str]:
    "The non-empty documents of one file, in order."
    path = Path(path)
    if path.suffix == ".jsonl": yield from _jsonl_docs(path)
    elif path.suffix == ".parquet": yield from _parquet_docs(path)
    elif path.suffix in (".txt", ".md"):
        try: text = path.read_text(encoding="utf-8-sig")  # without a byte-order mark, which is no part of the text
        except UnicodeDecodeError as e: raise _not_utf8(path) from e
        if (at := text.find("\x00")) >= 0:  # valid UTF-8, but no text has NULs: UTF-16 without a byte-order mark, or binary
            n = text.count("\x00")
            if 4 * n >= len(text):  # UTF-16 of mostly Latin text: a NUL beside every letter (before it: big-endian)
                fix = ("if it is UTF-16 (Windows' 'Unicode'), convert it: "
                       + _in_place(path, f"iconv -f UTF-16{'BE' if at == 0 else 'LE'} -t UTF-8"))
            else:  # a few stray NULs in text
                fix = "if the rest is text, drop them: " + _in_place(path, "tr -d '\\000'")
            raise DataError(f"{path} holds {n:,} NUL character{'s' * (n > 1)} (the first at character {at:,}): it is not "
                            f"plain text; {fix}; if it is not text, leave it out")
        yield from split_text(text, doc_split)
    else: raise DataError(f"unknown file type '{path.suffix}' of {path}: give {', '.join(SUFFIXES)} files")


# %%
shakespeare = list(read_documents(CORPUS))
n_bytes = sum(len(d.encode()) for d in shakespeare)
print(f"{len(shakespeare)} speeches, {n_bytes:,} bytes, {n_bytes / len(shakespeare):.0f} bytes each on average")
print(shakespeare[0] + "---\n" + shakespeare[1])
test_eq(len(shakespeare), 7222)
assert all(d.endswith("\n") and not d.endswith("\n\n") for d in shakespeare)


# %% [markdown]
# ## The validation split
#
# The validation split is the end of the corpus: with $N$ bytes of documents in order and a
# fraction $f$, the cut is the first line boundary at or after byte $c = \lfloor (1 - f) N \rfloor$.
# A document that straddles $c$ is cut at that newline (its head ends the training split, its
# tail opens the validation split); a document that does not contain a newline after $c$ stays
# whole in training. Taking the *end* rather than random documents keeps most near-duplicates of
# training text out of the split (neighbouring speeches share characters and phrases), so the
# validation loss measures generalisation to a later part of the play collection.

# %%
#| export
def _train_bytes(total_bytes: int, val_fraction: float) -> int:
    "Where validation starts, before moving to a line boundary: ⌊(1 - f) N⌋, exactly (in floats int((1 - 0.9) * 10) is 0)."
    if not 0 <= val_fraction < 1: raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    return math.floor((1 - Fraction(str(float(val_fraction)))) * total_bytes)


def split_train_val(docs: Iterable[str], # Documents in corpus order
                    total_bytes: int, # UTF-8 bytes of all documents (a first pass counts them)
                    val_fraction: float = 0.1, # Fraction of the bytes, at the end, that goes to validation
                   ) -> Iterator[tuple[str, str]]:
    "Yield `('train', doc)` then `('val', doc)`: the cut is the first line boundary at or after `(1 - val_fraction) * total_bytes`."
    cut, pos = _train_bytes(total_bytes, val_fraction), 0
    for d in docs:
        b = d.encode("utf-8")
        if pos + len(b) <= cut: yield "train", d
        elif pos >= cut: yield "val", d
        else:  # the cut falls inside this document: end it at the next newline
            i = b.find(b"\n", max(cut - pos - 1, 0))  # a newline at byte cut - 1 ends the line at the cut
            head, tail = (b, b"") if i < 0 else (b[:i + 1], b[i + 1:])
            yield "train", head.decode("utf-8")
            if tail.strip(): yield "val", tail.decode("utf-8")
        pos += len(b)


# %%
toy = ["aaaa\nbbbb\n", "cccc\n", "dddd\neeee\n"]  # 25 bytes; 40 % validation cuts at byte 15
test_eq(list(split_train_val(toy, 25, 0.4)), [("train", "aaaa\nbbbb\n"), ("train", "cccc\n"), ("val", "dddd\neeee\n")])
test_eq(list(split_train_val(toy, 25, 0.3)), [("train", "aaaa\nbbbb\n"), ("train", "cccc\n"), ("train", "dddd\n"), ("val", "eeee\n")])
test_eq(list(split_train_val(["aaaa\nbbbb\n"], 10, 0.5)), [("train", "aaaa\n"), ("val", "bbbb\n")])  # a boundary exactly at the cut
test_fail(lambda: list(split_train_val(toy, 25, 1.0)), contains="must be in [0, 1)")


# %% [markdown]
# ## The tokenizer
#
# Byte-level BPE (GPT-2's scheme): text is first turned into bytes, each byte mapped to one of 256
# printable symbols, so every string is encodable and decoding is exact; the GPT-2 regex
# pre-tokenizer splits words, numbers and punctuation; BPE then learns up to `vocab_size - 257` merges
# (256 byte symbols and EOT are fixed; fewer if the text runs out of pairs to merge, which the data
# CLI reports). No space is added before a document's first word (`add_prefix_space=False`, where the
# library's default is True): "hello" after an EOT is tokenised as it is, without the `Ġ` of
# " hello", and chapter 72 encodes prompts the same way. On the 1 MB corpus, training takes under a second on a laptop CPU.
# The trainer counts merges within words, in time that grows with the square of a word's length, so
# runs of more than 1000 characters without whitespace (a line of base64, say) are broken up for it
# first; ordinary text has none. While the trainer merges, no Python runs, so a Ctrl-C would wait for it (seconds
# here, minutes on the gibibyte the tokenizer may learn from); it runs in a worker thread (`_in_a_thread`), and the
# main thread stops at once.
#
# `encode_special_tokens = True` makes the tokenizer encode a literal `<|endoftext|>` *in the
# text* as ordinary characters. Without it, a document that quotes the string would inject a
# document boundary; EOT ids then come only from the pipeline. The flag is not saved in
# `tokenizer.json`: a tokenizer read back with `Tokenizer.from_file` encodes the literal string as
# EOT again, which is why HyMo's loaders (`tokenizer_from_json`, `load_run`) set it after reading.

# %%
#| export
def _check_vocab_size(vocab_size: int):
    if vocab_size < 257: raise DataError(f"vocab_size={vocab_size} must be at least 257: the 256 byte symbols and {EOT}")
    if vocab_size > 2**24:  # the tokenizer trainer reserves memory in proportion (2**32 asks for some 280 GB)
        raise DataError(f"vocab_size={vocab_size} is above 2**24 = 16,777,216, far beyond any language model's vocabulary")


LONG_RUN = 1000  # characters without a space: the BPE trainer's time grows with the square of a word's length


def _short_runs(docs: Iterable[str]) -> Iterator[str]:
    """`docs` with a space after every `LONG_RUN` characters of a longer run without whitespace. The trainer counts
    merges within words, and one 10 MB line of base64 or DNA would keep it busy for hours; broken up, it costs what
    ordinary text does (and no merge is longer than `LONG_RUN`). Text without such runs is passed on as it is."""
    long = re.compile(r"\S{%d}(?=\S)" % LONG_RUN)
    for d in docs: yield long.sub(lambda m: m.group(0) + " ", d)


def train_tokenizer(docs: Iterable[str], # Training documents
                    vocab_size: int = DEFAULT_VOCAB_SIZE, # Target vocabulary, EOT included (>= 257)
                    progress: bool = False, # Show the trainer's progress bar
                   ):
    "A byte-level BPE `tokenizers.Tokenizer` trained on `docs`, with EOT as token 0."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    _check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    _in_a_thread(lambda: tok.train_from_iterator(_short_runs(docs), trainer))
    tok.encode_special_tokens = True
    return tok


def _in_a_thread(fn: Callable):
    """`fn()` in a worker thread, waited for in short joins, so that Ctrl-C (or `hymo.data`'s SIGTERM) reaches this
    thread at once while `fn` runs code that never looks for signals (the Rust BPE trainer, releasing the GIL as it
    merges). Stopped, `fn` is left to finish on its own; a daemon thread, it ends with the process."""
    out = {}
    def work():
        try: out["value"] = fn()
        except BaseException as e: out["error"] = e
    worker = threading.Thread(target=work, name="hymo-" + getattr(fn, "__name__", "work"), daemon=True)
    worker.start()
    while worker.is_alive(): worker.join(0.1)
    if "error" in out: raise out["error"]
    return out["value"]


# %%
t0 = time.perf_counter()
tok = train_tokenizer(shakespeare[:6500], 2048)
print(f"trained in {time.perf_counter() - t0:.2f} s, vocabulary {tok.get_vocab_size()}")
line = "To be, or not to be, that is the question:"
enc = tok.encode(line)
print(enc.tokens)
print(enc.ids)
print(f"{len(line.encode())} bytes -> {len(enc.ids)} tokens")
test_eq(tok.decode(enc.ids), line)
test_eq(tok.token_to_id(EOT), 0)
test_eq([len(w) for w in next(_short_runs(["x" * 2500 + " y"])).split()], [1000, 1000, 500, 1])  # a long run, broken up
test_eq(list(_short_runs(shakespeare[:6500])), shakespeare[:6500])  # ordinary text: what the trainer gets is the text

# %% [markdown]
# The round trip is exact for any Unicode, and the literal EOT string in text is not a boundary:

# %%
for s in ["Héllo,\r\n\twörld ☃ 𝄞", "a <|endoftext|> b"]: test_eq(tok.decode(tok.encode(s).ids), s)
assert 0 not in tok.encode("a <|endoftext|> b").ids


# %% [markdown]
# ## Shards and the manifest
#
# `prepare` makes the dataset folder:
#
# ```
# DIR/manifest.json      format, fingerprint and the source it hashes, tokenizer sha256, vocab size,
#                        dtype, EOT id, and per split: tokens, documents, bytes, shards (each
#                        with its tokens and CRC-32); last, its own CRC-32
# DIR/tokenizer.json     the tokenizer (Hugging Face format)
# DIR/train_0000.npy ... the training stream: doc EOT doc EOT ..., cut into shards
# DIR/val_0000.npy  ...  the validation stream
# ```
#
# Token ids are `uint16` when the vocabulary fits ($V \le 2^{16}$; the 750M model's 64 256 does):
# half the disk and page-cache traffic of `int32`. A larger vocabulary takes `uint32`. Shards are plain `.npy` files
# (the header carries the dtype and length) of `shard_tokens` tokens each, the last one shorter;
# documents run across shard boundaries, because the loader reads the splits as one stream.
#
# **The fingerprint** is a sha256 of everything that determines the output, its *source*: the format version,
# every input file's name and content hash, and the options. The manifest keeps the source too, so that a refusal can
# say what changed. Re-running `prepare` with the same
# fingerprint returns once it has hashed the inputs, without writing (so file times do not change),
# if the dataset is intact (`check_compatible`: every shard and the tokenizer as the manifest records them, and
# `check_contents`: every shard's CRC-32); a
# damaged one (a shard deleted, cut short or with other bytes) is prepared again, which is what the trainer's error
# for it asks. A different fingerprint in an existing dataset folder is refused unless
# `overwrite=True`, naming what differs (`b.txt changed; val_fraction 0.1 -> 0.2`), and so is a manifest that
# cannot be read, or a folder of a dataset's files whose manifest is gone (with `overwrite` it is prepared again;
# a folder holding anything else is never replaced).
#
# The manifest checks itself (`load_manifest`): its CRC-32 over the rest (`manifest_sum`: sorted JSON, the same for
# the dict read back), exactly the splits `train` and `val`, a fingerprint that is its source's. A flipped letter
# leaves valid JSON: `"tr`in"` made a dataset without a training split, `"~al"` one without validation (no
# validation loss, without a word), a flipped fingerprint "prepared from other inputs". An input that changes while
# it is prepared (a download still writing) is refused before the dataset is installed: its shards would hold text
# the recorded sha256 never saw (`_stamps`: each input's size, time and inode, before hashing and after). Tokenizer
# training and encoding are deterministic, and the manifest holds no time stamps, so two
# preparations of the same input are byte-identical.

# %%
#| export
def sha256_file(path: Path) -> str:
    "Hex sha256 of a file's bytes."
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""): h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    "The smallest unsigned dtype holding ids `0 .. vocab_size-1`: uint16 or uint32."
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def to_disk(f):
    "Flush an open file, or a folder's entries (a `Path`: renames and new files in it), to the disk itself."
    if isinstance(f, Path):
        fd = os.open(f, os.O_RDONLY)
        try: os.fsync(fd)
        except OSError as e:  # some network and FUSE file systems cannot sync a folder: they keep renames in order anyway
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF): raise
        finally: os.close(fd)
    else: f.flush(); os.fsync(f.fileno())


def to_devnull(stream):
    "Point `stream`'s file descriptor at /dev/null: once its reader has gone (`| head`), what is still buffered, and Python's exit, flush into nothing."
    null = os.open(os.devnull, os.O_WRONLY)
    try: os.dup2(null, stream.fileno())
    finally: os.close(null)


def _a_terminal(stream) -> bool:
    """Whether `stream` is a terminal. Only there is a progress bar drawn: in a log file (a scheduler's, `nohup`'s) every
    redraw is one more line (the training bar's would add 11 MB over the 750M preset's 57 220 steps)."""
    try: return stream.isatty()
    except (AttributeError, ValueError): return False  # no isatty, or a closed stream


def _bar_shows(bar_cls=None) -> bool:
    "Whether a progress bar of `bar_cls` (default tqdm.auto's) is drawn where it belongs: a terminal, or a Jupyter widget."
    if bar_cls is None: from tqdm.auto import tqdm as bar_cls
    return _a_terminal(sys.stderr) or any(c.__module__ == "tqdm.notebook" for c in bar_cls.__mro__)


def _write_synced(path: Path, data: str | bytes):
    "Write `path` and flush it to the disk: a dataset is renamed into place only once all of it is there."
    with open(path, "wb") as f: f.write(data.encode("utf-8") if isinstance(data, str) else data); to_disk(f)


class _ShardWriter:
    "Appends token arrays to one split and writes `{split}_{i:04d}.npy` shards of `shard_tokens` tokens."
    def __init__(self, folder: Path, split: str, dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.buf, self.n_buf, self.shards, self.tokens, self.documents, self.bytes = [], 0, [], 0, 0, 0

    def add(self, ids: np.ndarray, n_bytes: int):
        "Append one document's ids (EOT included)."
        self.buf.append(ids); self.n_buf += len(ids)
        self.tokens += len(ids); self.documents += 1; self.bytes += n_bytes
        while self.n_buf >= self.shard_tokens: self._flush(self.shard_tokens)

    def _flush(self, n: int):
        arr = np.concatenate(self.buf) if self.buf else np.zeros(0, self.dtype)
        name = f"{self.split}_{len(self.shards):04d}.npy"
        with open(self.folder / name, "wb") as f:
            try: np.save(f, arr[:n])
            except OSError as e:  # numpy's short write says "N requested and M written", without an errno
                if e.errno is not None: raise
                if shutil.disk_usage(self.folder).free < arr[:n].nbytes: code, why = errno.ENOSPC, os.strerror(errno.ENOSPC)
                else: code, why = errno.EIO, "the write was cut short: a disk quota reached, or a failing disk"
                raise OSError(code, f"{why} ({e})", str(self.folder / name)) from None
            to_disk(f)
        self.shards.append({"file": name, "tokens": int(n), "crc32": zlib.crc32(arr[:n])})  # what `check_contents` compares
        self.buf, self.n_buf = ([arr[n:]] if len(arr) > n else []), len(arr) - n

    def close(self) -> dict:
        if self.n_buf: self._flush(self.n_buf)
        return {"tokens": self.tokens, "documents": self.documents, "bytes": self.bytes, "shards": self.shards}


# %% [markdown]
# `prepare` reads the inputs first to hash them (the fingerprint; with a given tokenizer, the first
# megabyte of documents is read once before that, to check the tokenizer), then twice more (once to count
# bytes for the split, once to encode), and once more, up to `tokenizer_train_bytes`, to train the
# tokenizer, so memory stays bounded for large
# corpora of many files. Documents are encoded in batches (`encode_batch` runs on all cores) under
# a progress bar. Memory grows with the largest file, which is read whole (about three times its
# size, split into documents), and with the largest document, which is encoded whole (about a
# hundred times its size): a corpus that is one file of several GB should be cut into files first.

# %%
#| export
def _source(files, tokenizer_sha, vocab_size, doc_split, val_fraction, shard_tokens, tokenizer_train_bytes) -> dict:
    "What determines a dataset: the format, every input's name and sha256, and the options (kept in the manifest)."
    return {"format": FORMAT, "inputs": [[name, sha256_file(p)] for p, name in files], "tokenizer": tokenizer_sha,
            "vocab_size": None if tokenizer_sha else vocab_size, "doc_split": doc_split, "val_fraction": val_fraction,
            "shard_tokens": shard_tokens, "tokenizer_train_bytes": None if tokenizer_sha else tokenizer_train_bytes}


def _stamps(files) -> list[tuple]:
    "Each input's size, modification time and inode: what a file still being written changes."
    return [(s.st_size, s.st_mtime_ns, s.st_ino) for s in (os.stat(p) for p, _ in files)]


def _fingerprint(source: dict) -> str:
    "The sha256 that names a dataset's `source`: equal sources, equal datasets."
    return hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()


def _what_changed(old, new: dict) -> str:
    "What differs from a dataset's recorded source ('b.txt changed; val_fraction 0.1 -> 0.2'); '' if it has none."
    try:
        was, now = {n: h for n, h in old["inputs"]}, {n: h for n, h in new["inputs"]}
        said = [f"{n} {'changed' if n in was else 'added'}" for n, h in now.items() if was.get(n) != h]
        said += [f"{n} not given" for n in was if n not in now]
        if not said and list(was) != list(now): said.append("the inputs in another order")
        tok = old.get("tokenizer") != new["tokenizer"]  # with a given tokenizer, the trained one's options are None
        said += ["another tokenizer" if k == "tokenizer" else f"{k} {old.get(k)!r} -> {v!r}" for k, v in new.items()
                 if k not in ("format", "inputs") and old.get(k) != v and not (tok and k != "tokenizer" and None in (old.get(k), v))]
    except (TypeError, KeyError, ValueError, AttributeError): return ""  # an older manifest, without a source
    return "; ".join(said[:4] + [f"{len(said) - 4} more"] * (len(said) > 4))


def _all_docs(files, doc_split) -> Iterator[str]:
    for p, _ in files: yield from read_documents(p, doc_split)


def _head(docs: Iterable[str], max_bytes: int) -> Iterator[str]:
    "The first `max_bytes` UTF-8 bytes of `docs`: whole documents, and the one that crosses the limit cut at its last line break before it."
    n = 0
    for d in docs:
        if n >= max_bytes: return
        b = d.encode("utf-8")
        if n + len(b) > max_bytes:  # one huge document (--doc-split file, a big JSONL row) would otherwise come whole
            part = b[:max_bytes - n]
            part = part[:part.rfind(b"\n") + 1] or part  # at a line break, else at the limit
            yield part.decode("utf-8", errors="ignore"); return  # (a character the limit cut in two is left out)
        n += len(b); yield d


def _batches(items: Iterable[tuple[str, str]], max_bytes: int = 1 << 22) -> Iterator[list[tuple[str, str]]]:
    batch, n = [], 0
    for it in items:
        batch.append(it); n += len(it[1])
        if n >= max_bytes: yield batch; batch, n = [], 0
    if batch: yield batch


# %%
#| export
def _write_dataset(folder: Path, files, tok, tokenizer_json: str, source: dict, doc_split: str,
                   val_fraction: float, shard_tokens: int, total_bytes: int, progress: bool) -> dict:
    "Encode every document into shards under `folder`; write tokenizer.json and, last, manifest.json."
    _write_synced(folder / "tokenizer.json", tokenizer_json)
    vocab_size, eot_id = tok.get_vocab_size(), tok.token_to_id(EOT)
    dtype = token_dtype(vocab_size)
    writers = {s: _ShardWriter(folder, s, dtype, shard_tokens) for s in ("train", "val")}
    eot = np.array([eot_id], dtype)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: faster where available
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
        for batch in _batches(split_train_val(_all_docs(files, doc_split), total_bytes, val_fraction)):
            for (split, d), e in zip(batch, encode([d for _, d in batch])):
                n = len(d.encode("utf-8"))
                writers[split].add(np.concatenate([np.asarray(e.ids, dtype), eot]), n)
                bar.update(n)
    manifest = {"format": FORMAT, "fingerprint": _fingerprint(source), "source": source, "tokenizer": "tokenizer.json",
                "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest(),
                "vocab_size": vocab_size, "eot_id": eot_id, "eot_token": EOT, "dtype": dtype.name,
                "doc_split": doc_split, "val_fraction": val_fraction, "inputs": [name for _, name in files],
                "splits": {s: w.close() for s, w in writers.items()}}
    manifest["manifest_crc32"] = manifest_sum(manifest)  # its own: a flipped letter of a split's name reads as valid JSON
    _write_synced(folder / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


# %% [markdown]
# The dataset appears all at once. Everything is written into a hidden sibling folder
# `.DIR.tmp-<host>-<pid>-<random>`, which is renamed to `DIR` only when the manifest is written. An
# interrupted run (Ctrl-C, an exception; from the command line also SIGTERM and SIGHUP) removes its temporary
# folder; a killed one (`kill -9`, a power cut) leaves a
# hidden folder that nothing mistakes for a dataset. The next `prepare` of `DIR` deletes it if it names this machine
# and a process that has ended; any other it names in a warning and keeps (it may be another `prepare` still running,
# here or on another machine that shares the disk). Replacing a dataset
# takes two renames, the old one aside to `.DIR.old-<random>` and the new one in (the new folder is synced to disk
# first). An exception between the two (Ctrl-C, SIGTERM) renames the old one back before it ends; killed
# outright between them, `DIR` is missing, and reading it says where the old dataset is and how to rename it
# back. One after both, as the old one is deleted (seconds, for a large one), leaves the new dataset installed:
# the command says so, and where the old one's remains are. If two processes prepare the same data at once (say every rank of a `torchrun`), the
# second to finish finds a dataset with the same fingerprint already in place and drops its own copy.
# With three, one may move another's copy aside to put its own in just as the third renames: the third
# finds no dataset where its rename was refused, and tries the rename again rather than failing.
# If files no prepare writes arrived in `DIR` meanwhile, or (without `--overwrite`) another
# prepare's dataset of other inputs, they are left alone and the finished dataset is kept beside
# them as `DIR-2` (the first free number), with an error that names both: hours of tokenizing are
# not thrown away, nor is the other's work. `--overwrite` replaces the dataset `DIR` held when this prepare began, not
# one another prepare (`--overwrite` too) installed since: two such into one folder keep both, the later beside.
# The same holds, `--overwrite` or not, for a dataset that another
# prepare renames into `DIR` in the moment between this one's two renames; the dataset this one had just moved
# aside is then kept under the next number, not renamed back over the newcomer, and the error names it too.
#
# What the swap needs of `DIR` is checked before any work: a link named as `--out` is followed (the folder it
# names is replaced, on its own file system, and the link keeps pointing at it); a mount point cannot be renamed,
# and the current folder (or one holding it) would leave the shell in a deleted folder, so both are refused.
# Replacing a dataset deletes the old folder, so anything in it that `prepare` did not write (notes, an
# input kept there, a `.git`; only Finder's `.DS_Store` is nobody's) stops the replacement with a message that names it.

# %%
#| export
def _left_behind(out: Path, kinds=("tmp", "old")) -> list[Path]:
    "Folders a stopped `prepare` of `out` left beside it: its work in progress (`.tmp-*`), the dataset it replaced (`.old-*`)."
    return [p for kind in kinds for p in sorted(out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"))]


_HOST = re.sub(r"[^A-Za-z0-9.]+", "_", socket.gethostname()) or "host"  # no '-': the work folder's name splits on it
_WORK = re.compile(r"\.(?P<out>.+)\.tmp-(?:(?P<host>[A-Za-z0-9._]+)-)?(?P<pid>\d+)-[0-9a-f]{8}")  # `_work_folder`'s names


def _work_folder(out: Path) -> Path:
    "A new name for `prepare`'s work in progress on `out`, beside it: `.NAME.tmp-<host>-<pid>-<random>`."
    return out.with_name(f".{out.name}.tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _stopped_here(work: Path) -> bool:
    """Whether work folder `work` is a `prepare`'s whose process has ended on this machine (a `kill -9`, a power cut):
    only then is it safe to delete. Another machine's (a shared disk), or a name without one (older), may be running."""
    m = _WORK.fullmatch(work.name)
    if not m or m["host"] != _HOST or int(m["pid"]) == os.getpid(): return False
    try: os.kill(int(m["pid"]), 0)
    except ProcessLookupError: return True
    except OSError: return False  # alive (another user's: no permission to signal it), or cannot tell
    return False


def manifest_sum(manifest: dict) -> int:
    "The CRC-32 of a manifest without its own (`manifest_crc32`), as sorted JSON: the same for the dict read back."
    return zlib.crc32(json.dumps({k: v for k, v in manifest.items() if k != "manifest_crc32"}, sort_keys=True).encode())


_MANIFEST_KEYS = {"fingerprint": str, "tokenizer": str, "tokenizer_sha256": str, "vocab_size": int, "eot_id": int,
                  "dtype": str, "inputs": list, "splits": dict}  # what the readers use, checked before they do


def _holds_cwd(path) -> bool:
    "Whether `path` is the current folder or one holding it (never, once the current folder was deleted)."
    try: return Path.cwd().resolve().is_relative_to(Path(os.path.realpath(path)))
    except OSError: return False


def load_manifest(data_dir: Path) -> dict:
    "The manifest of a prepared dataset folder, or a `DataError` saying how to make one."
    d = Path(data_dir)
    m = d / "manifest.json"
    if not d.exists():
        try: real = Path(os.path.realpath(d))  # through a link, `prepare` swaps the folder the link names, beside it
        except OSError: raise DataError(f"the current folder was deleted: cd to an existing one, or give {data_dir} as "
                                        "an absolute path") from None
        old = [p for b in {d, real} for p in _left_behind(b, ("old",)) if (p / "manifest.json").is_file()]
        if old:  # stopped between `_install`'s two renames: the dataset is there, under another name
            old = max(old, key=lambda p: p.stat().st_mtime)  # the newest, if several
            raise DataError(f"{data_dir} does not exist, but {old} holds the dataset that was there (a prepare into it was "
                            f"stopped as it swapped the folders): rename it back (mv {shell_word(old)} {shell_word(data_dir)}), or prepare again")
        # a misspelt path: not a place to prepare into before checking it
        raise DataError(f"{data_dir} does not exist: check the path, or prepare a dataset there (`python -m hymo.data "
                        f"prepare --input TEXT... --out {shell_word(data_dir)}`)")
    if not m.exists():  # a training run's folder; or texts not prepared yet, to prepare into a folder of their own
        if d.is_dir() and (d / "config.yaml").is_file() and (d / "metrics.jsonl").is_file():
            raise DataError(f"{data_dir} is not a prepared dataset but holds a config.yaml (a run folder?): give the "
                            "dataset folder, data_dir in that config.yaml (null there: the bundled corpus, which is "
                            "what leaving out data_dir trains on)")
        if d.is_file() and (d.name == "manifest.json" or (d.parent / "manifest.json").is_file()):
            raise DataError(f"{data_dir} is a file of a prepared dataset: give its folder, {d.parent}")
        if d.is_dir() and (w := _WORK.fullmatch(d.name) or re.fullmatch(r"\.(?P<out>.+)\.tmp-.+", d.name)):
            raise DataError(f"{data_dir} is the work folder of a prepare that did not finish (stopped, or still running); "
                            f"a finished one is installed as {d.parent / w['out']}: give that, or delete {data_dir} "
                            "if no prepare is running")
        if d.is_dir() and (datasets := sorted(p.parent for p in d.glob("*/manifest.json"))):
            raise DataError(f"{data_dir} is not a prepared dataset but holds {len(datasets)} datasets: give one of them, "
                            f"{', '.join(map(str, datasets[:3]))}{' ...' * (len(datasets) > 3)}")
        if d.is_dir() and (parts := sorted(p.name for p in d.iterdir() if _DATASET_FILE.fullmatch(p.name))):
            raise DataError(f"{data_dir} holds part of a prepared dataset ({', '.join(parts[:3])}{', ...' * (len(parts) > 3)}) "
                            "but no manifest.json: copy the whole dataset folder, or prepare the texts again into a new folder")
        if d.is_file() and d.suffix not in SUFFIXES:
            raise DataError(f"{data_dir} is a file, not a prepared dataset: give a dataset folder (one with a manifest.json)")
        texts = d.is_file() or (d.is_dir() and any(f.suffix in SUFFIXES and f.is_file() for f in d.rglob("*")))
        if not texts and d.is_dir() and any(d.iterdir()):
            raise DataError(f"{data_dir} is not a prepared dataset (no manifest.json) and holds no text to prepare "
                            f"({', '.join(SUFFIXES)} files): give a dataset folder, or prepare one (`python -m hymo.data "
                            "prepare --input TEXT... --out DIR`)")
        where = "data/mine" if _holds_cwd(d) else data_dir  # `prepare` refuses to replace the current folder
        named = Path(os.path.abspath(d)) if d.name in ("", "..") else d  # `.` and `..` name no folder to suggest an --out from
        stem = f"{named.with_suffix('').name if named.is_file() else named.name}_prepared" if named.name else "prepared"
        inside = Path(os.path.abspath(named)).is_relative_to(package_dir().resolve())  # the bundled corpus: not into the package
        out = Path("data") / stem if inside else named.with_name(stem) if named.name else Path(stem)
        raise DataError(f"{data_dir} is not a prepared dataset (no manifest.json): run `python -m hymo.data prepare "
                        + (f"--input {shell_word(data_dir)} --out {shell_word(out)}`, then give data_dir={shell_word(out)}" if texts else
                           f"--input TEXT... --out {shell_word(where)}`"
                           + (f", then give data_dir={shell_word(where)}" if where != data_dir else "")))
    try: manifest = json.loads(m.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError) as e:
        raise DataError(f"{m} is damaged ({e}): prepare the dataset again (`python -m hymo.data prepare ... "
                        f"--out {shell_word(data_dir)} --overwrite`)") from None
    if not isinstance(manifest, dict): manifest = {}
    if manifest.get("format") != FORMAT:
        raise DataError(f"{data_dir} has format {manifest.get('format')!r}, this version reads {FORMAT!r}: prepare it "
                        f"again (`python -m hymo.data prepare ... --out {shell_word(data_dir)} --overwrite`)")
    bad = [k for k, t in _MANIFEST_KEYS.items() if not isinstance(manifest.get(k), t) or isinstance(manifest.get(k), bool)]
    splits = manifest.get("splits") if isinstance(manifest.get("splits"), dict) else {}
    bad += [f"splits.{name}" for name, v in splits.items() if not (isinstance(v, dict) and all(
        isinstance(v.get(k), int) for k in ("tokens", "documents")) and isinstance(v.get("shards"), list) and all(
        isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("tokens"), int)
        and isinstance(s.get("crc32", 0), int) for s in v["shards"]))]
    if not bad and set(splits) != {"train", "val"}: bad.append(f"splits {sorted(splits)}, not train and val")
    if not bad and isinstance(manifest.get("source"), dict) and _fingerprint(manifest["source"]) != manifest["fingerprint"]:
        bad.append("fingerprint (not its source's)")
    if not bad and manifest.get("manifest_crc32", manifest_sum(manifest)) != manifest_sum(manifest):  # (older: none)
        bad.append("its CRC-32 (changed since it was written)")  # the most specific first, this last
    if bad:
        raise DataError(f"{m} is damaged (missing or wrong: {', '.join(bad)}): prepare the dataset again "
                        f"(`python -m hymo.data prepare ... --out {shell_word(data_dir)} --overwrite`)")
    return manifest


_DATASET_FILE = re.compile(r"(manifest|tokenizer)\.json|(train|val)_\d{4,}\.npy")  # what `_write_dataset` writes


def _entries(folder: Path) -> list[Path]:
    "What `folder` holds; nothing if it is gone, or went as it was listed (another prepare moving it aside)."
    try: return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError): return []


def _filled(out: Path) -> bool:
    "Whether folder `out` holds anything but Finder's `.DS_Store`, which is nobody's work."
    return any(p.name != ".DS_Store" for p in _entries(out))


def _not_written_by_prepare(out: Path) -> list[str]:
    "Names in dataset folder `out` that no `prepare` writes (the user's notes, an input kept there)."
    return sorted(p.name + "/" * p.is_dir() for p in _entries(out)  # Finder's .DS_Store is nobody's work; .git is
                  if p.name != ".DS_Store" and not (_DATASET_FILE.fullmatch(p.name) and not p.is_dir()))  # a name gone
                  # as it is looked at is no one's file: another prepare moving the folder aside to install its own


def _same_dataset(out: Path, fingerprint: str) -> bool:
    "Whether `out` holds the dataset `fingerprint` names, intact (every shard and the tokenizer as its manifest says)."
    try:
        m = load_manifest(out)
        return m["fingerprint"] == fingerprint and check_compatible(out, m["vocab_size"]) is not None and (
            check_contents(out) is True)  # every byte of every shard (a manifest without checksums: prepared again)
    except (DataError, OSError):  # none there, damaged (prepared again), unreadable, or moved aside as it was read
        return False              # (another prepare installing its own)


def _free_name(out: Path) -> Path:
    "Claim `out-2` (or the next free number) beside `out`, as an empty folder: a concurrent loser may want one too."
    for i in itertools.count(2):
        try: (p := out.with_name(f"{out.name}-{i}")).mkdir(); return p
        except FileExistsError: continue


def _keep_beside(tmp: Path, out: Path, what: str, moved: Optional[Path] = None):
    """Keep the finished `tmp` as `out-2` (the first free number) and raise the `DataError` saying so: `out` holds `what`.
    `moved`, the dataset this prepare had moved aside from `out` to swap its own in, is kept under the next number."""
    os.replace(tmp, kept := _free_name(out))
    if moved is not None: os.replace(moved, was := _free_name(out))
    to_disk(out.parent)
    raise DataError(f"{out} now holds {what} while this prepare ran; it is left as it is. This prepare's dataset is "
                    f"kept at {kept}: train on it there (data_dir={shell_word(kept)}), or move it to {out} yourself"
                    + (f". The dataset {out} held when this prepare moved it aside is at {was}, as it was" if moved else ""))


def _install(tmp: Path, out: Path, fingerprint: str, overwrite: bool = False,
             found: str | None = None): # The fingerprint of the dataset `prepare` found in `out` (None: none, or unreadable)
    """Move the finished `tmp` to `out`, replacing an older (or damaged) dataset there: the one `prepare` found
    (`overwrite`), or this dataset damaged. What arrived in `out` while it ran (another prepare's dataset, with
    `overwrite` too; someone's files) is left as it is, and `tmp` is kept beside it under a name of its own, hours of
    tokenizing not lost."""
    if _same_dataset(out, fingerprint): shutil.rmtree(tmp); return  # another process finished the same work first
    to_disk(tmp)  # its files' entries on disk before a rename names it a dataset (the files are synced as written)
    foreign = _not_written_by_prepare(out)  # `prepare` refused any at its start: they are new
    def there():  # the fingerprint of what `out` holds: this one's for nothing, None for a manifest that cannot be read
        try: return load_manifest(out).get("fingerprint") if _filled(out) and not foreign else fingerprint
        except (DataError, OSError): return None if _filled(out) else fingerprint  # (gone as it was read: nothing)
    if (theirs := there()) is None:  # unreadable, or moved aside and another put in as it was read: look again
        if _same_dataset(out, fingerprint): shutil.rmtree(tmp); return
        theirs = there()
    if foreign or (theirs != fingerprint and not (overwrite and theirs == found)):  # (the same: this one damaged, replaced)
        _keep_beside(tmp, out, f"{', '.join(foreign[:3])}{', ...' * (len(foreign) > 3)}, which no prepare wrote," if foreign
                     else "a dataset from other inputs or options, which another prepare installed" if theirs is not None
                     else "a dataset whose manifest cannot be read, which another prepare installed")
    old = None
    try:
        try:
            if any(out.iterdir()):
                old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
                os.replace(out, old)
            else: out.rmdir()
        except FileNotFoundError: old = None  # none there, or another process just moved it aside to install its own
        for tries_left in (2, 1, 0):  # another process may install `out` between our check and our rename ...
            try: os.replace(tmp, out); break
            except OSError:
                if _same_dataset(out, fingerprint): shutil.rmtree(tmp); break
                if _filled(out):  # another dataset: it stays, as above; the one moved aside is kept too, not put back
                    _keep_beside(tmp, out, "a dataset from other inputs or options, which another prepare installed", old)
                if tries_left == 0: raise  # ... and a third move it aside again before we look: try again
    except BaseException:  # stopped (Ctrl-C, SIGTERM) or refused between the renames: the old dataset goes back
        if old is not None and old.exists() and not out.exists(): os.replace(old, out)
        raise
    to_disk(out.parent)  # the rename itself, before the old dataset goes: a power cut leaves one of the two whole
    if old is None: return
    try: shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:  # a Ctrl-C as it goes (seconds, for a large one): installed all the same
        e.installed_over = old  # (`python -m hymo.data` says so, not "as it was")
        raise


# %%
#| export
_SAME_COMMAND = "(the same `python -m hymo.data prepare` command)"  # what rebuilds a damaged dataset


def load_tokenizer(data_dir: Path):
    "The `tokenizers.Tokenizer` of a prepared dataset: `.encode(text).ids` and `.decode(ids)`."
    return tokenizer_from_json(read_tokenizer(data_dir))


def tokenizer_from_json(text: str):
    "A `tokenizers.Tokenizer` from the text of a dataset's tokenizer.json, encoding `<|endoftext|>` in text as plain text."
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(text)
    tok.encode_special_tokens = True
    return tok


def read_tokenizer(data_dir: Path) -> str:
    "The text of a prepared dataset's tokenizer.json, checked against the manifest's sha256."
    manifest = load_manifest(data_dir)
    path = Path(data_dir) / manifest["tokenizer"]
    try: text = path.read_text(encoding="utf-8") if path.is_file() else ""
    except UnicodeDecodeError: text = None  # damaged bytes: not the tokenizer the manifest names either
    if text is None or hashlib.sha256(text.encode("utf-8")).hexdigest() != manifest["tokenizer_sha256"]:
        raise DataError(f"{path} is missing or is not the tokenizer the shards were encoded with (sha256 differs "
                        f"from the manifest): prepare the dataset again {_SAME_COMMAND}")
    return text


def _open_shards(data_dir: Path, manifest: dict, split: str) -> list[np.ndarray]:
    "Memory-map the shards of `split`, checking each against the manifest."
    if split not in manifest["splits"]: raise DataError(f"split {split!r}: choose one of {sorted(manifest['splits'])}")
    arrays = []
    for s in manifest["splits"][split]["shards"]:
        p = Path(data_dir) / s["file"]
        if not p.exists(): raise DataError(f"shard {p} is missing: prepare the dataset again {_SAME_COMMAND}")
        try: a = np.load(p, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:  # cut short: no header (EOFError: empty), or shorter than it says
            raise DataError(f"shard {p} cannot be read ({e or 'empty'}): the dataset is damaged, prepare it again {_SAME_COMMAND}") from None
        if a.ndim != 1 or len(a) != s["tokens"] or a.dtype.name != manifest["dtype"] or not a.dtype.isnative:  # '>u2' is 'uint16'
            raise DataError(f"shard {p} holds {len(a)} {a.dtype} tokens, the manifest says {s['tokens']} "
                            f"{manifest['dtype']}: the dataset is damaged, prepare it again {_SAME_COMMAND}")
        arrays.append(a)
    return arrays


def check_compatible(data_dir: Path, # A prepared dataset folder
                     vocab_size: int, # The model's vocabulary (embedding rows)
                    ) -> dict:
    "Raise a `DataError` unless the dataset's files are there at their recorded sizes (`check_contents` reads them), its tokenizer is the manifest's, and its ids fit a model of `vocab_size`; return its manifest."
    manifest = load_manifest(data_dir)
    tok = load_tokenizer(data_dir)
    if tok.get_vocab_size() != manifest["vocab_size"]:
        raise DataError(f"tokenizer.json has {tok.get_vocab_size()} tokens, the manifest says {manifest['vocab_size']}: prepare again")
    eot_id, dtype = tok.token_to_id(EOT), token_dtype(manifest["vocab_size"])
    if eot_id != manifest["eot_id"] or manifest["dtype"] != dtype.name:
        raise DataError(f"the manifest's eot_id {manifest['eot_id']} and dtype {manifest['dtype']} are not what its "
                        f"tokenizer gives ({EOT} is id {eot_id}, ids fit {dtype}): "
                        f"the manifest was edited or belongs to another dataset; prepare again {_SAME_COMMAND}")
    for split in manifest["splits"]: _open_shards(data_dir, manifest, split)
    if manifest["vocab_size"] > vocab_size:
        raise DataError(f"{data_dir} was tokenized with {manifest['vocab_size']} tokens but the model has vocab_size="
                        f"{vocab_size}: set model.vocab_size >= {manifest['vocab_size']}, or prepare the data " +
                        (f"with --vocab-size {vocab_size}" if vocab_size >= 257 else "with a model vocab_size of at least "
                         f"257 (a byte-level tokenizer has the 256 bytes and {EOT}), and --vocab-size to match"))
    return manifest


def _with_sums(data_dir: Path, manifest: dict, split: str, arrays: list[np.ndarray]) -> list[tuple[Path, int | None, np.ndarray]]:
    "Each shard of `split` (opened: `arrays`) with its path and the CRC-32 the manifest records (None in an older one)."
    return [(Path(data_dir) / s["file"], s.get("crc32"), a) for s, a in zip(manifest["splits"][split]["shards"], arrays)]


def _sums_match(shards: list[tuple[Path, int | None, np.ndarray]]) -> bool:
    "True if each shard's CRC-32 is the one recorded; a `DataError` names the first that differs; False if any has none."
    if any(crc is None for _, crc, _ in shards): return False
    for path, crc, a in shards:
        if zlib.crc32(a) != crc:
            raise DataError(f"shard {path} is damaged (its CRC-32 is not the manifest's: bytes changed on disk): prepare the "
                            f"dataset again {_SAME_COMMAND}")
    return True


def check_contents(data_dir: Path, # A prepared dataset folder
                   rank: int = 0, # Read only a share of the shards: every `world_size`-th, from the `rank`-th
                   world_size: int = 1, # How many shares (the ranks of a run, which read one each)
                  ) -> bool:
    """Read every shard (of this share) and compare its CRC-32 with the manifest's: a `DataError` names the first that
    differs. True when all match; False for a dataset prepared before manifests kept checksums (nothing to compare)."""
    manifest = load_manifest(data_dir)
    shards = [x for split in manifest["splits"] for x in _with_sums(data_dir, manifest, split, _open_shards(data_dir, manifest, split))]
    return _sums_match(shards[rank::world_size])


# %% [markdown]
# A tokenizer given with `tokenizer=` (`--tokenizer`) is checked before it is used. Its ids must be
# $0 \dots V-1$ and it must know `<|endoftext|>`; truncation, padding and special tokens added around
# each text are turned off, with a warning (each document already ends in `<|endoftext|>`). And it
# must give back what it encodes: a tokenizer without byte fallback (and without an unknown token)
# drops the characters it has no token for, so the model would never see them and nothing would
# fail. `prepare` decodes the first megabyte of documents and warns with the first place where the
# text does not come back as it was (a normaliser that lower-cases or folds accents warns too: it
# may be what you want, and the warning says what it does). HyMo's own byte-level BPE gives back
# every byte.

# %%
#| export
def _lossy(tok, docs: Iterable[str]) -> str | None:
    "Where `tok` first fails to give a document back as it was (`'...' comes back as '...'`), or None if it gives back every one."
    for d in docs:
        back = tok.decode(tok.encode(d).ids, skip_special_tokens=False)
        if back != d:
            i = next((i for i, (a, b) in enumerate(zip(d, back)) if a != b), min(len(d), len(back)))  # first difference
            return f"{ascii(d[max(0, i - 20):i + 20])} comes back as {ascii(back[max(0, i - 20):i + 20])}"  # ascii: 'e\\u0301' shows"
    return None


def _plain_tokenizer(tok, path: Path, text: str) -> str:
    """Turn off what a given tokenizer.json may do to every document beyond splitting it into tokens (truncation,
    padding, special tokens added around it), with a `DataWarning`; return the JSON the dataset keeps."""
    adds = tok.post_processor is not None and tok.post_processor.num_special_tokens_to_add(False) > 0
    off = [name for name, on in (("truncation", tok.truncation), ("padding", tok.padding), ("special tokens its "
           "post-processor adds around each text", adds)) if on]
    if not off: return text
    tok.no_truncation(); tok.no_padding()
    if adds: tok.post_processor = None
    warnings.warn(f"tokenizer {path}: its {', '.join(off)} turned off: they would cut, pad or mark every document "
                  f"(each ends in {EOT}); the dataset keeps the tokenizer without them", DataWarning, stacklevel=3)
    return tok.to_str()


def _clean_left_behind(out: Path):
    "Delete what a `prepare` of `out` on this machine left when its process ended (`_stopped_here`); name the rest."
    left = _left_behind(out)
    if gone := [p for p in left if _stopped_here(p)]:  # its process ended without cleaning up (a kill -9, a power cut)
        for p in gone: shutil.rmtree(p, ignore_errors=True)
        warnings.warn(f"removed {', '.join(p.name for p in gone)} from {out.parent}: the work of a prepare of {out.name} "
                      "on this machine whose process has ended", DataWarning, stacklevel=3)
    if left := [p for p in left if p not in gone]:
        warnings.warn(f"{', '.join(p.name for p in left)} in {out.parent} {'were' if len(left) > 1 else 'was'} left by "
                      f"another prepare of {out.name}, stopped or still running: delete {'them' if len(left) > 1 else 'it'} if no prepare "
                      f"of {out.name} is running", DataWarning, stacklevel=3)


def _real_out(out) -> Path:
    "`--out` as the absolute path of the folder to replace: through a link, the folder it names (`DataError` for a loop)."
    out = Path(os.path.abspath(Path(out).expanduser()))  # absolute: `--out ..` has a name for its temporary sibling
    if not out.is_symlink(): return out
    try: return out.resolve(strict=False)
    except (RuntimeError, OSError): raise DataError(f"--out {out} is a link that leads to itself (a loop): remove it, "
                                                     "or give another --out") from None


def prepare(inputs, # Text files, folders of them, .jsonl (a 'text' field) or .parquet (a 'text' column)
            out, # Dataset folder to create
            vocab_size: Optional[int] = None, # BPE vocabulary to train (default 2048); with `tokenizer`, must match it if given
            tokenizer=None, # A tokenizer.json to use instead of training one; it must contain <|endoftext|>
            doc_split: str = "blank", # Plain text: 'blank' (blank lines end a document) or 'file' (one document per file)
            val_fraction: float = 0.1, # Fraction of the bytes, at the end, kept for validation
            shard_tokens: int = 2**27, # Tokens per shard file (the last may be shorter)
            tokenizer_train_bytes: int = 2**30, # The tokenizer is trained on at most this many bytes of training documents (the first)
            overwrite: bool = False, # Replace a dataset in `out` prepared from other inputs or options
            progress: bool = True, # Show progress bars
           ) -> Path:
    "Tokenize `inputs` into train/val token shards, a tokenizer and a manifest in `out`; return the dataset folder, absolute (through a link, the folder it names)."
    try: out = _real_out(out)
    except FileNotFoundError: raise DataError(f"the current folder was deleted: cd to an existing one, or give --out as an "
                                              "absolute path") from None
    # the options first: a bad one fails at once, not after reading every input. numpy's numbers as Python's: they go
    # into the manifest, and json cannot write numpy's
    vocab_size, val_fraction, shard_tokens, tokenizer_train_bytes = (
        x.item() if isinstance(x, np.generic) else x for x in (vocab_size, val_fraction, shard_tokens, tokenizer_train_bytes))
    if os.path.ismount(out):
        raise DataError(f"--out {out} is a mount point, which cannot be replaced by a new folder: give a folder inside it "
                        f"(e.g. --out {shell_word(out / 'data')})")
    if not 0 <= val_fraction < 1: raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    if shard_tokens <= 0: raise DataError(f"shard_tokens={shard_tokens} must be positive")
    if tokenizer is None: _check_vocab_size(DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size)
    if out.exists() and not out.is_dir(): raise DataError(f"--out {out} is a file: give a new or empty folder")
    if _filled(out) and not (out / "manifest.json").exists():
        if _not_written_by_prepare(out):
            raise DataError(f"{out} exists and is not a HyMo dataset: choose an empty or new folder for --out")
        if not overwrite:  # only a dataset's files: one whose manifest.json is gone
            raise DataError(f"{out} holds part of a HyMo dataset, without its manifest.json: pass --overwrite "
                            "(overwrite=True in Python) to prepare it again there, or choose another --out")
    files = find_files(inputs, out)
    if tokenizer is not None:
        from tokenizers import Tokenizer
        tokenizer = Path(tokenizer)
        if not tokenizer.is_file():
            inner = tokenizer / "tokenizer.json"  # a dataset's or a run's folder: the file in it
            raise DataError(f"tokenizer {tokenizer} {'is a folder' if tokenizer.is_dir() else 'does not exist'}: give a Hugging "
                            f"Face tokenizer.json" + (f" (--tokenizer {inner})" if inner.is_file() else ""))
        _check_readable(tokenizer, "tokenizer")
        try: tokenizer_json = tokenizer.read_text(encoding="utf-8")
        except UnicodeDecodeError: raise DataError(f"tokenizer {tokenizer} is not text (not UTF-8): give a Hugging Face tokenizer.json") from None
        try: tok = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise DataError(f"tokenizer {tokenizer} is not a Hugging Face tokenizer.json ({e}): give the file that "
                            "`Tokenizer.save` writes") from None
        if tok.token_to_id(EOT) is None: raise DataError(f"tokenizer {tokenizer} has no {EOT} token: add it as a special token")
        top = max(tok.get_vocab(with_added_tokens=True).values())
        if top + 1 != tok.get_vocab_size():  # the embedding needs a row for every id, not for every token
            raise DataError(f"tokenizer {tokenizer} has {tok.get_vocab_size()} tokens but ids up to {top}: its ids must "
                            f"be 0..{tok.get_vocab_size() - 1}, without gaps (renumber it, or train one: drop --tokenizer)")
        if vocab_size is not None and vocab_size != tok.get_vocab_size():
            raise DataError(f"vocab_size={vocab_size} but tokenizer {tokenizer} has {tok.get_vocab_size()} tokens: drop --vocab-size or use another tokenizer")
        tok.encode_special_tokens = True
        tokenizer_json = _plain_tokenizer(tok, tokenizer, tokenizer_json)
        if (lost := _lossy(tok, _head(_all_docs(files, doc_split), 1 << 20))) is not None:
            warnings.warn(f"tokenizer {tokenizer} does not give back the text it encodes: {lost}. It drops or changes "
                          "characters (a normaliser, no token for them) or decodes them differently; what it drops, the model "
                          "never sees. If that is not what you want, leave out --tokenizer to train a byte-level BPE, which "
                          "gives back every byte", DataWarning, stacklevel=2)
    vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size  # only None: 0 was refused above
    tok_sha = None if tokenizer is None else hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()
    stamps = _stamps(files)  # before the sha256s: a writer still appending shows after
    source = _source(files, tok_sha, vocab_size, doc_split, val_fraction, shard_tokens, tokenizer_train_bytes)
    fingerprint = _fingerprint(source)
    _clean_left_behind(out)  # also when the dataset turns out to be there already
    found = None  # the fingerprint of the dataset in `out`, which `overwrite` replaces (and no other that arrives meanwhile)
    if _filled(out):  # a dataset (checked above: `--out` is no file, nor a folder of other things)
        try: there = load_manifest(out)
        except DataError:  # a damaged manifest, or another format: replaced with --overwrite, as its message says
            if not overwrite: raise
            there = {}
        found = there.get("fingerprint")
        same = found == fingerprint
        if same and _same_dataset(out, fingerprint): return out  # already prepared, intact: nothing to write
        if not (same or overwrite):
            changed = _what_changed(there.get("source"), source)
            raise DataError(f"{out} holds a dataset prepared from other inputs or options" + (f" ({changed})" if changed
                            else "") + ": pass --overwrite (overwrite=True in Python) to replace it, or choose another --out")
        if foreign := _not_written_by_prepare(out):  # the whole folder is replaced: never delete someone's files
            raise DataError(f"{out} also holds {len(foreign)} thing{'s' * (len(foreign) > 1)} prepare did not write "
                            f"({', '.join(foreign[:3])}{', ...' * (len(foreign) > 3)}), which replacing the dataset would "
                            "delete: move them out of it first (inputs too), or choose another --out")
        if same: warnings.warn(f"{out} holds this dataset damaged (a shard or the tokenizer missing, cut or changed): "
                               "preparing it again", DataWarning, stacklevel=2)
    if _holds_cwd(out):  # the dataset is swapped in by renaming a new folder
        raise DataError(f"--out {out} is the current folder (or holds it): installing the dataset "
                        "replaces that folder with a new one, and your shell would be left in the deleted one. Give "
                        "another folder (e.g. --out data/mine), or run from outside it")
    out.parent.mkdir(parents=True, exist_ok=True)  # before the long work: an --out that cannot be made fails now
    tmp = _work_folder(out)
    tmp.mkdir()
    try:
        total_bytes = sum(len(d.encode("utf-8")) for d in _all_docs(files, doc_split))
        if total_bytes == 0: raise DataError(f"no text in {', '.join(name for _, name in files)}: the inputs are empty")
        if _train_bytes(total_bytes, val_fraction) == 0:  # any cut after byte 0 leaves training at least a line
            raise DataError(f"val_fraction={val_fraction} leaves no text for training (less than a byte of the "
                            f"{total_bytes}): lower it, or give more text")
        if tokenizer is None:
            train_docs = (d for s, d in split_train_val(_all_docs(files, doc_split), total_bytes, val_fraction) if s == "train")
            tok = train_tokenizer(_head(train_docs, tokenizer_train_bytes), vocab_size, progress)
            tokenizer_json = tok.to_str()
        _write_dataset(tmp, files, tok, tokenizer_json, source, doc_split, val_fraction, shard_tokens, total_bytes, progress)
        if moved := [name for (_, name), a, b in zip(files, stamps, _stamps(files)) if a != b]:
            raise DataError(f"{', '.join(moved[:3])}{' ...' * (len(moved) > 3)} changed while {'they were' if len(moved) > 1 else 'it was'} "
                            "being prepared (a download or copy still writing?): the dataset would not be the one its "
                            "manifest describes, so nothing was written; prepare again once the inputs are complete")
        _install(tmp, out, fingerprint, overwrite, found)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# %% [markdown]
# Preparing the whole bundled corpus takes about a second:

# %%
work = Path(tempfile.mkdtemp())
t0 = time.perf_counter()
ds = prepare(CORPUS, work / "shakespeare", vocab_size=2048, progress=False)
print(f"prepared in {time.perf_counter() - t0:.1f} s: {sorted(p.name for p in ds.iterdir())}")
manifest = load_manifest(ds)
for s, v in manifest["splits"].items():
    print(f"{s:5s} {v['tokens']:8,} tokens {v['documents']:6,} documents {v['bytes']:9,} bytes "
          f"({v['bytes'] / v['tokens']:.2f} bytes/token)")
print({k: manifest[k] for k in ("vocab_size", "dtype", "eot_id", "doc_split", "inputs")})

# %% [markdown]
# The checks: the validation split holds about 10 % of the bytes, every document ends in exactly
# one EOT, the shards add up to the manifest's counts, and decoding the stream gives back the
# text.

# %%
from tokenizers import Tokenizer

# %%
tr, va = manifest["splits"]["train"], manifest["splits"]["val"]
test_close(va["bytes"] / (tr["bytes"] + va["bytes"]), 0.1, eps=0.002)
test_eq(tr["documents"] + va["documents"], len(shakespeare) + 1)  # the speech cut at the split counts twice
test_eq(manifest["dtype"], "uint16")
stream = np.load(ds / "train_0000.npy", mmap_mode="r")
test_eq(len(stream), tr["tokens"])
test_eq(int((stream == manifest["eot_id"]).sum()), tr["documents"])
test_eq(int(stream[-1]), manifest["eot_id"])
tok = Tokenizer.from_file(str(ds / "tokenizer.json"))
first = np.flatnonzero(stream == manifest["eot_id"])[:2]
test_eq(tok.decode(stream[:first[0]].tolist()), shakespeare[0])
test_eq(tok.decode(stream[first[0] + 1:first[1]].tolist()), shakespeare[1])

# %% [markdown]
# Running it again is a no-op (same fingerprint: no file is touched), and the output is
# deterministic: a second folder gets byte-identical files.

# %%
mtimes = {p.name: p.stat().st_mtime_ns for p in ds.iterdir()}
t0 = time.perf_counter()
prepare(CORPUS, ds, vocab_size=2048, progress=False)
print(f"second call: {1e3 * (time.perf_counter() - t0):.0f} ms")
test_eq({p.name: p.stat().st_mtime_ns for p in ds.iterdir()}, mtimes)
ds2 = prepare(CORPUS, work / "again", vocab_size=2048, progress=False)
test_eq({p.name: sha256_file(p) for p in ds2.iterdir()}, {p.name: sha256_file(p) for p in ds.iterdir()})
test_fail(lambda: prepare(CORPUS, ds, vocab_size=1024, progress=False), contains="(vocab_size 2048 -> 1024): pass --overwrite")

# %% [markdown]
# How long are the documents? Most speeches are short, which matters for document masking: a
# window of 128 tokens holds several of them.

# %%
#| fig-alt: "Histogram of the bundled Shakespeare's document lengths in tokens per speech: most speeches are short."
starts = np.flatnonzero(stream == manifest["eot_id"])
lengths = np.diff(np.concatenate([[-1], starts]))  # tokens per document, EOT included
fig, ax = plt.subplots(figsize=(5, 2.5))
ax.hist(lengths, bins=np.arange(0, 400, 8))
ax.set_xlabel("tokens per document (speech)"); ax.set_ylabel("documents")
ax.set_title(f"median {np.median(lengths):.0f}, mean {lengths.mean():.0f} tokens")
plt.tight_layout(); plt.show()

# %% [markdown]
# ## Using a prepared dataset
#
# The trainer needs two things from a dataset folder besides its tokens: the tokenizer (to print
# samples) and the assurance that the token ids fit the model. `check_compatible` (defined before
# `prepare`, which uses it to tell an intact dataset from a damaged one) verifies that
# `tokenizer.json` is the one the shards were encoded with (its sha256 is in the manifest), that
# every shard is present with the recorded length and dtype (its byte order too: a header flipped from `'<u2'` to
# `'>u2'` is still `uint16` by name, and swaps every token's bytes), and that the largest possible id,
# $V_\text{data} - 1$, is a row of the model's embedding: $V_\text{data} \le V_\text{model}$. A
# model vocabulary larger than the data's is allowed (data prepared with 64 000 tokens fits the 750M
# model's 64 256 rows, a multiple of 128); a smaller one would index past the embedding. (The trainer warns when the
# model has at least twice the data's rows: most of its embedding would never be a token.)
#
# Sizes catch a shard cut short, not one whose bytes changed on disk. For that each shard's CRC-32 is in the
# manifest, and `check_contents` reads every byte to compare: `python -m hymo.data info` and `prepare`'s "already
# there" check call it. Training checks them too, without waiting for it: the trainer starts a `ContentsCheck`,
# which reads the shards in a background thread while the first steps train (CRC-32 sums 2.3 to 3.2 GB/s on one core,
# chapter 70 measures it, and zlib lets go of the GIL as it sums). The ranks of a node share the work, so each node
# reads the copy it trains on once. Damage stops the run at the next step, and no checkpoint is written before the
# check has read every shard: no checkpoint holds a step trained on bytes not yet checked. (A dataset prepared by an
# older HyMo, whose manifest has no sums, is not checked, and the trainer warns that it is not.) The
# loader also checks each batch's ids against the vocabulary as it reads them, so a damaged shard whose ids no
# tokenizer has stops the run with its name before the check gets there, rather than failing in the model's embedding.

# %%
test_eq(check_compatible(ds, 2048)["vocab_size"], 2048)
check_compatible(ds, 4096)  # a larger embedding is fine
test_fail(lambda: check_compatible(ds, 1024), contains="set model.vocab_size >= 2048")
test_fail(lambda: check_compatible(work, 2048), contains="holds 2 datasets: give one of them")  # a folder of datasets
test_eq(check_contents(ds), True)

# %% [markdown]
# A token changed in a copy of the dataset (to another valid id, which no size or range check can see) is found by its
# checksum:

# %%
damaged = Path(shutil.copytree(ds, work / "damaged"))
shard = np.load(damaged / "train_0000.npy", mmap_mode="r+")
shard[1000] = (shard[1000] + 1) % 2048
shard.flush()
test_fail(lambda: check_contents(damaged), contains="train_0000.npy is damaged (its CRC-32")
test_eq(check_contents(damaged, rank=1, world_size=2), True)  # the other share: val_0000.npy, intact
test_fail(lambda: check_contents(damaged, rank=0, world_size=2), contains="train_0000.npy is damaged")


# %% [markdown]
# ## The default dataset
#
# With no data argument the trainer calls `prepare_default`, which prepares the bundled
# Shakespeare into `$HYMO_CACHE` (default `~/.cache/hymo`), in a folder named by the vocabulary
# size, and reuses it on every later run.

# %%
#| export
def default_cache_dir() -> Path:
    "`$HYMO_CACHE`, or `~/.cache/hymo`."
    return Path(os.environ.get("HYMO_CACHE") or Path.home() / ".cache" / "hymo").expanduser()


def prepare_default(cache_dir: Optional[Path] = None, # Where datasets are cached; None: `default_cache_dir()`
                    vocab_size: int = DEFAULT_VOCAB_SIZE, # BPE vocabulary to train
                    progress: bool = True, # Show progress bars
                   ) -> Path:
    "Prepare the bundled Shakespeare (once) into the cache and return the dataset folder."
    out = Path(cache_dir or default_cache_dir()) / "data" / f"tinyshakespeare-bpe{vocab_size}"
    return prepare(CORPUS, out, vocab_size=vocab_size, overwrite=True, progress=progress)


# %%
test_eq(prepare_default(work / "cache", progress=False), work / "cache" / "data" / "tinyshakespeare-bpe2048")
test_eq(load_manifest(work / "cache/data/tinyshakespeare-bpe2048")["fingerprint"], manifest["fingerprint"])


# %% [markdown]
# ## The loader
#
# A split is one stream of $N$ tokens $x_0 \dots x_{N-1}$ (its shards end to end). Window $k$
# starts at $s_k = kT$ and holds the $T + 1$ tokens $x_{s_k} \dots x_{s_k + T}$: inputs are the
# first $T$, targets the last $T$ (shifted by one). There are $K = \lfloor (N - 1) / T \rfloor$
# windows; consecutive windows share one token, so no token is a target twice: every token but $x_0$
# and a tail shorter than $T$ is a target once over the $K$ windows.
#
# **Order.** Epoch $e$ visits the windows in the permutation $\pi_e$ drawn from a generator seeded
# with $(\text{seed}, e)$. A micro-batch step takes $W B$ windows for $W$ data-parallel ranks with
# $B$ sequences each, and an optimiser step takes $A$ micro-batch steps (gradient accumulation), so
# $G = A W B$ windows, the global batch. An epoch is a whole number of optimiser steps,
# $\lfloor K / G \rfloor$, which is $S = A \lfloor K / G \rfloor$ micro-batch steps (the at most
# $G - 1$ windows left over are a fresh random set every epoch). Step $t$ belongs to epoch
# $e = \lfloor t / S \rfloor$, and rank $r$ reads, for $b = 0 \dots B - 1$,
# $$k = \pi_e\big((t \bmod S)\, W B + r B + b\big).$$
# Nothing but $(\text{seed}, t, r)$ enters: the ranks' windows are disjoint (distinct entries of
# one permutation), together they cover the epoch, and the loader's whole state is the step $t$.
# Resuming is `load_state_dict({'step': t, ...})`.
#
# Optimiser step $s$ is micro-batch steps $t = sA \dots sA + A - 1$, so it reads entries
# $jG \dots jG + G - 1$ of $\pi_e$, with $e$ and $j$ the quotient and remainder of $s$ by
# $\lfloor K / G \rfloor$: the same windows for any $W$ and $A$ with the same $G$. That is what lets a run resume on another number of GPUs with the same data: its
# optimiser steps see the same windows as the run would have. (Measuring an epoch in micro-batch
# steps, $\lfloor K / (W B) \rfloor$, would put the epoch boundary, and so everything after it,
# somewhere else for every $W$.)
#
# **Document boundaries.** With `doc_masking=True` the loader also returns `cu_seqlens`, the
# offsets where documents start. EOT *opens* a segment: it acts as the beginning-of-sequence
# token of the document after it, so that document is predicted from nothing that came before,
# while the EOT that ends a document is still a target of its last token (the model learns when
# to stop). A segment also starts at every row start. For `B > 1` the offsets index the batch
# *flattened* to one row of $BT$ tokens, exactly what a model that packs sequences (the
# varlen kernels, run with batch size 1) needs: `cu_seqlens` is `int32` of shape `[S + 1]`,
# $0 = c_0 < c_1 < \dots < c_S = BT$, and segment $j$ is tokens $c_j \dots c_{j+1} - 1$ of
# `tokens.view(1, B * T)`. The model's GDN and MLA layers restart at every offset, and the MTP
# heads skip the targets that lie past their position's segment (chapter 40).

# %%
#| export
def doc_cu_seqlens(tokens: torch.Tensor, # [B, T] token ids
                   eot_id: int, # The id that opens a document
                  ) -> torch.Tensor:
    "Document start offsets in the flattened `[1, B*T]` batch, and `B*T` at the end: int32 `[S + 1]`."
    import torch
    B, T = tokens.shape
    starts = tokens == eot_id  # (B, T)
    starts[:, 0] = True  # every row starts a segment
    idx = torch.nonzero(starts.reshape(-1)).squeeze(1)  # (S,) offsets into the flattened B*T tokens
    return torch.cat([idx, idx.new_tensor([B * T])]).to(torch.int32)


# %%
E = 0
x = torch.tensor([[5, 6, E, 7, 8, 9, E, 4],
                  [E, 1, 2, 3, 3, 3, E, 2]])
test_eq(doc_cu_seqlens(x, E).tolist(), [0, 2, 6, 8, 14, 16])


# %%
#| export
class TokenLoader:
    "Micro-batches of `seq_len` windows from a prepared split: `(tokens, targets)` `[B, T]` int64, plus `cu_seqlens` with `doc_masking`."
    def __init__(self, data_dir: Path, # A prepared dataset folder
                 split: str = "train", # 'train' or 'val'
                 seq_len: int = 128, # T: tokens per sequence (each window reads T + 1)
                 micro_batch_size: int = 16, # B: sequences per batch on this rank
                 rank: int = 0, # This data-parallel rank
                 world_size: int = 1, # W: data-parallel ranks
                 seed: int = 0, # Seeds the per-epoch window order
                 doc_masking: bool = False, # Also return `cu_seqlens` (document starts in the flattened batch)
                 accum: int = 1, # A: micro-batch steps per optimiser step; an epoch is a whole number of optimiser steps
                 eval_only: bool = False, # Only for `eval_batches` (validation): one micro-batch of windows is enough
                ):
        self.data_dir, self.split, self.seq_len, self.micro_batch_size = Path(data_dir), split, seq_len, micro_batch_size
        self.rank, self.world_size, self.seed, self.doc_masking, self.accum = rank, world_size, seed, doc_masking, accum
        if not 0 <= rank < world_size: raise DataError(f"rank={rank} must be in [0, world_size={world_size})")
        if seed < 0: raise DataError(f"seed={seed} must be >= 0 (it seeds numpy's generator)")
        if seq_len <= 0 or micro_batch_size <= 0 or accum <= 0:
            raise DataError("seq_len, micro_batch_size and accum must be positive")
        self.manifest = load_manifest(data_dir)
        self.eot_id = self.manifest["eot_id"]
        self.shards = _open_shards(data_dir, self.manifest, split)
        self.offsets = np.cumsum([0] + [len(a) for a in self.shards])  # shard i holds stream[offsets[i]:offsets[i+1]]
        self.n_tokens = int(self.offsets[-1])
        self.n_windows = max(self.n_tokens - 1, 0) // seq_len  # K
        per_step = world_size * micro_batch_size * accum  # G
        if self.n_tokens == 0:  # only a validation split can be empty: `prepare` refuses a corpus with no training text
            f = self.manifest.get("val_fraction")
            why = "prepared with val_fraction=0" if not f else f"the cut at val_fraction={f} fell inside the last line"
            raise DataError(f"the {split} split of {data_dir} holds no tokens ({why}): prepare the data again with a "
                            f"{'' if not f else 'larger '}val_fraction (--val-fraction) to have one")
        if self.n_windows == 0:
            raise DataError(f"the {split} split of {data_dir} has {self.n_tokens} tokens; seq_len={seq_len} needs "
                            f"{seq_len + 1} per sequence: use a shorter seq_len or more data")
        if eval_only and self.n_windows < micro_batch_size:  # eval_plan shares what there is among the ranks
            raise DataError(f"the {split} split has {self.n_windows} window{'s' * (self.n_windows != 1)} of seq_len={seq_len}, fewer than one "
                            f"micro-batch (micro_batch_size {micro_batch_size}): use a shorter seq_len, a smaller batch or more data")
        if not eval_only and self.n_windows < per_step:
            raise DataError(f"the {split} split has {self.n_windows} window{'s' * (self.n_windows != 1)} of seq_len={seq_len}, fewer than the "
                            f"{per_step} one optimiser step needs (world_size {world_size} x micro_batch_size "
                            f"{micro_batch_size} x accumulation {accum}): use a shorter seq_len, a smaller batch or more data")
        self.steps_per_epoch = self.n_windows // per_step * accum  # S, micro-batch steps
        self.step, self._perm = 0, (None, None)

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm[0] != epoch: self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return self._perm[1]

    def _one_step_at_least(self):
        if not self.steps_per_epoch:
            raise DataError(f"the {self.split} split has {self.n_windows} window{'s' * (self.n_windows != 1)}, fewer than one optimiser step's "
                            f"{self.world_size * self.micro_batch_size * self.accum}: it serves `eval_batches` only")

    def window_ids(self, step: int) -> np.ndarray:
        "The window indices $k$ this rank reads at `step`: `[B]`."
        if step < 0: raise DataError(f"step={step} must be >= 0")
        self._one_step_at_least()
        epoch, t = divmod(step, self.steps_per_epoch)
        B = self.micro_batch_size
        first = t * self.world_size * B + self.rank * B
        return self._permutation(epoch)[first:first + B]

    def _read(self, start: int, n: int) -> np.ndarray:
        "Tokens `start .. start+n-1` of the stream, across shard boundaries."
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts = []
        while n > 0:
            lo = start - self.offsets[i]
            part = self.shards[i][lo:lo + n]
            parts.append(part); n -= len(part); start += len(part); i += 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _batch(self, windows: np.ndarray):
        import torch
        T = self.seq_len
        ids = np.stack([self._read(int(k) * T, T + 1) for k in windows])  # (B, T+1)
        if ids.size and int(ids.max()) >= self.manifest["vocab_size"]: self._damaged(windows, ids)
        xy = torch.from_numpy(ids.astype(np.int64))
        tokens, targets = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # (B, T) each
        if self.doc_masking: return tokens, targets, doc_cu_seqlens(tokens, self.eot_id)
        return tokens, targets

    def _damaged(self, windows: np.ndarray, ids: np.ndarray):
        "Raise the `DataError` for an id beyond the tokenizer's in `ids` (damaged bytes in a shard): where, and what to do."
        b, t = np.argwhere(ids >= self.manifest["vocab_size"])[0]
        at = int(windows[b]) * self.seq_len + int(t)  # in the split's stream
        i = int(np.searchsorted(self.offsets, at, side="right")) - 1
        shard = self.data_dir / self.manifest["splits"][self.split]["shards"][i]["file"]
        raise DataError(f"shard {shard} holds id {ids[b, t]} at token {at - int(self.offsets[i]):,}, beyond the tokenizer's "
                        f"{self.manifest['vocab_size']}: the dataset is damaged (`python -m hymo.data info {shell_word(self.data_dir)}` "
                        f"checks every shard); prepare it again {_SAME_COMMAND}")

    def batch(self, step: int):
        "The micro-batch of `step` on this rank (a pure function of seed, step and rank)."
        return self._batch(self.window_ids(step))

    def __iter__(self): return self

    def __next__(self):
        b = self.batch(self.step)
        self.step += 1
        return b

    @property
    def epoch(self) -> float:
        "Epochs done so far, fractional."
        self._one_step_at_least()
        return self.step / self.steps_per_epoch

    def state_dict(self) -> dict:
        "Everything needed to continue with the next batch: the step, and what the order depends on."
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size,
                "world_size": self.world_size, "accum": self.accum, "split": self.split, "fingerprint": self.manifest["fingerprint"]}

    def check_same_data(self, saved: dict, # `fingerprint`, `tokenizer_sha256`, `seq_len` and `seed` of a saved run; a key it lacks (or None) is not checked
                        source: str, # What saved them, for the message (a checkpoint's folder)
                       ):
        "Raise `DataError` unless `saved` names this loader's dataset, and the `seq_len` and `seed` its order depends on."
        mine = self.state_dict()
        if saved.get("fingerprint") not in (None, mine["fingerprint"]):
            raise DataError(f"the dataset in {self.data_dir} is not the one {source} trained on (fingerprint "
                            f"{saved['fingerprint'][:12]}… then, {mine['fingerprint'][:12]}… now: prepared again, or another "
                            "folder): resume with that data; to train on this one, start a new run (a new run_dir=..., "
                            "without --resume)")
        if saved.get("tokenizer_sha256") not in (None, self.manifest["tokenizer_sha256"]):  # the fingerprint names a
            # trained tokenizer by its inputs and options: another version of `tokenizers` may learn other merges from them
            raise DataError(f"the dataset in {self.data_dir} was prepared from the same texts as the one {source} trained "
                            "on, but encoded by another tokenizer (its tokenizer.json's sha256 differs: prepared again, "
                            "perhaps with another version of tokenizers), so its ids mean other text: resume with the "
                            "dataset it trained on; to train on this one, start a new run (a new run_dir=..., without --resume)")
        diff = [f"{k} {saved[k]} -> {mine[k]}" for k in ("seq_len", "seed") if saved.get(k, mine[k]) != mine[k]]
        if diff: raise DataError(f"{source} cannot continue its data order with {', '.join(diff)} (the order of the windows "
                                 "depends on them): resume with the saved values, or start a new run (a new run_dir=..., "
                                 "without --resume)")

    def load_state_dict(self, state: dict):
        "Continue from a `state_dict()`; the order-defining settings must be the same."
        self.check_same_data({"fingerprint": state.get("fingerprint")}, "this run")  # the other settings, listed below
        mine = self.state_dict()
        diff = [f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in mine if k != "step" and state.get(k) != mine[k]]
        if diff: raise DataError("cannot resume the data order, settings differ (" + "; ".join(diff) + "): "
                                 "resume with the same data, seed, seq_len, micro_batch_size, world_size and accumulation")
        self.step = int(state["step"])

    def step_after(self, saved: dict, # A saved loader's `state_dict()`, or meta.json's {'optimizer_step': s, 'global_batch_size': G}
                  ) -> int:
        """The step at which to continue a run saved with another global batch or another split of it: in the saved
        run's epoch, after the windows of that epoch it had read (rounded up to this loader's optimiser steps, so none
        is read twice), or at the start of the next epoch when this loader's epoch has no more steps."""
        if "optimizer_step" in saved:  # only meta.json: steps of G windows
            per, per_epoch, step = saved["global_batch_size"], self.n_windows // saved["global_batch_size"], saved["optimizer_step"]
        else:
            per, a = saved["world_size"] * saved["micro_batch_size"], saved.get("accum", 1)  # windows per micro-step
            per_epoch, step = self.n_windows // (per * a) * a, saved["step"]
        epoch, t = divmod(step, per_epoch)
        mine = -(-t * per // (self.world_size * self.micro_batch_size))  # ceil: windows read in the epoch, in this loader's steps
        mine = -(-mine // self.accum) * self.accum  # up to an optimiser step: an epoch stays whole optimiser steps
        if mine >= self.steps_per_epoch: epoch, mine = epoch + 1, 0
        return epoch * self.steps_per_epoch + mine

    def eval_plan(self, n_batches: Optional[int] = None, # Micro-batches in the pass, all ranks together; None: all full ones
                 ) -> list[tuple[int, bool]]:
        """This rank's share of a validation pass: (group, counted) per forward. Group g is windows [g·B, (g+1)·B) in
        stream order, so the pass is the same set on any number of ranks; rank r takes groups r, r + W, ... Every rank
        runs the same number of forwards (FSDP gathers in each); a turn past the last group repeats one, not counted."""
        total = self.n_windows // self.micro_batch_size
        n = total if n_batches is None else min(n_batches, total)
        rounds = -(-n // self.world_size)  # ceil
        return [(g if g < n else g % max(n, 1), g < n) for g in (i * self.world_size + self.rank for i in range(rounds))]

    def eval_batches(self, n_batches: Optional[int] = None, # Micro-batches in the pass, all ranks together; None: all full ones
                    ) -> Iterator:
        "This rank's validation micro-batches (see `eval_plan`): windows in stream order, the same on every call."
        for g, _ in self.eval_plan(n_batches):
            yield self._batch(np.arange(g * self.micro_batch_size, (g + 1) * self.micro_batch_size))


# %% [markdown]
# On the prepared Shakespeare with the tiny preset's shapes ($T = 128$, $B = 16$): the targets are
# the inputs shifted by one, and a window is a slice of the stream.

# %%
T, B = 128, 16
loader = TokenLoader(ds, "train", seq_len=T, micro_batch_size=B, seed=0)
print(f"{loader.n_tokens:,} tokens, {loader.n_windows} windows, {loader.steps_per_epoch} steps per epoch")
tokens, targets = next(loader)
test_eq(tokens.shape, (B, T)); test_eq(tokens.dtype, torch.int64)
test_eq(tokens[:, 1:], targets[:, :-1])
k = int(loader.window_ids(0)[0])
test_eq(tokens[0].numpy(), stream[k * T:k * T + T])
print(repr(tok.decode(tokens[0, :40].tolist())))

# %% [markdown]
# Two ranks see disjoint windows and, together, a whole epoch:

# %%
W = 2
ranks = [TokenLoader(ds, seq_len=T, micro_batch_size=B, rank=r, world_size=W, seed=0) for r in range(W)]
S = ranks[0].steps_per_epoch
seen = [np.concatenate([l.window_ids(t) for t in range(S)]) for l in ranks]
assert not set(seen[0]) & set(seen[1])
test_eq(len(set(seen[0]) | set(seen[1])), S * W * B)
test_eq(len(np.unique(seen[0])), S * B)
test_ne(ranks[0].window_ids(S).tolist(), ranks[0].window_ids(0).tolist())  # the next epoch has a new order

# %% [markdown]
# Resuming: a loader restored from a state dict continues with exactly the batches an
# uninterrupted one would have produced, across an epoch boundary too.

# %%
a = TokenLoader(ds, seq_len=T, micro_batch_size=B, seed=3)
stream_a = [next(a)[0] for _ in range(S + 5)]
b = TokenLoader(ds, seq_len=T, micro_batch_size=B, seed=3)
for _ in range(S - 2): next(b)
c = TokenLoader(ds, seq_len=T, micro_batch_size=B, seed=3)
c.load_state_dict(b.state_dict())
for i in range(S - 2, S + 5): test_eq(next(c)[0], stream_a[i])
test_fail(lambda: c.load_state_dict({**b.state_dict(), "seed": 4}), contains="seed: saved 4")


# %% [markdown]
# One global batch of $G = 32$ windows read three ways: 1 rank accumulating 4 micro-batches of 8,
# 2 ranks accumulating 2, and 4 ranks with none. Every optimiser step reads the same 32 windows in
# all three, over two and a half epochs, which is what resuming on another number of GPUs relies on.

# %%
def optimiser_step_windows(W, A, s):  # the windows of optimiser step s, over all ranks and micro-batches
    ls = [TokenLoader(ds, seq_len=T, micro_batch_size=8, rank=r, world_size=W, seed=0, accum=A) for r in range(W)]
    return sorted(int(k) for l in ls for t in range(s * A, s * A + A) for k in l.window_ids(t))

per_epoch = loader.n_windows // 32
for s in (*range(0, 5 * per_epoch // 2, 7), per_epoch - 1, per_epoch, 2 * per_epoch):  # epoch boundaries too
    test_eq(optimiser_step_windows(1, 4, s), optimiser_step_windows(2, 2, s))
    test_eq(optimiser_step_windows(1, 4, s), optimiser_step_windows(4, 1, s))

# %% [markdown]
# A resume with another global batch (a different $G$) cannot keep the optimiser steps' windows,
# and its epochs leave other windows over. `step_after` keeps what matters: it continues in the
# saved run's epoch, after the windows of that epoch the saved run had read, so none is read twice
# and none is skipped but for the rounding up to an optimiser step (an epoch stays a whole number
# of them). Here a run of $G = 32$ stopped a third of
# the way into its second epoch continues with $G = 16$, and with $G = 128$:

# %%
old = TokenLoader(ds, seq_len=T, micro_batch_size=8, seed=0, accum=4)  # G = 32
old.step = (per_epoch + per_epoch // 3) * 4  # micro-steps: a third into epoch 1
read = {int(k) for t in range(per_epoch * 4, old.step) for k in old.window_ids(t)}  # what it read of epoch 1
for G, accum in ((16, 2), (128, 16)):
    new = TokenLoader(ds, seq_len=T, micro_batch_size=8, seed=0, accum=accum)
    for saved in (old.state_dict(), {"optimizer_step": old.step // 4, "global_batch_size": 32}):  # rank 0's file, or meta.json
        t = new.step_after(saved)
        test_eq(t // new.steps_per_epoch, 1)  # the same epoch
        rest = {int(k) for u in range(t, 2 * new.steps_per_epoch) for k in new.window_ids(u)}
        assert not rest & read and len(rest) == (new.steps_per_epoch - t % new.steps_per_epoch) * 8
        assert t % accum == 0 and t % new.steps_per_epoch * 8 - len(read) < G  # skipped: less than an optimiser step's

# %% [markdown]
# With document masking, each batch also carries its document starts in the flattened batch:

# %%
dm = TokenLoader(ds, seq_len=T, micro_batch_size=B, doc_masking=True)
tokens, targets, cu = next(dm)
flat = tokens.reshape(-1)  # (B*T,)
test_eq(int(cu[0]), 0); test_eq(int(cu[-1]), B * T); test_eq(cu.dtype, torch.int32)
assert bool((flat[cu[:-1].long()] == manifest["eot_id"]).logical_or(cu[:-1] % T == 0).all())
is_start = (flat == manifest["eot_id"]) | (torch.arange(B * T) % T == 0)
test_eq(cu[:-1].long(), torch.nonzero(is_start).squeeze(1))
print(f"{len(cu) - 1} segments in {B} x {T} tokens, longest {int(cu.diff().max())}")

# %% [markdown]
# The validation iterator ignores the training position: windows in stream order, the same
# every time it is called, and the same set on any number of ranks (`eval_batches` counts the
# pass's micro-batches over all ranks), so a validation loss does not move when a run resumes on
# another number of GPUs.

# %%
val = TokenLoader(ds, "val", seq_len=T, micro_batch_size=B)
first = [x for x, _ in val.eval_batches(4)]
next(val)
test_eq([x for x, _ in val.eval_batches(4)], first)
test_eq(first[1][0].numpy(), np.load(ds / "val_0000.npy")[B * T:B * T + T])
print(f"validation: {val.n_tokens:,} tokens, {val.n_windows} windows, {val.n_windows // B} full batches")
plans = [TokenLoader(ds, "val", seq_len=T, micro_batch_size=B, rank=r, world_size=3).eval_plan(4) for r in range(3)]
test_eq(plans, [[(0, True), (3, True)], [(1, True), (0, False)], [(2, True), (1, False)]])  # 4 groups, 3 ranks: 2 repeats

# %% [markdown]
# A validation split smaller than one optimiser step of the training split still gives a
# validation loss: `eval_only` asks for one micro-batch of windows, and ranks past the last group
# repeat one without counting it. So the same data reports the same validation loss on one GPU or
# on many, where a split of two micro-batches would otherwise have none on four ranks.

# %%
few = val.n_windows // B  # micro-batches in the split
many = [TokenLoader(ds, "val", seq_len=T, micro_batch_size=B, rank=r, world_size=few + 2, eval_only=True) for r in range(few + 2)]
counted = sorted(g for ld in many for g, c in ld.eval_plan() if c)
test_eq(counted, list(range(few)))  # every group once, whichever rank
test_fail(lambda: TokenLoader(ds, "val", seq_len=T, micro_batch_size=B, world_size=few + 2), contains="fewer than")
test_fail(lambda: next(many[0]), contains="serves `eval_batches` only")


# %% [markdown]
# ### Every byte, checked while training
#
# The sizes a loader checks as it opens the shards catch a shard cut short; the sums catch bytes changed in place
# (`check_contents`, above). Reading all of a large dataset before the first step would delay every start, so the
# trainer checks the shards its loaders opened in a daemon thread instead, as the first steps train: a `ContentsCheck`.
# The ranks of a node share the work: local rank $r$ of the node's $L$ reads every $L$-th shard from the $r$-th. So
# each node checks the copy it reads, whether the dataset is on a file system every node shares (each node then reads
# it once: the price of also checking copies on each node's own disk) or copied to each. zlib lets go of the GIL as it
# sums (CRC-32 runs at 2.3 to 3.2 GB/s on one core, chapter 70 measures it). The trainer asks `error()` after each
# step and stops at the first damage; it `wait()`s before it writes a checkpoint, so that no checkpoint holds a step
# trained on bytes not yet checked, and a stop's checkpoint in the first steps says when it waits. The check reads the
# arrays the loaders hold, not the folder's files by name: a dataset prepared again, moved or deleted during the run
# does not change what is read. What it does not see: bytes changed in place after their shard was checked (the
# run reads them unchecked), and a shard cut short in place as the run reads it, which ends the process with a bus
# error (SIGBUS) at the first page past its new end, in the check or in the loader, as any reader of a mapped file.

# %%
#| export
class ContentsCheck:
    """The CRC-32 of every shard `loaders` opened (this rank's share: every `world_size`-th, from the `rank`-th) against
    the manifest's, in a daemon thread: the trainer asks `error()` between steps and `wait()`s before it saves."""
    def __init__(self, loaders: Iterable[TokenLoader], # The run's loaders, train's then val's: the same order on every rank
                 rank: int = 0, # This share
                 world_size: int = 1): # How many shares
        shards = [x for L in loaders for x in _with_sums(L.data_dir, L.manifest, L.split, L.shards)]
        self.sums = all(crc is not None for _, crc, _ in shards)  # False: an older manifest, nothing to compare
        self.result, self._error = None, None  # result: True once the share matched, False for a manifest without sums
        def work():
            try: self.result = _sums_match(shards[rank::world_size])
            except Exception as e: self._error = e  # a damaged shard (DataError), or one it cannot read (OSError)
        self._thread = threading.Thread(target=work, name="hymo-check-contents", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        "Whether it is still reading its share."
        return self._thread.is_alive()

    def error(self) -> Exception | None:
        "What the check found so far, without waiting: None while it reads, and once every shard of its share matched."
        return self._error

    def wait(self) -> Exception | None:
        "What the check found, once it has read its whole share."
        self._thread.join()
        return self._error


# %% [markdown]
# A token changed in place (`damaged`, above) is found in the share that holds it, and not in the other:

# %%
loaders = [TokenLoader(damaged, split, seq_len=T, micro_batch_size=B, eval_only=split == "val") for split in ("train", "val")]
found = ContentsCheck(loaders).wait()
assert isinstance(found, DataError) and "train_0000.npy is damaged" in str(found), found
test_eq(ContentsCheck(loaders, rank=1, world_size=2).wait(), None)  # val_0000.npy's share: intact
intact = ContentsCheck([TokenLoader(ds, "train", seq_len=T, micro_batch_size=B)])
test_eq((intact.wait(), intact.result), (None, True))
shutil.rmtree(damaged)  # the loaders' arrays stay readable: the check reads what they opened, not the folder
test_eq(type(ContentsCheck(loaders).wait()), DataError)

# %% [markdown]
# And the errors, each with what to do:

# %%
test_fail(lambda: TokenLoader(ds, "val", seq_len=10**6, micro_batch_size=1), contains="use a shorter seq_len")
test_fail(lambda: TokenLoader(ds, "val", seq_len=T, micro_batch_size=10**4), contains="fewer than")
test_fail(lambda: prepare(work / "nothing.txt", work / "x"), contains="does not exist")
(work / "table.csv").write_text("a,b\n")
test_fail(lambda: prepare(work / "table.csv", work / "x"), contains="unknown file type '.csv'")
(work / "empty.txt").write_text("\n\n  \n")
test_fail(lambda: prepare(work / "empty.txt", work / "x"), contains="the inputs are empty")
(work / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
test_fail(lambda: prepare(work / "latin1.jsonl", work / "x"), contains="is not UTF-8 text")
(work / "table.parquet").write_text("a,b\n")
test_fail(lambda: prepare(work / "table.parquet", work / "x"), contains="cannot be read as Parquet")
test_fail(lambda: prepare(CORPUS, work / "x", vocab_size=0), contains="must be at least 257")
test_fail(lambda: prepare(CORPUS, ds, val_fraction=1.5), contains="must be in [0, 1)")  # before the inputs, and before --out's dataset
shutil.rmtree(work)

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why byte-level BPE rather than a character or word vocabulary?
# Mapping the 256 byte values to symbols first makes every string encodable: there is no
# unknown token, and `decode(encode(s)) == s` for any Unicode (accents, emoji, a stray `\r`). BPE
# then merges frequent byte pairs into tokens, so common words cost one token and rare ones fall
# back to pieces. A character vocabulary wastes the model's context (sequences about 2.9× longer
# here, where HyMo's 2 048 tokens average 2.9 bytes; about 4× against GPT-2-sized vocabularies);
# a word vocabulary cannot spell unseen words. The price is that the vocabulary depends on the
# training corpus: a Shakespeare tokenizer compresses modern English worse.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why store tokens as uint16, and what breaks above 65 536 tokens?
# Ids below $2^{16}$ fit two bytes, half of `int32`: 30 B tokens are 60 GB instead of 120 GB, and
# the loader moves half as many bytes per step. A vocabulary of more than 65 536 tokens would wrap
# silently in `uint16`, so the dtype is chosen from the vocabulary size (`uint32` above it) and
# recorded in the manifest; the loader widens to `int64` only for the small batch it returns.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How does the loader resume exactly where it stopped, and why is that a single integer?
# The batch at step $t$ on rank $r$ is a pure function of $(\text{seed}, t, r)$: the epoch
# $e = \lfloor t/S \rfloor$ selects a permutation seeded with $(\text{seed}, e)$, and the position
# in the epoch selects the slice. So the state is $t$ (plus the settings it depends on, which
# `load_state_dict` checks). A loader that keeps an iterator over a shuffled buffer, or worker
# processes with their own random state, needs all of that state saved, and usually replays or
# skips data after a restart.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why make EOT open the next document's segment rather than close the current one?
# With document masking no information may cross a boundary. The input at an EOT position
# predicts the first token of the next document; if EOT belonged to the previous segment, that
# prediction would be conditioned on the previous document. Opening the segment with EOT makes it
# a beginning-of-sequence token: the first token is predicted from EOT alone, the way generation
# starts from a prompt of one EOT. The EOT that ends a document is still a *target* of its last
# token, so the model learns where documents end.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why must `prepare` write to a temporary folder and rename?
# A dataset that looks complete but is not (a crash after three of five shards, or a manifest
# written before the shards) trains silently on the wrong data. Writing everything into a hidden
# temporary folder and renaming it in one `os.replace` means the folder `DIR` either does not
# exist or is complete; on the same file system the rename is atomic. Every file is flushed to the
# disk before the rename, and the rename before the old dataset is deleted, so a power cut cannot
# leave a renamed folder whose shards the disk never got. The fingerprint check
# makes a re-run cheap (it hashes the inputs and checksums the shards, and writes nothing), and also
# lets concurrent ranks that all prepared the same data keep one copy.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why is the validation split the end of the corpus and not a random 10 % of documents?
# Neighbouring speeches share names, phrases and plot, so a random split leaks near-copies of the
# validation text into training and makes the validation loss optimistic. Cutting at the end
# (on a line boundary, so no line is split) keeps the two splits apart, is reproducible without a
# seed, and needs only one byte count to compute.
# :::
