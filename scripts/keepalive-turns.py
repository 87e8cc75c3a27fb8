"""Time to first token of conversations sent back to back on one kept-alive connection, as an
OpenAI SDK client or the benchmark sends them: each turn goes out as soon as the previous answer
ended. A server or router whose socket holds small writes back (Nagle's algorithm against the
client's delayed ACK) shows it here as ~20-40 ms on every turn, which a new connection per
request hides.

Usage: python3 scripts/keepalive-turns.py HOST:PORT [MODEL]
"""

import http.client
import json
import random
import socket
import statistics
import sys
import time


def main(address, model):
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port))
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def first_byte_ms(body):
        start = time.time()
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"content-type": "application/json"})
        answer = conn.getresponse()
        first = None
        while chunk := answer.read1(65536):
            if first is None:
                first = time.time() - start
        return first * 1000

    first_turns, later_turns = [], []
    for conversation in range(4):
        rng = random.Random()  # a system prompt no earlier run left in the cache
        system = " ".join("".join(chr(97 + rng.randrange(26)) for _ in range(6)) for _ in range(300))
        messages = [{"role": "system", "content": system}]
        for turn in range(4):
            messages.append({"role": "user", "content": f"question {turn} " + "more " * 30})
            body = {"model": model, "messages": messages, "max_tokens": 16, "ignore_eos": True,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
            (later_turns if turn else first_turns).append(first_byte_ms(body))
            messages.append({"role": "assistant", "content": "answer " * 16})
    print(f"{address}: TTFT median ms, first turns {statistics.median(first_turns):.1f}, "
          f"later turns {statistics.median(later_turns):.1f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tiny-llama")
