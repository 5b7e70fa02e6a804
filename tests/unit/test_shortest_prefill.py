"""The shortest_prefill scheduling policy: shortest prompt first within a priority, a preempted request first, and
the starvation bound (no request waits behind more than `starvation_bound` admissions since its arrival)."""

import random

import pytest
from test_scheduler import FakeRunner, run_to_completion

from kestrel.config import CacheConfig, ConfigError, SchedulerConfig
from kestrel.engine.contracts import run_step
from kestrel.engine.scheduler import Scheduler
from kestrel.engine.waiting_queue import WaitingQueue
from kestrel.request import Request
from kestrel.sampling_params import SamplingParams


def scheduler(budget=64, max_seqs=1, num_blocks=64, bound=None, max_model_len=512):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy="shortest_prefill",
                             starvation_bound=bound)
    return Scheduler(config, CacheConfig(), num_blocks, max_model_len)


def request(rid, n_prompt, max_tokens=2, priority=0, seed=None):
    rng = random.Random(rid if seed is None else seed)
    r = Request(rid, [rng.randrange(500) for _ in range(n_prompt)], SamplingParams(max_tokens=max_tokens))
    r.priority = priority
    return r


def admission_order(sched, runner=None):
    runner = runner or FakeRunner()
    admitted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        admitted += [n.req_id for n in out.new_requests]
        sched.update(out, run_step(runner, out))
    return admitted


def test_the_shortest_prompt_is_admitted_first_within_a_priority():
    sched = scheduler()
    for rid, length, priority in (("long", 40, 0), ("short", 3, 0), ("mid", 12, 0), ("urgent-long", 50, -1),
                                  ("short-too", 3, 0)):
        sched.add_request(request(rid, length, priority=priority))
    # Priority first; equal lengths keep their arrival order.
    assert admission_order(sched) == ["urgent-long", "short", "short-too", "mid", "long"]


def test_fcfs_admits_the_same_requests_in_arrival_order():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1), CacheConfig(), 64, 512)
    for rid, length in (("long", 40), ("short", 3), ("mid", 12)):
        sched.add_request(request(rid, length))
    assert admission_order(sched) == ["long", "short", "mid"]


def test_a_long_request_waits_behind_at_most_the_bound_of_admissions():
    bound = 3
    sched = scheduler(bound=bound)
    runner = FakeRunner()
    sched.add_request(request("long", 60))
    admitted, arrivals = [], 0
    # A steady stream of short requests, two arriving per step: without the bound the long one never runs.
    for _ in range(40):
        for _ in range(2):
            sched.add_request(request(f"short-{arrivals}", 4))
            arrivals += 1
        out = sched.schedule()
        admitted += [n.req_id for n in out.new_requests]
        sched.update(out, run_step(runner, out))
        if "long" in admitted:
            break
    assert admitted.index("long") == bound, admitted
    run_to_completion(sched, runner)  # and every request still finishes


def test_the_bound_counts_admissions_not_arrivals():
    queue = WaitingQueue("shortest_prefill", starvation_bound=2)
    first = request("first", 30)
    queue.add(first)
    for i in range(5):  # arrivals alone never promote anyone
        queue.add(request(f"s{i}", 2))
    assert queue[0].request_id == "s0" and queue[len(queue) - 1] is first
    assert queue.pop_head().request_id == "s0"
    assert queue[0].request_id == "s1"  # one admission: still below the bound
    assert queue.pop_head().request_id == "s1"
    assert queue[0] is first  # two admissions since it arrived: it goes first


def test_a_preempted_request_is_readmitted_before_shorter_new_ones():
    # Two requests fill a 4-block pool while decoding; the later arrival is preempted, then short requests arrive.
    sched = scheduler(budget=64, max_seqs=4, num_blocks=4, max_model_len=64)
    runner = FakeRunner()
    sched.add_request(request("a", 30, max_tokens=30))
    sched.add_request(request("b", 31, max_tokens=30))
    preempted = set()
    for _ in range(100):
        out = sched.schedule()
        sched.update(out, run_step(runner, out))
        if out.preempted_req_ids:
            preempted = set(out.preempted_req_ids)
            break
    assert preempted == {"b"}  # equal priorities: the latest arrival is the victim
    sched.add_request(request("short", 2))
    assert sched.waiting[0].request_id == "b"
    finished = run_to_completion(sched, runner)
    assert sorted(finished) == ["a", "b", "short"] and sched.kv.pool.num_free_blocks == 4


def test_finished_and_aborted_waiting_requests_leave_every_structure():
    queue = WaitingQueue("shortest_prefill", starvation_bound=1)
    old, short = request("old", 20), request("short", 2)
    queue.add(old)
    queue.add(short)
    queue.remove(old)  # aborted while waiting: it must not be promoted later
    assert queue.pop_head() is short and len(queue) == 0
    queue.add(request("next", 5))
    assert [r.request_id for r in queue] == ["next"]


@pytest.mark.parametrize("policy, bound, fix", [
    ("fcfs", 8, "shortest_prefill"),
    ("priority", 8, "shortest_prefill"),
    ("shortest_prefill", 0, ">= 1"),
])
def test_the_bound_is_refused_where_it_would_be_ignored_or_is_invalid(policy, bound, fix):
    with pytest.raises(ConfigError, match="scheduling_starvation_bound") as refused:
        SchedulerConfig(policy=policy, starvation_bound=bound)
    assert fix in str(refused.value)


def test_the_bound_defaults_under_shortest_prefill():
    assert SchedulerConfig(policy="shortest_prefill").starvation_bound == 64
    assert SchedulerConfig().starvation_bound is None
