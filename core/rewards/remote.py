"""A reward computed by another process over HTTP, with a small JSON protocol (docs/remote-reward.md).

Some scorers need an environment of their own — the original GenEval on mmdetection, UnifiedReward or
another VLM behind a server — so the trainer sends images, prompts and metadata to a URL and reads one
score per image back. Protocol "marble-reward/1", one POST per batch:

    request  {"protocol": "marble-reward/1", "reward": <name or null>, "image_format": "png",
              "images": [<base64 PNG>, ...], "prompts": [...], "metadata": [{...}, ...]}
    response {"scores": [<number or null>, ...]}      (null = not applicable -> NaN)

Anything else is an error that names the URL, the HTTP status and the start of the body. The client uses
only the standard library (urllib); :func:`serve` is a matching reference server, standard library + PIL,
so it can be copied into the scorer's own environment.
"""

from __future__ import annotations

import base64
import io
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from core.rewards.base import Reward, check_number_in_range, register_reward

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from PIL import Image

PROTOCOL = "marble-reward/1"
IMAGE_FORMATS = ("png", "jpeg")


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or answered something that breaks the protocol."""


# ---- encoding ---------------------------------------------------------------------------------------------

def encode_image(image: Image.Image, image_format: str = "png") -> str:
    """A PIL image as base64 text (PNG is lossless; JPEG quality 95 is smaller)."""
    buffer = io.BytesIO()
    if image_format == "png":
        image.save(buffer, format="PNG")
    else:
        image.save(buffer, format="JPEG", quality=95)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(text: str) -> Image.Image:
    """Base64 PNG/JPEG text -> an RGB PIL image."""
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(text, validate=True))).convert("RGB")


def build_request(images: Sequence[Image.Image], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]],
                  reward: str | None = None, image_format: str = "png") -> dict:
    """The request body of one batch (a JSON object)."""
    return {"protocol": PROTOCOL, "reward": reward, "image_format": image_format,
            "images": [encode_image(im, image_format) for im in images], "prompts": list(prompts),
            "metadata": [dict(m) for m in metadata]}


def parse_scores(body: Any, expected: int, url: str) -> list[float]:
    """``{"scores": [...]}`` -> floats, null -> NaN; RemoteRewardError on anything else."""
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list) or len(scores) != expected:
        got = f"{len(scores)} scores" if isinstance(scores, list) else f"{type(body).__name__} {str(body)[:120]!r}"
        raise RemoteRewardError(f"reward server {url}: expected {{\"scores\": [...]}} with {expected} values "
                                f"(one per image), got {got}")
    out = []
    for i, s in enumerate(scores):
        if s is None:
            out.append(math.nan)
        elif isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s):
            out.append(float(s))
        else:
            raise RemoteRewardError(f"reward server {url}: scores[{i}]={s!r}: each score must be a finite number "
                                    f"or null (not applicable)")
    return out


# ---- the client ---------------------------------------------------------------------------------------------

class RemoteReward(Reward):
    """POSTs each batch to ``url`` and returns the server's scores."""

    def __init__(self, url: str, reward: str | None = None, timeout: float = 120.0, batch_size: int = 32,
                 retries: int = 2, image_format: str = "png", headers: Mapping[str, str] | None = None):
        self.url = url
        self.remote_name = reward
        self.timeout = timeout
        self.batch_size = batch_size
        self.retries = retries
        self.image_format = image_format
        self.headers = dict(headers or {})

    def score(self, images: torch.Tensor, prompts: Sequence[str],
              metadata: Sequence[Mapping[str, Any]]) -> torch.Tensor:
        import torch

        from core.rewards.preprocess import to_pil_images

        pils = to_pil_images(images)
        scores: list[float] = []
        for start in range(0, len(pils), self.batch_size):
            stop = start + self.batch_size
            body = build_request(pils[start:stop], prompts[start:stop], metadata[start:stop], self.remote_name,
                                 self.image_format)
            scores += parse_scores(self._post(body), len(pils[start:stop]), self.url)
        return torch.tensor(scores, dtype=torch.float32)

    def _post(self, body: dict) -> Any:
        """One POST with up to ``retries`` retries on connection errors and 5xx answers (1 s, 2 s, ... apart)."""
        try:
            data = json.dumps(body, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise RemoteRewardError(f"reward server {self.url}: the batch's metadata is not plain JSON ({e})") from None
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(float(attempt))
            request = urllib.request.Request(self.url, data=data, method="POST",
                                             headers={"Content-Type": "application/json", **self.headers})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as e:
                text = e.read().decode("utf-8", "replace")[:300]
                last = f"HTTP {e.code}: {text!r}"
                if e.code < 500:
                    break  # the request itself is wrong: retrying will not help
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            except json.JSONDecodeError as e:
                raise RemoteRewardError(f"reward server {self.url}: the answer is not JSON ({e})") from None
        raise RemoteRewardError(f"reward server {self.url} failed after {attempt + 1} attempt(s): {last}. "
                                f"Is the server running and speaking {PROTOCOL} (docs/remote-reward.md)?")


@register_reward("remote", "A reward scored by an HTTP server (JSON protocol marble-reward/1)")
def remote(url: str, reward: str | None = None, timeout: float = 120.0, batch_size: int = 32, retries: int = 2,
           image_format: str = "png", headers: dict | None = None) -> Reward:
    """A remote reward at ``url`` (http:// or https://); ``reward`` is passed to the server as-is, for
    servers that host several scorers; ``headers`` are added to every request (e.g. an authorization)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"reward 'remote': url={url!r}: must start with http:// or https://")
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"reward 'remote': image_format={image_format!r}: valid choices: {', '.join(IMAGE_FORMATS)}")
    check_number_in_range("remote", "timeout", timeout, 0.1, 86400)
    check_number_in_range("remote", "batch_size", batch_size, 1, 4096, integer=True)
    check_number_in_range("remote", "retries", retries, 0, 100, integer=True)
    return RemoteReward(url, reward, float(timeout), batch_size, retries, image_format, headers)


# ---- a reference server -------------------------------------------------------------------------------------

ScoreFn = Callable[[list, list, list], Sequence[float | None]]
"""(PIL images, prompts, metadata dicts) -> one score per image, None where not applicable."""


def make_handler(score_fn: ScoreFn, max_bytes: int = 512 * 1024 * 1024) -> type[BaseHTTPRequestHandler]:
    """An HTTP handler answering protocol requests with ``score_fn``; 400 on a malformed request, 500 when
    ``score_fn`` raises (the client retries those)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - a health check
            self._reply(200, {"protocol": PROTOCOL, "status": "ok"})

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 < length <= max_bytes:
                    raise ValueError(f"Content-Length {length} outside 1..{max_bytes}")
                body = json.loads(self.rfile.read(length))
                if body.get("protocol") != PROTOCOL:
                    raise ValueError(f"protocol {body.get('protocol')!r}, expected {PROTOCOL!r}")
                images = [decode_image(t) for t in body["images"]]
                prompts, metadata = list(body["prompts"]), list(body["metadata"])
                if not len(images) == len(prompts) == len(metadata):
                    raise ValueError(f"{len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata")
            except Exception as e:  # noqa: BLE001 - any malformed request is the client's error
                self._reply(400, {"error": f"bad request: {type(e).__name__}: {e}"})
                return
            try:
                scores = [None if s is None or (isinstance(s, float) and math.isnan(s)) else float(s)
                          for s in score_fn(images, prompts, metadata)]
            except Exception as e:  # noqa: BLE001
                self._reply(500, {"error": f"scoring failed: {type(e).__name__}: {e}"})
                return
            self._reply(200, {"scores": scores})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
            pass

    return Handler


def serve(score_fn: ScoreFn, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Start a protocol server for ``score_fn`` in a daemon thread; returns (server, thread).

    ``port=0`` picks a free port (``server.server_address[1]``). Stop it with ``server.shutdown()`` and
    ``server.server_close()``.
    """
    server = ThreadingHTTPServer((host, port), make_handler(score_fn))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread
