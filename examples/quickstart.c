/*
 * quickstart: the tour of tensorshare's README, in C. It puts, peeks, gets, appends, listens
 * and lists against a running tensord, and prints what happens.
 *
 *   tensord --port 8000 &
 *   ./quickstart                 (or ./quickstart HOST:PORT, ./quickstart unix:/path)
 *
 * Exits 0 when every step worked. Build outside the tree with:
 *   cc quickstart.c $(pkg-config --cflags --libs tensorshare) -o quickstart
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tensorshare/tensorshare.h>

static atomic_int n_notes;    /* notifications seen on bin "xyz" */
static atomic_int chain_done; /* the put -> get callback chain finished (1 ok, -1 failed) */

/* A 2x2 float32 tensor of values in [-1, 1), copied into the value (TS_COPY). */
static ts_value_t *random_2x2(void)
{
    static uint32_t seed = 12345;
    float v[4];
    for (int i = 0; i < 4; i++) {
        seed = seed * 1664525u + 1013904223u;
        v[i] = (float)(seed >> 8) / (float)(1u << 23) - 1.0f;
    }
    int64_t shape[2] = {2, 2};
    return ts_tensor_new(TS_FLOAT32, 2, shape, v, TS_COPY);
}

/* {"a": 2x2 tensor, "version": 0}, like the README's dict(a=torch.randn(2, 2), version=0). */
static ts_value_t *make_record(void)
{
    ts_value_t *m = ts_map_new();
    if (m == NULL || ts_map_set(m, "a", random_2x2()) != 0 ||
        ts_map_set(m, "version", ts_int_new(0)) != 0) {
        ts_value_free(m);
        return NULL;
    }
    return m;
}

/* Print one item: its tensor values or the tensor under "a", and "version" if present. */
static void print_item(const char *what, const ts_value_t *item)
{
    const ts_tensor_t *t = ts_value_tensor(item);
    if (t == NULL)
        t = ts_map_get_tensor(item, "a");
    printf("  %s:", what);
    if (t != NULL && t->dtype == TS_FLOAT32) {
        const float *f = t->data;
        printf(" tensor [%.3f %.3f; %.3f %.3f]", (double)f[0], (double)f[1], (double)f[2],
               (double)f[3]);
    }
    int64_t version;
    if (ts_map_get_int(item, "version", &version) == 0)
        printf(" version=%lld", (long long)version);
    printf("\n");
}

/* Every change of "xyz", made by anyone (this program included). Runs on the client's thread. */
static void on_xyz(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    (void)arg;
    if (status != 0) {
        printf("  [listen] subscription to xyz ended (%s)\n", ts_err_name(status));
        return;
    }
    static const char *const names[] = {"?", "put", "append", "get", "delete", "rows"};
    const char *ev =
        n->event >= TS_EV_PUT && n->event <= TS_EV_ROWS ? names[n->event] : "connection event";
    printf("  [listen] bin %s updated by %s: %u items (version %llu)\n", n->bin, ev, n->n_items,
           (unsigned long long)n->version);
    atomic_fetch_add(&n_notes, 1);
}

/* The second link of the chain: the items of "xyz" (the callback owns them until it returns). */
static void on_got_xyz(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)arg;
    if (status != 0) {
        printf("  get xyz failed: %s\n", ts_strerror(status));
        atomic_store(&chain_done, -1);
        return;
    }
    printf("  get xyz from the callback: %zu item(s)\n", ts_items_count(res->items));
    print_item("item 0", ts_items_at(res->items, 0));
    atomic_store(&chain_done, 1);
}

/* The first link: as soon as the server has the put, get the bin back (like cb_get_data). */
static void on_put_xyz(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)arg;
    if (status != 0) {
        printf("  put xyz failed: %s\n", ts_strerror(status));
        atomic_store(&chain_done, -1);
        return;
    }
    printf("  put xyz confirmed by the server (version %llu)\n", (unsigned long long)res->version);
    if (ts_get_async(c, "xyz", 0, on_got_xyz, NULL) != 0)
        atomic_store(&chain_done, -1);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Report a failed call and give the exit status. */
static int failed(const char *what, int rc)
{
    fprintf(stderr, "quickstart: %s failed: %s %s\n", what, ts_strerror(rc), ts_last_error());
    return 1;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: quickstart [ADDRESS]\n"
               "  ADDRESS  where tensord listens: HOST:PORT, [V6ADDR]:PORT or unix:PATH\n"
               "           (default 127.0.0.1:8000)\n"
               "Exit status: 0 every step worked, 1 a step failed, 2 bad usage.\n");
}

