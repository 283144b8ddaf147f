# %% [markdown]
# # Data from the command line
#
# > `python -m hymo.data prepare`: turn text files, folders, JSONL or Parquet into token shards.

# %%
#| default_exp data

# %% [markdown]
# A thin command line over `hymo.training.data` (the previous chapter). Two commands:
#
# ```sh
# python -m hymo.data prepare --input PATH [PATH ...] --out DIR [--vocab-size N] [--tokenizer tokenizer.json]
#                             [--doc-split blank|file] [--val-fraction 0.1] [--shard-tokens N] [--overwrite]
# python -m hymo.data info DIR      # print the manifest of a prepared dataset and check every byte of it
# ```
#
# Then train on it with `python -m hymo.train data_dir=DIR`. Running `prepare` twice on the same
# input is cheap: the second run hashes the inputs, finds the same fingerprint, checks the shards' checksums and
# writes nothing (and says so).

# %%
#| export
import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

from tqdm import tqdm

from hymo.train import _Once
from hymo.training.data import (DEFAULT_VOCAB_SIZE, DataError, DataWarning, _a_terminal, _real_out, check_compatible,
                                check_contents, load_manifest, prepare, to_devnull)

# %%
import subprocess
import tempfile

from fastcore.test import test_eq


# %% [markdown]
# `main` takes the argument list (so it can be called from Python and tested), turns a
# `DataError` into a one-line message on stderr and exit status 1, and prints the help when no
# command is given. The user's mistakes are `DataError`s: a missing or unknown input, a file that
# is not UTF-8, JSON or Parquet, an option out of range (checked before any input is read), an
# `--out` that is a file, a folder of something else, a dataset of other inputs, the current folder
# or a mount point (a dataset is installed by renaming a new folder into place, which neither survives).
# `--input` may be given several times and collects every path; any other option that takes a value, given twice, is
# refused, as `python -m hymo.train` refuses a second `--config` (argparse would keep the last without
# a word). `info` prints the
# manifest (on stdout, for `jq`) and then checks the dataset as training does before its first step (every shard's
# size and the tokenizer as the manifest says) and as it does while its first steps train (every shard's CRC-32, reading
# all of it; chapter 60's `ContentsCheck`), before any training. On stderr it says "intact", or gives the error and
# status 1.
#
# Stopping: Ctrl-C, and also SIGTERM and SIGHUP (a scheduler's time limit, a closed terminal), stop `prepare` as an
# exception, so it deletes its work folder; the status is 130, or 128 + the signal's number. Progress bars are drawn
# only when stderr is a terminal: in a log file every redraw would be one more line.
#
# An `--out` the operating system refuses (`/sys/...`, a path through a file, a read-only or full
# disk) is an `OSError`. `prepare` leaves it one, because the trainer reports its own cache folder
# from it; `main` prints one line for it when the error concerns `--out`: the folder, one of its
# parents, or its temporary sibling `.NAME.tmp-*`; or the disk filled up. Any other `OSError`
# keeps its traceback, since it may be a bug.

