/*
 * tsinfer: serve a TorchScript model through tensord with dynamic batching.
 *
 *   tsinfer --server HOST:PORT --model policy.pt --name policy --input :float32:8
 *           [--output :float32:4] [--max-batch 64] [--max-delay-us 500] [--device cpu:2]
 *           [--params BIN] [--timeout-ms MS] [--threads N] [--stats-s S]
 *
 * Remote workers submit to the bin NAME/requests with ts_predictor_* (batcher.h); tsinfer
 * batches their rows on the model's replicas and appends each answer to its requester's reply
 * bin. With --params it loads every {params, version} a trainer puts into BIN, between forwards.
 * SIGINT or SIGTERM stop it: pending requests are answered with TS_ECANCELED.
 *
 * tsinfer takes the requests itself (rather than with ts_batcher_serve) so that it can tell a
 * malformed request apart: one that is not a request record, names no reply bin, has no input or
 * an input that does not match the schema. Each is counted, logged (at most LOG_BURST lines per
 * LOG_WINDOW_S seconds) and, where it names a reply bin, answered with TS_ESCHEMA.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tensorshare/batcher.h"
#include "tensorshare/tensorshare.h"
#include "tensorshare/torch.h"

#define SERVE_WAIT_MS     200 /* ms; the serve thread waits this long, then checks whether to stop */
#define SERVE_RETRY_NS    50000000L /* ns; pause after a failed call, while the client reconnects */
#define SERVE_GET_BATCHES 4         /* a get takes up to this many max_batch worth of requests */
#define LOG_BURST         10        /* malformed-request lines printed per window ... */
#define STATS_MAX_S       86400     /* s; --stats-s: at most a day between statistics lines */
#define STATS_IDLE_S      3600      /* s; without --stats-s, the signal wait wakes this rarely */
#define LOG_WINDOW_S      10 /* ... of this many seconds; the rest are counted, then summed up */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tsinfer --server HOST:PORT --model FILE --name NAME --input SCHEMA\n"
            "               [--output SCHEMA] [--max-batch ROWS] [--max-delay-us US]\n"
            "               [--device PLACEMENT] [--params BIN] [--timeout-ms MS]\n"
            "               [--threads N] [--stats-s S]\n"
            "  SCHEMA     comma-separated fields NAME:DTYPE:DIMS, per row (no batch dimension),\n"
            "             e.g. obs.x:float32:4x4,obs.id:int64: ; an empty NAME is a bare tensor\n"
            "             (:float32:8). DIMS is empty for one value per row.\n"
            "  PLACEMENT  cpu, cpu:N, cuda:I, cuda:I*K, cuda*K, cuda/N, comma-separated\n"
            "             (default cpu)\n"
            "  --stats-s S  print the statistics line every S seconds (default 0: on exit only)\n"
            "On exit tsinfer prints how many requests were answered, failed (the model failed or\n"
            "a deadline passed) and were malformed (not a request record, no reply bin, no input,\n"
            "or an input that does not match --input; each is logged on stderr, at most %d\n"
            "lines per %d s, and answered with ESCHEMA when it names a reply bin).\n",
            LOG_BURST, LOG_WINDOW_S);
}

/* Parse a decimal number in [lo, hi]. 0 or -1. */
static int parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0 || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

#define MAX_FIELDS TS_BATCHER_MAX_FIELDS

/*
 * Parse a schema into fields whose names point into buf (a writable copy of spec). Returns the
 * number of fields, or -1 with a message on stderr.
 */
