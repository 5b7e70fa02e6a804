"""IncrementalDetokenizer against full decodes of the built-in byte-level BPE tokenizer."""

from __future__ import annotations

import gc
import random
import weakref
from pathlib import Path

import pytest

from kestrel.engine.detokenizer import IncrementalDetokenizer, TokenizerLookups, _byte_fallback
from kestrel.loader.tokenizer_init import write_tokenizer
from kestrel.sampling_params import SamplingParams as SP

transformers = pytest.importorskip("transformers")

CHARS = (
    list("abcdefghij klmnopqrstuvwxyz ,.!?\n") + list("éèüñçøå") + list("日本語中文한국어") + ["🙂", "🚀", "👍🏽", "€"]
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    path: Path = tmp_path_factory.mktemp("tok")
    write_tokenizer(str(path))
    return transformers.AutoTokenizer.from_pretrained(str(path))


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(CHARS) for _ in range(length))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def chunks(rng: random.Random, ids: list[int], max_chunk: int) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        out.append(ids[i : i + n])
        i += n
    return out


def run(tokenizer, ids_chunks: list[list[int]], params: SP) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed chunks, collecting deltas; checks the streaming invariants on the way."""
    detok = IncrementalDetokenizer(tokenizer, [0, 5, 6], params)
    deltas: list[str] = []
    for chunk in ids_chunks:
        stop = detok.update(chunk)
        deltas.append(detok.get_delta(finished=stop is not None))
        if stop is not None:
            break
    deltas.append(detok.get_delta(finished=True))
    assert "".join(deltas) == detok.output_text
    return detok, deltas


# ---------------------------------------------------------------- text == decode


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_equals_decode(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = encode(tokenizer, random_text(rng, 60))
    detok = IncrementalDetokenizer(tokenizer, [], SP())
    for chunk in chunks(rng, ids, 3):
        detok.update(chunk)
        assert detok.output_text == tokenizer.decode(detok.token_ids, skip_special_tokens=True)
    assert detok.token_ids == ids


@pytest.mark.parametrize("chunk", [1, 3])
def test_ids_past_the_vocabulary_decode_to_no_text(tokenizer, chunk: int) -> None:
    """A model whose embedding is padded past its tokenizer's vocabulary can sample such an id: it adds no text
    (as decode drops it) and the stream goes on."""
    ids = encode(tokenizer, "héllo wörld")
    past = len(tokenizer) + 7
    stream = ids[:2] + [past] + ids[2:] + [past]
    detok = IncrementalDetokenizer(tokenizer, [], SP())
    for start in range(0, len(stream), chunk):
        detok.update(stream[start: start + chunk])
    assert detok.output_text == tokenizer.decode(ids) == "héllo wörld"
    assert detok.token_ids == stream


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_random_token_ids_equal_decode(tokenizer, seed: int, skip: bool, spaces: bool) -> None:
    """Any ids at all, including special tokens and byte tokens that form invalid UTF-8."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(50)] + [1, 2, 3, rng.randrange(4, 300)]
    params = SP(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    detok, _ = run(tokenizer, chunks(rng, ids, 4), params)
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_multibyte_characters_are_never_split_in_deltas(tokenizer) -> None:
    text = "naïve café 🙂🚀👍🏽 日本語 한국어 €5"
    ids = encode(tokenizer, text)
    # The tokenizer must actually split some characters across tokens for this test to mean anything.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer, [], SP())
    deltas = []
    for token in ids:
        detok.update([token])
        deltas.append(detok.get_delta(finished=False))
        assert "\ufffd" not in deltas[-1]
    deltas.append(detok.get_delta(finished=True))
    assert "".join(deltas) == text == detok.output_text


def test_skip_special_tokens(tokenizer) -> None:
    ids = encode(tokenizer, "Hi") + [tokenizer.eos_token_id, 2] + encode(tokenizer, "user") + [3]
    kept, _ = run(tokenizer, [[t] for t in ids], SP(skip_special_tokens=False))
    assert kept.output_text == "Hi<|end_of_text|><|start_header_id|>user<|end_header_id|>"
    skipped, _ = run(tokenizer, [[t] for t in ids], SP(skip_special_tokens=True))
    assert skipped.output_text == "Hiuser"


# ---------------------------------------------------------------- stop strings


def stop_oracle(tokenizer, ids_chunks: list[list[int]], stops: list[str], include: bool) -> tuple[str, str | None]:
    """Decode the whole prefix after every chunk; the first chunk where a stop appears decides."""
    seen: list[int] = []
    for chunk in ids_chunks:
        seen.extend(chunk)
        text = tokenizer.decode(seen, skip_special_tokens=True)
        hits = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        if hits:
            index, _, stop = min(hits)
            return text[: index + len(stop) if include else index], stop
    return tokenizer.decode(seen, skip_special_tokens=True), None


def test_stop_string_split_across_tokens(tokenizer) -> None:
    ids = encode(tokenizer, "The answer is 42. ###END### and then more text")
    stop = "###END###"
    assert not any(stop in tokenizer.decode([t]) for t in ids)
    detok, deltas = run(tokenizer, [[t] for t in ids], SP(stop=[stop]))
    assert detok.stop_reason == stop
    assert detok.output_text == "The answer is 42. "
    assert all("#" not in d for d in deltas)


def test_include_stop_str_in_output(tokenizer) -> None:
    ids = encode(tokenizer, "alpha beta gamma delta")
    detok, _ = run(tokenizer, [[t] for t in ids], SP(stop=["gam", "zzz"], include_stop_str_in_output=True))
    assert detok.stop_reason == "gam"
    assert detok.output_text == "alpha beta gam"


def test_stop_string_with_multibyte_characters(tokenizer) -> None:
    ids = encode(tokenizer, "x 日本語 🙂 y")
    detok, deltas = run(tokenizer, [[t] for t in ids], SP(stop=["本語 🙂"]))
    assert detok.output_text == "x 日"
    assert "".join(deltas) == "x 日"


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_random(tokenizer, seed: int, include: bool) -> None:
    rng = random.Random(100 + seed)
    text = random_text(rng, 80)
    start = rng.randrange(10, 70)
    stops = [text[start : start + rng.randint(1, 6)], text[start + 3 : start + 5] or "q", "never-there"]
    stops = [s for s in stops if s]
    ids = encode(tokenizer, text)
    ids_chunks = chunks(rng, ids, 3)
    detok, deltas = run(tokenizer, ids_chunks, SP(stop=stops, include_stop_str_in_output=include))
    expected_text, expected_stop = stop_oracle(tokenizer, ids_chunks, stops, include)
    assert detok.stop_reason == expected_stop
    assert detok.output_text == expected_text
    # Everything streamed before the end is a prefix of the final text: no piece of a stop string leaked.
    streamed = ""
    for delta in deltas[:-1]:
        streamed += delta
        assert expected_text.startswith(streamed)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_deep_in_a_long_output(tokenizer, seed: int, include: bool) -> None:
    """Deltas and the stop search read only the text's end: a stop string thousands of characters in, after a
    near miss, ends the text where a search of the whole text does."""
    rng = random.Random(300 + seed)
    text = random_text(rng, 3000)
    start = rng.randrange(2500, 2900)
    stop = text[start : start + 4]
    near_miss = stop[:3] + "#"  # never in the text: CHARS has no '#'
    ids = encode(tokenizer, text)
    ids_chunks = chunks(rng, ids, 3)
    detok, deltas = run(tokenizer, ids_chunks, SP(stop=[near_miss, stop], include_stop_str_in_output=include))
    expected_text, expected_stop = stop_oracle(tokenizer, ids_chunks, [near_miss, stop], include)
    assert detok.stop_reason == expected_stop == stop
    assert detok.output_text == expected_text
    assert "".join(deltas) == expected_text


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("window", ["library", "python"])
def test_stop_strings_after_characters_split_across_steps(tokenizer, seed: int, window: str) -> None:
    """Steps of several tokens that end inside a multi-byte character (its text pending, held back) and stop
    strings of one or two characters: the search resumes where the last one stopped, inside the pending text too.
    In both windows (the Python one where special tokens are literal boundaries)."""
    literal = {"skip_special_tokens": False, "spaces_between_special_tokens": False} if window == "python" else {}
    rng = random.Random(500 + seed)
    text = "".join(rng.choice(["🙂", "🚀", "👍🏽", "日", "é", "a", "b", " "]) for _ in range(40))
    stops = [rng.choice(["a", "b", "é", "a🙂", " b", "日a"]) for _ in range(2)]
    ids = encode(tokenizer, text)
    for include in (False, True):
        ids_chunks = chunks(rng, ids, 7)
        detok, _ = run(tokenizer, ids_chunks, SP(stop=stops, include_stop_str_in_output=include, **literal))
        expected_text, expected_stop = stop_oracle(tokenizer, ids_chunks, stops, include)
        assert (detok.stop_reason, detok.output_text) == (expected_stop, expected_text)


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    """As EOS does (vLLM's rule): a stop string ending in the text of the first min_tokens tokens does not count,
    one ending after it does, however the tokens arrive."""
    ids = encode(tokenizer, "a.b.c.d.e.f.g.h")
    assert len(ids) == 15  # a token per character
    detok, _ = run(tokenizer, [[t] for t in ids], SP(stop=["."]))
    assert detok.output_text == "a"
    for ids_chunks in ([[t] for t in ids], [ids[:4], ids[4:]], [ids[:5], ids[5:]]):
        detok, _ = run(tokenizer, ids_chunks, SP(stop=["."], min_tokens=5))
        assert (detok.stop_reason, detok.output_text) == (".", "a.b.c")
    detok, _ = run(tokenizer, [[t] for t in ids], SP(stop=["."], min_tokens=15, max_tokens=15))
    assert detok.stop_reason is None and detok.output_text == "a.b.c.d.e.f.g.h"


def test_holds_back_possible_stop_prefix(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SP(stop=["STOP"]))
    detok.update(encode(tokenizer, "abc ST"))
    assert detok.get_delta(finished=False) == "abc"
    assert detok.update(encode(tokenizer, "UFF")) is None
    assert detok.get_delta(finished=False) == " ST"  # "abc STUFF" less the last 3 characters
    assert detok.get_delta(finished=True) == "UFF"


def test_update_after_stop_is_an_error(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SP(stop=["b"]))
    assert detok.update(encode(tokenizer, "abc")) == "b"
    with pytest.raises(RuntimeError):
        detok.update([5])


def test_prompt_context_keeps_the_first_leading_space_of_metaspace_tokenizers():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert tokenizer.decode([2, 3]) == "world again"  # the decoder drops a text's leading space
    detokenizer = IncrementalDetokenizer(tokenizer, [1], SP())
    detokenizer.update([2])
    detokenizer.update([3])
    assert detokenizer.output_text == " world again"


def test_shared_lookups_equal_private_ones(tokenizer) -> None:
    """Detokenizers sharing one TokenizerLookups (as the engine's do) give the texts that private ones give."""
    lookups = TokenizerLookups(tokenizer)
    assert type(lookups.tokens_to_string.__self__) is type(tokenizer.backend_tokenizer.decoder)  # the fast path
    rng = random.Random(7)
    for _ in range(20):
        ids = encode(tokenizer, random_text(rng, 40))
        params = SP(skip_special_tokens=rng.random() < 0.5)
        shared = IncrementalDetokenizer(tokenizer, [0, 5, 6], params, lookups)
        private = IncrementalDetokenizer(tokenizer, [0, 5, 6], params)
        for chunk in chunks(rng, ids, 3):
            shared.update(chunk)
            private.update(chunk)
            assert shared.get_delta(finished=False) == private.get_delta(finished=False)
        assert shared.output_text == private.output_text == tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(8))