int main(int argc, char **argv)
{
    if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        usage(stdout);
        return 0;
    }
    if (argc > 2 || (argc == 2 && argv[1][0] == '-')) {
        fprintf(stderr, "quickstart: unexpected argument '%s'\n", argv[argc > 2 ? 2 : 1]);
        usage(stderr);
        return 2;
    }
    const char *address = argc > 1 ? argv[1] : "127.0.0.1:8000";
    ts_client_t *c;
    int rc = ts_client_open(&c, address, NULL);
    if (rc != 0)
        return failed("connecting", rc);
    printf("connected to %s\n", address);
    int status = 1;

    /* put + peek: the bin keeps its item. */
    ts_value_t *rec = make_record();
    uint64_t version;
    rc = rec != NULL ? ts_put(c, "data_bin", rec, &version) : TS_ENOMEM;
    ts_value_free(rec);
    if (rc != 0)
        goto out_failed_put;
    printf("put data_bin -> version %llu\n", (unsigned long long)version);
    ts_items_t *items;
    if ((rc = ts_peek(c, "data_bin", 0, &items)) != 0) {
        failed("peek data_bin", rc);
        goto out;
    }
    printf("peek data_bin -> %zu item(s)\n", ts_items_count(items));
    print_item("item 0", ts_items_at(items, 0));
    ts_items_free(items);

    /* An asynchronous put whose callback gets the bin: callbacks may call the client. */
    printf("put xyz asynchronously, get it from the put's callback\n");
    rec = make_record();
    rc = rec != NULL ? ts_put_async(c, "xyz", rec, TS_COPY, on_put_xyz, NULL) : TS_ENOMEM;
    ts_value_free(rec); /* TS_COPY: the request holds its own copy */
    if (rc != 0) {
        failed("put xyz", rc);
        goto out;
    }
    for (int i = 0; i < 1000 && atomic_load(&chain_done) == 0; i++)
        sleep_ms(10);
    if (atomic_load(&chain_done) != 1) {
        fprintf(stderr, "quickstart: the put/get chain did not finish\n");
        goto out;
    }

    /* listen, then change the bin: every change is reported, ours included. */
    if ((rc = ts_listen(c, "xyz", on_xyz, NULL)) != 0) {
        failed("listen xyz", rc);
        goto out;
    }
    printf("listening to xyz\n");
    for (int i = 0; i < 2; i++) {
        ts_value_t *t = random_2x2();
        rc = t != NULL ? ts_append(c, "xyz", t, &version) : TS_ENOMEM;
        ts_value_free(t);
        if (rc != 0) {
            failed("append xyz", rc);
            goto out;
        }
        printf("append xyz -> version %llu\n", (unsigned long long)version);
    }
    if ((rc = ts_get(c, "xyz", 0, &items)) != 0) {
        failed("get xyz", rc);
        goto out;
    }
    printf("get xyz -> %zu item(s), the bin is gone\n", ts_items_count(items));
    for (size_t i = 0; i < ts_items_count(items); i++) {
        char what[32];
        snprintf(what, sizeof(what), "item %zu", i);
        print_item(what, ts_items_at(items, i));
    }
    ts_items_free(items);
    ts_value_t *t = random_2x2();
    rc = t != NULL ? ts_put(c, "xyz", t, &version) : TS_ENOMEM;
    ts_value_free(t);
    if (rc != 0) {
        failed("put xyz", rc);
        goto out;
    }
    printf("put xyz -> version %llu\n", (unsigned long long)version);

    /* list: every bin with its item count. */
    ts_bin_list_t *bins;
    if ((rc = ts_list(c, &bins)) != 0) {
        failed("list", rc);
        goto out;
    }
    printf("list -> %zu bin(s)\n", bins->count);
    for (size_t i = 0; i < bins->count; i++)
        printf("  %s: %u item(s), %llu bytes\n", bins->bins[i].name, bins->bins[i].n_items,
               (unsigned long long)bins->bins[i].bytes);
    ts_bin_list_free(bins);

    /* append, append, get, put: four notifications (they may trail the replies a little). */
    for (int i = 0; i < 500 && atomic_load(&n_notes) < 4; i++)
        sleep_ms(10);
    printf("%d notification(s) seen\n", atomic_load(&n_notes));
    if (atomic_load(&n_notes) < 4) {
        fprintf(stderr, "quickstart: expected 4 notifications\n");
        goto out;
    }

    ts_delete(c, "data_bin", NULL);
    ts_delete(c, "xyz", NULL);
    status = 0;
    goto out;
out_failed_put:
    failed("put data_bin", rc);
out:
    ts_client_free(c); /* ends the subscription: its callback gets its final call */
    printf("%s\n", status == 0 ? "done" : "FAILED");
    return status;
}
