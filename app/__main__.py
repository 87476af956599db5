"""``python -m app``: serve MARBLE Studio on 127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT respected).

Binding to any address other than loopback requires MARBLE_USERNAME and MARBLE_PASSWORD.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def main() -> int:
    host = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    port = int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
    auth = None
    if host not in LOOPBACK:
        user, password = os.environ.get("MARBLE_USERNAME"), os.environ.get("MARBLE_PASSWORD")
        if not user or not password:
            print(f"error: serving on {host} (not loopback) needs a login: set MARBLE_USERNAME and "
                  f"MARBLE_PASSWORD", file=sys.stderr)
            return 2
        auth = (user, password)
    from app import context
    from app.main import STATIC, build_app, css
    from jobs.runner import ensure_worker

    store = context.store()
    ensure_worker(store)  # queued runs start even if no page is open; jobs outlive this process
    demo = build_app()
    demo.queue(default_concurrency_limit=8)
    print(f"MARBLE Studio on http://{host}:{port}  (data: {store.home})", flush=True)
    demo.launch(server_name=host, server_port=port, auth=auth, css=css(), allowed_paths=[str(store.home)],
                favicon_path=str(STATIC / "logo.svg"), footer_links=[], show_error=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
