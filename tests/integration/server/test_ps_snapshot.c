/*
 * The parameter server across a restart with --save (snapshot format 4): an Adam parameter and an
 * Adam embedding table trained on a daemon that is saved, stopped and restarted from its file
 * give, push after push, exactly the values (bit for bit) of a second daemon that trained the
 * same way and was never restarted, through SAVE and through the final snapshot at SIGTERM
 * alike; a parameter and a table large enough to be copied off the loop, saved again and again
 * while pushes run and the daemon then killed, come back as one consistent moment (a value that
 * a never-stopped daemon reached, with the slots of that step: the next steps agree); a sync
 * parameter's staleness check knows the versions published before the restart; a damaged parameter
 * server section (a checksum, an optimizer out of range, a parameter without its bin or of another
 * size, an id twice) is refused with exit status 3 and a line naming the file and the problem; a
 * format 3 file still loads, and the next one written is format 4.
 */
#define _GNU_SOURCE /* memmem */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "record.h"
#include "snapfile_fix.h"
#include "tensorshare/ps.h"
#include "test_harden_util.h"

/* floats of the dense parameter; ids and width of the table's rows */
#define N_W   1000
#define DIM   8
#define N_IDS 6

static tsh_server ref;
static th_saving sv; /* the tensord under test, saving into sv.snap */

static int teardown(void **state)
{
    (void)state;
    if (ref.pid > 0)
        (void)tsh_server_stop(&ref);
    if (ref.dir[0] != '\0')
        tsh_server_cleanup(&ref);
    memset(&ref, 0, sizeof(ref));
    th_saving_teardown(&sv);
    return 0;
}

static ts_client_t *open_client(const tsh_server *srv)
{
    ts_client_t *c = NULL;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 20000;
    assert_int_equal(ts_client_open(&c, srv->addr, &o), 0);
    return c;
}

/* ---------------------------------------------------------------------------------------------
 * Training: the same deterministic steps on any daemon
 */

static const int64_t ids[N_IDS] = {3, 17, 1000000007, 0, 42, 1ll << 40};

/* Put the dense parameter "w" and make it Adam; make the Adam table "emb". */
static void make_state(ts_client_t *c)
{
    float v[N_W];
    for (int i = 0; i < N_W; i++)
        v[i] = (float)i / N_W - 0.5f;
    int64_t shape[1] = {N_W};
    ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, shape, v, TS_BORROW);
    assert_non_null(t);
    assert_int_equal(ts_put(c, "w", t, NULL), 0);
    ts_value_free(t);
    ts_ps_options_t o;
    ts_ps_options_init(&o);
    o.optimizer = TS_PS_ADAM;
    o.lr = 0.05;
    assert_int_equal(ts_ps_create(c, "w", &o, NULL), 0);
    ts_emb_options_t e;
    ts_emb_options_init(&e, DIM);
    e.optimizer = TS_PS_ADAM;
    e.init = TS_PS_INIT_NORMAL;
    e.seed = 7;
    e.lr = 0.1;
    assert_int_equal(ts_emb_create(c, "emb", &e), 0);
}

/* Step k: one push into "w" and one into "emb" (ids k % N_IDS.. only, so rows differ in age). */
static void train_step(ts_client_t *c, int k)
{
    float g[N_W];
    for (int i = 0; i < N_W; i++)
        g[i] = (float)((i * 7 + k * 13) % 23) / 23.0f - 0.4f;
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {N_W}};
    assert_int_equal(ts_ps_push(c, "w", &t, 0, 1.0, NULL), 0);
    size_t n = (size_t)(k % N_IDS) + 1;
    float rg[N_IDS * DIM];
    for (size_t i = 0; i < n * DIM; i++)
        rg[i] = (float)((int)(i * 5 + (size_t)k * 3) % 11) / 11.0f - 0.5f;
    assert_int_equal(ts_emb_push(c, "emb", ids, n, DIM, rg, 1.0, NULL), 0);
}

