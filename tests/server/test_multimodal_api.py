"""Images through the OpenAI API on a tiny random LLaVA-1.5 (tests/multimodal_checkpoints.py): the openai client's
image_url data URL gets LLM's greedy text; local files only under --allowed-local-media-path; remote URLs only from
--allowed-media-domains (a loopback HTTP server here); every bad image part a 400 naming it; a bad image beside a
good request leaves the good one whole. A LLaVA-NeXT checkpoint serves images of different aspect ratios the same
way, a Qwen2-VL one images of two sizes in one message (M-RoPE positions), and a Gemma 3 one images that attend to
themselves both ways."""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import http.server
import io
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, MODEL, LiveServer
from http_client import HTTP

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError
from kestrel.entrypoints.async_engine import AsyncEngine
from kestrel.entrypoints.server import build_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from multimodal_checkpoints import (  # noqa: E402
    GEMMA3_TOKENS_PER_IMAGE,
    random_image,
    write_gemma3,
    write_llava,
    write_llava_next,
    write_qwen2_vl,
)

MAX_NEW = 6


def png_bytes(seed: int, width: int = 40, height: int = 34) -> bytes:
    buffer = io.BytesIO()
    random_image(seed, width=width, height=height).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return write_llava(tmp_path_factory.mktemp("llava-api"), seed=4)


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png_bytes(21))
    (root / "broken.png").write_bytes(b"\x89PNG not really")
    return root


@pytest.fixture(scope="module")
def image_host(media_root) -> Iterator[str]:
    """A loopback HTTP server over media_root: the 'remote' images."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.log_message = lambda *args: None
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(llava_dir, media_root) -> Iterator[LiveServer]:
    engine = AsyncEngine.from_args(str(llava_dir), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
                                   device="cpu", dtype="float32", limit_mm_per_prompt={"image": 2},
                                   allowed_local_media_path=str(media_root),
                                   allowed_media_domains=("127.0.0.1",)).start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY, max_request_bytes=1 << 20, max_image_pixels=10_000),
                      engine)
    yield live
    live.stop()


def chat(server: LiveServer, messages: list[dict], **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_NEW, "temperature": 0, **extra}
    return HTTP.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)


def offline_text(llava_dir: Path, messages: list[dict], **engine_args) -> str:
    llm = LLM(str(llava_dir), dtype="float32", max_model_len=256, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_openai_client_image_matches_llm_offline(server, llava_dir) -> None:
    messages = user(image_part(data_url(png_bytes(1))))
    reply = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW,
                                                    temperature=0)
    assert reply.choices[0].message.content == offline_text(llava_dir, messages)
    assert reply.usage.prompt_tokens > 16  # the image's 16 placeholder tokens are part of the prompt
    other = server.client().chat.completions.create(model=MODEL, messages=user(image_part(data_url(png_bytes(2)))),
                                                    max_tokens=MAX_NEW, temperature=0)
    assert other.usage.prompt_tokens == reply.usage.prompt_tokens


def test_local_files_and_remote_urls_within_their_allowances(server, llava_dir, media_root, image_host) -> None:
    expected = offline_text(llava_dir, user(image_part(data_url(png_bytes(21)))))
    local = chat(server, user(image_part((media_root / "cat.png").as_uri())))
    assert local.status_code == 200, local.text
    assert local.json()["choices"][0]["message"]["content"] == expected
    remote = chat(server, user(image_part(f"{image_host}/cat.png")))
    assert remote.status_code == 200, remote.text
    assert remote.json()["choices"][0]["message"]["content"] == expected


def assert_400(response: httpx.Response, param: str, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


def test_bad_image_parts_are_400s_naming_the_part(server, media_root, image_host, tmp_path) -> None:
    part = "messages[0].content[0].image_url"
    assert_400(chat(server, user(image_part("data:image/png;base64,AAAA"))), part, "could not be decoded")
    assert_400(chat(server, user(image_part("data:image/png;base64,@@@"))), part, "not valid base64")
    assert_400(chat(server, user(image_part("data:text/plain;base64,AAAA"))), part, "data:image/")
    assert_400(chat(server, user(image_part((media_root / "broken.png").as_uri()))), part, "could not be decoded")
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes(3))
    assert_400(chat(server, user(image_part(outside.as_uri()))), part, "not a file under the allowed")
    assert_400(chat(server, user(image_part("https://example.com/cat.png"))), part, "not among the allowed")
    assert_400(chat(server, user(image_part(f"{image_host}/missing.png"))), part, "could not fetch")
    assert_400(chat(server, user(image_part("ftp://x/cat.png"))), part, "unsupported image URL scheme")
    big = data_url(png_bytes(4, width=400))  # 400 x 34 pixels, over the server's 10,000
    assert_400(chat(server, user(image_part(big))), part, "more than this server's")
    three = [image_part(data_url(png_bytes(k))) for k in range(3)]
    assert_400(chat(server, user(*three)), "messages", "at most 2")
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    response = chat(server, user(audio))
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages[0].content")
    assert_400(chat(server, user(image_part(data_url(png_bytes(1)))), use_beam_search=True, n=2),
               "use_beam_search", "images")


def test_a_bad_image_never_disturbs_a_good_request_beside_it(server) -> None:
    good = user(image_part(data_url(png_bytes(5))))
    alone = chat(server, good).json()["choices"][0]["message"]["content"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, server, user(image_part("data:image/png;base64,AAAA"))) for _ in range(2)]
        futures += [pool.submit(chat, server, good) for _ in range(2)]
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [400, 400, 200, 200]
    assert all(r.json()["choices"][0]["message"]["content"] == alone for r in results[2:])
    assert chat(server, good).status_code == 200  # the engine lives on


def test_remote_fetching_is_off_by_default(llava_dir, image_host) -> None:
    engine = AsyncEngine.from_args(str(llava_dir), max_model_len=256, device="cpu", dtype="float32").start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)
    try:
        assert_400(chat(live, user(image_part(f"{image_host}/cat.png"))), "messages[0].content[0].image_url",
                   "fetching remote images is off")
        assert_400(chat(live, user(image_part("file:///etc/hostname"))), "messages[0].content[0].image_url",
                   "local image files are off")
    finally:
        live.stop()


def test_image_part_to_a_text_only_model_is_refused(openai_server) -> None:
    response = chat(openai_server, user(image_part(data_url(png_bytes(1)))))
    assert_400(response, "messages[0].content[0]", "text only")


def test_multimodal_model_refuses_the_engine_core_process(llava_dir) -> None:
    from kestrel.entrypoints.core_client import CoreClient

    with pytest.raises(ConfigError, match="engine-core-process"):
        CoreClient.from_args(str(llava_dir), max_model_len=256, device="cpu", dtype="float32")


def test_llava_next_images_of_two_aspect_ratios_match_llm_offline(tmp_path) -> None:
    """The prompt's length follows each image's tile grid, as the checkpoint's processor expands it."""
    checkpoint = write_llava_next(tmp_path / "llava-next", seed=6)
    engine = AsyncEngine.from_args(str(checkpoint), max_model_len=256, device="cpu", dtype="float32").start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    try:
        prompt_tokens = set()
        for width, height in ((90, 20), (20, 90)):
            messages = user(image_part(data_url(png_bytes(3, width=width, height=height))))
            reply = live.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW,
                                                          temperature=0)
            (offline,) = llm.chat(messages, params, use_tqdm=False)
            assert reply.choices[0].message.content == offline.outputs[0].text
            assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
            prompt_tokens.add(reply.usage.prompt_tokens)
        assert len(prompt_tokens) == 2
    finally:
        live.stop()


