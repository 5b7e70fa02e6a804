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
}
