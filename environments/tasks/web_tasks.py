"""Task family for `WebNavigationEnv`: questions about a generated shop, answered from its pages.

The shop is `environments/web/site.py`; the agent browses it with `environments/web/browser.py`.

Categories, each with a horizon that grows with difficulty (the shop grows too: 12, 24, 40 products):
- `under_price`: find 1, 3 or 5 in-stock products of a department priced at most a limit (search's
  `department`, `max_price` and `in_stock` filters help; the oracle opens each one): 5, 7, 9 calls.
- `cheapest`: find the cheapest product of a department of 3+ products: an easy shop's department
  page lists prices (5 calls), a medium or hard one's does not, so every product page is read
  (7-15 calls: more products, more pages).
- `lookup_price`: the id and price of a product named by its title, or of the most expensive of 2
  or 3 named products (search, open each): 5, 7, 9 calls.

The agent answers with `submit_answer(product_ids: list[int], price: float)`; the verifier judges
that typed submission, never the final text, so "482913" for an id earns nothing.
"""

from __future__ import annotations

import random
from typing import Any

from flywheel.environments.agent.policies import call, final
from flywheel.environments.verify.untrusted import Unjudgeable, finite_number
from flywheel.environments.web.site import SIZES, catalog

CATEGORIES = ("under_price", "cheapest", "lookup_price")


def make_task(rng: random.Random, category: str, difficulty: str) -> dict[str, Any]:
    key = f"{rng.getrandbits(40):010x}"
    products = catalog(key, difficulty)
    root = f"/t/{key}/{difficulty}"
    shelves = sorted({p.shelf for p in products})
    page_size = SIZES[difficulty][1]
    actions = [call("open_url", url=f"{{site}}{root}/")]

    if category == "lookup_price":
        named = _distinct_titles(rng, products, {"easy": 1, "medium": 2, "hard": 3}[difficulty])
        for number, product in enumerate(named):
            if number:  # A product page has no search form: back to the home page for the next one.
                actions.append(call("open_url", url=f"{{site}}{root}/"))
            actions.append(call("search", query=product.title))
            actions.append(call("follow_link", text=product.title))
        target = max(named, key=lambda p: p.price)
        actions.append(call("submit_answer", product_ids=[target.id], price=target.price))
        answer: dict[str, Any] = {"ids": [target.id], "price": target.price}
        if len(named) == 1:
            prompt = f"What are the product id and the price of '{target.title}'?"
        else:
            titles = ", ".join(f"'{p.title}'" for p in named)
            prompt = f"Which of {titles} is the most expensive? Give its product id and its price."
        final_text = f"{target.id}: ${target.price:.2f}"
    elif category == "cheapest":
        sizes = {s: sum(p.shelf == s for p in products) for s in shelves}
        # The smallest department with 3+ products, paged through; an easy shop lists prices, so only the
        # cheapest product's page is opened (for its id), elsewhere every product page (prices are there).
        shelf = min((s for s in shelves if sizes[s] >= 3), key=lambda s: sizes[s])
        listing = [p for p in products if p.shelf == shelf]
        target = min(listing, key=lambda p: p.price)
        actions.append(call("follow_link", text=shelf.capitalize()))
        last_page = listing.index(target) if difficulty == "easy" else len(listing) - 1
        actions.extend(call("follow_link", text="Next page") for _ in range(last_page // page_size))
        if difficulty == "easy":  # Its link on the listing's page, for the id.
            actions.append(call("follow_link", text=target.title))
        else:
            actions.extend(call("open_url", url=f"{{site}}{root}/p/{p.id}") for p in listing)
        actions.append(call("submit_answer", product_ids=[target.id]))
        answer = {"ids": [target.id]}
        prompt = f"Find the cheapest product in the {shelf} department."
        final_text = f"{target.id}: {target.title}"
    else:
        stocked = {s: sorted(p.price for p in products if p.shelf == s and p.in_stock) for s in shelves}
        shelf = max(shelves, key=lambda s: len(stocked[s]))
        count = min({"easy": 1, "medium": 3, "hard": 5}[difficulty], len(stocked[shelf]))
        limit = float(int(stocked[shelf][min(len(stocked[shelf]) - 1, count)]) + 1)  # At least `count` qualify.
        chosen = [p for p in products if p.shelf == shelf and p.in_stock and p.price <= limit][:count]
        actions.append(call("search", department=shelf, max_price=limit, in_stock=True))
        actions.extend(call("open_url", url=f"{{site}}{root}/p/{p.id}") for p in chosen)
        actions.append(call("submit_answer", product_ids=[p.id for p in chosen]))
        answer = {"shelf": shelf, "limit": limit, "count": count}
        products_word = "product" if count == 1 else "products"
        prompt = f"Find {count} {products_word} in the {shelf} department priced at most ${limit:.0f}, in stock."
        final_text = "\n".join(f"{p.id}: {p.title}" for p in chosen)
    actions.append(final(final_text))
    return {
        "prompt": f"The shop's home page is {{site}}{root}/ . {prompt} Submit the answer with submit_answer.",
        "shop": {"key": key, "difficulty": difficulty},
        "answer": answer,
        "oracle": actions,
    }


def _distinct_titles(rng: random.Random, products: list[Any], count: int) -> list[Any]:
    """`count` products with distinct titles and distinct prices (the most expensive is one product)."""
    by_title: dict[str, Any] = {}
    for product in products:
        by_title.setdefault(product.title, product)
    unique = [p for p in by_title.values() if sum(q.price == p.price for q in by_title.values()) == 1]
    return rng.sample(unique, min(count, len(unique)))


def verify(item: dict[str, Any], submitted: dict[str, Any] | None) -> bool:
    """Check the answer `submit_answer` recorded (None: nothing submitted) against the shop's ground truth.

    `submit_answer` refuses mistyped arguments, so a submission here holds integer ids and a
    numeric (or no) price.
    """
    if not submitted:
        return False
    shop = item["shop"]
    products = {p.id: p for p in catalog(shop["key"], shop["difficulty"])}
    ids, truth = submitted["product_ids"], item["answer"]
    if item["category"] == "under_price":
        valid = {
            i
            for i in ids
            if i in products
            and products[i].shelf == truth["shelf"]
            and products[i].price <= truth["limit"]
            and products[i].in_stock
        }
        return len(valid) >= truth["count"] and len(valid) == len(ids)
    if ids != truth["ids"]:
        return False
    if item["category"] != "lookup_price":
        return True
    try:
        return abs(finite_number(submitted["price"]) - truth["price"]) < 0.005
    except Unjudgeable:  # No price, or one such as 10**400 or NaN: not the answer.
        return False
