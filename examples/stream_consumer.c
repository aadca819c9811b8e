/*
 * Stream example, a training consumer: reads the batches of stream_producer (see there for how
 * to run both) at its own batch size, checks every row, and reports per epoch what it got.
 *
 * Each consumer is its own group (--group), so every consumer gets every batch, in order. With
 * --batch-rows B the client library re-slices the producer's batches into batches of exactly B
 * rows (the last batch of an epoch may be shorter: a batch never spans an end-of-epoch marker).
 * A consumer that joins late starts at the oldest entry the stream kept (--start oldest) or at
 * the next one appended (--start newest). A consumer that was killed and starts again with the
 * same group resumes right after what it had acknowledged: the rows it had been given and not
 * acknowledged come again first. --commit-every N acknowledges after every N batches (the
 * library also acknowledges what was handed out whenever it reads more); --state FILE keeps a
 * log of the rows used, so that a restarted consumer tells rows it gets again (redelivered) from
 * new ones and still reports whole epochs.
 *
 * Every row is checked: its image hashes to the producer's "hash", its label matches its index,
 * and rows come in order (epoch, then index) with no gap. Per epoch it prints rows, batches, the
 * index and entry-id ranges and the sum of the row hashes (compare with the producer's line); a
 * partial epoch (joined in its middle, or entries lost to the window) says so. Exit status 1
 * when a check failed.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "stream_images.h"
#include "tensorshare/stream.h"
#include "tensorshare/tensorshare.h"

/* Epochs a consumer keeps accounts for (tags beyond are reported as errors). */
#define MAX_EPOCHS 4096
/* bytes; one line of the --state log. */
#define STATE_LINE_MAX 256

typedef struct {
    const char *address;
    const char *name;
    const char *group;
    const char *member;
    const char *state;
    long batch_rows;
    long epochs;
    long prefetch;
    long lease_ms;
    long commit_every;
    long step_ms;
    long timeout_s;
    int newest;
} args_t;

/* What one epoch brought. */
typedef struct {
    uint64_t rows, batches, hash_sum;
    int64_t min_index, max_index;
    uint64_t first_id, last_id;
    int seen, partial, ended;
} epoch_t;

static struct {
    epoch_t ep[MAX_EPOCHS];
    int have_last;       /* a row has been used (last_epoch, last_index are valid) */
    int64_t last_epoch;  /* the newest row used: its epoch ... */
    int64_t last_index;  /* ... and index */
    int64_t last_marker; /* the newest marker handled, -1 for none */
    uint64_t redelivered, errors, lost;
    /* From the --state log of an earlier run: rows used, and rows acknowledged, before it. */
    uint64_t before_rows, before_committed;
    int resumed;
    uint64_t rows_total, committed_rows;
    FILE *state;
} g = {.last_marker = -1};

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
    fprintf(f, "usage: stream_consumer [--address HOST:PORT|unix:PATH] [--name STREAM] "
               "[--group G] [--member M] [--batch-rows B] [--epochs N] [--start oldest|newest] "
               "[--prefetch N] [--lease-ms MS] [--commit-every N] [--state FILE] [--step-ms MS] "
               "[--timeout-s S]\n"
               "  --batch-rows: rows per training batch (0: as the producer made them)\n"
               "  --epochs: stop after the end of epoch N-1 (0: run until --timeout-s passes "
               "idle)\n"
               "  --step-ms: time one training step takes (a sleep)\n");
}

