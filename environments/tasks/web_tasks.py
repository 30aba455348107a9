"""Task family for `WebNavigationEnv`: a generated shop served on 127.0.0.1, and browser tools.

The site is stateless: every page of shop `key` is regenerated from the key, so one server
serves every task. Product ids are random hex, so an answer cannot be guessed from the prompt.

Categories:
- `under_price`: find 3 products of a category under a price; answer ids and titles.
- `cheapest`: find the cheapest product of a category.
- `lookup_price`: find a product's id and price from its title (search helps).
"""

from __future__ import annotations

import html
import random
import re
import threading
import urllib.parse
from dataclasses import dataclass
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from environments.errors import ToolCallError
from environments.policies import call, final
from environments.tool_context import ToolContext
from environments.tools import Tool, tool

CATEGORIES = ("under_price", "cheapest", "lookup_price")
SHELVES = ("books", "garden", "kitchen", "toys", "sports", "audio")
_ADJ = ("red", "silent", "rapid", "cozy", "golden", "tiny", "smart", "rustic", "bright", "classic")
_NOUN = ("lamp", "kettle", "racket", "speaker", "novel", "shovel", "robot", "blender", "puzzle", "headset")
_SIZE = {"easy": (12, 8), "medium": (24, 6), "hard": (40, 4)}  # products, page size
ID_PATTERN = re.compile(r"p-[0-9a-f]{6}")
_LIVE_ORIGINS: set[str] = set()  # The shop servers this process runs: the only hosts `open_url` reaches.


@dataclass(frozen=True)
class Product:
    id: str
    title: str
    shelf: str
    price: float


def catalog(key: str, difficulty: str) -> list[Product]:
    """The shop's products, in listing order (deterministic in `key`)."""
    rng = random.Random(f"shop:{key}")
    count, _ = _SIZE[difficulty]
    products, titles = [], set()
    while len(products) < count:
        title = f"{rng.choice(_ADJ).capitalize()} {rng.choice(_NOUN)} {rng.randint(10, 99)}"
        if title in titles:
            continue
        titles.add(title)
        products.append(
            Product(f"p-{rng.getrandbits(24):06x}", title, rng.choice(SHELVES[:4]), round(rng.uniform(5, 120), 2))
        )
    return products


