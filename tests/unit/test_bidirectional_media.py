"""The scheduler's rule for images that attend to themselves both ways (Gemma 3): a step never ends inside such an
image's placeholder run; the run waits for a step with room for all of it. Causal images may be split."""

from __future__ import annotations

import pytest
from test_scheduler import FakeRunner, make_scheduler

from kestrel.engine.contracts import run_step
from kestrel.request import MediaItem, Request, end_outside_runs
from kestrel.sampling_params import SamplingParams

RUNS = ((10, 12), (30, 12))  # two images of 12 placeholders in a 50-token prompt


def image(bidirectional: bool, ranges=RUNS) -> MediaItem:
    return MediaItem("image", "hash", ranges, bidirectional=bidirectional)


def test_end_outside_runs() -> None:
    item = (image(True),)
    assert end_outside_runs(item, 0, 16) == 10  # ends before the first image
    assert end_outside_runs(item, 0, 22) == 22  # the first image whole
    assert end_outside_runs(item, 10, 16) == 10  # starts at an image without room for it: nothing
    assert end_outside_runs(item, 14, 16) == 14  # (a prefix hit inside one: the rest of it, or nothing)
    assert end_outside_runs(item, 14, 30) == 30
    assert end_outside_runs((image(False),), 0, 16) == 16  # a causal image may be cut


@pytest.mark.parametrize("budget,others", [(16, 0), (13, 0), (20, 3)])
def test_steps_never_end_inside_a_bidirectional_image(budget: int, others: int) -> None:
    sched = make_scheduler(budget=budget, caching=False)
    runner = FakeRunner()
    sched.add_request(Request("img", list(range(50)), SamplingParams(max_tokens=3), media=(image(True),)))
    for i in range(others):  # text prompts beside it take part of each step's budget
        sched.add_request(Request(f"text{i}", list(range(100, 107)), SamplingParams(max_tokens=4)))
    ends = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if "img" in out.num_scheduled_tokens:
            ends.append(sched.requests["img"].num_computed_tokens)
        sched.update(out, run_step(runner, out))
    assert ends[-1] >= 50
    for start, length in RUNS:
        assert not any(start < end < start + length for end in ends), ends
