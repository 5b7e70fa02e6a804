"""The chat fine-tune of kestrel-tiny: QA pairs only from the train split, loss only on answer tokens, and a
written directory that kestrel loads and chats with.

Fine-tunes the bundled model when `kestrel/models/kestrel-tiny/model.safetensors` exists (otherwise a small
model trained here first) for a few CPU steps on a few dozen train files.
"""

from __future__ import annotations

import ast
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_tiny import one_thread  # noqa: F401  (a fixture, shared)

from kestrel import LLM, SamplingParams
from kestrel.entrypoints.chat import apply_chat_template
from kestrel.loader.tokenizer import load_tokenizer
from kestrel.tiny import BUNDLED_MODEL_DIR, corpus
from training.tiny import finetune as ft
from training.tiny import qa
from training.tiny.model import TinyConfig
from training.tiny.train import MAX_SAFETENSORS_BYTES, TrainOptions, split_files, train

TRAIN_FILES = 40


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    request.getfixturevalue("one_thread")
    if (BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        return BUNDLED_MODEL_DIR
    out = tmp_path_factory.mktemp("tiny-base")
    arch = TinyConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position=128)
    train(TrainOptions(out=out, steps=20, device="cpu", model=arch, max_train_files=TRAIN_FILES, batch_size=8,
                       lr=1e-2, warmup_steps=5, dropout=0.0, eval_every=10, val_tokens=2048, plot=False,
                       quiet=True))
    return out


@pytest.fixture(scope="module")
def tokenizer(base):
    return load_tokenizer(str(base))


@pytest.fixture(scope="module")
def short_eval_file() -> list[corpus.SourceFile]:
    files = [f for f in corpus.eval_files() if 1500 <= f.path.stat().st_size <= 4000]
    assert files, "the stdlib has no short held-out file"
    return files[:1]


@pytest.fixture(scope="module")
def finetuned(base, short_eval_file, tmp_path_factory: pytest.TempPathFactory) -> ft.FinetuneResult:
    out = tmp_path_factory.mktemp("tiny-chat")
    opts = ft.FinetuneOptions(out=out, base=base, steps=4, device="cpu", batch_size=4, code_batch_size=1,
                              code_context=64, warmup_steps=1, eval_every=2, log_every=1, val_tokens=512,
                              max_val_pairs=8, recall_pairs=8, max_train_files=TRAIN_FILES, heldout_files=1,
                              questions=("What does `os.path.join` do?",), sample_tokens=4, quiet=True)
    with pytest.MonkeyPatch.context() as mp:
        # Held-out scoring on one short file (the split itself is untouched: is_eval_path still decides).
        mp.setattr(ft.corpus, "eval_files", lambda root=None: list(short_eval_file))
        return ft.finetune(opts)


def test_module_names_skip_private_tests_and_scripts() -> None:
    assert qa.module_name("json/decoder.py") == "json.decoder"
    assert qa.module_name("json/__init__.py") == "json"
    assert qa.module_name("os.py") == "os"
    for rel in ("_pyio.py", "test/test_os.py", "json/__main__.py", "unittest/test/test_case.py",
                "idlelib/idle_test/test_run.py", "encodings/_private.py", "lib2to3/tests/data/foo.py"):
        assert qa.module_name(rel) is None, rel


