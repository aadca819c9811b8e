/*
 * The metrics page of tensord (server/metrics.c) read back as Prometheus would: every line a
 * HELP, a TYPE or a well-formed sample; each family's TYPE before its samples, once; no series
 * twice; histograms cumulative and ending in +Inf equal to _count; the values those of the
 * counters they come from.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "http.h"
#include "tensorshare/version.h"

/* Lines and series a page of these tests may hold. */
#define MAX_SERIES   4096
#define MAX_FAMILIES 256

/* A server with nothing but what the page reads (static: it is large). */
static tsd_server g_srv;

/* A parsed page: families in order, every series with its value. */
typedef struct family {
    char name[128];
    char type[16];
    int help, samples;
} family;

typedef struct series {
    char key[512]; /* name{labels} exactly as written */
    char name[128];
    char op[128]; /* the op label, if any */
    char le[128]; /* the le label, if any */
    double value;
} series;

typedef struct page {
    family fam[MAX_FAMILIES];
    size_t nfam;
    series ser[MAX_SERIES];
    size_t nser;
} page;

static page g_page;

static int name_start(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
}

static int name_char(char c)
{
    return name_start(c) || (c >= '0' && c <= '9');
}

/* Parse a metric name at *p into out; advances *p. */
static void parse_name(const char **p, char *out, size_t cap)
{
    const char *s = *p;
    assert_true(name_start(*s));
    size_t n = 0;
    while (name_char(s[n]))
        n++;
    assert_true(n < cap);
    memcpy(out, s, n);
    out[n] = '\0';
    *p = s + n;
}

static family *find_family(page *pg, const char *name)
{
    for (size_t i = 0; i < pg->nfam; i++)
        if (strcmp(pg->fam[i].name, name) == 0)
            return &pg->fam[i];
    return NULL;
}

/* The family a sample name belongs to (histograms: name less _bucket, _sum or _count). */
static family *family_of(page *pg, const char *name)
{
    family *f = find_family(pg, name);
    if (f != NULL)
        return f;
    static const char *const suffixes[] = {"_bucket", "_sum", "_count"};
    for (size_t i = 0; i < 3; i++) {
        size_t n = strlen(name), k = strlen(suffixes[i]);
        if (n > k && strcmp(name + n - k, suffixes[i]) == 0) {
            char base[128];
            memcpy(base, name, n - k);
            base[n - k] = '\0';
            f = find_family(pg, base);
            if (f != NULL && strcmp(f->type, "histogram") == 0)
                return f;
        }
    }
    return NULL;
}

/* A sample value: a float as Go's ParseFloat reads it, or +Inf, -Inf, NaN. */
static double parse_value(const char *s)
{
    if (strcmp(s, "+Inf") == 0)
        return INFINITY;
    if (strcmp(s, "-Inf") == 0)
        return -INFINITY;
    if (strcmp(s, "NaN") == 0)
        return NAN;
    char *end;
    double v = strtod(s, &end);
    assert_true(end != s);
    assert_true(*end == '\0');
    return v;
}

/* Parse one sample line (no newline) into pg. */
static void parse_sample(page *pg, const char *line)
{
    series *se = &pg->ser[pg->nser];
    memset(se, 0, sizeof(*se));
    const char *p = line;
    parse_name(&p, se->name, sizeof(se->name));
    assert_true(strncmp(se->name, "tensord_", 8) == 0);
    family *f = family_of(pg, se->name);
    if (f == NULL)
        fail_msg("sample %s before the TYPE of its family", se->name);
    f->samples++;
    if (*p == '{') {
        p++;
        char seen[8][64];
        size_t nseen = 0;
        while (*p != '}') {
            char lname[64];
            assert_true(name_start(*p) && *p != ':');
            parse_name(&p, lname, sizeof(lname));
            for (size_t i = 0; i < nseen; i++)
                assert_string_not_equal(seen[i], lname);
            assert_true(nseen < 8);
            snprintf(seen[nseen++], sizeof(seen[0]), "%s", lname);
            assert_true(*p == '=');
            p++;
            assert_true(*p == '"');
            p++;
            char val[128];
            size_t n = 0;
            while (*p != '"') {
                assert_true(*p != '\0' && *p != '\n');
                if (*p == '\\') {
                    p++;
                    assert_true(*p == '\\' || *p == '"' || *p == 'n');
                }
                assert_true(n + 1 < sizeof(val));
                val[n++] = *p++;
            }
            val[n] = '\0';
            p++;
            if (strcmp(lname, "op") == 0)
                snprintf(se->op, sizeof(se->op), "%s", val);
            if (strcmp(lname, "le") == 0) {
                snprintf(se->le, sizeof(se->le), "%s", val);
            }
            if (*p == ',')
                p++;
            else
                assert_true(*p == '}');
        }
        p++;
    }
    size_t keylen = (size_t)(p - line);
    assert_true(keylen < sizeof(se->key));
    memcpy(se->key, line, keylen);
    se->key[keylen] = '\0';
    /* One space, then the value; no timestamp (tensord writes none). */
    assert_true(*p == ' ');
    p++;
    se->value = parse_value(p);
    for (size_t i = 0; i < pg->nser; i++)
        if (strcmp(pg->ser[i].key, se->key) == 0)
            fail_msg("series %s twice", se->key);
    assert_true(pg->nser + 1 < MAX_SERIES);
    pg->nser++;
}

