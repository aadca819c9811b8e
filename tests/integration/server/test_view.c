/*
 * LIST and SAVE show the store as it was at one moment while other clients keep changing it.
 * tensord walks the bins of such a view a chunk per loop turn, so writers are served between
 * the chunks, and a bin about to change before the walk reached it has its old state captured
 * first. These tests run writers on their own connections (PUT, APPEND, GET, DELETE, new bins)
 * while LISTs and SAVEs run, log every acknowledged change with the version its reply gave,
 * and check each view against the writers' history: the view must equal the state after
 * exactly the changes with versions up to some point, with nothing before it missing and
 * nothing after it present. A SAVE is checked by killing tensord right after it and loading
 * the snapshot. STATS view_captures shows that writers did change bins the walk had not reached
 * yet (the copy-on-write path), and view_turns_last that a walk took several loop turns.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "msg.h"
#include "record.h"
#include "test_server_util.h"

/*
 * Bins filled before each test: a walk takes several loop turns. A power of two, so that the
 * name table (one bucket per bin at most) is full with 32768 buckets and doubles at the next new
 * bin. The writers change only these names (they delete bins and create them again, so there
 * are never more), and the creator, started once a view has begun, adds new ones: the table
 * then doubles while that view is being walked.
 */
#define V_BINS     32768u
#define V_CREATE   40000u /* names only the creator makes, one after the other */
#define V_RANDOM   V_BINS /* the writers pick among the first V_RANDOM names */
#define V_NAMES    (V_RANDOM + V_CREATE)
#define V_WRITERS  2       /* writer connections */
#define V_WINDOW   256u    /* requests a writer may keep in flight */
#define V_WIN_RAND 32u     /* requests each random writer keeps in flight */
#define V_MAX_OPS  400000u /* requests per writer at most (they normally stop much earlier) */
#define V_ROUNDS   6       /* views taken until one saw a change before its walk got there */
#define V_FILL_WIN 1024u   /* PUTs in flight while filling or checking */
#define V_POLL_MAX 2000    /* STATS polls (at most 2 ms apart) while waiting */

enum { EV_PUT, EV_APPEND, EV_GET, EV_DELETE };

/* One acknowledged change: what it did and the version its reply carried. */
typedef struct ev {
    uint64_t version;
    uint32_t bin;
    uint8_t op;
    uint8_t emptied; /* a GET that took the last item (the bin is gone) */
    int64_t value;   /* the item written, or the item a GET took */
} ev;

typedef struct evlog {
    ev *e;
    size_t n, cap;
} evlog;

static tsh_server srv;
static char snap[512];
static uint8_t *tmpl; /* a record of one int; its value is patched per write */
static size_t tmpl_len;

static void log_add(evlog *l, const ev *e)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 4096;
        l->e = realloc(l->e, l->cap * sizeof(*l->e));
        if (l->e == NULL)
            abort();
    }
    l->e[l->n++] = *e;
}

static void bin_name(uint32_t bin, char *out, size_t cap)
{
    snprintf(out, cap, "v%05u", bin);
}

/* The template record holding v (the int is the record's root value, after the header). */
static const uint8_t *rec_of(uint8_t *buf, int64_t v)
{
    memcpy(buf, tmpl, tmpl_len);
    ts__put_u64le(buf + TS_REC_HDR_SIZE + 1, (uint64_t)v);
    return buf;
}

/* ---------------------------------------------------------------------------------------------
 * Writers: threads with their own connection, no cmocka calls (failures go to why).
 */
typedef struct writer {
    pthread_t thr;
    int fd;
    unsigned id;
    uint64_t rng;
    evlog log;
    atomic_int *stop;
    int shutdown_ok; /* SHUTTING_DOWN replies and the end of the stream are expected */
    unsigned window; /* requests in flight at most */
    uint32_t create_next, create_end; /* the creator: PUTs of these new names in order */
    unsigned long sent, acked;
    char why[160]; /* empty unless the writer failed */
} writer;

typedef struct pend {
    uint32_t rid;
    uint32_t bin;
    uint8_t op;
    int64_t value;
} pend;

static uint64_t rnd(writer *w)
{
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return w->rng;
}