def test_qwen2_vl_two_image_sizes_in_one_message_match_llm_offline(tmp_path) -> None:
    """Each image's placeholder count follows its own grid; the decoder's M-RoPE positions come from them."""
    checkpoint = write_qwen2_vl(tmp_path / "qwen2-vl", seed=7)
    engine = AsyncEngine.from_args(str(checkpoint), max_model_len=256, device="cpu", dtype="float32").start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    try:
        messages = user(image_part(data_url(png_bytes(3, width=60, height=24))),
                        image_part(data_url(png_bytes(4, width=30, height=50))))
        reply = live.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW,
                                                      temperature=0)
        (offline,) = llm.chat(messages, params, use_tqdm=False)
        assert reply.choices[0].message.content == offline.outputs[0].text
        assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
        pad = llm.media.image_token_id
        assert offline.prompt_token_ids.count(pad) == (24 // 8) * (64 // 8) + (32 // 8) * (48 // 8)
    finally:
        live.stop()


def test_gemma3_images_match_llm_offline(tmp_path) -> None:
    """Gemma 3: each image_url data URL becomes the processor's 16 soft tokens between <start_of_image> and
    <end_of_image>, attending to one another both ways; the served text is LLM's."""
    checkpoint = write_gemma3(tmp_path / "gemma3", seed=8)
    engine = AsyncEngine.from_args(str(checkpoint), max_model_len=256, device="cpu", dtype="float32").start()
    live = LiveServer(build_app(engine, MODEL, api_key=API_KEY), engine)
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    try:
        messages = user(image_part(data_url(png_bytes(5))), image_part(data_url(png_bytes(6, width=50))))
        reply = live.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW,
                                                      temperature=0)
        (offline,) = llm.chat(messages, params, use_tqdm=False)
        assert reply.choices[0].message.content == offline.outputs[0].text
        assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
        soft = llm.media.image_embed_token_id
        assert offline.prompt_token_ids.count(soft) == 2 * GEMMA3_TOKENS_PER_IMAGE
    finally:
        live.stop()
