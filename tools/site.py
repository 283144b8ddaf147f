"""Render the docs site offline into `_site/`: every chapter in `nbs/` and every workshop deck in `slides/`.

    python tools/site.py             # or `make docs`; then: python -m http.server -d _site
    python tools/site.py --slides    # only the decks (`make slides`)

It is the offline twin of the Quarto site (`nbdev-docs` with `nbs/_quarto.yml`, decks with the top-level
`_quarto.yml`), built with the pandoc of `pypandoc-binary` and reveal.js from npm, so no Quarto and no
network at view time: maths is MathML, drawn with the STIX Two Math font (from npm, copied into
`_site/fonts/`: without a math font a browser draws sums and braces at text size), images are embedded,
reveal.js is copied into `_site/slides/`.

What it does with a notebook, the way nbdev + Quarto do:
- the first markdown cell's `# Title` and `> description` become the page title and subtitle;
- markdown cells are Pandoc markdown; Quarto callouts (`::: {.callout-tip collapse="true"}` with a
  `## Question` heading) become `<details>` that start closed; backticked names of exported objects
  link to their docs; links to `NN_name.ipynb` go to that chapter's page;
- `#| export` cells are replaced by the API docs of what they define (signature with docments and docstring, as nbdev's `show_doc` shows them), `#| exports`
  cells show those docs and then their source, in a collapsible block shown open; `#| hide`, `#| exporti`, `#| default_exp`,
  `#| include: false` cells are dropped; `#| echo: false` hides the source, `#| output: false` the
  outputs; every `#|` line is stripped;
- outputs: text, HTML, markdown, LaTeX, PNG/JPEG (embedded) and SVG.
The notebooks are rendered as they are saved: a chapter whose script in `nbs_py/` says something else (an edit
not yet synced) is named on stderr, with `python tools/nb.py sync` to carry it over.
The sidebar lists every chapter (glob of `nbs/*.ipynb`, in file order, grouped by the tens of the
chapter number) and every deck, on every page; each chapter has previous/next links. The top bar
searches every section of every chapter, as Quarto's does (`search.js` over `search-index.js`, a
script rather than JSON so that it loads from `file://` too), and links to the repository.
"""
from __future__ import annotations

import argparse
import ast
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import textwrap
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS, SLIDES, OUT, CACHE = ROOT / "nbs", ROOT / "slides", ROOT / "_site", ROOT / ".cache"
CSS = Path(__file__).with_name("site.css")
REVEAL = CACHE / "npm" / "node_modules" / "reveal.js"
REVEAL_VERSION = "5"
MATH_FONT = CACHE / "npm" / "node_modules" / "@fontsource" / "stix-two-math" / "files" / "stix-two-math-latin-400-normal.woff2"
MATH_FONT_VERSION = "5"  # @fontsource/stix-two-math: the whole font (its MATH table, 4 605 characters) despite "latin" in the name
SITE_TITLE = "HyMo"
REPO_URL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
SEARCH_JS = Path(__file__).with_name("search.js")
# Sidebar parts: a chapter numbered NN belongs to the last part whose first number is <= NN.
PARTS = [(0, "Foundations"), (10, "Linear attention"), (20, "Attention"), (30, "Sparsity"),
         (40, "The model"), (50, "Training"), (80, "Results")]
HIDE = {"hide", "exporti", "default_exp"}

# Quarto callouts -> HTML. A heading that opens the callout (or its `title` attribute) is the title;
# `collapse="true"` makes it a closed <details>, `collapse="false"` an open one.
CALLOUTS_LUA = r"""
local function title_of(el, kind)
  local body = el.content
  if #body > 0 and body[1].t == 'Header' then
    local rest = pandoc.List()
    for i = 2, #body do rest:insert(body[i]) end
    return body[1].content, rest
  end
  if el.attributes['title'] then
    local doc = pandoc.read(el.attributes['title'], 'markdown')
    if #doc.blocks > 0 then return doc.blocks[1].content, body end
  end
  return {pandoc.Str((kind:gsub('^%l', string.upper)))}, body
end

function Div(el)
  local kind
  for _, c in ipairs(el.classes) do kind = kind or c:match('^callout%-(%a+)$') end
  if not kind then return nil end
  local title, body = title_of(el, kind)
  local cls = 'callout callout-' .. kind
  local collapse = el.attributes['collapse']
  if collapse == 'true' or collapse == 'false' then
    local open = collapse == 'false' and ' open' or ''
    return {pandoc.RawBlock('html', '<details class="' .. cls .. '"' .. open .. '>\n<summary>'),
            pandoc.Plain(title), pandoc.RawBlock('html', '</summary>'),
            pandoc.Div(body, {class = 'callout-body'}), pandoc.RawBlock('html', '</details>')}
  end
  return pandoc.Div({pandoc.Div({pandoc.Plain(title)}, {class = 'callout-title'}),
                     pandoc.Div(body, {class = 'callout-body'})}, {class = cls})
end
"""
PAGE_TEMPLATE = "$highlighting-css$\n<!--split-->\n$table-of-contents$\n<!--split-->\n$body$\n"


