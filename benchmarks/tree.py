"""Prefix-tree benchmark: match + insert per 1k-token sequence, shared prefixes, 64-token pages.

Runs the same workload through kvstrata's ``PrefixTree`` and a baseline measured in the same
run, and prints the ratio. The baseline is SGLang's real ``RadixCache`` (``create_simulated``:
no memory pools) when ``--sglang-path`` (or ``KVSTRATA_SGLANG_PATH``) names an unpacked SGLang
wheel; otherwise (or when that import fails, reported as ``skipped: <reason>``) a token-level
paged radix tree written here in the same style (token arrays on edges compared page by page,
one device index per token, split by slicing, match concatenates the indices).

SGLang is never installed (it pulls torchvision and CUDA): unpack its wheel and the four small
pure deps its utility modules import at module level next to it::

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl
    python -m zipfile -e /tmp/sgl/sglang-0.5.23-*.whl /tmp/sglang-site
    pip install --no-deps --target /tmp/sglang-site msgspec pybase64 dill tqdm

Each side is timed with both the wall clock and this thread's CPU time (the machine is shared:
the wall clock also counts time the scheduler gives to other processes); both are printed, with
the ratio, and both go to ``--json``.

The loader skips ``sglang/__init__.py``, stubs the modules listed in ``SGLANG_STUBS`` and any
missing third-party module, and prints each one it stubbed.

    python benchmarks/tree.py [--sequences 10000] [--sglang-path /tmp/sglang-site] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import random
import sys
import time
import types
from array import array
from collections.abc import Callable
from typing import Any

import torch
from _results import Figure, write_results

from kvstrata.core.tree import PrefixTree, page_keys
from kvstrata.plugins.pool_type import ModelContext
from kvstrata.pool_types.kv import KVConfig, KVPoolType

PAGE = 64
SEQ_TOKENS = 1024

Timed = tuple[float, float, int]  # wall seconds, this thread's CPU seconds, device hit tokens


def _clocks() -> tuple[float, float]:
    # CPU time as well as wall time: on a shared machine the wall clock also counts the time the
    # scheduler gives other processes, which lands on whichever implementation is running
    return time.perf_counter(), time.thread_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clocks()
    return wall - start[0], cpu - start[1]


def workload(sequences: int, seed: int) -> list[array]:
    """Sequences = system prompt (256 tokens, 40 of them) + maybe a shared document
    (384 tokens, 400 of them) + a unique tail, 1024 tokens in all; held as ``array('q')``, the
    representation SGLang's RadixKey uses, and given as such to every implementation."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(32000) for _ in range(n)]

    systems = [tokens(256) for _ in range(40)]
    documents = [tokens(384) for _ in range(400)]
    out = []
    for _ in range(sequences):
        seq = list(rng.choice(systems))
        if rng.random() < 0.6:
            seq += rng.choice(documents)
        seq += tokens(SEQ_TOKENS - len(seq))
        out.append(array("q", seq))
    return out


def run_kvstrata(seqs: list[array]) -> Timed:
    spec = KVPoolType("kv", KVConfig(layers=1, kv_heads=1, head_dim=8), ModelContext(page_size=PAGE)).spec()
    tree = PrefixTree([spec])
    pages = SEQ_TOKENS // PAGE
    values = [torch.arange(i * pages, (i + 1) * pages) for i in range(len(seqs))]
    hit = 0
    start = _clocks()
    for seq, value in zip(seqs, values, strict=True):
        keys = page_keys(seq, PAGE)
        m = tree.match(keys)
        hit += len(tree.values(m.device_path, "kv"))
        tree.insert(keys, {"kv": value})
    return *_since(start), hit * PAGE


class _Node:
    __slots__ = ("children", "key", "parent", "value")

    def __init__(self, key: array, value: torch.Tensor | None, parent: _Node | None) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}