/* The state of c: the value of "w" and the rows of "emb" (ids and one never pushed). */
typedef struct state {
    float w[N_W];
    float rows[(N_IDS + 1) * DIM];
} ps_state_t;

static void read_state(ts_client_t *c, ps_state_t *out)
{
    ts_items_t *items = NULL;
    assert_int_equal(ts_ps_pull(c, "w", 0, &items, NULL), 0);
    assert_non_null(items);
    const ts_tensor_t *t = ts_value_tensor(ts_items_at(items, 0));
    assert_non_null(t);
    assert_true(t->dtype == TS_FLOAT32 && t->shape[0] == N_W);
    memcpy(out->w, t->data, sizeof(out->w));
    ts_items_free(items);
    int64_t q[N_IDS + 1];
    memcpy(q, ids, sizeof(ids));
    q[N_IDS] = 99;
    assert_int_equal(ts_emb_pull(c, "emb", q, N_IDS + 1, DIM, out->rows, NULL), 0);
}

/* Both daemons hold bit for bit the same state. */
static void expect_same(ts_client_t *a, ts_client_t *b)
{
    static ps_state_t x, y;
    read_state(a, &x);
    read_state(b, &y);
    assert_memory_equal(x.w, y.w, sizeof(x.w));
    assert_memory_equal(x.rows, y.rows, sizeof(x.rows));
}

/* Adam state kept by SAVE and by the final snapshot: the next steps equal a daemon never stopped.
 */
static void test_adam_survives_restart(void **state)
{
    (void)state;
    th_saving_start(&sv);
    assert_int_equal(tsh_server_start(&ref, NULL), 0);
    ts_client_t *a = open_client(&sv.srv), *b = open_client(&ref);
    make_state(a);
    make_state(b);
    for (int k = 0; k < 5; k++) {
        train_step(a, k);
        train_step(b, k);
    }
    expect_same(a, b);
    /* SAVE, then a stop that has nothing more to write. */
    assert_int_equal(ts_save(a), 0);
    ts_client_free(a);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    th_saving_restart(&sv);
    a = open_client(&sv.srv);
    expect_same(a, b);
    train_step(a, 5);
    train_step(b, 5);
    expect_same(a, b);
    /* The final snapshot at SIGTERM keeps the state too. */
    ts_client_free(a);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    th_saving_restart(&sv);
    a = open_client(&sv.srv);
    for (int k = 6; k < 9; k++) {
        train_step(a, k);
        train_step(b, k);
    }
    expect_same(a, b);
    /* Creating the table again with its settings is still accepted (every worker does). */
    ts_emb_options_t e;
    ts_emb_options_init(&e, DIM);
    e.optimizer = TS_PS_ADAM;
    e.init = TS_PS_INIT_NORMAL;
    e.seed = 7;
    e.lr = 0.1;
    assert_int_equal(ts_emb_create(a, "emb", &e), 0);
    ts_client_free(a);
    ts_client_free(b);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
}

/*
 * A worker starting again creates its parameters with keep: the restored Adam state stays (the
 * next step equals a daemon never stopped); other settings are refused with nothing changed; a
 * bin that is no parameter yet becomes one; without keep the state is reset as before.
 */
