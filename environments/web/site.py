"""`ShopSite`: generated shops served on 127.0.0.1, one server for every web-navigation task.

The site is stateless: every page of shop `key` is regenerated from the key, so one server
serves every task. Product ids are random 6-digit integers, so an answer cannot be guessed from
the prompt. The search form filters by words, department, highest price and stock.
"""

from __future__ import annotations

import html
import random
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, get_args

Department = Literal["books", "garden", "kitchen", "toys"]
DEPARTMENTS: tuple[str, ...] = get_args(Department)
_SEARCH_FIELDS = ("q", "department", "max_price", "in_stock")
SIZES = {"easy": (12, 8), "medium": (24, 6), "hard": (40, 4)}  # Per difficulty: products, page size.
_ADJ = ("red", "silent", "rapid", "cozy", "golden", "tiny", "smart", "rustic", "bright", "classic")
_NOUN = ("lamp", "kettle", "racket", "speaker", "novel", "shovel", "robot", "blender", "puzzle", "headset")
_LIVE_ORIGINS: set[str] = set()  # The shop servers this process runs: the only hosts `open_url` reaches.


@dataclass(frozen=True)
class Product:
    id: int
    title: str
    shelf: str
    price: float
    in_stock: bool


def catalog(key: str, difficulty: str) -> list[Product]:
    """The shop's products, in listing order (deterministic in `key`)."""
    rng = random.Random(f"shop:{key}")
    count, _ = SIZES[difficulty]
    products: list[Product] = []
    titles, ids = set(), set()
    while len(products) < count:
        title = f"{rng.choice(_ADJ).capitalize()} {rng.choice(_NOUN)} {rng.randint(10, 99)}"
        product_id = rng.randint(100000, 999999)
        if title in titles or product_id in ids:
            continue
        titles.add(title)
        ids.add(product_id)
        shelf, price = rng.choice(DEPARTMENTS), round(rng.uniform(5, 120), 2)
        in_stock = rng.random() < 0.8 or not products  # The first is in stock: every shop has one.
        products.append(Product(product_id, title, shelf, price, in_stock))
    return products


def _search_hits(products: list[Product], query: dict[str, str]) -> list[Product]:
    """Products whose titles hold every word of `q`, of `department`, priced at most `max_price`,
    in stock when `in_stock` is "yes" (an empty field does not filter); ValueError for a bad price."""
    words = query.get("q", "").lower().split()
    department = query.get("department", "")
    max_price = float(query["max_price"]) if query.get("max_price") else None
    return [
        p
        for p in products
        if all(w in p.title.lower() for w in words)
        and (not department or p.shelf == department)
        and (max_price is None or p.price <= max_price)
        and (query.get("in_stock") != "yes" or p.in_stock)
    ]


def is_live_origin(origin: str) -> bool:
    """Whether `scheme://host:port` is a shop server this process runs (and nothing else on 127.0.0.1)."""
    return origin in _LIVE_ORIGINS


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
        if len(parts) < 3 or parts[0] != "t" or parts[2] not in SIZES:
            return self._send(404, "<h1>Not found</h1>")
        key, difficulty, rest = parts[1], parts[2], parts[3:]
        products = catalog(key, difficulty)
        root = f"/t/{key}/{difficulty}"
        page_size = SIZES[difficulty][1]
        if not rest:
            body = (
                "<h1>Shop home</h1><h2>Departments</h2><ul>"
                + "".join(
                    f'<li><a href="{root}/c/{s}">{s.capitalize()}</a></li>' for s in sorted({p.shelf for p in products})
                )
                + f'</ul><form name="search" action="{root}/search">'
                + "".join(f'<input name="{name}">' for name in _SEARCH_FIELDS)
                + "</form>"
            )
            return self._send(200, body)
        if rest[0] == "c" and len(rest) == 2:
            shelf = [p for p in products if p.shelf == rest[1]]
            page = _page_number(query.get("page", "1"))
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
            match = [p for p in products if str(p.id) == rest[1]]
            if not match:
                return self._send(404, "<h1>No such product</h1>")
            p = match[0]
            return self._send(
                200,
                f"<h1>{html.escape(p.title)}</h1><p>Product id: {p.id}</p><p>Price: ${p.price:.2f}</p>"
                f"<p>In stock: {'yes' if p.in_stock else 'no'}</p>"
                f'<p>Department: <a href="{root}/c/{p.shelf}">{p.shelf}</a></p>',
            )
        if rest[0] == "search":
            try:
                hits = _search_hits(products, query)
            except ValueError:
                return self._send(400, "<h1>Bad search: max_price must be a number</h1>")
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


def _page_number(text: str) -> int:
    """A page number from the query: ASCII digits only (`"²".isdigit()` is true, `int("²")` raises), at
    least 1, at most 6 digits; anything else is page 1."""
    return max(1, int(text)) if text.isascii() and text.isdigit() and len(text) <= 6 else 1
