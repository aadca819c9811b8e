"""One RL worker process for test_rl.py.

    python3 rl_worker_proc.py ADDRESS WORKER_ID ITEMS

Waits for parameters (version 0), adds ITEMS experience items {worker, seq, x}, flushes, then
waits for version 1 and adds ITEMS more, flushes, and prints its counters as JSON. Every wait is
bounded, so a broken trainer cannot keep this process alive.
"""
import json
import sys

import numpy as np

import tensorshare
from tensorshare.rl import RLWorker

# seconds; the longest wait for parameters or for the adds to be answered
WAIT_S = 30.0


def main():
    address, wid, items = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with tensorshare.Client(address, timeout=WAIT_S) as client:
        with RLWorker(client, prefix="t/", tensor_type="numpy") as worker:
            p = worker.params() or worker.await_params(timeout=WAIT_S)
            assert p.version == 0, p.version
            for phase in range(2):
                for seq in range(items):
                    worker.add({"worker": wid, "seq": seq,
                                "x": np.full(4, p.value["w"][0] + seq, dtype=np.float32)})
                worker.flush(timeout=WAIT_S)
                if phase == 0:
                    p = worker.await_params(timeout=WAIT_S)
                    assert p.version == 1, p.version
            print(json.dumps(worker.stats()))


if __name__ == "__main__":
    main()
