"""Randomized operation sequences against a per-page reference model, with ``check()`` each step.

The model keys everything by the prefix (tuple of page ids) ending at a page, so it knows
nothing about nodes or splits: it says which pages / states / window pages each tier holds,
and the tree's match lengths must agree with the model's hit-rule fold.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.core.tree import PrefixTree, Tier
from tree_stacks import PAGE, kv_spec, mamba_spec, swa_spec

WINDOW = 2  # swa window in pages


class Model:
    def __init__(self, pools: tuple[str, ...]) -> None:
        self.pools = pools
        # tier -> pool -> {prefix: unit id}
        self.held: dict[Tier, dict[str, dict[tuple[int, ...], int]]] = {
            tier: {name: {} for name in pools} for tier in Tier
        }

    def present(self, tier: Tier, pool: str, prefix: tuple[int, ...]) -> bool:
        if prefix in self.held[Tier.DEVICE][pool]:
            return True
        return tier is Tier.HOST and prefix in self.held[Tier.HOST][pool]

    def known(self, seq: tuple[int, ...]) -> int:
        n = 0
        while n < len(seq) and self.present(Tier.HOST, "kv", seq[: n + 1]):
            n += 1
        return n

    def usable(self, seq: tuple[int, ...], tier: Tier, boundaries: set[int]) -> int:
        """Deepest usable length; ``boundaries`` are the tree's node ends along ``seq``."""
        limit = 0
        while limit < len(seq) and self.present(tier, "kv", seq[: limit + 1]):
            limit += 1
        for length in range(limit, 0, -1):
            if "mamba" in self.pools and not self.present(tier, "mamba", seq[:length]):
                continue
            if "swa" in self.pools and not all(
                self.present(tier, "swa", seq[:k]) for k in range(max(1, length - WINDOW + 1), length + 1)
            ):
                continue
            if length in boundaries or length == limit:
                return length
        return 0


def make_tree(pools: tuple[str, ...]) -> PrefixTree:
    specs = {"kv": kv_spec, "swa": lambda: swa_spec(WINDOW * PAGE), "mamba": mamba_spec}
    return PrefixTree([specs[name]() for name in pools])