@dataclass
class Page:
    src: Path  # The notebook or deck
    html: str  # Output file name, relative to _site/
    title: str
    desc: str = ""
    part: str = ""


def pandoc_path() -> str:
    try:
        import pypandoc
        return pypandoc.get_pandoc_path()
    except (ImportError, OSError) as e:  # no pypandoc, or pypandoc without the pandoc binary pypandoc-binary brings
        sys.exit(f"the offline site is rendered with the pandoc of pypandoc-binary ({e}): pip install -e '.[dev]'")


def unsynced() -> list[str]:
    "The scripts of `nbs_py/` that say something their notebook does not (`tools/nb.py`'s check of a pair), or have none."
    import importlib.util
    spec = importlib.util.spec_from_file_location("hymo_nb_tools", Path(__file__).with_name("nb.py"))
    nb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nb)
    return ([f"{nb.rel(py)} differs from its notebook" for notebook, py in nb.pairs() if nb.disagree(notebook, py)]
            + [f"{nb.rel(py)} has no notebook" for py in sorted(nb.PYS.glob("*.py")) if not (NBS / f"{py.stem}.ipynb").exists()])


def nb_html_name(p: Path) -> str:
    "nbdev's page name: `00_config.ipynb` -> `config.html` (numeric prefix dropped, lower case)."
    return re.sub(r"^\d+[a-zA-Z0-9]*_", "", p.name.lower()).rsplit(".", 1)[0] + ".html"


def part_of(p: Path) -> str:
    m = re.match(r"(\d+)", p.name)
    if not m: return ""
    return [name for start, name in PARTS if start <= int(m.group(1))][-1]


def read_nb(p: Path) -> list[dict]:
    for attempt in range(5):  # a notebook being saved by `tools/nb.py sync` may be half-written for a moment
        try: cells = json.loads(p.read_text())["cells"]; break
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            if attempt == 4:
                sys.exit(f"{p} is not a notebook ({type(e).__name__}: {e}): fix it, or restore it with git checkout -- {p}")
            time.sleep(1)
    for c in cells: c["source"] = "".join(c.get("source", ""))
    return cells


def title_desc(md: str) -> tuple[str, str, str]:
    "Split nbdev's title cell: (`# Title`, `> description`, the rest of the cell)."
    m = re.match(r"\s*#\s+(.+?)\s*\n(?:\s*\n)*(?:>\s*(.+?)\s*(?:\n|$))?", md + "\n")
    if not m: return "", "", md
    return m.group(1), m.group(2) or "", md[m.end():]


def chapters() -> list[Page]:
    "Every notebook in nbs/, home page first, then in file (reading) order."
    nbs = sorted(NBS.glob("*.ipynb"), key=lambda p: (p.name != "index.ipynb", p.name))
    pages = []
    for p in nbs:
        first = next((c["source"] for c in read_nb(p) if c["cell_type"] == "markdown"), "")
        title, desc, _ = title_desc(first)
        pages.append(Page(p, nb_html_name(p), title or p.stem, desc, part_of(p)))
    return pages


def decks() -> list[Page]:
    pages = []
    for p in sorted(SLIDES.glob("*.qmd")):
        fm = re.match(r"---\n(.*?)\n---", p.read_text(), flags=re.S)
        meta = _yaml(fm.group(1)) if fm else {}
        pages.append(Page(p, f"slides/{p.stem}.html", str(meta.get("title", p.stem)), str(meta.get("subtitle", ""))))
    return pages


def _yaml(s: str) -> dict:
    import yaml
    return yaml.safe_load(s) or {}


# ---------------------------------------------------------------- notebook -> Pandoc markdown

