// Search for the offline site (tools/site.py copies this next to the pages): every section of every chapter,
// from search-index.js (`window.HYMO_SEARCH`: page, section, href, text). A section matches when it holds every
// word typed; its heading counts more than its text. "/" focuses the box, Enter opens the first result,
// the arrow keys move through the results, Escape clears.
(() => {
  const input = document.getElementById("search"), list = document.getElementById("search-results");
  if (!input || !list || !window.HYMO_SEARCH) return;
  const docs = window.HYMO_SEARCH.map(d => ({ ...d, head: (d.page + " " + d.section).toLowerCase(), body: d.text.toLowerCase() }));

  function count(hay, word) {  // occurrences, up to 5
    let n = 0;
    for (let i = hay.indexOf(word); i >= 0 && n < 5; i = hay.indexOf(word, i + word.length)) n++;
    return n;
  }

  function score(d, words) {
    let s = 0;
    for (const w of words) {
      const inHead = d.head.includes(w), n = count(d.body, w);
      if (!inHead && !n) return 0;
      s += (inHead ? 10 : 0) + n + (d.section.toLowerCase() === w ? 20 : 0);
    }
    return s;
  }

  function snippet(d, words) {  // the text around the first word found
    const i = words.map(w => d.body.indexOf(w)).find(i => i >= 0) ?? 0;
    let a = Math.max(0, i - 60);
    if (a > 0) a = d.text.lastIndexOf(" ", a) + 1;  // from a word's start
    return (a > 0 ? "… " : "") + d.text.slice(a, a + 160) + (a + 160 < d.text.length ? " …" : "");
  }

  function show() {
    const words = input.value.toLowerCase().split(/\s+/).filter(w => w.length > 0);
    list.replaceChildren();
    if (!words.length || input.value.trim().length < 2) { list.hidden = true; return; }
    const hits = docs.map(d => [score(d, words), d]).filter(([s]) => s > 0).sort((a, b) => b[0] - a[0]).slice(0, 12);
    for (const [, d] of hits) {
      const li = document.createElement("li"), a = document.createElement("a");
      const head = document.createElement("span"), text = document.createElement("span");
      a.href = d.href;
      head.className = "hit-head"; head.textContent = d.section ? `${d.page} › ${d.section}` : d.page;
      text.className = "hit-text"; text.textContent = snippet(d, words);
      a.append(head, text); li.append(a); list.append(li);
    }
    if (!hits.length) {
      const li = document.createElement("li");
      li.className = "none"; li.textContent = "No results";
      list.append(li);
    }
    list.hidden = false;
  }

  input.addEventListener("input", show);
  input.addEventListener("focus", show);
  input.addEventListener("keydown", e => {
    const links = [...list.querySelectorAll("a")];
    if (e.key === "Enter" && links.length) { e.preventDefault(); location.href = links[0].href; }
    else if (e.key === "ArrowDown" && links.length) { e.preventDefault(); links[0].focus(); }
    else if (e.key === "Escape") { input.value = ""; show(); }
  });
  list.addEventListener("keydown", e => {
    const links = [...list.querySelectorAll("a")], i = links.indexOf(document.activeElement);
    if (e.key === "ArrowDown" && i + 1 < links.length) { e.preventDefault(); links[i + 1].focus(); }
    else if (e.key === "ArrowUp") { e.preventDefault(); (i > 0 ? links[i - 1] : input).focus(); }
    else if (e.key === "Escape") { input.focus(); input.value = ""; show(); }
  });
  document.addEventListener("keydown", e => {
    if (e.key === "/" && document.activeElement !== input && !/^(INPUT|TEXTAREA)$/.test(document.activeElement?.tagName)) {
      e.preventDefault(); input.focus();
    }
  });
  document.addEventListener("click", e => { if (!e.target.closest(".search")) list.hidden = true; });
})();
