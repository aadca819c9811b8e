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
 *
 * Bounded wake-ups. A change records itself in its watch (seq, the change's state) and rewinds
 * the watch's two cursors to the first listener and the first waiter; then at most
 * TSD_WAKE_BUDGET of them are visited at once, the rest on later loop turns through the wake
 * queue. A listener visited late is told of the latest change, flagged coalesced when it missed
 * one in between (its seen counter says); so per bin and connection versions still increase. A
 * waiter is checked against the bin's state at the moment it is visited, with the same rule as
 * the immediate check of WAIT (the bin exists and its version is above after_version), so a
 * waiter is answered exactly once and never with a state that does not satisfy it. Dropping a
 * listener or waiter moves a cursor that points at it; a watch being visited is not freed.
 *
 * Memory. Every subscription, waiter and watch counts against --max-memory (tsd_store_reserve),
 * and STATS reports the total as watch_bytes.
 */
#include "coord.h"
#include "ps.h"
#include "server.h"
#include "service.h"
#include "stream.h"
#include "table.h"

static void wake_run(tsd_server *srv, tsd_watch *w, uint32_t *budget);

/*
 * The state WAIT sees of w's name: a bin's version and items, or a stream's last id and entries
 * kept. 1 when either exists, else 0 (version and n are 0).
 */
static int bin_state(tsd_server *srv, const tsd_watch *w, uint64_t *version, uint32_t *n)
{
    tsd_bin *bin = tsd_store_find(&srv->store, w->node.name, w->node.name_len);
    if (bin != NULL) {
        *version = bin->version;
        *n = bin->n_items;
        return 1;
    }
    tsd_stream *st = tsd_stream_find(srv, w->node.name, w->node.name_len);
    *version = st != NULL ? st->last_id : 0;
    *n = st != NULL ? tsd_stream_n_entries(st) : 0;
    return st != NULL;
}

static void wake_enqueue(tsd_server *srv, tsd_watch *w);

/* Count bytes against --max-memory. 0 or TS_EOOM. */
static int charge(tsd_server *srv, uint64_t bytes)
{
    if (tsd_store_reserve(&srv->store, bytes) != 0) {
        srv->stats.oom_rejections++;
        return TS_EOOM;
    }
    srv->stats.watch_bytes += bytes;
    return 0;
}

static void uncharge(tsd_server *srv, uint64_t bytes)
{
    tsd_store_unreserve(&srv->store, bytes);
    srv->stats.watch_bytes -= bytes;
}

/*
 * The watch for name, created when create is set and it is missing. NULL when missing and not
 * created; *rc says why it was not created (TS_EOOM, TS_ENOMEM).
 */
static tsd_watch *watch_get(tsd_server *srv, const uint8_t *name, size_t len, int create, int *rc)
{
    tsd_watch *w = (tsd_watch *)tsd_htab_find(&srv->watches, name, len);
    if (w != NULL || !create)
        return w;
    *rc = charge(srv, TSD_WATCH_COST(len));
    if (*rc != 0)
        return NULL;
    w = ts__calloc(1, sizeof(*w) + len + 1);
    if (w == NULL) {
        uncharge(srv, TSD_WATCH_COST(len));
        *rc = TS_ENOMEM;
        return NULL;
    }
    w->node.name = (uint8_t *)(w + 1);
    memcpy(w->node.name, name, len);
    w->node.name_len = (uint8_t)len;
    w->node.hash = tsd_hash(name, len);
    tsd_htab_insert(&srv->watches, &w->node);
    return w;
}

static void wake_dequeue(tsd_server *srv, tsd_watch *w)
{
    if (!w->queued)
        return;
    if (w->qprev != NULL)
        w->qprev->qnext = w->qnext;
    else
        srv->wake_head = w->qnext;
    if (w->qnext != NULL)
        w->qnext->qprev = w->qprev;
    else
        srv->wake_tail = w->qprev;
    w->qprev = w->qnext = NULL;
    w->queued = 0;
}

static void watch_maybe_free(tsd_server *srv, tsd_watch *w)
{
    if (w->subs != NULL || w->waiters != NULL || w->in_pass)
        return;
    wake_dequeue(srv, w);
    tsd_htab_remove(&srv->watches, &w->node);
    uncharge(srv, TSD_WATCH_COST(w->node.name_len));
    ts__free(w);
}

int tsd_listen(tsd_server *srv, tsd_conn *c, const uint8_t *name, size_t len)
{
    int rc = 0;
    tsd_watch *w = watch_get(srv, name, len, 0, &rc);
    if (w != NULL)
        for (tsd_sub *s = c->subs; s != NULL; s = s->cnext)
            if (s->w == w)
                return 0; /* Listening twice is the same as once. */
    if (c->n_watch >= srv->cfg.max_watch)
        return TS_ETOOMANY;
    if (w == NULL && (w = watch_get(srv, name, len, 1, &rc)) == NULL)
        return rc;
    rc = charge(srv, TSD_SUB_COST);
    if (rc != 0) {
        watch_maybe_free(srv, w);
        return rc;
    }
    tsd_sub *s = ts__calloc(1, sizeof(*s));
    if (s == NULL) {
        uncharge(srv, TSD_SUB_COST);
        watch_maybe_free(srv, w);
        return TS_ENOMEM;
    }
    s->w = w;
    s->c = c;
    s->seen = w->seq; /* Only changes from now on are reported. */
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
    if (w->sub_cur == s)
        w->sub_cur = s->wnext;
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
    uncharge(srv, TSD_SUB_COST);
    srv->stats.listeners--;
    watch_maybe_free(srv, w);
}

int tsd_unlisten(tsd_server *srv, tsd_conn *c, const uint8_t *name, size_t len)
{
    int rc = 0;
    tsd_watch *w = watch_get(srv, name, len, 0, &rc);
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

/* ---------------------------------------------------------------------------------------------
 * The deadline heap: a binary min-heap of waiters ordered by (deadline, seq), one timer for all.
 */

static int heap_before(const tsd_waiter *a, const tsd_waiter *b)
{
    return a->deadline < b->deadline || (a->deadline == b->deadline && a->seq < b->seq);
}

static void heap_set(tsd_server *srv, size_t i, tsd_waiter *wt)
{
    srv->wheap[i] = wt;
    wt->heap_idx = i;
}

static void heap_up(tsd_server *srv, size_t i)
{
    tsd_waiter *wt = srv->wheap[i];
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!heap_before(wt, srv->wheap[parent]))
            break;
        heap_set(srv, i, srv->wheap[parent]);
        i = parent;
    }
    heap_set(srv, i, wt);
}