def directives(src: str) -> tuple[dict, str]:
    "Cell directives (`#| key: value` or nbdev's `#| key value`) and the source without any `#|` line."
    d, keep = {}, []
    for line in src.splitlines():
        s = line.strip()
        if s.startswith("#|"):
            body = s[2:].strip()
            if not body: continue
            k, _, v = body.partition(":") if re.match(r"[\w-]+\s*:", body) else body.partition(" ")
            v = v.strip()
            d[k.strip()] = v.lower() if v.lower() in ("true", "false") else v  # YAML's booleans: `echo: False` too
        elif not re.search(r"#\|\s*hide_line\s*$", line):
            keep.append(line)
    code = "\n".join(keep)
    code = re.sub(r"(?m)^\s*%(load_ext|autoreload|reload_ext|matplotlib|config)\b.*\n?", "", code)
    return d, code.strip("\n")


def fence(text: str, attrs: str) -> str:
    "A fenced block longer than any backtick run inside `text`."
    n = max([3] + [len(m) + 1 for m in re.findall(r"`{3,}", text)])
    return f"{'`' * n}{attrs}\n{text}\n{'`' * n}"


ANSI = re.compile(r"\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])")


def output_md(o: dict, alt: str = "") -> str:
    "One cell output as Pandoc markdown (raw HTML for rich outputs); `alt` describes an image (the cell's `fig-alt`)."
    kind = o.get("output_type")
    if kind == "stream":
        text = ANSI.sub("", "".join(o.get("text", ""))).rstrip("\n")
        return fence(text, "{.output}") if text.strip() else ""
    if kind == "error":
        return fence(ANSI.sub("", "\n".join(o.get("traceback", []))), "{.output .error}")
    data = {k: "".join(v) if isinstance(v, list) else v for k, v in o.get("data", {}).items()}
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            alt = html.escape(alt or "figure", quote=True)  # never the plot's repr, `<Figure size 640x480 ...>`
            img = f'<img class="output-img" alt="{alt}" src="data:{mime};base64,{data[mime].strip()}">'
            return fence(img, "{=html}")
    if "image/svg+xml" in data: return fence(data["image/svg+xml"], "{=html}")
    if "text/html" in data: return fence(f'<div class="output-html">\n{data["text/html"]}\n</div>', "{=html}")
    if "text/markdown" in data: return data["text/markdown"]
    if "text/latex" in data: return data["text/latex"]
    if "text/plain" in data: return fence(ANSI.sub("", data["text/plain"]).rstrip("\n"), "{.output}")
    return ""


def defined_names(code: str) -> list[str]:
    "Public functions and classes defined at the top level of `code` (what nbdev documents)."
    try: tree = ast.parse(code)
    except SyntaxError: return []
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [n.name for n in tree.body if isinstance(n, defs) and not n.name.startswith("_")]


def api_doc(code: str, name: str) -> str:
    """API docs of `name` defined in `code`, read from the source like nbdev's `show_doc`: the signature
    with its docments (the comment after each argument), or a class's fields / `__init__`, then the docstring."""
    lines = code.splitlines()
    node = next(n for n in ast.parse(code).body if getattr(n, "name", None) == name)

    def header(n):  # the `def`/`class` lines up to the body, comments included
        if n.body[0].lineno > n.lineno: return textwrap.dedent("\n".join(lines[n.lineno - 1:n.body[0].lineno - 1])).rstrip()
        kw = "class" if isinstance(n, ast.ClassDef) else "def"  # a one-line definition
        args = ", ".join(map(ast.unparse, n.bases)) if kw == "class" else ast.unparse(n.args)
        return f"{kw} {n.name}({args}):"

    sig = header(node)
    if isinstance(node, ast.ClassDef):
        body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        fields = [n for n in body if isinstance(n, ast.AnnAssign)]
        init = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if fields:  # a dataclass: its fields, with the comment lines among them
            a, b = fields[0].lineno - 1, fields[-1].end_lineno
            part = [l for l in lines[a:b] if not re.match(r"\s*(def |@)", l)]
            sig += "\n" + textwrap.indent(textwrap.dedent("\n".join(part)), "    ")
        elif init is not None:
            sig += "\n" + textwrap.indent(header(init), "    ")
    doc = ast.get_docstring(node) or ""
    one_line = doc and "\n" not in doc.strip()  # in italics, as nbdev shows it, by a class: `*...*` would end at an `_F`
    doc = f"\n\n::: {{.doc-summary}}\n{doc.strip()}\n:::" if one_line else (f"\n\n{doc.strip()}" if doc else "")
    return f"::: {{.doc}}\n### {name} {{#{name} .doc-name}}\n\n{fence(sig, '{.python}')}{doc}\n:::"