# %%
#| export
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hymo.data", description="Prepare and inspect HyMo token datasets.")
    sub = p.add_subparsers(dest="command")
    pp = sub.add_parser("prepare", help="tokenize text into train/val token shards with a manifest")
    pp.add_argument("--input", nargs="+", required=True, metavar="PATH", action="extend",  # `--input a --input b`: both
                    help="text files (.txt, .md), folders of them (recursive), .jsonl ('text' field) or .parquet ('text' column)")
    pp.add_argument("--out", required=True, metavar="DIR", action=_Once, help="dataset folder to create")
    pp.add_argument("--vocab-size", type=int, default=None, action=_Once, help=f"BPE vocabulary to train, at least 257: the 256 bytes and <|endoftext|> (default {DEFAULT_VOCAB_SIZE}); the tokenizer learns from the first 1 GiB of the training text (inputs in the order given, a folder's files by path)")
    pp.add_argument("--tokenizer", default=None, metavar="PATH", action=_Once, help="use this tokenizer.json instead of training one")
    pp.add_argument("--doc-split", choices=("blank", "file"), default="blank", action=_Once,
                    help="plain text: blank lines end a document (default), or one document per file")
    pp.add_argument("--val-fraction", type=float, default=0.1, action=_Once, help="fraction of the bytes, at the end, kept "
                    "for validation (default 0.1); the cut falls on a line break, so the document it falls in (with "
                    "--doc-split file, a whole file) has its head in training and its tail in validation")
    pp.add_argument("--shard-tokens", type=int, default=2**27, action=_Once, help="tokens per shard file (default 2**27)")
    pp.add_argument("--overwrite", action="store_true", help="replace a dataset in --out made from other inputs or options")
    pp.add_argument("--no-progress", action="store_true", help="no progress bars (none are drawn unless stderr is a terminal)")
    pi = sub.add_parser("info", help="print the manifest of a prepared dataset and check every byte of it")
    pi.add_argument("dir", metavar="DIR", help="a prepared dataset folder; the manifest goes to stdout, the check's "
                    "result (intact, or the error and status 1) to stderr")
    return p


def _out_error(e: OSError, out: Path) -> str | None:
    "The one-line message for an OS refusal to make or write `out`, or None if `e` is about another file."
    try: out = _real_out(out)  # through a link: the folder it names, where `prepare` writes
    except (DataError, OSError): return None
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    if e.filename is None:  # a write that ran out of space names no file; other errors without one may be reads
        if not full: return None
    else:
        f = Path(os.path.abspath(e.filename))
        if not (f == out or f in out.parents or any(p.parent == out.parent and p.name.startswith(f".{out.name}.")
                                                    for p in (f, *f.parents))): return None
    file = next((p for p in out.parents if p.exists() and not p.is_dir()), None)  # EEXIST, ENOTDIR: a file in the way
    return (f"cannot write {out}: {f'{file} is a file, not a folder' if file else e.strerror}: "
            f"{'free space or ' if full else ''}choose another --out")


class _Stopped(KeyboardInterrupt):
    "SIGTERM or SIGHUP (a scheduler's stop, a closed terminal), raised as Ctrl-C is, so that `prepare` cleans up."
    def __init__(self, signum: int): super().__init__(); self.signum = signum


@contextlib.contextmanager
def _stop_signals_interrupt():
    "While active (in the main thread), SIGTERM and SIGHUP raise `_Stopped`; one ignored (`nohup`) stays ignored."
    wanted = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None
              and threading.current_thread() is threading.main_thread() and signal.getsignal(s) is signal.SIG_DFL]
    def stop(signum, frame): raise _Stopped(signum)
    old = {s: signal.signal(s, stop) for s in wanted}
    try: yield
    finally:
        for s, handler in old.items(): signal.signal(s, handler)


def _stamp(out) -> tuple | None:
    "Which manifest.json `out` holds (inode, time), or None: the same before and after `prepare`, nothing was written."
    try: s = (_real_out(out) / "manifest.json").stat()
    except (OSError, DataError): return None
    return s.st_ino, s.st_mtime_ns


def _n(k: int, word: str) -> str: return f"{k:,} {word}{'s' * (k != 1)}"


def _one_line(show):
    """A `warnings.showwarning` that prints a `DataWarning` as one line at once, above the progress bar: a skipped file is
    said before hours of tokenizing, while there is time to stop and fix the input. Others (tokenizers', pyarrow's) go to `show`."""
    def shown(message, category, *rest, **kw):
        if issubclass(category, DataWarning): tqdm.write(f"warning: {message}", file=sys.stderr)
        else: show(message, category, *rest, **kw)
    return shown