def test_the_tokenizers_librarys_window_gives_the_pythons_texts_and_deltas(tokenizer, seed: int) -> None:
    """A fast tokenizer's window runs in `tokenizers` (DecodeStream); each step's text and delta equal the window
    run in Python (and, through the other tests, the full decode), split characters and specials included."""
    rng = random.Random(seed)
    python_window = TokenizerLookups(tokenizer)
    python_window.decode_stream = None
    ids = encode(tokenizer, random_text(rng, 50)) + [rng.randrange(len(tokenizer)) for _ in range(30)]
    ids.insert(rng.randrange(len(ids)), len(tokenizer) + 3)  # past the vocabulary
    params = SP(skip_special_tokens=rng.random() < 0.5, stop=["é"] if seed % 2 else [])
    stream = IncrementalDetokenizer(tokenizer, [0, 5, 6], params, TokenizerLookups(tokenizer))
    window = IncrementalDetokenizer(tokenizer, [0, 5, 6], params, python_window)
    assert stream._stream is not None and window._stream is None
    for chunk in chunks(rng, ids, 3):
        stops = stream.update(chunk), window.update(chunk)
        assert stops[0] == stops[1]
        finished = stops[0] is not None
        assert stream.output_text == window.output_text
        assert stream.get_delta(finished) == window.get_delta(finished)
        if finished:
            break
    assert stream.get_delta(True) == window.get_delta(True)


