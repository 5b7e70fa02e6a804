"""The HTTP server's settings: one frozen dataclass, validated once; `kestrel serve`'s server flags are generated
from its fields (names with dashes, help and vLLM's spellings in each field's metadata), so the two cannot drift.

Only the standard library and kestrel's light modules (config, the chat module's tool formats) are imported here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kestrel.config import ConfigError
from kestrel.entrypoints.chat import CONTENT_FORMATS, TOOL_FORMATS
from kestrel.entrypoints.media import (
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_MEDIA_BYTES,
    DEFAULT_MEDIA_FETCH_TIMEOUT_S,
)
from kestrel.entrypoints.reasoning import REASONING_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 18  # ~7 MB of JSON at the usual ~26 bytes an entry
DEFAULT_MAX_RESPONSE_BYTES = 8 << 20  # docs/security.md says why


# `vllm serve` flags kestrel does not have, with what to do instead: the command line refuses each by name with
# this reason (not argparse's bare "unrecognized arguments").
NOT_SUPPORTED_SERVER_FLAGS: dict[str, str] = {
    "response_role": "a chat answer's role is always 'assistant'",
    "middleware": "kestrel loads no ASGI middleware by import path; put a proxy in front of the server",
    "return_tokens_as_token_ids": "send return_tokens_as_token_ids in the requests that want it (a request field)",
    "max_log_len": "requests are logged with their id, size and settings only (--enable-log-requests), never their "
                   "text",
    "disable_fastapi_docs": "the API documentation is behind the API key unless --public-docs",
    "enable_request_id_headers": "a response's id is its request's X-Request-Id header (or request_id field)",
    "enable_force_include_usage": "streams send usage where a request asks with stream_options.include_usage",
    "ssl_ca_certs": "client certificates are not checked; terminate mutual TLS in a proxy",
    "ssl_cert_reqs": "client certificates are not checked; terminate mutual TLS in a proxy",
    "enable_reasoning": "vLLM's older flag: --reasoning-parser NAME turns the reasoning parser on",
    "lora_modules": "LoRA adapters are not supported; merge the adapter into the weights",
    "prompt_adapters": "prompt adapters are not supported",
    "api_server_count": "one API server process serves; --engine-core-process runs the engine core in a process of "
                        "its own",
    "disable_frontend_multiprocessing": "--no-engine-core-process keeps the engine core in the server's process",
    "enable_log_outputs": "requests are logged with their id, size and settings only (--enable-log-requests), never "
                          "their text",
    "uds": "kestrel serves on TCP (--host, --port); put a proxy in front for a Unix socket",
}


def chat_template_text(chat_template: str | None) -> str | None:
    """A --chat-template as template text: a file's contents, or the value itself when no such file."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template) as f:
            return f.read()
    if "{" not in chat_template:
        raise ConfigError(f"invalid chat_template={chat_template!r}: no such file, and not a Jinja template")
    return chat_template


def _opt(default: Any, help_text: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help_text, **extra})



def check_log_requests(enable_log_requests: bool, disable_log_requests: bool) -> None:
    """vLLM's two request-logging flags (the server's and AsyncLLM's): both set contradict each other."""
    if enable_log_requests and disable_log_requests:
        raise ConfigError("enable_log_requests and disable_log_requests contradict each other; give one")

