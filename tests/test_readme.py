"""The README and the home page notebook give the same install, test and run commands."""
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