def test_definitions_signatures_and_answers() -> None:
    source = textwrap.dedent('''
        __all__ = ["Point", "scale"]

        def scale(point, factor=2.0, *, clamp: bool = False) -> "Point":
            """Multiply a point by a factor.

            Second paragraph, not in the answer.
            """

        def unlisted():
            """Not in __all__, so no question."""

        class Point:
            """A point in the plane."""

            def __init__(self, x, y=0):
                pass

            def moved(self, dx, dy):
                """Return a copy moved by (dx, dy)."""

            @staticmethod
            def origin(dims=2):
                """The origin of the plane."""

            @property
            def norm(self):
                """Euclidean norm."""

            def _hidden(self):
                """Private."""
    ''')
    found = {d.name: d for d in qa.definitions(ast.parse(source), "geo", "geo.py")}
    assert list(found) == ["geo.scale", "geo.Point", "geo.Point.moved", "geo.Point.origin"]
    assert found["geo.scale"].signature == "geo.scale(point, factor=2.0, *, clamp: bool=False) -> 'Point'"
    assert found["geo.Point"].signature == "geo.Point(x, y=0)"
    assert found["geo.Point.moved"].signature == "geo.Point.moved(dx, dy)"
    assert found["geo.Point.origin"].signature == "geo.Point.origin(dims=2)"
    pairs = qa.pairs_for(found["geo.scale"])
    assert [p.question for p in pairs] == ["What does `geo.scale` do?", "How do I use `geo.scale`?",
                                           "What is the signature of `geo.scale`?"]
    assert pairs[0].answer == "geo.scale(point, factor=2.0, *, clamp: bool=False) -> 'Point'\n\n" \
                              "Multiply a point by a factor."
    text = "First sentence here. " + "word " * 200
    assert qa.first_paragraph(text, max_chars=50) == "First sentence here."  # cut at a sentence end
    cut = qa.first_paragraph(text, max_chars=100)  # no sentence end late enough: cut at a word, marked
    assert len(cut) <= 100 and cut.startswith("First sentence here. word") and cut.endswith("word ...")


def test_pairs_come_only_from_train_split_modules() -> None:
    pairs = qa.build_pairs()
    assert len(pairs) > 1000
    sources = {p.source for p in pairs}
    assert not any(corpus.is_eval_path(s) for s in sources)
    assert all(qa.module_name(s) is not None for s in sources)
    train_set = {f.rel for f in corpus.train_files()}
    assert sources <= train_set
    assert len({(p.question, p.answer) for p in pairs}) == len(pairs)
    some = corpus.select_evenly(corpus.train_files(), 100)
    assert qa.build_pairs(some) == qa.build_pairs(list(reversed(some)))  # deterministic, whatever the order
    # The demo's question is there (os.path is posixpath on POSIX), answered with signature + docstring.
    join = next(p for p in pairs if p.question == "What does `os.path.join` do?")
    assert join.source == "posixpath.py" and join.answer.startswith("os.path.join(a, *p)\n\nJoin two or more")
    # No docstring of a held-out file is trained on, even one copied into a train-split file.
    held_out_docs = qa.eval_docstrings()
    assert held_out_docs and not any(p.answer.split("\n\n", 1)[1] in held_out_docs for p in pairs)
    with pytest.raises(ValueError, match="train split only"):
        qa.build_pairs(corpus.eval_files()[:1])


def test_loss_masks_everything_but_the_answer(base, tokenizer) -> None:
    pair = qa.QAPair("What does `os.path.join` do?", "os.path.join(a, *p)\n\nJoin two or more pathname components.",
                     "os.path.join", "function", "posixpath.py")
    example = ft.encode_pair(tokenizer, pair, tokenizer.eos_token_id, context=512)
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": pair.question}])
    assert example.ids[: example.prompt_len] == prompt  # exactly what kestrel feeds at chat time
    inputs, targets = example.tensors()
    assert inputs == example.ids[:-1] and len(targets) == len(inputs)
    learned = [t for t in targets if t != ft.IGNORE]
    answer_ids = tokenizer.encode(pair.answer, add_special_tokens=False)
    assert learned == answer_ids + [tokenizer.eos_token_id]
    assert all(t == ft.IGNORE for t in targets[: example.prompt_len - 1])
    # The whole conversation is what the chat template writes for it (answer closed by the template's eos).
    rendered = tokenizer.apply_chat_template(pair.messages(), tokenize=False)
    assert tokenizer.decode(example.ids) == rendered
    # masked_loss is the cross-entropy over the answer positions only, padding ignored.
    model = ft.load_tiny(base)
    short = ft.encode_pair(tokenizer, qa.QAPair("Hi?", "Yes.", "x", "function", "x.py"), tokenizer.eos_token_id, 512)
    batch_in, batch_tg = ft.collate([example, short], pad_id=tokenizer.eos_token_id)
    short_learned = len(tokenizer.encode("Yes.", add_special_tokens=False)) + 1
    assert int((batch_tg != ft.IGNORE).sum()) == len(learned) + short_learned
    with torch.no_grad():
        logits = model(batch_in)
        reference = F.cross_entropy(logits.view(-1, logits.shape[-1]), batch_tg.view(-1), ignore_index=ft.IGNORE)
        assert float(ft.masked_loss(model, batch_in, batch_tg)) == pytest.approx(float(reference), rel=1e-5)
        alone = F.cross_entropy(model(batch_in[1:, : len(short.ids) - 1])[0], batch_tg[1, : len(short.ids) - 1],
                                ignore_index=ft.IGNORE, reduction="sum")
        padded = F.cross_entropy(logits[1], batch_tg[1], ignore_index=ft.IGNORE, reduction="sum")
        assert float(alone) == pytest.approx(float(padded), rel=1e-5)  # right padding changes nothing


