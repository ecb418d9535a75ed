"""Send one chat completion to a kvferry service (standard library only).

    kubectl port-forward svc/demo-router 8000:8000 &
    python examples/client.py --url http://127.0.0.1:8000 --model demo "Hello"
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    body = {"model": args.model, "max_tokens": args.max_tokens,
            "messages": [{"role": "user", "content": args.prompt}]}
    headers = {"Content-Type": "application/json"}
    if os.environ.get("KVFERRY_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['KVFERRY_API_KEY']}"
    request = urllib.request.Request(f"{args.url}/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        print(json.load(response)["choices"][0]["message"]["content"])


if __name__ == "__main__":
    main()
