"""The remote reward against a real HTTP server on 127.0.0.1 (started and stopped by each test)."""

import json
import math
import urllib.request
from contextlib import contextmanager

import pytest
import torch

from core.rewards import make_reward
from core.rewards.remote import PROTOCOL, RemoteRewardError, build_request, decode_image, parse_scores, serve
from core.rewards.preprocess import to_pil_images


@contextmanager
def running(score_fn):
    server, thread = serve(score_fn, host="127.0.0.1", port=0)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def images(batch=3, size=8, seed=0):
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_round_trip_images_prompts_metadata_and_null_scores():
    seen = {}

    def score(pils, prompts, metadata):
        seen["pixels"] = [list(p.getdata()) for p in pils]
        seen["prompts"], seen["metadata"] = prompts, metadata
        # mean red channel as the score; None (not applicable) where the metadata says so
        return [None if m.get("skip") else sum(px[0] for px in p.getdata()) / (255.0 * len(p.getdata()))
                for p, m in zip(pils, metadata)]

    x = images()
    meta = [{"source": "a"}, {"source": "b", "skip": True}, {"include": [{"class": "cat", "count": 2}]}]
    with running(score) as url:
        reward = make_reward("remote", url=url, batch_size=2)  # 3 images -> two requests
        out = reward(x, ["p0", "p1", "p2"], meta)
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert math.isnan(out[1]) and not math.isnan(out[0]) and not math.isnan(out[2])
    expected_red = (x[:, 0] * 255).round().mean(dim=(1, 2)) / 255
    torch.testing.assert_close(out[[0, 2]], expected_red[[0, 2]], rtol=0, atol=1e-6)
    assert seen["prompts"] == ["p2"] and seen["metadata"] == [meta[2]]  # the last request held the last image
    # PNG is lossless: the server saw exactly round(255 x)
    assert seen["pixels"][0] == [tuple(v) for v in (x[2] * 255).round().to(torch.uint8).permute(1, 2, 0).reshape(-1, 3).tolist()]


def test_request_body_follows_the_documented_protocol():
    pils = to_pil_images(images(2))
    body = build_request(pils, ["a", "b"], [{"k": 1}, {}], reward="geneval")
    assert body["protocol"] == PROTOCOL == "marble-reward/1"
    assert set(body) == {"protocol", "reward", "image_format", "images", "prompts", "metadata"}
    assert body["reward"] == "geneval" and body["image_format"] == "png"
    assert list(decode_image(body["images"][1]).getdata()) == list(pils[1].getdata())
    json.dumps(body)  # plain JSON


@pytest.mark.parametrize("body, fragment", [
    ({"scores": [1.0]}, "2 values"),
    ({"result": [1, 2]}, "expected"),
    ({"scores": [1.0, "x"]}, "scores[1]"),
    ({"scores": [1.0, True]}, "scores[1]"),
    ({"scores": [1.0, float("inf")]}, "finite"),
])
def test_protocol_violations_are_named(body, fragment):
    with pytest.raises(RemoteRewardError, match="reward server http://h") as e:
        parse_scores(body, 2, "http://h")
    assert fragment in str(e.value)


def test_server_errors_are_retried_then_reported_with_status_and_body():
    calls = []

    def failing(pils, prompts, metadata):
        calls.append(len(pils))
        raise RuntimeError("model exploded")

    with running(failing) as url:
        reward = make_reward("remote", url=url, retries=1)
        with pytest.raises(RemoteRewardError, match="HTTP 500.*model exploded"):
            reward(images(1), ["p"], [{}])
    assert calls == [1, 1]  # one retry


def test_wrong_length_answer_fails_clearly():
    with running(lambda pils, prompts, metadata: [0.5]) as url:
        with pytest.raises(RemoteRewardError, match="with 2 values"):
            make_reward("remote", url=url)(images(2), ["a", "b"], [{}, {}])


def test_bad_request_is_a_400_and_health_check_answers():
    with running(lambda *a: []) as url:
        with urllib.request.urlopen(url, timeout=5) as r:
            assert json.loads(r.read()) == {"protocol": PROTOCOL, "status": "ok"}
        req = urllib.request.Request(url, data=json.dumps({"protocol": "other/9"}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 400 and "protocol" in e.value.read().decode()


def test_unreachable_server_and_bad_arguments():
    with running(lambda *a: []) as url:
        pass  # the port is closed again after the block
    reward = make_reward("remote", url=url, retries=0, timeout=2)
    with pytest.raises(RemoteRewardError, match="failed after 1 attempt"):
        reward(images(1), ["p"], [{}])
    with pytest.raises(ValueError, match="http:// or https://"):
        make_reward("remote", url="127.0.0.1:80")
    with pytest.raises(ValueError, match="missing required argument.*url"):
        make_reward("remote")
    with pytest.raises(ValueError, match="image_format"):
        make_reward("remote", url="http://x", image_format="gif")
