"""Sampler against independent numpy / plain-Python oracles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kestrel.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    sampling_probs,
    to_logprob_dicts,
)
from kestrel.sampling_params import SamplingParams as SP

V = 64
EOS = 1


def build(
    params: list[SP],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    vocab_size: int = V,
    device: str = "cpu",
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        EOS,
        vocab_size,
        device,
    )


def random_logits(batch: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


# ---------------------------------------------------------------- greedy and fast paths


def test_greedy_is_argmax() -> None:
    logits = random_logits(16)
    meta = build([SP(temperature=0.0)] * 16)
    assert meta.all_greedy and meta.no_penalties and meta.top_k is None and meta.top_p is None
    out = Sampler()(logits, meta)
    assert out.logprobs is None and out.logprob_token_ids is None
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == np.argmax(logits.numpy(), axis=1).tolist()


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    logits = random_logits(8, seed=1)
    params = [SP(temperature=0.0) if i % 2 == 0 else SP(temperature=1.5, top_k=10) for i in range(8)]
    meta = build(params)
    assert not meta.all_greedy and not meta.all_random
    sampled = Sampler(torch.Generator().manual_seed(0))(logits, meta).sampled_token_ids
    expected = np.argmax(logits.numpy(), axis=1)
    assert sampled[0::2].tolist() == expected[0::2].tolist()


def test_fast_path_flags() -> None:
    meta = build([SP(), SP(temperature=0.5)])
    assert meta.all_random and meta.no_penalties
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.min_tokens_rows is None and meta.max_num_logprobs is None
    # Options on greedy rows do not switch on the random-path work.
    meta = build([SP(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)])
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None


def test_no_host_sync_on_meta_device() -> None:
    """Meta tensors have no values: any .item()/.tolist()/.cpu() in the hot path would raise."""
    params = [
        SP(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
           frequency_penalty=0.3, logprobs=3, min_tokens=4, stop_token_ids=[7]),
        SP(temperature=0.0),
        SP(temperature=1.0, top_k=3),
    ]  # fmt: skip
    meta = build(params, [[1, 2], [3], [4]], [[4], [], [5, 5]], device="meta")
    out = Sampler()(torch.empty(3, V, device="meta"), meta)
    assert out.sampled_token_ids.shape == (3,)
    assert out.logprobs is not None and out.logprobs.shape == (3, 4)


# ---------------------------------------------------------------- penalties


def penalties_oracle(
    logits: np.ndarray, params: list[SP], prompts: list[list[int]], outputs: list[list[int]]
) -> np.ndarray:
    result = logits.astype(np.float64).copy()
    for row, p in enumerate(params):
        seen = set(prompts[row]) | set(outputs[row])
        for token in range(logits.shape[1]):
            x = result[row, token]
            if token in seen:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[row].count(token)
            x -= p.frequency_penalty * count
            x -= p.presence_penalty * (1 if count > 0 else 0)
            result[row, token] = x
    return result


def test_penalties_match_formulas() -> None:
    rng = np.random.default_rng(0)
    params = [
        SP(repetition_penalty=1.3),
        SP(repetition_penalty=0.7, frequency_penalty=0.4),
        SP(presence_penalty=-0.8, frequency_penalty=-0.2),
        SP(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.5, temperature=0.0),
        SP(),
    ]
    prompts = [rng.integers(0, V, size=rng.integers(1, 20)).tolist() for _ in params]
    outputs = [rng.integers(0, V, size=rng.integers(0, 30)).tolist() for _ in params]
    logits = random_logits(len(params), seed=2)
    meta = build(params, prompts, outputs)
    got = apply_penalties(logits, meta).numpy()
    np.testing.assert_allclose(got, penalties_oracle(logits.numpy(), params, prompts, outputs), rtol=1e-5, atol=1e-5)


def test_penalties_leave_input_untouched_and_apply_to_greedy() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    logits[0, 6] = 1.9
    before = logits.clone()
    meta = build([SP(temperature=0.0, repetition_penalty=2.0)], [[5]], [[]])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [6]
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- min_p / top_k / top_p masks


def probs_oracle(logits: np.ndarray, p: SP) -> np.ndarray:
    """Naive: temperature, min_p on the full softmax, then k largest, then top_p prefix of the rest."""
    x = logits.astype(np.float64) / p.temperature
    keep = np.ones_like(x, dtype=bool)
    if p.min_p > 0:
        probs = softmax64(x)
        keep &= probs >= p.min_p * probs.max()
    order = [int(i) for i in np.argsort(-x, kind="stable") if keep[i]]
    if p.top_k > 0:
        order = order[: p.top_k]
    if p.top_p < 1.0:
        kept_probs = softmax64(x[order])
        total, prefix = 0.0, []
        for token, prob in zip(order, kept_probs):
            prefix.append(token)
            total += prob
            if total >= p.top_p:
                break
        order = prefix
    result = np.zeros_like(x)
    result[order] = softmax64(x[order])
    return result


MASK_CASES = [
    SP(temperature=1.0, top_k=5),
    SP(temperature=0.5, top_k=1),
    SP(temperature=1.3, top_p=0.8),
    SP(temperature=0.9, top_p=0.05),
    SP(temperature=1.0, min_p=0.1),
    SP(temperature=2.0, top_k=20, top_p=0.7),
    SP(temperature=0.7, min_p=0.05, top_k=8, top_p=0.9),
    SP(temperature=1.0),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masks_match_naive_oracle(seed: int) -> None:
    logits = random_logits(len(MASK_CASES), seed=10 + seed)
    meta = build(MASK_CASES)
    probs = sampling_probs(logits, meta).numpy()
    for row, p in enumerate(MASK_CASES):
        expected = probs_oracle(logits[row].numpy(), p)
        assert ((probs[row] > 0) == (expected > 0)).all(), (row, p)
        np.testing.assert_allclose(probs[row], expected, atol=1e-6)


@pytest.mark.parametrize("params", [SP(temperature=1.0, top_k=7), SP(temperature=0.8, top_k=3, top_p=0.6)])
def test_masks_alone_in_batch(params: SP) -> None:
    """The top-k-only path (partial topk) and the sort path agree with the oracle on their own too."""
    logits = random_logits(4, seed=5)
    probs = sampling_probs(logits, build([params] * 4)).numpy()
    for row in range(4):
        np.testing.assert_allclose(probs[row], probs_oracle(logits[row].numpy(), params), atol=1e-6)


# ---------------------------------------------------------------- sampling distribution


@pytest.mark.parametrize(
    "params", [SP(temperature=1.0), SP(temperature=0.6), SP(temperature=1.0, top_k=4, top_p=0.9, min_p=0.02)]
)
def test_sampling_distribution(params: SP) -> None:
    vocab, draws = 8, 20_000
    row_logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    meta = build([params] * draws, vocab_size=vocab)
    sampled = Sampler(torch.Generator().manual_seed(123))(row_logits.expand(draws, vocab).contiguous(), meta)
    freq = np.bincount(sampled.sampled_token_ids.numpy(), minlength=vocab) / draws
    expected = probs_oracle(row_logits.numpy(), params)
    # Binomial std <= 0.0036 at 20k draws: 0.015 is over 4 sigma.
    assert np.abs(freq - expected).max() < 0.015
    assert (freq[expected == 0] == 0).all()


# ---------------------------------------------------------------- seeds


def test_seeded_rows_independent_of_batch() -> None:
    seeded = SP(temperature=1.0, seed=42)
    other = SP(temperature=1.0)
    steps = 12

    def run(batch_size: int, seeded_row: int, shared_seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(42)
        sampler = Sampler(torch.Generator().manual_seed(shared_seed))
        tokens = []
        for step in range(steps):
            logits = random_logits(batch_size, seed=1000 + step + batch_size, scale=0.5)
            logits[seeded_row] = random_logits(1, seed=step, scale=0.5)[0]
            params = [other] * batch_size
            params[seeded_row] = seeded
            gens: list[torch.Generator | None] = [None] * batch_size
            gens[seeded_row] = generator
            out = sampler(logits, build(params, generators=gens))
            tokens.append(int(out.sampled_token_ids[seeded_row]))
        return tokens

    alone = run(1, 0, shared_seed=0)
    assert run(5, 3, shared_seed=1) == alone
    assert run(3, 0, shared_seed=7) == alone
    assert len(set(alone)) > 1


def test_unseeded_rows_use_shared_generator() -> None:
    logits = random_logits(4, scale=0.3)
    meta = build([SP(temperature=1.0)] * 4)
    a = Sampler(torch.Generator().manual_seed(3))(logits, meta).sampled_token_ids
    b = Sampler(torch.Generator().manual_seed(3))(logits, meta).sampled_token_ids
    assert torch.equal(a, b)


# ---------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids(temperature: float) -> None:
    logits = torch.full((4, V), -5.0)
    logits[:, EOS] = 50.0
    logits[:, 9] = 40.0
    logits[:, 10] = 30.0
    params = [
        SP(temperature=temperature, min_tokens=3),
        SP(temperature=temperature, min_tokens=3, stop_token_ids=[9]),
        SP(temperature=temperature, min_tokens=3, ignore_eos=True),
        SP(temperature=temperature, min_tokens=2, stop_token_ids=[9]),
    ]
    outputs = [[5], [5, 6], [5], [5, 6]]
    out = Sampler(torch.Generator().manual_seed(0))(logits, build(params, outputs=outputs))
    # Row 3 reached its min_tokens: nothing is masked any more.
    assert out.sampled_token_ids.tolist() == [9, 10, EOS, EOS]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(4, seed=9)
    params = [
        SP(temperature=0.0, logprobs=3, repetition_penalty=1.8),
        SP(temperature=0.5, logprobs=0, top_k=2),
        SP(temperature=1.0),
        SP(temperature=1.0, logprobs=1, presence_penalty=2.0),
    ]
    out = Sampler(torch.Generator().manual_seed(0))(logits, build(params, [[1, 2]] * 4, [[3, 3]] * 4))
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.logprobs.shape == (4, 4) and out.logprob_token_ids.shape == (4, 4)
    x = logits.numpy().astype(np.float64)
    ref = x - x.max(axis=1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
    ids = out.logprob_token_ids.numpy()
    np.testing.assert_array_equal(ids[:, 0], out.sampled_token_ids.numpy())
    np.testing.assert_allclose(out.logprobs.numpy(), np.take_along_axis(ref, ids, axis=1), atol=1e-5)
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-ref, axis=1)[:, :3])

    dicts = to_logprob_dicts(out, [p.logprobs for p in params])
    assert dicts[2] is None
    sampled = out.sampled_token_ids.tolist()
    for row, n in ((0, 3), (1, 0), (3, 1)):
        d = dicts[row]
        assert d is not None and next(iter(d)) == sampled[row]
        expected_keys = [sampled[row], *np.argsort(-ref[row])[:n].tolist()]
        assert set(d) == set(expected_keys)
        for token, lp in d.items():
            assert lp.logprob == pytest.approx(ref[row, token], abs=1e-5)
            # Rank: 1 + the number of tokens strictly more likely in the float64 reference.
            assert lp.rank == 1 + int((ref[row] > ref[row, token]).sum())


def test_to_logprob_dicts_without_logprobs() -> None:
    out = Sampler()(random_logits(2), build([SP(temperature=0.0)] * 2))
    assert to_logprob_dicts(out, [None, None]) == [None, None]


def test_build_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        SamplingMetadata.build([SP()], [[1]], [], [None], EOS, V, "cpu")


def test_logit_bias_shifts_sampling_but_not_raw_logprobs() -> None:
    logits = random_logits(3)
    base = logits.numpy().astype(np.float64)
    target = int(np.argmin(base[0]))
    params = [SP(temperature=0.0, logit_bias={target: 100.0}, logprobs=1),
              SP(temperature=0.0, logit_bias={int(np.argmax(base[1])): -100.0}),
              SP(temperature=0.0)]
    out = Sampler()(logits, build(params))
    biased = base.copy()
    biased[0, target] += 100.0
    biased[1, int(np.argmax(base[1]))] -= 100.0
    assert out.sampled_token_ids.tolist() == [int(np.argmax(row)) for row in biased]
    assert out.sampled_token_ids[0].item() == target
    # reported logprobs are the model's own (raw) distribution
    expected = np.log(softmax64(base[0]))[target]
    assert out.logprobs[0, 0].item() == pytest.approx(expected, abs=1e-5)


def test_logit_bias_is_validated() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SP(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SP(logit_bias={-1: 1.0})


def test_allowed_token_ids_restrict_greedy_and_random_rows_only() -> None:
    params = [SP(temperature=0.0, allowed_token_ids=[3, 7]), SP(temperature=1.0, seed=5, allowed_token_ids=[9]),
              SP(temperature=0.0)]
    gens = [None, torch.Generator().manual_seed(5), None]
    logits = random_logits(3)
    for trial in range(20):
        out = Sampler()(random_logits(3, seed=trial), build(params, generators=gens)).sampled_token_ids.tolist()
        assert out[0] in (3, 7) and out[1] == 9
    expected_row0 = 3 if logits[0, 3] > logits[0, 7] else 7
    out = Sampler()(logits, build(params, generators=gens)).sampled_token_ids.tolist()
    assert out[0] == expected_row0 and out[2] == int(logits[2].argmax())
    with pytest.raises(Exception, match="allowed_token_ids"):
        SP(allowed_token_ids=[])


def test_bad_words_ban_the_last_token_after_the_words_prefix() -> None:
    bad = [[5], [7, 8]]
    params = [SP(temperature=0.0, bad_words_token_ids=bad), SP(temperature=0.0, bad_words_token_ids=bad)]
    logits = torch.zeros(2, V)
    logits[:, 5] = 10.0
    logits[:, 8] = 9.0
    out = Sampler()(logits, build(params, outputs=[[3, 7], [7, 3]])).sampled_token_ids.tolist()
    assert out == [0, 8]  # row 0 just wrote 7: 8 is banned too; row 1 did not, so 8 may follow


def test_cpu_draws_skip_zero_probability_tokens_and_follow_the_distribution() -> None:
    from kestrel.sample.sampler import draw_from_probs

    probs = torch.zeros(4000, 6)
    probs[:, 1], probs[:, 3], probs[:, 5] = 0.2, 0.3, 0.5  # the first and last tokens are not zero-free either
    probs[:2000, 5], probs[:2000, 0] = 0.0, 0.5
    drawn = draw_from_probs(probs, {}, torch.Generator().manual_seed(0))
    assert set(drawn[:2000].tolist()) <= {0, 1, 3} and set(drawn[2000:].tolist()) <= {1, 3, 5}
    counts = torch.bincount(drawn[2000:], minlength=6).double() / 2000
    assert torch.allclose(counts[[1, 3, 5]], torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64), atol=0.04)
