"""Notebook chores in one place: keep `nbs/*.ipynb`, `nbs_py/*.py` and `hymo/` in step.

    python tools/nb.py sync              # nbs_py/*.py <-> nbs/*.ipynb (jupytext), then nbdev-export
    python tools/nb.py run 12_gated_deltanet 13 ...   # execute chapters, by name or number (outputs saved in the .ipynb), clean, sync, export
    python tools/nb.py run all           # execute every chapter
    python tools/nb.py check             # exit 1 if a committed pair disagrees, hymo/ holds a module no notebook
                                         # exports, or sync or export would change a tracked file (CI)

Write a chapter either as the notebook or as its paired script; `sync` carries the edited one over (the one changed
since the last sync, or the last commit, whichever file is newer) and says which way it went. A pair edited on both
sides is refused, not merged: jupytext would keep the newer file and drop the other's edit.
`run` stores outputs (plots, printed tables) in the notebook so the docs show them without
re-running; slow or GPU cells marked `#| slow` / `#| gpu` are skipped, as in `nbdev-test`.
"""
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS, PYS = ROOT / "nbs", ROOT / "nbs_py"


def sh(*cmd):
    subprocess.run(cmd, cwd=ROOT, check=True)


def rel(p: Path) -> str: return str(p.relative_to(ROOT))


def pairs() -> list:
    "`(notebook, script)` for every chapter with both files (`jupytext --sync` writes a missing one)."
    return [(nb, PYS / f"{nb.stem}.py") for nb in sorted(NBS.glob("*.ipynb")) if (PYS / f"{nb.stem}.py").exists()]


def as_script(notebook) -> str:
    "A notebook's text as its paired script, as jupytext writes it (the pair's settings in jupytext.toml)."
    import jupytext
    from jupytext.config import load_jupytext_config
    return jupytext.writes(notebook, fmt="py:percent", config=load_jupytext_config(str(NBS)))


def script_text(nb: Path) -> str:
    "The notebook at `nb` as its paired script's text."
    import jupytext
    try: notebook = jupytext.read(nb)
    except Exception as e:  # noqa: BLE001 (JSON or nbformat's errors: the file is not a notebook)
        sys.exit(f"{rel(nb)} is not a notebook ({type(e).__name__}: {e}): fix it, or restore it with git checkout -- {rel(nb)}")
    return as_script(notebook)


def disagree(nb: Path, py: Path) -> bool: return script_text(nb) != py.read_text(encoding="utf-8")


SYNCED = ROOT / ".nb_sync.json"  # (git ignores it) each pair's script text, hashed, as the last sync left it


def digest(text: str) -> str: return hashlib.sha1(text.encode()).hexdigest()


def committed_text(nb: Path, py: Path) -> str | None:
    "The pair's script text in the last commit, if the commit holds both files and they agree there; else None."
    import jupytext
    show = lambda p: subprocess.run(["git", "show", f"HEAD:./{rel(p)}"], cwd=ROOT, capture_output=True, text=True)
    script, notebook = show(py), show(nb)  # (text: CRLF read as LF, as read_text does)
    if script.returncode or notebook.returncode: return None
    try: return script.stdout if as_script(jupytext.reads(notebook.stdout, fmt="ipynb")) == script.stdout else None
    except Exception: return None  # noqa: BLE001 (a commit's notebook that is not one: no common text)


