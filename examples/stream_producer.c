/*
 * Stream example, the producer: one data loader feeding many training processes through a
 * tensord stream (include/tensorshare/stream.h). It "decodes" and augments synthetic images
 * (examples/stream_images.h: real CPU work, about 7 ms per batch of 32 rows) once, and every
 * consumer gets every batch, at its own batch size, from the stream.
 *
 *   tensord --port 8000 &
 *   stream_producer --address 127.0.0.1:8000 --epochs 3 --wait-consumers 2 &
 *   stream_consumer --address 127.0.0.1:8000 --group a --batch-rows 16 --epochs 3 &
 *   stream_consumer --address 127.0.0.1:8000 --group b --batch-rows 64 --epochs 3
 *
 * (examples/stream_demo.sh runs four consumers, one joining late and one killed and restarted.)
 *
 * Each batch is a map of tensors with the same first dimension (rows): "image" float32
 * [rows, 3, 52, 52], and int64 [rows] "label", "index" (the sample in the data set, 0..N-1 in
 * every epoch), "epoch", and "hash" (a hash of the row's image bytes, for the consumers' checks).
 * An end-of-epoch marker with the epoch number as its tag follows each epoch's batches. The
 * stream keeps the newest --max-entries entries (the replay window a late consumer starts from)
 * and lets no live consumer fall more than --window entries behind: a push waits for credit.
 *
 * Per epoch it prints what it produced (rows, batches, indices, entry ids, the sum of the row
 * hashes), which the consumers' reports are checked against.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "stream_images.h"
#include "tensorshare/stream.h"
#include "tensorshare/tensorshare.h"

/* rows; the largest batch this example makes (its buffers are allocated once). */
#define MAX_BATCH_ROWS    4096
#define WAIT_CONSUMERS_MS 60000 /* ms; how long --wait-consumers waits */
#define WAIT_POLL_MS      20    /* ms; between two looks */

typedef struct {
    const char *address;
    const char *name;
    long epochs;
    long batches_per_epoch;
    long rows;
    long max_entries;
    long window;
    long lease_ms;
    long passes;
    long wait_consumers;
    int fresh;
} args_t;

static int parse_long(const char *s, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: stream_producer [--address HOST:PORT|unix:PATH] [--name STREAM] "
            "[--epochs N] [--batches-per-epoch N] [--rows N] [--max-entries N] [--window N] "
            "[--lease-ms MS] [--passes N] [--wait-consumers N] [--fresh]\n"
            "  --rows: rows per batch the producer makes (default 32; consumers re-slice)\n"
            "  --max-entries: the replay window kept for late consumers (default 64)\n"
            "  --window: entries a live consumer may be behind before pushes wait (32)\n"
            "  --passes: decode passes per image, the CPU cost of a batch (default %d)\n"
            "  --wait-consumers: create the stream, then wait (up to 60 s) until N consumer\n"
            "    groups have joined before producing\n"
            "  --fresh: delete the stream first (ids start at 1 again)\n",
            IMG_DECODE_PASSES);
}

/* Read the command line into a. Returns -1 to go on, else the exit status (0 after --help). */
static int parse_args(int argc, char **argv, args_t *a)
{
    *a = (args_t){.address = "127.0.0.1:8000",
                  .name = "images",
                  .epochs = 3,
                  .batches_per_epoch = 20,
                  .rows = 32,
                  .max_entries = 64,
                  .window = 32,
                  .lease_ms = 5000,
                  .passes = IMG_DECODE_PASSES};
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(opt, "--help") == 0 || strcmp(opt, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(opt, "--fresh") == 0) {
            a->fresh = 1;
            continue;
        }
        int bad = val == NULL, known = 1;
        if (val == NULL)
            known = strcmp(opt, "--address") == 0 || strcmp(opt, "--name") == 0 ||
                    strcmp(opt, "--epochs") == 0 || strcmp(opt, "--batches-per-epoch") == 0 ||
                    strcmp(opt, "--rows") == 0 || strcmp(opt, "--max-entries") == 0 ||
                    strcmp(opt, "--window") == 0 || strcmp(opt, "--lease-ms") == 0 ||
                    strcmp(opt, "--passes") == 0 || strcmp(opt, "--wait-consumers") == 0;
        else if (strcmp(opt, "--address") == 0)
            a->address = val;
        else if (strcmp(opt, "--name") == 0)
            a->name = val;
        else if (strcmp(opt, "--epochs") == 0)
            bad = parse_long(val, 1, 1000000, &a->epochs) != 0;
        else if (strcmp(opt, "--batches-per-epoch") == 0)
            bad = parse_long(val, 1, 100000000, &a->batches_per_epoch) != 0;
        else if (strcmp(opt, "--rows") == 0)
            bad = parse_long(val, 1, MAX_BATCH_ROWS, &a->rows) != 0;
        else if (strcmp(opt, "--max-entries") == 0)
            bad = parse_long(val, 1, TS_STREAM_ENTRIES_MAX, &a->max_entries) != 0;
        else if (strcmp(opt, "--window") == 0)
            bad = parse_long(val, 0, TS_STREAM_ENTRIES_MAX, &a->window) != 0;
        else if (strcmp(opt, "--lease-ms") == 0)
            bad = parse_long(val, 1, 86400000, &a->lease_ms) != 0;
        else if (strcmp(opt, "--passes") == 0)
            bad = parse_long(val, 0, 1000, &a->passes) != 0;
        else if (strcmp(opt, "--wait-consumers") == 0)
            bad = parse_long(val, 0, 1024, &a->wait_consumers) != 0;
        else
            known = 0;
        if (!known || bad) {
            if (!known)
                fprintf(stderr, "stream_producer: unknown argument '%s'\n", opt);
            else if (val == NULL)
                fprintf(stderr, "stream_producer: option '%s' needs a value\n", opt);
            else
                fprintf(stderr, "stream_producer: bad value '%s' for %s\n", val, opt);
            usage(stderr);
            return 2;
        }
        i++;
    }
    if (a->window > a->max_entries) {
        fprintf(stderr, "stream_producer: --window must not exceed --max-entries\n");
        return 2;
    }
    return -1;
}

