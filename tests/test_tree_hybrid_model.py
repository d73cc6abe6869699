"""Randomized hybrid-stack operations against a per-page reference model, at page sizes 1, 4, 64.

Extends ``test_tree_random`` to what differs per pool: window values covering only a suffix of
an insert, inserts below a node (``at=``), node-local locks and moved locks, out-of-window and
component eviction (with write-back's ``delete_unbacked=False``), matches ending inside nodes.
After every step the tree must hold exactly the model's units, page by page (so a split put
every value on the right half), no eviction may free a unit a lock holds, and a match's usable
lengths and state slots must be the model's.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.core.metrics import CacheMetrics
from kvstrata.core.policies import make_policy, policy_config
from kvstrata.core.retention import Retention, RetentionHint
from kvstrata.core.tree import PrefixTree, Tier, TreeNode
from kvstrata.core.tree_eviction import event_errors
from kvstrata.core.tree_node import UNIT
from kvstrata.plugins import PluginHost
from kvstrata.plugins.eviction_policy import PolicyContext
from kvstrata.plugins.pool_type import ModelContext, PoolRole
from kvstrata.pool_types.kv import KVConfig, KVPoolType
from kvstrata.pool_types.mamba import MambaConfig, MambaPoolType, StateShape
from kvstrata.pool_types.swa import SWAConfig, SWAPoolType

Prefix = tuple[int, ...]
WINDOWS = {"swa": 2, "swb": 3}  # window pools and their windows in pages


def make_tree(pools: tuple[str, ...], page: int) -> PrefixTree:
    ctx = ModelContext(page_size=page, anchor="kv")
    specs = []
    for name in pools:
        if name == "kv":
            specs.append(KVPoolType("kv", KVConfig(layers=1, kv_heads=1, head_dim=8), ctx).spec())
        elif name == "full":  # an all_pages component (a second full-attention pool)
            spec = KVPoolType("full", KVConfig(layers=1, kv_heads=1, head_dim=8), ctx).spec()
            specs.append(spec.model_copy(update={"role": PoolRole.COMPONENT}))
        elif name in WINDOWS:
            cfg = SWAConfig(layers=1, kv_heads=1, head_dim=8, window=WINDOWS[name] * page)
            specs.append(SWAPoolType(name, cfg, ctx).spec())
        else:
            cfg = MambaConfig(layers=1, conv=[StateShape(shape=(4,))], temporal=StateShape(shape=(2, 2)))
            specs.append(MambaPoolType(name, cfg, ctx).spec())
    return PrefixTree(specs)


class Model:
    """Which unit each tier holds per pool for the prefix ending at each page."""

    def __init__(self, pools: tuple[str, ...]) -> None:
        self.pools = pools
        self.held: dict[Tier, dict[str, dict[Prefix, int]]] = {t: {n: {} for n in pools} for t in Tier}
        self.where: dict[tuple[Tier, str, int], Prefix] = {}

    def put(self, tier: Tier, name: str, prefix: Prefix, unit: int) -> None:
        self.held[tier][name][prefix] = unit
        self.where[(tier, name, unit)] = prefix

    def free(self, tier: Tier, name: str, unit: int) -> Prefix:
        prefix = self.where.pop((tier, name, unit))
        assert self.held[tier][name].pop(prefix) == unit
        return prefix

    def present(self, tier: Tier, name: str, prefix: Prefix) -> bool:
        return prefix in self.held[Tier.DEVICE][name] or (
            tier is Tier.HOST and prefix in self.held[Tier.HOST][name]
        )

    def usable(self, seq: Prefix, tier: Tier, ends: set[int]) -> int:
        limit = 0
        while limit < len(seq) and all(
            self.present(tier, n, seq[: limit + 1]) for n in self.pools if n in ("kv", "full")
        ):
            limit += 1
        for length in range(limit, 0, -1):
            if any(n.startswith("mamba") and not self.present(tier, n, seq[:length]) for n in self.pools):
                continue
            if any(
                not all(
                    self.present(tier, n, seq[:k]) for k in range(max(1, length - WINDOWS[n] + 1), length + 1)
                )
                for n in self.pools
                if n in WINDOWS
            ):
                continue
            if length in ends:
                return length
        return 0


HOST = PluginHost()


class Run:
    def __init__(
        self, pools: tuple[str, ...], page: int, seed: int, paged: bool, policy: str | None = None
    ) -> None:
        self.rng = random.Random(seed)
        self.page, self.paged, self.pools = page, paged, pools
        self.tree, self.model = make_tree(pools, page), Model(pools)
        self.units = iter(range(10**9))
        #: (handle, seq, length, local)
        self.locks: list[tuple[object, Prefix, int, bool]] = []
        self.now = 0.0
        self.retention: Retention | None = None
        self.pins: list[tuple[object, Prefix, int]] = []  # (pin, seq, length)
        if policy is not None:
            for tier in Tier:
                context = PolicyContext(tier=tier.value, capacity_pages=64, page_size=page, page_bytes=64)
                self.tree.set_eviction_order(tier, make_policy(HOST, policy_config(HOST, policy), context))
            self.retention = Retention(self.tree, 10**6, CacheMetrics(), clock=lambda: self.now)
            self.tree.set_retention(self.retention)

    # ------------------------------------------------------------------ helpers
    def keys(self, seq: Prefix):  # type: ignore[no-untyped-def]
        if self.paged:
            return self.tree.keys_of([pid for pid in seq for _ in range(self.page)])
        return [(pid,) * self.page for pid in seq]

    def rand_seq(self) -> Prefix:
        rng = self.rng
        return tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 7)))

    def take(self, n: int) -> torch.Tensor:
        return torch.tensor([next(self.units) for _ in range(n)], dtype=torch.int64)

    def path_prefix(self, node: TreeNode) -> Prefix:
        """The page ids of the prefix ending at ``node`` (read off its edges)."""
        parts = []
        while node is not self.tree.root:
            parts.append(
                [k[0] if not isinstance(k, bytes) else int.from_bytes(k[:8], "little") for k in node.keys]
            )
            node = node.parent  # type: ignore[assignment]
        return tuple(pid for part in reversed(parts) for pid in part)

    # ------------------------------------------------------------------ operations
    def insert(self, tier: Tier) -> None:
        rng, tree, model = self.rng, self.tree, self.model
        seq = self.rand_seq()
        top, base = None, 0
        if tier is Tier.DEVICE and rng.random() < 0.3:  # below a device node (a lease's next chunk)
            m = tree.match(self.keys(seq), count_hit=False)
            if m.device_pages:
                base = rng.randint(0, m.device_nodes - 1)
                top = m.path[base]
                base = top.depth_end
                seq = seq[:base] + self.rand_seq()
        n = len(seq) - base
        values: dict[str, torch.Tensor] = {}
        starts: dict[str, int] = {}
        for name in self.pools:
            if name.startswith("mamba"):
                if n and rng.random() < 0.7:
                    values[name] = self.take(1)
                continue
            if name != "kv" and rng.random() < 0.15:
                continue  # left out: tombstones on new nodes
            start = 0
            if name in WINDOWS and n and rng.random() < 0.4:
                start = rng.randint(0, n)  # a window pool holding only its last pages
            values[name] = self.take(n - start)
            starts[name] = start
        keys = self.keys(seq[base:]) if top is not None else self.keys(seq)
        res = (tree.insert if tier is Tier.DEVICE else tree.insert_host)(
            keys, values, **({"at": top} if top else {})
        )
        dups: dict[str, list[int]] = {}
        for name, value in values.items():
            units = value.tolist()
            if name.startswith("mamba"):
                positions = [len(seq) - 1]
            else:
                positions = list(range(base + starts[name], len(seq)))
            for unit, pos in zip(units, positions, strict=True):
                prefix = seq[: pos + 1]
                if prefix in model.held[tier][name]:
                    dups.setdefault(name, []).append(unit)
                else:
                    model.put(tier, name, prefix, unit)
        got = {name: sorted(v.tolist()) for name, v in res.duplicates.items()}
        assert got == {name: sorted(v) for name, v in dups.items()}, (seq, base, starts)
        assert res.node.depth_end == len(seq)

    def backup(self) -> None:
        tree, model = self.tree, self.model
        seq = self.rand_seq()
        m = tree.match(self.keys(seq))
        for node in m.path:
            prefix = self.path_prefix(node)
            for name in self.pools:
                p = tree.index[name]
                if node.device_raw[p] is None or node.host_raw[p] is not None:
                    continue
                if p and node.host_raw[0] is None:
                    continue
                value = self.take(len(node.device_raw[p]) // UNIT)
                tree.set_host_value(node, name, value)
                if name.startswith("mamba"):
                    model.put(Tier.HOST, name, prefix, value.item())
                else:
                    for i, unit in enumerate(value.tolist()):
                        model.put(Tier.HOST, name, prefix[: node.depth_start + i + 1], unit)

    def drop(self) -> None:
        tree, rng = self.tree, self.rng
        comps = [n for n in self.pools if n != "kv"]
        if not comps:
            return
        m = tree.match(self.keys(self.rand_seq()))
        name = rng.choice(comps)
        tier = Tier.DEVICE if rng.random() < 0.7 else Tier.HOST
        p = tree.index[name]
        for node in m.path:
            locked = (node.device_lock if tier is Tier.DEVICE else node.host_lock)[p]
            value = (node.device_raw if tier is Tier.DEVICE else node.host_raw)[p]
            if value is not None and not locked and rng.random() < 0.5:
                for unit in tree.drop_component(node, name, tier).tolist():
                    self.model.free(tier, name, unit)

    def locked_units(self, tier: Tier) -> set[tuple[str, int]]:
        out: set[tuple[str, int]] = set()
        held = self.model.held[tier]
        for handle, seq, length, local in self.locks:
            if handle.tier is not tier:  # type: ignore[attr-defined]
                continue
            for name in self.pools:
                ks = _held_lengths(name, length, whole=not local)
                out |= {(name, held[name][seq[:k]]) for k in ks if seq[:k] in held[name]}
        if tier is Tier.DEVICE:
            for pin, seq, length in self.pins:
                if pin.held:  # type: ignore[attr-defined]  # (a lapsed one goes as an eviction starts)
                    for name in self.pools:
                        ks = _held_lengths(name, length, whole=True)
                        out |= {(name, held[name][seq[:k]]) for k in ks if seq[:k] in held[name]}
        return out

    def pin(self) -> None:
        """A retention hint on a device prefix: a level, a TTL, maybe a pin (a device lock)."""
        rng, tree, retention = self.rng, self.tree, self.retention
        if retention is None:
            return
        self.now += rng.random()
        if self.pins and rng.random() < 0.3:
            pin, *_ = self.pins.pop(rng.randrange(len(self.pins)))
            retention.release(pin)  # type: ignore[arg-type]
            return
        seq = self.rand_seq()
        m = tree.match(self.keys(seq))
        if not m.device_pages:
            return
        hint = RetentionHint(
            priority=rng.randint(-1, 2), pin=rng.random() < 0.6, ttl_s=rng.choice([None, 0.5, 3.0])
        )
        pin = retention.apply(m.device_node, hint, None)
        if pin is not None:
            self.pins.append((pin, seq, m.device_pages))

    def evict(self) -> None:
        rng, tree = self.rng, self.tree
        tier = Tier.DEVICE if rng.random() < 0.6 else Tier.HOST
        needs = {name: rng.randint(1, 5) for name in rng.sample(self.pools, rng.randint(1, len(self.pools)))}
        protected = self.locked_units(tier)
        ooo = rng.random() < 0.2
        ends = self.usable_ends(tier) if ooo else []
        if tier is Tier.DEVICE:
            res = tree.evict_device(needs, delete_unbacked=rng.random() < 0.7, out_of_window_only=ooo)
        else:
            res = tree.evict_host(needs, out_of_window_only=ooo)
        for name, parts in res.freed.items():
            for part in parts:
                for unit in part.tolist():
                    assert (name, unit) not in protected, f"evicted locked {name} unit {unit}"
                    self.model.free(tier, name, unit)
        for prefix in ends:  # out-of-window data is no held prefix's
            assert self.model.usable(prefix, tier, {len(prefix)}) == len(prefix), prefix

    def usable_ends(self, tier: Tier) -> list[Prefix]:
        """The usable prefixes ``tier`` holds: where its paths end or branch, or (with state
        pools) where a node holds every state."""

        def held(node: TreeNode, name: str) -> bool:
            p = self.tree.index[name]
            return node.device_raw[p] is not None or (tier is Tier.HOST and node.host_raw[p] is not None)

        states = [name for name in self.pools if name.startswith("mamba")]
        out = []
        for node in self.tree.nodes():
            if not held(node, "kv"):
                continue
            below = sum(held(child, "kv") for child in node.children.values())
            if below != 1 or (states and all(held(node, name) for name in states)):
                prefix = self.path_prefix(node)
                if self.model.usable(prefix, tier, {len(prefix)}) == len(prefix):
                    out.append(prefix)
        return out

    def lock(self) -> None:
        rng, tree = self.rng, self.tree
        seq = self.rand_seq()
        m = tree.match(self.keys(seq))
        tier = Tier.DEVICE if rng.random() < 0.7 else Tier.HOST
        node = m.device_node if tier is Tier.DEVICE else m.host_node
        length = m.device_pages if tier is Tier.DEVICE else m.host_pages
        if not length or (tier is Tier.HOST and node.device_raw[0] is not None):
            return
        if rng.random() < 0.25:
            self.locks.append((tree.lock_local(node, tier), seq, length, True))
        else:
            self.locks.append((tree.lock(node, tier), seq, length, False))

    def move(self) -> None:
        """Move a path lock down to a deeper usable end of the same sequence."""
        tree, rng = self.tree, self.rng
        movable = [i for i, (h, _, _, local) in enumerate(self.locks) if not local]
        if not movable:
            return
        i = rng.choice(movable)
        handle, seq, length, _ = self.locks[i]
        longer = seq[:length] + self.rand_seq()
        m = tree.match(self.keys(longer))
        node = m.device_node if handle.tier is Tier.DEVICE else m.host_node  # type: ignore[attr-defined]
        new = m.device_pages if handle.tier is Tier.DEVICE else m.host_pages  # type: ignore[attr-defined]
        if new < length or (handle.tier is Tier.HOST and node.device_raw[0] is not None):  # type: ignore[attr-defined]
            return
        self.locks[i] = (tree.move_lock(handle, node), longer, new, False)  # type: ignore[arg-type]

    def unlock(self) -> None:
        if self.locks:
            handle, *_ = self.locks.pop(self.rng.randrange(len(self.locks)))
            self.tree.unlock(handle)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ checks
    def check_values(self) -> None:
        """Every node holds exactly the model's units, page by page, in each tier."""
        tree, model = self.tree, self.model
        count = {(t, n): 0 for t in Tier for n in self.pools}
        for node in tree.nodes():
            prefix = self.path_prefix(node)
            for name in self.pools:
                p = tree.index[name]
                for tier, raw in ((Tier.DEVICE, node.device_raw[p]), (Tier.HOST, node.host_raw[p])):
                    if raw is None:
                        continue
                    units = torch.frombuffer(bytearray(raw), dtype=torch.int64).tolist()
                    if name.startswith("mamba"):
                        assert model.held[tier][name].get(prefix) == units[0], (node, name, tier)
                    else:
                        for i, unit in enumerate(units):
                            k = node.depth_start + i + 1
                            assert model.held[tier][name].get(prefix[:k]) == unit, (node, name, tier, k)
                    count[(tier, name)] += len(units)
        for (tier, name), total in count.items():
            assert total == len(model.held[tier][name]), (tier, name)

    def check_pins(self) -> None:
        """Pinned pages: each node on a live pin's path counted once, halves of a split included."""
        retention = self.retention
        if retention is None:
            return
        self.pins = [entry for entry in self.pins if not entry[0].released]  # type: ignore[attr-defined]
        nodes: dict[TreeNode, int] = {}
        for pin in retention._pins.values():
            node = pin.lock.node
            while node is not self.tree.root:
                nodes[node] = nodes.get(node, 0) + 1
                node = node.parent  # type: ignore[assignment]
        assert retention._pin_counts == nodes
        assert retention.pinned_pages == sum(n.pages for n in nodes)
        assert not event_errors(self.tree.evictor), event_errors(self.tree.evictor)

    def check_matches(self) -> None:
        tree, model = self.tree, self.model
        for probe in (self.rand_seq(), self.rand_seq()):
            m = tree.match(self.keys(probe), count_hit=False)
            ends = {node.depth_end for node in m.path}
            known = 0
            while known < len(probe) and model.present(Tier.HOST, "kv", probe[: known + 1]):
                known += 1
            assert m.pages == known, probe
            for tier, got, node, state in (
                (Tier.DEVICE, m.device_pages, m.device_node, m.device_state),
                (Tier.HOST, m.host_pages, m.host_node, m.host_state),
            ):
                assert got == model.usable(probe, tier, ends) == node.depth_end, (probe, tier)
                for name in self.pools:
                    if name.startswith("mamba") and got:
                        raw = state[name] if tier is Tier.DEVICE else state[name][1]
                        src = Tier.DEVICE if tier is Tier.DEVICE else state[name][0]
                        assert raw.item() == model.held[src][name][probe[:got]]
            tree.check()

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.22:
            self.insert(Tier.DEVICE)
        elif op < 0.3:
            self.insert(Tier.HOST)
        elif op < 0.4:
            self.backup()
        elif op < 0.46:
            self.drop()
        elif op < 0.62:
            self.evict()
        elif op < 0.76:
            self.lock()
        elif op < 0.84:
            self.move()
        elif op < 0.9:
            self.pin()
        else:
            self.unlock()
        self.tree.check()
        self.check_pins()
        self.check_values()
        self.check_matches()
        self.check_values()

    def finish(self) -> None:
        while self.locks:
            self.unlock()
        if self.retention is not None:
            self.retention.release_all()
            self.check_pins()
        self.tree.check()
        assert all(not any(n.device_lock) and not any(n.host_lock) for n in self.tree.nodes())
        assert all(
            not n.device_windows and not n.host_windows
            for n in self.tree.nodes()
            if n.device_windows is not None
        )