def main(argv: list[str] | None = None, # Arguments without the program name; None reads sys.argv
        ) -> int:
    "Run the `python -m hymo.data` command line; return the exit status."
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            before = _stamp(args.out)
            with warnings.catch_warnings(), _stop_signals_interrupt():  # (catch_warnings puts showwarning back)
                warnings.simplefilter("always", DataWarning)
                warnings.showwarning = _one_line(warnings.showwarning)
                out = prepare(args.input, args.out, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
                              doc_split=args.doc_split, val_fraction=args.val_fraction, shard_tokens=args.shard_tokens,
                              overwrite=args.overwrite, progress=not args.no_progress and _a_terminal(sys.stderr))
            m = load_manifest(out)
            print(f"{out}: {_n(len(m['inputs']), 'input file')}, vocab {m['vocab_size']}, {m['dtype']}, " + ", ".join(
                f"{s} {_n(v['tokens'], 'token')} in {_n(v['documents'], 'document')}" for s, v in m["splits"].items()))
            if before is not None and _stamp(out) == before:
                print("note: nothing written: it already held this dataset (the same inputs and options), intact")
            asked = None if args.tokenizer else args.vocab_size or DEFAULT_VOCAB_SIZE  # a given tokenizer has its own size
            if asked and m["vocab_size"] < asked:
                print(f"note: the tokenizer learned {m['vocab_size']} of the {asked} tokens asked for: the text has "
                      f"no more pairs worth merging. It trains any model whose vocab_size is {m['vocab_size']} or more "
                      f"(the unused rows of a larger one are never targets)")
            if args.val_fraction > 0 and m["splits"].get("val", {}).get("tokens", 0) == 0:
                print(f"warning: the validation split is empty: the cut that keeps the last {args.val_fraction:g} of the "
                      "bytes for it fell in the last line of the text, which stays in training (the cut moves to the next "
                      "line break). Give the text more lines or documents, or --val-fraction 0 to say so",
                      file=sys.stderr)
        elif args.command == "info":
            m = load_manifest(args.dir)
            print(json.dumps(m, indent=1), flush=True)
            check_compatible(args.dir, m["vocab_size"])  # what training checks first: a damaged dataset is not reported fine
            if check_contents(args.dir):  # and what it checks as it trains: every byte of every shard
                print(f"{args.dir}: intact (every shard's size and CRC-32, and the tokenizer's sha256, as the manifest "
                      "says)", file=sys.stderr)
            else:
                print(f"{args.dir}: intact as far as its sizes and the tokenizer's sha256 tell (its manifest has no shard "
                      "checksums, from an older HyMo: the command that prepared it prepares it again, with them)",
                      file=sys.stderr)
        else:
            parser.print_help(sys.stderr)
            return 2
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # prepare writes into a temporary folder and installs it whole at the end
        sig, old = getattr(e, "signum", None), getattr(e, "installed_over", None)
        print(("interrupted" if sig is None else f"stopped by {signal.Signals(sig).name}") + (
              "" if args.command != "prepare" else
              f"; {args.out} holds the new dataset (installed before the stop), and what is left of the old one, which "
              f"was being deleted, is in {old}: delete it" if old is not None else
              f"; {args.out} is as it was (a dataset is installed whole, at the end): the same command prepares it again"),
              file=sys.stderr)
        return 130 if sig is None else 128 + sig
    except BrokenPipeError:  # `... info DIR | head`: the reader has what it wanted and closed the pipe
        to_devnull(sys.stdout)
        return 0
    except OSError as e:
        msg = _out_error(e, Path(args.out)) if args.command == "prepare" else None
        if msg is None: raise  # not --out's: a traceback, it may be a bug
        print(f"error: {msg}", file=sys.stderr)
        return 1
    return 0


# %% [markdown]
# The module runs `main` when started with `python -m hymo.data`. A notebook kernel is also
# named `__main__`, but has no `__file__`, so the cell does nothing here.

# %%
#| export
if __name__ == "__main__" and "__file__" in globals(): sys.exit(main())

