"""ModelRunner: a set-up model (`runner_setup`) behind the engine's two verbs: `execute_model` (the step's inputs,
`step_inputs`, and its forward) and `sample_tokens` (its sampling, `step_sampling`)."""

from __future__ import annotations

import itertools

import torch

from kestrel.config import EngineConfig
from kestrel.distributed.parallel import ParallelContext
from kestrel.engine.contracts import GrammarBitmask, ModelRunnerOutput, Ready, SchedulerOutput
from kestrel.sample.sampler import Sampler
from kestrel.worker.media_attention import with_causal_ends
from kestrel.worker.mrope import with_mrope_positions
from kestrel.worker.runner_setup import RunnerSetup, host_threads_for_gpu_steps
from kestrel.worker.step_inputs import ScheduledStep, StepInputs
from kestrel.worker.step_sampling import DraftStep, ForwardStep, LaunchedStep, StepSampler


class ModelRunner(RunnerSetup):
    def __init__(self, config: EngineConfig, eos_token_id: int | None = None,
                 parallel: ParallelContext | None = None) -> None:
        """`parallel`: this rank's place in a tensor/pipeline-parallel group (kestrel.executor.worker);
        None runs the whole model in this process."""
        super().__init__(config, eos_token_id, parallel)
        generator = torch.Generator(self.device)
        generator.manual_seed(config.model.seed)
        self.step_inputs = StepInputs(config.scheduler.max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                      self.device, self.drafter,
                                      [group.spec.follows_tokens for group in self.kv_groups],
                                      self.streaming_sink_blocks)
        self.requests = self.step_inputs.requests
        self.block_table = self.step_inputs.block_table
        self.sampling = StepSampler(self.model, Sampler(generator), self.eos_token_ids, self.device, self.drafter,
                                    self.step_inputs, self.expert_counts, config.expert_load_interval)
        self._forwarded: ForwardStep | None = None  # executed, not yet sampled
        if self.device.type == "cuda":
            host_threads_for_gpu_steps()

    # ----- the two verbs -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Ready | None:
        """Apply the scheduler output and enqueue the step's forward and the logits of its sampling rows; None
        (`sample_tokens` follows), or the empty output of a step with nothing to compute. Nothing here waits for
        the device, so `non_block` only wraps the value in a handle.

        A row whose input token was sampled by the step still in flight reads it on the device (`last_sampled`),
        so the next step can be executed before the host knows that token. A pipeline stage before the last runs
        its layers only (the model's forward hands its hidden states on); the last stage samples, and
        `record_sampled` brings its ids here before any later step reads them."""
        output = self._execute(scheduler_output)
        return Ready(output) if non_block else output

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        if self._forwarded is not None:
            raise RuntimeError("execute_model was called again before the executed step's sample_tokens")
        self.step_inputs.apply(out)
        step = self.step_inputs.prepare(out)
        if step is None:
            return ModelRunnerOutput([], [])
        if self.graphs_pending:  # graph_capture="serving": one graph before each step until all are captured
            self.capture_next_graph()
        if self.mrope:
            step = with_mrope_positions(self.model, step)
        if self.bidirectional_media:
            step = with_causal_ends(step)
        if self.encoder_decoder:
            self.media_encoder.write_cross_kv(step.states)
            embeds = None
        else:
            embeds = self._media_embeds(step)
        if not self.is_last_stage:
            inputs = step.inputs
            self._run_model(inputs.input_ids, inputs.positions, inputs.attn_metadata, inputs_embeds=embeds)
            self.step_inputs.mark_computed(step)
            return None
        hidden = self._forward_step(step, embeds)
        draft = None
        if self.drafter is not None:
            self.drafter.catch_up(step.inputs, step.counts, step.states, hidden)
            if out.draft_request_ids:
                draft = DraftStep(out.draft_request_ids, hidden, [0, *itertools.accumulate(step.counts)])
        self._forwarded = self.sampling.score(step, hidden, draft)
        self.step_inputs.mark_computed(step)
        return None

    def _media_embeds(self, step: ScheduledStep) -> torch.Tensor | None:
        """The encoder step: input embeddings with the media rows the step computes, or None (no media in it, or
        a pipeline stage after the first, which reads hidden states)."""
        if self.media_encoder is None or (self.parallel is not None and not self.parallel.is_first_stage):
            return None
        return self.media_encoder.input_embeds(step.states, step.counts, step.inputs.input_ids)

    def _forward_step(self, step: ScheduledStep, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The step's hidden states: a captured graph's replay when one fits (a decode or verify graph, else a
        prefill / mixed-step graph when max_prefill_graph_tokens is on), else the eager forward (always for a step
        that writes media rows into its input embeddings)."""
        inputs = step.inputs
        width = inputs.attn_metadata.block_tables.shape[1]
        if (inputs_embeds is None and inputs.attn_metadata.causal_ends is None and self.graph_runner is not None
                and self.graph_runner.can_run(step.counts, width)):
            return self.graph_runner.run(inputs, step.counts)
        return self._run_model(inputs.input_ids, inputs.positions, inputs.attn_metadata,
                               inputs_embeds=inputs_embeds)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarBitmask | None,
                      non_block: bool = False) -> ModelRunnerOutput | SampledStep:
        """Enqueue the sampling of the executed step, its constrained rows masked by `grammar_output` first (so
        greedy, top-p/top-k and logprobs all see the masked distribution), its drafts verified, the drafter's
        proposals and the one host copy; then wait for the ids, or with `non_block` return a handle whose
        `result()` does."""
        forwarded, self._forwarded = self._forwarded, None
        if forwarded is None:
            raise RuntimeError("sample_tokens was called without a step executed (or on a stage before the last)")
        sampled = SampledStep(self, self.sampling.sample(forwarded, grammar_output))
        return sampled if non_block else sampled.result()

    def _collect(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a sampled step's ids (its one host synchronization) and record them."""
        return self.sampling.collect(launched)

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, by MoE layer index (`expert_load_metrics`); waits for the device."""
        if self.expert_counts is None:
            raise RuntimeError("the expert load is counted only with expert_load_metrics=True")
        return self.expert_counts.read()

    def record_sampled(self, req_ids: list[str], sampled_token_ids: list[list[int]]) -> None:
        """A pipeline stage before the last: the tokens the last stage added in a step."""
        self.step_inputs.record_sampled(req_ids, sampled_token_ids)


class SampledStep:
    """`sample_tokens(non_block=True)`'s handle: `result()` collects the step once."""

    def __init__(self, runner: ModelRunner, launched: LaunchedStep) -> None:
        self._runner = runner
        self._launched: LaunchedStep | None = launched
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._launched is not None:
            self._output = self._runner._collect(self._launched)
            self._launched = None
        return self._output