STACKS = [("kv", "swa"), ("kv", "mamba"), ("kv", "swa", "mamba"), ("kv", "swa", "swb", "full", "mamba")]


@pytest.mark.parametrize("page", [1, 4, 64])
@pytest.mark.parametrize("pools", STACKS)
@pytest.mark.parametrize("seed", range(3))
def test_hybrid_operations_match_the_page_model(pools: tuple[str, ...], page: int, seed: int) -> None:
    run = Run(pools, page, seed, paged=seed % 2 == 0)
    for _ in range(200):
        run.step()
    run.finish()


@pytest.mark.parametrize("policy", ["lru", "chain", "s3fifo"])
@pytest.mark.parametrize("pools", STACKS)
@pytest.mark.parametrize("seed", range(2))
def test_hybrid_operations_under_policies_and_retention(
    pools: tuple[str, ...], policy: str, seed: int
) -> None:
    """The same under an eviction policy's order and retention hints (levels, TTLs, pins)."""
    run = Run(pools, 4 if seed else 1, seed, paged=seed % 2 == 0, policy=policy)
    for _ in range(200):
        run.step()
    run.finish()


def _held_lengths(name: str, length: int, *, whole: bool) -> list[int]:
    """Prefix lengths whose ``name`` units a lock or pin on ``length`` pages holds: the state at
    its end, the window's last pages, every page of an all-pages pool (``whole``: not a local lock)."""
    if name.startswith("mamba"):
        return [length]
    if name in WINDOWS:
        return list(range(max(1, length - WINDOWS[name] + 1), length + 1))
    return list(range(1, length + 1)) if whole else []