static int writer_send(writer *w, pend *p)
{
    char name[16];
    uint8_t rec[256];
    uint64_t r = rnd(w);
    p->bin = (uint32_t)(r % V_RANDOM);
    unsigned kind = (unsigned)((r >> 32) % 20);
    p->op = kind < 6 ? EV_PUT : kind < 12 ? EV_APPEND : kind < 17 ? EV_GET : EV_DELETE;
    if (w->create_end != 0) {
        p->bin = w->create_next++;
        p->op = EV_PUT;
    }
    p->value = (int64_t)(w->id + 1) * 100000000 + (int64_t)w->sent;
    bin_name(p->bin, name, sizeof(name));
    switch (p->op) {
    case EV_PUT:
    case EV_APPEND:
        return tsu_send_store(w->fd, p->op == EV_PUT ? TS_OP_PUT : TS_OP_APPEND, p->rid, name,
                              rec_of(rec, p->value), tmpl_len);
    case EV_GET:
        return tsu_send_get(w->fd, TS_OP_GET, p->rid, name, 1);
    default:
        return tsu_send_name(w->fd, TS_OP_DELETE, p->rid, name, NULL, 0);
    }
}

/* Turn one reply into a log entry. 0, 1 at the end of the stream (shutdown), -1 on failure. */
static int writer_reply(writer *w, const pend *p, const tsu_frame *f)
{
    if (f->h.opcode == 0 && w->shutdown_ok)
        return 1; /* the connection-level SHUTTING_DOWN frame: nothing more comes */
    if (f->h.request_id != p->rid) {
        snprintf(w->why, sizeof(w->why), "reply %u for request %u", f->h.request_id, p->rid);
        return -1;
    }
    if (f->h.status == TS_ST_SHUTTING_DOWN && w->shutdown_ok)
        return 0;
    ev e = {.bin = p->bin, .op = p->op, .value = p->value};
    if (p->op == EV_GET && f->h.status == TS_ST_NOT_FOUND)
        return 0;
    if (f->h.status != TS_ST_OK) {
        snprintf(w->why, sizeof(w->why), "op %u answered status %u", p->op, f->h.status);
        return -1;
    }
    if (p->op == EV_GET) {
        ts__msg_items m;
        ts__msg_items_iter it;
        size_t off, len;
        if (ts__msg_items_decode(f->body, f->len, &m) != 0 || m.n_items != 1) {
            snprintf(w->why, sizeof(w->why), "bad ITEMS reply");
            return -1;
        }
        ts__msg_items_iter_init(&m, &it);
        if (ts__msg_items_next(&m, &it, &off, &len) != 1 || len != tmpl_len) {
            snprintf(w->why, sizeof(w->why), "bad item in a GET reply");
            return -1;
        }
        e.version = m.version;
        e.value = (int64_t)ts__get_u64le(f->body + off + TS_REC_HDR_SIZE + 1);
        e.emptied = m.remaining == 0;
    } else {
        if (f->len != TS_BIN_STATE_SIZE) {
            snprintf(w->why, sizeof(w->why), "bad BIN_STATE reply");
            return -1;
        }
        e.version = ts__get_u64le(f->body);
        if (p->op == EV_DELETE && e.version == 0)
            return 0; /* the bin did not exist: nothing changed */
    }
    log_add(&w->log, &e);
    w->acked++;
    return 0;
}

static void *writer_main(void *arg)
{
    writer *w = arg;
    pend ring[V_WINDOW]; /* indexed by request id modulo V_WINDOW (window is at most that) */
    uint32_t next = 1, head = 1; /* request ids sent, and the oldest unanswered */
    int sending = 1;
    for (;;) {
        while (sending && !atomic_load(w->stop) && next - head < w->window && w->sent < V_MAX_OPS &&
               (w->create_end == 0 || w->create_next < w->create_end)) {
            pend *p = &ring[next % V_WINDOW];
            p->rid = next;
            if (writer_send(w, p) != 0) {
                if (!w->shutdown_ok) {
                    snprintf(w->why, sizeof(w->why), "send failed");
                    return NULL;
                }
                /* Stopping: the replies to what was sent may still come (they are logged). */
                sending = 0;
                break;
            }
            next++;
            w->sent++;
        }
        if (head == next) {
            if (!sending || atomic_load(w->stop) || w->sent >= V_MAX_OPS ||
                (w->create_end != 0 && w->create_next >= w->create_end))
                return NULL;
            continue;
        }
        tsu_frame f = {0};
        if (tsu_recv(w->fd, &f) != 0) {
            if (!w->shutdown_ok)
                snprintf(w->why, sizeof(w->why), "no reply");
            return NULL;
        }
        int rc = writer_reply(w, &ring[head % V_WINDOW], &f);
        tsu_frame_free(&f);
        if (rc != 0)
            return NULL;
        head++;
    }
}

static void writer_init(writer *w, unsigned id, atomic_int *stop, int shutdown_ok)
{
    memset(w, 0, sizeof(*w));
    w->fd = tsu_client(&srv);
    w->id = id;
    w->rng = 0x9e3779b97f4a7c15ull * (id + 1) + (uint64_t)getpid();
    w->stop = stop;
    w->shutdown_ok = shutdown_ok;
    w->window = V_WIN_RAND;
}

