"""The reasoning parsers' split of an answer into thinking and content, whole and streamed in any pieces."""

from __future__ import annotations

import random

import pytest

from kestrel.entrypoints.reasoning import ReasoningSplitter, opened_by_prompt, split_reasoning

CASES = [  # (parser, opened by the prompt, answer, reasoning, content)
    ("deepseek_r1", False, "<think>add 2 and 3</think>It is 5.", "add 2 and 3", "It is 5."),
    ("deepseek_r1", False, "add 2 and 3</think>It is 5.", "add 2 and 3", "It is 5."),  # R1 may skip the opening
    ("deepseek_r1", False, "still thinking when cut", "still thinking when cut", ""),
    ("deepseek_r1", True, "x < y, so</think>\n\ny", "x < y, so", "\n\ny"),
    ("qwen3", False, "<think>\nhm\n</think>\n\nHello <b>!", "\nhm\n", "\n\nHello <b>!"),
    ("qwen3", False, "No thinking </think> here", None, "No thinking </think> here"),  # thinking off
    ("qwen3", True, "hm</think>Hi", "hm", "Hi"),  # the template opened it (thinking models)
    ("qwen3", False, "<thin", None, "<thin"),
    ("qwen3", False, "<think></think>", None, ""),
]


@pytest.mark.parametrize(("parser", "opened", "answer", "reasoning", "content"), CASES)
def test_a_whole_answer_and_its_stream_split_alike(parser, opened, answer, reasoning, content) -> None:
    assert split_reasoning(parser, answer, opened) == (reasoning, content)
    rng = random.Random(answer)
    for _ in range(30):
        splitter, pieces, i = ReasoningSplitter(parser, opened), [], 0
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
