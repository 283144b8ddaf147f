# Docs. `make docs`: the offline site in _site/ (pandoc + reveal.js and a math font from npm, no Quarto, no network at
# view time; view with `python -m http.server -d _site`). `make slides`: only the decks, into _site/slides/.
# `make site`: the published site, with Quarto: nbdev-docs renders the chapters into _docs/, then
# `quarto render --no-clean` adds the decks (top-level _quarto.yml) into _docs/slides/.
.PHONY: docs slides site

docs:
	python tools/site.py

slides:
	python tools/site.py --slides

site:
	nbdev-docs
	quarto render --no-clean
