"""What a benchmark checks before it starts: where it cannot run, or could not write its result, a one-line message,
not a traceback (and not after minutes of measuring)."""
import argparse
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
    "An argparse type: a device name torch understands (cpu, cuda, cuda:1), checked when the arguments are read."
    try: torch.device(name)
    except RuntimeError as e: raise argparse.ArgumentTypeError(str(e).splitlines()[0]) from None
    return name


def check_out(p: argparse.ArgumentParser, path, flag: str = "--out"):
    "Refuse, before the run, an output file that could not be written: a folder, a missing folder, no write permission."
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
        return
    try: tempfile.TemporaryFile(dir=f.parent).close()  # what a new file needs (os.access says yes to root on /proc)
    except OSError as e: p.error(f"{flag} {path}: cannot write in {f.parent} ({e.strerror})")


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
