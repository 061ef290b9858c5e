"""The thinking split off an answer (reasoning_format): whole answers and streamed pieces."""
from __future__ import annotations

from runtime.server.reasoning import ReasoningStream, split_reasoning, thinking_forced_open


def _stream(pieces: list[str], forced: bool) -> tuple[str, str, list[tuple[str, str]]]:
    s = ReasoningStream(forced)
    out = [s.feed(p) for p in pieces]
    tail = s.finish()
    return "".join(r for r, _ in out) + tail[0], "".join(c for _, c in out) + tail[1], out


def test_whole_answers():
    assert split_reasoning("<think>plan</think>\n\nanswer", False) == ("plan", "answer")
    assert split_reasoning("plan</think>answer", True) == ("plan", "answer")
    assert split_reasoning("still thinking", True) == ("still thinking", "")
    assert split_reasoning("just an answer", False) == (None, "just an answer")
    assert split_reasoning("a <think> in the middle", False) == (None, "a <think> in the middle")


def test_streamed_pieces_hold_only_a_possible_tag():
    reasoning, content, out = _stream(["<thi", "nk>pl", "an</th", "ink>ans", "wer"], False)
    assert (reasoning, content) == ("plan", "answer")
    assert out[1] == ("pl", "") and out[2] == ("an", "")     # "</th" waits for the next piece
    reasoning, content, out = _stream(["Hello", " <think>"], False)
    assert (reasoning, content) == ("", "Hello <think>") and out[0] == ("", "Hello")


def test_forced_open_prompts():
    assert thinking_forced_open("<|Assistant|><think>\n")
    assert not thinking_forced_open("<|Assistant|><think>\n</think>")
    assert not thinking_forced_open("<|im_start|>assistant\n")
