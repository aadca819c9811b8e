/*
 * The deadline heap and timer of parked requests (deadline.h).
 */
#include "deadline.h"
#include "heap.h"

#include "common.h"
#include "server.h"

/* Earlier deadline first; among equal deadlines, the one that arrived first. */
static int before(const void *a, const void *b)
{
    const tsd_deadline *x = a, *y = b;
    return x->deadline < y->deadline || (x->deadline == y->deadline && x->seq < y->seq);
}

static void *get(void *h, size_t i)
{
    return ((tsd_deadlines *)h)->heap[i];
}

static void set(void *h, size_t i, void *x)
{
    tsd_deadline *d = x;
    ((tsd_deadlines *)h)->heap[i] = d;
    d->heap_idx = i;
}

static const tsd_heap_ops ops = {get, set, before};

static void handle_free(uv_handle_t *h)
{
    ts__free(h);
}

/*
 * Room for one more wait: the timer (its data set to data) when there is none, and a heap slot.
 * 0, or TS_ENOMEM with what was made kept (tsd_deadlines_rearm closes it again when no wait is
 * parked).
 */
static int deadlines_reserve(tsd_deadlines *q, uv_loop_t *loop, void *data)
{
    if (q->timer == NULL) {
        q->timer = ts__malloc(sizeof(*q->timer));
        if (q->timer == NULL)
            return TS_ENOMEM;
        uv_timer_init(loop, q->timer);
        q->timer->data = data;
    }
    if (q->n == q->cap) {
        size_t cap = q->cap != 0 ? q->cap * 2 : 16;
        tsd_deadline **arr = ts__realloc(q->heap, cap * sizeof(*arr));
        if (arr == NULL)
            return TS_ENOMEM;
        q->heap = arr;
        q->cap = cap;
    }
    return 0;
}

int tsd_deadlines_push(tsd_deadlines *q, tsd_deadline *d, uint64_t deadline)
{
    d->deadline = deadline;
    d->seq = q->seq++;
    q->heap[q->n++] = d;
    tsd_heap_up(q, q->n - 1, &ops);
    return q->heap[0] == d;
}

void tsd_deadlines_remove(tsd_deadlines *q, tsd_deadline *d)
{
    size_t i = d->heap_idx;
    tsd_deadline *last = q->heap[--q->n];
    if (i < q->n) {
        set(q, i, last);
        tsd_heap_up(q, i, &ops);
        tsd_heap_down(q, last->heap_idx, q->n, &ops);
    }
}

void tsd_deadlines_rearm(tsd_deadlines *q, uint64_t now, uv_timer_cb cb)
{
    if (q->n == 0) {
        tsd_deadlines_stop(q);
        ts__free(q->heap);
        q->heap = NULL;
        q->cap = 0;
        return;
    }
    if (q->timer == NULL)
        return; /* made by tsd_wait_new before any wait is parked */
    uint64_t due = q->heap[0]->deadline;
    uv_timer_start(q->timer, cb, due > now ? due - now : 0, 0);
}

void *tsd_wait_new(tsd_deadlines *q, tsd_conn *c, size_t size, uint64_t cost, int *rc)
{
    tsd_server *srv = c->srv;
    if (c->n_watch >= srv->cfg.max_watch) {
        *rc = TS_ETOOMANY;
        return NULL;
    }
    if (tsd_store_reserve(&srv->store, cost) != 0) {
        srv->stats.oom_rejections++;
        *rc = TS_EOOM;
        return NULL;
    }
    void *w = NULL;
    if (deadlines_reserve(q, srv->loop, srv) == 0)
        w = ts__calloc(1, size);
    if (w == NULL) {
        tsd_store_unreserve(&srv->store, cost);
        if (q->n == 0)
            tsd_deadlines_rearm(q, 0, NULL); /* closes a timer made for nothing */
        *rc = TS_ENOMEM;
        return NULL;
    }
    srv->stats.watch_bytes += cost;
    c->n_watch++;
    return w;
}

void tsd_wait_free(tsd_deadlines *q, tsd_conn *c, tsd_deadline *d, uint64_t cost)
{
    tsd_server *srv = c->srv;
    c->n_watch--;
    tsd_deadlines_remove(q, d);
    ts__free(d);
    tsd_store_unreserve(&srv->store, cost);
    srv->stats.watch_bytes -= cost;
}

void tsd_deadlines_stop(tsd_deadlines *q)
{
    if (q->timer == NULL)
        return;
    uv_timer_stop(q->timer);
    uv_close((uv_handle_t *)q->timer, handle_free);
    q->timer = NULL;
}

void tsd_deadlines_free(tsd_deadlines *q)
{
    if (q->timer != NULL) {
        uv_close((uv_handle_t *)q->timer, handle_free);
        q->timer = NULL;
    }
    ts__free(q->heap);
    q->heap = NULL;
    q->n = q->cap = 0;
}
