"""The garbage collector of a serving process (kestrel/engine/serving_gc.py), in a fresh interpreter: what start-up
left is frozen (no collection walks it again), later objects are still collected, and the young generation's
threshold is raised."""

import json
import subprocess
import sys

SCRIPT = """
import gc, json
import torch  # a heap the size of a serving process's, in part
from kestrel.engine.serving_gc import YOUNG_THRESHOLD, tune_for_serving
before = len(gc.get_objects())
frozen = tune_for_serving()
tracked = len(gc.get_objects())
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle only the collector frees
del a, b
collected = gc.collect()
print(json.dumps({"before": before, "frozen": frozen, "tracked": tracked, "collected": collected,
                  "threshold": gc.get_threshold(), "young": YOUNG_THRESHOLD}))
"""


def test_start_up_heap_frozen_later_garbage_collected_and_threshold_raised():
    result = json.loads(subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                                       check=True).stdout)
    assert result["frozen"] >= result["before"] // 2 > 10_000  # torch's objects among them
    assert result["tracked"] < result["frozen"] // 10  # what collections still walk
    assert result["collected"] >= 2  # the two nodes of the cycle made after the freeze
    assert result["threshold"][0] == result["young"] > 700
