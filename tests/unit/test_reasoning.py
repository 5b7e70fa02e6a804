"""The reasoning parsers' split of an answer into thinking and content, whole and streamed in any pieces."""

from __future__ import annotations

import random

import pytest

from kestrel.entrypoints.core_protocol import params_from_wire, params_to_wire
from kestrel.entrypoints.reasoning import (
    ReasoningSplitter,
    answer_prompt,
    opened_by_prompt,
    split_reasoning,
    thinking_at_start,
)
from kestrel.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams, ThinkingTags

CASES = [  # (parser, where the answer starts (thinking_at_start), answer, reasoning, content)
    ("deepseek_r1", True, "<think>add 2 and 3</think>It is 5.", "add 2 and 3", "It is 5."),
    ("deepseek_r1", True, "add 2 and 3</think>It is 5.", "add 2 and 3", "It is 5."),  # R1 may skip the opening
    ("deepseek_r1", True, "still thinking when cut", "still thinking when cut", ""),
    ("deepseek_r1", True, "x < y, so</think>\n\ny", "x < y, so", "\n\ny"),
    ("deepseek_r1", None, "The answer</think> is 5", None, "The answer</think> is 5"),  # the prompt closed it
    ("qwen3", False, "<think>\nhm\n</think>\n\nHello <b>!", "\nhm\n", "\n\nHello <b>!"),
    ("qwen3", False, "No thinking </think> here", None, "No thinking </think> here"),  # thinking off
    ("qwen3", True, "hm</think>Hi", "hm", "Hi"),  # the template opened it (thinking models)
    ("qwen3", None, "<think>hm</think>Hi", None, "<think>hm</think>Hi"),  # the template closed it
    ("qwen3", False, "<thin", None, "<thin"),
    ("qwen3", False, "<think></think>", None, ""),
]


@pytest.mark.parametrize(("parser", "start", "answer", "reasoning", "content"), CASES)
def test_a_whole_answer_and_its_stream_split_alike(parser, start, answer, reasoning, content) -> None:
    assert split_reasoning(parser, answer, start) == (reasoning, content)
    rng = random.Random(answer)
    for _ in range(30):
        splitter, pieces, i = ReasoningSplitter(parser, start), [], 0
        while i < len(answer):
            size = rng.randint(0, 4)
            pieces.append(splitter.feed(answer[i:i + size]))
            i += size
        pieces.append(splitter.feed("", final=True))
        assert "".join(r for r, _ in pieces) == (reasoning or "")
        assert "".join(c for _, c in pieces) == content


def test_nothing_of_a_tag_leaks_before_it_is_whole() -> None:
    splitter = ReasoningSplitter("qwen3", False)
    assert splitter.feed("<th") == ("", "")  # may open the thinking
    assert splitter.feed("ink>a b </th") == ("a b ", "")  # may close it
    assert splitter.feed("x") == ("</thx", "")
    assert splitter.feed("</think>done") == ("", "done")


def test_the_prompt_opens_the_thinking_when_it_ends_with_the_tag() -> None:
    assert opened_by_prompt("<|im_start|>assistant\n<think>\n")
    assert not opened_by_prompt("<|im_start|>assistant\n")
    assert opened_by_prompt("<think>a</think>b<|im_start|>assistant\n<think>\nLet me see")  # a continued thought
    assert not opened_by_prompt("<|im_start|>assistant\n<think>a</think>b<|im_start|>user\nhi")
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningSplitter("granite", False)


def test_where_a_structured_answer_starts_its_thinking() -> None:
    """Inside it when the prompt opened it (or deepseek_r1, which may think without the tag); past it when the prompt
    ends with it closed (thinking turned off); otherwise the first token may open it."""
    assert thinking_at_start("qwen3", "<|im_start|>assistant\n<think>\n") is True
    assert thinking_at_start("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert thinking_at_start("qwen3", "<|im_start|>assistant\n") is False
    # an earlier turn's closed thinking (a tool-call loop) lies before the answer's part of the prompt
    loop = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "<think>a</think>call"},
            {"role": "tool", "content": "42"}]
    text = "<|im_start|>user\nweather?<think>a</think>call<|im_start|>tool\n42<|im_start|>assistant\n"
    assert thinking_at_start("qwen3", text[answer_prompt(text, loop):]) is False
    # a continued assistant message that closed its thinking: the answer goes on past it
    continued = "<|im_start|>assistant\n<think>ok</think>\n\n{\"city\": "
    assert thinking_at_start("deepseek_r1", continued) is None and thinking_at_start("qwen3", continued) is None
    assert thinking_at_start("deepseek_r1", "<｜Assistant｜>") is True
    assert thinking_at_start("deepseek_r1", "<｜Assistant｜><think>\n\n</think>\n\n") is None


def test_after_thinking_crosses_to_the_engine_core_process_and_is_checked() -> None:
    tags = ThinkingTags(151667, 151668, open=True)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}, after_thinking=tags))
    assert params_from_wire(params_to_wire(params)) == params
    plain = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    assert params_from_wire(params_to_wire(plain)) == plain
    with pytest.raises(SamplingParamsError, match="differ"):
        ThinkingTags(5, 5)
    with pytest.raises(SamplingParamsError, match="end_token_id"):
        ThinkingTags(5, -1)
    with pytest.raises(SamplingParamsError, match="after_thinking"):
        StructuredOutputsParams(regex="a+", after_thinking=(1, 2))


def test_the_answers_part_of_the_prompt_starts_after_the_last_message_it_does_not_continue() -> None:
    """A <think> that a user, system or tool message mentions opens nothing; one of the template's generation
    prompt, or of an assistant message the answer continues, does."""
    messages = [{"role": "system", "content": "Put your reasoning in <think> tags."},
                {"role": "user", "content": "What does the <think> tag do?"}]
    prompt = "[system]Put your reasoning in <think> tags.[user]What does the <think> tag do?[assistant]"
    start = answer_prompt(prompt, messages)
    assert prompt[start:] == "[assistant]" and thinking_at_start("qwen3", prompt[start:]) is False
    assert thinking_at_start("qwen3", prompt) is True  # the whole prompt would have said otherwise
    opened = prompt + "<think>\n"
    assert thinking_at_start("qwen3", opened[answer_prompt(opened, messages):]) is True
    continued = [*messages, {"role": "assistant", "content": "<think>Let me"}]
    text = prompt + "<think>Let me"
    assert thinking_at_start("qwen3", text[answer_prompt(text, continued):]) is True
    parts = [{"role": "user", "content": [{"type": "text", "text": "a <think> b"}, {"type": "image"}]}]
    assert answer_prompt("[user]a <think> b<image>[assistant]", parts) == len("[user]a <think> b")
    assert answer_prompt("[user]rewritten[assistant]", [{"role": "user", "content": "hi <think>"}]) == 0
    # a short message is found where it is, not in the generation prompt after it
    short = "user\nhi\nassistant\n<think>\n"
    assert short[answer_prompt(short, [{"role": "user", "content": "hi"}]):] == "\nassistant\n<think>\n"
    both = "[user]a[assistant]b</think>a[user]c[assistant]<think>"
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b</think>a"},
               {"role": "user", "content": "c"}]
    assert both[answer_prompt(both, history):] == "[assistant]<think>"