static double cpu_seconds(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The batch buffers, filled in place for every batch; the record borrows them. */
typedef struct {
    float *image;
    int64_t *label, *index, *epoch, *hash;
    uint8_t *src, *tmp;
    ts_value_t *record;
} batch_t;

static void batch_free(batch_t *b)
{
    ts_value_free(b->record);
    free(b->image);
    free(b->label);
    free(b->index);
    free(b->epoch);
    free(b->hash);
    free(b->src);
    free(b->tmp);
}

/* Allocate the buffers of rows rows and the record over them. 0 or -1. */
static int batch_init(batch_t *b, long rows)
{
    memset(b, 0, sizeof(*b));
    size_t n = (size_t)rows;
    b->image = malloc(n * IMG_ROW_FLOATS * sizeof(float));
    b->label = malloc(n * sizeof(int64_t));
    b->index = malloc(n * sizeof(int64_t));
    b->epoch = malloc(n * sizeof(int64_t));
    b->hash = malloc(n * sizeof(int64_t));
    b->src = malloc(IMG_SRC_BYTES);
    b->tmp = malloc(IMG_SRC_BYTES);
    b->record = ts_map_new();
    if (b->image == NULL || b->label == NULL || b->index == NULL || b->epoch == NULL ||
        b->hash == NULL || b->src == NULL || b->tmp == NULL || b->record == NULL)
        return -1;
    const int64_t ishape[4] = {rows, IMG_CHANNELS, IMG_CROP, IMG_CROP};
    const int64_t vshape[1] = {rows};
    /* TS_BORROW: a push reads the buffers during the call only, so one record serves them all. */
    if (ts_map_set(b->record, "image", ts_tensor_new(TS_FLOAT32, 4, ishape, b->image, TS_BORROW)) ||
        ts_map_set(b->record, "label", ts_tensor_new(TS_INT64, 1, vshape, b->label, TS_BORROW)) ||
        ts_map_set(b->record, "index", ts_tensor_new(TS_INT64, 1, vshape, b->index, TS_BORROW)) ||
        ts_map_set(b->record, "epoch", ts_tensor_new(TS_INT64, 1, vshape, b->epoch, TS_BORROW)) ||
        ts_map_set(b->record, "hash", ts_tensor_new(TS_INT64, 1, vshape, b->hash, TS_BORROW)))
        return -1;
    return 0;
}

/*
 * Wait until the stream has at least n groups (consumers that joined), polling its info.
 * 0, or -1 after WAIT_CONSUMERS_MS or on an error.
 */
static int wait_consumers(ts_client_t *c, const char *name, long n)
{
    for (long waited = 0; waited <= WAIT_CONSUMERS_MS; waited += WAIT_POLL_MS) {
        ts_value_t *info = NULL;
        int rc = ts_stream_info(c, name, &info);
        if (rc != 0) {
            fprintf(stderr, "stream_producer: info '%s': %s\n", name, ts_last_error());
            return -1;
        }
        const ts_value_t *groups = ts_map_get(info, "groups");
        size_t have = groups != NULL ? ts_value_len(groups) : 0;
        ts_value_free(info);
        if ((long)have >= n)
            return 0;
        struct timespec ts = {0, WAIT_POLL_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
    fprintf(stderr, "stream_producer: fewer than %ld consumers joined within %d s\n", n,
            WAIT_CONSUMERS_MS / 1000);
    return -1;
}

int main(int argc, char **argv)
{
    args_t a;
    int status = parse_args(argc, argv, &a);
    if (status >= 0)
        return status;
    setvbuf(stdout, NULL, _IOLBF, 0);

    batch_t b;
    if (batch_init(&b, a.rows) != 0) {
        fprintf(stderr, "stream_producer: out of memory\n");
        batch_free(&b);
        return 1;
    }
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, a.address, NULL);
    if (rc != 0) {
        fprintf(stderr, "stream_producer: cannot connect to %s: %s\n", a.address, ts_last_error());
        batch_free(&b);
        return 1;
    }
    if (a.fresh) {
        rc = ts_delete(c, a.name, NULL);
        if (rc != 0 && rc != TS_ENOENT) {
            fprintf(stderr, "stream_producer: delete '%s': %s\n", a.name, ts_last_error());
            goto fail_client;
        }
    }
    ts_stream_config_t cfg;
    ts_stream_config_init(&cfg);
    cfg.max_entries = (uint64_t)a.max_entries;
    cfg.window = (uint32_t)a.window;
    cfg.lease_ms = (uint32_t)a.lease_ms;
    ts_stream_producer_t *p = NULL;
    /* Wait for credit as long as it takes: a consumer that stops is dropped after its lease. */
    rc = ts_stream_producer_open(&p, c, a.name, &cfg, TS_TIMEOUT_INFINITE);
    if (rc != 0) {
        fprintf(stderr, "stream_producer: open '%s': %s\n", a.name, ts_last_error());
        goto fail_client;
    }
    printf("producer: stream '%s': %ld epochs of %ld batches of %ld rows (%.2f MiB each), "
           "replay window %ld entries, credit window %ld, lease %ld ms\n",
           a.name, a.epochs, a.batches_per_epoch, a.rows,
           (double)a.rows * IMG_ROW_FLOATS * sizeof(float) / 1048576.0, a.max_entries, a.window,
           a.lease_ms);

    if (a.wait_consumers > 0) {
        if (wait_consumers(c, a.name, a.wait_consumers) != 0)
            goto fail;
        printf("producer: %ld consumers joined\n", a.wait_consumers);
    }

    double t0 = now_seconds(), work = 0;
    uint64_t total_rows = 0, total_batches = 0;
    for (long e = 0; e < a.epochs; e++) {
        uint64_t first_id = 0, last_id = 0, hash_sum = 0, rows = 0;
        for (long k = 0; k < a.batches_per_epoch; k++) {
            double w0 = cpu_seconds();
            uint64_t first_index = (uint64_t)k * (uint64_t)a.rows;
            img_make_batch(b.image, b.label, b.index, b.epoch, b.hash, (int)a.rows, (uint64_t)e,
                           first_index, (int)a.passes, b.src, b.tmp);
            work += cpu_seconds() - w0;
            for (long r = 0; r < a.rows; r++)
                hash_sum += (uint64_t)b.hash[r];
            uint64_t id = 0;
            rc = ts_stream_producer_push(p, b.record, &id);
            if (rc != 0) {
                fprintf(stderr, "stream_producer: push: %s\n", ts_last_error());
                goto fail;
            }
            if (first_id == 0)
                first_id = id;
            last_id = id;
            rows += (uint64_t)a.rows;
        }
        uint64_t marker = 0;
        rc = ts_stream_producer_end_epoch(p, (uint64_t)e, &marker);
        if (rc != 0) {
            fprintf(stderr, "stream_producer: end of epoch: %s\n", ts_last_error());
            goto fail;
        }
        total_rows += rows;
        total_batches += (uint64_t)a.batches_per_epoch;
        printf("producer: epoch %ld: rows %" PRIu64 ", batches %ld, index 0..%" PRIu64
               ", ids %" PRIu64 "..%" PRIu64 ", marker %" PRIu64 ", hash %016" PRIx64 "\n",
               e, rows, a.batches_per_epoch, rows - 1, first_id, last_id, marker, hash_sum);
    }
    double el = now_seconds() - t0;
    printf("producer: done: %ld epochs, %" PRIu64 " rows, %" PRIu64 " batches in %.2f s "
           "(%.1f batches/s), %.2f ms of CPU per batch making them, %" PRIu64
           " pushes waited for credit\n",
           a.epochs, total_rows, total_batches, el, (double)total_batches / el,
           work / (double)total_batches * 1e3, ts_stream_producer_waits(p));
    ts_stream_producer_free(p);
    ts_client_free(c);
    batch_free(&b);
    return 0;

fail:
    ts_stream_producer_free(p);
fail_client:
    ts_client_free(c);
    batch_free(&b);
    return 1;
}