def choose_sides():
    """Before `jupytext --sync`, which carries the newer file of each pair over the older: for each pair that disagrees,
    make the side that moved the newer (times in a fresh clone say nothing), refuse a pair where both moved, and say
    which way each goes. A side has moved unless it is a text the pair last shared: as the last sync left it, or as
    the last commit holds it (where its notebook agreed); with neither known, the newer file is taken."""
    try: synced = json.loads(SYNCED.read_text())
    except (OSError, ValueError): synced = {}
    both = []
    for nb, py in pairs():
        text, script = script_text(nb), py.read_text(encoding="utf-8")
        if text == script: continue
        shared = {synced[py.stem]} if py.stem in synced else set()
        if (committed := committed_text(nb, py)) is not None: shared.add(digest(committed))
        moved = [f for f, t in ((nb, text), (py, script)) if shared and digest(t) not in shared]
        if len(moved) == 2: both.append(f"{rel(nb)} and {rel(py)}"); continue
        src = moved[0] if moved else max((nb, py), key=lambda f: f.stat().st_mtime_ns)
        if moved:  # make it the newer, even of a file dated in the future
            t = max(time.time(), nb.stat().st_mtime, py.stat().st_mtime) + 1
            os.utime(src, (t, t))
        print(f"{rel(src)} -> {rel(py if src == nb else nb)}" + ("" if moved else " (the newer: no common text to compare with)"))
    if both:
        sys.exit("Edited on both sides since the last sync and the last commit, and they disagree: syncing would keep the "
                 "newer and lose the other's edit:\n  " + "\n  ".join(both) + "\nPut both edits in one of them and restore "
                 "the other (git diff, then git checkout -- FILE), then sync again; or, to let the newer file win, delete "
                 f"{rel(SYNCED)} (the last sync's texts) and sync.")


def record_sync():
    "Each pair's text as this sync leaves it: the next sync's common text (see `choose_sides`)."
    SYNCED.write_text(json.dumps({py.stem: digest(py.read_text(encoding="utf-8")) for _, py in pairs()}, indent=1))


def sync():
    choose_sides()
    sh("jupytext", "--quiet", "--sync", *sorted(map(str, NBS.glob("*.ipynb"))), *sorted(map(str, PYS.glob("*.py"))))
    sh("nbdev-clean")
    sh("jupytext", "--quiet", "--sync", *sorted(map(str, NBS.glob("*.ipynb"))))
    record_sync()  # the pairs agree now, whatever the export below makes of them
    sh("nbdev-export")
    write_llms_txt()


LLMS_MARK = "<!-- Written by `python tools/nb.py sync` from the modules' docstrings; edit the notebooks, not this file -->"


def write_llms_txt():
    """`nbs/llms.txt`, nbdev's index for language models, listing every module with its summary and docs page. nbdev's
    own lists only modules whose docstring runs past its summary and link (here 2 of 17); this file, without nbdev's
    marker, is left to us. Read from the exported modules' docstrings (the notebooks' `> description` lines)."""
    import ast
    from nbdev.config import get_config
    cfg = get_config()
    lib = Path(cfg.lib_path)
    rows = []
    for p in sorted(lib.rglob("*.py")):
        if p.name.startswith("_"): continue
        doc = ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or ""
        summary = " ".join(doc.split("\n\n")[0].split())
        url = next((l[5:].strip() for l in doc.splitlines() if l.startswith("Docs:")), "")
        name = ".".join((lib.name, *p.relative_to(lib).with_suffix("").parts))
        rows.append(f"- [{name}]({url}): {summary}" if url else f"- `{name}`: {summary}")
    text = "\n\n".join([f"# {lib.name}", f"> {cfg.description}", "## Modules", "\n".join(rows), LLMS_MARK]) + "\n"
    (NBS / "llms.txt").write_text(text, encoding="utf-8")


def _skip(cell) -> bool:
    "Cells `nbdev-test` skips: flagged `#| slow` or `#| gpu`, or marked `#| eval: false`."
    lines = [l[2:].strip() for l in cell.source.splitlines() if l.startswith("#|")]
    return any(l.split()[:1] in (["slow"], ["gpu"]) or l.replace(" ", "") == "eval:false" for l in lines)


def chapter(name: str) -> Path:
    "The notebook of nbs/ that `name` gives: its file name, with or without `.ipynb`, or the start of one (`12`, `12_gated`)."
    stem, nbs = name.removesuffix(".ipynb"), sorted(NBS.glob("*.ipynb"))
    hits = [p for p in nbs if p.stem == stem] or [p for p in nbs if p.stem.startswith(stem)]
    if len(hits) != 1:
        sys.exit(f"{name} names {'no notebook' if not hits else 'more than one notebook'} in nbs/; give one of: "
                 + " ".join(p.stem for p in (hits or nbs)))
    return hits[0]