/*
 * Connect the writers, and the creator (ws[V_WRITERS], which PUTs new names one after the other,
 * many in flight) when asked; writers_go starts the writers, creator_go the creator.
 */
static void writers_prepare(writer *ws, atomic_int *stop, int shutdown_ok, int creator)
{
    atomic_store(stop, 0);
    for (unsigned i = 0; i < V_WRITERS; i++)
        writer_init(&ws[i], i, stop, shutdown_ok);
    if (creator) {
        writer *w = &ws[V_WRITERS];
        writer_init(w, V_WRITERS, stop, shutdown_ok);
        w->window = V_WINDOW;
        w->create_next = V_RANDOM;
        w->create_end = V_NAMES;
    }
}

/* Start the writers prepared (not the creator). */
static void writers_go(writer *ws)
{
    for (unsigned i = 0; i < V_WRITERS; i++)
        assert_int_equal(pthread_create(&ws[i].thr, NULL, writer_main, &ws[i]), 0);
}

static void creator_go(writer *ws)
{
    assert_int_equal(pthread_create(&ws[V_WRITERS].thr, NULL, writer_main, &ws[V_WRITERS]), 0);
}

static void writers_start(writer *ws, atomic_int *stop, int shutdown_ok)
{
    writers_prepare(ws, stop, shutdown_ok, 0);
    writers_go(ws);
}

/* Wait until STATS view_passes reaches want: that many views have begun (bounded). */
static void wait_passes(int fd, int64_t want)
{
    int64_t now = tsu_stat(fd, "view_passes");
    for (int i = 0; i < V_POLL_MAX && now < want; i++) {
        usleep(500);
        now = tsu_stat(fd, "view_passes");
    }
    assert_true(now >= want);
}

/* Stop the writers (and the creator when there is one), check them, move their logs to all. */
static void writers_join(writer *ws, atomic_int *stop, evlog *all, int creator)
{
    atomic_store(stop, 1);
    for (unsigned i = 0; i < V_WRITERS + (creator ? 1u : 0u); i++) {
        writer *w = &ws[i];
        pthread_join(w->thr, NULL);
        close(w->fd);
        if (w->why[0] != '\0')
            fail_msg("writer %u: %s", i, w->why);
        for (size_t k = 0; k < w->log.n; k++)
            log_add(all, &w->log.e[k]);
        free(w->log.e);
    }
}

/* ---------------------------------------------------------------------------------------------
 * The model: the bins after a prefix of the history (changes in version order).
 */
typedef struct mbin {
    int exists;
    uint64_t version;
    int64_t *v;
    size_t head, n, cap;
} mbin;

static mbin model[V_NAMES];

static void model_reset(void)
{
    for (uint32_t i = 0; i < V_NAMES; i++) {
        model[i].exists = 0;
        model[i].head = model[i].n = 0;
        model[i].version = 0;
    }
}

static void model_push(mbin *b, int64_t v)
{
    if (b->head + b->n == b->cap) {
        if (b->head > 0) {
            memmove(b->v, b->v + b->head, b->n * sizeof(*b->v));
            b->head = 0;
        } else {
            b->cap = b->cap ? b->cap * 2 : 4;
            b->v = realloc(b->v, b->cap * sizeof(*b->v));
            assert_non_null(b->v);
        }
    }
    b->v[b->head + b->n++] = v;
}

static void model_apply(const ev *e)
{
    mbin *b = &model[e->bin];
    switch (e->op) {
    case EV_PUT:
    case EV_APPEND:
        if (e->op == EV_PUT || !b->exists)
            b->head = b->n = 0;
        b->exists = 1;
        model_push(b, e->value);
        b->version = e->version;
        break;
    case EV_DELETE:
        assert_true(b->exists);
        b->exists = 0;
        b->head = b->n = 0;
        break;
    case EV_GET:
        /* The history must explain what the GET took: the bin's oldest item. */
        assert_true(b->exists && b->n > 0);
        assert_true(b->v[b->head] == e->value);
        b->head++;
        b->n--;
        assert_int_equal(b->n == 0, e->emptied);
        if (b->n == 0)
            b->exists = 0;
        else
            b->version = e->version;
        break;
    default:
        fail();
    }
}

static void model_free(void)
{
    for (uint32_t i = 0; i < V_NAMES; i++) {
        free(model[i].v);
        model[i].v = NULL;
        model[i].cap = 0;
    }
}

