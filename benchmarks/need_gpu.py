"""What a benchmark checks before it starts: where it cannot run, or could not write its result, a one-line message,
not a traceback (and not after minutes of measuring); and how it writes a result it adds to a file."""
import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def need_gpu(on_cpu: str = "",  # What a CPU can run instead, said in the message
             interpreter_ok: bool = False,  # The script has a CPU smoke run under TRITON_INTERPRET=1 (small shapes)
            ):
    "Exit with status 1 unless a CUDA GPU is visible (or, with `interpreter_ok`, TRITON_INTERPRET=1 is set)."
    if torch.cuda.is_available() or (interpreter_ok and os.environ.get("TRITON_INTERPRET") == "1"): return
    raise SystemExit("this benchmark needs a CUDA GPU" + (f"; on a CPU, {on_cpu}" if on_cpu else ""))


def need_triton():
    "Exit with status 1 where Triton cannot be imported (HyMo installs it only on Linux): call before importing it."
    try: import triton  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"this benchmark needs Triton ({e}); it installs on Linux: pip install triton") from None


def device_arg(name: str) -> str:
    "An argparse type: a CPU or CUDA device name (cpu, cuda, cuda:1), checked when the arguments are read."
    try: kind = torch.device(name).type
    except RuntimeError as e: raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None
    if kind not in ("cpu", "cuda"): raise argparse.ArgumentTypeError(f"{name}: the benchmarks run on cpu or cuda (cuda:1, ...)")
    return name


def check_out(p: argparse.ArgumentParser, path, flag: str = "--out",
              adds: type | None = None,  # list: the result is a row put first in the file's list; dict: a table added to the file's
             ):
    """Refuse, before the run, an output file that could not be written (a folder, a missing folder, no write permission)
    or one the result would write over: an existing file must hold what the result is added to (`adds`), or is refused."""
    if path is None: return
    if not str(path).strip(): p.error(f"{flag} is empty: give the name of a file to write (an unset shell variable?)")
    f = Path(os.path.realpath(path))  # through links, to what would be written
    if f.is_dir() or str(path).endswith(("/", os.sep)): p.error(f"{flag} {path} is a folder; give the name of a file to write")
    if f.parent.exists() and not f.parent.is_dir(): p.error(f"{flag} {path}: {f.parent} is a file, not a folder")
    if not f.parent.is_dir():
        p.error(f"{flag} {path}: the folder {f.parent} does not exist; create it or give another path"
                + (" (~ is not expanded inside quotes)" if str(path).startswith("~") else ""))
    if f.exists():
        if not os.access(f, os.W_OK): p.error(f"{flag} {path}: the file cannot be written (permissions)")
        if adds is None: p.error(f"{flag} {path} exists, and this result would replace it: give a new name, or delete it first")
        what = "a list of rows" if adds is list else "tables by key"
        try: old = json.loads(f.read_text())
        except (OSError, ValueError) as e: p.error(f"{flag} {path} cannot be read as JSON ({e}): give a file of {what} or a new file")
        if not isinstance(old, adds): p.error(f"{flag} {path} holds a JSON {type(old).__name__}, not {what}")
        return
    try: tempfile.TemporaryFile(dir=f.parent).close()  # what a new file needs (os.access says yes to root on /proc)
    except OSError as e: p.error(f"{flag} {path}: cannot write in {f.parent} ({e.strerror})")


def add_row(path, row: dict):
    """Put `row` first in the JSON list at `path` (newest first, as the results page reads them; a new file holds just it),
    written whole beside the file and renamed over it: a crash leaves the old list. Check the file first: `check_out(adds=list)`."""
    path = Path(os.path.realpath(path))  # through a link, to the file it names (a rename would replace the link)
    old = json.loads(path.read_text()) if path.exists() else []
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps([row] + old, indent=1))
    os.replace(tmp, path)


def provenance() -> dict:
    "Date, versions and the commit measured (marked when the checkout has changes), for a result row."
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, check=True,
                                        cwd=Path(__file__).parent).stdout.strip()
        code = git("rev-parse", "--short", "HEAD") + (" + changes" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.CalledProcessError): code = "unknown"
    try: import triton; version = triton.__version__
    except ImportError: version = None
    return dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, triton=version, code=code)
