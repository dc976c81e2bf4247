"""`make run`: serve the bundled default model and show a completion.

The default model is the demo pair shipped in `dspark/assets/demo` (a small Python-code
target and its DSpark drafter). When the package has no trained pair, a tiny RANDOM pair is
built offline instead; its text is gibberish and the server says so at start-up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

ASSETS = os.path.join(os.path.dirname(__file__), "assets", "demo")


def default_model_paths() -> tuple[str, str | None, bool]:
    """(target path, drafter path or None, is_gibberish)."""
    target, drafter = os.path.join(ASSETS, "target"), os.path.join(ASSETS, "drafter")
    if os.path.isfile(os.path.join(target, "config.json")):
        has_drafter = os.path.isfile(os.path.join(drafter, "config.json"))
        return target, drafter if has_drafter else None, False
    cache = os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dspark", "random-demo"
    )
    target, drafter = os.path.join(cache, "target"), os.path.join(cache, "drafter")
    if not os.path.isfile(os.path.join(drafter, "model.safetensors")):
        from dspark.testing.checkpoints import TinyShape, make_tiny_target
        from dspark.testing.drafters import make_tiny_drafter

        make_tiny_target(target, TinyShape(hidden_size=128, intermediate_size=256), seed=0)
        make_tiny_drafter(drafter, target, seed=0)
    return target, drafter, True


def main() -> int:
    import httpx

    port = int(os.environ.get("DSPARK_DEMO_PORT", "8000"))
    cmd = [sys.executable, "-m", "dspark", "serve", "--port", str(port), "--device", "cpu"]
    print("$", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                print("the server exited during start-up", file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                print("the server did not become healthy in time", file=sys.stderr)
                return 1
            time.sleep(0.5)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 48,
                "temperature": 0.0}  # fmt: skip
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
        print("\n--- completion of 'def fibonacci(n):' ---")
        print("def fibonacci(n):" + resp["choices"][0]["text"])
        print("--- usage:", json.dumps(resp.get("usage")))
        print("--- spec_decode:", json.dumps(resp.get("spec_decode")))
        if os.environ.get("DSPARK_DEMO_EXIT"):
            return 0
        print(f"\nserving at {base} (OpenAI-compatible); Ctrl-C to stop", flush=True)
        server.wait()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    sys.exit(main())