static int ev_cmp(const void *a, const void *b)
{
    const ev *x = a, *y = b;
    return (x->version > y->version) - (x->version < y->version);
}

static void history_sort(evlog *all)
{
    qsort(all->e, all->n, sizeof(*all->e), ev_cmp);
    for (size_t i = 1; i < all->n; i++)
        assert_true(all->e[i].version > all->e[i - 1].version);
}

/* One LIST entry, its name turned into the bin number. */
typedef struct vent {
    uint32_t bin;
    uint32_t n;
    uint64_t bytes, version;
} vent;

static size_t parse_list(const tsu_frame *f, vent *out)
{
    ts__msg_list l;
    assert_int_equal(ts__msg_list_decode(f->body, f->len, &l), 0);
    assert_true(l.n <= V_NAMES);
    ts__msg_list_iter it = {0};
    ts__msg_list_entry e;
    size_t k = 0;
    while (ts__msg_list_next(&l, &it, &e) == 1) {
        assert_true(e.name_len == 6 && e.name[0] == 'v');
        char digits[8] = {0};
        memcpy(digits, e.name + 1, 5);
        out[k].bin = (uint32_t)strtoul(digits, NULL, 10);
        assert_true(out[k].bin < V_NAMES);
        out[k].n = e.n_items;
        out[k].bytes = e.bytes;
        out[k].version = e.version;
        k++;
    }
    assert_int_equal(k, l.n);
    return k;
}

/* 1 when the model shows exactly the listed bins with their counts, sizes and versions. */
static int model_matches(const vent *v, size_t n)
{
    size_t exist = 0;
    for (uint32_t i = 0; i < V_NAMES; i++)
        exist += model[i].exists != 0;
    if (exist != n)
        return 0;
    for (size_t k = 0; k < n; k++) {
        const mbin *b = &model[v[k].bin];
        if (!b->exists || b->n != v[k].n || b->version != v[k].version ||
            v[k].bytes != (uint64_t)b->n * tmpl_len)
            return 0;
    }
    return 1;
}

/*
 * Check a listed view against the history: it must be the state after every change up to
 * some version and none after. The newest version it shows fixes that point up to changes that
 * leave no version behind (a DELETE, a GET taking the last item), which are tried in turn.
 * Leaves the model at that point and returns how many changes it holds.
 */
