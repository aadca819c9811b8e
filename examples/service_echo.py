"""A service from Python: one client serves "echo", another calls it.

    python3 examples/service_echo.py [ADDRESS]          # both in this process
    python3 examples/service_echo.py ADDRESS serve      # a server only (Ctrl-C stops it)
    python3 examples/service_echo.py ADDRESS call       # a caller only

ADDRESS is a running tensord (default 127.0.0.1:8000). The handler doubles the request's "x"
and returns its "tag"; it runs on the serving client's worker threads (docs/PYTHON.md, Services).
"""
import sys
import time

import numpy as np

import tensorshare as ts


def handler(request):
    if "x" not in request:
        raise ValueError("the request needs an 'x'")
    return {"x": np.asarray(request["x"]) * 2, "tag": request.get("tag", "")}


def call(address):
    with ts.Client(address, tensor_type="numpy") as c:
        for i in range(3):
            answer = c.call("echo", {"x": np.arange(4, dtype=np.float32) + i, "tag": "call %d" % i},
                            timeout=5.0, wait_for_server=True)
            print(answer["tag"], answer["x"])
        try:
            c.call("echo", {"tag": "no x"}, timeout=5.0)
        except ts.InvalidArgumentError as e:
            print("refused:", e)


def main():
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8000"
    mode = sys.argv[2] if len(sys.argv) > 2 else "both"
    if mode == "call":
        call(address)
        return
    with ts.Client(address, tensor_type="numpy") as server, server.serve("echo", handler):
        if mode == "serve":
            print("serving echo on", address)
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        else:
            call(address)


if __name__ == "__main__":
    main()
