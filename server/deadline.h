/*
 * deadline.h - the deadline heap and timer of parked requests, shared by the stream and table
 * code (internal to tensord).
 *
 * A STREAM_READ, STREAM_RANGE or STREAM_CREDIT that waits, and a TABLE_INSERT or TABLE_SAMPLE
 * that the rate limiter holds back, each park until something answers them or their deadline
 * passes. Each of the two kinds keeps all its waits in one binary min-heap by deadline, with one
 * timer for the earliest; the heap and the timer exist only while a wait is parked, so an idle
 * server holds neither. Every wait of either kind counts the same way against --max-watch and
 * --max-memory, which tsd_wait_new and tsd_wait_free keep. Loop thread only.
 */
#ifndef TSD_DEADLINE_H
#define TSD_DEADLINE_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "server.h"

/*
 * A wait's place in its heap. It is the wait's first member, so that a pointer to it is a
 * pointer to the wait (the heap holds these, the caller converts them back).
 */
typedef struct tsd_deadline {
    uint64_t deadline; /* uv_now ms */
    uint64_t seq;      /* arrival order: equal deadlines time out in this order */
    size_t heap_idx;
} tsd_deadline;

/* The waits of one kind by deadline, and the timer for the earliest. Zeroed is empty. */
typedef struct tsd_deadlines {
    tsd_deadline **heap; /* heap[0 .. n), earliest first; NULL while no wait is parked */
    size_t n, cap;
    uint64_t seq;      /* the next wait's arrival number */
    uv_timer_t *timer; /* made with the first wait, closed when the heap empties */
} tsd_deadlines;

/*
 * Park d (borrowed until tsd_deadlines_remove) at deadline, after its equals, in the slot
 * tsd_wait_new made. Nonzero when d is now the earliest, and the timer wants rearming.
 */
int tsd_deadlines_push(tsd_deadlines *q, tsd_deadline *d, uint64_t deadline);

/* Take d, parked in q, out of the heap. The caller rearms the timer. */
void tsd_deadlines_remove(tsd_deadlines *q, tsd_deadline *d);

/* The earliest wait, or NULL when none is parked. */
static inline tsd_deadline *tsd_deadlines_first(const tsd_deadlines *q)
{
    return q->n > 0 ? q->heap[0] : NULL;
}

/*
 * Start the timer for the earliest deadline (now is uv_now in ms; cb is called once it passes),
 * or, when no wait is parked, close the timer and give the heap's memory back.
 */
void tsd_deadlines_rearm(tsd_deadlines *q, uint64_t now, uv_timer_cb cb);

/*
 * A new wait of size bytes, zeroed, for a request of c, with room made in q for its deadline:
 * counted in c->n_watch against --max-watch, and as cost bytes against --max-memory and in STATS
 * watch_bytes. The wait starts with its tsd_deadline; the caller links and pushes it. The wait,
 * or NULL with *rc TS_ETOOMANY, TS_EOOM (counted in stats.oom_rejections) or TS_ENOMEM.
 */
void *tsd_wait_new(tsd_deadlines *q, tsd_conn *c, size_t size, uint64_t cost, int *rc);

/*
 * Undo tsd_wait_new for the wait that d starts, parked in q and unlinked by the caller: out of
 * the heap, its counts and cost given back, freed. The caller rearms the timer.
 */
void tsd_wait_free(tsd_deadlines *q, tsd_conn *c, tsd_deadline *d, uint64_t cost);

/* Shutdown: stop and close the timer, if any (the waits are answered by the caller). */
void tsd_deadlines_stop(tsd_deadlines *q);

/* Close the timer, if any, and free the heap. The loop must still run to finish the close. */
void tsd_deadlines_free(tsd_deadlines *q);

#endif