FILE_SUFFIXES = {"py", "json", "jsonl", "yaml", "yml", "ipynb", "qmd", "md", "txt", "toml", "pt", "safetensors", "png",
                 "csv", "sh", "log", "distcp", "html", "js", "css", "parquet", "bin"}  # `train_step.py` is a file, not an attribute


FENCE = re.compile(r"\s*(`{3,}|~{3,})(.*)")


def in_fences(md: str) -> list[bool]:
    """For each line of `md`, whether it belongs to a fenced code block (its fences included). As in CommonMark, a block
    ends only at a fence of its own character, at least as long, with nothing after it: a ```` fence can show a ``` one."""
    flags, opened = [], None
    for line in md.split("\n"):
        m = FENCE.match(line)
        if opened is None:
            if m and not (m[1][0] == "`" and "`" in m[2]): opened = m[1]  # ``` with a backtick after is inline code
            flags.append(opened is not None)
        else:
            flags.append(True)
            if m and m[1][0] == opened[0] and len(m[1]) >= len(opened) and not m[2].strip(): opened = None
    return flags


def outside_code(md: str, pattern: str, sub) -> str:
    "`re.sub(pattern, sub, ...)` on the prose of `md` only: not in fenced code blocks, nor in inline code spans."
    spans = re.compile(r"(`+)(?:(?!\1).)+?\1|" + pattern)
    return "\n".join(line if code else spans.sub(lambda m: m[0] if m[1] else sub(m), line)
                     for line, code in zip(md.split("\n"), in_fences(md)))


def link_names(md: str, symbols: dict[str, list], here: str) -> str:
    """Link backticked names of exported objects (`RMSNorm`, `ModelConfig.layer_types`) to their docs: the definition on
    this page if there is one, else the only one (a name several chapters define, like `main`, is left unlinked).
    Headings are left alone (a link in a callout's question would leave the page instead of opening the answer), and
    so are file names (`train_step.py`)."""
    def sub(m):
        whole, name = m.group(0), m.group(1)
        if name.partition(".")[2] in FILE_SUFFIXES: return whole
        targets = symbols.get(name.split(".")[0], [])
        target = next((t for t in targets if t[0] == here), targets[0] if len(targets) == 1 else None)
        if not target: return whole
        page, anchor = target
        return f"[{whole}]({'' if page == here else page}#{anchor})"
    return "\n".join(line if code or line.lstrip().startswith("#") else
                     re.sub(r"(?<![\[`])`([A-Za-z_]\w*(?:\.\w+)?)(?:\(\))?`(?![\]`])", sub, line)
                     for line, code in zip(md.split("\n"), in_fences(md)))


def fix_links(md: str, nb_pages: dict[str, str]) -> str:
    """Links to other notebooks or decks point at their pages, by the file's name where it is in nbs/ or slides/
    (`20_rope.ipynb`, `../slides/02_mla.qmd`); a link shown as code is left as written."""
    def sub(m):
        name, frag = m[2], m[3] or ""
        ours = Path(name).parent.name in ("", "nbs", "slides")  # not another folder's file of the same name
        if ours and Path(name).name not in nb_pages:
            print(f"warning: a link to {name} is left as written: no notebook or deck of that name", file=sys.stderr)
        return f"]({nb_pages.get(Path(name).name, name) if ours else name}{frag})"
    return outside_code(md, r"\]\(([\w./-]+\.(?:ipynb|qmd))(#[^)\s]*)?\)", sub)


def attachments(md: str, cell: dict) -> str:
    for name, data in (cell.get("attachments") or {}).items():
        mime, b64 = next(iter(data.items()))
        md = md.replace(f"attachment:{name}", f"data:{mime};base64,{''.join(b64)}")
    return md