static void test_create_keep_after_restart(void **state)
{
    (void)state;
    th_saving_start(&sv);
    assert_int_equal(tsh_server_start(&ref, NULL), 0);
    ts_client_t *a = open_client(&sv.srv), *b = open_client(&ref);
    make_state(a);
    make_state(b);
    for (int k = 0; k < 5; k++) {
        train_step(a, k);
        train_step(b, k);
    }
    assert_int_equal(ts_save(a), 0);
    ts_client_free(a);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    th_saving_restart(&sv);
    a = open_client(&sv.srv);
    ts_ps_options_t o;
    ts_ps_options_init(&o);
    o.optimizer = TS_PS_ADAM;
    o.lr = 0.05;
    o.keep = 1;
    uint64_t v0 = 0, v1 = 0;
    assert_int_equal(ts_ps_pull(a, "w", 0, NULL, &v0), 0);
    assert_int_equal(ts_ps_create(a, "w", &o, &v1), 0);
    assert_int_equal(v1, v0);
    train_step(a, 5);
    train_step(b, 5);
    expect_same(a, b);
    /* Other settings with keep: refused, nothing changed. */
    o.lr = 0.06;
    assert_int_equal(ts_ps_create(a, "w", &o, NULL), TS_EINVAL);
    o.lr = 0.05;
    o.optimizer = TS_PS_SGD;
    assert_int_equal(ts_ps_create(a, "w", &o, NULL), TS_EINVAL);
    o.optimizer = TS_PS_ADAM;
    train_step(a, 6);
    train_step(b, 6);
    expect_same(a, b);
    /* A bin that is not a parameter yet becomes one with keep. */
    float v[N_W] = {0};
    int64_t shape[1] = {N_W};
    ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, shape, v, TS_BORROW);
    assert_non_null(t);
    assert_int_equal(ts_put(a, "w2", t, NULL), 0);
    ts_value_free(t);
    assert_int_equal(ts_ps_create(a, "w2", &o, NULL), 0);
    ts_tensor_t g = {.data = v, .dtype = TS_FLOAT32, .ndim = 1, .shape = {N_W}};
    assert_int_equal(ts_ps_push(a, "w2", &g, 0, 1.0, NULL), 0);
    /* Without keep the slots are reset: the next step no longer equals the reference's. */
    o.keep = 0;
    assert_int_equal(ts_ps_create(a, "w", &o, NULL), 0);
    train_step(a, 7);
    train_step(b, 7);
    static ps_state_t x, y;
    read_state(a, &x);
    read_state(b, &y);
    assert_memory_not_equal(x.w, y.w, sizeof(x.w));
    ts_client_free(a);
    ts_client_free(b);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
}

/* A sync parameter's version ring survives: staleness is judged as before the restart. */
static void test_staleness_after_restart(void **state)
{
    (void)state;
    th_saving_start(&sv);
    ts_client_t *c = open_client(&sv.srv);
    float z[8] = {0}, g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    int64_t shape[1] = {8};
    ts_value_t *v = ts_tensor_new(TS_FLOAT32, 1, shape, z, TS_BORROW);
    uint64_t v0 = 0, v1 = 0, v2 = 0, cur = 0;
    assert_int_equal(ts_put(c, "stale", v, &v0), 0);
    ts_value_free(v);
    ts_ps_options_t o;
    ts_ps_options_init(&o);
    o.optimizer = TS_PS_SUM;
    o.mode = TS_PS_SYNC;
    o.sync_k = 1;
    o.tolerance = 1;
    assert_int_equal(ts_ps_create(c, "stale", &o, NULL), 0);
    ts_tensor_t t = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {8}};
    assert_int_equal(ts_ps_push(c, "stale", &t, v0, 1.0, &v1), 0);
    assert_int_equal(ts_ps_push(c, "stale", &t, v1, 1.0, &v2), 0);
    assert_int_equal(ts_save(c), 0);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    th_saving_restart(&sv);
    c = open_client(&sv.srv);
    /* Two steps behind, tolerance 1: refused, the current version handed back. */
    assert_int_equal(ts_ps_push(c, "stale", &t, v0, 1.0, &cur), TS_ESTALE);
    assert_true(cur == v2);
    /* One step behind is within the tolerance; the sum goes on from 2. */
    assert_int_equal(ts_ps_push(c, "stale", &t, v1, 1.0, &cur), 0);
    assert_true(cur > v2);
    ts_items_t *items = NULL;
    assert_int_equal(ts_ps_pull(c, "stale", 0, &items, NULL), 0);
    const ts_tensor_t *w = ts_value_tensor(ts_items_at(items, 0));
    assert_true(((const float *)w->data)[0] == 3.0f && ((const float *)w->data)[7] == 3.0f);
    ts_items_free(items);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
}

/* ---------------------------------------------------------------------------------------------
 * SAVE while pushes run: the state taken is one consistent moment
 */

