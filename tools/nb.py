"""Notebook chores in one place: keep `nbs/*.ipynb`, `nbs_py/*.py` and `hymo/` in step.

    python tools/nb.py sync              # nbs_py/*.py <-> nbs/*.ipynb (jupytext), then nbdev-export
    python tools/nb.py run 12_gated_deltanet 13 ...   # execute chapters, by name or number (outputs saved in the .ipynb), clean, sync, export
    python tools/nb.py run all           # execute every chapter
    python tools/nb.py check             # exit 1 if sync or export would change a tracked file (CI)

Write a chapter either as the notebook or as its paired script; `sync` carries the newer one over.
`run` stores outputs (plots, printed tables) in the notebook so the docs show them without
re-running; slow or GPU cells marked `#| slow` / `#| gpu` are skipped, as in `nbdev-test`.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"


def sh(*cmd):
    subprocess.run(cmd, cwd=ROOT, check=True)


def sync():
    sh("jupytext", "--quiet", "--sync", *sorted(map(str, NBS.glob("*.ipynb"))), *sorted(map(str, (ROOT / "nbs_py").glob("*.py"))))
    sh("nbdev-clean")
    sh("jupytext", "--quiet", "--sync", *sorted(map(str, NBS.glob("*.ipynb"))))
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
        shell.run_all(nb, exc_stop=True)
        for c in skipped: c.cell_type = "code"; c.outputs = []; c.execution_count = None
        write_nb(nb, p)
    os.chdir(ROOT)
    sync()


def check():
    git = lambda *a: subprocess.run(["git", *a, "--", "nbs", "nbs_py", "hymo"], cwd=ROOT,
                                    capture_output=True, text=True, check=True).stdout
    if changed := git("status", "--porcelain"):  # sync would rewrite them, and the check then compares with the commit
        sys.exit("check compares a fresh sync and export with the last commit, and syncing rewrites nbs/, nbs_py/ and hymo/ "
                 "(an edit of hymo/ by hand would be lost): commit these changes first (after `python tools/nb.py sync`), "
                 "or stash them:\n" + changed)
    sync()
    out = git("diff", "--name-only") + git("ls-files", "--others", "--exclude-standard")
    if out.strip():
        print("These files change when the notebooks are synced and exported; run `python tools/nb.py sync` and commit:\n" + out)
        subprocess.run(["git", "--no-pager", "diff", "--stat"], cwd=ROOT)
        sys.exit(1)
    print("notebooks, scripts and package are in sync")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in {"sync", "run", "check"}:
        sys.exit(__doc__)
    {"sync": lambda: sync(), "run": lambda: run(sys.argv[2:] or sys.exit(__doc__ + "\nrun: name the chapters to execute, or `all`")), "check": lambda: check()}[sys.argv[1]]()
