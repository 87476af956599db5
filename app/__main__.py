"""``python -m app``: serve MARBLE Studio on 127.0.0.1:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT respected).

Binding to any address other than loopback requires MARBLE_USERNAME and MARBLE_PASSWORD (5 failed logins
within 5 minutes lock that user name out for 5 minutes), and so does a public share link (GRADIO_SHARE=true):
without the login the share link is refused, never opened.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def main() -> int:
    host = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    port_text = os.environ.get("GRADIO_SERVER_PORT", "7860")
    if not (port_text.isdigit() and 1 <= int(port_text) <= 65535):
        print(f"error: GRADIO_SERVER_PORT={port_text!r}: must be a port number in [1, 65535]", file=sys.stderr)
        return 2
    port = int(port_text)
    share = os.environ.get("GRADIO_SHARE", "").strip().lower() in ("1", "true", "yes")
    auth = None
    if host not in LOOPBACK or share:
        user, password = os.environ.get("MARBLE_USERNAME"), os.environ.get("MARBLE_PASSWORD")
        if not user or not password:
            why = "GRADIO_SHARE=true (a public share link)" if share else f"serving on {host} (not loopback)"
            print(f"error: {why} needs a login: set MARBLE_USERNAME and MARBLE_PASSWORD", file=sys.stderr)
            return 2
        from app.auth import LoginGuard

        auth = LoginGuard(user, password)  # locks a user name out after repeated failed logins
        os.environ["MARBLE_EXPOSED"] = "1"  # the New-run form offers known models only (app/forms.py)
    from app import context
    from app.main import STATIC, build_app, css
    from jobs.runner import ensure_worker

    from jobs.runner import worker_pid

    store = context.store()
    ours = worker_pid(store.home) is None  # a worker someone started by hand is left alone on exit
    ensure_worker(store)  # queued runs start even if no page is open; jobs outlive this process
    demo = build_app()
    demo.queue(default_concurrency_limit=8)
    print(f"MARBLE Studio on http://{host}:{port}  (data: {store.home})", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, `docker stop`: the same goodbye as Ctrl-C
    try:
        demo.launch(server_name=host, server_port=port, auth=auth, share=share and auth is not None, css=css(), allowed_paths=[str(store.home)],
                    favicon_path=str(STATIC / "logo.svg"), footer_links=[], show_error=True)
    except KeyboardInterrupt:
        pass
    finally:
        print(farewell(store, ours), flush=True)
    return 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def farewell(store, ours: bool = True) -> str:
    """On exit: with nothing queued or running, the worker this app started stops too; otherwise say which runs
    keep going in the background and how to stop them."""
    from jobs.runner import active_runs_line, stop_worker, worker_pid

    line = active_runs_line(store)
    if line:
        return (f"MARBLE Studio stopped. These runs keep going in the background worker: {line}. Watch them with "
                f"`python -m jobs list`, stop one with `python -m jobs cancel RUN`, or stop the worker (running "
                f"jobs finish on their own) with `python -m jobs worker --stop`.")
    if not ours or worker_pid(store.home) is None:
        return "MARBLE Studio stopped."
    try:
        return f"MARBLE Studio stopped, and its idle worker with it ({stop_worker(store.home, timeout=15)})."
    except TimeoutError as e:
        return f"MARBLE Studio stopped; {e}."


if __name__ == "__main__":
    sys.exit(main())