/* Floats of the large parameter and rows of the large table: both above the size copied on the
 * loop, so that their copies run on the thread pool. */
#define NB         32768
#define NR         2000
#define BIG_PUSHES 60
#define BIG_SAVES  3

static float big_g[NB], rows_g[NR * DIM];
static int64_t rows_ids[NR];

static void make_big(ts_client_t *c)
{
    static float v[NB];
    for (int i = 0; i < NB; i++)
        v[i] = (float)(i % 101) / 101.0f;
    int64_t shape[1] = {NB};
    ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, shape, v, TS_BORROW);
    assert_int_equal(ts_put(c, "big", t, NULL), 0);
    ts_value_free(t);
    ts_ps_options_t o;
    ts_ps_options_init(&o);
    o.optimizer = TS_PS_ADAM;
    assert_int_equal(ts_ps_create(c, "big", &o, NULL), 0);
    ts_emb_options_t e;
    ts_emb_options_init(&e, DIM);
    e.optimizer = TS_PS_ADAM;
    e.seed = 3;
    assert_int_equal(ts_emb_create(c, "rows", &e), 0);
}

static void push_big(ts_client_t *c)
{
    ts_tensor_t t = {.data = big_g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {NB}};
    assert_int_equal(ts_ps_push(c, "big", &t, 0, 1.0, NULL), 0);
}

static void push_rows(ts_client_t *c)
{
    assert_int_equal(ts_emb_push(c, "rows", rows_ids, NR, DIM, rows_g, 1.0, NULL), 0);
}

static void read_big(ts_client_t *c, float *out)
{
    ts_items_t *items = NULL;
    assert_int_equal(ts_ps_pull(c, "big", 0, &items, NULL), 0);
    memcpy(out, ts_value_tensor(ts_items_at(items, 0))->data, NB * sizeof(float));
    ts_items_free(items);
}

static void read_rows(ts_client_t *c, float *out)
{
    assert_int_equal(ts_emb_pull(c, "rows", rows_ids, NR, DIM, out, NULL), 0);
}

/*
 * The pusher's client is opened by the test's own thread (an assertion may fail only there), and
 * the saves begin once its first push is in, so that they always run among pushes.
 */
typedef struct big_pusher {
    ts_client_t *c;
    atomic_int pushed; /* pushes of both done */
    atomic_int done;
    int rc;
} big_pusher;

static void *big_push_thread(void *arg)
{
    big_pusher *b = arg;
    /* Until the daemon is killed under it (then a push fails: the end of the run). */
    for (int k = 0; k < BIG_PUSHES && b->rc == 0; k++) {
        ts_tensor_t t = {.data = big_g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {NB}};
        if (ts_ps_push(b->c, "big", &t, 0, 1.0, NULL) != 0 ||
            ts_emb_push(b->c, "rows", rows_ids, NR, DIM, rows_g, 1.0, NULL) != 0)
            b->rc = -1;
        else
            atomic_fetch_add(&b->pushed, 1);
    }
    atomic_store(&b->done, 1);
    return NULL;
}

