"""The offline docs site in a real browser.

Builds `_site/` once (`python tools/site.py`), serves it on 127.0.0.1 and loads every page in
headless Debian Chromium through Playwright: no console error, no failed request, nothing fetched
from outside 127.0.0.1, maths rendered as MathML, Q&A callouts closed until clicked, internal links
(and their #anchors) resolving, the sidebar listing every chapter in order, and the decks working.
Screenshots of the home page, a chapter and a slide go to `artifacts/screenshots/` for review.
"""
import ast
import html
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections import namedtuple
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_site"
SHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]

Page = namedtuple("Page", "src html title")

# What every page reports: read from the DOM once the page has loaded.
PAGE_FACTS = """() => {
  const clone = document.body.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, math, .sourceCode').forEach(e => e.remove());
  return {
    text: clone.innerText,
    allText: document.body.innerText,
    description: document.querySelector('p.description')?.innerText ?? '',
    images: [...document.querySelectorAll('main img, article img, body img')].map(i => [i.alt, i.naturalWidth]),
    maths: document.querySelectorAll('math').length,
    mathScrollsY: [...document.querySelectorAll('math[display="block"]')].filter(m => m.scrollHeight > m.clientHeight + 1).length,
    closedQA: document.querySelectorAll('details.callout:not([open])').length,
    rawMath: document.querySelectorAll('span.math:not(:has(math))').length,
    hrefs: [...document.querySelectorAll('a[href]')].map(a => a.href),
    ids: [...document.querySelectorAll('[id]')].map(e => e.id),
    sidebar: [...document.querySelectorAll('nav.sidebar a')].map(a => [a.textContent.trim(), a.getAttribute('href')]),
    prev: document.querySelector('nav.pager a.prev')?.getAttribute('href') ?? null,
    next: document.querySelector('nav.pager a.next')?.getAttribute('href') ?? null,
    clippedCode: [...document.querySelectorAll('main pre')].filter(p => p.scrollWidth > p.clientWidth + 1)
                  .map(p => p.innerText.slice(0, 60)),
  };
}"""