/* Parse the page text (n bytes) into pg, checking the format on the way. */
static void parse_page(page *pg, const char *text, size_t n)
{
    memset(pg, 0, sizeof(*pg));
    assert_true(n > 0);
    assert_true(text[n - 1] == '\n'); /* every line ends with a newline, the last one too */
    const char *p = text;
    const char *end = text + n;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        assert_non_null(nl);
        size_t len = (size_t)(nl - p);
        assert_true(len > 0 && len < 1024);
        char line[1024];
        memcpy(line, p, len);
        line[len] = '\0';
        assert_null(memchr(line, '\r', len));
        if (strncmp(line, "# HELP ", 7) == 0) {
            const char *q = line + 7;
            char name[128];
            parse_name(&q, name, sizeof(name));
            assert_true(*q == ' ' && q[1] != '\0');
            family *f = find_family(pg, name);
            if (f == NULL) {
                assert_true(pg->nfam < MAX_FAMILIES);
                f = &pg->fam[pg->nfam++];
                snprintf(f->name, sizeof(f->name), "%s", name);
            }
            assert_int_equal(f->help, 0);
            assert_int_equal(f->samples, 0);
            f->help = 1;
        } else if (strncmp(line, "# TYPE ", 7) == 0) {
            const char *q = line + 7;
            char name[128];
            parse_name(&q, name, sizeof(name));
            assert_true(*q == ' ');
            q++;
            assert_true(strcmp(q, "counter") == 0 || strcmp(q, "gauge") == 0 ||
                        strcmp(q, "histogram") == 0);
            family *f = find_family(pg, name);
            if (f == NULL) {
                assert_true(pg->nfam < MAX_FAMILIES);
                f = &pg->fam[pg->nfam++];
                snprintf(f->name, sizeof(f->name), "%s", name);
            }
            assert_string_equal(f->type, ""); /* once */
            assert_int_equal(f->samples, 0);  /* before any sample */
            snprintf(f->type, sizeof(f->type), "%s", q);
            /* Counters end in _total (the name the samples carry). */
            if (strcmp(q, "counter") == 0)
                assert_string_equal(name + strlen(name) - 6, "_total");
        } else {
            assert_true(line[0] != '#');
            parse_sample(pg, line);
        }
        p = nl + 1;
    }
    for (size_t i = 0; i < pg->nfam; i++) {
        assert_int_equal(pg->fam[i].help, 1);
        assert_string_not_equal(pg->fam[i].type, "");
    }
}

static const series *find_series(const page *pg, const char *key)
{
    for (size_t i = 0; i < pg->nser; i++)
        if (strcmp(pg->ser[i].key, key) == 0)
            return &pg->ser[i];
    return NULL;
}

static double value_of(const page *pg, const char *key)
{
    const series *s = find_series(pg, key);
    if (s == NULL)
        fail_msg("no series %s", key);
    return s->value;
}

/*
 * Every histogram: per op, buckets in increasing le, counts never falling, the last +Inf and
 * equal to _count, a _sum. Returns the ops seen.
 */
static size_t check_histograms(const page *pg)
{
    size_t ops = 0;
    for (size_t i = 0; i < pg->nfam; i++) {
        const family *f = &pg->fam[i];
        if (strcmp(f->type, "histogram") != 0)
            continue;
        char bucket[160], count[160], sum[160];
        snprintf(bucket, sizeof(bucket), "%s_bucket", f->name);
        snprintf(count, sizeof(count), "%s_count", f->name);
        snprintf(sum, sizeof(sum), "%s_sum", f->name);
        for (size_t j = 0; j < pg->nser; j++) {
            const series *c = &pg->ser[j];
            if (strcmp(c->name, count) != 0)
                continue;
            ops++;
            double last_le = -INFINITY, last = 0;
            int buckets = 0, inf = 0;
            for (size_t k = 0; k < pg->nser; k++) {
                const series *b = &pg->ser[k];
                if (strcmp(b->name, bucket) != 0 || strcmp(b->op, c->op) != 0)
                    continue;
                assert_false(inf); /* +Inf is the last bucket */
                double le = parse_value(b->le);
                assert_true(le > last_le);
                assert_true(b->value >= last);
                last_le = le;
                last = b->value;
                buckets++;
                inf = isinf(le) && le > 0;
            }
            assert_true(inf);
            assert_int_equal(buckets, TSD_LAT_BOUNDS + 1);
            assert_true(last == c->value);
            int have_sum = 0;
            for (size_t k = 0; k < pg->nser; k++)
                have_sum |= strcmp(pg->ser[k].name, sum) == 0 && strcmp(pg->ser[k].op, c->op) == 0;
            assert_true(have_sum);
        }
    }
    return ops;
}