static void heap_down(tsd_server *srv, size_t i)
{
    tsd_waiter *wt = srv->wheap[i];
    size_t n = srv->wheap_n;
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        const tsd_waiter *best = wt;
        if (l < n && heap_before(srv->wheap[l], best)) {
            m = l;
            best = srv->wheap[l];
        }
        if (l + 1 < n && heap_before(srv->wheap[l + 1], best))
            m = l + 1;
        if (m == i)
            break;
        heap_set(srv, i, srv->wheap[m]);
        i = m;
    }
    heap_set(srv, i, wt);
}

static void heap_remove(tsd_server *srv, tsd_waiter *wt)
{
    size_t i = wt->heap_idx;
    tsd_waiter *last = srv->wheap[--srv->wheap_n];
    if (i < srv->wheap_n) {
        heap_set(srv, i, last);
        heap_up(srv, i);
        heap_down(srv, last->heap_idx);
    }
    if (srv->wheap_n == 0) {
        /* No waiter left: the array and the timer go, so nothing lingers at exit. */
        ts__free(srv->wheap);
        srv->wheap = NULL;
        srv->wheap_cap = 0;
    }
}

static void timer_closed(uv_handle_t *h)
{
    ts__free(h);
}

static void on_wait_timer(uv_timer_t *t);

/* Arm the timer for the earliest deadline, or close it when no waiter is left. */
static void timer_rearm(tsd_server *srv)
{
    if (srv->wait_timer == NULL)
        return;
    if (srv->wheap_n == 0) {
        uv_timer_stop(srv->wait_timer);
        uv_close((uv_handle_t *)srv->wait_timer, timer_closed);
        srv->wait_timer = NULL;
        return;
    }
    uint64_t now = uv_now(srv->loop), due = srv->wheap[0]->deadline;
    uv_timer_start(srv->wait_timer, on_wait_timer, due > now ? due - now : 0, 0);
}