static size_t check_view(const evlog *all, const vent *v, size_t n)
{
    uint64_t newest = 0;
    for (size_t k = 0; k < n; k++)
        if (v[k].version > newest)
            newest = v[k].version;
    model_reset();
    size_t k = 0;
    while (k < all->n && all->e[k].version <= newest)
        model_apply(&all->e[k++]);
    for (;;) {
        if (model_matches(v, n))
            return k;
        if (k == all->n || !(all->e[k].op == EV_DELETE || all->e[k].emptied)) {
            size_t extra = 0, missing = 0;
            for (size_t i = 0; i < n; i++) {
                const mbin *b = &model[v[i].bin];
                if (!b->exists || b->n != v[i].n || b->version != v[i].version)
                    extra++;
            }
            for (uint32_t i = 0; i < V_NAMES; i++)
                missing += model[i].exists != 0;
            fail_msg("the view is no point in time of the history: %zu listed, %zu in the model "
                     "after %zu of %zu changes, %zu entries differ",
                     n, missing, k, all->n, extra);
        }
        model_apply(&all->e[k++]);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Setup
 */
static int start(void **state)
{
    (void)state;
    if (tsh_server_start(&srv, NULL) != 0 || tsh_server_stop(&srv) != 0)
        return -1;
    snprintf(snap, sizeof(snap), "%s/snap", srv.dir);
    const char *args[] = {"--save", snap, "--save-interval", "0", NULL};
    return tsh_server_restart(&srv, args);
}

static int stop(void **state)
{
    (void)state;
    int rc = 0;
    if (tsh_server_alive(&srv))
        rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    model_free();
    return rc == 0 ? 0 : -1;
}

static void restart_from_snapshot(void)
{
    const char *args[] = {"--save", snap, "--save-interval", "0", NULL};
    assert_int_equal(tsh_server_restart(&srv, args), 0);
}

/* Fill V_BINS bins of one item each, logging the changes. */
static void fill(int fd, evlog *all)
{
    uint8_t rec[256];
    char name[16];
    tsu_frame f;
    for (uint32_t i = 0; i < V_BINS; i += V_FILL_WIN) {
        uint32_t end = i + V_FILL_WIN < V_BINS ? i + V_FILL_WIN : V_BINS;
        for (uint32_t b = i; b < end; b++) {
            bin_name(b, name, sizeof(name));
            assert_int_equal(tsu_send_store(fd, TS_OP_PUT, b + 1, name, rec_of(rec, b), tmpl_len),
                             0);
        }
        for (uint32_t b = i; b < end; b++) {
            tsu_expect(fd, &f, TS_OP_PUT, b + 1, TS_ST_OK);
            ev e = {.version = ts__get_u64le(f.body), .bin = b, .op = EV_PUT, .value = b};
            log_add(all, &e);
            tsu_frame_free(&f);
        }
    }
}

static size_t list_now(int fd, uint32_t rid, vent *out)
{
    assert_int_equal(tsh_send(fd, TS_OP_LIST, rid, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_LIST, rid, TS_ST_OK);
    size_t n = parse_list(&f, out);
    tsu_frame_free(&f);
    return n;
}

/* After a restart: the loaded store must equal the model (counts, versions and every item). */
static void check_loaded_items(int fd)
{
    char name[16];
    tsu_frame f;
    for (uint32_t i = 0; i < V_NAMES; i += V_FILL_WIN) {
        uint32_t end = i + V_FILL_WIN < V_NAMES ? i + V_FILL_WIN : V_NAMES;
        for (uint32_t b = i; b < end; b++) {
            bin_name(b, name, sizeof(name));
            assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, b + 1, name, 0), 0);
        }
        for (uint32_t b = i; b < end; b++) {
            const mbin *m = &model[b];
            assert_int_equal(tsu_recv(fd, &f), 0);
            assert_int_equal(f.h.request_id, b + 1);
            if (!m->exists) {
                assert_int_equal(f.h.status, TS_ST_NOT_FOUND);
                tsu_frame_free(&f);
                continue;
            }
            assert_int_equal(f.h.status, TS_ST_OK);
            ts__msg_items it;
            assert_int_equal(ts__msg_items_decode(f.body, f.len, &it), 0);
            assert_int_equal(it.n_items, m->n);
            assert_int_equal(it.version, m->version);
            ts__msg_items_iter iter;
            ts__msg_items_iter_init(&it, &iter);
            size_t off, len;
            for (size_t k = 0; k < m->n; k++) {
                assert_int_equal(ts__msg_items_next(&it, &iter, &off, &len), 1);
                assert_int_equal(tsu_item_int(f.body + off, len), m->v[m->head + k]);
            }
            tsu_frame_free(&f);
        }
    }
}

/* Wait until no view is being walked (bounded). */
static void wait_no_views(int fd)
{
    int64_t active = 1;
    for (int i = 0; i < V_POLL_MAX && active != 0; i++) {
        active = tsu_stat(fd, "view_active");
        if (active != 0)
            usleep(2000);
    }
    assert_int_equal(active, 0);
}

/* ---------------------------------------------------------------------------------------------
 * The tests
 */

/*
 * LISTs while two writers change bins and a third creates new ones: each LIST is a point in
 * time of their history, and at least one saw a change of a bin its walk had not reached yet.
 * The writers start once the LIST's view has begun, so the name table doubles during its walk
 * (the fill left it full).
 */
static void test_list_point_in_time(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    int other = tsu_client(&srv);
    evlog all = {0};
    fill(fd, &all);
    vent *v = malloc(V_NAMES * sizeof(*v));
    assert_non_null(v);
    int64_t captures = 0;
    for (int round = 0; round < V_ROUNDS && captures == 0; round++) {
        writer ws[V_WRITERS + 1];
        atomic_int stop_flag;
        writers_prepare(ws, &stop_flag, 0, round == 0);
        writers_go(ws);
        usleep(20000);
        uint32_t rid = 100 + (uint32_t)round;
        int64_t passes = tsu_stat(other, "view_passes");
        assert_int_equal(tsh_send(fd, TS_OP_LIST, rid, NULL, 0), 0);
        if (round == 0) {
            wait_passes(other, passes + 1);
            creator_go(ws);
        }
        tsu_frame f;
        tsu_expect(fd, &f, TS_OP_LIST, rid, TS_ST_OK);
        size_t n = parse_list(&f, v);
        tsu_frame_free(&f);
        usleep(20000);
        writers_join(ws, &stop_flag, &all, round == 0);
        history_sort(&all);
        (void)check_view(&all, v, n);
        captures = tsu_stat(fd, "view_captures");
    }
    assert_true(captures > 0);
    assert_true(tsu_stat(fd, "view_turns_last") > 1);
    /* Every change is in the LIST taken once the writers stopped. */
    size_t n = list_now(fd, 200, v);
    assert_int_equal(check_view(&all, v, n), all.n);
    wait_no_views(fd);
    free(v);
    free(all.e);
    close(fd);
    close(other);
}

/*
 * A SAVE while writers change bins: killed right after the SAVE's reply and restarted, tensord
 * holds exactly the state at one point of the history (every change acknowledged before the
 * SAVE began, none after), every item included. Two LISTs run at the same time on other
 * connections (three views overlapping); each is a point in time of the history too.
 */
static void test_save_and_lists_overlap(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    int l1 = tsu_client(&srv);
    int l2 = tsu_client(&srv);
    evlog all = {0};
    fill(fd, &all);
    vent *v1 = malloc(V_NAMES * sizeof(*v1));
    vent *v2 = malloc(V_NAMES * sizeof(*v2));
    assert_true(v1 != NULL && v2 != NULL);
    writer ws[V_WRITERS + 1];
    atomic_int stop_flag;
    writers_prepare(ws, &stop_flag, 0, 1);
    writers_go(ws);
    usleep(20000);
    int64_t passes = tsu_stat(l2, "view_passes");
    assert_int_equal(tsh_send(l1, TS_OP_LIST, 1, NULL, 0), 0);
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 2, NULL, 0), 0);
    /* Both views have begun (the SAVE's once a worker prepared its arrays): now the creator. */
    wait_passes(l2, passes + 2);
    creator_go(ws);
    assert_int_equal(tsh_send(l2, TS_OP_LIST, 3, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_SAVE, 2, TS_ST_OK);
    tsu_frame_free(&f);
    tsu_expect(l1, &f, TS_OP_LIST, 1, TS_ST_OK);
    size_t n1 = parse_list(&f, v1);
    tsu_frame_free(&f);
    tsu_expect(l2, &f, TS_OP_LIST, 3, TS_ST_OK);
    size_t n2 = parse_list(&f, v2);
    tsu_frame_free(&f);
    int64_t captures = tsu_stat(fd, "view_captures");
    /* The writers stop first; nothing writes the file after the SAVE (no periodic snapshots). */
    writers_join(ws, &stop_flag, &all, 1);
    tsh_server_kill(&srv);
    history_sort(&all);
    (void)check_view(&all, v1, n1);
    (void)check_view(&all, v2, n2);
    close(fd);
    close(l1);
    close(l2);
    restart_from_snapshot();
    fd = tsu_client(&srv);
    size_t n = list_now(fd, 4, v1);
    size_t k = check_view(&all, v1, n);
    assert_true(k >= V_BINS);
    check_loaded_items(fd);
    assert_true(captures > 0);
    free(v1);
    free(v2);
    free(all.e);
    close(fd);
}