def test_a_token_the_library_refuses_continues_in_the_python_window(tokenizer) -> None:
    """Should `DecodeStream` raise on a token, the sequence goes on in the Python window from the stream's state:
    the same texts and deltas as a window that ran in Python throughout."""
    rng = random.Random(3)
    python_window = TokenizerLookups(tokenizer)
    python_window.decode_stream = None
    ids = encode(tokenizer, random_text(rng, 60))
    stream = IncrementalDetokenizer(tokenizer, [0, 5, 6], SP(), TokenizerLookups(tokenizer))
    window = IncrementalDetokenizer(tokenizer, [0, 5, 6], SP(), python_window)
    step, refused = stream._stream_step, []

    def refusing(token_id: int) -> str | None:
        if stream._unread_ids and not refused:  # refused inside a split character: the mirrored ids carry over
            refused.append(token_id)
            raise Exception("Invalid prefix encountered while decoding stream")  # noqa: TRY002 - the library's type
        return step(token_id)

    stream._stream_step = refusing
    for chunk in chunks(rng, ids, 3):
        stream.update(chunk)
        window.update(chunk)
        assert stream.output_text == window.output_text
        assert stream.get_delta(False) == window.get_delta(False)
    assert stream._stream is None and refused
    assert stream.get_delta(True) == window.get_delta(True)
    assert stream.output_text == tokenizer.decode(ids)


