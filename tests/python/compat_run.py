"""Run a program written for the original tensorshare against the test's tensord.

    python3 compat_run.py PROGRAM.py

The program is run as __main__ unchanged. It connects to port 8000, as the original README's
examples do; this runner sends TensorShare('...', 8000) (and the RL classes) to the port in
$TS_TEST_PORT instead, so that tests keep to ephemeral ports.
"""
import os
import runpy
import sys

import tensorshare.compat as compat

README_PORT = 8000
port = int(os.environ["TS_TEST_PORT"])


def _redirect(cls):
    init = cls.__init__

    def __init__(self, host, p, *args, **kwargs):
        init(self, host, port if int(p) == README_PORT else p, *args, **kwargs)

    cls.__init__ = __init__


for _cls in (compat.TensorShare, compat.RLTrainer, compat.RLWorker):
    _redirect(_cls)

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