/*
 * Connections that close while their LIST is being walked: everything the LIST held is returned
 * (bytes_reserved back where it was, no view left), and tensord exits cleanly (leak-free under
 * ASan). The connection is not read while its LIST runs, so the close is seen once the LIST is
 * answered at the latest.
 */
static void test_close_mid_list(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    evlog all = {0};
    fill(fd, &all);
    int64_t reserved = tsu_stat(fd, "bytes_reserved");
    int64_t passes = tsu_stat(fd, "view_passes");
    writer ws[V_WRITERS];
    atomic_int stop_flag;
    writers_start(ws, &stop_flag, 0);
    for (int i = 0; i < 4; i++) {
        int c = tsu_client(&srv);
        assert_int_equal(tsh_send(c, TS_OP_LIST, 1, NULL, 0), 0);
        if (i % 2 == 1)
            usleep(5000);
        close(c);
    }
    usleep(20000);
    writers_join(ws, &stop_flag, &all, 0);
    wait_no_views(fd);
    assert_true(tsu_stat(fd, "view_passes") >= passes + 1);
    /* A LIST whose walk ended before the close was seen is sorted first: wait for it too. */
    int64_t now = -1;
    for (int i = 0; i < V_POLL_MAX && now != reserved; i++) {
        now = tsu_stat(fd, "bytes_reserved");
        if (now != reserved)
            usleep(2000);
    }
    assert_int_equal(now, reserved);
    free(all.e);
    close(fd);
    tsu_check_healthy(&srv);
}

/*
 * SIGTERM while a LIST and a SAVE are being walked and writers are busy: LIST and SAVE are
 * answered (OK or SHUTTING_DOWN), tensord exits 0, and the final snapshot holds every change
 * that was acknowledged.
 */