# %% [markdown]
# Preparing a small JSONL file and a text file together, from Python and then as a subprocess:

# %%
work = Path(tempfile.mkdtemp())
(work / "a.jsonl").write_text("\n".join(json.dumps({"text": f"Row {i}: the quick brown fox."}) for i in range(40)))
(work / "b.txt").write_text("Speech one.\nStill one.\n\nSpeech two.\n")
test_eq(main(["prepare", "--input", str(work / "a.jsonl"), str(work / "b.txt"), "--out", str(work / "ds"),
              "--vocab-size", "300", "--no-progress"]), 0)
m = load_manifest(work / "ds")
test_eq(m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"], 42)

# %%
r = subprocess.run([sys.executable, "-m", "hymo.data", "prepare", "--input", str(work / "a.jsonl"), str(work / "b.txt"),
                    "--out", str(work / "ds"), "--vocab-size", "300", "--no-progress"], capture_output=True, text=True)
print(r.stdout)
test_eq(r.returncode, 0)
r = subprocess.run([sys.executable, "-m", "hymo.data", "prepare", "--input", str(work / "missing.txt"), "--out",
                    str(work / "x")], capture_output=True, text=True)
print(r.stderr)
test_eq(r.returncode, 1)
assert "does not exist" in r.stderr

# %% [markdown]
# With no command it prints the help to stderr and fails, so a script that forgot the command
# stops there:

# %%
from contextlib import redirect_stderr
import io

# %%
with redirect_stderr(io.StringIO()) as err: test_eq(main([]), 2)
assert "prepare" in err.getvalue()

# %% [markdown]
# An `--out` that cannot be made is one line too, said before any input is tokenized (the inputs
# are only read to hash them first):

# %%
(work / "afile").write_text("a file, not a folder\n")
with redirect_stderr(io.StringIO()) as err:
    test_eq(main(["prepare", "--input", str(work / "b.txt"), "--out", str(work / "afile" / "ds"), "--no-progress"]), 1)
print(err.getvalue())
assert "afile is a file, not a folder: choose another --out" in err.getvalue()

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why keep the command line a separate, thin module?
# The logic lives in importable functions (`prepare`, `load_manifest`) that the trainer and the
# tests call directly. The CLI only parses arguments and maps errors to exit codes, so it cannot
# drift from the library, and `main(argv)` can be tested without a subprocess.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why return exit status 1 with one line instead of a traceback for bad input?
# A missing file or an unknown format is the user's mistake, not a bug: a one-line message that
# says what to do is what they need, and a non-zero status lets scripts and job schedulers stop.
# Tracebacks are kept for real bugs, where they help.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How would you prepare 30 B tokens faster than this single process?
# Tokenizing is embarrassingly parallel over documents. `encode_batch` already uses every core of
# one machine; beyond that, split the inputs into groups, run one `prepare`-like worker per group
# writing its own shards, and merge the manifests (token counts add; the tokenizer is trained once
# on a sample first and passed with `--tokenizer`). The loader reads the shards as one stream, so
# nothing else changes, once the merge has numbered the shards as one stream and rebuilt the
# manifest's fingerprint, sources and checksums. One thing does change: the validation split would
# be each group's last 10 %, not the corpus's, unless the merge moves it.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why pass a tokenizer with `--tokenizer` instead of training one per dataset?
# Token ids only mean something relative to one tokenizer. To continue training a model on new
# data, to compare runs on different corpora, or to evaluate on a held-out set, every dataset must
# be encoded with the model's tokenizer. The manifest records its sha256, and so does a finished
# run's `summary.json`, so which tokenizer encoded what is never a guess: generation checks a run
# folder's copy against it, and a resume refuses a dataset whose fingerprint (its inputs and
# options, with a given tokenizer's hash) or whose tokenizer's hash (each checkpoint keeps it) is
# not the one the run trained on.
# :::
