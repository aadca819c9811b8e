"""Streams: one producer feeding many readers through tensord (include/tensorshare/stream.h,
docs/PYTHON.md "Streams").

    with tensorshare.StreamProducer(client, "samples", max_entries=4096, window=256) as p:
        for epoch in range(E):
            for batch in loader:
                p.push({"x": batch.x, "y": batch.y})   # waits while a reader is 256 behind
            p.end_epoch(epoch)

    with tensorshare.StreamConsumer(client, "samples", "trainer-0", batch_rows=64) as c:
        for epoch in range(E):
            for batch in c:                            # ends at the producer's end_epoch
                train(batch["x"], batch["y"])          # exactly 64 rows (the last may be fewer)

Waits are in milliseconds (the names say _ms); None waits as long as it takes, in slices that
let Ctrl-C and a close() from another thread through.
"""
from ._tensorshare import StreamEntries, StreamEntry, _StreamConsumer, _StreamProducer

__all__ = ["StreamProducer", "StreamConsumer", "StreamEntry", "StreamEntries"]


class StreamProducer(_StreamProducer):
    """Appends records to a stream, waiting for credit (stream.h's ts_stream_producer_t).

    StreamProducer(client, name, config=None, *, block_ms=None, **settings)

    client is a tensorshare.Client, used for the producer's whole life (closing the Client takes
    effect once the producer is closed). config (a dict) or settings (keyword arguments:
    max_entries, max_bytes, max_age_ms, window, lease_ms; settings win over config) create the
    stream, or change the settings of an existing one; with neither the stream must exist
    (BinNotFoundError otherwise).

    block_ms: how long one push waits for credit while a live group is `window` entries behind:
    None (default) as long as it takes, 0 not at all (BackpressureError at once), else that many
    milliseconds (TimeoutError after them). Nothing is stored by a push that raises.

    push(value) -> int: append a record (as Client.append takes it); returns its id.
    end_epoch(tag) -> int: append an end-of-epoch marker (tag: an int such as the epoch number;
    never waits for credit); returns its id. Consumers' iterations end there.
    waits: how many pushes found the window full and waited; last_id: the id of the last entry
    appended. close() (also on leaving a with block) frees the producer; it is idempotent.
    Several threads may share one producer: their calls take turns.
    """

    def __init__(self, client, name, config=None, *, block_ms=None, **settings):
        if settings:
            config = dict(config or {}, **settings)
        super().__init__(client, name, config, block_ms=block_ms)

    def __repr__(self):
        return "<tensorshare.StreamProducer %r%s>" % (self.name, " closed" if self.closed else "")


class StreamConsumer(_StreamConsumer):
    """Reads a stream as a member of a group, in batches (stream.h's ts_stream_consumer_t).

    StreamConsumer(client, name, group, member=None, *, start="oldest", batch_rows=0,
                   prefetch=4, lease_ms=0, timeout_ms=None, tensor_type=None)

    Joins group (created when missing) as member (default: the group's name). One group per
    consumer gives fan-out: each gets every entry, in order. One group of several members is a
    work queue: each entry goes to one of them. start applies to a new group: "oldest" replays
    the entries the stream keeps, "newest" starts with those appended after the join.

    batch_rows=0 hands out records as they were appended. batch_rows=B re-slices them: every
    tensor of a record (its root, or the tensors of its root dict; all with the same first
    dimension) is cut and joined along the first dimension into batches of exactly B rows,
    whatever the producer's batch size; a batch never spans an end-of-epoch marker, so the last
    batch of an epoch may be shorter. prefetch: entries asked for per read (1 to 1024).
    lease_ms: the group's lease (0 keeps it; the stream's for a new group): a member not heard
    from for that long stops holding the producer back and its entries go to others.

    Iterating yields batches (tensors as get() returns them: torch tensors when torch can be
    imported, or numpy with tensor_type="numpy") until an end-of-epoch marker, where the loop
    ends and .epoch holds the marker's tag; iterating again continues with the next epoch:

        for epoch in range(E):
            for batch in consumer:
                ...

    read() -> batch or None: one step (None at a marker). Both wait up to timeout_ms for an
    entry (None: as long as it takes; 0: not at all) and raise TimeoutError when none came: a
    stream with no marker never ends an iteration by itself.

    Everything handed out counts as consumed once the next batch is asked for: it is
    acknowledged with the next read, by commit(), or by close(). A consumer of the same group
    and member that joins later (after close(), a crash, on another host) resumes right after
    the acknowledged rows; what was handed out and not acknowledged comes again first.
    close(leave=False) commits and frees the consumer; leave=True also removes the member from
    its group (a with block closes without leaving). Attributes: first_id and last_id (the
    entries the last batch's rows came from), lost (entries the group lost to the stream's
    replay window), epoch, name, group, member, closed. Several threads may share one consumer:
    their calls take turns.
    """

    def __repr__(self):
        return "<tensorshare.StreamConsumer %r group=%r member=%r%s>" % (
            self.name, self.group, self.member, " closed" if self.closed else "")