static int parse_args(int argc, char **argv, args_t *a)
{
    *a = (args_t){.address = "127.0.0.1:8000",
                  .name = "images",
                  .group = "trainer",
                  .epochs = 3,
                  .prefetch = 4,
                  .timeout_s = 30};
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(opt, "--help") == 0 || strcmp(opt, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        int bad = 0, known = 1;
        if (val == NULL)
            bad = 1;
        else if (strcmp(opt, "--address") == 0)
            a->address = val;
        else if (strcmp(opt, "--name") == 0)
            a->name = val;
        else if (strcmp(opt, "--group") == 0)
            a->group = val;
        else if (strcmp(opt, "--member") == 0)
            a->member = val;
        else if (strcmp(opt, "--state") == 0)
            a->state = val;
        else if (strcmp(opt, "--start") == 0) {
            a->newest = strcmp(val, "newest") == 0;
            bad = !a->newest && strcmp(val, "oldest") != 0;
        } else if (strcmp(opt, "--batch-rows") == 0)
            bad = parse_long(val, 0, 1000000, &a->batch_rows) != 0;
        else if (strcmp(opt, "--epochs") == 0)
            bad = parse_long(val, 0, MAX_EPOCHS, &a->epochs) != 0;
        else if (strcmp(opt, "--prefetch") == 0)
            bad = parse_long(val, 1, TS_STREAM_READ_MAX, &a->prefetch) != 0;
        else if (strcmp(opt, "--lease-ms") == 0)
            bad = parse_long(val, 0, 86400000, &a->lease_ms) != 0;
        else if (strcmp(opt, "--commit-every") == 0)
            bad = parse_long(val, 0, 1000000000, &a->commit_every) != 0;
        else if (strcmp(opt, "--step-ms") == 0)
            bad = parse_long(val, 0, 60000, &a->step_ms) != 0;
        else if (strcmp(opt, "--timeout-s") == 0)
            bad = parse_long(val, 1, 86400, &a->timeout_s) != 0;
        else
            known = 0;
        if (!known || bad) {
            if (!known)
                fprintf(stderr, "stream_consumer: unknown argument '%s'\n", opt);
            else if (val == NULL)
                fprintf(stderr, "stream_consumer: option '%s' needs a value\n", opt);
            else
                fprintf(stderr, "stream_consumer: bad value '%s' for %s\n", val, opt);
            usage(stderr);
            return 2;
        }
        i++;
    }
    if (a->member == NULL)
        a->member = a->group;
    return -1;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* Account rows [lo, hi] of epoch e (already checked) as used, from entries [fid, lid]. */
static void account(int64_t e, int64_t lo, int64_t hi, uint64_t hash_sum, uint64_t fid,
                    uint64_t lid, int new_batch)
{
    epoch_t *ep = &g.ep[e];
    if (!ep->seen) {
        ep->seen = 1;
        ep->min_index = lo;
        ep->first_id = fid;
        /* Joined in the middle of the epoch (late, or after entries were lost). */
        ep->partial = lo != 0;
    }
    ep->rows += (uint64_t)(hi - lo + 1);
    ep->batches += (uint64_t)new_batch;
    ep->hash_sum += hash_sum;
    ep->max_index = hi;
    if (lid > ep->last_id)
        ep->last_id = lid;
    g.have_last = 1;
    g.last_epoch = e;
    g.last_index = hi;
    g.rows_total += (uint64_t)(hi - lo + 1);
}

static void report_epoch(const char *group, int64_t e)
{
    const epoch_t *ep = &g.ep[e];
    if (!ep->seen) {
        printf("consumer %s: epoch %" PRId64 ": rows 0 (none kept when it joined), partial\n",
               group, e);
        return;
    }
    printf("consumer %s: epoch %" PRId64 ": rows %" PRIu64 ", batches %" PRIu64 ", index %" PRId64
           "..%" PRId64 ", ids %" PRIu64 "..%" PRIu64 ", hash %016" PRIx64 "%s\n",
           group, e, ep->rows, ep->batches, ep->min_index, ep->max_index, ep->first_id, ep->last_id,
           ep->hash_sum, ep->partial ? ", partial" : "");
}

/*
 * Replay the --state log of an earlier run of this consumer: "b E LO HI HASH FID LID" for rows
 * LO..HI of epoch E used, "m TAG" for a marker handled, "c" for a commit. 0 or -1.
 */
static int load_state(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return errno == ENOENT ? 0 : -1;
    char line[STATE_LINE_MAX];
    while (fgets(line, sizeof(line), f) != NULL) {
        int64_t e, lo, hi;
        uint64_t h, fid, lid;
        if (line[0] == 'b' &&
            sscanf(line + 1, "%" SCNd64 " %" SCNd64 " %" SCNd64 " %" SCNx64 " %" SCNu64 " %" SCNu64,
                   &e, &lo, &hi, &h, &fid, &lid) == 6) {
            if (e < 0 || e >= MAX_EPOCHS || lo < 0 || hi < lo)
                break;
            account(e, lo, hi, h, fid, lid, 1);
        } else if (line[0] == 'm' && sscanf(line + 1, "%" SCNd64, &e) == 1) {
            if (e < 0 || e >= MAX_EPOCHS)
                break;
            g.ep[e].ended = 1;
            g.last_marker = e;
        } else if (line[0] == 'c') {
            g.committed_rows = g.rows_total;
        }
        /* A torn last line (killed while writing) is ignored: that batch was not used. */
    }
    fclose(f);
    g.before_rows = g.rows_total;
    g.before_committed = g.committed_rows;
    g.resumed = g.before_rows > 0 || g.last_marker >= 0;
    return 0;
}

static void state_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void state_line(const char *fmt, ...)
{
    if (g.state == NULL)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(g.state, fmt, ap);
    va_end(ap);
    /* Flushed at once: a consumer killed right after a batch has it on record. */
    fflush(g.state);
}

/* The int64 [rows] column key of a batch, or NULL. */
static const int64_t *column(const ts_value_t *v, const char *key, int64_t rows)
{
    const ts_tensor_t *t = ts_map_get_tensor(v, key);
    if (t == NULL || t->dtype != TS_INT64 || t->ndim != 1 || t->shape[0] != rows)
        return NULL;
    return t->data;
}

/*
 * Check and account one batch. Rows already used (redelivered after a restart) are counted as
 * such and skipped. Returns the rows that were new.
 */
static int64_t use_batch(const char *group, const ts_value_t *v, const ts_stream_item_t *info)
{
    const ts_tensor_t *img = ts_map_get_tensor(v, "image");
    if (img == NULL || img->dtype != TS_FLOAT32 || img->ndim != 4 ||
        img->shape[1] != IMG_CHANNELS || img->shape[2] != IMG_CROP || img->shape[3] != IMG_CROP) {
        fprintf(stderr, "consumer %s: a batch without the expected image tensor\n", group);
        g.errors++;
        return 0;
    }
    int64_t rows = img->shape[0];
    const int64_t *label = column(v, "label", rows), *index = column(v, "index", rows);
    const int64_t *epoch = column(v, "epoch", rows), *hash = column(v, "hash", rows);
    if (label == NULL || index == NULL || epoch == NULL || hash == NULL) {
        fprintf(stderr, "consumer %s: a batch without its int64 columns\n", group);
        g.errors++;
        return 0;
    }
    const float *data = img->data;
    int64_t lo = -1, hi = -1, e_new = -1;
    uint64_t hsum = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t e = epoch[r], idx = index[r];
        const float *row = data + (size_t)r * IMG_ROW_FLOATS;
        if ((int64_t)img_row_hash(row, IMG_ROW_FLOATS) != hash[r] ||
            label[r] != idx % IMG_CLASSES || e < 0 || e >= MAX_EPOCHS || idx < 0) {
            fprintf(stderr, "consumer %s: row %" PRId64 " of epoch %" PRId64 " is corrupt\n", group,
                    idx, e);
            g.errors++;
            continue;
        }
        if (g.have_last && (e < g.last_epoch || (e == g.last_epoch && idx <= g.last_index))) {
            /* Used before this consumer was restarted: handed out again, not acknowledged. */
            g.redelivered++;
            continue;
        }
        int in_order = !g.have_last        ? 1
                       : e == g.last_epoch ? idx == g.last_index + 1
                                           : idx == 0 && g.last_marker >= g.last_epoch;
        if (!in_order && info->lost == g.lost) {
            fprintf(stderr,
                    "consumer %s: row %" PRId64 " of epoch %" PRId64 " after row %" PRId64
                    " of epoch %" PRId64 ": out of order\n",
                    group, idx, e, g.last_index, g.last_epoch);
            g.errors++;
        }
        if (e_new >= 0 && e != e_new) {
            fprintf(stderr, "consumer %s: a batch spans epochs\n", group);
            g.errors++;
        }
        if (lo < 0 || e != e_new) {
            if (lo >= 0)
                account(e_new, lo, hi, hsum, info->first_id, info->last_id, 1);
            lo = idx;
            hsum = 0;
        }
        e_new = e;
        hi = idx;
        hsum += (uint64_t)hash[r];
        g.have_last = 1;
        g.last_epoch = e;
        g.last_index = idx;
    }
    g.lost = info->lost;
    if (lo < 0)
        return 0;
    account(e_new, lo, hi, hsum, info->first_id, info->last_id, 1);
    state_line("b %" PRId64 " %" PRId64 " %" PRId64 " %" PRIx64 " %" PRIu64 " %" PRIu64 "\n", e_new,
               lo, hi, hsum, info->first_id, info->last_id);
    return hi - lo + 1;
}

