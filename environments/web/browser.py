"""Browser tools (`WEB_TOOLS`): open a page, follow a link, search, submit a form; text and numbered links back.

`submit_answer` records the agent's typed answer (integer product ids, a number for a price) in
the task's state, where the verifier reads it: a mistyped answer is refused, so never recorded.
`open_url` reaches only the task's own shop: a live `ShopSite` of this process, under the task's
`/t/<key>/<difficulty>/` (read from `ctx.state["item"]`, which the base env sets and never shows).
"""

from __future__ import annotations

import functools
import re
import urllib.parse
from html.parser import HTMLParser
from typing import Any

import httpx

from flywheel.environments.agent.tools import Tool, tool
from flywheel.environments.errors import ToolCallError
from flywheel.environments.tool_context import ToolContext
from flywheel.environments.web.site import Department, is_live_origin


class _PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.links: list[tuple[str, str]] = []
        self.forms: list[dict[str, Any]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "a":
            self._href = values.get("href")
        elif tag == "form":
            self.forms.append({"name": values.get("name") or "form", "action": values.get("action"), "fields": []})
        elif tag == "input" and self.forms:
            self.forms[-1]["fields"].append(values.get("name"))

    def handle_endtag(self, tag: str) -> None:
        if tag == "a":
            self._href = None
        elif tag in ("li", "p", "h1", "h2"):
            self.text.append("\n")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            self.links.append((data.strip(), self._href))
            self.text.append(f"[{len(self.links)}] {data.strip()}")
        else:
            self.text.append(data)


@functools.cache
def _http() -> httpx.Client:
    """One client for every page opened (a new one builds an SSL context each time, ~20-40 ms of CPU)."""
    return httpx.Client(timeout=10.0, follow_redirects=False)


def _browse(ctx: ToolContext, url: str) -> str:
    current = ctx.state.get("url")
    absolute = urllib.parse.urljoin(current or url, url)
    _check_reachable(ctx, absolute)
    try:
        response = _http().get(absolute)
    except httpx.HTTPError as err:
        raise ToolCallError(f"open_url: {absolute} is unreachable ({type(err).__name__})") from err
    parser = _PageParser()
    parser.feed(response.text)
    ctx.state.update(url=absolute, links=parser.links, forms=parser.forms)
    text = re.sub(r"\n\s*\n+", "\n", "".join(parser.text)).strip()
    forms = "".join(f"\nForm '{f['name']}' with fields {f['fields']}" for f in parser.forms)
    return f"URL: {absolute} (HTTP {response.status_code})\n{text}{forms}"


def _check_reachable(ctx: ToolContext, url: str) -> None:
    """Only the task's own shop: a live shop server of this process, under the task's `/t/<key>/<difficulty>/`.

    Everything else on 127.0.0.1 (the model server, the Prefect API, other tasks' shops) and
    every other host is refused before any request is made.
    """
    shop = (ctx.state.get("item") or {}).get("shop") or {}
    parts = urllib.parse.urlsplit(url)
    try:
        origin = f"{parts.scheme}://{parts.hostname}:{parts.port}"
    except ValueError as err:
        raise ToolCallError(f"open_url: not a valid URL: {url}") from err
    path = urllib.parse.unquote(parts.path)
    root = f"/t/{shop.get('key')}/{shop.get('difficulty')}"
    inside = (path == root or path.startswith(root + "/")) and ".." not in path.split("/")
    if not shop or not is_live_origin(origin) or parts.username or parts.password or not inside:
        raise ToolCallError(f"open_url: only the task's own shop is reachable, not {url}")


@tool
def open_url(ctx: ToolContext, url: str) -> str:
    """Open a web page and show its text, numbered links and forms.

    Args:
        url: Absolute URL, or a path relative to the current page.
    """
    return _browse(ctx, url)


@tool
def follow_link(ctx: ToolContext, text: str) -> str:
    """Follow a link on the current page by its text or its [number].

    Args:
        text: The link's text, or its number as shown in brackets.
    """
    links = ctx.state.get("links") or []
    wanted = text.strip().strip("[]")
    for number, (label, href) in enumerate(links, start=1):
        if wanted == str(number) or wanted.lower() == label.lower():
            return _browse(ctx, href)
    raise ToolCallError(f"follow_link: no link '{text}' on the current page")


@tool
def search(
    ctx: ToolContext,
    query: str = "",
    department: Department | None = None,
    max_price: float | None = None,
    in_stock: bool = False,
) -> str:
    """Search the current site with its search form; every given filter must hold.

    Args:
        query: Words the product title must contain.
        department: Only products of this department.
        max_price: Only products priced at most this many dollars.
        in_stock: True: only products in stock.
    """
    if not any(f["name"] == "search" for f in ctx.state.get("forms") or []):
        raise ToolCallError("search: the current page has no search form; open the home page first")
    price = "" if max_price is None else str(max_price)
    fields = {"q": query, "department": department or "", "max_price": price, "in_stock": "yes" if in_stock else ""}
    return _submit(ctx, "search", fields)


@tool
def submit_form(ctx: ToolContext, form: str, fields: dict[str, str]) -> str:
    """Fill in and submit a form of the current page.

    Args:
        form: The form's name.
        fields: Field name -> value.
    """
    return _submit(ctx, form, fields)


def _submit(ctx: ToolContext, form: str, fields: dict[str, str]) -> str:
    match = [f for f in ctx.state.get("forms") or [] if f["name"] == form]
    if not match:
        raise ToolCallError(f"submit_form: no form '{form}' on the current page")
    unknown = set(fields) - set(match[0]["fields"])
    if unknown:
        raise ToolCallError(f"submit_form: form '{form}' has no field(s) {sorted(unknown)}")
    return _browse(ctx, f"{match[0]['action']}?{urllib.parse.urlencode(fields)}")


@tool
def submit_answer(ctx: ToolContext, product_ids: list[int], price: float | None = None) -> str:
    """Submit your final answer (the last submission counts), then reply with a short summary.

    Args:
        product_ids: The ids of the products asked for, as integers.
        price: The price in dollars as a number, when the question asks for one.
    """
    ctx.state["answer"] = {"product_ids": product_ids, "price": price}
    return f"Answer recorded: product_ids={product_ids}" + ("" if price is None else f", price={price}")


WEB_TOOLS: list[Tool] = [open_url, follow_link, search, submit_form, submit_answer]