class TokenRadixBaseline:
    """Token-level paged radix tree: the shape of SGLang's RadixCache, written from scratch."""

    def __init__(self, page_size: int) -> None:
        self.page = page_size
        self.root = _Node([], None, None)

    def _prefix_len(self, a: array, b: array) -> int:
        n, page, i = min(len(a), len(b)), self.page, 0
        while i + page <= n and a[i : i + page] == b[i : i + page]:
            i += page
        return i

    def _split(self, child: _Node, at: int) -> _Node:
        upper = _Node(child.key[:at], child.value[:at], child.parent)  # type: ignore[index]
        upper.children = {tuple(child.key[at : at + self.page]): child}
        child.parent.children[tuple(upper.key[: self.page])] = upper  # type: ignore[union-attr]
        child.parent = upper
        child.key = child.key[at:]
        child.value = child.value[at:]  # type: ignore[index]
        return upper

    def match(self, key: array) -> torch.Tensor:
        key = key[: len(key) // self.page * self.page]
        node, values = self.root, []
        while key:
            child = node.children.get(tuple(key[: self.page]))
            if child is None:
                break
            n = self._prefix_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, key = child, key[n:]
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    def insert(self, key: array, value: torch.Tensor) -> int:
        node, done = self.root, 0
        while key:
            child = node.children.get(tuple(key[: self.page]))
            if child is None:
                node.children[tuple(key[: self.page])] = _Node(key, value, node)
                return done
            n = self._prefix_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            done += n
            node, key, value = child, key[n:], value[n:]
        return done


def run_baseline(seqs: list[array]) -> Timed:
    tree = TokenRadixBaseline(PAGE)
    values = [torch.arange(i * SEQ_TOKENS, (i + 1) * SEQ_TOKENS) for i in range(len(seqs))]
    hit = 0
    start = _clocks()
    for seq, value in zip(seqs, values, strict=True):
        hit += len(tree.match(seq))
        tree.insert(seq, value)
    return *_since(start), hit


class _StubMeta(type):
    """A permissive stand-in for names of modules RadixCache's match/insert never calls: any
    attribute, call, subscript or subclass works, a one-function call returns it (decorators)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Stub

    def __getitem__(cls, key: Any) -> Any:
        return _Stub

    def __setitem__(cls, key: Any, value: Any) -> None:
        pass

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:
        return False

    def __or__(cls, other: Any) -> Any:
        return _Stub

    __ror__ = __or__


class _Stub(metaclass=_StubMeta):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a stub module for each name in ``names`` (and its submodules)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if any(name == n or name.startswith(n + ".") for n in self.names):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


# SGLang modules that radix_cache imports but whose code the simulated RadixCache's match/insert
# never runs; importing them for real pulls the model/kernel stack (quantization, MoE, HF configs).
SGLANG_STUBS = {
    "sglang.srt.mem_cache.memory_pool": "ReqToTokenPool, a type hint here: req_to_token_pool=None",
    "sglang.srt.mem_cache.allocator": "BaseTokenToKVPoolAllocator, a type hint: allocator=None",
    "sglang.srt.observability.metrics_collector": "used only with enable_metrics=True",
}


def load_sglang(path: str) -> tuple[Any, list[str]]:
    """Import SGLang's real ``radix_cache`` module from an unpacked wheel at ``path``.

    The package ``sglang/__init__.py`` (the public-API facade: HF patches, frontend language) is not
    executed; the modules in ``SGLANG_STUBS`` are stubbed; so is any third-party module that is not
    installed (never torch). Returns the module and a description of everything stubbed; raises
    RuntimeError with the reason when the import still fails."""
    sys.path.insert(0, path)
    package = types.ModuleType("sglang")
    package.__path__ = [os.path.join(path, "sglang")]
    stubbed = {name: f"stub ({why})" for name, why in SGLANG_STUBS.items()}
    finder = _StubFinder(set(SGLANG_STUBS))
    sys.meta_path.insert(0, finder)
    try:
        for _ in range(50):
            for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
                del sys.modules[name]
            sys.modules["sglang"] = package
            try:
                module = importlib.import_module("sglang.srt.mem_cache.radix_cache")
                module.RadixCache.create_simulated(page_size=PAGE)  # the constructor works
                break
            except ModuleNotFoundError as exc:
                top = (exc.name or "").split(".")[0]
                if not top or top in ("sglang", "torch") or top in finder.names:
                    raise RuntimeError(f"importing sglang.srt.mem_cache.radix_cache failed: {exc!r}") from exc
                finder.names.add(top)
                stubbed[top] = "stub (third-party module not installed)"
            except Exception as exc:  # any import-time failure of a foreign package is a skip reason
                raise RuntimeError(f"importing sglang.srt.mem_cache.radix_cache failed: {exc!r}") from exc
        else:
            raise RuntimeError("importing sglang.srt.mem_cache.radix_cache: too many missing modules")
    finally:
        sys.meta_path.remove(finder)
    notes = ["sglang/__init__.py: not executed (public-API facade)"]
    for root, why in sorted(stubbed.items()):
        # exactly the modules served as stubs: the root and each submodule something imported
        served = sorted(
            m
            for m, v in sys.modules.items()
            if isinstance(v, _StubModule)
            and m.split(".")[0] == root.split(".")[0]
            and (m == root or m.startswith(root + "."))
        )
        notes.append(f"{', '.join(served) or root}: {why}")
    return module, notes


def sglang_runner(path: str) -> tuple[Callable[[list[array]], Timed], str, list[str]]:
    """Build a runner over SGLang's real RadixCache, or raise with the reason it cannot be imported."""
    module, notes = load_sglang(path)
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    radix_cache, radix_key = module.RadixCache, module.RadixKey
    match_params, insert_params = base.MatchPrefixParams, base.InsertParams
    version = _sglang_version(path)

    def run(seqs: list[array]) -> Timed:
        cache: Any = radix_cache.create_simulated(page_size=PAGE)
        values = [torch.arange(i * SEQ_TOKENS, (i + 1) * SEQ_TOKENS) for i in range(len(seqs))]
        hit = 0
        start = _clocks()
        for tokens, value in zip(seqs, values, strict=True):
            result = cache.match_prefix(match_params(key=radix_key(tokens)))
            hit += len(cache.path_device_indices(result.last_device_node))
            cache.insert(insert_params(key=radix_key(tokens), value=value))
        return *_since(start), hit

    return run, f"sglang {version} RadixCache (real, {module.__file__})", notes


def _sglang_version(path: str) -> str:
    for entry in os.listdir(path):
        if entry.startswith("sglang-") and entry.endswith(".dist-info"):
            return entry[len("sglang-") : -len(".dist-info")]
    return "(unknown version)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; the best of each counts")
    parser.add_argument("--sglang-path", default=os.environ.get("KVSTRATA_SGLANG_PATH"))
    parser.add_argument("--quick", action="store_true", help="CI-sized run (2000 sequences, 1 repeat)")
    parser.add_argument("--json", help="write the results file (benchmarks/README.md)")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.repeats = min(args.sequences, 2000), 1
    seqs = workload(args.sequences, args.seed)
    baseline_name, baseline = "token-radix baseline (same-run, RadixCache-shaped)", run_baseline
    if args.sglang_path:
        try:
            baseline, baseline_name, notes = sglang_runner(args.sglang_path)
            print("sglang import: " + "; ".join(notes))
        except RuntimeError as exc:
            print(f"sglang RadixCache skipped: {exc}")
    else:
        print(
            "sglang RadixCache skipped: no --sglang-path / KVSTRATA_SGLANG_PATH (an unpacked sglang wheel;"
            " see this script's docstring); baseline: the in-benchmark token-level radix tree"
        )
    # the workload's 10M token ints are not part of either tree: keep them out of the collector's
    # full passes so both sides pay only for the objects they create
    gc.collect()
    gc.freeze()
    ours, theirs = [float("inf")] * 2, [float("inf")] * 2  # best (wall, cpu) of the repeats
    for _ in range(args.repeats):
        *elapsed, our_hits = run_kvstrata(seqs)
        ours = [min(a, b) for a, b in zip(ours, elapsed, strict=True)]
        gc.collect()
        *elapsed, their_hits = baseline(seqs)
        theirs = [min(a, b) for a, b in zip(theirs, elapsed, strict=True)]
        gc.collect()
    if their_hits != our_hits:
        raise SystemExit(f"hit tokens differ: kvstrata {our_hits} vs {baseline_name} {their_hits}")
    n = len(seqs)
    print(f"workload: {n} sequences x {SEQ_TOKENS} tokens, page {PAGE}, device hit tokens {our_hits}")
    figures = []
    for clock, mine, base in (("cpu", ours[1], theirs[1]), ("wall", ours[0], theirs[0])):
        print(f"[{clock} time] kvstrata PrefixTree: {mine:.3f} s  ({mine / n * 1e6:.1f} us per match+insert)")
        print(f"[{clock} time] {baseline_name}: {base:.3f} s  ({base / n * 1e6:.1f} us per match+insert)")
        print(f"[{clock} time] speedup: {base / mine:.2f}x")
        metric = f"match+insert per {SEQ_TOKENS}-token sequence, {clock} time (sequences/s, bigger is better)"
        figures.append(Figure.against(metric, n / mine, "sequences/s", n / base, baseline_name))
    if args.json:
        write_results(args.json, "tree", figures)


if __name__ == "__main__":
    main()