static void test_save_during_pushes(void **state)
{
    (void)state;
    for (int i = 0; i < NB; i++)
        big_g[i] = (float)(i % 13) / 13.0f - 0.3f;
    for (int i = 0; i < NR; i++)
        rows_ids[i] = i * 3;
    for (int i = 0; i < NR * DIM; i++)
        rows_g[i] = (float)(i % 9) / 9.0f - 0.4f;
    th_saving_start(&sv);
    assert_int_equal(tsh_server_start(&ref, NULL), 0);
    ts_client_t *a = open_client(&sv.srv), *b = open_client(&ref);
    make_big(a);
    make_big(b);
    /*
     * A push made just after the kill waits for a reconnection up to the request timeout: 5 s
     * for this client, so that the end of the run does not wait 20 s.
     */
    ts_client_options_t po;
    ts_client_options_init(&po);
    po.request_timeout_ms = 5000;
    big_pusher bp = {.rc = 0};
    assert_int_equal(ts_client_open(&bp.c, sv.srv.addr, &po), 0);
    atomic_init(&bp.pushed, 0);
    atomic_init(&bp.done, 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, big_push_thread, &bp), 0);
    for (int i = 0; i < 2000 && atomic_load(&bp.pushed) == 0 && !atomic_load(&bp.done); i++)
        usleep(5000); /* at most 10 s */
    assert_true(atomic_load(&bp.pushed) > 0);
    int saves = 0;
    while (!atomic_load(&bp.done) && saves < BIG_SAVES) {
        assert_int_equal(ts_save(a), 0);
        saves++;
    }
    ts_client_free(a);
    /*
     * Killed while the pushes still run (no final snapshot): the file holds what the last SAVE
     * took, somewhere among them.
     */
    tsh_server_kill(&sv.srv);
    pthread_join(th, NULL);
    ts_client_free(bp.c);
    th_saving_restart(&sv);
    a = open_client(&sv.srv);
    static float x[NB], y[NB], rx[NR * DIM], ry[NR * DIM];
    read_big(a, x);
    int k = 0;
    for (;; k++) {
        read_big(b, y);
        if (memcmp(x, y, sizeof(x)) == 0)
            break;
        assert_true(k < BIG_PUSHES);
        push_big(b);
    }
    read_rows(a, rx);
    int kr = 0;
    for (;; kr++) {
        read_rows(b, ry);
        if (memcmp(rx, ry, sizeof(rx)) == 0)
            break;
        assert_true(kr < BIG_PUSHES);
        push_rows(b);
    }
    print_message("saves %d, the file holds push %d of the parameter, %d of the table\n", saves, k,
                  kr);
    /* The values came with their own slots and step counts: the next steps agree too. */
    for (int r = 0; r < 2; r++) {
        push_big(a);
        push_big(b);
        push_rows(a);
        push_rows(b);
    }
    read_big(a, x);
    read_big(b, y);
    assert_memory_equal(x, y, sizeof(x));
    read_rows(a, rx);
    read_rows(b, ry);
    assert_memory_equal(rx, ry, sizeof(rx));
    ts_client_free(a);
    ts_client_free(b);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
}

/* ---------------------------------------------------------------------------------------------
 * Damaged files and old formats
 */

static void test_damaged_ps_refused(void **state)
{
    (void)state;
    th_saving_start(&sv);
    ts_client_t *c = open_client(&sv.srv);
    /* An SGD parameter (no slots) of 4 floats first, then a momentum table of 2 rows. */
    float z[4] = {0};
    int64_t shape[1] = {4};
    ts_value_t *v = ts_tensor_new(TS_FLOAT32, 1, shape, z, TS_BORROW);
    assert_int_equal(ts_put(c, "p", v, NULL), 0);
    ts_value_free(v);
    assert_int_equal(ts_ps_create(c, "p", NULL, NULL), 0);
    ts_emb_options_t e;
    ts_emb_options_init(&e, 2);
    e.optimizer = TS_PS_MOMENTUM;
    assert_int_equal(ts_emb_create(c, "t", &e), 0);
    int64_t two[2] = {5, 9};
    float g[4] = {1, 2, 3, 4};
    assert_int_equal(ts_emb_push(c, "t", two, 2, 2, g, 1.0, NULL), 0);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    size_t len;
    uint8_t *good = th_read_file(sv.snap, &len);
    assert_int_equal(ts__get_u32le(good + 8), TSD_SNAP_FORMAT);
    uint8_t *bad = malloc(len);
    assert_non_null(bad);
    const uint8_t *sec = memmem(good, len, "TSDPSRV", 8);
    assert_non_null(sec);
    size_t ph = (size_t)(sec - good) + TSD_SNAP_SEC_SIZE; /* the parameter's header */
    size_t pf = ph + 1 + 1;                               /* its fixed part (name "p") */
    size_t ring = pf + 80 + 8;                            /* its ring: one row */
    size_t th = ring + TSD_SNAP_RING_SIZE + 8;            /* the table's header (name "t") */
    size_t tids = th + 1 + 1 + 80 + 8;                    /* its ids */
    assert_int_equal(good[th], 1);
    assert_int_equal(good[th + 1], 't');
    /* A flipped bit in the parameter's name: its header's checksum fails. */
    memcpy(bad, good, len);
    bad[ph + 1] ^= 0x01;
    th_saving_expect_refused(&sv, bad, len, "checksum mismatch in the header of parameter 0");
    /* An optimizer out of range, every checksum right. */
    memcpy(bad, good, len);
    bad[pf] = 9;
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "parameter 'p': the optimizer is out of range");
    /* A parameter whose bin is not in the file. */
    memcpy(bad, good, len);
    bad[ph + 1] = 'q';
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "parameter 'q': no such bin");
    /* A parameter of another size than its bin's tensor. */
    memcpy(bad, good, len);
    ts__put_u64le(bad + pf + 48, 5);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "its bin holds 4 elements, its state is for 5");
    /* The same id twice in the table. */
    memcpy(bad, good, len);
    memcpy(bad + tids + 8, bad + tids, 8);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "embedding table 't' holds id");
    /* A negative id. */
    memcpy(bad, good, len);
    ts__put_u64le(bad + tids, UINT64_MAX);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "row 0 has id -1, out of range");
    /* The file cut short inside the section. */
    th_saving_expect_refused(&sv, good, len - 1, "truncated");
    free(bad);
    free(good);
}

