"""Image content in chat requests: OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` parts, for a served
model whose engine takes images (an image-text Qwen3.5 / Qwen3.6: kiln.engine.vision).

An image comes inline as a `data:image/...;base64,` URL. The server fetches nothing: an http(s) address is refused
(it reaches no network, and a server that fetched what a client names could be pointed at hosts behind it), and so
is a file:// one (a client could read the server's files). Each refusal is a 400 naming the part's field.

The prompt is built as `kiln chat --image` builds it (kiln.data.sft.image_chat_prompt): each image part becomes the
model's vision tokens in the message's text, the conversation goes through the chat template, each placeholder is
widened to its image's merged patch count, and the images' pixel inputs go with the request to the engine.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

from kiln.data.sft import chat_prompt_ids
from kiln.data.sft_images import ImageTokens, expand_images
from kiln.errors import KilnError
from kiln.serve.protocol import ImagePart, Message, RequestError
from kiln.serve.tools import template_messages

MAX_IMAGE_BYTES = 20 << 20  # one image's encoded bytes at most (OpenAI's own bound)
_DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w-]+=[\w.-]+)*;base64,", re.ASCII)


def has_images(messages: list[Message]) -> bool:
    return any(isinstance(m.content, list) and any(isinstance(p, ImagePart) for p in m.content) for m in messages)


def _decode(url: str, param: str):
    """The PIL image of one data URL, or a RequestError naming `param`."""
    from kiln.data.images import _pil

    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme in ("http", "https"):
        raise RequestError(f"{param}: image web addresses are not fetched (this server reaches no network); "
                           "send the image inline as a data:image/...;base64, URL", param)
    if scheme == "file":
        raise RequestError(f"{param}: file:// images are refused (a client may not read the server's files); "
                           "send the image inline as a data:image/...;base64, URL", param)
    head = _DATA_URL.match(url)
    if head is None:
        raise RequestError(f"{param}: want a data:image/...;base64, URL, got {url[:40]!r}", param)
    payload = url[head.end():]
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise RequestError(f"{param}: the image is over {MAX_IMAGE_BYTES >> 20} MiB", param)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{param}: the base64 data does not decode ({e})", param) from None
    Image = _pil()
    try:
        with Image.open(io.BytesIO(raw)) as f:
            f.load()
            return f.copy()
    except (OSError, Image.DecompressionBombError, ValueError) as e:
        raise RequestError(f"{param}: not an image Pillow reads ({e})", param) from None


def image_chat(tokenizer: Any, messages: list[Message], spec: ImageTokens | None,
               tools: list[dict[str, Any]] | None) -> tuple[list[int], dict | None]:
    """The prompt ids of a chat request whose messages hold image parts, and the images' pixel inputs (for the
    engine's `prompt_inputs`). `spec`: the served model's vision tokens and processor; None when it takes no
    images (then the first image part is refused by name)."""
    images = []
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if isinstance(part, ImagePart):
                param = f"messages.{i}.content.{j}.image_url"
                if spec is None:
                    raise RequestError(f"{param}: this model takes no images (it has no vision tower)", param)
                image = _decode(part.image_url.url, f"{param}.url")
                budget = spec.processor.max_input_pixels
                if budget is not None and image.width * image.height > budget:
                    raise RequestError(f"{param}: the image is {image.width}x{image.height} = "
                                       f"{image.width * image.height} pixels, over the model's budget of {budget}",
                                       param)
                images.append(image)
    assert spec is not None  # (has_images: at least one image part, refused above without a spec)
    flat = template_messages(messages, spec.image_text())
    try:
        ids = chat_prompt_ids(tokenizer, flat, tools)
    except KilnError as e:  # the template refused the conversation (raise_exception, no template)
        raise RequestError(str(e), "messages") from None
    try:
        ids, _, inputs = expand_images(ids, list(ids), images, spec, "messages")
    except KilnError as e:  # a template that dropped a message holding an image; an image the processor refused
        raise RequestError(str(e), "messages") from None
    return ids, inputs
