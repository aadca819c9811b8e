/*
 * tsinfer: serve a TorchScript model through tensord with dynamic batching.
 *
 *   tsinfer --server HOST:PORT --model policy.pt --name policy --input :float32:8
 *           [--output :float32:4] [--max-batch 64] [--max-delay-us 500] [--device cpu:2]
 *           [--params BIN] [--timeout-ms MS] [--threads N] [--stats-s S]
 *           [--min-delay-us US] [--preferred ROWS,...] [--amp bfloat16|float16]
 *           [--shm [SLOTS]] [--answer-threads N [--overlap]]
 *
 * Remote workers call the service NAME with ts_predictor_* (batcher.h), or relay through the bin
 * NAME/requests (TS_PREDICTOR_RELAY); tsinfer batches their rows on the model's replicas and
 * answers each call (or appends each relayed answer to its requester's reply bin). With --shm it
 * also offers shared-memory slots (ts_batcher_serve_shm, advertised in the bin NAME/shm) to the
 * predictors on its own host, whose blocking predictions then skip tensord. With --params it
 * loads every {params, version} a trainer puts into BIN, between forwards, and logs each one that
 * a replica does not load. SIGINT or SIGTERM stop it: pending requests are answered with
 * TS_ECANCELED.
 *
 * ts_batcher_serve_with takes the requests; it counts each malformed request (not a request
 * record, no input, no reply bin for a relayed one, or an input that does not match the
 * schema), answers it with TS_ESCHEMA (a relayed one where it names a reply bin), and reports it
 * to on_malformed, which logs it here (at most LOG_BURST lines per LOG_WINDOW_S seconds).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tensorshare/batcher.h"
#include "tensorshare/tensorshare.h"
#include "tensorshare/torch.h"

#define LOG_BURST    10    /* malformed-request lines printed per window ... */
#define STATS_MAX_S  86400 /* s; --stats-s: at most a day between statistics lines */
#define STATS_IDLE_S 3600  /* s; without --stats-s, the signal wait wakes this rarely */
#define LOG_WINDOW_S 10    /* ... of this many seconds; the rest are counted, then summed up */
/* ms; --params: one wait for the bin lasts this long at most, so that stopping is prompt */
#define FOLLOW_WAIT_MS 200
/* ms; --params: the pause after a wait or a read that failed (the connection is down) */
#define FOLLOW_RETRY_MS 50

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tsinfer --server HOST:PORT --model FILE --name NAME --input SCHEMA\n"
            "               [--output SCHEMA] [--max-batch ROWS] [--max-delay-us US]\n"
            "               [--device PLACEMENT] [--params BIN] [--timeout-ms MS]\n"
            "               [--threads N] [--stats-s S] [--min-delay-us US]\n"
            "               [--preferred ROWS,...] [--amp bfloat16|float16] [--shm [SLOTS]]\n"
            "               [--answer-threads N [--overlap]]\n"
            "  SCHEMA     comma-separated fields NAME:DTYPE:DIMS, per row (no batch dimension),\n"
            "             e.g. obs.x:float32:4x4,obs.id:int64: ; an empty NAME is a bare tensor\n"
            "             (:float32:8). DIMS is empty for one value per row; a dimension\n"
            "             may be 0 (the field's rows then hold no values)\n"
            "  PLACEMENT  cpu, cpu:N, cuda:I, cuda:I*K, cuda*K, cuda/N, comma-separated\n"
            "             (default cpu)\n"
            "  --name NAME  serve the service NAME and the relay's bin NAME/requests (NAME:\n"
            "             1 to %zu bytes)\n"
            "  --params BIN  load every {params, version} put into the bin BIN, between\n"
            "             forwards; a version a replica does not load (it keeps its weights) or\n"
            "             an item that is not {params, version} is logged on stderr\n"
            "  --timeout-ms MS  the deadline in the queue of a request that names none (a\n"
            "             relayed record without timeout_ms, or with 0): positive milliseconds,\n"
            "             or -1 for none (default 30000; predictors' requests carry their own)\n"
            "  --stats-s S  print the statistics every S seconds (default 0: on exit only): two\n"
            "             lines for the batcher (below), then one per replica with its mean\n"
            "             queue, input copy, compute and output times and its batch sizes\n"
            "  --min-delay-us US  hold a partial batch at least this long (default 0)\n"
            "  --preferred ROWS,...  batch sizes that run as soon as the queue reaches them\n"
            "  --amp DTYPE  run the replicas under autocast (bfloat16; float16 on CUDA only)\n"
            "  --answer-threads N  threads (0 to %d, default 0) that help the replicas hand out\n"
            "             large batches' answers; with --overlap they hand out every batch's\n"
            "             answers while the replica runs its next batch (two batches in flight\n"
            "             per replica: for fast devices with more requests waiting than a batch)\n"
            "  --shm [SLOTS]  also offer SLOTS shared-memory slots (default %d, 1 to %d) to\n"
            "             predictors on tsinfer's own host, advertised in the bin NAME/shm: a\n"
            "             predictor takes one when it runs on the same host as tsinfer (the\n"
            "             same boot id), can open tsinfer's /dev/shm object (the same /dev/shm,\n"
            "             so not from another container, and the same user: the object is mode\n"
            "             0600) and a slot is free; its blocking predictions then go through the\n"
            "             slot instead of tensord. Every other predictor, and an input larger\n"
            "             than a slot, calls the service as before. tensord itself may be on\n"
            "             any host. The statistics lines count slot requests with the others\n"
            "             (the predictors' own statistics tell them apart)\n",
            TS_MAX_NAME_LEN - strlen(TS_BATCHER_REQ_SUFFIX), TS_BATCHER_MAX_ANSWER_THREADS,
            TS_BATCHER_SHM_DEFAULT_SLOTS, TS_BATCHER_SHM_MAX_SLOTS);
    /* Two strings: C99 compilers need not take one over 4095 bytes. */
    fprintf(f,
            "On exit tsinfer prints how many requests were answered, failed (the model failed or\n"
            "a deadline passed) and were malformed (not a request record, no input, no reply bin\n"
            "for a relayed one, or an input that does not match --input: answered with ESCHEMA,\n"
            "or EPROTO for a slot's request that does not decode, a relayed one only when it\n"
            "names a reply bin; logged on stderr, at most %d lines per %d s, those of the --shm\n"
            "slots excepted), then how many were submitted, timed out (of the failed),\n"
            "cancelled (service calls still queued when it stops; relayed and slot requests\n"
            "still queued then are cancelled after the line, uncounted) and refused (queue\n"
            "full). Workers call the service NAME (or relay through NAME/requests).\n"
            "Exit status: 0 after SIGINT or SIGTERM; 2 for a configuration error, before it\n"
            "connects (an argument that is missing or does not parse, a --name or --params\n"
            "that is not a bin name, or options the batcher or the shim refuse: --overlap\n"
            "without --answer-threads, --min-delay-us above --max-delay-us, --timeout-ms 0,\n"
            "overlapping fields, a --device this build or machine lacks); 1 when loading the\n"
            "model, making its replicas, connecting to tensord or serving fails.\n",
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
        /* DIMS: empty, or decimal numbers joined by single x's and nothing else ("4x", "4 "
           and "+4" are refused). */
        char *dims = c2 + 1;
        while (*dims != '\0') {
            char *x = strchr(dims, 'x');
            if (x != NULL)
                *x = '\0';
            long d;
            if (f->ndim >= TS_MAX_NDIM - 1 || dims[strspn(dims, "0123456789")] != '\0' ||
                parse_long(dims, 0, INT32_MAX, &d) != 0 || (x != NULL && x[1] == '\0')) {
                fprintf(stderr,
                        "tsinfer: field '%s': bad dimensions (DIMS is empty or up to %d numbers "
                        "of 0 to %d joined by x, e.g. 4x4)\n",
                        tok, TS_MAX_NDIM - 1, INT32_MAX);
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
 * Logging malformed requests, which ts_batcher_serve counts, answers and reports to on_malformed
 */
typedef struct log_state {
    const char *name;                  /* the service */
    char req_bin[TS_MAX_NAME_LEN + 1]; /* the relay's bin, NAME/requests */
    /* Log rate limit; used on the serve thread only (on_malformed is never called concurrently). */
    time_t window_start;
    unsigned logged, suppressed;
} log_state;

/* Log a malformed request (its reason in ts_last_error()), at most LOG_BURST lines per
   LOG_WINDOW_S seconds; the lines left out are counted and summed up when the window ends. A
   call of the service has a reason that starts with "call N: " (batcher.h,
   ts_batcher_malformed_cb); the others were taken from the relay's bin. */
static void on_malformed(ts_batcher_t *b, int status, void *arg)
{
    (void)b;
    (void)status;
    log_state *ls = arg;
    time_t now = time(NULL);
    if (now - ls->window_start >= LOG_WINDOW_S) {
        if (ls->suppressed > 0)
            fprintf(stderr, "tsinfer: %u more malformed requests were not shown\n", ls->suppressed);
        ls->window_start = now;
        ls->logged = 0;
        ls->suppressed = 0;
    }
    if (ls->logged >= LOG_BURST) {
        ls->suppressed++;
        return;
    }
    ls->logged++;
    const char *why = ts_last_error();
    if (strncmp(why, "call ", 5) == 0)
        fprintf(stderr, "tsinfer: malformed call of the service %s: %s\n", ls->name, why);
    else
        fprintf(stderr, "tsinfer: malformed request in %s: %s\n", ls->req_bin, why);
}

/* ---------------------------------------------------------------------------------------------
 * Following --params. ts_batcher_follow_weights publishes each update without waiting and never
 * says when a replica refuses one; this thread loads each newest {params, version} with the
 * blocking ts_batcher_load_weights instead, so that a refused update is logged with its version
 * and the loader's message (the replicas that refuse it keep their weights and version).
 */
typedef struct follower {
    ts_batcher_t *b;
    ts_client_t *client;
    const char *bin;
    atomic_int stop;
} follower;

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* Wait for the bin to change, then load its newest item into every replica; until stop is set. */
static void *follow_main(void *arg)
{
    follower *f = arg;
    uint64_t after = 0;
    while (!atomic_load(&f->stop)) {
        uint64_t v = 0;
        int rc = ts_wait(f->client, f->bin, after, FOLLOW_WAIT_MS, &v, NULL);
        if (rc == TS_ETIMEDOUT)
            continue;
        if (rc != 0) {
            sleep_ms(FOLLOW_RETRY_MS);
            continue;
        }
        ts_items_t *items = NULL;
        rc = ts_peek(f->client, f->bin, 0, &items);
        if (rc == TS_ENOENT) {
            after = v;
            continue;
        }
        if (rc != 0) {
            sleep_ms(FOLLOW_RETRY_MS);
            continue;
        }
        after = ts_items_version(items);
        /* The newest item wins (a trainer puts one; appended ones are read newest first). */
        size_t n = ts_items_count(items);
        const ts_value_t *rec = n > 0 ? ts_items_at(items, n - 1) : NULL;
        const ts_value_t *params = rec != NULL ? ts_map_get(rec, "params") : NULL;
        int64_t version = 0;
        if (params == NULL || ts_map_get_int(rec, "version", &version) != 0) {
            fprintf(stderr,
                    "tsinfer: --params %s: the newest item (bin version %llu) is not {params, "
                    "version}: ignored\n",
                    f->bin, (unsigned long long)after);
        } else {
            /* Replicas load between forwards: the wait lasts about a forward and a load. */
            rc = ts_batcher_load_weights(f->b, params, version, TS_TIMEOUT_INFINITE);
            if (rc != 0)
                fprintf(stderr, "tsinfer: --params %s: version %lld not loaded: %s\n", f->bin,
                        (long long)version, ts_last_error());
        }
        ts_items_free(items);
    }
    return NULL;
}

/* Mean of a sum of nanoseconds over n, in microseconds (0 when n is 0). */
static double mean_us(uint64_t sum_ns, uint64_t n)
{
    return n > 0 ? (double)sum_ns / (double)n / 1e3 : 0.0;
}

/*
 * The statistics, printed every --stats-s seconds and on exit: the batcher's two lines, then one
 * line per replica (Triton's split of the time: queue per request; input copy, compute and output
 * per batch; then the batch sizes, bucket by bucket, the empty ones left out). "failed" is the
 * model's failures and the deadlines passed; cancellations are counted apart, on the second line
 * (ts_batcher_stats_t.failed counts both).
 */
static void print_stats(const char *when, ts_batcher_t *b)
{
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    printf("tsinfer: %s: %llu requests answered, %llu failed, %llu malformed, %llu batches, "
           "%.2f rows per batch\n",
           when, (unsigned long long)st.requests, (unsigned long long)(st.failed - st.cancelled),
           (unsigned long long)st.malformed, (unsigned long long)st.batches,
           st.batches ? (double)st.rows / (double)st.batches : 0.0);
    printf("tsinfer: %s: %llu submitted, %llu timed out, %llu cancelled, %llu refused (queue "
           "full)\n",
           when, (unsigned long long)st.submitted, (unsigned long long)st.timed_out,
           (unsigned long long)st.cancelled, (unsigned long long)st.rejected);
    for (int i = 0; i < ts_batcher_replicas(b); i++) {
        ts_batcher_replica_stats_t rs;
        if (ts_batcher_replica_stats(b, i, &rs) != 0)
            continue;
        printf("tsinfer:   replica %d (%s): %llu batches, %llu rows, queue %.1f us per request, "
               "input %.1f us, compute %.1f us, output %.1f us per batch; sizes",
               i, ts_batcher_device(b, i), (unsigned long long)rs.batches,
               (unsigned long long)rs.rows, mean_us(rs.queue_ns, rs.requests),
               mean_us(rs.input_ns, rs.batches), mean_us(rs.compute_ns, rs.batches),
               mean_us(rs.output_ns, rs.batches));
        for (int k = 0; k < TS_BATCHER_HIST_BUCKETS; k++) {
            if (rs.batch_sizes[k] == 0)
                continue;
            long hi = 1L << k, lo = k == 0 ? 1 : (1L << (k - 1)) + 1;
            if (lo == hi)
                printf(" %ld:%llu", hi, (unsigned long long)rs.batch_sizes[k]);
            else
                printf(" %ld-%ld:%llu", lo, hi, (unsigned long long)rs.batch_sizes[k]);
        }
        printf("\n");
    }
    fflush(stdout);
}

/* "4,8,16" into sizes (at most TS_BATCHER_MAX_PREFERRED, each 1..max_batch). The count or -1. */
static int parse_sizes(const char *s, long max_batch, int *sizes)
{
    int n = 0;
    const char *p = s;
    while (*p != '\0') {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno != 0 || v < 1 || v > max_batch || n == TS_BATCHER_MAX_PREFERRED ||
            (*end != ',' && *end != '\0'))
            return -1;
        sizes[n++] = (int)v;
        p = *end == ',' ? end + 1 : end;
    }
    return n;
}

int main(int argc, char **argv)
{
    const char *server = NULL, *model = NULL, *name = NULL, *params = NULL;
    const char *device = "cpu";
    char *in_spec = NULL, *out_spec = NULL;
    long max_batch = 64, delay_us = 500, timeout_ms = 30000, threads = 0, stats_s = 0;
    long min_delay_us = 0;
    long answer_threads = 0;
    int overlap = 0;
    long shm_slots = 0; /* --shm: slots offered on this host (0: none) */
    const char *preferred = NULL, *amp = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "--overlap") == 0) {
            overlap = 1;
            continue;
        }
        if (strcmp(a, "--shm") == 0) {
            /* SLOTS is optional: the next argument is it unless it is another option. */
            shm_slots = TS_BATCHER_SHM_DEFAULT_SLOTS;
            if (v == NULL || strncmp(v, "--", 2) == 0)
                continue;
            if (parse_long(v, 1, TS_BATCHER_SHM_MAX_SLOTS, &shm_slots) != 0) {
                fprintf(stderr, "tsinfer: --shm %s: SLOTS is a number of slots from 1 to %d\n", v,
                        TS_BATCHER_SHM_MAX_SLOTS);
                usage(stderr);
                return 2;
            }
            i++;
            continue;
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
        } else if (strcmp(a, "--min-delay-us") == 0) {
            bad = parse_long(v, 0, 60000000, &min_delay_us);
        } else if (strcmp(a, "--answer-threads") == 0) {
            bad = parse_long(v, 0, TS_BATCHER_MAX_ANSWER_THREADS, &answer_threads);
        } else if (strcmp(a, "--preferred") == 0) {
            preferred = v;
        } else if (strcmp(a, "--amp") == 0) {
            amp = v;
            bad = strcmp(v, "bfloat16") != 0 && strcmp(v, "float16") != 0;
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
    /* Everything that can be checked without the model or the server is checked first. */
    size_t name_max = TS_MAX_NAME_LEN - strlen(TS_BATCHER_REQ_SUFFIX);
    if (name[0] == '\0' || strlen(name) > name_max) {
        fprintf(stderr, "tsinfer: --name '%s': 1 to %zu bytes (NAME%s is a bin name)\n", name,
                name_max, TS_BATCHER_REQ_SUFFIX);
        return 2;
    }
    if (params != NULL && (params[0] == '\0' || strlen(params) > TS_MAX_NAME_LEN)) {
        fprintf(stderr, "tsinfer: --params '%s': a bin name of 1 to %d bytes\n", params,
                TS_MAX_NAME_LEN);
        return 2;
    }
    ts_field_t in[MAX_FIELDS], out[MAX_FIELDS];
    int n_in = parse_schema(in_spec, in);
    int n_out = out_spec != NULL ? parse_schema(out_spec, out) : 0;
    if (n_in <= 0 || n_out < 0)
        return 2;
    int sizes[TS_BATCHER_MAX_PREFERRED];
    int n_sizes = preferred != NULL ? parse_sizes(preferred, max_batch, sizes) : 0;
    if (n_sizes < 0) {
        fprintf(stderr, "tsinfer: --preferred %s: up to %d sizes of 1..%ld rows\n", preferred,
                TS_BATCHER_MAX_PREFERRED, max_batch);
        return 2;
    }

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
    if (amp != NULL) {
        rc = ts_torch_set_autocast(proto, strcmp(amp, "float16") == 0 ? TS_FLOAT16 : TS_BFLOAT16);
        if (rc != 0) {
            fprintf(stderr, "tsinfer: --amp %s: %s\n", amp, ts_last_error());
            ts_torch_model_free(proto);
            return 2;
        }
    }
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.min_delay_us = min_delay_us;
    cfg.answer_threads = (int)answer_threads;
    cfg.overlap_answers = overlap;
    cfg.preferred_batch = sizes;
    cfg.n_preferred = n_sizes;
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
        /* Refused options (and a device this build or machine lacks) are configuration errors. */
        return rc == TS_EINVAL || rc == TS_ENOTSUP ? 2 : 1;
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
    static log_state logs;
    ts_batcher_serve_options_t so;
    ts_batcher_serve_options_init(&so);
    so.on_malformed = on_malformed;
    so.on_malformed_arg = &logs;
    logs.name = name;
    snprintf(logs.req_bin, sizeof(logs.req_bin), "%s%s", name, TS_BATCHER_REQ_SUFFIX);
    rc = ts_batcher_serve_with(b, client, name, &so);
    int served = rc == 0; /* requests may have come in: the statistics are printed on exit */
    if (rc != 0)
        fprintf(stderr, "tsinfer: %s: %s\n", ts_strerror(rc), ts_last_error());
    if (rc == 0 && shm_slots > 0) {
        ts_batcher_shm_options_t shm;
        ts_batcher_shm_options_init(&shm);
        shm.slots = (int)shm_slots;
        rc = ts_batcher_serve_shm(b, client, name, &shm);
        if (rc != 0)
            fprintf(stderr, "tsinfer: --shm %ld: %s: %s\n", shm_slots, ts_strerror(rc),
                    ts_last_error());
    }
    static follower fol;
    pthread_t follow_th;
    int following = 0;
    if (rc == 0 && params != NULL) {
        fol.b = b;
        fol.client = client;
        fol.bin = params;
        atomic_init(&fol.stop, 0);
        if (pthread_create(&follow_th, NULL, follow_main, &fol) != 0) {
            fprintf(stderr, "tsinfer: --params %s: cannot start the thread that follows it\n",
                    params);
            rc = TS_ENOMEM;
        } else {
            following = 1;
        }
    }
    if (rc == 0) {
        printf("tsinfer: serving the service %s (and the relay's bin %s%s) on %s with %d "
               "replica(s) [",
               name, name, TS_BATCHER_REQ_SUFFIX, server, ts_batcher_replicas(b));
        for (int i = 0; i < ts_batcher_replicas(b); i++)
            printf("%s%s", i ? " " : "", ts_batcher_device(b, i));
        printf("], max batch %ld, max delay %ld us", max_batch, delay_us);
        if (shm_slots > 0)
            printf(", %ld shared-memory slots in %s%s", shm_slots, name, TS_BATCHER_SHM_SUFFIX);
        printf("\n");
        fflush(stdout);
        /* Wait for a signal; with --stats-s, print the counters each time that passes. */
        for (;;) {
            struct timespec period = {stats_s > 0 ? stats_s : STATS_IDLE_S, 0};
            int sig = sigtimedwait(&sigs, NULL, &period);
            if (sig == SIGINT || sig == SIGTERM)
                break;
            if (sig < 0 && errno == EAGAIN && stats_s > 0)
                print_stats("running", b);
        }
    }
    if (following) {
        atomic_store(&fol.stop, 1);
        pthread_join(follow_th, NULL);
    }
    ts_batcher_stop_remote(b);
    /* Before the batcher goes: requests still queued are cancelled by ts_batcher_free. */
    if (served)
        print_stats("stopped", b);
    ts_batcher_free(b);
    ts_client_free(client);
    ts_torch_model_free(proto);
    return rc == 0 ? 0 : 1;
}
