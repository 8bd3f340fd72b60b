"""Write the small synthetic tables of the worked example in docs/own-data.md.

Three institutions hold different columns about partly overlapping customers, keyed by ``customer_id``:

* ``bank`` (the active party: it holds the label ``defaulted``, 0 or 1, known for some of its customers): income in
  euros (standard deviation ~600), debt ratio, age;
* ``shop``: shares of online and discounted purchases (fractions, at most ~0.76);
* ``telco``: calls per day, data volume, months of tenure.

Written files (CSV)::

    OUT/train/{bank,shop,telco}.csv     training customers (bank's defaulted is empty where unknown)
    OUT/new/{bank,shop,telco}.csv       new customers to predict (no label column)
    OUT/outcomes/bank.csv               the new customers' bank table with defaulted, as known months later
    OUT/outcomes/defaulted.csv          customer_id and defaulted of every new customer some institution holds,
                                        as a collections department records them (for ``evaluate --truth``)

Usage: ``python scripts/make_example_tables.py OUT [--seed 0] [--train 1500] [--new 300]``.  The same seed writes
the same files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

#: share of the customers each institution holds (the bank, as the label holder, holds the most)
COVERAGE = {"bank": 0.9, "shop": 0.7, "telco": 0.6}
LABELED_SHARE = 0.3  # of the bank's training customers, those whose outcome is known


def customers(rng: np.random.Generator, n: int, first_id: int) -> pd.DataFrame:
    """``n`` customers: a default flag and a latent profile that every institution sees a noisy part of."""
    defaulted = (rng.random(n) < 0.35).astype(int)
    profile = rng.normal(0.0, 1.0, (n, 3)) + np.where(defaulted[:, None] == 1, 1.0, -0.5) * np.array([1.0, 0.8, 0.7])
    noise = rng.normal(0.0, 1.0, (n, 8))
    return pd.DataFrame({
        "customer_id": np.arange(first_id, first_id + n),
        "defaulted": defaulted,
        "income_eur": np.round(3200 - 450 * profile[:, 0] + 420 * noise[:, 0], 0),
        "debt_ratio": np.round(np.clip(0.35 + 0.08 * profile[:, 1] + 0.05 * noise[:, 1], 0, None), 3),
        "age": np.round(44 - 4 * profile[:, 2] + 9 * noise[:, 2]).astype(int),
        "share_online": np.round(np.clip(0.38 + 0.1 * profile[:, 1] + 0.08 * noise[:, 3], 0, 0.76), 3),
        "share_discount": np.round(np.clip(0.3 + 0.09 * profile[:, 0] + 0.07 * noise[:, 4], 0, 0.76), 3),
        "calls_per_day": np.round(np.clip(6 + 1.6 * profile[:, 2] + 1.5 * noise[:, 5], 0, None), 1),
        "data_gb": np.round(np.clip(9 - 2.2 * profile[:, 0] + 2.5 * noise[:, 6], 0, None), 2),
        "tenure_months": np.round(np.clip(40 - 9 * profile[:, 1] + 12 * noise[:, 7], 1, None)).astype(int),
    })


COLUMNS = {"bank": ["income_eur", "debt_ratio", "age"], "shop": ["share_online", "share_discount"],
           "telco": ["calls_per_day", "data_gb", "tenure_months"]}


def party_tables(rng: np.random.Generator, people: pd.DataFrame, *, label: str) -> dict[str, pd.DataFrame]:
    """Each institution's table: the customers it holds (a random share), its own columns, in its own row order."""
    out = {}
    for party, cols in COLUMNS.items():
        held = people[rng.random(len(people)) < COVERAGE[party]]
        table = held[["customer_id", *cols]].copy()
        if party == "bank" and label != "none":
            y = held["defaulted"].astype("Int64")
            if label == "some":
                y[rng.random(len(held)) >= LABELED_SHARE] = pd.NA
            table["defaulted"] = y
        out[party] = table.sample(frac=1.0, random_state=int(rng.integers(2**31)))
    return out


def write(out: Path, seed: int = 0, n_train: int = 1500, n_new: int = 300) -> list[Path]:
    """Write every file (see the module docstring) and return their paths."""
    rng = np.random.default_rng(seed)
    written = []
    train = party_tables(rng, customers(rng, n_train, 100_000), label="some")
    new_people = customers(rng, n_new, 900_000)
    new = party_tables(rng, new_people, label="all")
    outcomes = new["bank"]
    new["bank"] = outcomes.drop(columns=["defaulted"])
    held = set().union(*(set(t["customer_id"]) for t in new.values()))
    defaulted = new_people.loc[new_people["customer_id"].isin(held), ["customer_id", "defaulted"]]
    for folder, tables in (("train", train), ("new", new), ("outcomes", {"bank": outcomes, "defaulted": defaulted})):
        (out / folder).mkdir(parents=True, exist_ok=True)
        for party, table in tables.items():
            path = out / folder / f"{party}.csv"
            table.to_csv(path, index=False)
            written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory to write the tables into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=1500, help="training customers")
    parser.add_argument("--new", type=int, default=300, help="new customers")
    args = parser.parse_args()
    for path in write(Path(args.out), args.seed, args.train, args.new):
        rows = sum(1 for _ in path.open()) - 1
        print(f"{path}: {rows} rows")


if __name__ == "__main__":
    main()
