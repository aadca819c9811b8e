#!/bin/sh
# stream_example_test.sh DEMO TENSORD STREAM_PRODUCER STREAM_CONSUMER
#
# Runs the stream example as the README and docs/STREAMS.md run it (examples/stream_demo.sh),
# with smaller counts: one producer, four consumers at batch sizes 16, 32, 48 and 64, one
# joining late (it replays the window) and one killed with SIGKILL in the middle of an epoch and
# started again (it resumes after its last acknowledgement). The demo checks every consumer's
# whole epochs (rows and the sum of the row hashes) against the producer's, that the restarted
# consumer got again only rows of its uncommitted tail, and that no consumer saw a row out of
# order or corrupt; it stops everything it started.
set -eu
demo=$1
TENSORD=$2 STREAM_PRODUCER=$3 STREAM_CONSUMER=$4
export TENSORD STREAM_PRODUCER STREAM_CONSUMER
out=$(sh "$demo" --epochs 3 --batches-per-epoch 12 --step-ms 2 2>&1) || {
    echo "$out"
    echo "stream_example_test: the demo failed"
    exit 1
}
echo "$out" | tail -n 20
echo "$out" | grep -q "^stream_demo: ok: " || { echo "stream_example_test: no ok line"; exit 1; }
echo "stream_example_test: ok"
