"""Scheduler rules: token budget, chunking, preemption by recompute, nothing lost, all blocks freed."""

import random

from kestrel.config import CacheConfig, SchedulerConfig
from kestrel.engine.contracts import GrammarBitmask, ModelRunnerOutput, Ready, SchedulerOutput, run_step
from kestrel.engine.scheduler import Scheduler
from kestrel.request import Request, RequestStatus
from kestrel.sampling_params import SamplingParams


class FakeRunner:
    """Mirrors a worker's bookkeeping and checks every SchedulerOutput it gets for consistency."""

    def __init__(self, block_size: int = 16):
        self.block_size = block_size
        self.state: dict[str, dict] = {}
        self.computed_per_step: list[int] = []
        self.executed: ModelRunnerOutput | None = None

    def execute_model(self, out: SchedulerOutput, non_block: bool = False):
        output = self._run(out)
        if out.is_empty:  # it only releases requests
            return Ready(output) if non_block else output
        self.executed = output
        return Ready() if non_block else None

    def sample_tokens(self, grammar: GrammarBitmask | None, non_block: bool = False):
        output, self.executed = self.executed, None
        return Ready(output) if non_block else output

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.state.pop(rid, None)
        for new in out.new_requests:
            assert new.req_id not in self.state, "a request the runner knows was sent as new"
            self.state[new.req_id] = {"tokens": list(new.token_ids), "blocks": [list(b) for b in new.block_ids],
                                      "computed": new.num_computed_tokens}
        for cached in out.cached_requests:
            st = self.state[cached.req_id]
            for blocks, added in zip(st["blocks"], cached.new_block_ids):
                blocks.extend(added)
            assert st["computed"] == cached.num_computed_tokens
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            st = self.state[rid]
            assert n > 0
            end = st["computed"] + n
            assert end <= len(st["tokens"])
            assert all(len(b) * self.block_size >= end for b in st["blocks"]), "scheduled tokens without blocks"
            st["computed"] = end
            req_ids.append(rid)
            if end == len(st["tokens"]):
                token = 1000 + len(st["tokens"])
                st["tokens"].append(token)
                sampled.append([token])
            else:
                sampled.append([])
        self.computed_per_step.append(out.total_num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, sampled)


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, caching=True, max_model_len=512):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                     CacheConfig(enable_prefix_caching=caching), num_blocks, max_model_len)


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps=10_000):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= sched.config.max_num_seqs
        result = run_step(runner, out)
        for req in sched.update(out, result):
            if req.is_finished:
                assert req.request_id not in finished, "request finished twice"
                finished[req.request_id] = req
    assert not sched.has_unfinished_requests()
    return finished


def req(rid, n_prompt, max_tokens=5, seed=0):
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(500) for _ in range(n_prompt)], SamplingParams(max_tokens=max_tokens))


def test_budget_and_chunked_prefill():
    sched = make_scheduler(budget=16)
    sched.add_request(req("a", 40))
    runner = FakeRunner()
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    run_step(runner, out)
    sched.update(out, ModelRunnerOutput(["a"], [[]]))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    assert [c.req_id for c in out.cached_requests] == ["a"]


def test_decodes_first_then_prefill_chunks_mixed():
    sched = make_scheduler(budget=20)
    runner = FakeRunner()
    sched.add_request(req("a", 8, max_tokens=10))
    out = sched.schedule()
    res = run_step(runner, out)
    sched.update(out, res)
    sched.add_request(req("b", 50, seed=1))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 19)]


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_seqs=2, budget=64)
    for i in range(4):
        sched.add_request(req(f"r{i}", 4, seed=i))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}


def test_everything_finishes_and_all_blocks_are_free():
    sched = make_scheduler(num_blocks=64, budget=32, max_seqs=4)
    runner = FakeRunner()
    rng = random.Random(0)
    ids = []
    for i in range(12):
        sched.add_request(req(f"r{i}", rng.randrange(1, 60), max_tokens=rng.randrange(1, 20), seed=i))
        ids.append(f"r{i}")
    finished = run_to_completion(sched, runner)
    assert sorted(finished) == sorted(ids)
    for r in finished.values():
        assert r.num_output_tokens == r.sampling_params.max_tokens
        assert r.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.pool.num_free_blocks == 64


