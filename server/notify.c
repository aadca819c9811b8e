/*
 * Listeners and waiters. Both hang off a watch: one per bin name that somebody listens to or
 * waits on (the bin itself may not exist). A watch disappears with its last listener and
 * waiter. Subscriptions and waiters are also linked into their connection, so closing a
 * connection drops them without a search.
 *
 * Coalescing. A listener whose connection has more than --notify-backlog bytes of unwritten
 * output gets no new NOTIFY frames queued: each subscription holds at most one notification
 * instead (the bin's latest change, updated in place), and the connection keeps a list of the
 * subscriptions holding one. They are sent when its output drains (write callback, cron),
 * flagged TS_NOTE_FLAG_COALESCED when they stand for more than one change. A listener that
 * never reads thus costs at most the backlog plus one small frame per bin it listens to, and
 * per bin it still sees versions in increasing order, ending with the latest.
 */
#include "server.h"

/* The watch for name, created when create is set and it is missing; NULL otherwise or ENOMEM. */
static tsd_watch *watch_get(tsd_server *srv, const uint8_t *name, size_t len, int create)
{
    tsd_watch *w = (tsd_watch *)tsd_htab_find(&srv->watches, name, len);
    if (w != NULL || !create)
        return w;
    w = ts__calloc(1, sizeof(*w) + len + 1);
    if (w == NULL)
        return NULL;
    w->node.name = (uint8_t *)(w + 1);
    memcpy(w->node.name, name, len);
    w->node.name_len = (uint8_t)len;
    w->node.hash = tsd_hash(name, len);
    tsd_htab_insert(&srv->watches, &w->node);
    return w;
}

static void watch_maybe_free(tsd_server *srv, tsd_watch *w)
{
    if (w->subs != NULL || w->waiters != NULL)
        return;
    tsd_htab_remove(&srv->watches, &w->node);
    ts__free(w);
}

int tsd_listen(tsd_server *srv, tsd_conn *c, const uint8_t *name, size_t len)
{
    tsd_watch *w = watch_get(srv, name, len, 1);
    if (w == NULL)
        return TS_ENOMEM;
    for (tsd_sub *s = c->subs; s != NULL; s = s->cnext)
        if (s->w == w)
            return 0; /* Listening twice is the same as once. */
    if (c->n_watch >= srv->cfg.max_watch) {
        watch_maybe_free(srv, w);
        return TS_ETOOMANY;
    }
    tsd_sub *s = ts__calloc(1, sizeof(*s));
    if (s == NULL) {
        watch_maybe_free(srv, w);
        return TS_ENOMEM;
    }
    s->w = w;
    s->c = c;
    s->wnext = w->subs;
    if (w->subs != NULL)
        w->subs->wprev = s;
    w->subs = s;
    s->cnext = c->subs;
    if (c->subs != NULL)
        c->subs->cprev = s;
    c->subs = s;
    c->n_watch++;
    srv->stats.listeners++;
    return 0;
}

/* Put s on its connection's held list (it holds a notification now). */
static void held_link(tsd_sub *s)
{
    tsd_conn *c = s->c;
    s->hnext = NULL;
    s->hprev = c->held_tail;
    if (c->held_tail != NULL)
        c->held_tail->hnext = s;
    else
        c->held_head = s;
    c->held_tail = s;
}

static void held_unlink(tsd_sub *s)
{
    tsd_conn *c = s->c;
    if (s->hprev != NULL)
        s->hprev->hnext = s->hnext;
    else
        c->held_head = s->hnext;
    if (s->hnext != NULL)
        s->hnext->hprev = s->hprev;
    else
        c->held_tail = s->hprev;
    s->hprev = s->hnext = NULL;
    s->held = 0;
}

/* Unlink and free a subscription; its watch is freed when unused. */
static void sub_drop(tsd_server *srv, tsd_sub *s)
{
    tsd_watch *w = s->w;
    if (s->held > 0)
        held_unlink(s);
    if (s->wprev != NULL)
        s->wprev->wnext = s->wnext;
    else
        w->subs = s->wnext;
    if (s->wnext != NULL)
        s->wnext->wprev = s->wprev;
    if (s->cprev != NULL)
        s->cprev->cnext = s->cnext;
    else
        s->c->subs = s->cnext;
    if (s->cnext != NULL)
        s->cnext->cprev = s->cprev;
    s->c->n_watch--;
    ts__free(s);
    srv->stats.listeners--;
    watch_maybe_free(srv, w);
}

int tsd_unlisten(tsd_server *srv, tsd_conn *c, const uint8_t *name, size_t len)
{
    tsd_watch *w = watch_get(srv, name, len, 0);
    if (w == NULL)
        return TS_ENOENT;
    for (tsd_sub *s = c->subs; s != NULL; s = s->cnext) {
        if (s->w == w) {
            sub_drop(srv, s);
            return 0;
        }
    }
    return TS_ENOENT;
}

static void waiter_closed(uv_handle_t *h)
{
    ts__free(h->data);
}

/* Unlink a waiter and close its timer (the waiter is freed in the close callback). */
static void waiter_drop(tsd_server *srv, tsd_waiter *wt)
{
    tsd_watch *w = wt->w;
    if (wt->wprev != NULL)
        wt->wprev->wnext = wt->wnext;
    else
        w->waiters = wt->wnext;
    if (wt->wnext != NULL)
        wt->wnext->wprev = wt->wprev;
    if (wt->cprev != NULL)
        wt->cprev->cnext = wt->cnext;
    else
        wt->c->waiters = wt->cnext;
    if (wt->cnext != NULL)
        wt->cnext->cprev = wt->cprev;
    wt->c->n_watch--;
    wt->w = NULL;
    wt->c = NULL;
    srv->stats.waiters--;
    uv_timer_stop(&wt->timer);
    uv_close((uv_handle_t *)&wt->timer, waiter_closed);
    watch_maybe_free(srv, w);
}

