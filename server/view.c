/*
 * Views: point-in-time passes over the store (store.c) walked by the loop a chunk per turn.
 *
 * A LIST of many bins or a snapshot needs every bin as it was at one moment. Walking a million
 * bins at once would hold up every other client for hundreds of milliseconds, so one idle
 * handle walks all the views in progress, TSD_VIEW_CHUNK buckets and bins per loop turn in all,
 * and the other clients' requests are served between the chunks. The store keeps each view
 * exact meanwhile: a bin about to change is handed to the views that have not walked it yet
 * before it changes (see the passes in store.c). When a view's walk ends, its done callback
 * runs on the loop thread, on the turn the walk ended. Loop thread only.
 */
#include "server.h"

/* The idle handle is freed once closed. */
static void idle_closed(uv_handle_t *h)
{
    ts__free(h);
}

/*
 * One loop turn: walk the views on with one budget between them, the first in line first, in
 * slices of TSD_VIEW_SLICE, until TSD_VIEW_CHUNK units (buckets, bins, a snapshot's items) are
 * used or TSD_VIEW_TURN_US have passed (a slow or busy machine walks less per turn, never
 * longer). A view whose walk is over leaves the line and hears of it (done); one that used up
 * the budget goes to the back of the line, so that with several views each gets its turn.
 */
static void on_view_idle(uv_idle_t *h)
{
    tsd_server *srv = h->data;
    tsd_store *s = &srv->store;
    size_t budget = TSD_VIEW_CHUNK;
    uint64_t t0 = ts__now_ns(), t = t0;
    const uint64_t end = t0 + (uint64_t)TSD_VIEW_TURN_US * 1000u;
    while (s->passes != NULL && budget > 0 && t < end) {
        tsd_pass *p = s->passes;
        uint64_t began = t;
        int over = 0;
        while (!over && budget > 0 && t < end) {
            size_t slice = budget < TSD_VIEW_SLICE ? budget : TSD_VIEW_SLICE;
            uint64_t before = p->work;
            over = tsd_store_pass_step(s, p, &slice);
            /* What the step used, which the last bin may take past the slice. */
            uint64_t used = p->work - before;
            budget = used >= budget ? 0 : budget - (size_t)used;
            t = ts__now_ns();
        }
        p->turns++;
        p->loop_ns += t - began;
        if (over) {
            tsd_store_pass_end(s, p);
            srv->stats.view_turns_last = p->turns;
            p->done(p, p->err);
            t = ts__now_ns();
            continue;
        }
        if (p->next != NULL) {
            /* To the back of the line. */
            tsd_store_pass_end(s, p);
            tsd_pass *last = s->passes;
            while (last->next != NULL)
                last = last->next;
            p->prev = last;
            last->next = p;
            s->n_passes++;
        }
    }
    uint64_t us = (ts__now_ns() - t0) / 1000u;
    if (us > srv->stats.view_turn_max_us)
        srv->stats.view_turn_max_us = us;
    if (s->passes == NULL && srv->view_idle != NULL) {
        uv_idle_stop(srv->view_idle);
        uv_close((uv_handle_t *)srv->view_idle, idle_closed);
        srv->view_idle = NULL;
    }
}

int tsd_view_start(tsd_server *srv, tsd_pass *p)
{
    tsd_store *s = &srv->store;
    srv->stats.view_passes++;
    if (srv->view_idle == NULL) {
        srv->view_idle = ts__malloc(sizeof(*srv->view_idle));
        if (srv->view_idle == NULL || uv_idle_init(srv->loop, srv->view_idle) != 0) {
            /* Nothing can walk it over the next turns: walk it now, as it used to be. */
            ts__free(srv->view_idle);
            srv->view_idle = NULL;
            (void)tsd_store_pass_run(s, p);
            srv->stats.view_turns_last = 1;
            return 1;
        }
        srv->view_idle->data = srv;
        uv_idle_start(srv->view_idle, on_view_idle);
    }
    if (tsd_store_pass_begin(s, p) != 0) {
        /* The gens are used up while other views run (once in 2^32 views): walk it now. */
        (void)tsd_store_pass_run(s, p);
        srv->stats.view_turns_last = 1;
        return 1;
    }
    return 0;
}