/* Unlink and free a waiter; its watch is freed when unused. The caller rearms the timer. */
static void waiter_drop(tsd_server *srv, tsd_waiter *wt)
{
    tsd_watch *w = wt->w;
    if (w->wt_cur == wt)
        w->wt_cur = wt->wnext;
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
    heap_remove(srv, wt);
    ts__free(wt);
    uncharge(srv, TSD_WAITER_COST);
    srv->stats.waiters--;
    watch_maybe_free(srv, w);
}

/* Waiters ran out of time: answer TIMEOUT with the bin's current state, a bounded number a turn. */
static void on_wait_timer(uv_timer_t *t)
{
    tsd_server *srv = t->data;
    uint64_t now = uv_now(srv->loop);
    for (uint32_t k = 0; k < TSD_WAKE_BUDGET && srv->wheap_n > 0; k++) {
        tsd_waiter *wt = srv->wheap[0];
        if (wt->deadline > now)
            break;
        uint64_t version;
        uint32_t n;
        (void)bin_state(srv, wt->w, &version, &n);
        tsd_reply_state(wt->c, TS_OP_WAIT, wt->rid, TS_ST_TIMEOUT, version, n);
        waiter_drop(srv, wt);
    }
    /* More expired ones are left to the next turn (a timeout of 0 fires after the next poll). */
    timer_rearm(srv);
    tsd_server_flush(srv);
}

int tsd_wait_add(tsd_server *srv, tsd_conn *c, uint32_t rid, const uint8_t *name, size_t len,
                 uint64_t after, uint32_t timeout_ms)
{
    if (c->n_watch >= srv->cfg.max_watch)
        return TS_ETOOMANY;
    int rc = 0;
    tsd_watch *w = watch_get(srv, name, len, 1, &rc);
    if (w == NULL)
        return rc;
    rc = charge(srv, TSD_WAITER_COST);
    if (rc != 0) {
        watch_maybe_free(srv, w);
        return rc;
    }
    if (srv->wait_timer == NULL) {
        srv->wait_timer = ts__malloc(sizeof(*srv->wait_timer));
        if (srv->wait_timer == NULL)
            goto nomem;
        uv_timer_init(srv->loop, srv->wait_timer);
        srv->wait_timer->data = srv;
    }
    if (srv->wheap_n == srv->wheap_cap) {
        size_t cap = srv->wheap_cap != 0 ? srv->wheap_cap * 2 : 16;
        tsd_waiter **arr = ts__realloc(srv->wheap, cap * sizeof(*arr));
        if (arr == NULL)
            goto nomem;
        srv->wheap = arr;
        srv->wheap_cap = cap;
    }
    tsd_waiter *wt = ts__calloc(1, sizeof(*wt));
    if (wt == NULL)
        goto nomem;
    wt->w = w;
    wt->c = c;
    wt->rid = rid;
    wt->after = after;
    wt->deadline = uv_now(srv->loop) + timeout_ms;
    wt->seq = srv->wait_seq++;
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
    srv->wheap[srv->wheap_n++] = wt;
    heap_up(srv, srv->wheap_n - 1);
    if (srv->wheap[0] == wt)
        timer_rearm(srv);
    return 0;

nomem:
    uncharge(srv, TSD_WAITER_COST);
    if (srv->wheap_n == 0)
        timer_rearm(srv);
    watch_maybe_free(srv, w);
    return TS_ENOMEM;
}

/* ---------------------------------------------------------------------------------------------
 * Notifications and wake-ups
 */

/*
 * Queue one NOTIFY frame on c. Returns 0, or -1 when it was not queued (no more output taken,
 * or out of memory: the output code has taken the partial frame back).
 */