static void test_shutdown_mid_pass(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    int l1 = tsu_client(&srv);
    evlog all = {0};
    fill(fd, &all);
    writer ws[V_WRITERS];
    atomic_int stop_flag;
    writers_start(ws, &stop_flag, 1);
    usleep(20000);
    int64_t passes = tsu_stat(fd, "view_passes");
    assert_int_equal(tsh_send(l1, TS_OP_LIST, 1, NULL, 0), 0);
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 2, NULL, 0), 0);
    /* Both views have begun once two more passes are counted (STATS on a third connection). */
    int other = tsu_client(&srv);
    int64_t now = passes;
    for (int i = 0; i < V_POLL_MAX && now < passes + 2; i++) {
        now = tsu_stat(other, "view_passes");
        if (now < passes + 2)
            usleep(1000);
    }
    assert_true(now >= passes + 2);
    assert_int_equal(kill(srv.pid, SIGTERM), 0);
    tsu_frame f;
    assert_int_equal(tsu_recv(l1, &f), 0);
    assert_int_equal(f.h.opcode, TS_OP_LIST);
    assert_true(f.h.status == TS_ST_OK || f.h.status == TS_ST_SHUTTING_DOWN);
    tsu_frame_free(&f);
    assert_int_equal(tsu_recv(fd, &f), 0);
    assert_int_equal(f.h.opcode, TS_OP_SAVE);
    assert_true(f.h.status == TS_ST_OK || f.h.status == TS_ST_SHUTTING_DOWN);
    tsu_frame_free(&f);
    assert_int_equal(tsh_server_stop(&srv), 0);
    writers_join(ws, &stop_flag, &all, 0);
    history_sort(&all);
    close(fd);
    close(l1);
    close(other);
    restart_from_snapshot();
    fd = tsu_client(&srv);
    vent *v = malloc(V_NAMES * sizeof(*v));
    assert_non_null(v);
    size_t n = list_now(fd, 3, v);
    assert_int_equal(check_view(&all, v, n), all.n);
    check_loaded_items(fd);
    free(v);
    free(all.e);
    close(fd);
}

/* Wait (bounded) until STATS name equals want; the last value read. */
static int64_t wait_stat(int fd, const char *name, int64_t want)
{
    int64_t now = tsu_stat(fd, name);
    for (int i = 0; i < V_POLL_MAX && now != want; i++) {
        usleep(2000);
        now = tsu_stat(fd, name);
    }
    return now;
}

/*
 * What views hold comes back exactly: two SAVEs and overlapping LISTs (one of them on a
 * connection that closes mid-walk) while writers change bins the walks have not reached yet.
 * Once all are answered and the writers stopped, bytes_reserved is where it was, orphaned_bytes
 * is 0 again (the items the snapshots took ahead of PUT, GET and DELETE were counted there
 * until their references went), no view is left and a LIST of the quiet store shows it all.
 */
static void test_view_memory_returns(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    int l1 = tsu_client(&srv);
    int l2 = tsu_client(&srv);
    evlog all = {0};
    fill(fd, &all);
    int64_t reserved = tsu_stat(fd, "bytes_reserved");
    assert_int_equal(tsu_stat(fd, "orphaned_bytes"), 0);
    int64_t captures = tsu_stat(fd, "view_captures");
    writer ws[V_WRITERS];
    atomic_int stop_flag;
    writers_start(ws, &stop_flag, 0);
    usleep(20000);
    for (uint32_t round = 0; round < 2; round++) {
        int gone = tsu_client(&srv);
        assert_int_equal(tsh_send(fd, TS_OP_SAVE, 10 + round, NULL, 0), 0);
        assert_int_equal(tsh_send(l1, TS_OP_LIST, 20 + round, NULL, 0), 0);
        assert_int_equal(tsh_send(gone, TS_OP_LIST, 1, NULL, 0), 0);
        usleep(3000);
        close(gone);
        assert_int_equal(tsh_send(l2, TS_OP_LIST, 30 + round, NULL, 0), 0);
        tsu_frame f;
        tsu_expect(fd, &f, TS_OP_SAVE, 10 + round, TS_ST_OK);
        tsu_frame_free(&f);
        tsu_expect(l1, &f, TS_OP_LIST, 20 + round, TS_ST_OK);
        tsu_frame_free(&f);
        tsu_expect(l2, &f, TS_OP_LIST, 30 + round, TS_ST_OK);
        tsu_frame_free(&f);
    }
    writers_join(ws, &stop_flag, &all, 0);
    assert_true(tsu_stat(fd, "view_captures") > captures);
    wait_no_views(fd);
    assert_int_equal(wait_stat(fd, "orphaned_bytes", 0), 0);
    assert_int_equal(wait_stat(fd, "bytes_reserved", reserved), reserved);
    history_sort(&all);
    vent *v = malloc(V_NAMES * sizeof(*v));
    assert_non_null(v);
    size_t n = list_now(fd, 40, v);
    assert_int_equal(check_view(&all, v, n), all.n);
    assert_int_equal(wait_stat(fd, "bytes_reserved", reserved), reserved);
    free(v);
    free(all.e);
    close(fd);
    close(l1);
    close(l2);
    tsu_check_healthy(&srv);
}

