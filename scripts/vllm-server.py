"""Runs one vLLM OpenAI server and takes it down with everything it started.

vLLM starts helper processes (the engine core, its workers). This wrapper starts the server in a
session of its own and, when its standard input closes (the parent is done with it, or died) or
it gets SIGTERM/SIGINT, terminates that whole session: nothing outlives a test or a benchmark.
The line "kill" on its standard input kills the whole session at once with SIGKILL (a crash, for
fault tests).

Usage: python scripts/vllm-server.py VLLM_ARGS...   (with the python of scripts/vllm-venv.sh)
"""

import os
import signal
import subprocess
import sys
import threading
import time


def main() -> int:
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *sys.argv[1:]],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    stopping = threading.Event()

    def stop(*_args) -> None:
        if stopping.is_set():
            return
        stopping.set()
        for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(server.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if server.poll() is not None:
                    # The server is gone; its helpers may linger a moment.
                    try:
                        os.killpg(server.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return
                time.sleep(0.1)

    def watch_stdin() -> None:
        try:
            for line in sys.stdin.buffer:
                if line.strip() == b"kill":
                    try:
                        os.killpg(server.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        finally:
            stop()
            os._exit(0)

    signal.signal(signal.SIGTERM, lambda *a: (stop(), os._exit(0)))
    signal.signal(signal.SIGINT, lambda *a: (stop(), os._exit(0)))
    threading.Thread(target=watch_stdin, daemon=True).start()
    code = server.wait()
    stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