int main(int argc, char **argv)
{
    args_t a;
    int status = parse_args(argc, argv, &a);
    if (status >= 0)
        return status;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (a.state != NULL) {
        if (load_state(a.state) != 0) {
            fprintf(stderr, "stream_consumer: cannot read %s\n", a.state);
            return 1;
        }
        g.state = fopen(a.state, "a");
        if (g.state == NULL) {
            fprintf(stderr, "stream_consumer: cannot write %s\n", a.state);
            return 1;
        }
    }
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, a.address, NULL);
    if (rc != 0) {
        fprintf(stderr, "stream_consumer: cannot connect to %s: %s\n", a.address, ts_last_error());
        return 1;
    }
    ts_stream_consumer_options_t o;
    ts_stream_consumer_options_init(&o);
    o.start = a.newest ? TS_STREAM_NEWEST : TS_STREAM_OLDEST;
    o.lease_ms = (int)a.lease_ms;
    o.batch_rows = (uint32_t)a.batch_rows;
    o.prefetch = (uint32_t)a.prefetch;
    o.timeout_ms = 1000;
    ts_stream_consumer_t *s = NULL;
    /* The stream may not exist yet when consumers start first: retry while it is missing. */
    for (long waited = 0;; waited += 100) {
        rc = ts_stream_consumer_open(&s, c, a.name, a.group, a.member, &o);
        if (rc != TS_ENOENT || waited >= a.timeout_s * 1000)
            break;
        sleep_ms(100);
    }
    if (rc != 0) {
        fprintf(stderr, "stream_consumer: join '%s' as %s/%s: %s\n", a.name, a.group, a.member,
                ts_last_error());
        ts_client_free(c);
        return 1;
    }
    printf("consumer %s: joined stream '%s' (batch rows %ld, start %s)%s\n", a.group, a.name,
           a.batch_rows, a.newest ? "newest" : "oldest",
           g.resumed ? ", resuming after a restart" : "");
    /* The epochs that ended before the restart, from the log, so that this report is whole. */
    for (int64_t e = 0; e <= g.last_marker; e++)
        if (g.ep[e].ended)
            report_epoch(a.group, e);

    long idle_ms = 0, since_commit = 0;
    int done = 0;
    while (!done) {
        ts_value_t *v = NULL;
        ts_stream_item_t info;
        rc = ts_stream_consumer_next(s, &v, &info);
        if (rc == TS_ETIMEDOUT) {
            idle_ms += o.timeout_ms;
            if (idle_ms >= a.timeout_s * 1000) {
                /* Without --epochs, a stream gone quiet is the end; with it, a failure. */
                if (a.epochs > 0) {
                    fprintf(stderr, "consumer %s: nothing for %ld s\n", a.group, a.timeout_s);
                    g.errors++;
                }
                break;
            }
            continue;
        }
        if (rc != 0) {
            fprintf(stderr, "consumer %s: next: %s\n", a.group, ts_last_error());
            g.errors++;
            break;
        }
        idle_ms = 0;
        if (info.end_of_epoch) {
            int64_t e = (int64_t)info.tag;
            if (e < 0 || e >= MAX_EPOCHS) {
                fprintf(stderr, "consumer %s: marker %" PRId64 " out of range\n", a.group, e);
                g.errors++;
            } else if (e > g.last_marker) {
                /* Not a marker handed out again after a restart: the epoch is complete. */
                g.ep[e].ended = 1;
                g.last_marker = e;
                state_line("m %" PRId64 "\n", e);
                report_epoch(a.group, e);
            }
            done = a.epochs > 0 && e >= a.epochs - 1;
            continue;
        }
        use_batch(a.group, v, &info);
        ts_value_free(v);
        if (a.step_ms > 0)
            sleep_ms(a.step_ms);
        if (a.commit_every > 0 && ++since_commit >= a.commit_every) {
            rc = ts_stream_consumer_commit(s);
            if (rc != 0) {
                fprintf(stderr, "consumer %s: commit: %s\n", a.group, ts_last_error());
                g.errors++;
                break;
            }
            since_commit = 0;
            g.committed_rows = g.rows_total;
            state_line("c\n");
        }
    }
    /* Done: commit, and leave the group so that it holds the producer back no longer. */
    ts_stream_consumer_close(s, done);
    ts_client_free(c);
    if (g.state != NULL)
        fclose(g.state);

    /*
     * The server had acknowledged what this consumer committed and what the library acknowledged
     * with its reads: everything used before the restart except what came again. So the rows
     * received after the restart plus those acknowledged before it make the whole.
     */
    if (g.resumed)
        printf("consumer %s: resumed: %" PRIu64 " rows used before the restart (%" PRIu64
               " committed, %" PRIu64 " acknowledged), %" PRIu64 " rows received after it, %" PRIu64
               " rows redelivered (at most %" PRIu64 ", the uncommitted tail)\n",
               a.group, g.before_rows, g.before_committed, g.before_rows - g.redelivered,
               g.rows_total - g.before_rows + g.redelivered, g.redelivered,
               g.before_rows - g.before_committed);
    uint64_t batches = 0;
    long epochs = 0;
    for (int e = 0; e < MAX_EPOCHS; e++) {
        batches += g.ep[e].batches;
        epochs += g.ep[e].ended;
    }
    printf("consumer %s: done: %ld epochs, %" PRIu64 " rows, %" PRIu64 " batches, %" PRIu64
           " redelivered, %" PRIu64 " entries lost, %" PRIu64 " errors\n",
           a.group, epochs, g.rows_total, batches, g.redelivered, g.lost, g.errors);
    return g.errors == 0 && (a.epochs == 0 || done) ? 0 : 1;
}
