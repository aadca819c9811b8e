/*
 * The hand-off of an answer to a requester blocked in ts_batcher_predict (batcher/handoff.c).
 *
 * A requester sleeps on a handoff_sync of its own until the thread that answers posts it. On
 * Linux it sleeps on a futex word: the answering thread publishes with one release store and
 * wakes it with one system call, where a mutex and a condition variable cost a second wake-up
 * (the woken thread blocks again on the mutex the signaller still holds). Elsewhere, or when
 * TS_HANDOFF_PTHREAD is defined (the unit test builds both), a mutex and a condition variable
 * of its own do the same job.
 *
 * A replica thread collects the posts of one batch in a handoff_chain (handoff_chain_begin ..
 * handoff_chain_end) and wakes them together: see handoff.c. Posts outside a chain wake their
 * requester at once.
 */
#ifndef TS_BATCHER_HANDOFF_H
#define TS_BATCHER_HANDOFF_H

#include <pthread.h>
#include <stdatomic.h>

#if defined(__linux__) && !defined(TS_HANDOFF_PTHREAD)
#define TS_HANDOFF_FUTEX 1
#else
#define TS_HANDOFF_FUTEX 0
#endif

typedef struct handoff_sync {
#if TS_HANDOFF_FUTEX
    atomic_uint done;             /* 0, then 1 once the answer is published (release/acquire) */
    struct handoff_sync *link;    /* the next post of the same chain (answering side only) */
    struct handoff_sync *wake[2]; /* requesters of the same chain this one wakes, or NULL */
#else
    pthread_mutex_t mu; /* its own: answering must not contend for the batcher's lock */
    pthread_cond_t cv;
    int done;
#endif
} handoff_sync;

/* The posts of one batch, collected by the replica thread that answers them. */
typedef struct handoff_chain {
    handoff_sync *head, *tail;
} handoff_chain;

/* 0 or TS_ENOMEM. */
int ts__handoff_init(handoff_sync *s);
void ts__handoff_destroy(handoff_sync *s);
/* Block until s is posted; then wake the requesters this one is to wake (chains). */
void ts__handoff_wait(handoff_sync *s);
/*
 * Publish s (everything the requester reads must be written before): added to the calling
 * thread's chain when it has one, else woken now. The requester may return and free s as soon
 * as it is woken.
 */
void ts__handoff_post(handoff_sync *s);
/*
 * Tests only (NULL otherwise): called by handoff_chain_end on the posting thread right after
 * each requester of the chain is published, to interleave a requester's own wake-ups with the
 * publishing deterministically; s may already be gone (its requester returned): compare it,
 * never read it. Futex hand-off only.
 */
extern void (*ts__handoff_published_hook)(handoff_sync *s);
/* Collect this thread's posts in c until handoff_chain_end, which wakes them. */
void ts__handoff_chain_begin(handoff_chain *c);
void ts__handoff_chain_end(handoff_chain *c);

#endif /* TS_BATCHER_HANDOFF_H */