@dataclass(frozen=True)
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to bind (0.0.0.0 for every interface)")
    port: int = _opt(8000, "port to listen on")
    api_key: tuple[str, ...] = _opt((), "one or more keys clients send as 'Authorization: Bearer KEY' on every "
                                        "route but /health, /ping, /version and the playground (/metrics and the "
                                        "API docs too with --public-metrics / --public-docs) (default: the "
                                        "KESTREL_API_KEY environment variable, else vLLM's VLLM_API_KEY; none: open)")
    served_model_name: tuple[str, ...] = _opt((), "the model's names for clients: all are accepted and listed by "
                                                  "/v1/models; the first labels the metrics and answers requests that "
                                                  "name no model (default: the model as given)")
    max_queued_requests: int = _opt(1024, "waiting sequences beyond which new requests get 429 with Retry-After")
    request_timeout: float | None = _opt(None, "abort requests running longer (s)")
    max_request_bytes: int = _opt(4 << 20, "largest request body (413 beyond)")
    max_logprob_entries: int = _opt(DEFAULT_MAX_LOGPROB_ENTRIES,
                                    "most logprob entries one response may carry, n x tokens x (logprobs + 1); "
                                    "400 beyond")
    max_response_bytes: int = _opt(DEFAULT_MAX_RESPONSE_BYTES,
                                   "most bytes one response may produce (all choices, logprobs included): refused "
                                   "with 400 before any work where the size can be bounded, ended with an error "
                                   "once streamed output passes it")
    max_streaming_tokens: int = _opt(1 << 20, "with --streaming-window: most output tokens one request may ask "
                                               "for (max_tokens may pass max_model_len up to this); 400 beyond")
    max_stop_sequences: int = _opt(64, "most stop strings one request may give, and most stop_token_ids (counted "
                                        "apart); 400 beyond")
    max_bad_words: int = _opt(128, "most bad_words one request may give; 400 beyond")
    tokenizer_workers: int | None = _opt(None, "processes that tokenize prompts and render chat templates off the "
                                               "event loop (default: half the CPU cores, 2 to 4; 0: a thread)")
    tokenize_timeout: float = _opt(30.0, "a request whose prompt tokenization takes longer gets 400 and its "
                                         "worker is replaced (s)")
    max_tokenize_bytes: int = _opt(2 << 20, "largest prompt text /tokenize accepts (UTF-8 bytes; 400 beyond)")
    grammar_compile_timeout: float = _opt(5.0, "a structured-outputs grammar that takes longer to compile gets "
                                               "400 and its compile worker is replaced (s)")
    grammar_compile_workers: int = _opt(1, "processes that compile structured-outputs grammars, off the event "
                                           "loop and the engine (0: a thread of the serving process)")
    max_grammar_bytes: int = _opt(64 << 10, "largest structured-outputs grammar (JSON schema, regex, EBNF or "
                                            "choice list) in bytes; 400 beyond, before compiling")
    max_grammar_choices: int = _opt(4096, "most options of one JSON-schema enum, anyOf / oneOf / allOf, choice list "
                                          "or set of forced tool calls; 400 beyond, before compiling")
    max_schema_properties: int = _opt(1024, "most properties a JSON schema may declare, all objects together; "
                                            "400 beyond, before compiling")
    grammar_cache_bytes: int = _opt(256 << 20, "memory the compiled grammars kept for reuse may hold (least "
                                               "recently used dropped first)")
    grammar_cache_entries: int = _opt(512, "most compiled grammars kept for reuse")
    chat_template: str | None = _opt(None, "a chat template (Jinja) file, or the template itself, instead of the "
                                           "tokenizer's")
    chat_template_content_format: str = _opt("auto", "how a message's content reaches the chat template: "
                                                     "'string', 'openai' (a list of parts), or 'auto' (parts where "
                                                     "the template loops over a message's content, or the model "
                                                     "takes images)", choices=CONTENT_FORMATS)
    trust_request_chat_template: bool = _opt(False, "accept a chat_template in chat requests (rendered in a "
                                                    "sandbox); off: such requests are refused")
    tool_call_parser: str | None = _opt(None, "how the model writes tool calls (default: detected from the chat "
                                              "template)", choices=TOOL_FORMATS)
    reasoning_parser: str | None = _opt(None, "how a reasoning model writes its thinking, which chat answers then "
                                              "carry as `reasoning` apart from the content (off: all content)",
                                        choices=REASONING_PARSERS)
    exclude_tools_when_tool_choice_none: bool = _opt(False, "leave a request's tools out of its prompt when its "
                                                            "tool_choice is 'none' (by default the template still "
                                                            "renders them, as in vLLM)")
    enable_auto_tool_choice: bool = _opt(True, "let the model decide whether to call a tool (tool_choice 'auto'); "
                                               "off: such requests are refused")
    enable_prompt_tokens_details: bool = _opt(False, "report usage.prompt_tokens_details.cached_tokens, the prompt "
                                                     "tokens the prefix cache served (vLLM's flag; off: null)")
    special_tokens_in_content: bool = _opt(False, "let special-token text in chat messages become control tokens "
                                                  "(vLLM's behaviour; off: it is tokenized as plain text)")
    enable_response_store: bool = _opt(False, "keep /v1/responses answers in memory so that `previous_response_id` "
                                              "can continue them and GET / DELETE /v1/responses/{id} can read and "
                                              "delete them (store true, OpenAI's default, then applies); off: "
                                              "`store: true` and `previous_response_id` are refused")
    response_store_max_entries: int = _opt(1024, "most responses the response store keeps; the least recently "
                                                 "used is dropped first")
    # The CORS lists take vLLM's form, one JSON list ('["https://a.example", "https://b.example"]'), or one value;
    # the flag may be repeated (json_list: the command line's parsing).
    allowed_origins: tuple[str, ...] = _opt((), "origins allowed to call the API from a browser (CORS; a JSON list "
                                                "or one origin, '*' for any; default: no CORS headers)",
                                            json_list=True)
    allowed_methods: tuple[str, ...] = _opt(("*",), "CORS: allowed methods (a JSON list or one method)",
                                            json_list=True)
    allowed_headers: tuple[str, ...] = _opt(("*",), "CORS: allowed request headers (a JSON list or one header)",
                                            json_list=True)
    allow_credentials: bool = _opt(False, "CORS: allow credentials")
    root_path: str | None = _opt(None, "the path prefix a proxy serves the API under")
    ssl_keyfile: str | None = _opt(None, "TLS private key file (with --ssl-certfile)")
    ssl_certfile: str | None = _opt(None, "TLS certificate file (with --ssl-keyfile)")
    public_docs: bool = _opt(False, "serve /openapi.json, /docs and /redoc without the API key (default: behind it)")
    public_metrics: bool = _opt(False, "serve /metrics without the API key (vLLM's behaviour; default: behind it)")
    header_read_timeout: float = _opt(15.0, "close a connection whose request headers take longer (s)")
    keep_alive_timeout: float = _opt(20.0, "close a keep-alive connection idle for longer (s); keep it above the "
                                           "clients' idle expiry (httpx and the OpenAI SDKs: 5 s, aiohttp: 15 s) "
                                           "and a proxy's idle timeout, or a request sent as the server closes "
                                           "the connection is reset unanswered")
    body_read_timeout: float = _opt(60.0, "answer 408 when a request body takes longer to arrive (s)")
    shutdown_timeout: float = _opt(30.0, "on SIGTERM, how long running requests may still finish before they are "
                                         "ended with a 503 / an error event (s)")
    media_fetch_timeout: float = _opt(DEFAULT_MEDIA_FETCH_TIMEOUT_S, "multimodal models: an image URL "
                                      "(--allowed-media-domains) that takes longer to fetch gets 400 (s)")
    max_media_bytes: int = _opt(DEFAULT_MAX_MEDIA_BYTES, "multimodal models: largest image file (data: URL, local "
                                                         "or fetched) in bytes; 400 beyond")
    max_image_pixels: int = _opt(DEFAULT_MAX_IMAGE_PIXELS, "multimodal models: most pixels (width x height) of one "
                                                           "image, read from its header before decoding; 400 beyond")
    max_audio_seconds: float = _opt(DEFAULT_MAX_AUDIO_SECONDS, "audio-language models: longest audio clip in "
                                    "seconds, read from its header before decoding; 400 beyond")
    engine_core_process: bool | None = _opt(None, "run the engine core (scheduler, model runner, grammar matchers) "
                                                   "in its own process; this one tokenizes, detokenizes and serves "
                                                   "HTTP (default: on for a text model on the CPU without tensor/"
                                                   "pipeline workers, off elsewhere)")
    enable_log_requests: bool = _opt(False, "log each request's id, size and sampling settings")
    disable_log_requests: bool = _opt(False, "vLLM's older flag: requests are not logged (the default here)")
    log_level: str = _opt("info", "kestrel's log level", choices=LOG_LEVELS)
    uvicorn_log_level: str | None = _opt(None, "the HTTP server's own log level (default: --log-level)",
                                         choices=LOG_LEVELS)
    disable_uvicorn_access_log: bool = _opt(False, "leave out the HTTP server's access log line per request")

    def __post_init__(self) -> None:
        check_log_requests(self.enable_log_requests, self.disable_log_requests)
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 1 <= self.port <= 65535:
            raise ConfigError(f"invalid port={self.port!r}: expected a TCP port from 1 to 65535")
        for name in ("max_queued_requests", "max_request_bytes", "max_logprob_entries", "max_response_bytes",
                     "max_streaming_tokens", "max_stop_sequences", "max_bad_words", "max_tokenize_bytes",
                     "grammar_compile_workers",
                     "max_grammar_bytes", "max_grammar_choices", "max_schema_properties", "grammar_cache_bytes",
                     "grammar_cache_entries", "response_store_max_entries", "max_media_bytes", "max_image_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"invalid {name}={value!r}: expected a non-negative integer")
        for name in ("header_read_timeout", "keep_alive_timeout", "body_read_timeout", "shutdown_timeout",
                     "request_timeout", "tokenize_timeout", "grammar_compile_timeout", "media_fetch_timeout",
                     "max_audio_seconds"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"invalid {name}={value!r}: expected a number of seconds > 0")
        if self.tokenizer_workers is not None and self.tokenizer_workers < 0:
            raise ConfigError(f"invalid tokenizer_workers={self.tokenizer_workers}: expected 0 (a thread) or more")
        for name in ("max_logprob_entries", "max_response_bytes", "max_streaming_tokens", "max_tokenize_bytes",
                     "max_grammar_bytes", "max_grammar_choices", "max_schema_properties", "grammar_cache_entries",
                     "response_store_max_entries", "max_media_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"invalid {name}={getattr(self, name)}: expected >= 1")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ConfigError("invalid TLS settings: give both ssl_keyfile and ssl_certfile, or neither")
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"invalid {name}={path!r}: no such file")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ConfigError(f"invalid chat_template_content_format={self.chat_template_content_format!r}: "
                              f"expected one of {list(CONTENT_FORMATS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_FORMATS:
            raise ConfigError(f"invalid tool_call_parser={self.tool_call_parser!r}: expected one of "
                              f"{list(TOOL_FORMATS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"invalid reasoning_parser={self.reasoning_parser!r}: expected one of "
                              f"{list(REASONING_PARSERS)}")
        for name in ("log_level", "uvicorn_log_level"):
            value = getattr(self, name)
            if value is not None and value not in LOG_LEVELS:
                raise ConfigError(f"invalid {name}={value!r}: expected one of {list(LOG_LEVELS)}")

    def chat_template_text(self) -> str | None:
        return chat_template_text(self.chat_template)

    @property
    def tokenizer_processes(self) -> int:
        """tokenizer_workers, its default resolved: half the CPU cores, 2 to 4 (two at least, so that a small
        prompt never waits behind a multi-megabyte one)."""
        if self.tokenizer_workers is not None:
            return self.tokenizer_workers
        return min(4, max(2, (os.cpu_count() or 2) // 2))
