"""Media in prompts: image URLs to images (data: URLs; file:// under --allowed-local-media-path; http(s) from
--allowed-media-domains, with size, time and pixel limits), and a prompt's images to the engine's media items
through the checkpoint's own transformers processor.

The processor gives the pixel tensors, and its `replace_image_token` says what one `<image>` placeholder of the
prompt becomes (so the expansion is transformers' own); each expanded placeholder run is the item's range. Every
refusal is an InvalidRequestError naming the request part.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from kestrel.config import DEFAULT_MM_PER_PROMPT, ConfigError, ModelConfig
from kestrel.request import InvalidRequestError, MediaItem

DEFAULT_MEDIA_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_MEDIA_BYTES = 20 << 20
DEFAULT_MAX_IMAGE_PIXELS = 64 << 20  # 8192 x 8192


@dataclass(frozen=True)
class MediaLimits:
    """Where images may come from and how big they may be (the server's flags; LLM uses these defaults)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout_s: float = DEFAULT_MEDIA_FETCH_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS


def load_image(url: str, param: str, limits: MediaLimits) -> Any:
    """The PIL image an image_url names."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(param, "expected an image URL (data:, file:// or http(s)://)")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url, param, limits), param, limits)
    if scheme == "file":
        return decode_image(_local_file_bytes(url, param, limits), param, limits)
    if scheme in ("http", "https"):
        return decode_image(_remote_bytes(url, param, limits), param, limits)
    raise InvalidRequestError(param, f"unsupported image URL scheme {scheme or url[:20]!r}: use a data: URL "
                              "(base64 PNG or JPEG), file:// (with --allowed-local-media-path) or http(s):// (with "
                              "--allowed-media-domains)")


def _data_url_bytes(url: str, param: str, limits: MediaLimits) -> bytes:
    header, _, payload = url.partition(",")
    if not header.lower().endswith(";base64") or not header[5:].lower().startswith("image/"):
        raise InvalidRequestError(param, "a data URL image must be data:image/<type>;base64,<data>")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise InvalidRequestError(param, f"the image is over {limits.max_bytes:,} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(param, "the data URL's payload is not valid base64") from None


def _local_file_bytes(url: str, param: str, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise InvalidRequestError(param, "local image files are off on this server; start it with "
                                  "--allowed-local-media-path DIR, or send the image as a data: URL")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(root)
    if os.path.commonpath([path, root]) != root or not os.path.isfile(path):
        raise InvalidRequestError(param, f"{url!r} is not a file under the allowed local media path")
    if os.path.getsize(path) > limits.max_bytes:
        raise InvalidRequestError(param, f"the image is over {limits.max_bytes:,} bytes")
    with open(path, "rb") as f:
        return f.read()


def _remote_bytes(url: str, param: str, limits: MediaLimits) -> bytes:
    domains = limits.allowed_media_domains
    if not domains:
        raise InvalidRequestError(param, "fetching remote images is off on this server; send the image as a data: "
                                  "URL, or start the server with --allowed-media-domains")
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if host not in domains:
        raise InvalidRequestError(param, f"the image's domain {host!r} is not among the allowed media domains")
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as response:  # noqa: S310 (scheme checked)
            data = response.read(limits.max_bytes + 1)
    except Exception as e:  # DNS, connection, HTTP status and timeout errors all mean the same to the client
        raise InvalidRequestError(param, f"could not fetch the image: {e}") from None
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(param, f"the image is over {limits.max_bytes:,} bytes")
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


def image_content_hash(image: Any, processor_kwargs: dict[str, Any]) -> str:
    """What the encoder output depends on: the pixels (and mode, size) and the processor's settings."""
    digest = hashlib.sha256()
    digest.update(f"image|{image.mode}|{image.size}|{sorted(processor_kwargs.items())!r}|".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class MediaProcessor:
    """A multimodal checkpoint's transformers processor, and the per-prompt limits."""

    def __init__(self, model_config: ModelConfig, modalities: frozenset[str], tokenizer: Any) -> None:
        import transformers

        self.modalities = modalities
        self.tokenizer = tokenizer
        limits = dict(model_config.limit_mm_per_prompt or {})
        for modality, count in limits.items():
            if count and modality not in modalities:
                raise ConfigError(f"invalid limit_mm_per_prompt.{modality}={count}: the model takes "
                                  f"{', '.join(sorted(modalities))}; give 0 or leave it out")
        self.limits = {modality: limits.get(modality, DEFAULT_MM_PER_PROMPT) for modality in modalities}
        try:
            self.processor = transformers.AutoProcessor.from_pretrained(model_config.model)
        except Exception as e:
            raise ConfigError(f"invalid model={model_config.model!r}: the multimodal checkpoint's processor "
                              f"(processor_config.json / preprocessor_config.json) could not be loaded: {e}") from None
        image_processor = getattr(self.processor, "image_processor", None)
        self.image_token_id = getattr(self.processor, "image_token_id", None)
        if image_processor is None or self.image_token_id is None:
            raise ConfigError(f"invalid model={model_config.model!r}: its processor "
                              f"({type(self.processor).__name__}) has no image processor or image token")
        self.processor_kwargs = dict(model_config.mm_processor_kwargs or {})
        for key in self.processor_kwargs:
            if not hasattr(image_processor, key):
                raise ConfigError(f"invalid mm_processor_kwargs.{key}: {type(image_processor).__name__} has no such "
                                  "setting")

    def check_count(self, modality: str, count: int, param: str) -> None:
        if modality not in self.modalities:
            raise InvalidRequestError(param, f"this model does not take {modality} input; it takes "
                                      f"{', '.join(sorted(self.modalities))}")
        limit = self.limits[modality]
        if count > limit:
            raise InvalidRequestError(param, f"{count} {modality} items in one prompt; this server takes at most "
                                      f"{limit} (--limit-mm-per-prompt)")

    def expand(self, token_ids: list[int], images: list[Any], param: str) -> tuple[list[int], tuple[MediaItem, ...]]:
        """The prompt's ids with each image placeholder replaced by the processor's expansion, and one media item
        per image (in placeholder order)."""
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
        media: list[MediaItem] = []
        previous = 0
        for index, (at, replacement) in enumerate(zip(placeholders, replacements)):
            ids += token_ids[previous:at]
            expanded = self.tokenizer.encode(replacement, add_special_tokens=False)
            ranges = _runs(expanded, self.image_token_id, len(ids))
            ids += expanded
            previous = at + 1
            data = {key: value[index: index + 1] for key, value in processed.items()
                    if hasattr(value, "shape") and value.shape[0] == len(images)}
            media.append(MediaItem("image", image_content_hash(images[index], self.processor_kwargs), ranges, data))
        ids += token_ids[previous:]
        return ids, tuple(media)


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
    return InvalidRequestError(param, f"invalid {param}: this model takes text only, so image parts are not "
                               "supported; use {'type': 'text', 'text': ...}")


def images_of(data: Any, param: str) -> list[Any]:
    """vLLM's `multi_modal_data` of an offline prompt -> its images (PIL images, one or a list)."""
    from PIL import Image

    if not isinstance(data, dict):
        raise InvalidRequestError(param, "multi_modal_data must be a dict such as {'image': PIL.Image or a list}")
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise InvalidRequestError(f"{param}.{unknown[0]}", f"media of type {unknown[0]!r} is not supported; kestrel "
                                  "takes images ('image')")
    images = data.get("image", [])
    images = [images] if isinstance(images, Image.Image) else list(images)
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"{param}.image[{index}]", f"expected a PIL image, got {type(image).__name__}")
    return images


def chat_images(messages: list[dict[str, Any]], media: MediaProcessor | None, limits: MediaLimits
                ) -> tuple[list[dict[str, Any]], list[Any]]:
    """A conversation's image parts (`image_url`, and offline `image_pil`) loaded, in message order, and the
    messages with each replaced by `{"type": "image"}`, the part chat templates render as the model's image
    placeholder. A part of any other type but text is refused, naming it."""
    images: list[Any] = []
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
            if kind not in ("image_url", "image_pil"):
                raise InvalidRequestError(param, f"content parts of type {kind!r} are not supported; this model "
                                          f"takes {'text and image_url' if media else 'text'} parts")
            if media is None:
                raise text_only_refusal(param)
            if kind == "image_pil":
                images.append(images_of({"image": part.get("image_pil")}, param)[0])
            else:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(load_image(url, f"{param}.image_url", limits))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    if media is not None:
        media.check_count("image", len(images), "messages")
    return out, images