static int parse_schema(char *buf, ts_field_t *fields)
{
    int n = 0;
    for (char *tok = buf, *next; tok != NULL; tok = next) {
        next = strchr(tok, ',');
        if (next != NULL)
            *next++ = '\0';
        if (n == MAX_FIELDS) {
            fprintf(stderr, "tsinfer: too many fields\n");
            return -1;
        }
        char *c1 = strchr(tok, ':');
        char *c2 = c1 != NULL ? strchr(c1 + 1, ':') : NULL;
        if (c2 == NULL) {
            fprintf(stderr, "tsinfer: field '%s': expected NAME:DTYPE:DIMS\n", tok);
            return -1;
        }
        *c1 = '\0';
        *c2 = '\0';
        ts_field_t *f = &fields[n];
        memset(f, 0, sizeof(*f));
        f->name = tok;
        f->dtype = ts_dtype_from_name(c1 + 1);
        if (f->dtype == TS_DTYPE_INVALID) {
            fprintf(stderr, "tsinfer: field '%s': unknown dtype '%s'\n", tok, c1 + 1);
            return -1;
        }
        char *dims = c2 + 1;
        while (*dims != '\0') {
            char *x = strchr(dims, 'x');
            if (x != NULL)
                *x = '\0';
            long d;
            if (f->ndim >= TS_MAX_NDIM - 1 || parse_long(dims, 0, INT32_MAX, &d) != 0) {
                fprintf(stderr, "tsinfer: field '%s': bad dimensions\n", tok);
                return -1;
            }
            f->shape[f->ndim++] = d;
            if (x == NULL)
                break;
            dims = x + 1;
        }
        n++;
    }
    return n;
}

/* ---------------------------------------------------------------------------------------------
 * Taking requests from NAME/requests (the record layout is in batcher.h)
 */
typedef struct serve_state {
    ts_batcher_t *b;
    ts_client_t *client;
    char req_bin[TS_MAX_NAME_LEN + 1];
    size_t max_items;
    atomic_int stop;
    atomic_ullong malformed; /* requests refused before reaching the model */
    /* Log rate limit; used by the serve thread only. */
    time_t window_start;
    unsigned logged, suppressed;
} serve_state;

/* The items of one get, kept until the last request decoded from them is answered. */
typedef struct shared_items {
    atomic_int refs;
    ts_items_t *items;
} shared_items;

static void shared_unref(shared_items *si)
{
    if (atomic_fetch_sub(&si->refs, 1) == 1) {
        ts_items_free(si->items);
        free(si);
    }
}

/* One request in the batcher. */
typedef struct request {
    serve_state *srv;
    shared_items *si;
    int64_t id;
    char reply[TS_MAX_NAME_LEN + 1];
} request;

static void reply_sent(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)status;
    (void)res;
    ts_value_free(arg);
}

/*
 * Append {id, status, version, output | error} to a reply bin; output is taken over. A reply
 * that cannot be sent is dropped: the requester's own deadline covers it.
 */
static void send_reply(ts_client_t *c, const char *bin, int64_t id, int status, ts_value_t *output,
                       int64_t version, const char *msg)
{
    ts_value_t *rec = ts_map_new();
    int rc = rec != NULL ? 0 : TS_ENOMEM;
    if (rc == 0)
        rc = ts_map_set(rec, "id", ts_int_new(id));
    if (rc == 0)
        rc = ts_map_set(rec, "status", ts_int_new(status));
    if (rc == 0)
        rc = ts_map_set(rec, "version", ts_int_new(version));
    if (rc == 0 && status == 0) {
        rc = ts_map_set(rec, "output", output);
        output = NULL;
    } else if (rc == 0) {
        const char *m = msg != NULL ? msg : ts_strerror(status);
        rc = ts_map_set(rec, "error", ts_string_new(m, strlen(m)));
    }
    ts_value_free(output);
    if (rc != 0 || ts_append_async(c, bin, rec, 0, reply_sent, rec) != 0)
        ts_value_free(rec);
}

static void on_answer(ts_batcher_t *b, int status, ts_value_t *output, int64_t version, void *arg)
{
    (void)b;
    request *r = arg;
    send_reply(r->srv->client, r->reply, r->id, status, output, version,
               status != 0 ? ts_last_error() : NULL);
    shared_unref(r->si);
    free(r);
}

