"""The configs `kestrel model-init` writes random checkpoints of: sizes and per-family config.json entries.
Plain data (no torch), so the command line can list the choices without importing the model code."""

from __future__ import annotations

from typing import Any

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    "small": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2},
}

ARCHS: dict[str, dict[str, Any]] = {
    # Llama 3.1 style: llama3 rope scaling (an original context of 64 stretched 8x to the 512 positions).
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "sliding_window": 32, "tie_word_embeddings": False,
    },
    # Like Qwen2-0.5B: tied embeddings, q/k/v bias, no sliding window.
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": 512, "tie_word_embeddings": True,
    },
    # The families below carry head_dim 16 (the sizes' hidden / heads), which transformers would otherwise
    # default to its own (128 or 256) for some of them.
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16, "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "rope_theta": 1000000.0, "tie_word_embeddings": False,
    },
    "gemma": {
        "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "head_dim": 16, "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "hidden_act": "gelu_pytorch_tanh", "rope_theta": 10000.0, "tie_word_embeddings": True,
    },
    # Alternating windows (the first layer local), both soft caps.
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 16, "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 10000.0, "tie_word_embeddings": True,
        "query_pre_attn_scalar": 16, "sliding_window": 16, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    # transformers 4's names: a local RoPE base on the sliding layers, linear scaling on the global ones.
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 16, "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True,
        "query_pre_attn_scalar": 16, "sliding_window": 16, "sliding_window_pattern": 2,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "pad_token_id": 0,
        "original_max_position_embeddings": 512, "tie_word_embeddings": False,
    },
    "granite": {
        "architectures": ["GraniteForCausalLM"], "model_type": "granite", "pad_token_id": 0, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
        "attention_multiplier": 0.0625, "residual_multiplier": 0.22, "logits_scaling": 8.0,
    },
    "olmo2": {
        "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    },
    "glm4": {
        "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "head_dim": 16, "rms_norm_eps": 1e-5,
        "pad_token_id": 0,
        "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "attention_bias": True, "tie_word_embeddings": False,
    },
    "cohere": {
        "architectures": ["CohereForCausalLM"], "model_type": "cohere", "pad_token_id": 0, "layer_norm_eps": 1e-5,
        "rope_theta": 10000.0, "logit_scale": 0.25, "tie_word_embeddings": True,
    },
    # One sliding layer with RoPE, one global layer without.
    "cohere2": {
        "architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "head_dim": 16, "layer_norm_eps": 1e-5,
        "pad_token_id": 0,
        "rope_theta": 10000.0, "logit_scale": 0.25, "tie_word_embeddings": True, "sliding_window": 16,
        "sliding_window_pattern": 2,
    },
    "starcoder2": {
        "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "norm_epsilon": 1e-5,
        "pad_token_id": 0,
        "hidden_act": "gelu_pytorch_tanh", "rope_theta": 10000.0, "use_bias": True, "tie_word_embeddings": True,
        "sliding_window": 16,
    },
    # Mixtures of experts: 4 experts, 2 a token (the sizes' intermediate_size is Mixtral's and OLMoE's expert size).
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "rms_norm_eps": 1e-5,
        "pad_token_id": 0,
        "rope_theta": 1000000.0, "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False,
    },
    # The second layer dense (mlp_only_layers), a shared expert.
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "rope_theta": 1000000.0, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "mlp_only_layers": [1], "norm_topk_prob": False,
        "use_sliding_window": False, "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 16, "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "rope_theta": 1000000.0, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "use_sliding_window": False, "tie_word_embeddings": False,
    },
    "olmoe": {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "pad_token_id": 0,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False, "tie_word_embeddings": False,
    },
}