def test_a_vocabulary_with_a_gap_in_its_ids_keeps_the_tokens_above_it(tmp_path) -> None:
    """A BPE vocabulary may skip an id: its largest ids then lie at or past its size, and are still tokens whose
    text the library's window gives (as the Python window and the full decode do)."""
    import json

    write_tokenizer(str(tmp_path))
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    gap = next(token for token, i in vocab.items() if i == 500)
    del vocab[gap]
    spec["model"]["merges"] = [m for m in spec["model"]["merges"]
                               if gap not in (m if isinstance(m, list) else m.split(" "))
                               and gap != "".join(m if isinstance(m, list) else m.split(" "))]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    backend = tok.backend_tokenizer
    top = max(backend.get_vocab(with_added_tokens=True).values())
    assert top >= backend.get_vocab_size(with_added_tokens=True) and tok.decode([top])
    ids = encode(tok, "hello world") + [top, 500] + encode(tok, " again")
    python_window = TokenizerLookups(tok)
    python_window.decode_stream = None
    stream = IncrementalDetokenizer(tok, [], SP(), TokenizerLookups(tok))
    window = IncrementalDetokenizer(tok, [], SP(), python_window)
    assert stream._stream is not None
    for token in ids:
        stream.update([token])
        window.update([token])
        assert stream.output_text == window.output_text
        assert stream.get_delta(False) == window.get_delta(False)
    assert stream.output_text == tok.decode(ids)


def test_sentencepiece_byte_fallback_keeps_the_python_window() -> None:
    """A byte-fallback decoder (SentencePiece's, with its space stripping) decodes invalid bytes otherwise than
    `DecodeStream` would: its sequences keep the Python window, and valid text equals the full decode."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "▁the", "▁cat", "at", "é"]
    backend = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    text = "the cat é 日本 🙂 cat"
    ids = encode(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer, [], SP(), TokenizerLookups(tokenizer))
    assert detokenizer._stream is None
    deltas = []
    for token in ids:
        detokenizer.update([token])
        deltas.append(detokenizer.get_delta(False))
    deltas.append(detokenizer.get_delta(True))
    assert "".join(deltas) == detokenizer.output_text == tokenizer.decode(ids) == text
    # A logprob's bytes: the pieces with their spaces, the byte-fallback tokens' bytes (the prepended word start too).
    lookups = TokenizerLookups(tokenizer)
    assert any(_byte_fallback(t) is not None for t in tokenizer.convert_ids_to_tokens(ids))
    assert b"".join(lookups.token_bytes(t) for t in ids) == f" {text}".encode()


def test_token_bytes_rebuild_characters_split_across_byte_level_tokens(tokenizer) -> None:
    text = 'x = "\u00e9\u00e8\u4e2d\U0001f642" and  tabs\t\n'
    ids = encode(tokenizer, text)
    lookups = TokenizerLookups.of(tokenizer)
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids)  # some tokens hold part of a character
    assert b"".join(lookups.token_bytes(t) for t in ids) == text.encode()
    eos = tokenizer.eos_token_id
    assert lookups.token_bytes(eos) == tokenizer.decode([eos]).encode()  # a special token: its text


def test_lookups_are_shared_per_tokenizer(tokenizer) -> None:
    assert TokenizerLookups.of(tokenizer) is TokenizerLookups.of(tokenizer)

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]
        all_special_ids: list[int] = []

        def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
            return [f"<{i}>" for i in ids]

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return "".join(tokens)

    plain = Unhashable()
    lookups = TokenizerLookups.of(plain)
    assert lookups is not TokenizerLookups.of(plain)
    assert lookups.ids_to_tokens([3, 4, 3]) == ["<3>", "<4>", "<3>"]
    assert lookups.decode_tokens(["<3>"]) == "<3>"
    detok = IncrementalDetokenizer(plain, [1], SP(), lookups)
    detok.update([2, 3])
    assert detok.output_text == "<2><3>"


def test_shared_lookups_do_not_keep_their_tokenizer_alive(tmp_path) -> None:
    write_tokenizer(str(tmp_path))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    TokenizerLookups.of(tok).ids_to_tokens([5, 6])
    ref = weakref.ref(tok)
    del tok
    gc.collect()
    assert ref() is None