class ShopSite:
    """A threaded HTTP server on 127.0.0.1 serving every generated shop under `/t/<key>/<difficulty>/`."""

    def __init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "ShopSite is not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> ShopSite:
        if self._server is None:
            self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
            self._server.daemon_threads = True
            threading.Thread(target=self._server.serve_forever, name="shop-site", daemon=True).start()
            _LIVE_ORIGINS.add(self.base_url)
        return self

    def stop(self) -> None:
        if self._server is not None:
            _LIVE_ORIGINS.discard(self.base_url)
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # Quiet: one line per request would flood logs.
        pass

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = [p for p in url.path.split("/") if p]
        query = dict(urllib.parse.parse_qsl(url.query))
        if len(parts) < 3 or parts[0] != "t" or parts[2] not in _SIZE:
            return self._send(404, "<h1>Not found</h1>")
        key, difficulty, rest = parts[1], parts[2], parts[3:]
        products = catalog(key, difficulty)
        root = f"/t/{key}/{difficulty}"
        page_size = _SIZE[difficulty][1]
        if not rest:
            body = (
                "<h1>Shop home</h1><h2>Departments</h2><ul>"
                + "".join(
                    f'<li><a href="{root}/c/{s}">{s.capitalize()}</a></li>' for s in sorted({p.shelf for p in products})
                )
                + f'</ul><form name="search" action="{root}/search"><input name="q"></form>'
            )
            return self._send(200, body)
        if rest[0] == "c" and len(rest) == 2:
            shelf = [p for p in products if p.shelf == rest[1]]
            page = max(1, int(query.get("page", "1")) if query.get("page", "1").isdigit() else 1)
            chunk = shelf[(page - 1) * page_size : page * page_size]
            show_price = difficulty == "easy"
            items = "".join(
                f'<li><a href="{root}/p/{p.id}">{html.escape(p.title)}</a>'
                + (f" ${p.price:.2f}" if show_price else "")
                + "</li>"
                for p in chunk
            )
            nav = f'<a href="{root}/c/{rest[1]}?page={page + 1}">Next page</a>' if page * page_size < len(shelf) else ""
            return self._send(200, f"<h1>{rest[1].capitalize()} (page {page})</h1><ul>{items}</ul>{nav}")
        if rest[0] == "p" and len(rest) == 2:
            match = [p for p in products if p.id == rest[1]]
            if not match:
                return self._send(404, "<h1>No such product</h1>")
            p = match[0]
            return self._send(
                200,
                f"<h1>{html.escape(p.title)}</h1><p>Product id: {p.id}</p><p>Price: ${p.price:.2f}</p>"
                f'<p>Department: <a href="{root}/c/{p.shelf}">{p.shelf}</a></p>',
            )
        if rest[0] == "search":
            words = query.get("q", "").lower().split()
            hits = [p for p in products if words and all(w in p.title.lower() for w in words)]
            items = "".join(f'<li><a href="{root}/p/{p.id}">{html.escape(p.title)}</a></li>' for p in hits)
            return self._send(200, f"<h1>Search results</h1><ul>{items or '<li>No results</li>'}</ul>")
        return self._send(404, "<h1>Not found</h1>")

    def _send(self, status: int, body: str) -> None:
        data = f"<html><body>{body}</body></html>".encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def make_task(rng: random.Random, category: str, difficulty: str) -> dict[str, Any]:
    key = f"{rng.getrandbits(40):010x}"
    products = catalog(key, difficulty)
    root = f"/t/{key}/{difficulty}"
    shelves = sorted({p.shelf for p in products})
    page_size = _SIZE[difficulty][1]
    actions = [call("open_url", url=f"{{site}}{root}/")]

    def browse(shelf: str, wanted: list[Product]) -> None:
        """Oracle: open the department, page through it, open each wanted product."""
        listing = [p for p in products if p.shelf == shelf]
        actions.append(call("follow_link", text=shelf.capitalize()))
        last_page = max(listing.index(p) // page_size for p in wanted) if wanted else 0
        actions.extend(call("follow_link", text="Next page") for _ in range(last_page))
        actions.extend(call("open_url", url=f"{{site}}{root}/p/{p.id}") for p in wanted)

    if category == "lookup_price":
        target = rng.choice(products)
        actions.append(call("search", query=target.title))
        actions.append(call("follow_link", text=target.title))
        answer = {"ids": [target.id], "price": f"{target.price:.2f}"}
        prompt = f"What are the product id and the price of '{target.title}'?"
        final_text = f"{target.id}: ${target.price:.2f}"
    else:
        sizes = {s: sum(p.shelf == s for p in products) for s in shelves}
        # Cheapest: the smallest department with 3+ products (every product page must be read).
        pick = min if category == "cheapest" else max
        shelf = pick((s for s in shelves if sizes[s] >= 3), key=lambda s: sizes[s])
        listing = [p for p in products if p.shelf == shelf]
        if category == "cheapest":
            target = min(listing, key=lambda p: p.price)
            browse(shelf, listing)
            answer = {"ids": [target.id]}
            prompt = f"Find the cheapest product in the {shelf} department. Answer with its id and title."
            final_text = f"{target.id}: {target.title}"
        else:
            prices = sorted(p.price for p in listing)
            limit = float(int(prices[min(len(prices) - 1, 3)]) + 1)  # At least 3 qualify.
            chosen = [p for p in listing if p.price < limit][:3]
            browse(shelf, chosen)
            answer = {"shelf": shelf, "limit": limit, "count": 3}
            prompt = (
                f"Find 3 products in the {shelf} department priced under ${limit:.0f}. Answer with their "
                "ids and titles, one per line as `id: title`."
            )
            final_text = "\n".join(f"{p.id}: {p.title}" for p in chosen)
    actions.append(final(final_text))
    return {
        "prompt": f"The shop's home page is {{site}}{root}/ . {prompt}",
        "shop": {"key": key, "difficulty": difficulty},
        "answer": answer,
        "oracle": actions,
    }


def verify(item: dict[str, Any], answer_text: str) -> bool:
    """Check the final answer against the shop's ground truth."""
    shop = item["shop"]
    products = {p.id: p for p in catalog(shop["key"], shop["difficulty"])}
    ids = list(dict.fromkeys(ID_PATTERN.findall(answer_text)))
    truth = item["answer"]
    if item["category"] == "under_price":
        valid = [
            i
            for i in ids
            if i in products and products[i].shelf == truth["shelf"] and products[i].price < truth["limit"]
        ]
        return len(valid) >= truth["count"] and len(valid) == len(ids)
    if ids != truth["ids"]:
        return False
    return item["category"] != "lookup_price" or truth["price"] in answer_text


# -- browser tools --------------------------------------------------------------------------------


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


def _browse(ctx: ToolContext, url: str) -> str:
    current = ctx.state.get("url")
    absolute = urllib.parse.urljoin(current or url, url)
    _check_reachable(ctx, absolute)
    try:
        response = httpx.get(absolute, timeout=10.0, follow_redirects=False)
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
    if not shop or origin not in _LIVE_ORIGINS or parts.username or parts.password or not inside:
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
def search(ctx: ToolContext, query: str) -> str:
    """Search the current site with its search form.

    Args:
        query: Words to search for.
    """
    forms = [f for f in ctx.state.get("forms") or [] if f["name"] == "search"]
    if not forms:
        raise ToolCallError("search: the current page has no search form; open the home page first")
    return submit_form(ctx, {"form": "search", "fields": {forms[0]["fields"][0]: query}})


@tool
def submit_form(ctx: ToolContext, form: str, fields: dict) -> str:
    """Fill in and submit a form of the current page.

    Args:
        form: The form's name.
        fields: Field name -> value.
    """
    match = [f for f in ctx.state.get("forms") or [] if f["name"] == form]
    if not match:
        raise ToolCallError(f"submit_form: no form '{form}' on the current page")
    unknown = set(fields) - set(match[0]["fields"])
    if unknown:
        raise ToolCallError(f"submit_form: form '{form}' has no field(s) {sorted(unknown)}")
    return _browse(ctx, f"{match[0]['action']}?{urllib.parse.urlencode(fields)}")


WEB_TOOLS: list[Tool] = [open_url, follow_link, search, submit_form]
