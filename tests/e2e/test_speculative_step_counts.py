"""What a speculative step with a worker-side proposer costs the host, counted on the CPU with CUDA graphs
emulated (each captured program runs eagerly at replay): per step one read of device values by the host (the
sampled ids, verified tokens, accepted counts and the drafts come back in one copy), one replay each of the
target's verify graph, the drafter's catch-up and the k-step proposal program, no model forward outside a
graph, and a bounded number of eager ops (the launches outside graphs on a GPU). Greedy outputs stay equal to
decoding without speculation, and EAGLE proposals to a recomputation of the head over the whole context, with
padded verify rows (two requests, one of them decoding plainly or verifying fewer drafts)."""

import contextlib

import pytest
import torch
from test_speculative_models import _recompute_head
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kestrel import LLM, SamplingParams
from kestrel.ops import cpu_references
from kestrel.worker import cuda_graph

K = 3
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}
# Eager ATen ops of one speculative step (two rows) outside graphs and model forwards (input building, sampling,
# verification, loading the graphs' static inputs, the host copy).
MAX_EAGER_OPS = {"draft": 124, "head": 134}


class Counts(TorchFunctionMode, TorchDispatchMode):
    pass


class Counter:
    """Host reads and ATen ops outside graph replays and model forwards; replays by program."""

    def __init__(self) -> None:
        self.depth = 0
        self.host_reads = self.ops = 0
        self.replays: list[str] = []
        self.forwards: list[str] = []
        counter = self

        class Reads(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in HOST_READS and counter.depth == 0:
                    counter.host_reads += 1
                return func(*args, **(kwargs or {}))

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if counter.depth == 0:
                    counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.modes = (Reads(), Ops())

    def inside(self, log: list[str], name: str, fn):
        def wrapped(*args, **kwargs):
            log.append(name)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return wrapped


class EagerGraph:
    def __init__(self, fn, out: torch.Tensor, name: str, counter: Counter) -> None:
        self.fn, self.out = counter.inside(counter.replays, name, fn), out

    def replay(self) -> None:
        out = self.fn()
        if out.data_ptr() != self.out.data_ptr():
            self.out.copy_(out)


PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8] * 4}, {"prompt_token_ids": [9, 5, 6] * 3}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
KW = dict(dtype="float32", max_model_len=64, max_num_seqs=2)


def with_emulated_graphs(llm: LLM, counter: Counter, monkeypatch) -> None:
    """Capture the engine's graphs as eager programs: the target's (pool "target") and the drafter's catch-up
    and proposal programs."""
    runner = llm.runner
    drafter = runner.drafter

    def capture_graph(fn, pool):
        out = fn()
        name = "proposal" if out.data_ptr() == drafter.drafts.data_ptr() else pool
        return EagerGraph(fn, out, name, counter), out

    monkeypatch.setattr(cuda_graph, "capture_graph", capture_graph)
    with torch.inference_mode():
        monkeypatch.setattr(cuda_graph, "graph_pool", lambda device: "target")
        runner._capture_graphs()
        monkeypatch.setattr(cuda_graph, "graph_pool", lambda device: "catch-up")
        drafter.capture_graphs(KW["max_num_seqs"], runner.max_blocks_per_seq, *runner._verify_shapes())


@pytest.mark.parametrize("proposer", ["draft", "head"])
def test_one_host_read_and_one_replay_per_program_per_speculative_step(spec_models, proposer, monkeypatch,
                                                                      record_proposals):
    plain = [o.outputs[0].token_ids for o in LLM(spec_models["target"], **KW).generate(PROMPTS, PARAMS, use_tqdm=False)]
    spec = {"model": spec_models[proposer], "num_speculative_tokens": K}
    llm = LLM(spec_models["target"], speculative_config=spec, **KW)
    runner = llm.runner
    counter = Counter()
    with_emulated_graphs(llm, counter, monkeypatch)
    for model, name in ((runner.model, "target"), (runner.drafter.model, "drafter")):
        monkeypatch.setattr(model, "forward", counter.inside(counter.forwards, name, model.forward))
    steps = []
    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens
    counting: list[contextlib.ExitStack] = []  # open from a verify step's forward through its collect

    def counted_execute(out, non_block=False):
        if out.scheduled_spec_decode_tokens:
            counter.host_reads = counter.ops = 0
            counter.replays.clear()
            counter.forwards.clear()
            modes = contextlib.ExitStack()
            modes.enter_context(counter.modes[0])
            modes.enter_context(counter.modes[1])
            counting.append(modes)
        return execute_model(out, non_block)

    def counted_sample(grammar, non_block=False):
        result = sample_tokens(grammar, non_block)  # the engine samples a verify step blocking: collected here
        if counting:
            counting.pop().close()
            steps.append((counter.host_reads, sorted(counter.replays), len(counter.forwards), counter.ops))
        return result

    runner.execute_model, runner.sample_tokens = counted_execute, counted_sample
    recorded = record_proposals(runner)
    # The ops a GPU launches: the CPU's fast paths (kernels/cpu) lay out their operands in ops of their own.
    with cpu_references():
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == plain
    assert len(steps) >= 4 and llm.stats.num_spec_draft_tokens > 0
    for host_reads, replays, forwards, ops in steps:
        assert host_reads == 1
        assert replays == ["catch-up", "proposal", "target"]
        # Every forward ran inside a replay: 1 target, 1 catch-up, k proposal steps.
        assert forwards == 2 + K
        assert ops <= MAX_EAGER_OPS[proposer]
    if proposer == "head":
        assert len(recorded) >= 10
        for tokens, drafts in recorded:
            assert drafts == _recompute_head(runner, tokens, K)[: len(drafts)]