/* A WAIT ran out of time: answer TIMEOUT with the bin's current state. */
static void on_wait_timeout(uv_timer_t *t)
{
    tsd_waiter *wt = t->data;
    tsd_conn *c = wt->c;
    tsd_server *srv = c->srv;
    tsd_bin *bin = tsd_store_find(&srv->store, wt->w->node.name, wt->w->node.name_len);
    tsd_reply_state(c, TS_OP_WAIT, wt->rid, TS_ST_TIMEOUT, bin != NULL ? bin->version : 0,
                    bin != NULL ? bin->n_items : 0);
    waiter_drop(srv, wt);
    tsd_server_flush(srv);
}

int tsd_wait_add(tsd_server *srv, tsd_conn *c, uint32_t rid, const uint8_t *name, size_t len,
                 uint64_t after, uint32_t timeout_ms)
{
    if (c->n_watch >= srv->cfg.max_watch)
        return TS_ETOOMANY;
    tsd_watch *w = watch_get(srv, name, len, 1);
    if (w == NULL)
        return TS_ENOMEM;
    tsd_waiter *wt = ts__calloc(1, sizeof(*wt));
    if (wt == NULL) {
        watch_maybe_free(srv, w);
        return TS_ENOMEM;
    }
    uv_timer_init(srv->loop, &wt->timer);
    wt->timer.data = wt;
    wt->w = w;
    wt->c = c;
    wt->rid = rid;
    wt->after = after;
    wt->wnext = w->waiters;
    if (w->waiters != NULL)
        w->waiters->wprev = wt;
    w->waiters = wt;
    wt->cnext = c->waiters;
    if (c->waiters != NULL)
        c->waiters->cprev = wt;
    c->waiters = wt;
    c->n_watch++;
    srv->stats.waiters++;
    uv_timer_start(&wt->timer, on_wait_timeout, timeout_ms, 0);
    return 0;
}

/*
 * Queue one NOTIFY frame on c. Returns 0, or -1 when it was not queued (no more output taken,
 * or out of memory: the output code has taken the partial frame back).
 */
static int send_note(tsd_conn *c, const uint8_t *name, size_t len, uint64_t version,
                     uint32_t n_items, uint8_t event, uint8_t flags)
{
    if (tsd_out_begin(c, TS_OP_NOTIFY, 0) != 0 ||
        tsd_out_hdr(c, TS_OP_NOTIFY, 0, TS_ST_OK, TS_NOTIFY_FIXED + len) != 0)
        return -1;
    uint8_t *p = tsd_out_bytes(c, TS_NOTIFY_FIXED + len);
    if (p == NULL)
        return -1;
    ts__put_u64le(p, version);
    ts__put_u32le(p + 8, n_items);
    p[12] = event;
    p[13] = flags;
    p[14] = (uint8_t)len;
    memcpy(p + 15, name, len);
    c->srv->stats.notifications_sent++;
    return 0;
}

void tsd_notify_release_held(tsd_server *srv, tsd_conn *c)
{
    while (c->held_head != NULL && !c->out_blocked && !c->closing &&
           tsd_conn_unwritten(c) <= srv->cfg.notify_backlog) {
        tsd_sub *s = c->held_head;
        uint8_t flags = s->held > 1 ? TS_NOTE_FLAG_COALESCED : 0;
        if (send_note(c, s->w->node.name, s->w->node.name_len, s->h_version, s->h_n_items,
                      s->h_event, flags) != 0)
            return; /* Still held; the cron tries again. */
        held_unlink(s);
    }
}

void tsd_notify_change(tsd_server *srv, const uint8_t *name, size_t len, uint64_t version,
                       uint32_t n_items, uint8_t event)
{
    tsd_watch *w = watch_get(srv, name, len, 0);
    if (w == NULL)
        return;
    /*
     * Replies and notifications only queue output; no connection is closed or unlinked while
     * these lists are walked (a slow reader is cut off later, at flush time).
     */
    for (tsd_sub *s = w->subs; s != NULL; s = s->wnext) {
        if (s->held > 0) {
            /* One held already: it now stands for this change too. */
            s->held++;
            s->h_version = version;
            s->h_n_items = n_items;
            s->h_event = event;
            srv->stats.notes_coalesced++;
            continue;
        }
        tsd_conn *c = s->c;
        if (c->out_blocked || c->closing)
            continue;
        if (tsd_conn_unwritten(c) <= srv->cfg.notify_backlog &&
            send_note(c, name, len, version, n_items, event, 0) == 0)
            continue;
        /* Backed up (or out of memory): hold it. */
        s->held = 1;
        s->h_version = version;
        s->h_n_items = n_items;
        s->h_event = event;
        held_link(s);
    }
    tsd_waiter *wt = w->waiters;
    while (wt != NULL) {
        tsd_waiter *next = wt->wnext;
        if (version > wt->after) {
            tsd_reply_state(wt->c, TS_OP_WAIT, wt->rid, TS_ST_OK, version, n_items);
            if (next == NULL) {
                /* The last waiter may free the watch: do not touch w afterwards. */
                waiter_drop(srv, wt);
                return;
            }
            waiter_drop(srv, wt);
        }
        wt = next;
    }
}

void tsd_notify_conn_gone(tsd_server *srv, tsd_conn *c)
{
    while (c->subs != NULL)
        sub_drop(srv, c->subs);
    while (c->waiters != NULL)
        waiter_drop(srv, c->waiters);
}

size_t tsd_notify_n_waiters(const tsd_server *srv)
{
    return (size_t)srv->stats.waiters;
}