def test_preemption_recomputes_and_loses_nothing():
    # 10 blocks of 16 tokens for 4 requests that each grow to 60 tokens: preemption must happen.
    sched = make_scheduler(num_blocks=10, budget=64, max_seqs=4, max_model_len=128)
    runner = FakeRunner()
    for i in range(4):
        sched.add_request(req(f"r{i}", 30, max_tokens=30, seed=i))
    finished = run_to_completion(sched, runner)
    assert sched.stats.num_preemptions > 0
    assert sorted(finished) == [f"r{i}" for i in range(4)]
    for r in finished.values():
        assert r.num_output_tokens == 30
        # The output is exactly what the runner produced for this request, in order, with no repeats.
        assert r.output_token_ids == [1000 + 30 + k for k in range(30)]
    assert sched.kv.pool.num_free_blocks == 10


def test_preempted_request_goes_to_front_of_queue():
    sched = make_scheduler(num_blocks=4, budget=64, max_seqs=4, max_model_len=64)
    runner = FakeRunner()
    sched.add_request(req("old", 30, max_tokens=30))
    sched.add_request(req("new", 30, max_tokens=30, seed=1))
    sched.add_request(req("later", 4, max_tokens=2, seed=2))
    preempted = None
    for _ in range(100):
        out = sched.schedule()
        if out.preempted_req_ids:
            preempted = set(out.preempted_req_ids)
            assert sched.waiting[0].request_id in preempted
            break
        sched.update(out, run_step(runner, out))
    assert preempted == {"new"}  # the most recently admitted one


def test_prefix_caching_skips_computation_and_frees():
    sched = make_scheduler(num_blocks=64, budget=256)
    runner = FakeRunner()
    shared = list(range(64))
    sched.add_request(Request("a", shared + [1, 2], SamplingParams(max_tokens=2)))
    run_to_completion(sched, runner)
    before = sched.stats.num_scheduled_tokens
    sched.add_request(Request("b", shared + [3, 4], SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert out.new_requests[0].num_computed_tokens == 64
    assert out.num_scheduled_tokens == {"b": 2}
    sched.update(out, run_step(runner, out))
    run_to_completion(sched, runner)
    assert sched.stats.num_scheduled_tokens - before == 3
    assert sched.kv.pool.num_free_blocks == 64


def test_abort_frees_blocks_and_tells_runner():
    sched = make_scheduler()
    runner = FakeRunner()
    sched.add_request(req("a", 20))
    sched.add_request(req("b", 20, seed=1))
    out = sched.schedule()
    sched.update(out, run_step(runner, out))
    sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert "a" in out.finished_req_ids and "a" not in out.num_scheduled_tokens
    sched.update(out, run_step(runner, out))
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_free_blocks == 64
    assert not sched.has_unfinished_requests()


def test_stop_rules():
    sched = make_scheduler()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[7]), eos_token_id=9)
    sched.add_request(r)
    # min_tokens counts the token just sampled: eos as the first token does not stop, as the third it does.
    for token, expect_finished in [(9, False), (5, False), (9, True)]:
        out = sched.schedule()
        sched.update(out, ModelRunnerOutput(["a"], [[token]]))
        assert r.is_finished == expect_finished
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    r2 = Request("b", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]), eos_token_id=9)
    sched.add_request(r2)
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput(["b"], [[7]]))
    assert r2.status == RequestStatus.FINISHED_STOPPED and r2.stop_reason == 7


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=8)
    r = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=100), max_model_len=8)
    sched.add_request(r)
    run_to_completion(sched, FakeRunner())
    assert r.num_tokens == 8 and r.status == RequestStatus.FINISHED_LENGTH


def priority_scheduler(**kwargs):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=kwargs.pop("budget", 64), max_num_seqs=kwargs.pop(
        "max_seqs", 4), policy="priority"), CacheConfig(), kwargs.pop("num_blocks", 64), kwargs.pop("max_model_len",
                                                                                                   512))


def prioritized(rid, n_prompt, priority, max_tokens=5, seed=0):
    request = req(rid, n_prompt, max_tokens, seed)
    request.priority = priority
    return request


