"""Tiny, seeded Hugging Face models of every family the HF adapter covers (no download).

Each config keeps the family's layer kinds (full / sliding-window attention, Mamba / GDN / KDA /
short-conv states, MoE blocks, MLA) at toy sizes: at most 2 M parameters, 2-4 layers, a
vocabulary of 256. ``tiny_model(family, dtype, seed)`` builds one with random weights from
``torch.manual_seed(seed)``, so two processes build bit-identical models. Needs the ``hf`` extra.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 256
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
_MAMBA_SMALL = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 8, "mamba_chunk_size": 16}
_LINEAR_SMALL = {
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_GDN_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

#: family -> (transformers model_type, config fields beyond the common toy sizes)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"num_hidden_layers": 2, "head_dim": 16}),
    "qwen3": ("qwen3", {"num_hidden_layers": 2, "head_dim": 16}),
    "mistral": ("mistral", {"num_hidden_layers": 2, "head_dim": 16, "sliding_window": 24}),
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "sliding_window": 5,  # smaller than a 16-token page
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
    ),
    "gpt_oss": (
        "gpt_oss",
        {
            "num_hidden_layers": 2,
            "head_dim": 16,
            "sliding_window": 20,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "falcon_h1": (
        "falcon_h1",
        {
            "num_hidden_layers": 2,
            "head_dim": 16,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 8,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 16,
        },
    ),
    "qwen3_next": (
        "qwen3_next",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            **_LINEAR_SMALL,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": _GDN_LAYERS,
        },
    ),
    "qwen3_5": (
        "qwen3_5_text",
        {"num_hidden_layers": 4, "head_dim": 16, **_LINEAR_SMALL, "layer_types": _GDN_LAYERS},
    ),
    "mamba2": (
        "mamba2",
        {"num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "state_size": 8, "n_groups": 1}
        | {"chunk_size": 16},
    ),
    "jamba": (
        "jamba",
        {
            "num_hidden_layers": 4,
            "attn_layer_period": 4,
            "attn_layer_offset": 2,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 8,
            "mamba_dt_rank": 8,
        },
    ),
    "zamba2": (
        "zamba2",
        {
            "num_hidden_layers": 4,
            "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
            "mamba_d_state": 8,
            "n_mamba_heads": 4,
            "mamba_ngroups": 1,
            "chunk_size": 16,
        },
    ),
    "bamba": ("bamba", {"num_hidden_layers": 3, "attn_layer_indices": [1], **_MAMBA_SMALL}),
    "granitemoehybrid": (
        "granitemoehybrid",
        {
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "attention", "linear_attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
            **_MAMBA_SMALL,
        },
    ),
    "nemotron_h": (
        "nemotron_h",
        {
            "layers_block_type": ["mamba", "attention", "moe", "mlp"],
            "head_dim": 16,
            "ssm_state_size": 8,
            "mamba_num_heads": 4,
            "mamba_head_dim": 32,
            "n_groups": 1,
            "chunk_size": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
        },
    ),
    "kimi_linear": (
        "kimi_linear",
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "mlp_layer_types": ["dense", "sparse", "dense"],
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "linear_head_dim": 8,
            "linear_num_heads": 4,
            "num_experts": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
    ),
    "lfm2": (
        "lfm2",
        {
            "num_hidden_layers": 3,
            "layer_types": ["conv", "full_attention", "conv"],
            "block_multiple_of": 16,
            "block_auto_adjust_ff_dim": False,
        },
    ),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
        },
    ),
}


#: families the adapter refuses, with the reason it names (for the clear-error tests and docs)
UNMAPPED: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v32": (  # DSA indexer keys in a DynamicIndexedLayer
        "deepseek_v32",
        {
            **FAMILIES["deepseek_v3"][1],
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_topk": 8,
        },
    ),
    "glm_moe_dsa": (  # the same DSA indexer layer
        "glm_moe_dsa",
        {
            **FAMILIES["deepseek_v3"][1],
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_topk": 8,
        },
    ),
    "deepseek_v4": (  # compressed attention in a DeepseekV4HCACache layer
        "deepseek_v4",
        {
            "num_hidden_layers": 2,
            "head_dim": 16,
            "q_lora_rank": 32,
            "o_lora_rank": 32,
            "o_groups": 2,
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_topk": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "sliding_window": 8,
            "num_nextn_predict_layers": 0,
        },
    ),
    "minimax": (  # lightning attention in the family's own MiniMaxCache
        "minimax",
        {
            "num_hidden_layers": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
}


def tiny_config(family: str, **fields: Any) -> Any:
    """The family's toy ``PretrainedConfig`` (``fields`` override or add config fields)."""
    from transformers import AutoConfig

    try:
        model_type, extra = FAMILIES[family] if family in FAMILIES else UNMAPPED[family]
    except KeyError:
        raise KeyError(f"no tiny config for {family!r}; families: {sorted(FAMILIES)}") from None
    return AutoConfig.for_model(model_type, **{**_COMMON, **extra, **fields})


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **fields: Any) -> Any:
    """A seeded random-weight causal LM of ``family`` in eval mode (built in fp32, then cast)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()
