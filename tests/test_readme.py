"""The README and the home page notebook give the same install, test and run commands; llms.txt lists every module."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def code_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]


def test_readme_commands_match_index():
    index = json.loads((ROOT / "nbs" / "index.ipynb").read_text())
    md = "\n".join("".join(c["source"]) for c in index["cells"] if c["cell_type"] == "markdown")
    readme = code_blocks((ROOT / "README.md").read_text())
    for block in code_blocks(md):
        assert block in readme, f"index.ipynb command block missing from README:\n{block}"


def test_readme_tree_names_existing_files():
    text = (ROOT / "README.md").read_text()
    tree = text.split("## Files", 1)[1]
    for line in re.findall(r"^(\S+)\s{2,}", tree, flags=re.M):
        if line.startswith("```"): continue
        assert (ROOT / line).exists(), f"README's file tree names {line}, which does not exist"


def test_llms_txt_lists_every_module():
    "nbs/llms.txt (written by `tools/nb.py sync`) names every public module of the package, with its summary."
    text = (ROOT / "nbs" / "llms.txt").read_text()
    pkg = ROOT / "hymo"
    mods = {".".join(("hymo", *p.relative_to(pkg).with_suffix("").parts)) for p in pkg.rglob("*.py") if not p.name.startswith("_")}
    assert len(mods) >= 17
    listed = set(re.findall(r"^- \[(hymo[\w.]*)\]\(", text, re.M))
    assert listed == mods, (mods - listed, listed - mods)
