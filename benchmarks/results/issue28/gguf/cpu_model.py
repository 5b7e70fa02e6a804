"""The CPU comparison's model: a random GGUF file (Q4_K_M mix) of a ~0.2B Llama shape whose rows hold K-quant
blocks (every K a multiple of 256), and the offline run timed in both trees.

    .venv/bin/python benchmarks/results/issue28/gguf/cpu_model.py write /tmp/cpu_gguf/q4km/model.gguf
    [PYTHONPATH=OTHER_TREE] .venv/bin/python benchmarks/results/issue28/gguf/cpu_model.py run /tmp/cpu_gguf/q4km/model.gguf
"""

import json
import sys
import time
from pathlib import Path


def write(path: Path) -> None:
    from kestrel.bench import common
    from kestrel.tiny import default_model_path

    config = json.loads((Path(default_model_path()) / "config.json").read_text())
    config.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=64, tie_word_embeddings=False)
    common.write_random_gguf(path, config, "gguf-q4_k_m")


def run(path: Path) -> None:
    started = time.perf_counter()
    from kestrel import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", max_model_len=256)
    built = time.perf_counter()
    prompts = [{"prompt_token_ids": [(i * 37 + j * 11) % 8000 + 10 for j in range(64)]} for i in range(32)]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], greedy, use_tqdm=False)
    begin = time.perf_counter()
    out = llm.generate(prompts, greedy, use_tqdm=False)
    elapsed = time.perf_counter() - begin
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    print(json.dumps({"startup_s": round(built - started, 2), "out_tok_s": round(tokens / elapsed, 1),
                      "first_tokens": out[0].outputs[0].token_ids[:8]}))


if __name__ == "__main__":
    {"write": write, "run": run}[sys.argv[1]](Path(sys.argv[2]))
