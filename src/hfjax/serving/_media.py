"""Images in chat requests: OpenAI's `image_url` content parts, read as vLLM reads them.

A part {"type": "image_url", "image_url": {"url": URL}} (or "image_url": URL) holds its image as

    data:image/...;base64,...   the image's bytes, inline
    file:///path, /path         a file under `--allowed-local-media-path` (else refused)
    http(s)://...               fetched with a timeout and a size limit (httpx)

`image_parts` takes a chat body's parts out of its messages (each becomes the {"type": "image"}
part a processor's chat template reads) and checks the count against `--limit-mm-per-prompt`;
`load_images` reads them into RGB PIL images; `fixed_image_example` is the one-image chat whose
prefill an engine compiles before it starts. Every bad part is an OpenAI-shaped 400 naming its
field: an image sent to a model that reads none, too many, an unknown scheme, a path outside the
allowed one, bytes that are no image.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import pathlib
import urllib.parse

import numpy as np

from .. import generation
from ._protocol import ApiError, invalid

DEFAULT_IMAGE_LIMIT = 999  # vLLM's default --limit-mm-per-prompt, per modality
FETCH_TIMEOUT_S = 10.0  # an http(s) image's whole fetch
MAX_IMAGE_BYTES = 20 * 2**20  # an image's bytes, inline or fetched


@dataclasses.dataclass(frozen=True, kw_only=True)
class MediaPolicy:
    """What a server reads of a request's images."""

    allowed_local_media_path: pathlib.Path | None = None  # files under it may be read; None: no files
    image_limit: int = DEFAULT_IMAGE_LIMIT  # images per prompt
    fetch_timeout_s: float = FETCH_TIMEOUT_S
    max_image_bytes: int = MAX_IMAGE_BYTES


def image_parts(body, policy: MediaPolicy, *, takes_images: bool) -> list[tuple[str, str]]:
    """(field, URL) of each image_url part of a chat body's messages, in order; each part is replaced
    in `body` by {"type": "image"}, the placeholder a processor's chat template reads."""
    messages = body.get("messages") if isinstance(body, dict) else None
    found = []
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            field = f"messages[{i}].content[{j}].image_url"
            if not takes_images:
                raise invalid(field, f"{field}: this model reads no images; send text content parts only")
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url:
                raise invalid(
                    field, f'{field}={value!r}: pass {{"url": "data:image/png;base64,..."}} (or an http(s) URL)'
                )
            found.append((f"{field}.url" if isinstance(value, dict) else field, url))
            content[j] = {"type": "image"}
    if len(found) > policy.image_limit:
        raise invalid(
            "messages",
            f"the messages hold {len(found)} images, more than this server takes per prompt ({policy.image_limit}, "
            "--limit-mm-per-prompt); send at most that many",
        )
    return found


async def load_images(parts: list[tuple[str, str]], policy: MediaPolicy) -> list:
    """RGB PIL images of `image_parts`' (field, URL) pairs, in order."""
    return [_decoded(field, await _image_bytes(field, url, policy)) for field, url in parts]


async def _image_bytes(field: str, url: str, policy: MediaPolicy) -> bytes:
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise invalid(field, f"{field}: a data: URL must be data:<type>;base64,<data>; got {url[:40]!r}...")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(field, f"{field}: the data: URL's payload is not base64; encode the image's bytes") from None
    elif scheme in ("http", "https"):
        data = await _fetched(field, url, policy)
    elif scheme == "file" or (scheme == "" and url.startswith("/")):
        data = _local(field, url, policy)
    else:
        raise invalid(
            field, f"{field}: {url[:60]!r} has scheme {scheme or 'none'!r}; pass a data:, http(s):// or file:// URL"
        )
    if len(data) > policy.max_image_bytes:
        raise invalid(
            field, f"{field}: the image has {len(data)} bytes, over {policy.max_image_bytes}; send a smaller one"
        )
    return data


def _local(field: str, url: str, policy: MediaPolicy) -> bytes:
    path = pathlib.Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path) if url.startswith("file:") else url)
    allowed = policy.allowed_local_media_path
    resolved = path.resolve()
    if allowed is None or not resolved.is_relative_to(allowed.resolve()):
        where = "no path is allowed" if allowed is None else f"only files under {allowed} are"
        raise invalid(
            field,
            f"{field}: {url!r} is a local file, and {where} (--allowed-local-media-path); send the image as a data: URL "
            "or start the server with --allowed-local-media-path DIR",
        )
    try:
        return resolved.read_bytes()
    except OSError as error:
        raise invalid(
            field, f"{field}: {url!r} cannot be read ({error.strerror}); pass an image file that exists"
        ) from None


async def _fetched(field: str, url: str, policy: MediaPolicy) -> bytes:
    try:
        import httpx
    except ImportError:
        raise ApiError(
            400, f"{field}: http(s) images need httpx on the server: pip install 'hfjax[serve]'", param=field
        ) from None
    data = bytearray()
    try:
        async with httpx.AsyncClient(timeout=policy.fetch_timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise invalid(
                        field, f"{field}: fetching {url!r} answered HTTP {response.status_code}; pass a reachable URL"
                    )
                async for piece in response.aiter_bytes():
                    data += piece
                    if len(data) > policy.max_image_bytes:
                        raise invalid(
                            field, f"{field}: {url!r} is over {policy.max_image_bytes} bytes; send a smaller image"
                        )
    except httpx.HTTPError as error:
        raise invalid(
            field, f"{field}: {url!r} could not be fetched ({type(error).__name__}); pass a reachable URL"
        ) from None
    return bytes(data)


def _decoded(field: str, data: bytes):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise invalid(
            field, f"{field}: the bytes are not an image PIL can read ({error}); send a PNG, JPEG, ..."
        ) from None


def fixed_image_example(processor) -> tuple[list[int], dict] | None:
    """(prompt ids, the processor's other outputs) of a chat with one image, where `processor` gives
    images of two sizes the same shapes (a fixed image size, whose prefill an engine can compile
    ahead); else None."""
    from PIL import Image

    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    examples = [
        generation.processed(processor, [text], [[Image.new("RGB", size, (128, 128, 128))]])
        for size in ((48, 40), (32, 64))
    ]
    shapes = [{name: np.shape(value) for name, value in example.items()} for example in examples]
    if shapes[0] != shapes[1]:
        return None
    first = examples[0]
    ids = [int(t) for t in first.pop("input_ids")[0]]
    first.pop("attention_mask", None)
    return ids, first
