"""Media in prompts: image URLs to images (data: URLs; file:// under --allowed-local-media-path; http(s) from
--allowed-media-domains, with size, time and pixel limits), audio (`input_audio` base64 data, `audio_url`s from the
same places) to mono samples at the feature extractor's rate, and a prompt's media to the engine's media items
through the checkpoint's own transformers processor.

The processor gives the pixel tensors, and its `replace_image_token` says what one `<image>` placeholder of the
prompt becomes (so the expansion is transformers' own); for audio, the processor itself expands one placeholder
for each clip, with its log-mel features. Each expanded placeholder run is the item's range. Every refusal is an
InvalidRequestError naming the request part.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import json
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel.config import DEFAULT_MM_PER_PROMPT, ConfigError, ModelConfig
from kestrel.request import InvalidRequestError, MediaItem

DEFAULT_MEDIA_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_MEDIA_BYTES = 20 << 20
DEFAULT_MAX_IMAGE_PIXELS = 64 << 20  # 8192 x 8192
DEFAULT_MAX_AUDIO_SECONDS = 600.0
AUDIO_FORMATS = ("wav", "mp3", "flac")  # input_audio's `format`s, all decoded by libsndfile (soundfile)


@dataclass(frozen=True)
class MediaLimits:
    """Where images may come from and how big they may be (the server's flags; LLM uses these defaults)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout_s: float = DEFAULT_MEDIA_FETCH_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS


@dataclass(frozen=True, eq=False)
class Audio:
    """A decoded clip: mono float32 samples at `rate` Hz."""

    samples: np.ndarray
    rate: int


def load_image(url: str, param: str, limits: MediaLimits) -> Any:
    """The PIL image an image_url names."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(param, "expected an image URL (data:, file:// or http(s)://)")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url, param, limits, "image"), param, limits)
    if scheme == "file":
        return decode_image(_local_file_bytes(url, param, limits), param, limits)
    if scheme in ("http", "https"):
        return decode_image(_remote_bytes(url, param, limits), param, limits)
    raise InvalidRequestError(param, f"unsupported image URL scheme {scheme or url[:20]!r}: use a data: URL "
                              "(base64 PNG or JPEG), file:// (with --allowed-local-media-path) or http(s):// (with "
                              "--allowed-media-domains)")


def _data_url_bytes(url: str, param: str, limits: MediaLimits, kind: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.lower().endswith(";base64") or not header[5:].lower().startswith(f"{kind}/"):
        raise InvalidRequestError(param, f"a data URL {kind} must be data:{kind}/<type>;base64,<data>")
    return _base64_bytes(payload, param, limits, kind, "the data URL's payload")


def _base64_bytes(payload: str, param: str, limits: MediaLimits, kind: str, what: str) -> bytes:
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise InvalidRequestError(param, f"the {kind} is over {limits.max_bytes:,} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(param, f"{what} is not valid base64") from None


def _local_file_bytes(url: str, param: str, limits: MediaLimits, kind: str = "image") -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise InvalidRequestError(param, f"local {kind} files are off on this server; start it with "
                                  f"--allowed-local-media-path DIR, or send the {kind} as data")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(root)
    if os.path.commonpath([path, root]) != root or not os.path.isfile(path):
        raise InvalidRequestError(param, f"{url!r} is not a file under the allowed local media path")
    if os.path.getsize(path) > limits.max_bytes:
        raise InvalidRequestError(param, f"the {kind} is over {limits.max_bytes:,} bytes")
    with open(path, "rb") as f:
        return f.read()


def _remote_bytes(url: str, param: str, limits: MediaLimits, kind: str = "image") -> bytes:
    domains = limits.allowed_media_domains
    if not domains:
        raise InvalidRequestError(param, f"fetching remote {kind}s is off on this server; send the {kind} as data, "
                                  "or start the server with --allowed-media-domains")
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if host not in domains:
        raise InvalidRequestError(param, f"the {kind}'s domain {host!r} is not among the allowed media domains")
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as response:  # noqa: S310 (scheme checked)
            data = response.read(limits.max_bytes + 1)
    except Exception as e:  # DNS, connection, HTTP status and timeout errors all mean the same to the client
        raise InvalidRequestError(param, f"could not fetch the {kind}: {e}") from None
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(param, f"the {kind} is over {limits.max_bytes:,} bytes")
    return data


def decode_image(data: bytes, param: str, limits: MediaLimits) -> Any:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size  # read from the header, before any pixel is decoded
        if width * height > limits.max_pixels:
            raise InvalidRequestError(param, f"the image has {width}x{height} pixels, more than this server's "
                                      f"{limits.max_pixels:,}")
        image.load()
    except InvalidRequestError:
        raise
    except Exception as e:  # PIL raises many types for a corrupt or unknown file
        raise InvalidRequestError(param, f"the image could not be decoded ({type(e).__name__}: {e}); send a PNG or "
                                  "JPEG") from None
    return image


def load_audio_url(url: str, param: str, limits: MediaLimits) -> Audio:
    """The clip an audio_url names (data:audio/<type>;base64, file:// or http(s)://, as image URLs)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(param, "expected an audio URL (data:, file:// or http(s)://)")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_audio(_data_url_bytes(url, param, limits, "audio"), param, limits)
    if scheme == "file":
        return decode_audio(_local_file_bytes(url, param, limits, "audio"), param, limits)
    if scheme in ("http", "https"):
        return decode_audio(_remote_bytes(url, param, limits, "audio"), param, limits)
    raise InvalidRequestError(param, f"unsupported audio URL scheme {scheme or url[:20]!r}: use a data: URL, "
                              "file:// (with --allowed-local-media-path) or http(s):// (with --allowed-media-domains)")


def load_input_audio(part: Any, param: str, limits: MediaLimits) -> Audio:
    """OpenAI's `input_audio` part body `{"data": base64, "format": "wav" | "mp3" | "flac"}` -> its clip."""
    if not isinstance(part, dict) or not isinstance(part.get("data"), str):
        raise InvalidRequestError(param, "expected {'data': <base64 audio>, 'format': 'wav' | 'mp3' | 'flac'}")
    fmt = part.get("format")
    if fmt not in AUDIO_FORMATS:
        raise InvalidRequestError(f"{param}.format", f"unsupported audio format {fmt!r}: send "
                                  f"{', '.join(AUDIO_FORMATS)}")
    return decode_audio(_base64_bytes(part["data"], f"{param}.data", limits, "audio", "the audio data"),
                        f"{param}.data", limits)


def decode_audio(data: bytes, param: str, limits: MediaLimits) -> Audio:
    """Mono float32 samples (channels averaged) at the file's own rate."""
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            seconds = f.frames / f.samplerate  # from the header, before any sample is decoded
            if seconds > limits.max_audio_seconds:
                raise InvalidRequestError(param, f"the audio is {seconds:.1f} s long, more than this server's "
                                          f"{limits.max_audio_seconds:g} s")
            samples = f.read(dtype="float32", always_2d=True)
            rate = f.samplerate
    except InvalidRequestError:
        raise
    except Exception as e:  # libsndfile's errors for a corrupt or unknown file
        raise InvalidRequestError(param, f"the audio could not be decoded ({type(e).__name__}: {e}); send "
                                  f"{', '.join(AUDIO_FORMATS)}") from None
    if samples.shape[0] == 0:
        raise InvalidRequestError(param, "the audio has no samples")
    return Audio(samples.mean(axis=1), rate)


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling: the spectrum cut (or zero-padded) at the lower rate's Nyquist frequency, so nothing
    above it aliases into the result."""
    if rate == target:
        return samples
    count = max(1, round(samples.shape[0] * target / rate))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    keep = min(spectrum.shape[0], count // 2 + 1)
    out = np.fft.irfft(spectrum[:keep], n=count) * (count / samples.shape[0])
    return out.astype(np.float32)


def audio_content_hash(samples: np.ndarray, processor_kwargs: dict[str, Any]) -> str:
    """What the encoder output depends on: the resampled samples and the feature extractor's settings."""
    digest = hashlib.sha256()
    digest.update(f"audio|{samples.shape[0]}|{sorted(processor_kwargs.items())!r}|".encode())
    digest.update(np.ascontiguousarray(samples, dtype=np.float32).tobytes())
    return digest.hexdigest()


def image_content_hash(image: Any, processor_kwargs: dict[str, Any]) -> str:
    """What the encoder output depends on: the pixels (and mode, size) and the processor's settings."""
    digest = hashlib.sha256()
    digest.update(f"image|{image.mode}|{image.size}|{sorted(processor_kwargs.items())!r}|".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class MediaProcessor:
    """A multimodal checkpoint's transformers processor, and the per-prompt limits."""

    def __init__(self, model_config: ModelConfig, modalities: frozenset[str], tokenizer: Any) -> None:
        if len(modalities) != 1:
            # each modality's items are expanded on their own, so one model takes one of them
            raise ConfigError(f"kestrel serves models of one media modality; this one takes {sorted(modalities)}")
        self.modalities = modalities
        self.tokenizer = tokenizer
        limits = dict(model_config.limit_mm_per_prompt or {})
        for modality, count in limits.items():
            if count and modality not in modalities:
                raise ConfigError(f"invalid limit_mm_per_prompt.{modality}={count}: the model takes "
                                  f"{', '.join(sorted(modalities))}; give 0 or leave it out")
        self.limits = {modality: limits.get(modality, DEFAULT_MM_PER_PROMPT) for modality in modalities}
        # An encoder-decoder model (Whisper) hears one clip a request through cross-attention: its prompt is the
        # decoder's, with no placeholder; its checkpoint has a feature extractor and no processor class.
        self.encoder_decoder = bool(model_config.hf_config.get("is_encoder_decoder"))
        if self.encoder_decoder:
            self._init_encoder_decoder(model_config)
            return
        try:
            self.processor = load_processor(model_config.model)
        except Exception as e:
            raise ConfigError(f"invalid model={model_config.model!r}: the multimodal checkpoint's processor "
                              f"(processor_config.json / preprocessor_config.json) could not be loaded: {e}") from None
        # modality -> (the processor's part for it, its placeholder token id)
        parts = {"image": ("image_processor", "image_token_id"), "audio": ("feature_extractor", "audio_token_id")}
        self.placeholder_ids: dict[str, int] = {}
        subprocessors = []
        for modality in sorted(modalities):
            sub = getattr(self.processor, parts[modality][0], None)
            token_id = getattr(self.processor, parts[modality][1], None)
            if sub is None or token_id is None:
                raise ConfigError(f"invalid model={model_config.model!r}: its processor "
                                  f"({type(self.processor).__name__}) has no {parts[modality][0]} or {modality} token")
            self.placeholder_ids[modality] = token_id
            subprocessors.append(sub)
        self.image_token_id = self.placeholder_ids.get("image")
        # The token whose runs take an image's embeddings: the placeholder itself, or the one token the processor
        # marks as image tokens in what a placeholder expands to (Gemma 3: `<start_of_image>` in the prompt,
        # `<image_soft_token>`s in its expansion).
        marked = [i for i in getattr(self.processor, "image_token_ids", ()) or () if i is not None]
        self.image_embed_token_id = marked[0] if len(marked) == 1 else self.image_token_id
        self.processor_kwargs = dict(model_config.mm_processor_kwargs or {})
        for key in self.processor_kwargs:
            if not any(hasattr(sub, key) for sub in subprocessors):
                raise ConfigError(f"invalid mm_processor_kwargs.{key}: "
                                  f"{' / '.join(type(sub).__name__ for sub in subprocessors)} has no such setting")
        if "audio" in modalities:
            extractor = self.processor.feature_extractor
            self.sampling_rate = int(extractor.sampling_rate)
            # The extractor cuts a clip at its window: a longer one would be heard only in part, so it is refused.
            self.max_audio_samples = int(extractor.n_samples)

    def _init_encoder_decoder(self, model_config: ModelConfig) -> None:
        import transformers

        if self.modalities != frozenset({"audio"}):
            raise ConfigError(f"kestrel's encoder-decoder models take audio; this one takes {sorted(self.modalities)}")
        try:
            self.feature_extractor = transformers.AutoFeatureExtractor.from_pretrained(model_config.model)
        except Exception as e:
            raise ConfigError(f"invalid model={model_config.model!r}: the checkpoint's feature extractor "
                              f"(preprocessor_config.json) could not be loaded: {e}") from None
        self.placeholder_ids = {}
        self.image_token_id = None
        self.processor_kwargs = dict(model_config.mm_processor_kwargs or {})
        for key in self.processor_kwargs:
            if not hasattr(self.feature_extractor, key):
                raise ConfigError(f"invalid mm_processor_kwargs.{key}: {type(self.feature_extractor).__name__} has "
                                  "no such setting")
        self.sampling_rate = int(self.feature_extractor.sampling_rate)
        self.max_audio_samples = int(self.feature_extractor.n_samples)

    def check_count(self, modality: str, count: int, param: str) -> None:
        if modality not in self.modalities:
            raise InvalidRequestError(param, f"this model does not take {modality} input; it takes "
                                      f"{', '.join(sorted(self.modalities))}")
        limit = self.limits[modality]
        if count > limit:
            raise InvalidRequestError(param, f"{count} {modality} items in one prompt; this server takes at most "
                                      f"{limit} (--limit-mm-per-prompt)")

    def expand(self, token_ids: list[int], media: list[Any], param: str) -> tuple[list[int], tuple[MediaItem, ...]]:
        """The prompt's ids with each placeholder replaced by the processor's expansion, and one media item per
        image or clip (`media`: PIL images and `Audio` clips, each modality in its placeholders' order)."""
        images = [item for item in media if not isinstance(item, Audio)]
        clips = [item for item in media if isinstance(item, Audio)]
        if images:
            self.check_count("image", len(images), param)
        if clips:
            self.check_count("audio", len(clips), param)
        if self.encoder_decoder:
            return self._encoder_input(token_ids, images, clips, param)
        if "audio" in self.modalities:
            return self._expand_audio(token_ids, clips, param)
        return self._expand_images(token_ids, images, param)

    def check_clip(self, clip: Audio, param: str, name: str = "the audio") -> np.ndarray:
        """The clip's samples at the feature extractor's rate; a clip longer than the extractor's window is refused
        (the model would hear only its start)."""
        samples = resample(clip.samples, clip.rate, self.sampling_rate)
        if samples.shape[0] > self.max_audio_samples:
            seconds, most = samples.shape[0] / self.sampling_rate, self.max_audio_samples / self.sampling_rate
            raise InvalidRequestError(param, f"{name} is {seconds:.2f} s long; this model hears at most {most:g} s "
                                      "a clip")
        return samples

    def _encoder_input(self, token_ids: list[int], images: list[Any], clips: list[Audio], param: str
                       ) -> tuple[list[int], tuple[MediaItem, ...]]:
        """An encoder-decoder request: the decoder prompt as given and its one clip's log-mel features, the item's
        range spanning the prompt (every prompt block's prefix-cache hash then carries the clip)."""
        if images or len(clips) != 1:
            raise InvalidRequestError(param, f"this model (an encoder-decoder: Whisper) takes exactly one audio clip "
                                      f"a request, got {len(clips)} clip(s) and {len(images)} image(s)")
        if not token_ids:
            raise InvalidRequestError(param, "the decoder prompt is empty; it starts with <|startoftranscript|>")
        samples = self.check_clip(clips[0], param)
        try:
            features = self.feature_extractor(samples, sampling_rate=self.sampling_rate, return_tensors="pt",
                                              **self.processor_kwargs)["input_features"]
        except Exception as e:  # the extractor's own checks
            raise InvalidRequestError(param, f"the feature extractor refused the clip: {e}") from None
        item = MediaItem("audio", audio_content_hash(samples, self.processor_kwargs), ((0, len(token_ids)),),
                         {"input_features": features})
        return list(token_ids), (item,)

    def _expand_audio(self, token_ids: list[int], clips: list[Audio], param: str
                      ) -> tuple[list[int], tuple[MediaItem, ...]]:
        token_id = self.placeholder_ids["audio"]
        placeholders = [i for i, t in enumerate(token_ids) if t == token_id]
        if len(placeholders) != len(clips):
            raise InvalidRequestError(param, f"the prompt has {len(placeholders)} audio placeholder(s) for "
                                      f"{len(clips)} clip(s); put one {self.processor.audio_token} where each clip "
                                      "goes (a chat template does it for audio parts)")
        ids: list[int] = []
        media: list[MediaItem] = []
        previous = 0
        for index, (at, clip) in enumerate(zip(placeholders, clips)):
            samples = self.check_clip(clip, param, f"audio clip {index}")
            try:
                processed = self.processor(text=self.processor.audio_token, audio=[samples],
                                           sampling_rate=self.sampling_rate, add_special_tokens=False,
                                           return_tensors="pt", **self.processor_kwargs)
            except Exception as e:  # the processor's own checks
                raise InvalidRequestError(param, f"the audio processor refused clip {index}: {e}") from None
            ids += token_ids[previous:at]
            expanded = processed["input_ids"][0].tolist()
            ranges = _runs(expanded, token_id, len(ids))
            ids += expanded
            previous = at + 1
            data = {key: value for key, value in processed.items()
                    if key not in ("input_ids", "attention_mask") and hasattr(value, "shape")}
            media.append(MediaItem("audio", audio_content_hash(samples, self.processor_kwargs), ranges, data))
        ids += token_ids[previous:]
        return ids, tuple(media)

    def _expand_images(self, token_ids: list[int], images: list[Any], param: str
                       ) -> tuple[list[int], tuple[MediaItem, ...]]:
        self.check_count("image", len(images), param)
        placeholders = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(placeholders) != len(images):
            raise InvalidRequestError(param, f"the prompt has {len(placeholders)} image placeholder(s) for "
                                      f"{len(images)} image(s); put one {self.processor.image_token} where each "
                                      "image goes (a chat template does it for image_url parts)")
        if not images:
            return token_ids, ()
        try:
            processed = self.processor.image_processor(images, return_tensors="pt", **self.processor_kwargs)
            replacements = [self.processor.replace_image_token(processed, image_idx=i) for i in range(len(images))]
        except Exception as e:  # the processor's own checks (an image it cannot resize, a bad channel count)
            raise InvalidRequestError(param, f"the image processor refused the image(s): {e}") from None
        ids: list[int] = []
        runs_per_image: list[int] = []
        previous = 0
        for at, replacement in zip(placeholders, replacements):
            ids = self._joined(ids, token_ids[previous:at])
            expanded = self.tokenizer.encode(replacement, add_special_tokens=False)
            runs_per_image.append(len(_runs(expanded, self.image_embed_token_id, 0)))
            ids = self._joined(ids, expanded)
            previous = at + 1
        ids = self._joined(ids, token_ids[previous:])
        runs = _runs(ids, self.image_embed_token_id, 0)
        if len(runs) != sum(runs_per_image):
            raise InvalidRequestError(param, "the prompt holds image tokens of its own; put only "
                                      f"{self.processor.image_token} where each image goes")
        media: list[MediaItem] = []
        for index, count in enumerate(runs_per_image):
            ranges, runs = runs[:count], runs[count:]
            data = _item_tensors(processed, index, len(images))
            media.append(MediaItem("image", image_content_hash(images[index], self.processor_kwargs), ranges, data))
        return ids, tuple(media)

    def _joined(self, ids: list[int], more: list[int]) -> list[int]:
        """`ids` then `more`, tokenized as the processor tokenizes the expanded text: where text meets text at the
        seam (Gemma 3's expansion starts and ends with "\n\n"), the text between the special tokens on either side
        is encoded again as one piece ("\n" + "\n\n" may be one token, or split otherwise)."""
        special = self._special_ids
        if not ids or not more or ids[-1] in special or more[0] in special:
            return ids + more
        start = len(ids)
        while start > 0 and ids[start - 1] not in special:
            start -= 1
        end = 0
        while end < len(more) and more[end] not in special:
            end += 1
        text = self.tokenizer.decode(ids[start:] + more[:end], clean_up_tokenization_spaces=False)
        return ids[:start] + self.tokenizer.encode(text, add_special_tokens=False) + more[end:]

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.all_special_ids) | frozenset(
            i for i, token in self.tokenizer.added_tokens_decoder.items() if token.special)


def load_processor(model: str) -> Any:
    """The checkpoint's transformers processor. A processor that also takes video (Qwen2-VL's) needs torchvision
    for its video processor; without it, the processor is built with none, as kestrel takes no video."""
    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(model)
    except ImportError:
        processor_cls = getattr(transformers, _preprocessor_field(model, "processor_class") or "", None)
        image_processor_cls = getattr(transformers, _preprocessor_field(model, "image_processor_type") or "", None)
        if (processor_cls is None or image_processor_cls is None
                or "video_processor" not in processor_cls.get_attributes()):
            raise

        class WithoutVideo(processor_cls):  # type: ignore[misc, valid-type]
            def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
                if argument_name == "video_processor" and argument is None:
                    return None
                return super().check_argument_for_proper_class(argument_name, argument)

        return WithoutVideo(image_processor=image_processor_cls.from_pretrained(model),
                            tokenizer=transformers.AutoTokenizer.from_pretrained(model), video_processor=None)


def _preprocessor_field(model: str, key: str) -> str | None:
    """`key` of the checkpoint's processor_config.json or preprocessor_config.json."""
    import transformers

    for name in ("processor_config.json", "preprocessor_config.json"):
        try:
            path = transformers.utils.cached_file(model, name)
        except OSError:
            continue
        if path is not None:
            with open(path) as f:
                value = json.load(f).get(key)
            if value:
                return value
    return None


def _item_tensors(processed: Any, index: int, count: int) -> dict[str, Any]:
    """The processor's tensors of image `index` of `count`: one row of each per-image tensor, and of patch-flattened
    `pixel_values` (`[all images' patches, ...]` beside `image_grid_thw`) the image's own patches, of per-crop
    `pixel_values` (beside Gemma 3's `num_crops`) the image's own and its crops' rows."""
    grids = processed.get("image_grid_thw")
    crops = processed.get("num_crops")
    data = {key: value[index: index + 1] for key, value in processed.items()
            if hasattr(value, "shape") and value.shape[0] == count and key != "pixel_values"}
    pixels = processed["pixel_values"]
    if grids is not None:
        sizes = [int(n) for n in grids.prod(-1)]
    elif crops is not None:
        sizes = [1 + int(n) for n in crops]
    else:
        sizes = [1] * count
    start = sum(sizes[:index])
    data["pixel_values"] = pixels[start: start + sizes[index]]
    return data


def _runs(ids: list[int], token_id: int, offset: int) -> tuple[tuple[int, int], ...]:
    """(start, length) of each run of `token_id` in `ids`, positions shifted by `offset`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == offset + i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((offset + i, 1))
    return tuple(runs)


def media_processor(model_config: ModelConfig, model_modalities: frozenset[str], tokenizer: Any
                    ) -> MediaProcessor | None:
    """The processor of a multimodal model; None for a text-only one (whose media settings are then refused)."""
    if model_modalities:
        return MediaProcessor(model_config, model_modalities, tokenizer)
    for name in ("limit_mm_per_prompt", "mm_processor_kwargs"):
        value = getattr(model_config, name)
        if value and (name != "limit_mm_per_prompt" or any(value.values())):
            raise ConfigError(f"invalid {name}={value!r}: this model takes text only")
    return None


def text_only_refusal(param: str) -> InvalidRequestError:
    return InvalidRequestError(param, f"invalid {param}: this model takes text only, so image and audio parts are "
                               "not supported; use {'type': 'text', 'text': ...}")


def images_of(data: Any, param: str) -> list[Any]:
    """vLLM's `multi_modal_data` of an offline prompt -> its images (PIL images, one or a list) and clips
    (`(samples, sampling rate)` tuples, one or a list, as vLLM takes them) as `Audio`."""
    from PIL import Image

    if not isinstance(data, dict):
        raise InvalidRequestError(param, "multi_modal_data must be a dict such as {'image': PIL.Image or a list}")
    unknown = sorted(set(data) - {"image", "audio"})
    if unknown:
        raise InvalidRequestError(f"{param}.{unknown[0]}", f"media of type {unknown[0]!r} is not supported; kestrel "
                                  "takes images ('image') and audio ('audio')")
    images = data.get("image", [])
    images = [images] if isinstance(images, Image.Image) else list(images)
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"{param}.image[{index}]", f"expected a PIL image, got {type(image).__name__}")
    clips = data.get("audio", [])
    clips = [clips] if isinstance(clips, tuple) else list(clips)
    audio: list[Any] = []
    for index, clip in enumerate(clips):
        if isinstance(clip, Audio):
            audio.append(clip)
            continue
        samples, rate = clip if isinstance(clip, tuple) and len(clip) == 2 else (None, None)
        array = np.asarray(samples, dtype=np.float32) if samples is not None else None
        if array is None or array.ndim != 1 or not array.size or not isinstance(rate, int) or rate < 1:
            raise InvalidRequestError(f"{param}.audio[{index}]", "expected a (1-D sample array, sampling rate) tuple")
        audio.append(Audio(array, rate))
    return images + audio


_PART_KINDS = {"image_url": "image", "image_pil": "image", "input_audio": "audio", "audio_url": "audio"}


def chat_images(messages: list[dict[str, Any]], media: MediaProcessor | None, limits: MediaLimits
                ) -> tuple[list[dict[str, Any]], list[Any]]:
    """A conversation's media parts (`image_url`, offline `image_pil`; `input_audio`, `audio_url`) loaded, in
    message order, and the messages with each replaced by `{"type": "image"}` or `{"type": "audio"}`, the parts
    chat templates render as the model's placeholders. A part of any other type but text is refused, naming it."""
    items: list[Any] = []
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" or not isinstance(part, dict):
                parts.append(part)
                continue
            modality = _PART_KINDS.get(kind)
            if modality is None:
                raise InvalidRequestError(param, f"content parts of type {kind!r} are not supported; this model "
                                          f"takes {_taken_parts(media)} parts")
            if media is None:
                raise text_only_refusal(param)
            if modality not in media.modalities:
                raise InvalidRequestError(param, f"this model does not take {modality} input; it takes "
                                          f"{_taken_parts(media)} parts")
            if kind == "input_audio":
                items.append(load_input_audio(part.get("input_audio"), f"{param}.input_audio", limits))
                media.check_clip(items[-1], f"{param}.input_audio.data")
            elif kind == "audio_url":
                url = part.get("audio_url")
                url = url.get("url") if isinstance(url, dict) else url
                items.append(load_audio_url(url, f"{param}.audio_url", limits))
                media.check_clip(items[-1], f"{param}.audio_url")
            elif kind == "image_pil":
                items.append(images_of({"image": part.get("image_pil")}, param)[0])
            else:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                items.append(load_image(url, f"{param}.image_url", limits))
            parts.append({"type": modality})
        out.append({**message, "content": parts})
    if media is not None:
        for modality in media.modalities:
            media.check_count(modality, sum(_modality(item) == modality for item in items), "messages")
    return out, items


def multi_modal_data(items: list[Any]) -> dict[str, list[Any]]:
    """`chat_images`' items as an offline prompt's `multi_modal_data`."""
    data: dict[str, list[Any]] = {}
    for item in items:
        data.setdefault(_modality(item), []).append(item)
    return data


def _modality(item: Any) -> str:
    return "audio" if isinstance(item, Audio) else "image"


def _taken_parts(media: MediaProcessor | None) -> str:
    if media is None:
        return "text"
    names = {"image": "image_url", "audio": "input_audio and audio_url"}
    return "text, " + ", ".join(names[m] for m in sorted(media.modalities))
