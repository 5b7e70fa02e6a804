"""The workshop: training code for the models kestrel bundles.

It imports kestrel (the public API, the loader's writers, the chat template, the ppl bench) and is never imported
by it: the runtime package runs without this one (`tests/unit/test_import_rules.py`).
"""