@pytest.fixture(scope="session")
def site():
    if not Path(CHROMIUM).exists():
        why = f"Debian chromium is not installed at {CHROMIUM} (CI installs it with apt-get install chromium)"
        if os.environ.get("HYMO_DOCS_BROWSER") == "required": pytest.fail(why)  # set by .ci/run: no green CI without the docs
        pytest.skip(why)
    before = {p.name for p in (ROOT / "nbs").glob("*.ipynb")}
    res = subprocess.run([sys.executable, "tools/site.py"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, f"python tools/site.py failed:\n{res.stdout}\n{res.stderr}"
    assert "pandoc:" not in res.stderr, f"pandoc warned (math or markup it could not convert):\n{res.stderr}"
    built = json.loads((SITE / "pages.json").read_text())
    assert before <= {Path(c["src"]).name for c in built["chapters"]}, "a notebook has no page"
    return SITE


@pytest.fixture(scope="session")
def built(site):
    "The chapters and decks of this build, as `tools/site.py` saw them (chapters may land meanwhile)."
    m = json.loads((site / "pages.json").read_text())
    return ([Page(ROOT / c["src"], c["html"], c["title"]) for c in m["chapters"]],
            [Page(ROOT / d["src"], d["html"], d["title"]) for d in m["decks"]])


@pytest.fixture(scope="session")
def server(site):
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args): pass
    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):  # the browser may drop a connection: not an error
            if not isinstance(sys.exc_info()[1], ConnectionError): super().handle_error(request, client_address)
    httpd = Server(("127.0.0.1", 0), partial(Quiet, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


@pytest.fixture(scope="session")
def browser(server):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def pages_of(site: Path) -> list[str]:
    "Every HTML page of the site (reveal.js's own files excluded)."
    return sorted(str(p.relative_to(site)) for p in site.rglob("*.html") if "reveal.js" not in p.parts)


def new_page(browser, log: dict):
    "A page that records console errors, page errors, failed and non-local requests; outside requests are blocked."
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    page.on("console", lambda m: m.type == "error" and log["errors"].append(f"console: {m.text}"))
    page.on("pageerror", lambda e: log["errors"].append(f"pageerror: {e}"))
    page.on("requestfailed", lambda r: log["failed"].append(f"{r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and log["failed"].append(f"{r.url} (HTTP {r.status})"))

    def route(r):
        host = urlparse(r.request.url).hostname
        if host == "127.0.0.1": return r.continue_()
        log["outside"].append(r.request.url)
        r.abort()
    page.route("**/*", route)
    return ctx, page


@pytest.fixture(scope="session")
def visits(site, server, browser):
    "Load every page once; page name -> what happened and what its DOM holds."
    out = {}
    for name in pages_of(site):
        log = {"errors": [], "failed": [], "outside": []}
        ctx, page = new_page(browser, log)
        page.goto(server + name, wait_until="load")
        if name.startswith("slides/"): page.wait_for_function("() => window.Reveal && Reveal.isReady()")
        log.update(page.evaluate(PAGE_FACTS))
        ctx.close()
        out[name] = log
    return out


def _load_site_module(monkeypatch):
    "tools/site.py as a module (named so as not to be the stdlib's `site`; its dataclasses look their module up there)."
    import importlib.util
    spec = importlib.util.spec_from_file_location("hymo_site", ROOT / "tools" / "site.py")
    site = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hymo_site", site)
    spec.loader.exec_module(site)
    return site


def test_pages_hold_every_visible_code_cell_output_and_image(visits, built, monkeypatch):
    """Each chapter's page shows the first line of every code cell the reader should see (not hidden, not exported, not
    echo: false), of its printed output and of the first row of each markdown table it outputs (rendered: no `|---|`
    left), in the notebook's order, and exactly the notebook's images, each loaded and described by its cell's
    `fig-alt` (the text a screen reader says and a broken image shows; Quarto reads the same option)."""
    site = _load_site_module(monkeypatch)
    chapters, _ = built
    missing = {}
    for ch in chapters:
        facts = visits[ch.html]
        text = " ".join(facts["allText"].split())
        want, alts, cells = [], [], []
        for c in json.loads(ch.src.read_text())["cells"]:
            if c["cell_type"] != "code": continue
            d, code = site.directives("".join(c["source"]))
            if d.keys() & site.HIDE or d.get("include") == "false" or "export" in d or "exports" in d: continue
            lines = [l for l in code.splitlines() if l.strip() and not l.lstrip().startswith("#")]
            if lines and d.get("echo") != "false" and not code.startswith("show_doc("): want.append(lines[0])
            if d.get("output") == "false": continue
            for o in c.get("outputs", []):
                printed = [l for l in site.ANSI.sub("", "".join(o.get("text", ""))).splitlines() if l.strip()]
                if o.get("output_type") == "stream" and printed: want.append(printed[0])
                rows = [l for l in "".join(o.get("data", {}).get("text/markdown", "")).splitlines() if l.startswith("|")]
                if len(rows) > 2: cells.append(rows[2].strip("|").split("|")[0].replace("`", "").replace("*", "").strip())
                if any(m in o.get("data", {}) for m in ("image/png", "image/jpeg")):
                    alts.append(d.get("fig-alt", "").strip("\"'") or f"(no fig-alt in the cell {lines[:1]})")
        lost = [w for w in want if " ".join(w.split()) not in text]
        if lost: missing[ch.html] = lost[:3] + ([f"... {len(lost)} in all"] if len(lost) > 3 else [])
        at, order = 0, []
        for w in want:
            w = " ".join(w.split())
            if w not in text: continue
            found = text.find(w, at)
            if found < 0: order.append(w)  # on the page, but only before what came earlier in the notebook
            else: at = found
        if order: missing[ch.html + " order"] = order[:3]
        page = (SITE / ch.html).read_text()
        tables = [c for c in cells if not re.search(r"<td[^>]*>(?:\s|<[^>]+>)*" + re.escape(html.escape(c, quote=False)), page)]
        if tables: missing[ch.html + " tables"] = tables  # a markdown output's table rendered as one (not shown raw)
        if [a for a, _ in facts["images"]] != alts or not all(w > 0 for _, w in facts["images"]):
            missing[ch.html + " images"] = [f"the notebook's: {alts}", facts["images"]]
        if "`" in facts["description"]: missing[ch.html + " subtitle"] = [facts["description"]]  # `code` is rendered
    assert not missing, json.dumps(missing, indent=1)


def test_names_link_to_this_pages_definition_or_to_the_only_one(monkeypatch):
    site = _load_site_module(monkeypatch)
    symbols = {"main": [("data_cli.html", "main"), ("train.html", "main")], "RMSNorm": [("layers.html", "RMSNorm")]}
    md = "Call `main` or `RMSNorm`."
    assert site.link_names(md, symbols, "train.html") == "Call [`main`](#main) or [`RMSNorm`](layers.html#RMSNorm)."
    assert site.link_names(md, symbols, "results.html") == "Call `main` or [`RMSNorm`](layers.html#RMSNorm)."
    symbols["train_step"], symbols["Trainer"] = [("trainer.html", "train_step")], [("trainer.html", "Trainer")]
    for kept in ("`train_step.py` wrote `train_step.json`", "## Why does `RMSNorm` come first?", "```\n`RMSNorm`\n```"):
        assert site.link_names(kept, symbols, "results.html") == kept  # files, headings (callout questions), code
    assert (site.link_names("`Trainer.train_step()` and `RMSNorm.weight`", symbols, "results.html")
            == "[`Trainer.train_step()`](trainer.html#Trainer) and [`RMSNorm.weight`](layers.html#RMSNorm)")


def test_code_is_left_as_written_inside_any_fence_and_inline(monkeypatch):
    """A ```` fence can show a ``` block (a notebook teaching markdown): the inner fences do not end it, so nothing in it
    is linked; a link to a notebook or deck goes to its page by the file's name, but not when it is shown as code."""
    site = _load_site_module(monkeypatch)
    symbols = {"RMSNorm": [("layers.html", "RMSNorm")]}
    md = "````md\n```python\n```\n`RMSNorm`\n~~~\n````\n`RMSNorm`"
    assert site.in_fences(md) == [True] * 6 + [False]
    assert site.link_names(md, symbols, "x.html").split("\n")[3:] == ["`RMSNorm`", "~~~", "````", "[`RMSNorm`](layers.html#RMSNorm)"]
    pages = {"20_rope.ipynb": "rope.html", "02_mla.qmd": "slides/02_mla.html"}
    assert (site.fix_links("See [RoPE](./20_rope.ipynb#why), [deck](../slides/02_mla.qmd), [x](other.ipynb).", pages)
            == "See [RoPE](rope.html#why), [deck](slides/02_mla.html), [x](other.ipynb).")
    for kept in ("Write `[RoPE](20_rope.ipynb)` in markdown.", "```\n[RoPE](20_rope.ipynb)\n```", "[old](../attic/20_rope.ipynb)"):
        assert site.fix_links(kept, pages) == kept


def test_built_pages_link_names_to_their_docs_but_not_files_nor_questions(site, built):
    """Every chapter's backticked names of exported objects are links to their docs (an attribute to its class's),
    file names are not (`train_step.py` led to `Trainer.train_step`), nor is a callout's question (a click on it would
    leave the page instead of opening the answer); the description in the page's head has no backticks."""
    pages = {ch.html: (site / ch.html).read_text() for ch in built[0]}
    code_links = [(p, m) for p, text in pages.items() for m in re.findall(r'<a href="([^"]*)"><code>([^<]*)</code></a>', text)]
    assert len(code_links) >= 100, len(code_links)
    assert ("trainer.html", ("data.html#TokenLoader", "TokenLoader.step_after")) in code_links
    files = [(p, m) for p, m in code_links if re.search(r"\.(py|json|yaml|ipynb)$", m[1])]
    assert not files, files
    for p, text in pages.items():
        assert not re.search(r"<summary>(?:(?!</summary>).)*<a ", text, re.S), p
        desc = re.search(r'<meta name="description" content="([^"]*)"', text)
        assert desc is None or "`" not in desc[1], (p, desc[1])


def test_no_notebook_cell_mixes_imports_with_code():
    """nbdev's docs pre-render runs every cell with an import anywhere in it (an import inside a block too; it warns only
    of some): such a cell must hold imports only, or it runs without the cells before it, or starts a benchmark."""
    import ast
    bad = []
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        for i, c in enumerate(json.loads(nb.read_text())["cells"]):
            src = "".join(c["source"])
            if c["cell_type"] != "code" or re.search(r"^#\|\s*(export|exports|exporti|eval:\s*false)\b", src, re.M): continue
            tree = ast.parse("\n".join(l for l in src.splitlines() if not l.lstrip().startswith(("%", "!"))))
            imports = (ast.Import, ast.ImportFrom)
            if any(isinstance(n, imports) for n in ast.walk(tree)) and not all(isinstance(t, imports) for t in tree.body):
                bad.append(f"{nb.name} cell {i}: {src.splitlines()[0][:60]}")
    assert not bad, bad


def test_nbdev_docs_prerender_runs_on_every_notebook():
    """`make site` (nbdev-docs, before Quarto renders) runs every exported cell and every cell with an import in a fresh
    kernel per notebook, skipping all others: a cell mixing imports with code would run without the cells before it
    (a NameError, or a benchmark started by a docs build). Quarto is not needed for this step, so it is checked here."""
    code = ("import warnings; warnings.simplefilter('always'); from nbdev.serve import proc_nbs; "
            "from nbdev.config import get_config; proc_nbs(get_config().nbs_path, n_workers=0, force=True)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Found cells containing imports and other code" not in r.stderr, r.stderr[-4000:]


def test_every_page_loads_without_errors(visits):
    assert len(visits) >= 3 + 4, sorted(visits)  # home, two chapters at least, four decks
    bad = {n: v["errors"] + v["failed"] for n, v in visits.items() if v["errors"] or v["failed"]}
    assert not bad, json.dumps(bad, indent=1)


def test_no_request_leaves_localhost(visits):
    outside = {n: v["outside"] for n, v in visits.items() if v["outside"]}
    assert not outside, json.dumps(outside, indent=1)


def test_sidebar_lists_every_chapter_in_order_with_prev_next(visits, built):
    chapters, decks = built
    assert chapters[0].html == "index.html" and len(decks) == 4
    nums = [int(c.src.name.split("_")[0]) for c in chapters[1:]]
    assert nums == sorted(nums), "chapters are not in reading (number) order"
    # titles straight from the notebooks, independently of the renderer
    for ch in chapters:
        cells = json.loads(ch.src.read_text())["cells"]
        first = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])
        assert ch.title == re.match(r"\s*#\s+(.+)", first).group(1).strip(), ch.src
    want = [[c.title.replace("`", ""), c.html] for c in chapters] + [[d.title, d.html] for d in decks]
    for i, ch in enumerate(chapters):
        v = visits[ch.html]
        assert v["sidebar"] == want, ch.html
        assert v["prev"] == (chapters[i - 1].html if i else None), ch.html
        assert v["next"] == (chapters[i + 1].html if i + 1 < len(chapters) else None), ch.html


def test_every_exported_name_has_its_signature_docments_and_docstring(site, built, monkeypatch):
    """Each public function and class a chapter exports has a section on its page (its anchor) that shows the signature
    with the comment after each argument (or a dataclass's fields with theirs) and the docstring, as nbdev shows them;
    the sidebar marks the page itself as the current one, and only it."""
    tools = _load_site_module(monkeypatch)
    def text(fragment):
        plain = html.unescape(re.sub(r"<[^>]+>", "", fragment))
        return re.sub(r"\s+", " ", plain.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
                      .replace("\u2026", "..."))  # pandoc's typography
    checked = 0
    for ch in built[0]:
        page = (site / ch.html).read_text()
        current = re.findall(r'<a href="([^"]*)" aria-current="page"', page)
        assert current == [ch.html], (ch.html, current)
        for c in json.loads(ch.src.read_text())["cells"]:
            d, code = tools.directives("".join(c["source"]))
            if c["cell_type"] != "code" or not ({"export", "exports"} & d.keys()): continue
            tree = ast.parse(code)
            for node in tree.body:
                if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"): continue
                m = re.search(rf'<section id="{node.name}" class="doc-name doc">(.*?)</section>', page, re.S)
                assert m, (ch.html, node.name)
                shown = text(m[1])
                doc = ast.get_docstring(node)
                if doc: assert re.sub(r"\s+", " ", doc.strip())[:60].replace("`", "") in shown, (ch.html, node.name, shown[:300])
                if doc and "\n" not in doc.strip():  # italic by its class: `*...*` broke at an `_F` and showed the stars
                    summary = re.search(r'<div class="doc-summary">(.*?)</div>', m[1], re.S)
                    assert summary and text(summary[1]).count("*") == doc.count("*"), (ch.html, node.name)
                lines = code.split("\n")
                header = lambda n: lines[n.lineno - 1:n.body[0].lineno - 1]  # def/class lines, with their comments
                fields = [lines[n.lineno - 1] for n in node.body if isinstance(n, ast.AnnAssign)]  # a dataclass's
                init = [header(n) for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
                for line in header(node) + (fields or (init[0] if init else [])):
                    comment = line.partition("  # ")[2] or line.partition(" # ")[2]
                    if comment: assert re.sub(r"\s+", " ", comment.strip()) in shown, (ch.html, node.name, comment)
                checked += 1
    assert checked >= 100, checked


def test_maths_renders_as_mathml(visits, built):
    chapters, decks = built
    with_maths = 0
    for ch in chapters:
        cells = json.loads(ch.src.read_text())["cells"]
        md = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        v = visits[ch.html]
        if re.search(r"\$[^$\s][^$]*\$", md):
            with_maths += 1
            assert v["maths"] > 0, f"{ch.html}: the notebook has $...$ but the page has no <math>"
    scrolls = {c.html: visits[c.html]["mathScrollsY"] for c in chapters if visits[c.html]["mathScrollsY"]}
    assert not scrolls, f"display formulas with a vertical scrollbar: {scrolls}"
    for name, v in visits.items():
        assert v["rawMath"] == 0, f"{name}: {v['rawMath']} formulas were left as TeX (pandoc could not convert them)"
        leftover = re.findall(r"\$\$?[^$\n]{1,80}\$|\\\(|\\\[|\\begin\{", v["text"])
        assert not leftover, f"{name}: raw TeX left in the text: {leftover[:5]}"
    assert with_maths >= 1
    assert all(visits[d.html]["maths"] > 0 for d in decks)


def n_collapsed(ch) -> int:
    "Collapsed callouts in the notebook's markdown (the interview questions)."
    cells = json.loads(ch.src.read_text())["cells"]
    return sum("".join(c["source"]).count('collapse="true"') for c in cells if c["cell_type"] == "markdown")


def test_every_collapsed_callout_is_a_closed_details(visits, built):
    counts = {c.html: (n_collapsed(c), visits[c.html]["closedQA"]) for c in built[0]}
    assert all(want == got for want, got in counts.values()), counts
    assert sum(want for want, _ in counts.values()) >= 4


def test_qa_callouts_start_collapsed_and_open_on_click(built, server, browser):
    chapters = [c for c in built[0] if n_collapsed(c) >= 2]
    assert chapters, "no chapter has interview questions yet"
    ch, n_src = chapters[0], n_collapsed(chapters[0])
    log = {"errors": [], "failed": [], "outside": []}
    ctx, page = new_page(browser, log)
    page.goto(server + ch.html)
    qa = page.locator("details.callout")
    assert qa.count() == n_src, f"{ch.html}: {qa.count()} collapsible callouts for {n_src} in the notebook"
    for i in range(qa.count()):
        d = qa.nth(i)
        assert d.get_attribute("open") is None
        assert d.locator("summary").is_visible() and d.locator("summary").inner_text().strip()
        assert not d.locator(".callout-body").is_visible()
    first = qa.nth(0)
    first.locator("summary").click()
    assert first.get_attribute("open") is not None
    assert first.locator(".callout-body").is_visible()
    assert first.locator(".callout-body").inner_text().strip()
    assert not qa.nth(1).locator(".callout-body").is_visible()  # the others stay closed
    ctx.close()


def test_internal_links_resolve(visits, server):
    checked = set()
    for name, v in visits.items():
        for href in v["hrefs"]:
            if not href.startswith(server): continue
            url, frag = urldefrag(href)
            if url not in checked:
                with urllib.request.urlopen(url) as r: assert r.status == 200, href
                checked.add(url)
            if frag.startswith("/"):  # reveal.js: #/slide-id (or #/h/v indices)
                frag = "" if re.fullmatch(r"/[\d/]*", frag) else frag[1:]
            if frag:
                target = url[len(server):] or "index.html"
                assert target in visits, f"{name}: #{frag} on a page that was not visited: {href}"
                assert frag in visits[target]["ids"], f"{name}: {href}: no element with id {frag!r}"
    assert any(u.endswith(".html") and "slides/" in u for u in checked), "the site does not link the decks"


def search_index(site: Path) -> list[dict]:
    s = (site / "search-index.js").read_text()
    assert s.startswith("window.HYMO_SEARCH = ") and s.rstrip().endswith(";"), s[:80]
    return json.loads(s[len("window.HYMO_SEARCH = "):].rstrip().rstrip(";"))


def test_search_index_covers_every_chapter_and_its_anchors_exist(site, visits, built, monkeypatch):
    """Every chapter is in the search index, cut at its headings and API docs; every entry's anchor is an element of
    its page; every page has the search box and links to the repository."""
    index, repo = search_index(site), _load_site_module(monkeypatch).REPO_URL
    assert {e["href"].split("#")[0] for e in index} == {ch.html for ch in built[0]}
    for e in index:
        page, _, anchor = e["href"].partition("#")
        assert not anchor or anchor in visits[page]["ids"], e["href"]
        assert "<" not in e["section"] and "<math" not in e["text"], e  # plain text, maths left out
        assert not re.search(r"&(?:[a-z]+|#x?[0-9a-f]+);", e["text"] + e["section"]), e  # entities unescaped
        assert not re.search(r"\\(?:eta|lambda|frac|sum|mathbf|top|alpha|beta)\b", e["text"]), e  # nor MathML's TeX
    assert all(any(e["href"] == ch.html and e["section"] == "" for e in index) for ch in built[0])  # each page's intro
    names = {e["section"]: e["href"] for e in index}
    assert names["build_hymo"] == "model.html#build_hymo" and names["RMSNorm"] == "layers.html#RMSNorm"
    assert "def build_hymo(config: ModelConfig" in next(e["text"] for e in index if e["section"] == "build_hymo")
    for ch in built[0]:
        assert "search" in visits[ch.html]["ids"] and repo in visits[ch.html]["hrefs"], ch.html


def test_search_lists_the_sections_holding_every_word_and_opens_the_first(site, server, browser):
    index = search_index(site)
    log = {"errors": [], "failed": [], "outside": []}
    ctx, page = new_page(browser, log)
    page.goto(server + "rope.html")
    page.keyboard.press("/")  # focuses the box
    assert page.evaluate("document.activeElement.id") == "search"
    results = lambda: page.eval_on_selector_all("#search-results a", "as => as.map(a => a.getAttribute('href'))")
    for query in ("forget before error", "cautious weight decay", "doc_masking"):
        page.fill("#search", query)
        words = query.lower().split()
        holding = [e["href"] for e in index
                   if all(w in (e["page"] + " " + e["section"] + " " + e["text"]).lower() for w in words)]
        got = results()
        assert got and set(got) <= set(holding) and len(got) == min(12, len(holding)), (query, got, holding)
    page.fill("#search", "build_hymo")
    assert results()[0] == "model.html#build_hymo"  # a heading that is the query comes first
    page.keyboard.press("Enter")
    page.wait_for_url("**/model.html#build_hymo")
    page.fill("#search", "qqzzxq nonsense")
    assert page.inner_text("#search-results") == "No results" and results() == []
    page.keyboard.press("Escape")
    assert page.is_hidden("#search-results")
    assert not log["errors"] and not log["failed"] and not log["outside"], log
    ctx.close()


def test_search_results_by_keyboard_with_snippets_and_closed_by_a_click_outside(server, browser):
    """The arrow keys walk the results and back to the box, each result shows the text around a word typed, a click
    elsewhere closes the list, and "/" typed in the box is a character, not a jump to it."""
    log = {"errors": [], "failed": [], "outside": []}
    ctx, page = new_page(browser, log)
    page.goto(server + "optim.html")
    page.fill("#search", "newton schulz")
    links = page.eval_on_selector_all("#search-results a", "as => as.map(a => a.getAttribute('href'))")
    assert len(links) >= 3, links
    focused = lambda: page.evaluate("document.activeElement.getAttribute('href') ?? document.activeElement.id")
    page.keyboard.press("ArrowDown")
    assert focused() == links[0]
    page.keyboard.press("ArrowDown"); page.keyboard.press("ArrowDown")
    assert focused() == links[2]
    page.keyboard.press("ArrowUp")
    assert focused() == links[1]
    page.keyboard.press("ArrowUp"); page.keyboard.press("ArrowUp")
    assert focused() == "search"
    hits = page.eval_on_selector_all("#search-results a", "as => as.map(a => [a.querySelector('.hit-head').textContent, "
                                                          "a.querySelector('.hit-text').textContent])")
    for head, text in hits:  # the words found in the text, else in the heading (the text then starts the section)
        assert (re.search(r"newton|schulz", text, re.I) or re.search(r"newton|schulz", head, re.I)) and len(text) <= 164, (head, text)
    assert sum(bool(re.search(r"newton|schulz", text, re.I)) for _, text in hits) >= 2, hits
    page.mouse.click(900, 700)  # the page's text, away from the search box
    assert page.is_hidden("#search-results") and page.input_value("#search") == "newton schulz"
    page.focus("#search"); page.fill("#search", ""); page.keyboard.type("a/b")
    assert page.input_value("#search") == "a/b"
    assert not log["errors"] and not log["failed"] and not log["outside"], log
    ctx.close()


def test_decks_have_slides_maths_and_fragment_answers(built, server, browser):
    for deck in built[1]:
        log = {"errors": [], "failed": [], "outside": []}
        ctx, page = new_page(browser, log)
        page.goto(server + deck.html)
        page.wait_for_function("() => window.Reveal && Reveal.isReady()")
        n = page.evaluate("Reveal.getTotalSlides()")
        assert 8 <= n <= 14, f"{deck.html}: {n} slides"
        answers = page.locator(".fragment.answer")
        assert answers.count() >= 3, f"{deck.html}: {answers.count()} interview answers"
        # go to the slide of the first answer: the answer is hidden until the next click
        h, _ = page.evaluate("(el => { const i = Reveal.getIndices(el.closest('section')); return [i.h, i.v]; })",
                             answers.first.element_handle())
        page.evaluate(f"Reveal.slide({h}, 0, -1)")
        assert "visible" not in (answers.first.get_attribute("class") or "")
        page.evaluate("Reveal.next()")
        page.wait_for_function("el => el.classList.contains('visible')", arg=answers.first.element_handle())
        assert not log["errors"] and not log["failed"] and not log["outside"], log
        ctx.close()


def test_screenshots(built, server, browser):
    SHOTS.mkdir(parents=True, exist_ok=True)
    chapter = max(built[0][1:], key=lambda c: (c.src.read_text().count("$"), c.src.name))
    deck = built[1][0]
    shots = [("home.png", "index.html", None), ("chapter.png", chapter.html, None),
             ("slide.png", deck.html, "#/the-gated-delta-rule")]
    for fname, url, frag in shots:
        log = {"errors": [], "failed": [], "outside": []}
        ctx, page = new_page(browser, log)
        page.goto(server + url + (frag or ""))
        if frag: page.wait_for_function("() => window.Reveal && Reveal.isReady()")
        page.screenshot(path=str(SHOTS / fname))
        ctx.close()
        assert (SHOTS / fname).stat().st_size > 10_000, fname


def test_reveal_js_that_npm_cannot_fetch_is_one_line(tmp_path, monkeypatch):
    "npm offline (or failing) ends the build with one line saying what to do, not a CalledProcessError traceback."
    import shutil as sh
    site = _load_site_module(monkeypatch)
    monkeypatch.setattr(site, "CACHE", tmp_path)
    monkeypatch.setattr(site, "REVEAL", tmp_path / "npm" / "node_modules" / "reveal.js")
    monkeypatch.setattr(site, "MATH_FONT", tmp_path / "npm" / "node_modules" / "font.woff2")
    monkeypatch.setattr(sh, "which", lambda name: "/bin/false")  # an npm that fails, as offline
    with pytest.raises(SystemExit) as e: site.ensure_npm()
    assert "npm could not fetch reveal.js@5 and @fontsource/stix-two-math@5" in str(e.value) and str(tmp_path / "npm") in str(e.value)


@pytest.mark.parametrize("name", ["mla.html", "slides/02_mla.html"])
def test_maths_is_drawn_with_a_math_font(built, server, browser, name):
    """A display sum is a large operator (about 1.6 times the text) and the math font loaded from the site; with the
    text font (no MATH table) the browser draws it at text size (0.94) and underbraces as ticks."""
    ctx, page = new_page(browser, log := {"errors": [], "failed": [], "outside": []})
    page.goto(server + name, wait_until="load")
    got = page.evaluate("""async () => {
      await document.fonts.ready;
      const sums = [...document.querySelectorAll('math[display="block"] :is(munder, munderover) > mo:first-child')]
        .filter(m => m.textContent.trim() === '\\u2211')
        .map(m => m.getBoundingClientRect().height / parseFloat(getComputedStyle(m).fontSize));
      const fonts = [...document.fonts].filter(f => f.family.replace(/"/g, '') === 'STIX Two Math').map(f => f.status);
      return {sums, fonts};
    }""")
    ctx.close()
    assert got["fonts"] == ["loaded"] and not log["failed"], (got, log)
    if name == "mla.html": assert got["sums"] and min(got["sums"]) > 1.3, got


def test_offline_sidebar_parts_are_quartos(monkeypatch):
    """The offline site's parts (`PARTS` in tools/site.py) are the sections of nbs/_quarto.yml's sidebar, with the same
    chapters in each (Quarto's `auto: "N*.ipynb"` globs by the tens digit), and every chapter is in one of them."""
    import yaml
    site = _load_site_module(monkeypatch)
    sidebar = yaml.safe_load((ROOT / "nbs" / "_quarto.yml").read_text())["website"]["sidebar"]["contents"]
    quarto = {}
    for item in sidebar:
        if not isinstance(item, dict) or "section" not in item: continue
        globs = [c["auto"] for c in item["contents"] if isinstance(c, dict) and "auto" in c]
        if globs: quarto[item["section"]] = sorted(int(re.fullmatch(r"(\d)\*\.ipynb", g)[1]) for g in globs)
    assert all(n % 10 == 0 for n, _ in site.PARTS), site.PARTS  # a part begins at a chapter's tens, as a glob does
    firsts = [n for n, _ in site.PARTS] + [site.PARTS[-1][0] + 10]  # the last part: its own tens (a 9x chapter is in no section)
    offline = {name: list(range(firsts[i] // 10, firsts[i + 1] // 10)) for i, (_, name) in enumerate(site.PARTS)}
    assert offline == quarto
    tens = {int(p.name[0]) for p in (ROOT / "nbs").glob("[0-9][0-9]_*.ipynb")}
    assert tens <= {d for ds in quarto.values() for d in ds}, "a chapter that no sidebar section lists"


def test_title_cells_are_a_title_and_a_one_line_description():
    "nbdev (and Quarto) keep only the first `>` line as the page's description and drop the rest of the title cell."
    bad = {}
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        first = "".join(next(c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "markdown")["source"])
        lines = [l for l in first.strip().splitlines() if l.strip()]
        if len(lines) != 2 or not lines[0].startswith("# ") or not lines[1].startswith("> "): bad[nb.name] = lines[1:]
    assert not bad, f"title cells that are not '# Title' and one '> description' line: {bad}"


def test_no_cell_shows_a_bare_object_repr():
    "A cell ending in `torch.manual_seed(0)` shows `<torch._C.Generator at 0x...>`: end it with `;` or assign the result."
    bad = [f"{nb.name} cell {i}: {''.join(o['data']['text/plain'])[:60]}"
           for nb in sorted((ROOT / "nbs").glob("*.ipynb"))
           for i, c in enumerate(json.loads(nb.read_text())["cells"]) for o in c.get("outputs", [])
           if o["output_type"] == "execute_result" and "text/plain" in o["data"]
           and re.fullmatch(r"<[\w.]+( object)?( at 0x[0-9a-f]+)?>", "".join(o["data"]["text/plain"]).strip())]
    assert not bad, bad


def test_site_names_a_script_not_synced_with_its_notebook(tmp_path, monkeypatch, capsys):
    "The site renders the notebooks: a chapter's script edited and not synced would not show, so the build names it."
    import importlib.util
    for f in ("pyproject.toml", "jupytext.toml", "tools/site.py", "tools/nb.py", "nbs/00_config.ipynb", "nbs_py/00_config.py"):
        (tmp_path / f).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    spec = importlib.util.spec_from_file_location("hymo_site", tmp_path / "tools" / "site.py")
    site = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hymo_site", site)
    spec.loader.exec_module(site)
    py = tmp_path / "nbs_py" / "00_config.py"
    import jupytext
    py.write_text(jupytext.writes(jupytext.read(tmp_path / "nbs" / "00_config.ipynb"), fmt="py:percent",
                                  config=jupytext.config.load_jupytext_config(str(tmp_path / "nbs"))))  # the pair in step
    assert site.unsynced() == []
    py.write_text(py.read_text() + "\n# %%\nedited_after_the_sync = 1\n")
    (tmp_path / "nbs_py" / "99_new.py").write_text("# %% [markdown]\n# # New\n")  # a chapter begun as a script
    assert site.unsynced() == ["nbs_py/00_config.py differs from its notebook", "nbs_py/99_new.py has no notebook"]

    class Rendering(Exception): pass
    monkeypatch.setattr(site, "pandoc_path", lambda: "pandoc")
    monkeypatch.setattr(site, "ensure_npm", lambda: tmp_path)
    monkeypatch.setattr(site, "build_chapters", lambda *a: (_ for _ in ()).throw(Rendering()))
    with pytest.raises(Rendering): site.main([])
    err = capsys.readouterr().err
    assert "nbs_py/00_config.py differs from its notebook, and the site" in err and "python tools/nb.py sync" in err, err
    assert "nbs_py/99_new.py has no notebook" in err


def test_hidden_cells_are_not_rendered(tmp_path, monkeypatch):
    "Each way a notebook hides a cell, its source or its output, against what must stay visible (no chapter uses them all)."
    site = _load_site_module(monkeypatch)
    code = lambda src, out=None: {"cell_type": "code", "source": src, "metadata": {}, "execution_count": 1,
                                  "outputs": [{"output_type": "stream", "name": "stdout", "text": out}] if out else []}
    cells = [{"cell_type": "markdown", "source": "# T\n\n> d", "metadata": {}},
             code("#| hide\nSECRET_HIDE = 1", "SECRET_HIDE_OUT"), code("#| exporti\ndef _secret_exporti(): pass"),
             code("#| include: false\nSECRET_INCLUDE = 1", "SECRET_INCLUDE_OUT"),
             code("#| echo: false\nSECRET_ECHO = 1", "VISIBLE_OUT"), code("#| output: false\nVISIBLE_CODE = 1", "SECRET_OUT"),
             code("#| echo: False\nSECRET_ECHO_YAML = 1", "VISIBLE_OUT2"), code("#| output: False\nVISIBLE_CODE2 = 1", "SECRET_OUT2"),
             code("#| export\ndef shown(x):\n    'Doc.'\n    SECRET_BODY = 1")]
    p = tmp_path / "99_t.ipynb"
    p.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    md = site.notebook_md(site.Page(p, "t.html", "T"), {}, {})
    assert "secret" not in md.lower(), md
    assert "VISIBLE_OUT" in md and "VISIBLE_CODE" in md and "{#shown" in md
    assert "VISIBLE_OUT2" in md and "VISIBLE_CODE2" in md


def test_callouts_keep_their_body_open_closed_or_plain(tmp_path, monkeypatch):
    """Quarto's three callout forms: collapse="true" a closed <details>, "false" an open one, none a plain box; each keeps
    its body and its title (a heading that opens it, its title= attribute, else its kind)."""
    site = _load_site_module(monkeypatch)
    md = "\n\n".join([
        '::: {.callout-tip collapse="true"}\n## Q1?\nBODY_ONE\n:::',
        '::: {.callout-note collapse="false" title="T2"}\nBODY_TWO\n:::',
        '::: {.callout-warning}\nBODY_THREE\n:::'])
    (tmp_path / "callouts.lua").write_text(site.CALLOUTS_LUA)  # as main writes them for a build
    (tmp_path / "page.tpl").write_text(site.PAGE_TEMPLATE)
    body = site.md_to_html(md, tmp_path)[2]
    box = r'\s*<div class="callout-body">\s*<p>BODY_{}</p>'
    assert re.search(r'<details class="callout callout-tip">\s*<summary>\s*Q1\?\s*</summary>' + box.format("ONE"), body), body
    assert re.search(r'<details class="callout callout-note" open>\s*<summary>\s*T2\s*</summary>' + box.format("TWO"), body), body
    assert re.search(r'<div class="callout callout-warning">\s*<div class="callout-title">\s*Warning\s*</div>'
                     + box.format("THREE"), body), body


def test_quarto_sidebar_and_navbar_list_home_and_every_deck():
    "The real site's sidebar (written by hand in nbs/_quarto.yml) names every deck in slides/ by its title."
    import yaml
    web = yaml.safe_load((ROOT / "nbs" / "_quarto.yml").read_text())["website"]
    items = web["sidebar"]["contents"]
    assert items[0] == "index.ipynb"
    decks = next(i for i in items if isinstance(i, dict) and i.get("section") == "Workshop slides")["contents"]
    want = [{"text": yaml.safe_load(re.match(r"---\n(.*?)\n---", p.read_text(), re.S)[1])["title"], "href": f"slides/{p.stem}.html"}
            for p in sorted((ROOT / "slides").glob("*.qmd"))]
    assert decks == want
    assert {"index.ipynb", want[0]["href"]} <= {i["href"] for i in web["navbar"]["left"]}
    home = "".join("".join(c["source"]) for c in json.loads((ROOT / "nbs" / "index.ipynb").read_text())["cells"])
    assert [(m[1], m[2]) for m in re.finditer(r"\[([^]]+)\]\((slides/[^)]+)\)", home)] == [(d["text"], d["href"]) for d in want]


def test_nb_run_finds_a_chapter_by_the_start_of_its_name(monkeypatch):
    "`python tools/nb.py run 12` runs 12_gated_deltanet; a name that fits none, or several, lists the chapters it could mean."
    import importlib.util
    spec = importlib.util.spec_from_file_location("hymo_nb_tool", ROOT / "tools" / "nb.py")
    nb = importlib.util.module_from_spec(spec); spec.loader.exec_module(nb)
    assert [nb.chapter(n).name for n in ("12", "00_config", "21_mla.ipynb")] == ["12_gated_deltanet.ipynb", "00_config.ipynb", "21_mla.ipynb"]
    with pytest.raises(SystemExit, match="^1 names more than one notebook in nbs/; give one of: 10_linear_attention 11_delta_rule "):
        nb.chapter("1")
    with pytest.raises(SystemExit, match="^12_gdn names no notebook in nbs/; give one of: 00_config 01_layers"):
        nb.chapter("12_gdn")


def test_nb_run_without_a_chapter_runs_nothing_and_says_how(tmp_path):
    "`python tools/nb.py run` alone executed every chapter (minutes, and outputs rewritten): it names none, so it runs none."
    import shutil
    (tmp_path / "tools").mkdir(); (tmp_path / "nbs").mkdir()
    shutil.copy(ROOT / "tools" / "nb.py", tmp_path / "tools" / "nb.py")
    (tmp_path / "nbs" / "00_a.ipynb").write_text("not a notebook: running it would fail")
    p = subprocess.run([sys.executable, "tools/nb.py", "run"], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode != 0 and p.stderr.rstrip().endswith("run: name the chapters to execute, or `all`"), p.stderr
    assert "00_a" not in p.stdout + p.stderr


def test_nb_check_refuses_a_tree_with_changes_it_would_overwrite(tmp_path):
    "check synced and exported first: an edit of hymo/ by hand was lost, and the check then said 'in sync'."
    import shutil
    repo = tmp_path / "repo"
    for d in ("nbs", "nbs_py", "hymo", "tools"): (repo / d).mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "nb.py", repo / "tools" / "nb.py")
    (repo / "hymo" / "generate.py").write_text("x = 1\n")
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo, check=True,
                                    capture_output=True)
    git("init", "-q"); git("add", "-A"); git("commit", "-qm", "start")
    (repo / "hymo" / "generate.py").write_text("x = 2  # by hand\n")
    p = subprocess.run([sys.executable, "tools/nb.py", "check"], cwd=repo, capture_output=True, text=True)
    assert p.returncode == 1 and "commit these changes first" in p.stderr and " M hymo/generate.py" in p.stderr, p.stderr
    assert (repo / "hymo" / "generate.py").read_text() == "x = 2  # by hand\n"


def _clone(tmp_path) -> Path:
    "A clone of this checkout with the working tree's tools/nb.py, for nb.py's commands to change at will."
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    for a in (("user.name", "t"), ("user.email", "t@t")): subprocess.run(["git", "config", *a], cwd=repo, check=True)
    shutil.copy(ROOT / "tools" / "nb.py", repo / "tools" / "nb.py")
    return repo


def _edit_notebook(path: Path, old: str, new: str):
    "Replace text in a notebook's cells, as an editor would (nbformat's JSON, one space of indent)."
    nb = json.loads(path.read_text())
    src = ["".join(c["source"]) for c in nb["cells"]]
    i = next(i for i, s in enumerate(src) if old in s)
    nb["cells"][i]["source"] = src[i].replace(old, new, 1)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def test_nb_sync_refuses_a_pair_edited_on_both_sides_and_carries_the_edited_side_over(tmp_path):
    "jupytext kept the newer file of a pair edited on both sides (the other edit lost, nothing said), and carried the newer over an edit."
    repo = _clone(tmp_path)
    nb, py = repo / "nbs" / "00_config.ipynb", repo / "nbs_py" / "00_config.py"
    _edit_notebook(nb, "One plain dataclass", "NOTEBOOK EDIT One plain dataclass")
    py.write_text(py.read_text().replace("# # ", "# # SCRIPT EDIT ", 1))
    before = nb.read_text(), py.read_text()
    sync = lambda: subprocess.run([sys.executable, "tools/nb.py", "sync"], cwd=repo, capture_output=True, text=True)
    p = sync()
    assert p.returncode == 1 and "nbs/00_config.ipynb and nbs_py/00_config.py" in p.stderr and "both sides" in p.stderr, p.stderr
    assert (nb.read_text(), py.read_text()) == before
    subprocess.run(["git", "checkout", "-q", "--", "nbs_py/00_config.py"], cwd=repo, check=True)
    os.utime(py, (time.time() + 60, time.time() + 60))  # the unedited side is the newer, as git can leave it in a fresh clone
    p = sync()
    assert p.returncode == 0 and "nbs/00_config.ipynb -> nbs_py/00_config.py" in p.stdout, p.stdout + p.stderr
    assert "NOTEBOOK EDIT One plain dataclass" in py.read_text() and "NOTEBOOK EDIT" in nb.read_text()
    py.write_text(py.read_text().replace("NOTEBOOK EDIT", "SECOND EDIT", 1))  # both differ from the commit, only one from the sync
    p = sync()
    assert p.returncode == 0 and "nbs_py/00_config.py -> nbs/00_config.ipynb" in p.stdout, p.stdout + p.stderr
    assert "SECOND EDIT One plain dataclass" in nb.read_text()
    py.write_text(py.read_text().replace("\n#| export\n", "\n#| export\ndef no_cell(:\n", 1))  # export fails on it...
    assert sync().returncode != 0
    py.write_text(py.read_text().replace("def no_cell(:\n", "", 1))  # ... and the fix is what the next sync carries over
    p = sync()
    assert p.returncode == 0 and "nbs_py/00_config.py -> nbs/00_config.ipynb" in p.stdout and "no_cell" not in py.read_text() + nb.read_text()
    subprocess.run(["git", "commit", "-qm", "synced", "--", "nbs", "nbs_py"], cwd=repo, check=True, capture_output=True)
    (repo / ".nb_sync.json").write_text('{"00_config": "0000"}')  # a record from another branch, say: the commit still counts
    py.write_text(py.read_text().replace("SECOND EDIT", "FOURTH EDIT", 1))
    p = sync()
    assert p.returncode == 0 and "FOURTH EDIT One plain dataclass" in nb.read_text(), p.stdout + p.stderr


def test_nb_check_names_a_committed_pair_that_disagrees_and_modules_no_notebook_exports(tmp_path):
    "A commit of a notebook alone, a hand-written module and one whose notebook was deleted all passed check (or got advice that lost the edit)."
    repo = _clone(tmp_path)
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True)
    check = lambda: subprocess.run([sys.executable, "tools/nb.py", "check"], cwd=repo, capture_output=True, text=True)
    _edit_notebook(repo / "nbs" / "00_config.ipynb", "One plain dataclass", "Edited: one plain dataclass")
    git("commit", "-qm", "the notebook alone", "nbs/00_config.ipynb")
    p = check()
    assert p.returncode == 1 and "disagree" in p.stderr and "nbs/00_config.ipynb and nbs_py/00_config.py" in p.stderr, p.stderr
    git("checkout", "-q", "HEAD~1", "--", "nbs/00_config.ipynb"); git("commit", "-qm", "back")
    py = repo / "nbs_py" / "01_layers.py"  # a script's edit committed alone: its notebook, not newer, must not win
    py.write_text(py.read_text().replace("# # ", "# # Script edit: ", 1)); git("commit", "-qam", "the script alone")
    p = check()
    assert p.returncode == 1 and "nbs/01_layers.ipynb and nbs_py/01_layers.py" in p.stderr, p.stderr
    os.utime(repo / "nbs" / "01_layers.ipynb", (time.time() + 60, time.time() + 60))
    os.utime(py, (time.time() + 120, time.time() + 120))  # touched, as the message says
    p = subprocess.run([sys.executable, "tools/nb.py", "sync"], cwd=repo, capture_output=True, text=True)
    assert "nbs_py/01_layers.py -> nbs/01_layers.ipynb" in p.stdout and "Script edit:" in (repo / "nbs" / "01_layers.ipynb").read_text(), p.stdout + p.stderr
    git("checkout", "-q", "HEAD~1", "--", "nbs_py/01_layers.py", "nbs/01_layers.ipynb"); git("commit", "-qm", "back again")
    (repo / "hymo" / "stray.py").write_text("x = 1\n")
    git("rm", "-q", "nbs/72_generate.ipynb", "nbs_py/72_generate.py"); git("add", "hymo"); git("commit", "-qm", "a stray, a module without notebook")
    p = check()
    assert p.returncode == 1 and "hymo/stray.py: not exported from a notebook" in p.stderr, p.stderr
    assert "hymo/generate.py: its notebook nbs/72_generate.ipynb is gone" in p.stderr, p.stderr


def test_the_site_build_names_a_broken_notebook_and_a_missing_pandoc_and_warns_of_dead_links(monkeypatch, tmp_path, capsys):
    "A broken notebook deleted the old site and gave a JSON traceback; pypandoc without pandoc a traceback; links to no page passed."
    import types
    site = _load_site_module(monkeypatch)
    bad = tmp_path / "30_moe.ipynb"
    bad.write_text("{")
    monkeypatch.setattr(site.time, "sleep", lambda s: None)
    with pytest.raises(SystemExit, match=f"^{bad} is not a notebook \\(JSONDecodeError: .*restore it with git checkout -- {bad}$"):
        site.read_nb(bad)
    def no_pandoc(): raise OSError("No pandoc was found: either install pandoc and add it to your PATH or ...")
    monkeypatch.setitem(sys.modules, "pypandoc", types.SimpleNamespace(get_pandoc_path=no_pandoc))
    with pytest.raises(SystemExit, match="pandoc of pypandoc-binary \\(No pandoc was found.*pip install -e"):
        site.pandoc_path()
    assert site.fix_links("See [MLA](21_mla.ipynb) and [x](99_gone.ipynb).", {"21_mla.ipynb": "mla.html"}) == \
        "See [MLA](mla.html) and [x](99_gone.ipynb)."
    assert "a link to 99_gone.ipynb is left as written: no notebook or deck of that name" in capsys.readouterr().err


def test_code_wraps_as_in_quartos_site_rather_than_being_cut_off(visits):
    "nbs/_quarto.yml asks for code-overflow: wrap; the offline site scrolled over half its code blocks sideways."
    clipped = {name: v["clippedCode"] for name, v in visits.items() if not name.startswith("slides/") and v["clippedCode"]}
    assert not clipped, clipped


def test_a_phone_shows_the_page_first_and_nothing_wider_than_the_screen(built, server, browser):
    "At 400 px every page was 464 px wide (the top bar), tables pushed it sideways, the chapter list came first."
    ctx = browser.new_context(viewport={"width": 400, "height": 800})
    page = ctx.new_page()
    page.route("**/*", lambda r: r.continue_() if urlparse(r.request.url).hostname == "127.0.0.1" else r.abort())
    wide, late = {}, {}
    for p in built[0]:
        page.goto(server + p.html, wait_until="load")
        w = page.evaluate("() => document.documentElement.scrollWidth")
        if w > 400: wide[p.html] = w
        top = page.evaluate("() => document.querySelector('main').getBoundingClientRect().top")
        if top > 200: late[p.html] = top
    assert not wide and not late, (wide, late)
    page.goto(server + "index.html", wait_until="load")
    page.fill("#search", "NorMuon")
    page.wait_for_selector("#search-results:not([hidden])")
    box = page.evaluate("() => { const r = document.getElementById('search-results').getBoundingClientRect();"
                        " return [r.left, r.right]; }")
    assert box[0] >= 0 and box[1] <= 400, box
    ctx.close()


def test_nb_check_passes_a_clean_clone_and_names_an_export_never_committed(tmp_path):
    repo = _clone(tmp_path)
    nb = lambda *a: subprocess.run([sys.executable, "tools/nb.py", *a], cwd=repo, capture_output=True, text=True)
    p = nb("check")
    assert p.returncode == 0 and "in sync" in p.stdout, p.stdout + p.stderr
    subprocess.run(["git", "rm", "-q", "--cached", "hymo/generate.py"], cwd=repo, check=True)
    (repo / "hymo" / "generate.py").unlink()
    subprocess.run(["git", "commit", "-qm", "module not committed"], cwd=repo, check=True, capture_output=True)
    p = nb("check")
    assert p.returncode == 1 and "hymo/generate.py" in p.stdout, p.stdout + p.stderr
    p = nb("sync", "00_config")
    assert p.returncode == 1 and "nb.py sync" in p.stderr and "Traceback" not in p.stderr, p.stderr
    (repo / "nbs" / "00_config.ipynb").write_text("{")
    p = nb("sync")
    assert p.returncode == 1 and "nbs/00_config.ipynb is not a notebook (NotJSONError" in p.stderr \
        and "git checkout -- nbs/00_config.ipynb" in p.stderr and "Traceback" not in p.stderr, p.stderr