def keys(seq: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [(pid,) * PAGE for pid in seq]


@pytest.mark.parametrize("pools", [("kv",), ("kv", "mamba"), ("kv", "swa"), ("kv", "swa", "mamba")])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_operations_match_reference_model(pools: tuple[str, ...], seed: int) -> None:
    rng = random.Random(seed)
    tree, model = make_tree(pools), Model(pools)
    next_unit = iter(range(10**9))
    where: dict[tuple[Tier, str, int], tuple[int, ...]] = {}  # unit id -> prefix (for frees)
    locks: list[tuple[object, tuple[int, ...], int]] = []

    def rand_seq() -> tuple[int, ...]:
        return tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 6)))

    def give(tier: Tier, seq: tuple[int, ...]) -> dict[str, torch.Tensor]:
        values = {}
        for name in pools:
            if name == "mamba":
                if not seq or rng.random() < 0.3:
                    continue
                values[name] = torch.tensor([next(next_unit)])
            elif name == "swa" and rng.random() < 0.2:
                continue
            else:
                values[name] = torch.tensor([next(next_unit) for _ in seq], dtype=torch.int64)
        return values

    def apply_insert(tier: Tier, seq: tuple[int, ...]) -> None:
        values = give(tier, seq)
        res = (tree.insert if tier is Tier.DEVICE else tree.insert_host)(keys(seq), values)
        expected_dups: dict[str, list[int]] = {}
        for name, value in values.items():
            units = value.tolist()
            positions = [len(seq) - 1] if name == "mamba" else range(len(seq))
            for unit, pos in zip(units, positions, strict=True):
                prefix = seq[: pos + 1]
                if prefix in model.held[tier][name]:
                    expected_dups.setdefault(name, []).append(unit)
                else:
                    model.held[tier][name][prefix] = unit
                    where[(tier, name, unit)] = prefix
        got = {name: sorted(v.tolist()) for name, v in res.duplicates.items()}
        assert got == {name: sorted(v) for name, v in expected_dups.items()}
        assert res.node.depth_end == len(seq)

    def apply_free(tier: Tier, freed: dict[str, list[torch.Tensor]]) -> None:
        for name, parts in freed.items():
            for part in parts:
                for unit in part.tolist():
                    prefix = where.pop((tier, name, unit))
                    assert model.held[tier][name].pop(prefix) == unit

    def locked_units(tier: Tier) -> set[tuple[str, int]]:
        out = set()
        for handle, seq, length in locks:
            if handle.tier is not tier:
                continue
            for k in range(1, length + 1):
                if seq[:k] in model.held[tier]["kv"]:
                    out.add(("kv", model.held[tier]["kv"][seq[:k]]))
                if "swa" in pools and k > length - WINDOW and seq[:k] in model.held[tier]["swa"]:
                    out.add(("swa", model.held[tier]["swa"][seq[:k]]))
            if "mamba" in pools and seq[:length] in model.held[tier]["mamba"]:
                out.add(("mamba", model.held[tier]["mamba"][seq[:length]]))
        return out

    def boundaries(seq: tuple[int, ...]) -> set[int]:
        m = tree.match(keys(seq), split=False, count_hit=False)
        return {node.depth_end for node in m.path}

    for _step in range(300):
        op = rng.random()
        seq = rand_seq()
        if op < 0.3:
            apply_insert(Tier.DEVICE, seq)
        elif op < 0.4:
            apply_insert(Tier.HOST, seq)
        elif op < 0.55:  # back up the device path (anchor first, then components)
            m = tree.match(keys(seq))
            for node in m.path:
                for name in ("kv", *[p for p in pools if p != "kv"]):
                    p = tree.index[name]
                    if node.device[p] is not None and node.host[p] is None:
                        if name != "kv" and node.host[0] is None:
                            continue
                        value = torch.tensor([next(next_unit) for _ in range(len(node.device[p]))])
                        tree.set_host_value(node, name, value)
                        start = node.depth_end - 1 if name == "mamba" else node.depth_start
                        for i, unit in enumerate(value.tolist()):
                            prefix = seq[: start + i + 1]
                            model.held[Tier.HOST][name][prefix] = unit
                            where[(Tier.HOST, name, unit)] = prefix
        elif op < 0.6 and len(pools) > 1:  # tombstone a component somewhere on the path
            m = tree.match(keys(seq))
            name = rng.choice(pools[1:])
            tier = Tier.DEVICE if rng.random() < 0.7 else Tier.HOST
            p = tree.index[name]
            for node in m.path:
                locked = node.device_lock[p] if tier is Tier.DEVICE else node.host_lock[p]
                value = node.device[p] if tier is Tier.DEVICE else node.host[p]
                if value is not None and not locked and rng.random() < 0.5:
                    apply_free(tier, {name: [tree.drop_component(node, name, tier)]})
        elif op < 0.7:
            tier = Tier.DEVICE if rng.random() < 0.6 else Tier.HOST
            pool = rng.choice(pools)
            protected = locked_units(tier)
            evict = tree.evict_device if tier is Tier.DEVICE else tree.evict_host
            res = evict({pool: rng.randint(1, 4)})
            for name, parts in res.freed.items():
                for part in parts:
                    assert not protected & {(name, u) for u in part.tolist()}, "evicted a locked unit"
            apply_free(tier, res.freed)
        elif op < 0.88:
            m = tree.match(keys(seq))
            tier = Tier.DEVICE if rng.random() < 0.7 else Tier.HOST
            node = m.device_node if tier is Tier.DEVICE else m.host_node
            length = m.device_pages if tier is Tier.DEVICE else m.host_pages
            if length and (tier is Tier.DEVICE or node.device[0] is None):
                locks.append((tree.lock(node, tier), seq, length))
        elif locks and rng.random() < 0.5:
            handle, _, _ = locks.pop(rng.randrange(len(locks)))
            tree.unlock(handle)
        tree.check()
        # compare lookups with the model's fold
        for probe in (seq, rand_seq(), rand_seq()):
            bounds = boundaries(probe)
            m = tree.match(keys(probe), count_hit=False)
            assert m.pages == model.known(probe), probe
            assert m.device_pages == model.usable(probe, Tier.DEVICE, bounds | {m.pages}), probe
            assert m.host_pages == model.usable(probe, Tier.HOST, bounds | {m.pages}), probe
            tree.check()
    for handle, _, _ in locks:
        tree.unlock(handle)
    tree.check()
    assert all(not any(n.device_lock) and not any(n.host_lock) for n in tree.nodes())
    # the tree's unit totals agree with the model
    for tier in Tier:
        for name in pools:
            assert tree.units(name, tier) == len(model.held[tier][name])
