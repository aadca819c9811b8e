/*
 * The wake-up of blocking requesters (handoff.h): a futex word per requester on Linux, a mutex
 * and a condition variable elsewhere (or with TS_HANDOFF_PTHREAD).
 */
#include "handoff.h"

#include "hooks.h"

#if TS_HANDOFF_FUTEX
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if TS_HANDOFF_FUTEX
/*
 * The answers of one batch are handed over as a chain: the replica publishes them all, wakes the
 * first requester, and each requester wakes up to two more as it leaves (see chain_flush). The
 * replica thus makes one wake-up per batch instead of one per request, and is not preempted by
 * every requester it wakes (on a machine with few cores each of those preemptions costs a
 * context switch); the requesters run on whatever cores are free meanwhile. Only a thread inside
 * handoff_chain_begin/end collects such a chain (tls_chain); posts made elsewhere (deadlines,
 * shutdown) wake their requester at once.
 *
 * A wake may reach a word after its requester saw done and returned: a futex wake on a dead
 * address at worst wakes some later waiter there spuriously, and every futex waiter (these
 * ones included) rechecks its condition.
 */
static _Thread_local handoff_chain *tls_chain;

void (*ts__handoff_published_hook)(handoff_sync *s);

static void futex_wake_one(atomic_uint *w)
{
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

void ts__handoff_wait(handoff_sync *s)
{
    while (atomic_load_explicit(&s->done, memory_order_acquire) == 0)
        syscall(SYS_futex, (uint32_t *)&s->done, FUTEX_WAIT_PRIVATE, 0u, NULL, NULL, 0);
    for (int i = 0; i < 2; i++)
        if (s->wake[i] != NULL)
            futex_wake_one(&s->wake[i]->done);
}

void ts__handoff_post(handoff_sync *s)
{
    handoff_chain *c = tls_chain;
    if (c != NULL) {
        /* Published by chain_flush: a requester seeing done must find its wake-ups set. */
        if (c->tail != NULL)
            c->tail->link = s;
        else
            c->head = s;
        c->tail = s;
        return;
    }
    atomic_store_explicit(&s->done, 1u, memory_order_release);
    futex_wake_one(&s->done);
}

/*
 * Publish a chain's answers, then wake its first requester. The wake-ups form a binary tree in
 * answer order (the i-th wakes the 2i+1-th and the 2i+2-th), so the last requester of a batch
 * of n is woken after about log2(n) hand-overs, not n: on a machine with idle cores a long
 * chain of hand-overs from core to core would add up to hundreds of microseconds.
 *
 * The answers are published last first, so that every requester's children are published
 * before it is. A requester that was not asleep yet sees its answer as soon as it is published
 * and wakes its children at once, while this thread may still be publishing (or be preempted
 * in the middle of it): published in answer order, those children would have been woken before
 * their answers were there, have gone back to sleep, and never been woken again.
 */
static void chain_flush(handoff_chain *c)
{
    handoff_sync *first = c->head;
    handoff_sync *child = first != NULL ? first->link : NULL;
    for (handoff_sync *s = first; s != NULL; s = s->link) {
        for (int i = 0; i < 2; i++) {
            s->wake[i] = child;
            if (child != NULL)
                child = child->link;
        }
    }
    /* Reverse the links (nothing is published yet, every record is still there). */
    handoff_sync *last = NULL;
    for (handoff_sync *s = first; s != NULL;) {
        handoff_sync *next = s->link;
        s->link = last;
        last = s;
        s = next;
    }
    for (handoff_sync *s = last; s != NULL;) {
        handoff_sync *next = s->link; /* read before publishing: s may be gone once done is set */
        atomic_store_explicit(&s->done, 1u, memory_order_release);
        if (ts__handoff_published_hook != NULL)
            ts__handoff_published_hook(s);
        s = next;
    }
    c->head = c->tail = NULL;
    if (first != NULL)
        futex_wake_one(&first->done);
}

void ts__handoff_chain_begin(handoff_chain *c)
{
    c->head = c->tail = NULL;
    tls_chain = c;
}

void ts__handoff_chain_end(handoff_chain *c)
{
    tls_chain = NULL;
    chain_flush(c);
}

int ts__handoff_init(handoff_sync *s)
{
    atomic_init(&s->done, 0u);
    s->link = NULL;
    s->wake[0] = s->wake[1] = NULL;
    return 0;
}

void ts__handoff_destroy(handoff_sync *s)
{
    (void)s;
}
#else
void ts__handoff_wait(handoff_sync *s)
{
    pthread_mutex_lock(&s->mu);
    while (!s->done)
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

void ts__handoff_post(handoff_sync *s)
{
    pthread_mutex_lock(&s->mu);
    s->done = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Without a futex every post wakes its requester at once: a chain collects nothing. */
void ts__handoff_chain_begin(handoff_chain *c)
{
    c->head = c->tail = NULL;
}

void ts__handoff_chain_end(handoff_chain *c)
{
    (void)c;
}

int ts__handoff_init(handoff_sync *s)
{
    if (pthread_mutex_init(&s->mu, NULL) != 0)
        return TS_ENOMEM;
    if (ts__cond_init_monotonic(&s->cv) != 0) {
        pthread_mutex_destroy(&s->mu);
        return TS_ENOMEM;
    }
    s->done = 0;
    return 0;
}

void ts__handoff_destroy(handoff_sync *s)
{
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
}
#endif
