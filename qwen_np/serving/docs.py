"""The walkthrough as web pages: `serve` renders docs/walkthrough.md (and the glossary it links to) as HTML.

    GET  /docs/walkthrough        docs/walkthrough.md as HTML: its figures inline, every heading an anchor
    GET  /docs/glossary           docs/glossary.md, whose links land on the walkthrough's sections
    GET  /docs/figures/NAME.png   the figures the pages show (docs/figures/*.png); any other name is a 404

The Markdown is rendered by markdown-it-py (the `serve` extra: CommonMark to the letter, with GFM's tables),
not by hand: the walkthrough has tables, code blocks, and <details> around each exercise's solution. Two
things are added to its tokens before they are rendered: each heading's id, made from the heading's text as
GitHub makes it (heading_anchor), so a `#section` link means the same on GitHub and here, and a link to a
served page's .md file is a link to the page (`walkthrough.md#11-train-one-yourself` -> `walkthrough#...`).
The Markdown is the project's own, shipped in the package, so its raw HTML is kept (the page's
Content-Security-Policy, access.PAGE_HEADERS, runs no inline script whatever it holds).

The files come from the package where a wheel installed them (pyproject.toml maps the top-level docs/ to
qwen_np/docs, as it maps weights/ to qwen_np/weights), else from the source checkout's docs/.

Imports nothing of serving/.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PAGES = ("walkthrough", "glossary")              # docs/NAME.md, served as /docs/NAME
STYLE = "/web/docs.css"                           # the pages' look (web/docs.css, beside the explorer's style.css)
_PAGE_LINK = re.compile(rf"({'|'.join(PAGES)})\.md(#.*)?")


def docs_folder() -> Path:
    """The folder of the walkthrough and its figures: qwen_np/docs in an installed wheel, else the checkout's
    docs/ (an editable install, or `python -m qwen_np` in the repository)."""
    package = Path(__file__).resolve().parents[1]          # qwen_np/, above serving/
    installed = package / "docs"
    return installed if (installed / "walkthrough.md").is_file() else package.parent / "docs"


def heading_anchor(heading: str) -> str:
    """The id GitHub gives a heading of text `heading` (as rendered: no backticks): lower case, punctuation
    dropped (not - and _), each space a -. "5. Final norm → logits" is "5-final-norm--logits"."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


@dataclass(frozen=True)
class Heading:
    level: int       # 1 for #, 2 for ##, ...
    source: str      # as written in the Markdown ("3.10 `self_attn.softmax`: ...")
    text: str        # as shown ("3.10 self_attn.softmax: ...")
    anchor: str      # its id in the page


@dataclass(frozen=True)
class Page:
    title: str                  # the first heading's text
    body: str                   # the Markdown as HTML
    headings: tuple[Heading, ...]

    def html(self) -> str:
        """The whole document: the body behind a link back to the explorer, styled by STYLE."""
        return ('<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
                '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
                f'<title>{_escape(self.title)}</title>\n<link rel="stylesheet" href="{STYLE}">\n</head>\n'
                f'<body class="docs">\n<nav><a href="/">qwen_np: the explorer</a></nav>\n<main>\n{self.body}</main>\n'
                '</body>\n</html>\n')


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _text(inline: Any) -> str:
    """A heading's text as GitHub reads it for its id: its words and code, without the Markdown around them."""
    return "".join(child.content for child in inline.children or () if child.type in ("text", "code_inline"))


@cache
def rendered(markdown: Path) -> Page:
    """`markdown` rendered: each heading given its GitHub id (a repeated one -1, -2, ... as GitHub does),
    each link to a served page's .md file made a link to the page. Rendered once per file and process."""
    from markdown_it import MarkdownIt

    parser = MarkdownIt("commonmark").enable("table")
    tokens = parser.parse(markdown.read_text(encoding="utf-8"))
    headings: list[Heading] = []
    seen: dict[str, int] = {}
    for token, following in zip(tokens, tokens[1:]):
        if token.type == "heading_open":
            text = _text(following)
            anchor = heading_anchor(text)
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchor = f"{anchor}-{count}" if count else anchor
            token.attrSet("id", anchor)
            headings.append(Heading(int(token.tag[1:]), following.content, text, anchor))
        if token.type == "inline":
            for child in token.children or ():
                href = child.attrGet("href") if child.type == "link_open" else None
                if isinstance(href, str) and _PAGE_LINK.fullmatch(href):
                    child.attrSet("href", _PAGE_LINK.sub(r"\1\2", href))
    body = parser.renderer.render(tokens, parser.options, {})
    return Page(headings[0].text if headings else markdown.stem, body, tuple(headings))


def figures(folder: Path) -> frozenset[str]:
    """The figures served: the names of folder/figures/*.png."""
    return frozenset(path.name for path in (folder / "figures").glob("*.png"))


def routes(folder: Path) -> list[Any]:
    """Starlette routes for the pages of `folder` (docs_folder()) that are there, and their figures; none
    where the walkthrough is not there."""
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.responses import FileResponse, HTMLResponse, Response
    from starlette.routing import Route

    if not (folder / "walkthrough.md").is_file():
        return []
    shown = figures(folder)

    def page(name: str) -> Any:
        async def respond(http: Any) -> Response:          # the first render takes ~0.1 s: off the event loop
            return HTMLResponse((await run_in_threadpool(rendered, folder / f"{name}.md")).html())
        return respond

    async def figure(http: Any) -> Response:
        name = http.path_params["name"]
        if name not in shown:                              # only the listed files: no path reaches outside
            raise HTTPException(404)
        return FileResponse(folder / "figures" / name, media_type="image/png")

    return [*(Route(f"/docs/{name}", page(name), methods=["GET"]) for name in PAGES if (folder / f"{name}.md").is_file()),
            Route("/docs/figures/{name}", figure, methods=["GET"])]