static void render(page *pg)
{
    tsd_text t;
    memset(&t, 0, sizeof(t));
    assert_int_equal(tsd_metrics_render(&g_srv, &t), 0);
    assert_false(t.failed);
    parse_page(pg, t.p, t.len);
    tsd_text_free(&t);
}

static int setup(void **state)
{
    (void)state;
    memset(&g_srv, 0, sizeof(g_srv));
    g_srv.start_ns = ts__now_ns();
    return 0;
}

/* A fresh server: well formed, no histogram samples yet, every opcode's counter at 0. */
static void test_empty(void **state)
{
    (void)state;
    render(&g_page);
    assert_int_equal(check_histograms(&g_page), 0);
    assert_true(value_of(&g_page, "tensord_operations_total{op=\"PUT\"}") == 0);
    assert_true(value_of(&g_page, "tensord_operations_total{op=\"TABLE_INFO\"}") == 0);
    assert_true(value_of(&g_page, "tensord_errors_total{status=\"NOT_FOUND\"}") == 0);
    assert_true(value_of(&g_page, "tensord_build_info{version=\"" TS_VERSION_STRING "\"}") == 1);
    assert_null(find_series(&g_page, "tensord_snapshot_age_seconds"));
    assert_non_null(find_family(&g_page, "tensord_snapshot_age_seconds"));
    /* Every family the documents promise, by name. */
    static const char *const names[] = {"tensord_operations_total",
                                        "tensord_errors_total",
                                        "tensord_received_bytes_total",
                                        "tensord_sent_bytes_total",
                                        "tensord_bins",
                                        "tensord_items",
                                        "tensord_stored_bytes",
                                        "tensord_connections",
                                        "tensord_connections_total",
                                        "tensord_connections_rejected_total",
                                        "tensord_memory_used_bytes",
                                        "tensord_memory_limit_bytes",
                                        "tensord_notifications_coalesced_total",
                                        "tensord_slow_readers_total",
                                        "tensord_snapshot_age_seconds",
                                        "tensord_snapshot_failures_total",
                                        "tensord_disk_bytes",
                                        "tensord_reclaim_pending_bytes",
                                        "tensord_streams",
                                        "tensord_tables",
                                        "tensord_uptime_seconds",
                                        "tensord_build_info",
                                        "tensord_operation_duration_seconds"};
    for (size_t i = 0; i < TS__ARRAY_SIZE(names); i++)
        if (find_family(&g_page, names[i]) == NULL)
            fail_msg("no family %s", names[i]);
}