def notebook_md(page: Page, symbols: dict, nb_pages: dict) -> str:
    "The whole notebook as one Pandoc markdown document (title cell removed: it is the page header)."
    cells, parts, title_done = read_nb(page.src), [], False
    shown = set(re.findall(r"show_doc\(\s*(\w+)", "\n".join(c["source"] for c in cells if c["cell_type"] == "code")))
    for c in cells:
        if c["cell_type"] == "markdown":
            md = c["source"]
            if not title_done:
                title_done = True
                _, _, md = title_desc(md)
            md = attachments(fix_links(link_names(md, symbols, page.html), nb_pages), c)
            if md.strip(): parts.append(md.strip())
            continue
        if c["cell_type"] != "code": continue
        d, code = directives(c["source"])
        if d.keys() & HIDE or d.get("include") == "false" or not (code or c.get("outputs")): continue
        if "export" in d or "exports" in d:
            parts += [api_doc(code, n) for n in defined_names(code) if n not in shown]
            if "exports" in d:
                parts.append(f'<details class="code-fold" open>\n<summary>Exported source</summary>\n\n'
                             f'{fence(code, "{.python}")}\n\n</details>')
            continue
        if re.match(r"show_doc\(", code): d["echo"] = "false"  # nbdev shows only its output
        if code and d.get("echo") != "false":
            block = fence(code, "{.python}")
            fold = d.get("code-fold")
            if fold in ("true", "show"):
                summary = d.get("code-summary", "Code").strip("\"'")
                block = (f'<details class="code-fold"{" open" if fold == "show" else ""}>\n'
                         f'<summary>{html.escape(summary)}</summary>\n\n{block}\n\n</details>')
            parts.append(block)
        if d.get("output") != "false":
            alt = d.get("fig-alt", "").strip("\"'")
            parts += [md for md in (output_md(o, alt) for o in c.get("outputs", [])) if md.strip()]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------- pandoc and the page layout

def run_pandoc(args: list[str], text: str) -> str:
    res = subprocess.run([pandoc_path(), *args], input=text, capture_output=True, text=True)
    if res.returncode: raise RuntimeError(f"pandoc failed: {res.stderr}")
    for line in res.stderr.splitlines():
        if line.strip(): print(f"  pandoc: {line}", file=sys.stderr)
    return res.stdout


def md_to_html(md: str, tmp: Path) -> tuple[str, str, str]:
    "(highlighting CSS, table of contents, body) of one page."
    out = run_pandoc(["-f", "markdown", "-t", "html5", "--mathml", "--toc", "--toc-depth=2",
                      f"--template={tmp / 'page.tpl'}", f"--lua-filter={tmp / 'callouts.lua'}",
                      "--syntax-highlighting=pygments", "--wrap=none"], md)
    css, toc, body = out.split("<!--split-->\n", 2)
    body = re.sub(r"<table\b", '<div class="table-wrap"><table', body).replace("</table>", "</table></div>")  # scrolls sideways
    return css.strip(), toc.strip(), body


# a `##`/`###` heading with its anchor: on the heading, or (API docs) on the <section> just before it
HEADING = re.compile(r'(?:<section id="(?P<sec>[^"]+)"[^>]*>\s*)?<h(?P<n>[23])(?: id="(?P<id>[^"]+)")?[^>]*>(?P<title>.*?)</h(?P=n)>', re.S)


def plain(fragment: str) -> str:
    "The text of an HTML fragment, maths dropped (MathML's tokens read as noise), no backticks, whitespace collapsed."
    fragment = re.sub(r"<math\b.*?</math>", " ", fragment, flags=re.S).replace("`", "")
    fragment = re.sub(r"</?(span|code|a|em|strong|sub|sup)\b[^>]*>", "", fragment)  # inline: no word break
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def search_entries(page: Page, body: str) -> list[dict]:
    """One search entry per section of a page: its `##`/`###` heading (none for the text before the first)
    with the anchor, and the section's text, code included (so `chunk_gated_delta_rule` finds its docs)."""
    cuts = [(0, "", "")] + [(m.start(), m["sec"] or m["id"] or "", plain(m["title"])) for m in HEADING.finditer(body)]
    out = []
    for (start, anchor, heading), nxt in zip(cuts, cuts[1:] + [(len(body), "", "")]):
        text = plain(HEADING.sub(" ", body[start:nxt[0]], count=1) if heading else body[start:nxt[0]])
        if text or heading:
            out.append({"page": page.title.replace("`", ""), "section": heading,
                        "href": page.html + (f"#{anchor}" if anchor else ""), "text": text})
    return out


