import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture
def web_store(tmp_path, monkeypatch):
    """The web app's one Store (app.context.store), opened on a fresh SQLite data directory for this test."""
    from app import context

    monkeypatch.setenv("MARBLE_HOME", str(tmp_path))
    context.store.cache_clear()
    yield context.store()
    context.store().close()
    context.store.cache_clear()