/* Count a malformed request and log it, at most LOG_BURST lines per LOG_WINDOW_S seconds. */
static void malformed(serve_state *srv, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void malformed(serve_state *srv, const char *fmt, ...)
{
    atomic_fetch_add(&srv->malformed, 1);
    time_t now = time(NULL);
    if (now - srv->window_start >= LOG_WINDOW_S) {
        if (srv->suppressed > 0)
            fprintf(stderr, "tsinfer: %u more malformed requests were not shown\n",
                    srv->suppressed);
        srv->window_start = now;
        srv->logged = 0;
        srv->suppressed = 0;
    }
    if (srv->logged >= LOG_BURST) {
        srv->suppressed++;
        return;
    }
    srv->logged++;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tsinfer: malformed request in %s: ", srv->req_bin);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* Check one request record and submit it; answer at once when it cannot be submitted. */
static void dispatch(serve_state *srv, shared_items *si, const ts_value_t *rec)
{
    /* An empty map is the wake-up a stopping server of the same name appends: no request. */
    if (ts_value_type(rec) == TS_TYPE_MAP && ts_value_len(rec) == 0)
        return;
    if (ts_value_type(rec) != TS_TYPE_MAP) {
        malformed(srv, "not a map");
        return;
    }
    int64_t id = 0, timeout_ms = 0;
    const char *reply = NULL;
    size_t reply_len = 0;
    if (ts_map_get_int(rec, "id", &id) != 0) {
        malformed(srv, "no integer 'id'");
        return;
    }
    if (ts_value_string(ts_map_get(rec, "reply"), &reply, &reply_len) != 0 || reply_len == 0 ||
        reply_len > TS_MAX_NAME_LEN || memchr(reply, '\0', reply_len) != NULL) {
        malformed(srv, "request %lld: no 'reply' bin name (a string of 1 to %d bytes)",
                  (long long)id, TS_MAX_NAME_LEN);
        return;
    }
    char bin[TS_MAX_NAME_LEN + 1];
    memcpy(bin, reply, reply_len);
    bin[reply_len] = '\0';
    if (ts_map_get(rec, "timeout_ms") != NULL &&
        ts_map_get_int(rec, "timeout_ms", &timeout_ms) != 0)
        timeout_ms = 0; /* not an integer: the configured default */
    const ts_value_t *input = ts_map_get(rec, "input");
    if (input == NULL) {
        malformed(srv, "request %lld: no 'input'", (long long)id);
        send_reply(srv->client, bin, id, TS_ESCHEMA, NULL, 0, "the request has no input");
        return;
    }
    request *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        send_reply(srv->client, bin, id, TS_ENOMEM, NULL, 0, "out of memory");
        return;
    }
    r->srv = srv;
    r->si = si;
    r->id = id;
    memcpy(r->reply, bin, reply_len + 1);
    atomic_fetch_add(&si->refs, 1);
    /* The record's timeout_ms: milliseconds; 0 or absent: the batcher's default; < 0: none. */
    int t = timeout_ms > INT32_MAX ? INT32_MAX
            : timeout_ms < 0       ? TS_TIMEOUT_INFINITE
            : timeout_ms == 0      ? TS_TIMEOUT_DEFAULT
                                   : (int)timeout_ms;
    int rc = ts_batcher_predict_async(srv->b, input, 0, t, on_answer, r);
    if (rc != 0) {
        const char *why = ts_last_error();
        if (rc == TS_ESCHEMA)
            malformed(srv, "request %lld: %s", (long long)id, why);
        send_reply(srv->client, bin, id, rc, NULL, 0, why[0] != '\0' ? why : NULL);
        shared_unref(si);
        free(r);
    }
}

static void pause_retry(void)
{
    struct timespec ts = {0, SERVE_RETRY_NS};
    nanosleep(&ts, NULL);
}

static void *serve_main(void *arg)
{
    serve_state *srv = arg;
    uint64_t after = 0; /* the requests bin's change counter last seen */
    int more = 0;
    while (!atomic_load(&srv->stop)) {
        uint64_t v = 0;
        if (!more) {
            int rc = ts_wait(srv->client, srv->req_bin, after, SERVE_WAIT_MS, &v, NULL);
            if (rc == TS_ETIMEDOUT)
                continue;
            if (rc != 0) {
                pause_retry();
                continue;
            }
        }
        ts_items_t *items = NULL;
        int rc = ts_get(srv->client, srv->req_bin, srv->max_items, &items);
        more = 0;
        if (rc == TS_ENOENT) {
            after = v > after ? v : after; /* another server took them */
            continue;
        }
        if (rc != 0) {
            pause_retry();
            continue;
        }
        after = ts_items_version(items);
        more = ts_items_remaining(items) > 0;
        shared_items *si = malloc(sizeof(*si));
        if (si == NULL) {
            ts_items_free(items);
            pause_retry();
            continue;
        }
        atomic_init(&si->refs, 1);
        si->items = items;
        for (size_t i = 0; i < ts_items_count(items); i++)
            dispatch(srv, si, ts_items_at(items, i));
        shared_unref(si);
    }
    return NULL;
}

/* Stop the serve thread: wake it from its wait with the empty map every server skips. */
static void serve_stop(serve_state *srv, pthread_t th)
{
    atomic_store(&srv->stop, 1);
    ts_value_t *wake = ts_map_new();
    if (wake != NULL)
        ts_append(srv->client, srv->req_bin, wake, NULL);
    ts_value_free(wake);
    pthread_join(th, NULL);
}

/* The statistics line, printed every --stats-s seconds and on exit. */
static void print_stats(const char *when, const ts_batcher_stats_t *st,
                        unsigned long long malformed)
{
    printf("tsinfer: %s: %llu requests answered, %llu failed, %llu malformed, %llu batches, "
           "%.2f rows per batch\n",
           when, (unsigned long long)st->requests, (unsigned long long)st->failed, malformed,
           (unsigned long long)st->batches,
           st->batches ? (double)st->rows / (double)st->batches : 0.0);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    const char *server = NULL, *model = NULL, *name = NULL, *params = NULL;
    const char *device = "cpu";
    char *in_spec = NULL, *out_spec = NULL;
    long max_batch = 64, delay_us = 500, timeout_ms = 30000, threads = 0, stats_s = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        if (v == NULL) {
            bad = 1;
        } else if (strcmp(a, "--server") == 0) {
            server = v;
        } else if (strcmp(a, "--model") == 0) {
            model = v;
        } else if (strcmp(a, "--name") == 0) {
            name = v;
        } else if (strcmp(a, "--device") == 0) {
            device = v;
        } else if (strcmp(a, "--params") == 0) {
            params = v;
        } else if (strcmp(a, "--input") == 0) {
            in_spec = argv[i + 1];
        } else if (strcmp(a, "--output") == 0) {
            out_spec = argv[i + 1];
        } else if (strcmp(a, "--max-batch") == 0) {
            bad = parse_long(v, 1, 1 << 20, &max_batch);
        } else if (strcmp(a, "--max-delay-us") == 0) {
            bad = parse_long(v, 0, 60000000, &delay_us);
        } else if (strcmp(a, "--timeout-ms") == 0) {
            bad = parse_long(v, -1, INT32_MAX, &timeout_ms);
        } else if (strcmp(a, "--stats-s") == 0) {
            bad = parse_long(v, 0, STATS_MAX_S, &stats_s);
        } else if (strcmp(a, "--threads") == 0) {
            bad = parse_long(v, 1, 1024, &threads);
        } else {
            bad = 1;
        }
        if (bad) {
            fprintf(stderr, "tsinfer: bad argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
        i++;
    }
    if (server == NULL || model == NULL || name == NULL || in_spec == NULL) {
        usage(stderr);
        return 2;
    }
    ts_field_t in[MAX_FIELDS], out[MAX_FIELDS];
    int n_in = parse_schema(in_spec, in);
    int n_out = out_spec != NULL ? parse_schema(out_spec, out) : 0;
    if (n_in <= 0 || n_out < 0)
        return 2;

    /* Signals are taken by sigwait below; every thread started from here inherits the mask. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);

    if (threads > 0)
        ts_torch_set_num_threads((int)threads);
    ts_torch_model_t *proto = NULL;
    int rc = ts_torch_load_file(&proto, model, "cpu");
    if (rc != 0) {
        /* The shim's message says what failed (ts_strerror's text for TS_ENOENT is about bins). */
        fprintf(stderr, "tsinfer: loading %s: %s\n", model, ts_last_error());
        return 1;
    }
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = in;
    cfg.n_inputs = n_in;
    cfg.outputs = n_out > 0 ? out : NULL;
    cfg.n_outputs = n_out;
    cfg.max_batch = (int)max_batch;
    cfg.max_delay_us = delay_us;
    cfg.placement = device;
    cfg.cuda_devices = ts_torch_cuda_device_count();
    cfg.timeout_ms = (int)timeout_ms;
    cfg.create = ts_torch_model_create;
    cfg.create_arg = proto;
    ts_batcher_t *b = NULL;
    rc = ts_batcher_new(&b, &cfg);
    if (rc != 0) {
        fprintf(stderr, "tsinfer: %s: %s\n", ts_strerror(rc), ts_last_error());
        ts_torch_model_free(proto);
        return 1;
    }
    ts_client_t *client = NULL;
    rc = ts_client_open(&client, server, NULL);
    if (rc != 0) {
        fprintf(stderr, "tsinfer: connecting to %s: %s (%s)\n", server, ts_strerror(rc),
                ts_last_error());
        ts_batcher_free(b);
        ts_torch_model_free(proto);
        return 1;
    }
    static serve_state srv;
    srv.b = b;
    srv.client = client;
    srv.max_items = (size_t)max_batch * SERVE_GET_BATCHES;
    atomic_init(&srv.stop, 0);
    atomic_init(&srv.malformed, 0);
    pthread_t serve_th;
    int serving = 0;
    if (strlen(name) + strlen(TS_BATCHER_REQ_SUFFIX) > TS_MAX_NAME_LEN) {
        fprintf(stderr, "tsinfer: --name %s: at most %d bytes\n", name,
                (int)(TS_MAX_NAME_LEN - strlen(TS_BATCHER_REQ_SUFFIX)));
        rc = TS_ENAMETOOLONG;
    } else {
        snprintf(srv.req_bin, sizeof(srv.req_bin), "%s%s", name, TS_BATCHER_REQ_SUFFIX);
        rc = pthread_create(&serve_th, NULL, serve_main, &srv) == 0 ? 0 : TS_ENOMEM;
        serving = rc == 0;
        if (rc != 0)
            fprintf(stderr, "tsinfer: cannot start the serving thread\n");
    }
    if (rc == 0 && params != NULL) {
        rc = ts_batcher_follow_weights(b, client, params);
        if (rc != 0)
            fprintf(stderr, "tsinfer: %s: %s\n", ts_strerror(rc), ts_last_error());
    }
    if (rc == 0) {
        printf("tsinfer: serving %s%s on %s with %d replica(s) [", name, TS_BATCHER_REQ_SUFFIX,
               server, ts_batcher_replicas(b));
        for (int i = 0; i < ts_batcher_replicas(b); i++)
            printf("%s%s", i ? " " : "", ts_batcher_device(b, i));
        printf("], max batch %ld, max delay %ld us\n", max_batch, delay_us);
        fflush(stdout);
        /* Wait for a signal; with --stats-s, print the counters each time that passes. */
        for (;;) {
            struct timespec period = {stats_s > 0 ? stats_s : STATS_IDLE_S, 0};
            int sig = sigtimedwait(&sigs, NULL, &period);
            if (sig == SIGINT || sig == SIGTERM)
                break;
            if (sig < 0 && errno == EAGAIN && stats_s > 0) {
                ts_batcher_stats_t now;
                ts_batcher_stats(b, &now);
                print_stats("running", &now, atomic_load(&srv.malformed));
            }
        }
    }
    if (serving)
        serve_stop(&srv, serve_th);
    ts_batcher_stop_remote(b);
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    ts_batcher_free(b);
    ts_client_free(client);
    ts_torch_model_free(proto);
    print_stats("stopped", &st, atomic_load(&srv.malformed));
    return rc == 0 ? 0 : 1;
}