def inline(text: str) -> str:
    "A title as HTML: escaped, with `code` spans."
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def sidebar(pages: list[Page], slides: list[Page], here: str, root: str) -> str:
    "Every chapter in order, grouped by part, then the decks; `root` prefixes hrefs."
    rows, part = [], None
    for p in pages:
        if p.part != part:
            if part is not None or p.part: rows.append(f'<li class="part">{html.escape(p.part)}</li>')
            part = p.part
        cur = ' aria-current="page" class="current"' if p.html == here else ""
        rows.append(f'<li><a href="{root}{p.html}"{cur}>{inline(p.title)}</a></li>')
    if slides:
        rows.append('<li class="part">Workshop slides</li>')
        rows += [f'<li><a class="deck" href="{root}{d.html}">{inline(d.title)}</a></li>' for d in slides]
    return '<nav class="sidebar" aria-label="Chapters"><ul>\n' + "\n".join(rows) + "\n</ul></nav>"


def pager(pages: list[Page], i: int) -> str:
    prev = pages[i - 1] if i > 0 else None
    nxt = pages[i + 1] if i + 1 < len(pages) else None
    a = lambda p, rel, label: (f'<a class="{rel}" rel="{rel}" href="{p.html}"><span>{label}</span>'
                               f'{inline(p.title)}</a>') if p else "<span></span>"
    return f'<nav class="pager">{a(prev, "prev", "← Previous")}{a(nxt, "next", "Next →")}</nav>'