/*
 * A snapshot's walk takes a reference per item, so its turns are measured in items too: a store
 * of a few bins holding many items each is walked over several loop turns (about one bin per
 * turn here, each bin holding as many items as one turn's budget), not all at once. The SAVE
 * still holds every item.
 */
#define V_HEAVY_BINS  8u    /* bins of the item-heavy store */
#define V_HEAVY_ITEMS 4096u /* items in each (one loop turn's budget of the walk) */

static void test_save_turns_count_items(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    uint8_t rec[256];
    char name[16];
    tsu_frame f;
    for (uint32_t b = 0; b < V_HEAVY_BINS; b++) {
        bin_name(b, name, sizeof(name));
        for (uint32_t i = 0; i < V_HEAVY_ITEMS; i += V_FILL_WIN) {
            for (uint32_t k = i; k < i + V_FILL_WIN; k++)
                assert_int_equal(
                    tsu_send_store(fd, TS_OP_APPEND, k + 1, name, rec_of(rec, k), tmpl_len), 0);
            for (uint32_t k = i; k < i + V_FILL_WIN; k++) {
                tsu_expect(fd, &f, TS_OP_APPEND, k + 1, TS_ST_OK);
                tsu_frame_free(&f);
            }
        }
    }
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 1, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_SAVE, 1, TS_ST_OK);
    tsu_frame_free(&f);
    /* Several turns, never the whole store at once (about one bin per turn; a loaded machine
     * has been seen to take fewer turns than bins, so only "more than one" is asserted). */
    assert_true(tsu_stat(fd, "view_turns_last") > 1);
    close(fd);
    tsh_server_kill(&srv);
    restart_from_snapshot();
    fd = tsu_client(&srv);
    assert_int_equal(tsu_stat(fd, "items"), (int64_t)(V_HEAVY_BINS * V_HEAVY_ITEMS));
    close(fd);
}

/*
 * Without --save the store is freed as soon as the shutdown begins: LISTs being walked then end
 * canceled (their requests were answered SHUTTING_DOWN), while writers keep changing bins
 * until their connections close. tensord exits 0 (leak-free under ASan: the jobs of the
 * canceled views are freed).
 */
static void test_stop_cancels_views(void **state)
{
    (void)state;
    assert_int_equal(tsh_server_stop(&srv), 0);
    assert_int_equal(tsh_server_restart(&srv, NULL), 0);
    int fd = tsu_client(&srv);
    evlog all = {0};
    fill(fd, &all);
    writer ws[V_WRITERS];
    atomic_int stop_flag;
    writers_start(ws, &stop_flag, 1);
    int l[3];
    int64_t passes = tsu_stat(fd, "view_passes");
    for (int i = 0; i < 3; i++) {
        l[i] = tsu_client(&srv);
        assert_int_equal(tsh_send(l[i], TS_OP_LIST, 1, NULL, 0), 0);
    }
    wait_passes(fd, passes + 3);
    assert_int_equal(kill(srv.pid, SIGTERM), 0);
    for (int i = 0; i < 3; i++) {
        tsu_frame f;
        assert_int_equal(tsu_recv(l[i], &f), 0);
        assert_int_equal(f.h.opcode, TS_OP_LIST);
        assert_true(f.h.status == TS_ST_OK || f.h.status == TS_ST_SHUTTING_DOWN);
        tsu_frame_free(&f);
        close(l[i]);
    }
    close(fd);
    assert_int_equal(tsh_server_stop(&srv), 0);
    writers_join(ws, &stop_flag, &all, 0);
    free(all.e);
}

#define T(f) cmocka_unit_test_setup_teardown(f, start, stop)

int main(void)
{
    tmpl = tsu_rec_int(0, &tmpl_len);
    size_t other_len;
    uint8_t *other = tsu_rec_int(INT64_MAX, &other_len);
    if (other_len != tmpl_len || tmpl_len > 256)
        return 1; /* the writers patch the template: every int record must have one size */
    tsu_rec_free(other, other_len);
    const struct CMUnitTest tests[] = {
        T(test_list_point_in_time), T(test_save_and_lists_overlap), T(test_close_mid_list),
        T(test_shutdown_mid_pass),  T(test_view_memory_returns),    T(test_save_turns_count_items),
        T(test_stop_cancels_views),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tsu_rec_free(tmpl, tmpl_len);
    return rc;
}