/* The record of the format 3 file's bin. */
static void old_item(void *arg, size_t index, const uint8_t **data, size_t *len)
{
    const tsu_frame *rec = arg;
    assert_int_equal(index, 0);
    *data = rec->body;
    *len = rec->len;
}

/* A format 3 file (0.5.0: no parameter server section) loads; the next one is format 4. */
static void test_format_3_loads(void **state)
{
    (void)state;
    th_saving_start(&sv);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    size_t rl;
    uint8_t *r = tsu_rec_int(1, &rl);
    tsu_frame rec = {.body = r, .len = rl};
    tsd_snapfile_bin bin = {
        .name = (const uint8_t *)"old", .name_len = 3, .version = 4, .n_items = 1};
    tsd_snapfile_head head = {.counter = 4, .n_bins = 1, .n_items = 1, .bytes = rl, .format = 3};
    FILE *f = fopen(sv.snap, "wb");
    assert_non_null(f);
    assert_int_equal(tsd_snapfile_write_all(fileno(f), &head, &bin, NULL, NULL, old_item, &rec), 0);
    fclose(f);
    ts__free_aligned(r, rl);
    size_t len;
    uint8_t *old = th_read_file(sv.snap, &len);
    assert_int_equal(ts__get_u32le(old + 8), 3);
    assert_null(memmem(old, len, "TSDPSRV", 8));
    free(old);
    th_saving_restart(&sv);
    ts_client_t *c = open_client(&sv.srv);
    ts_emb_options_t e;
    ts_emb_options_init(&e, 4);
    assert_int_equal(ts_emb_create(c, "t", &e), 0);
    ts_client_free(c);
    int fd = tsu_client(&sv.srv);
    assert_int_equal(tsu_stat(fd, "bins"), 1);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    uint8_t *now = th_read_file(sv.snap, &len);
    assert_int_equal(ts__get_u32le(now + 8), TSD_SNAP_FORMAT);
    assert_non_null(memmem(now, len, "TSDPSRV", 8));
    free(now);
    th_saving_restart(&sv);
    fd = tsu_client(&sv.srv);
    assert_int_equal(tsu_stat(fd, "bins"), 1);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_adam_survives_restart, teardown),
        cmocka_unit_test_teardown(test_create_keep_after_restart, teardown),
        cmocka_unit_test_teardown(test_staleness_after_restart, teardown),
        cmocka_unit_test_teardown(test_save_during_pushes, teardown),
        cmocka_unit_test_teardown(test_damaged_ps_refused, teardown),
        cmocka_unit_test_teardown(test_format_3_loads, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
