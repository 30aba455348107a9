"""Task family for `WebNavigationEnv`: questions about a generated shop, answered from its pages.

The shop is `environments/web/site.py`; the agent browses it with `environments/web/browser.py`.

Categories:
- `under_price`: find 3 products of a category under a price; answer ids and titles.
- `cheapest`: find the cheapest product of a category.
- `lookup_price`: find a product's id and price from its title (search helps).
"""

from __future__ import annotations

import random
import re
from typing import Any

from environments.policies import call, final
from environments.web.site import SIZES, Product, catalog

CATEGORIES = ("under_price", "cheapest", "lookup_price")
ID_PATTERN = re.compile(r"p-[0-9a-f]{6}")


def make_task(rng: random.Random, category: str, difficulty: str) -> dict[str, Any]:
    key = f"{rng.getrandbits(40):010x}"
    products = catalog(key, difficulty)
    root = f"/t/{key}/{difficulty}"
    shelves = sorted({p.shelf for p in products})
    page_size = SIZES[difficulty][1]
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
