"""kestrel: a fast LLM inference and serving engine."""