/* The counters of tsd_stats and the store, as they are, under their names. */
static void test_values(void **state)
{
    (void)state;
    g_srv.stats.ops[TS_OP_PUT] = 12345678901234ull;
    g_srv.stats.ops[TS_OP_GET] = 7;
    g_srv.stats.errors[TS_ST_NOT_FOUND] = 3;
    g_srv.stats.errors[TS_ST_OUT_OF_MEMORY] = 2;
    g_srv.stats.bytes_received = 1000;
    g_srv.stats.bytes_sent = 2000;
    g_srv.stats.connections_total = 9;
    g_srv.stats.rejected_clients = 4;
    g_srv.stats.slow_readers = 5;
    g_srv.stats.notes_coalesced = 6;
    g_srv.stats.snapshot_failures = 1;
    g_srv.stats.last_save_time = (uint64_t)time(NULL) - 30;
    g_srv.n_conns = 11;
    /* Only the counts are read: a million bins cost the page nothing (no table is walked). */
    g_srv.store.bins.count = 1000000;
    g_srv.store.n_items = 2000000;
    g_srv.store.held = 1u << 30;
    g_srv.store.max_memory = 1ull << 33;
    g_srv.store.overhead = 100;
    render(&g_page);
    assert_true(value_of(&g_page, "tensord_operations_total{op=\"PUT\"}") == 12345678901234.0);
    assert_true(value_of(&g_page, "tensord_operations_total{op=\"GET\"}") == 7);
    assert_true(value_of(&g_page, "tensord_errors_total{status=\"NOT_FOUND\"}") == 3);
    assert_true(value_of(&g_page, "tensord_errors_total{status=\"OUT_OF_MEMORY\"}") == 2);
    assert_true(value_of(&g_page, "tensord_received_bytes_total") == 1000);
    assert_true(value_of(&g_page, "tensord_sent_bytes_total") == 2000);
    assert_true(value_of(&g_page, "tensord_connections") == 11);
    assert_true(value_of(&g_page, "tensord_connections_total") == 9);
    assert_true(value_of(&g_page, "tensord_connections_rejected_total") == 4);
    assert_true(value_of(&g_page, "tensord_slow_readers_total") == 5);
    assert_true(value_of(&g_page, "tensord_notifications_coalesced_total") == 6);
    assert_true(value_of(&g_page, "tensord_snapshot_failures_total") == 1);
    double age = value_of(&g_page, "tensord_snapshot_age_seconds");
    assert_true(age >= 30 && age < 60);
    assert_true(value_of(&g_page, "tensord_bins") == 1000000);
    assert_true(value_of(&g_page, "tensord_items") == 2000000);
    assert_true(value_of(&g_page, "tensord_stored_bytes") == (double)(1u << 30));
    assert_true(value_of(&g_page, "tensord_memory_used_bytes") == (double)(1u << 30) + 100);
    assert_true(value_of(&g_page, "tensord_memory_limit_bytes") == (double)(1ull << 33));
    assert_true(value_of(&g_page, "tensord_uptime_seconds") >= 0);
}

/* Observations land in the buckets their bounds say (le: at most), cumulated on the page. */
static void test_histogram(void **state)
{
    (void)state;
    tsd_stats *st = &g_srv.stats;
    tsd_latency_observe(st, TS_OP_PUT, 5000);           /* 5 us */
    tsd_latency_observe(st, TS_OP_PUT, 10000);          /* exactly 10 us: le="0.00001" */
    tsd_latency_observe(st, TS_OP_PUT, 30000);          /* 30 us */
    tsd_latency_observe(st, TS_OP_PUT, 2000000000ull);  /* 2 s */
    tsd_latency_observe(st, TS_OP_PUT, 20000000000ull); /* 20 s: only +Inf */
    tsd_latency_observe(st, TS_OP_PING, 1);
    render(&g_page);
    assert_int_equal(check_histograms(&g_page), 2);
    const char *b = "tensord_operation_duration_seconds_bucket{op=\"PUT\",le=\"";
    char key[256];
    static const struct {
        const char *le;
        double n;
    } want[] = {{"0.00001", 2}, {"0.000025", 2}, {"0.00005", 3}, {"1", 3},
                {"2.5", 4},     {"10", 4},       {"+Inf", 5}};
    for (size_t i = 0; i < TS__ARRAY_SIZE(want); i++) {
        snprintf(key, sizeof(key), "%s%s\"}", b, want[i].le);
        assert_true(value_of(&g_page, key) == want[i].n);
    }
    assert_true(value_of(&g_page, "tensord_operation_duration_seconds_count{op=\"PUT\"}") == 5);
    double sum = value_of(&g_page, "tensord_operation_duration_seconds_sum{op=\"PUT\"}");
    assert_true(fabs(sum - 22.000045) < 1e-9);
    assert_true(value_of(&g_page, "tensord_operation_duration_seconds_count{op=\"PING\"}") == 1);
    assert_null(find_series(&g_page, "tensord_operation_duration_seconds_count{op=\"GET\"}"));
}

/* A failed allocation gives TS_ENOMEM and a page marked incomplete, nothing worse. */
static void test_alloc_failure(void **state)
{
    (void)state;
    tsd_text t;
    memset(&t, 0, sizeof(t));
    ts__alloc_fail_after(1);
    assert_int_equal(tsd_metrics_render(&g_srv, &t), TS_ENOMEM);
    assert_true(t.failed);
    tsd_text_free(&t);
    /* A page larger than the first buffer: the failure comes while growing it. */
    for (unsigned op = 0; op < 256; op++)
        tsd_latency_observe(&g_srv.stats, (uint8_t)op, 1000);
    memset(&t, 0, sizeof(t));
    ts__alloc_fail_after(2);
    assert_int_equal(tsd_metrics_render(&g_srv, &t), TS_ENOMEM);
    assert_true(t.failed);
    tsd_text_free(&t);
    /* And without a failure the same page is whole and well formed. */
    render(&g_page);
    assert_true(check_histograms(&g_page) > 40);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_empty, setup),
        cmocka_unit_test_setup(test_values, setup),
        cmocka_unit_test_setup(test_histogram, setup),
        cmocka_unit_test_setup(test_alloc_failure, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