def run(names):
    from fastcore.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell
    paths = sorted(NBS.glob("*.ipynb")) if names == ["all"] else [chapter(n) for n in names]  # a misspelt one before any work
    sync()
    for p in paths:
        print(f"running {p.name}", flush=True)
        os.chdir(NBS)
        nb = read_nb(p)
        skipped = [c for c in nb.cells if c.cell_type == "code" and _skip(c)]
        for c in skipped: c.cell_type = "raw"  # not executed
        shell = CaptureShell()
        try: shell.run_all(nb, exc_stop=True)
        except Exception as e:  # noqa: BLE001 (a cell's own error, whatever it is)
            os.chdir(ROOT)
            sync()
            done = [q.name for q in paths[:paths.index(p)]]
            sys.exit(f"{p.name} failed ({type(e).__name__}: {e}); its outputs are not saved"
                     + (f" (those of {', '.join(done)} are)" if done else "") + ". The traceback is above.")
        for c in skipped: c.cell_type = "code"; c.outputs = []; c.execution_count = None
        write_nb(nb, p)
    os.chdir(ROOT)
    sync()


def strays() -> list:
    """Modules of hymo/ that no notebook exports: without nbdev's header, or exported from a notebook since deleted
    (nbdev-export never deletes a module, so `check`'s sync and diff pass them)."""
    out = []
    for p in sorted((ROOT / "hymo").rglob("*.py")):
        if p.name in ("__init__.py", "_modidx.py"): continue
        head = p.read_text(encoding="utf-8").split("# AUTOGENERATED! DO NOT EDIT! File to edit: ", 1)
        src = (p.parent / head[1].split(maxsplit=1)[0].rstrip(".")).resolve() if len(head) == 2 else None
        if src is None or not src.exists():
            out.append(f"{rel(p)}: " + (f"its notebook {rel(src)} is gone" if src else "not exported from a notebook (no nbdev header)"))
    return out


def check():
    def git(*a):
        try: return subprocess.run(["git", *a, "--", "nbs", "nbs_py", "hymo"], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout
        except subprocess.CalledProcessError as e:
            sys.exit(f"check compares with the last commit, so it needs a git checkout with one (git: {e.stderr.strip()})")
    if changed := git("status", "--porcelain"):  # sync would rewrite them, and the check then compares with the commit
        sys.exit("check compares a fresh sync and export with the last commit, and syncing rewrites nbs/, nbs_py/ and hymo/ "
                 "(an edit of hymo/ by hand would be lost): commit these changes first (after `python tools/nb.py sync`), "
                 "or stash them:\n" + changed)
    if split := [f"{rel(nb)} and {rel(py)}" for nb, py in pairs() if disagree(nb, py)]:
        sys.exit("The commit holds notebooks and scripts that disagree:\n  " + "\n  ".join(split) + "\nDecide which of "
                 "each pair is right, make it the newer (touch it), delete .nb_sync.json (else the side changed since the last sync "
                 "here wins), run `python tools/nb.py sync`, check the diff and commit.")
    if stray := strays():
        sys.exit("hymo/ holds modules no notebook exports (delete them, or export them from a notebook):\n  " + "\n  ".join(stray))
    sync()
    out = git("diff", "--name-only") + git("ls-files", "--others", "--exclude-standard")
    if out.strip():
        print("These files change when the notebooks are synced and exported; run `python tools/nb.py sync` and commit:\n" + out)
        subprocess.run(["git", "--no-pager", "diff", "--stat"], cwd=ROOT)
        sys.exit(1)
    print("notebooks, scripts and package are in sync")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]): print(__doc__); sys.exit()
    if len(sys.argv) < 2 or sys.argv[1] not in {"sync", "run", "check"} or (sys.argv[1] != "run" and len(sys.argv) > 2):
        sys.exit(__doc__)
    {"sync": lambda: sync(), "run": lambda: run(sys.argv[2:] or sys.exit(__doc__ + "\nrun: name the chapters to execute, or `all`")), "check": lambda: check()}[sys.argv[1]]()