def test_sampler_sees_every_example_once_per_epoch() -> None:
    lengths = [5, 9, 3, 7, 7, 1, 4, 8, 2, 6, 5]
    sampler = ft.ExampleSampler(lengths, batch_size=3, seed=0, pool=2)
    for _ in range(2):
        batches = [sampler.take()]
        while sampler.batches:
            batches.append(sampler.take())
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert all(len(b) <= 3 for b in batches)
    assert sampler.epochs == 2
    assert ft.ExampleSampler(lengths, 3, seed=0, pool=2).take() == ft.ExampleSampler(lengths, 3, seed=0, pool=2).take()


def test_finetune_writes_a_loadable_chat_model(finetuned, base) -> None:
    out = finetuned.out
    assert {p.name for p in out.iterdir()} == set(ft.MODEL_FILES) | {ft.LOG_FILE}
    assert finetuned.safetensors_bytes == (out / "model.safetensors").stat().st_size < MAX_SAFETENSORS_BYTES
    for name in ft.TOKENIZER_FILES:
        assert (out / name).read_bytes() == (base / name).read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}

    log = json.loads((out / ft.LOG_FILE).read_text())
    data = log["data"]
    assert data["qa_train_pairs"] > 0 and data["qa_eval_split_sources"] == 0
    assert data["train_files"] <= TRAIN_FILES
    assert log["steps"] == 4 and len(log["train"]) == 4 and [r["step"] for r in log["val"]] == [0, 2, 4]
    # The kept weights are the validated ones with the best recall whose source loss stayed within the drift.
    base_code = log["val"][0]["code"]
    allowed = [r for r in log["val"] if r["code"] <= base_code + log["options"]["max_source_drift"]]
    assert log["best"]["step"] == min(allowed, key=lambda r: (r["recall"], r["step"]))["step"]
    assert all(math.isfinite(r["qa"]) and math.isfinite(r["code"]) for r in log["train"])
    for key in ("heldout_before", "heldout_after"):
        assert log[key]["files"] == 1 and log[key]["perplexity"] > 1
    assert len(log["samples_before"]) == len(log["samples_after"]) == 1

    llm = LLM(str(out), max_model_len=128, kv_cache_blocks=16, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reply = llm.chat([{"role": "user", "content": "What does `os.path.join` do?"}], params, use_tqdm=False)
    assert reply[0].prompt_token_ids[0] == llm.tokenizer.bos_token_id
    assert len(reply[0].outputs[0].token_ids) >= 1
    assert reply[0].outputs[0].text.startswith(log["samples_after"][0]["answer"])  # greedy: same start


def test_train_pairs_avoid_the_validation_slice(finetuned) -> None:
    train_set, val_set = split_files(TRAIN_FILES)
    assert not {f.rel for f in train_set} & {f.rel for f in val_set}
    train_sources = {p.source for p in qa.build_pairs(train_set)}
    assert train_sources and not train_sources & {f.rel for f in val_set}
    assert not any(corpus.is_eval_path(f.rel) for f in train_set + val_set)


def test_refuses_to_overwrite_the_base(base) -> None:
    with pytest.raises(ValueError, match="base model's directory"):
        ft.finetune(ft.FinetuneOptions(out=base, base=base, steps=1, device="cpu", quiet=True))
