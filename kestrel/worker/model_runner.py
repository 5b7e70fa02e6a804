"""ModelRunner: a set-up model (`runner_setup`) that runs one step: its inputs (`step_inputs`), the forward, its
sampling (`step_sampling`)."""

from __future__ import annotations

import itertools

import torch

from kestrel.config import EngineConfig
from kestrel.distributed.parallel import ParallelContext
from kestrel.engine.contracts import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from kestrel.sample.sampler import Sampler
from kestrel.worker.runner_setup import RunnerSetup, host_threads_for_gpu_steps
from kestrel.worker.step_inputs import ScheduledStep, StepInputs
from kestrel.worker.step_sampling import DraftStep, ForwardStep, LaunchedStep, StepSampler


class ModelRunner(RunnerSetup):
    def __init__(self, config: EngineConfig, eos_token_id: int | None = None,
                 parallel: ParallelContext | None = None) -> None:
        """`parallel`: this rank's place in a tensor/pipeline-parallel group (kestrel.distributed.worker);
        None runs the whole model in this process."""
        super().__init__(config, eos_token_id, parallel)
        generator = torch.Generator(self.device)
        generator.manual_seed(config.model.seed)
        self.step_inputs = StepInputs(config.scheduler.max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                      self.device, self.drafter)
        self.requests = self.step_inputs.requests
        self.block_table = self.step_inputs.block_table
        self.sampling = StepSampler(self.model, Sampler(generator), self.eos_token_ids, self.device, self.drafter,
                                    self.step_inputs)
        if self.device.type == "cuda":
            host_threads_for_gpu_steps()

    # ----- the step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        return self.collect(self.sample(self.forward(out), grammar))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Enqueue one step on the device and return at once; `collect` waits for its sampled ids.

        A row whose input token was sampled by the step still in flight reads it on the device
        (`last_sampled`), so the next step can be launched before the host knows that token.
        """
        return self.sample(self.forward(out))

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> ForwardStep:
        """Enqueue the step's forward and the logits of its sampling rows; `sample` follows (the engine fills
        the grammar bitmask on the host in between)."""
        self.step_inputs.apply(out)
        step = self.step_inputs.prepare(out)
        if step is None:
            return ForwardStep([], [], [], None, {})
        hidden = self._forward_step(step)
        draft = None
        if self.drafter is not None:
            self.drafter.catch_up(step.inputs, step.counts, step.states, hidden)
            if out.draft_request_ids:
                draft = DraftStep(out.draft_request_ids, hidden, [0, *itertools.accumulate(step.counts)])
        forwarded = self.sampling.score(step, hidden, draft)
        self.step_inputs.mark_computed(step)
        return forwarded

    def _forward_step(self, step: ScheduledStep) -> torch.Tensor:
        """The step's hidden states: a captured graph's replay when one fits, else the eager forward."""
        inputs = step.inputs
        width = inputs.attn_metadata.block_tables.shape[1]
        if self.graph_runner is not None and self.graph_runner.can_run(step.counts, width):
            return self.graph_runner.run(inputs, step.counts)
        return self._run_model(inputs.input_ids, inputs.positions, inputs.attn_metadata)

    @torch.inference_mode()
    def forward_stage(self, out: SchedulerOutput) -> None:
        """A pipeline stage before the last: run this stage's layers on the step and hand its hidden states on
        (the model's forward sends them). Only the last stage samples; `record_sampled` brings its ids here before
        any later step reads them."""
        self.step_inputs.apply(out)
        step = self.step_inputs.prepare(out)
        if step is None:
            return
        inputs = step.inputs
        self._run_model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        self.step_inputs.mark_computed(step)

    def record_sampled(self, req_ids: list[str], sampled_token_ids: list[list[int]]) -> None:
        self.step_inputs.record_sampled(req_ids, sampled_token_ids)

    @torch.inference_mode()
    def sample(self, step: ForwardStep, grammar: GrammarBitmask | None = None) -> LaunchedStep:
        return self.sampling.sample(step, grammar)

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        return self.sampling.collect(step)