def test_priority_policy_admits_the_lowest_value_first_then_by_arrival():
    sched = priority_scheduler(max_seqs=1)
    runner = FakeRunner()
    for rid, priority in (("late-low", 5), ("urgent", -1), ("normal-a", 0), ("normal-b", 0)):
        sched.add_request(prioritized(rid, 4, priority, max_tokens=2, seed=len(rid)))
    admitted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        admitted += [n.req_id for n in out.new_requests]
        sched.update(out, run_step(runner, out))
    assert admitted == ["urgent", "normal-a", "normal-b", "late-low"]


def test_priority_policy_preempts_the_least_important_not_the_newest():
    # Same shape as test_preempted_request_goes_to_front_of_queue, where first come, first served preempts "new".
    sched = priority_scheduler(num_blocks=4, max_model_len=64)
    runner = FakeRunner()
    sched.add_request(prioritized("old", 30, priority=3, max_tokens=30))
    sched.add_request(prioritized("new", 30, priority=0, max_tokens=30, seed=1))
    preempted = None
    for _ in range(100):
        out = sched.schedule()
        sched.update(out, run_step(runner, out))
        if out.preempted_req_ids:
            preempted = set(out.preempted_req_ids)
            break
    assert preempted == {"old"}
    finished = run_to_completion(sched, runner)
    assert sorted(finished) == ["new", "old"] and sched.kv.pool.num_free_blocks == 4


def test_update_appends_several_tokens_and_stops_at_the_first_stop_rule():
    sched = make_scheduler()
    runner = FakeRunner()
    request = Request("a", [5, 6, 7], SamplingParams(max_tokens=10, stop_token_ids=[42]), eos_token_id=2)
    sched.add_request(request)
    out = sched.schedule()
    sched.update(out, run_step(runner, out))  # the prompt's step: one token
    computed = request.num_computed_tokens
    # A verify step of 3 drafts: two accepted plus the corrected token = 3 tokens; one draft's slot is given back.
    spec = SchedulerOutput([], [], {"a": 4}, 4, scheduled_spec_decode_tokens={"a": [11, 12, 13]})
    request.num_computed_tokens += 4
    sched.update(spec, ModelRunnerOutput(["a"], [[11, 12, 99]]))
    assert request.output_token_ids[-3:] == [11, 12, 99] and request.num_computed_tokens == computed + 3
    # Tokens after a stop token are dropped, and the request finishes with that token's reason.
    sched.update(SchedulerOutput([], [], {"a": 3}, 3, scheduled_spec_decode_tokens={"a": [8, 42]}),
                 ModelRunnerOutput(["a"], [[8, 42, 9]]))
    assert request.output_token_ids[-2:] == [8, 42] and request.stop_reason == 42
    assert request.status == RequestStatus.FINISHED_STOPPED and sched.kv.pool.num_free_blocks == 64


def test_a_decode_step_sends_records_only_for_requests_whose_runner_state_changed():
    """A request whose last block has room decodes without a CachedRequestData (the runner advances its own count);
    one that gains a block, or whose count moved back because drafts were rejected, gets one with the count."""
    sched = make_scheduler(budget=64)
    sched.add_request(req("a", 15, max_tokens=20))
    sched.add_request(req("b", 5, max_tokens=20))
    out = sched.schedule()
    assert [n.req_id for n in out.new_requests] == ["a", "b"]
    sched.update(out, ModelRunnerOutput(["a", "b"], [[7], [7]]))
    out = sched.schedule()  # a computes its 16th position, the last of its first block; b its 6th
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.cached_requests == []
    sched.update(out, ModelRunnerOutput(["a", "b"], [[7], [7]]))
    sched.requests["b"].spec_token_ids = [8, 9, 10]
    out = sched.schedule()  # a: its 17th position needs a second block; b verifies three drafts
    assert [(c.req_id, c.num_computed_tokens) for c in out.cached_requests] == [("a", 16)]
    assert out.num_scheduled_tokens == {"a": 1, "b": 4} and out.scheduled_spec_decode_tokens == {"b": [8, 9, 10]}
    sched.update(out, ModelRunnerOutput(["a", "b"], [[7], [8, 11]]))  # b: one draft accepted, two rejected
    assert sched.requests["b"].num_computed_tokens == 8
    out = sched.schedule()
    assert [(c.req_id, c.num_computed_tokens, c.new_block_ids) for c in out.cached_requests] == [("b", 8, ())]
    sched.update(out, ModelRunnerOutput(["a", "b"], [[7], [7]]))
    out = sched.schedule()
    assert out.cached_requests == []
