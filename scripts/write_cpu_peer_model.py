"""A 0.5B-class random Qwen2 checkpoint for the CPU peer bench (`scripts/cpu_vllm_peer.py --model DIR`): Qwen2-0.5B's
layer shapes (hidden 896, 24 layers, 14 query and 2 KV heads of 64, MLP 4864, q/k/v bias, tied embeddings) over
kestrel-tiny's 8,192-token vocabulary, so the peer's prompts (kestrel-tiny token ids) are valid for it. About 0.36B
parameters, float32 (1.4 GB); both engines load it from the directory as any HF checkpoint.

    .venv/bin/python scripts/write_cpu_peer_model.py /tmp/qwen2-0.5b-shape
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.loader.model_init import write_tiny_checkpoint  # noqa: E402

QWEN2_0_5B_LAYERS = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768}
TINY = Path(__file__).resolve().parents[1] / "kestrel" / "models" / "kestrel-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tiny = json.loads((TINY / "config.json").read_text())
    config = write_tiny_checkpoint(args.out, arch="qwen2", seed=args.seed, vocab_size=tiny["vocab_size"],
                                   bos_token_id=tiny["bos_token_id"], eos_token_id=tiny["eos_token_id"],
                                   **QWEN2_0_5B_LAYERS)
    for name in TOKENIZER_FILES:  # kestrel-tiny's tokenizer: the peer's prompt ids are its ids
        if (TINY / name).is_file():
            shutil.copy(TINY / name, args.out / name)
    params = config["num_hidden_layers"] * (
        config["hidden_size"] * (config["hidden_size"] + 2 * 128) + config["hidden_size"] ** 2
        + 3 * config["hidden_size"] * config["intermediate_size"]) + config["vocab_size"] * config["hidden_size"]
    print(f"wrote {args.out}: Qwen2, {params / 1e9:.2f}B parameters, vocabulary {config['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
