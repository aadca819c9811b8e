"""A process that forks with an RLTrainer, an RLWorker and a Predictor open (test_rl.py).

    python3 rl_fork_proc.py ADDRESS

The child finds every object unusable (ConnectionError) and then exits normally: atexit
handlers and interpreter finalization run with the parent's objects still referenced, and
must neither hang nor crash nor touch the parent's connection. The parent then checks that its
objects still work. Exit status 0 when all of that holds.
"""
import os
import sys

import numpy as np

import tensorshare
from tensorshare.predictor import Predictor
from tensorshare.rl import RLTrainer, RLWorker

# seconds; the longest wait for parameters or for the child
WAIT_S = 30.0

client = tensorshare.Client(sys.argv[1], timeout=WAIT_S)
trainer = RLTrainer(client)
worker = RLWorker(client)
predictor = Predictor(client, "nobody")
pending = predictor.predict_async(np.zeros((1, 2), dtype=np.float32), timeout=WAIT_S)

pid = os.fork()
if pid == 0:
    refused = 0
    for call in (lambda: trainer.publish({"w": np.zeros(1, dtype=np.float32)}),
                 worker.params, lambda: predictor.predict(np.zeros((1, 2), dtype=np.float32))):
        try:
            call()
        except tensorshare.ConnectionError:
            refused += 1
    if refused != 3:
        sys.exit(3)
    # Falling off the end: a normal exit with the parent's objects still referenced.
else:
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        print("child failed:", status)
        sys.exit(1)
    if trainer.publish({"w": np.ones(1, dtype=np.float32)}) != 0:
        sys.exit(2)
    if worker.await_params(timeout=WAIT_S).version != 0:
        sys.exit(2)
    predictor.close()
    try:
        pending.result(WAIT_S)
        sys.exit(2)
    except tensorshare.CancelledError:
        pass
    print("ok")