static int send_note(tsd_conn *c, const uint8_t *name, size_t len, uint64_t version,
                     uint32_t n_items, uint8_t event, uint8_t flags)
{
    size_t size = ts__msg_notify_size(len);
    if (tsd_out_begin(c, TS_OP_NOTIFY, 0) != 0 ||
        tsd_out_hdr(c, TS_OP_NOTIFY, 0, TS_ST_OK, size) != 0)
        return -1;
    uint8_t *p = tsd_out_bytes(c, size);
    if (p == NULL)
        return -1;
    ts__msg_notify m = {.version = version,
                        .n_items = n_items,
                        .event = event,
                        .flags = flags,
                        .name = name,
                        .name_len = len};
    (void)ts__msg_notify_encode(p, size, &m, &size);
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

/*
 * Tell listener s of its watch's latest change, unless it was told already. A listener that
 * missed changes since it was last told gets one notification for all of them, flagged
 * coalesced, exactly as one whose output is backed up.
 */
static void visit_sub(tsd_server *srv, tsd_watch *w, tsd_sub *s)
{
    uint64_t missed = w->seq - s->seen;
    if (missed == 0)
        return;
    s->seen = w->seq;
    uint32_t m = missed > UINT32_MAX ? UINT32_MAX : (uint32_t)missed;
    if (s->held > 0) {
        /* One held already: it now stands for these changes too. */
        s->held = s->held > UINT32_MAX - m ? UINT32_MAX : s->held + m;
        srv->stats.notes_coalesced += m;
    } else {
        tsd_conn *c = s->c;
        if (c->out_blocked || c->closing)
            return;
        srv->stats.notes_coalesced += m - 1;
        uint8_t flags = m > 1 ? TS_NOTE_FLAG_COALESCED : 0;
        if (tsd_conn_unwritten(c) <= srv->cfg.notify_backlog &&
            send_note(c, w->node.name, w->node.name_len, w->n_version, w->n_items, w->n_event,
                      flags) == 0)
            return;
        /* Backed up (or out of memory): hold it. */
        s->held = m;
        held_link(s);
    }
    s->h_version = w->n_version;
    s->h_n_items = w->n_items;
    s->h_event = w->n_event;
}

/*
 * Visit w's listeners and waiters from its cursors, at most *budget of them (lowered by what was
 * visited). Leaves w queued when some are left, and frees it when nobody watches it any more.
 */
static void wake_run(tsd_server *srv, tsd_watch *w, uint32_t *budget)
{
    w->in_pass = 1;
    while (w->sub_cur != NULL && *budget > 0) {
        tsd_sub *s = w->sub_cur;
        w->sub_cur = s->wnext;
        (*budget)--;
        visit_sub(srv, w, s);
    }
    if (w->wt_cur != NULL && *budget > 0) {
        /* The rule of the immediate check in WAIT: the bin exists with a version above after. */
        uint64_t version;
        uint32_t n;
        int exists = bin_state(srv, w, &version, &n);
        int dropped = 0;
        while (w->wt_cur != NULL && *budget > 0) {
            tsd_waiter *wt = w->wt_cur;
            w->wt_cur = wt->wnext;
            (*budget)--;
            if (exists && version > wt->after) {
                tsd_reply_state(wt->c, TS_OP_WAIT, wt->rid, TS_ST_OK, version, n);
                waiter_drop(srv, wt);
                dropped = 1;
            }
        }
        if (dropped)
            timer_rearm(srv);
    }
    w->in_pass = 0;
    if (w->sub_cur == NULL && w->wt_cur == NULL) {
        wake_dequeue(srv, w);
        watch_maybe_free(srv, w);
    } else if (!w->queued) {
        /* Somebody is left to visit, so w is in use and stays. */
        srv->stats.wake_deferred++;
        wake_enqueue(srv, w);
    }
}

static void idle_closed(uv_handle_t *h)
{
    ts__free(h);
}

/* One loop turn of the wake queue: at most TSD_WAKE_BUDGET visits, oldest watch first. */
static void on_wake_idle(uv_idle_t *h)
{
    tsd_server *srv = h->data;
    uint32_t budget = TSD_WAKE_BUDGET;
    while (srv->wake_head != NULL && budget > 0)
        wake_run(srv, srv->wake_head, &budget);
    if (srv->wake_head == NULL && srv->wake_idle != NULL) {
        uv_idle_stop(srv->wake_idle);
        uv_close((uv_handle_t *)srv->wake_idle, idle_closed);
        srv->wake_idle = NULL;
    }
    tsd_server_flush(srv);
}

/*
 * Queue w for the next turns. When no idle handle can be allocated the visits are done now,
 * unbounded: late is better than never.
 */
static void wake_enqueue(tsd_server *srv, tsd_watch *w)
{
    if (srv->wake_idle == NULL) {
        srv->wake_idle = ts__malloc(sizeof(*srv->wake_idle));
        if (srv->wake_idle == NULL) {
            uint32_t all = UINT32_MAX;
            wake_run(srv, w, &all);
            return;
        }
        uv_idle_init(srv->loop, srv->wake_idle);
        srv->wake_idle->data = srv;
        uv_idle_start(srv->wake_idle, on_wake_idle);
    }
    w->queued = 1;
    w->qnext = NULL;
    w->qprev = srv->wake_tail;
    if (srv->wake_tail != NULL)
        srv->wake_tail->qnext = w;
    else
        srv->wake_head = w;
    srv->wake_tail = w;
}

/* Tell the subscribers and waiters of name about a change (tsd_notify_change). */
static void notify_watchers(tsd_server *srv, const uint8_t *name, size_t len, uint64_t version,
                            uint32_t n_items, uint8_t event)
{
    int rc = 0;
    tsd_watch *w = watch_get(srv, name, len, 0, &rc);
    if (w == NULL)
        return;
    /*
     * Replies and notifications only queue output; no connection is closed or unlinked while
     * the lists are walked (a slow reader is cut off later, at flush time).
     */
    w->seq++;
    w->n_version = version;
    w->n_items = n_items;
    w->n_event = event;
    w->sub_cur = w->subs;
    w->wt_cur = w->waiters;
    if (w->queued)
        return; /* Visits are under way: they start over with this change. */
    uint32_t budget = TSD_WAKE_BUDGET;
    wake_run(srv, w, &budget);
}

void tsd_notify_change(tsd_server *srv, const uint8_t *name, size_t len, uint64_t version,
                       uint32_t n_items, uint8_t event)
{
    notify_watchers(srv, name, len, version, n_items, event);
    /* A sync step being formed for a parameter whose bin lost its tensor (ps.c). */
    tsd_ps_bin_changed(srv, name, len);
    /* Then the takers waiting for items (coord.c): their GETs notify after this change. */
    tsd_coord_changed(srv, name, len);
}

void tsd_notify_conn_gone(tsd_server *srv, tsd_conn *c)
{
    /* Its TAKEs and barrier arrivals (coord.c). */
    tsd_coord_conn_drop(srv, c, 0);
    tsd_stream_conn_gone(srv, c); /* its stream waits (stream.c) */
    tsd_table_conn_gone(srv, c);  /* its replay table waits (table.c) */
    tsd_ps_conn_gone(srv, c);     /* its parameter server requests (ps.c) */
    tsd_svc_conn_gone(srv, c);    /* its services and calls (service.c) */
    while (c->subs != NULL)
        sub_drop(srv, c->subs);
    int had = c->waiters != NULL;
    while (c->waiters != NULL)
        waiter_drop(srv, c->waiters);
    if (had)
        timer_rearm(srv);
}

size_t tsd_notify_conn_stop(tsd_server *srv, tsd_conn *c)
{
    /* Its TAKEs and barrier arrivals (coord.c), answered SHUTTING_DOWN. */
    size_t answered = tsd_coord_conn_drop(srv, c, 1);
    size_t n = tsd_stream_conn_stop(srv, c); /* its stream waits (stream.c) */
    n += tsd_table_conn_stop(srv, c);        /* its replay table waits (table.c) */
    n += tsd_ps_conn_stop(srv, c);           /* its parameter server requests (ps.c) */
    n += tsd_svc_conn_stop(srv, c);          /* its calls to services (service.c) */
    while (c->subs != NULL)
        sub_drop(srv, c->subs);
    int had = c->waiters != NULL;
    while (c->waiters != NULL) {
        tsd_waiter *wt = c->waiters;
        /* The error body of section 5, not a bin state: the wait ended without an answer. */
        tsd_reply_msg(c, TS_OP_WAIT, wt->rid, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG,
                      sizeof(TSD_SHUTDOWN_MSG) - 1);
        waiter_drop(srv, wt);
        n++;
    }
    if (had)
        timer_rearm(srv);
    return n + answered;
}

size_t tsd_notify_n_waiters(const tsd_server *srv)
{
    return (size_t)srv->stats.waiters;
}
