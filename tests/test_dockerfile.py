"""The Docker image serves the app (issue 18 item 6). No Docker engine runs here, so the Dockerfile is read: its
CMD is run locally with the image's environment — refused without the login, serving with it."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _dockerfile() -> tuple[list[str], dict[str, str], list[str]]:
    """(CMD in exec form, ENV of the final stage, EXPOSEd ports)."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())  # join continued lines
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    cmds = [json.loads(ln[4:]) for ln in lines if ln.startswith("CMD ")]
    env: dict[str, str] = {}
    for ln in lines:
        if ln.startswith("ENV "):
            env.update(dict(pair.split("=", 1) for pair in ln[4:].split()))
    ports = [p for ln in lines if ln.startswith("EXPOSE ") for p in ln.split()[1:]]
    return cmds[-1], env, ports


def test_the_image_runs_the_app_bound_for_port_mapping_with_a_login(tmp_path):
    cmd, env, ports = _dockerfile()
    assert cmd == ["python", "-m", "app"]
    assert env["GRADIO_SERVER_NAME"] == "0.0.0.0" and ports == [env["GRADIO_SERVER_PORT"]] == ["7860"]
    assert env["HF_HUB_OFFLINE"] == "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    image_env = {k: v for k, v in env.items() if k not in ("PATH", "MARBLE_HOME")}
    base = {**os.environ, **image_env, "GRADIO_SERVER_PORT": str(port), "MARBLE_HOME": str(tmp_path),
            "PYTHONPATH": str(ROOT)}
    base.pop("MARBLE_USERNAME", None)
    base.pop("MARBLE_PASSWORD", None)
    argv = [sys.executable, *cmd[1:]]  # the image's python is the venv's
    refused = subprocess.run(argv, cwd=ROOT, env=base, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert refused.stderr.strip() == ("error: serving on 0.0.0.0 (not loopback) needs a login: set MARBLE_USERNAME "
                                      "and MARBLE_PASSWORD")
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen(argv, cwd=ROOT, env={**base, "MARBLE_USERNAME": "me", "MARBLE_PASSWORD": "pw"},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).read().decode()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "app.log").read_text()
                assert time.time() < deadline, "the app did not answer in 120 s"
                time.sleep(0.5)
        assert "<html" in page
        try:  # the app's layout is behind the login
            urllib.request.urlopen(f"http://127.0.0.1:{port}/config", timeout=10)
            raise AssertionError("/config answered without a login")
        except urllib.error.HTTPError as e:
            assert e.code == 401
        assert (tmp_path / "worker.lock").read_text().strip().isdigit()  # it started its worker
        proc.send_signal(signal.SIGTERM)  # docker stop
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert "MARBLE Studio stopped, and its idle worker with it" in (tmp_path / "app.log").read_text()