def layout(page: Page, body: str, toc: str, hl_css: str, side: str, pager_html: str) -> str:
    desc = f'<p class="description">{inline(page.desc)}</p>' if page.desc else ""
    toc_html = f'<aside class="toc"><h2>On this page</h2>{toc}</aside>' if toc else ""
    title = page.title if page.html == "index.html" else f"{page.title} – {SITE_TITLE}"
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title.replace("`", ""))}</title>
<meta name="description" content="{html.escape(page.desc.replace("`", ""), quote=True)}">
<link rel="icon" href="data:,">
<link rel="stylesheet" href="site.css">
<style>{hl_css}</style>
<script src="search-index.js" defer></script>
<script src="search.js" defer></script>
</head>
<body>
<header class="topbar"><a class="brand" href="index.html">{SITE_TITLE}</a>
<form class="search" role="search" onsubmit="return false"><input type="search" id="search" placeholder="Search  /"
 aria-label="Search the chapters" autocomplete="off"><ol id="search-results" aria-label="Search results" hidden></ol></form>
<a class="repo" href="{REPO_URL}">Repository</a></header>
<div class="layout">
{side}
<main>
<header class="page-header"><h1 class="title">{inline(page.title)}</h1>{desc}</header>
{body}
{pager_html}
</main>
{toc_html}
</div>
</body>
</html>
"""


def build_chapters(tmp: Path, slides: list[Page]) -> list[Page]:
    pages = chapters()
    nb_pages = {p.src.name: p.html for p in pages} | {d.src.name: d.html for d in slides}
    symbols = {}  # exported name -> [(page, anchor)], one for each chapter that defines it
    for p in pages:
        for c in read_nb(p.src):
            if c["cell_type"] != "code": continue
            d, code = directives(c["source"])
            if ("export" in d or "exports" in d) and not d.keys() & {"hide"}:
                for n in defined_names(code):
                    if (p.html, n) not in symbols.setdefault(n, []): symbols[n].append((p.html, n))
    def render(i):
        p = pages[i]
        md = notebook_md(p, symbols, nb_pages)
        try: hl, toc, body = md_to_html(md, tmp)
        except RuntimeError as e: raise RuntimeError(f"{p.src.name}: {e}") from None
        (OUT / p.html).write_text(layout(p, body, toc, hl, sidebar(pages, slides, p.html, ""), pager(pages, i)))
        return f"  {p.src.relative_to(ROOT)} -> _site/{p.html}", search_entries(p, body)
    index = []
    with ThreadPoolExecutor(4) as ex:
        for line, entries in ex.map(render, range(len(pages))): print(line); index += entries
    (OUT / "search-index.js").write_text("window.HYMO_SEARCH = " + json.dumps(index, ensure_ascii=False) + ";\n")
    shutil.copy(SEARCH_JS, OUT / "search.js")
    shutil.copy(CSS, OUT / "site.css")
    return pages


def copy_math_font():
    "The math font next to the pages (`site.css` and the decks' `<head>` load it from `_site/fonts/`)."
    (OUT / "fonts").mkdir(parents=True, exist_ok=True)
    shutil.copy(MATH_FONT, OUT / "fonts" / "stix-two-math.woff2")


# ---------------------------------------------------------------- slides (reveal.js)

def ensure_npm() -> Path:
    "reveal.js and the math font from npm into .cache/npm (once), so the site needs no network when viewed."
    have = lambda: (REVEAL / "dist" / "reveal.js").exists() and MATH_FONT.exists()
    if not have():
        wanted = [f"reveal.js@{REVEAL_VERSION}", f"@fontsource/stix-two-math@{MATH_FONT_VERSION}"]  # in one call: --no-save
        npm = shutil.which("npm")  # would remove a package that an earlier call installed and this one does not name
        if not npm: sys.exit(f"npm is needed to fetch {' and '.join(wanted)} for the docs: install Node.js/npm (apt-get install npm)")
        print(f"  npm install {' '.join(wanted)} into .cache/npm")
        (CACHE / "npm").mkdir(parents=True, exist_ok=True)
        got = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(CACHE / "npm"), *wanted],
                             stdout=subprocess.DEVNULL)
        if got.returncode != 0 or not have():  # npm said why, above
            sys.exit(f"npm could not fetch {' and '.join(wanted)} for the docs (offline?): build once with the "
                     f"npm registry reachable; they are kept in {CACHE / 'npm'} after that")
    return REVEAL


def build_slides(tmp: Path, slides: list[Page], pages: list[Page]):
    if not slides: return
    reveal = ensure_npm()
    dest = OUT / "slides" / "reveal.js"
    for sub in ("dist", "plugin"): shutil.copytree(reveal / sub, dest / sub, dirs_exist_ok=True)
    head = tmp / "slides-head.html"
    # the math font is named here rather than in slides.css, which Quarto's decks share and which have no _site/fonts/
    head.write_text('<link rel="icon" href="data:,">\n<link rel="stylesheet" href="slides.css">\n'
                    '<style>@font-face { font-family: "STIX Two Math"; src: url("../fonts/stix-two-math.woff2") format("woff2"); }\n'
                    '.reveal math { font-family: "STIX Two Math", math; }</style>\n')
    shutil.copy(Path(__file__).with_name("slides.css"), OUT / "slides" / "slides.css")
    for d in slides:
        text = fix_links(d.src.read_text(), {p.src.name: "../" + p.html for p in pages})
        out = run_pandoc(["-f", "markdown", "-t", "revealjs", "-s", "--mathml", "--slide-level=2",
                          "-V", "revealjs-url=reveal.js", "-V", "theme=white", "-V", "slideNumber=true",
                          "-V", "hash=true", "-V", "transition=none", "-V", "width=1280", "-V", "height=720",
                          f"--include-in-header={head}", f"--lua-filter={tmp / 'callouts.lua'}",
                          "--syntax-highlighting=pygments", "--wrap=none"], text)
        (OUT / d.html).write_text(out)
        print(f"  {d.src.relative_to(ROOT)} -> _site/{d.html}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slides", action="store_true", help="only render the workshop decks")
    args = ap.parse_args(argv)
    pandoc_path()  # before anything is deleted: a missing pandoc or npm stops here with what to install
    slides = decks()
    ensure_npm()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        (tmp / "callouts.lua").write_text(CALLOUTS_LUA)
        (tmp / "page.tpl").write_text(PAGE_TEMPLATE)
        if args.slides:
            (OUT / "slides").mkdir(parents=True, exist_ok=True)
            build_slides(tmp, slides, chapters())
            copy_math_font()
        else:
            chapters()  # reads every notebook: a damaged one stops here, before the old site is deleted
            for what in unsynced():
                print(f"warning: {what}, and the site shows the notebooks: if the script's edit is the one wanted, run "
                      "`python tools/nb.py sync` and render again", file=sys.stderr)
            if OUT.exists(): shutil.rmtree(OUT)
            (OUT / "slides").mkdir(parents=True)
            pages = build_chapters(tmp, slides)
            build_slides(tmp, slides, pages)
            copy_math_font()
            manifest = {k: [{"src": str(p.src.relative_to(ROOT)), "html": p.html, "title": p.title} for p in v]
                        for k, v in (("chapters", pages), ("decks", slides))}
            (OUT / "pages.json").write_text(json.dumps(manifest, indent=1))  # what was built, for the tests
    print(f"done: {OUT.relative_to(ROOT)}/ (view: python -m http.server -d _site)")


if __name__ == "__main__":
    main()
