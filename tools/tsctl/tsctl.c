/*
 * tsctl: the command-line client of tensord, in the spirit of redis-cli.
 *
 *   tsctl [OPTIONS] COMMAND [ARGS...]      (options may come before or after the command)
 *
 * Exit status: 0 success, 1 the operation failed (server error, connection), 2 usage error,
 * 3 timed out (wait), 4 not found (get/peek of a missing bin).
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "npy.h"
#include "tensorshare/tensorshare.h"

#define EXIT_FAILED   1
#define EXIT_USAGE    2
#define EXIT_TIMEOUT  3
#define EXIT_NOTFOUND 4
#define SHOW_VALUES   6  /* values printed per tensor in summaries */
#define SHOW_STRING   60 /* bytes of a string value printed in summaries */
/*
 * The protocol version this tsctl's library speaks (docs/PROTOCOL.md, section 1). The public
 * header has no constant for it yet; keep this in step with that table.
 */
#define TSCTL_PROTOCOL_VERSION 1
#define DEFAULT_WAIT_MS        10000   /* ms; wait's limit when --timeout is not given */
#define WATCH_MAX_SECONDS      86400.0 /* s; stats --watch interval: at most a day */
#define WATCH_MIN_SECONDS      0.01 /* s; below this the samples would only measure tsctl itself */
#define WATCH_SLICE_NS         50000000L /* ns; a watch sleeps in slices this long to see Ctrl-C */
#define ESCAPED_MAX            (4 * TS_MAX_NAME_LEN + 1) /* each byte escapes to at most 4 */

static const char usage_text[] =
    "usage: tsctl [OPTIONS] COMMAND [ARGS...]\n"
    "\n"
    "Commands:\n"
    "  ping                        round trip to the server\n"
    "  stats [--watch S [--count N]]\n"
    "                              server statistics; with --watch, every S seconds (e.g. 0.5)\n"
    "                              a line of counters and per-second rates (ops, bytes in and\n"
    "                              out where the server counts them), until Ctrl-C or N lines\n"
    "  list                        every bin with its items, bytes and change counter\n"
    "  put BIN VALUE               replace BIN's content with one item\n"
    "  append BIN VALUE            add one item to BIN\n"
    "                              VALUE: FILE.npy, or a literal such as 3.5 or [1,2,3]\n"
    "                              (literals become float32 tensors; write -- before a\n"
    "                              value that starts with '-' other than a number)\n"
    "  get BIN [--out FILE.npy]    print and remove BIN's items\n"
    "  peek BIN [--out FILE.npy]   print BIN's items, keeping them\n"
    "                              --out saves the first tensor of the first item. get --out\n"
    "                              takes nothing until FILE can be written: it first creates a\n"
    "                              temporary file beside FILE and checks that the first item\n"
    "                              holds a tensor NumPy can store; FILE then appears whole or\n"
    "                              not at all (written, synced, renamed). If writing still fails\n"
    "                              once the items are taken (a full disk, a file size limit,\n"
    "                              or another client changed the bin in between), tsctl\n"
    "                              appends them back to the end of BIN and exits 1.\n"
    "  delete BIN                  remove BIN\n"
    "  wait BIN [CHANGE]           wait until BIN's change counter passes CHANGE (default: the\n"
    "                              current one, i.e. the next change); --timeout MS bounds it\n"
    "                              (default 10000)\n"
    "  listen BIN... [--count N]   print changes as they happen, until Ctrl-C or N of them\n"
    "  save                        ask the server for a snapshot; returns once it is on disk\n"
    "\n"
    "Options (--opt VALUE or --opt=VALUE):\n"
    "  -H, --host H          server host                               [127.0.0.1]\n"
    "  -p, --port P          server TCP port                           [8000]\n"
    "  -u, --unix PATH       connect to a unix socket instead\n"
    "  -a, --address ADDR    the server's whole address instead of -H/-p/-u, as the library\n"
    "                        takes it: HOST:PORT, tls://HOST:PORT, unix:PATH, a cluster's\n"
    "                        H1:P1,H2:P2,... or cluster:MAPFILE (docs/CLUSTER.md, TLS.md)\n"
    "      --tls-ca FILE     (tls://) the CA the server's certificate must chain to (PEM);\n"
    "                        without it TS_TLS_CA, else the system's store\n"
    "  -t, --timeout MS      limit of connecting (each attempt) and of each request\n"
    "                        [5000 and 30000]; for wait, also how long to wait\n"
    "  -T, --token-file F    read the server's token from F (trailing whitespace ignored);\n"
    "                        without it the token comes from TS_AUTH_TOKEN, if set\n"
    "  -o, --out FILE.npy    (get, peek) save the first tensor\n"
    "  -n, --count N         (listen, stats --watch) stop after N lines\n"
    "  -w, --watch S         (stats) repeat every S seconds\n"
    "  -V, --version         print the library and protocol versions\n"
    "  -h, --help            this text\n"
    "\n"
    "CHANGE (in list, put, get, wait and listen) comes from the server's change counter: one\n"
    "count for the whole server that starts near its clock in microseconds and grows with\n"
    "every change; a bin's CHANGE is the count at its last change. It orders changes (wait\n"
    "and listen compare it); it is not the version of a model or of RL parameters, which a\n"
    "trainer numbers 0, 1, 2, ... inside the items it publishes (peek shows them).\n"
    "Bin names, map keys and strings are printed with bytes below 0x20, 0x7f, C1 controls and\n"
    "invalid UTF-8 written as \\xNN, and a backslash as \\\\.\n"
    "Exit status: 0 ok, 1 failed, 2 usage, 3 timed out, 4 no such bin.\n";

/* A usage error: one line that names what is wrong, then where to read more. */
static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tsctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("; see tsctl --help\n", stderr);
    return EXIT_USAGE;
}

/*
 * Copy a message into out without a segment that repeats the one before it: some messages are
 * built by several layers that each name the failure ("X: X: detail" becomes "X: detail").
 */
static void drop_repeats(const char *msg, char *out, size_t cap)
{
    size_t n = 0;
    const char *prev = NULL;
    size_t prev_len = 0;
    out[0] = '\0';
    while (*msg != '\0') {
        const char *sep = strstr(msg, ": ");
        size_t len = sep != NULL ? (size_t)(sep - msg) : strlen(msg);
        if (prev == NULL || len != prev_len || memcmp(prev, msg, len) != 0) {
            int w = snprintf(out + n, cap - n, "%s%.*s", n > 0 ? ": " : "", (int)len, msg);
            if (w < 0 || (size_t)w >= cap - n)
                return; /* truncated: out holds what fitted */
            n += (size_t)w;
        }
        prev = msg;
        prev_len = len;
        msg = sep != NULL ? sep + 2 : msg + len;
    }
}

/*
 * Report a failed call and map it to an exit status. The code's text is printed once: the
 * library's detail replaces it when the detail already says it, and follows it otherwise.
 */
static int report(const char *what, int rc)
{
    char detail[1024];
    drop_repeats(ts_last_error(), detail, sizeof(detail));
    const char *text = ts_strerror(rc);
    if (detail[0] == '\0')
        fprintf(stderr, "tsctl: %s: %s (%s)\n", what, text, ts_err_name(rc));
    else if (strstr(detail, text) != NULL)
        fprintf(stderr, "tsctl: %s: %s (%s)\n", what, detail, ts_err_name(rc));
    else
        fprintf(stderr, "tsctl: %s: %s: %s (%s)\n", what, text, detail, ts_err_name(rc));
    if (rc == TS_ETIMEDOUT)
        return EXIT_TIMEOUT;
    if (rc == TS_ENOENT)
        return EXIT_NOTFOUND;
    return EXIT_FAILED;
}

/* Parse a decimal integer in [lo, hi]. 0 or -1. */
static int parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end;
    errno = 0;
    if (s[0] == '-' || s[0] == '\0')
        return -1;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Escaping text from the server, so that a bin name cannot move the cursor, recolour the
 * terminal or hide itself.
 */

/* The length of the valid UTF-8 sequence at s (at most n bytes), or 0 when it is not one. */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf; /* the range of the second byte */
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0)
            lo = 0xa0; /* overlong */
        else if (c == 0xed)
            hi = 0x9f; /* surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0)
            lo = 0x90; /* overlong */
        else if (c == 0xf4)
            hi = 0x8f; /* above U+10FFFF */
    } else {
        return 0;
    }
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xbf)
            return 0;
    return len;
}

/*
 * Escape len bytes of s into out (cap bytes, at least 4 * len + 1 to hold everything): bytes
 * below 0x20, 0x7f, the C1 controls (U+0080..U+009F) and bytes of invalid UTF-8 become \xNN, a
 * backslash becomes \\. Returns out.
 */
static const char *escape(const char *s, size_t len, char *out, size_t cap)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s;
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        size_t seq = p[i] < 0x80 ? 1 : utf8_len(p + i, len - i);
        int c1 = seq == 2 && p[i] == 0xc2 && p[i + 1] <= 0x9f;
        size_t nesc = seq == 0 ? 1 : (c1 || p[i] < 0x20 || p[i] == 0x7f) ? seq : 0;
        if (nesc > 0) {
            for (size_t k = 0; k < nesc; k++) {
                if (o + 4 >= cap)
                    goto done;
                out[o++] = '\\';
                out[o++] = 'x';
                out[o++] = hex[p[i + k] >> 4];
                out[o++] = hex[p[i + k] & 15];
            }
            i += nesc;
        } else if (p[i] == '\\') {
            if (o + 2 >= cap)
                goto done;
            out[o++] = '\\';
            out[o++] = '\\';
            i++;
        } else {
            if (o + seq >= cap)
                goto done;
            memcpy(out + o, p + i, seq);
            o += seq;
            i += seq;
        }
    }
done:
    out[o] = '\0';
    return out;
}

/* A bin name or map key, escaped into a buffer of ESCAPED_MAX bytes. */
static const char *esc_name(const char *s, char *buf)
{
    size_t n = strlen(s);
    return escape(s, n > TS_MAX_NAME_LEN ? TS_MAX_NAME_LEN : n, buf, ESCAPED_MAX);
}

/* ---------------------------------------------------------------------------------------------
 * Printing values
 */

/* IEEE half to float. */
static float half_to_float(uint16_t h)
{
    int sign = h >> 15, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
    float v;
    if (exp == 0)
        v = ldexpf((float)frac, -24);
    else if (exp == 31)
        v = frac != 0 ? NAN : INFINITY;
    else
        v = ldexpf((float)(frac | 0x400), exp - 25);
    return sign ? -v : v;
}

/* One element of t as text. */
static void print_elem(const ts_tensor_t *t, size_t i)
{
    const uint8_t *p = (const uint8_t *)t->data + i * ts_dtype_size(t->dtype);
    switch (t->dtype) {
    case TS_BOOL:
        printf("%s", p[0] ? "true" : "false");
        break;
    case TS_UINT8:
        printf("%u", p[0]);
        break;
    case TS_INT8:
        printf("%d", (int8_t)p[0]);
        break;
    case TS_INT16: {
        int16_t v;
        memcpy(&v, p, sizeof(v));
        printf("%d", v);
        break;
    }
    case TS_INT32: {
        int32_t v;
        memcpy(&v, p, sizeof(v));
        printf("%" PRId32, v);
        break;
    }
    case TS_INT64: {
        int64_t v;
        memcpy(&v, p, sizeof(v));
        printf("%" PRId64, v);
        break;
    }
    case TS_FLOAT16: {
        uint16_t v;
        memcpy(&v, p, sizeof(v));
        printf("%g", (double)half_to_float(v));
        break;
    }
    case TS_BFLOAT16: {
        uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
        float v;
        memcpy(&v, &bits, sizeof(v));
        printf("%g", (double)v);
        break;
    }
    case TS_FLOAT32: {
        float v;
        memcpy(&v, p, sizeof(v));
        printf("%g", (double)v);
        break;
    }
    case TS_FLOAT64: {
        double v;
        memcpy(&v, p, sizeof(v));
        printf("%g", v);
        break;
    }
    case TS_COMPLEX64: {
        float v[2];
        memcpy(v, p, sizeof(v));
        printf("%g%+gj", (double)v[0], (double)v[1]);
        break;
    }
    case TS_COMPLEX128: {
        double v[2];
        memcpy(v, p, sizeof(v));
        printf("%g%+gj", v[0], v[1]);
        break;
    }
    default:
        printf("?");
        break;
    }
}

static void print_tensor(const ts_tensor_t *t)
{
    printf("%s[", ts_dtype_name(t->dtype));
    for (int i = 0; i < t->ndim; i++)
        printf("%s%" PRId64, i > 0 ? ", " : "", t->shape[i]);
    printf("]");
    int64_t n = ts_tensor_numel(t);
    printf(" {");
    for (int64_t i = 0; i < n && i < SHOW_VALUES; i++) {
        printf("%s", i > 0 ? ", " : "");
        print_elem(t, (size_t)i);
    }
    printf("%s}\n", n > SHOW_VALUES ? ", ..." : "");
}

/* Print a value tree, one leaf per line, with its key path. */
static void print_value(const ts_value_t *v, const char *path, int indent)
{
    printf("%*s%s%s", indent, "", path, path[0] != '\0' ? ": " : "");
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST: {
        int is_map = ts_value_type(v) == TS_TYPE_MAP;
        printf("%s (%zu entries)\n", is_map ? "map" : "list", ts_value_len(v));
        for (size_t i = 0; i < ts_value_len(v); i++) {
            char sub[ESCAPED_MAX];
            if (is_map)
                esc_name(ts_map_key_at(v, i), sub);
            else
                snprintf(sub, sizeof(sub), "[%zu]", i);
            print_value(is_map ? ts_map_value_at(v, i) : ts_list_at(v, i), sub, indent + 2);
        }
        break;
    }
    case TS_TYPE_TENSOR:
        print_tensor(ts_value_tensor(v));
        break;
    case TS_TYPE_INT: {
        int64_t i;
        ts_value_int(v, &i);
        printf("int %" PRId64 "\n", i);
        break;
    }
    case TS_TYPE_FLOAT: {
        double d;
        ts_value_float(v, &d);
        printf("float %g\n", d);
        break;
    }
    case TS_TYPE_STRING: {
        const char *s;
        size_t len;
        char buf[4 * SHOW_STRING + 1];
        ts_value_string(v, &s, &len);
        printf("string \"%s\"%s\n",
               escape(s, len > SHOW_STRING ? SHOW_STRING : len, buf, sizeof(buf)),
               len > SHOW_STRING ? "..." : "");
        break;
    }
    case TS_TYPE_BYTES: {
        const void *d;
        size_t len;
        ts_value_bytes(v, &d, &len);
        printf("bytes (%zu)\n", len);
        break;
    }
    default:
        printf("?\n");
        break;
    }
}

/* The first tensor of a tree (depth first), or NULL. */
static const ts_tensor_t *first_tensor(const ts_value_t *v)
{
    if (ts_value_type(v) == TS_TYPE_TENSOR)
        return ts_value_tensor(v);
    for (size_t i = 0; i < ts_value_len(v); i++) {
        const ts_value_t *child =
            ts_value_type(v) == TS_TYPE_MAP ? ts_map_value_at(v, i) : ts_list_at(v, i);
        const ts_tensor_t *t = first_tensor(child);
        if (t != NULL)
            return t;
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Commands
 */

/* What the command line asked for. */
typedef struct args {
    const char *host, *unix_path, *address, *tls_ca, *token_file, *out;
    long port;
    int place_given; /* -H, -p or -u was given (they and --address exclude each other) */
    int timeout_ms;  /* 0: the library's default */
    long count;      /* --count; -1 when not given */
    double watch_s;  /* --watch; 0 when not given */
    const char *cmd;
    int nargs;
    char **args;
} args_t;

/* Ctrl-C and SIGTERM end listen and stats --watch. */
static volatile sig_atomic_t interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    interrupted = 1;
}

static void catch_interrupts(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int cmd_ping(ts_client_t *c)
{
    double a = now_s();
    int rc = ts_ping(c);
    double b = now_s();
    if (rc != 0)
        return report("ping", rc);
    printf("PONG (%.3f ms)\n", (b - a) * 1e3);
    return 0;
}

static int cmd_stats_once(ts_client_t *c)
{
    ts_value_t *stats;
    int rc = ts_stats(c, &stats);
    if (rc != 0)
        return report("stats", rc);
    for (size_t i = 0; i < ts_value_len(stats); i++) {
        const ts_value_t *v = ts_map_value_at(stats, i);
        int64_t n;
        char key[ESCAPED_MAX];
        esc_name(ts_map_key_at(stats, i), key);
        if (ts_value_int(v, &n) == 0)
            printf("%s: %" PRId64 "\n", key, n);
        else
            print_value(v, key, 0);
    }
    ts_value_free(stats);
    return 0;
}

/*
 * The counters a watch line shows. STATS grows new keys over time and an older server lacks
 * some: a missing counter is shown as "-", and ops sums every ops_* key there is.
 */
enum { W_OPS, W_RECV, W_SENT, W_CONNS, W_ITEMS, W_BYTES, W_N };
static const char *const watch_keys[W_N] = {NULL,          "bytes_received", "bytes_sent",
                                            "connections", "items",          "bytes"};
static const int watch_rated[W_N] = {1, 1, 1, 0, 0, 0}; /* counters that get a rate column */

typedef struct sample {
    int64_t v[W_N];
    int have[W_N];
    double at; /* s, monotonic */
} sample;

static void take_sample(const ts_value_t *stats, sample *s)
{
    memset(s->have, 0, sizeof(s->have));
    s->v[W_OPS] = 0;
    for (size_t i = 0; i < ts_value_len(stats); i++) {
        int64_t n;
        if (strncmp(ts_map_key_at(stats, i), "ops_", 4) == 0 &&
            ts_value_int(ts_map_value_at(stats, i), &n) == 0) {
            s->v[W_OPS] += n;
            s->have[W_OPS] = 1;
        }
    }
    for (int k = 1; k < W_N; k++)
        s->have[k] = ts_map_get_int(stats, watch_keys[k], &s->v[k]) == 0;
}

/* One counter column, and its rate column when it has one ("-" where unknown). */
static void print_counter(const sample *cur, const sample *prev, int k)
{
    if (cur->have[k])
        printf(" %12" PRId64, cur->v[k]);
    else
        printf(" %12s", "-");
    if (!watch_rated[k])
        return;
    /* A counter that went down belongs to a restarted server: no rate across the restart. */
    if (prev != NULL && cur->have[k] && prev->have[k] && cur->v[k] >= prev->v[k] &&
        cur->at > prev->at)
        printf(" %10.1f", (double)(cur->v[k] - prev->v[k]) / (cur->at - prev->at));
    else
        printf(" %10s", "-");
}

/* Sleep until deadline (monotonic seconds) or an interrupt. */
static void sleep_until(double deadline)
{
    for (double left = deadline - now_s(); left > 0 && !interrupted; left = deadline - now_s()) {
        long ns = left * 1e9 < (double)WATCH_SLICE_NS ? (long)(left * 1e9) : WATCH_SLICE_NS;
        struct timespec ts = {0, ns};
        nanosleep(&ts, NULL);
    }
}

static int cmd_stats_watch(ts_client_t *c, double interval, long count)
{
    catch_interrupts();
    printf("%8s %12s %10s %12s %10s %12s %10s %12s %12s %12s\n", "TIME_S", "OPS", "OPS/S",
           "BYTES_IN", "IN/S", "BYTES_OUT", "OUT/S", "CONNECTIONS", "ITEMS", "BYTES");
    fflush(stdout);
    sample prev, cur;
    int have_prev = 0, status = 0;
    double start = now_s();
    long tick = 0; /* samples are taken at start + tick * interval */
    for (long n = 0; (count < 0 || n < count) && !interrupted; n++) {
        if (n > 0)
            sleep_until(start + (double)tick * interval);
        if (interrupted)
            break;
        ts_value_t *stats;
        int rc = ts_stats(c, &stats);
        /*
         * The next tick at least half an interval from now. Ticks a slow STATS (a paused server,
         * a reconnection) let pass are skipped rather than caught up: back to back, they would
         * give rates over a few microseconds.
         */
        long next = (long)((now_s() - start) / interval + 0.5) + 1; /* (long) floors: >= 0 */
        tick = next > tick + 1 ? next : tick + 1;
        if (rc != 0) {
            /* The client reconnects by itself: report, and try again at the next tick. */
            status = report("stats", rc);
            have_prev = 0;
            continue;
        }
        take_sample(stats, &cur);
        cur.at = now_s();
        ts_value_free(stats);
        printf("%8.2f", cur.at - start);
        for (int k = 0; k < W_N; k++)
            print_counter(&cur, have_prev ? &prev : NULL, k);
        printf("\n");
        fflush(stdout);
        prev = cur;
        have_prev = 1;
        status = 0;
    }
    return status;
}

static int cmd_save(ts_client_t *c)
{
    int rc = ts_save(c);
    if (rc != 0)
        return report("save", rc);
    printf("OK snapshot written\n");
    return 0;
}

/* Read a token file into buf (cap bytes), trailing whitespace dropped. 0 or -1. */
static int read_token(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "tsctl: --token-file %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t n = fread(buf, 1, cap - 1, f);
    int toolong = n == cap - 1 && fgetc(f) != EOF;
    fclose(f);
    while (n > 0 &&
           (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ' || buf[n - 1] == '\t'))
        n--;
    buf[n] = '\0';
    if (toolong || n == 0 || strlen(buf) != n) {
        fprintf(stderr, "tsctl: --token-file %s: %s\n", path,
                toolong ? "token too long" : "empty or not text");
        return -1;
    }
    return 0;
}

static int cmd_list(ts_client_t *c)
{
    ts_bin_list_t *list;
    int rc = ts_list(c, &list);
    if (rc != 0)
        return report("list", rc);
    if (list->count == 0)
        printf("(no bins)\n");
    else
        printf("%-32s %10s %14s %20s\n", "BIN", "ITEMS", "BYTES", "CHANGE");
    for (size_t i = 0; i < list->count; i++) {
        const ts_bin_info_t *b = &list->bins[i];
        char name[ESCAPED_MAX];
        printf("%-32s %10" PRIu32 " %14" PRIu64 " %20" PRIu64 "\n", esc_name(b->name, name),
               b->n_items, b->bytes, b->version);
    }
    ts_bin_list_free(list);
    return 0;
}

/* A VALUE argument: a .npy file when it names one, else a literal. */
static int load_value(const char *arg, ts_value_t **out)
{
    char err[512];
    size_t len = strlen(arg);
    int rc;
    if (len > 4 && strcmp(arg + len - 4, ".npy") == 0)
        rc = ts__npy_read(arg, out, err, sizeof(err));
    else
        rc = ts__literal_parse(arg, out, err, sizeof(err));
    if (rc != 0)
        fprintf(stderr, "tsctl: %s\n", err);
    return rc;
}

static int cmd_store(ts_client_t *c, int append, const char *bin, const char *arg)
{
    ts_value_t *v;
    if (load_value(arg, &v) != 0)
        return EXIT_USAGE;
    uint64_t change;
    int rc = append ? ts_append(c, bin, v, &change) : ts_put(c, bin, v, &change);
    ts_value_free(v);
    if (rc != 0)
        return report(append ? "append" : "put", rc);
    printf("OK change %" PRIu64 "\n", change);
    return 0;
}

/*
 * An output file being written: a temporary file beside the target, renamed over it once it is
 * complete and synced, so that the target is never seen half written.
 */
typedef struct outfile {
    const char *path;
    char tmp[PATH_MAX];
    FILE *f;
} outfile;

/* Create the temporary file. 0, or -1 after saying why (nothing is created then). */
static int out_open(outfile *o, const char *path)
{
    o->path = path;
    o->f = NULL;
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        fprintf(stderr, "tsctl: --out %s: is a directory\n", path);
        return -1;
    }
    const char *slash = strrchr(path, '/');
    int dlen = slash != NULL ? (int)(slash - path) + 1 : 0;
    const char *base = slash != NULL ? slash + 1 : path;
    int n = snprintf(o->tmp, sizeof(o->tmp), "%.*s.%s.tsctl-XXXXXX", dlen, path, base);
    if (base[0] == '\0' || n < 0 || (size_t)n >= sizeof(o->tmp)) {
        fprintf(stderr, "tsctl: --out %s: not a file name\n", path);
        return -1;
    }
    int fd = mkstemp(o->tmp);
    if (fd < 0) {
        fprintf(stderr, "tsctl: --out %s: cannot create a file there: %s\n", path, strerror(errno));
        return -1;
    }
    /* mkstemp makes the file private; give it the mode a plain create would (umask applied). */
    mode_t mask = umask(0);
    umask(mask);
    (void)fchmod(fd, 0666 & ~mask);
    o->f = fdopen(fd, "wb");
    if (o->f == NULL) {
        fprintf(stderr, "tsctl: --out %s: %s\n", path, strerror(errno));
        close(fd);
        unlink(o->tmp);
        return -1;
    }
    return 0;
}

static void out_abort(outfile *o)
{
    if (o->f != NULL) {
        fclose(o->f);
        o->f = NULL;
        unlink(o->tmp);
    }
}

/* Write t, sync, and rename over the target. 0, or -1 after saying why (the target untouched). */
static int out_commit(outfile *o, const ts_tensor_t *t)
{
    char err[512];
    int rc = ts__npy_write_file(o->f, o->path, t, err, sizeof(err));
    if (rc == 0 && fsync(fileno(o->f)) != 0) {
        snprintf(err, sizeof(err), "%s: sync failed: %s", o->path, strerror(errno));
        rc = -1;
    }
    if (fclose(o->f) != 0 && rc == 0) {
        snprintf(err, sizeof(err), "%s: write failed: %s", o->path, strerror(errno));
        rc = -1;
    }
    o->f = NULL;
    if (rc == 0 && rename(o->tmp, o->path) != 0) {
        snprintf(err, sizeof(err), "%s: %s", o->path, strerror(errno));
        rc = -1;
    }
    if (rc != 0) {
        unlink(o->tmp);
        fprintf(stderr, "tsctl: %s\n", err);
        return -1;
    }
    return 0;
}

/* The first tensor of an item that a .npy file can hold, or NULL with the reason in why. */
static const ts_tensor_t *writable_tensor(const ts_value_t *item, const char **why)
{
    const ts_tensor_t *t = item != NULL ? first_tensor(item) : NULL;
    *why = t == NULL                         ? "the first item holds no tensor"
           : ts__npy_descr(t->dtype) == NULL ? "NumPy has no dtype for the first tensor"
                                             : NULL;
    return *why == NULL ? t : NULL;
}

/* Append taken items back to the bin, in their order. 0 or the first error. */
static int give_back(ts_client_t *c, const char *bin, const ts_items_t *items)
{
    for (size_t i = 0; i < ts_items_count(items); i++) {
        int rc = ts_append(c, bin, ts_items_at(items, i), NULL);
        if (rc != 0)
            return rc;
    }
    return 0;
}

static int cmd_fetch(ts_client_t *c, int take, const char *bin, const char *out)
{
    outfile of;
    const char *why;
    if (out != NULL) {
        /* Everything that can be checked is checked before anything is taken: the file can
           be created, and the bin's first item (as it is now) holds a tensor to write. */
        ts_items_t *first;
        int rc = ts_peek(c, bin, 1, &first);
        if (rc != 0)
            return report(take ? "get" : "peek", rc);
        writable_tensor(ts_items_count(first) > 0 ? ts_items_at(first, 0) : NULL, &why);
        ts_items_free(first);
        if (why != NULL) {
            fprintf(stderr, "tsctl: --out %s: %s; nothing taken\n", out, why);
            return EXIT_FAILED;
        }
        if (out_open(&of, out) != 0)
            return EXIT_FAILED;
    }
    ts_items_t *items;
    int rc = take ? ts_get(c, bin, 0, &items) : ts_peek(c, bin, 0, &items);
    if (rc != 0) {
        if (out != NULL)
            out_abort(&of);
        return report(take ? "get" : "peek", rc);
    }
    size_t n = ts_items_count(items);
    char name[ESCAPED_MAX];
    printf("%zu item%s, change %" PRIu64 ", %" PRIu32 " left in the bin\n", n, n == 1 ? "" : "s",
           ts_items_version(items), ts_items_remaining(items));
    for (size_t i = 0; i < n; i++) {
        char path[32];
        snprintf(path, sizeof(path), "item %zu", i);
        print_value(ts_items_at(items, i), path, 0);
    }
    int status = 0;
    if (out != NULL) {
        const ts_tensor_t *t = writable_tensor(n > 0 ? ts_items_at(items, 0) : NULL, &why);
        if (t == NULL)
            fprintf(stderr, "tsctl: --out %s: %s (the bin changed since it was checked)\n", out,
                    why);
        if (t == NULL)
            out_abort(&of);
        if (t == NULL || out_commit(&of, t) != 0) {
            status = EXIT_FAILED;
            if (take) {
                rc = give_back(c, bin, items);
                if (rc == 0)
                    fprintf(stderr, "tsctl: the %zu item%s taken went back to the end of %s\n", n,
                            n == 1 ? "" : "s", esc_name(bin, name));
                else
                    report("putting the taken items back", rc);
            }
        } else {
            printf("wrote %s\n", out);
        }
    }
    ts_items_free(items);
    return status;
}

static int cmd_delete(ts_client_t *c, const char *bin)
{
    uint32_t n;
    int rc = ts_delete(c, bin, &n);
    if (rc != 0)
        return report("delete", rc);
    printf("removed %" PRIu32 " item%s\n", n, n == 1 ? "" : "s");
    return 0;
}

/* The bin's current change counter (0 when it does not exist). */
static int current_change(ts_client_t *c, const char *bin, uint64_t *change)
{
    ts_bin_list_t *list;
    int rc = ts_list(c, &list);
    if (rc != 0)
        return rc;
    *change = 0;
    for (size_t i = 0; i < list->count; i++)
        if (strcmp(list->bins[i].name, bin) == 0)
            *change = list->bins[i].version;
    ts_bin_list_free(list);
    return 0;
}

static int cmd_wait(ts_client_t *c, const char *bin, const char *after_arg, int timeout_ms)
{
    uint64_t after;
    if (after_arg != NULL) {
        if (parse_u64(after_arg, 0, UINT64_MAX, &after) != 0)
            return usage_error("bad CHANGE '%s' (a bin's change counter, as list shows it)",
                               after_arg);
    } else {
        int rc = current_change(c, bin, &after);
        if (rc != 0)
            return report("list", rc);
    }
    uint64_t change = 0;
    uint32_t n = 0;
    int rc = ts_wait(c, bin, after, timeout_ms, &change, &n);
    if (rc == TS_ETIMEDOUT) {
        printf("timed out: change %" PRIu64 ", %" PRIu32 " items\n", change, n);
        return EXIT_TIMEOUT;
    }
    if (rc != 0)
        return report("wait", rc);
    printf("change %" PRIu64 ", %" PRIu32 " items\n", change, n);
    return 0;
}

/*
 * listen: notifications arrive on the client's thread; main waits for Ctrl-C or the count. Once
 * the count is reached nothing more is printed: a burst of changes can arrive before main
 * looks again.
 */
static pthread_mutex_t listen_mu = PTHREAD_MUTEX_INITIALIZER;
static long listen_seen;
static long listen_count = -1; /* --count; -1: no limit */
static long listen_active;

static const char *event_name(ts_event_t e)
{
    switch (e) {
    case TS_EV_PUT:
        return "put";
    case TS_EV_APPEND:
        return "append";
    case TS_EV_GET:
        return "get";
    case TS_EV_DELETE:
        return "delete";
    case TS_EV_ROWS:
        return "rows";
    case TS_EV_DISCONNECTED:
        return "disconnected";
    case TS_EV_RESUBSCRIBED:
        return "resubscribed";
    default:
        return "?";
    }
}

static void on_note(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    (void)arg;
    pthread_mutex_lock(&listen_mu);
    if (status != 0) {
        if (status != TS_ECANCELED)
            fprintf(stderr, "tsctl: subscription ended: %s (%s)\n", ts_strerror(status),
                    ts_err_name(status));
        listen_active--;
    } else if (listen_count < 0 || listen_seen < listen_count) {
        char name[ESCAPED_MAX];
        printf("%s %s change %" PRIu64 " items %" PRIu32 "%s\n", esc_name(n->bin, name),
               event_name(n->event), n->version, n->n_items, n->coalesced ? " (coalesced)" : "");
        fflush(stdout);
        if (n->event != TS_EV_DISCONNECTED && n->event != TS_EV_RESUBSCRIBED)
            listen_seen++;
    }
    pthread_mutex_unlock(&listen_mu);
}

static int cmd_listen(ts_client_t *c, int nbins, char **bins, long count)
{
    pthread_mutex_lock(&listen_mu);
    listen_count = count;
    pthread_mutex_unlock(&listen_mu);
    for (int i = 0; i < nbins; i++) {
        int rc = ts_listen(c, bins[i], on_note, NULL);
        if (rc != 0)
            return report("listen", rc);
        pthread_mutex_lock(&listen_mu);
        listen_active++;
        pthread_mutex_unlock(&listen_mu);
    }
    fprintf(stderr, "listening to %d bin%s (Ctrl-C to stop)\n", nbins, nbins == 1 ? "" : "s");
    catch_interrupts();
    for (;;) {
        pthread_mutex_lock(&listen_mu);
        int done = (count > 0 && listen_seen >= count) || listen_active == 0;
        pthread_mutex_unlock(&listen_mu);
        if (done || interrupted)
            break;
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The command line
 */

/* The commands, how many operands each takes, and the options that apply to it. */
enum { OPT_OUT = 1, OPT_COUNT = 2, OPT_WATCH = 4 };
static const struct command {
    const char *name;
    int min_args, max_args; /* max_args -1: no limit */
    unsigned opts;
    const char *operands; /* for "NAME needs OPERANDS" */
} commands[] = {
    {"ping", 0, 0, 0, ""},
    {"stats", 0, 0, OPT_COUNT | OPT_WATCH, ""},
    {"list", 0, 0, 0, ""},
    {"put", 2, 2, 0, "BIN VALUE"},
    {"append", 2, 2, 0, "BIN VALUE"},
    {"get", 1, 1, OPT_OUT, "BIN"},
    {"peek", 1, 1, OPT_OUT, "BIN"},
    {"delete", 1, 1, 0, "BIN"},
    {"wait", 1, 2, 0, "BIN [CHANGE]"},
    {"listen", 1, -1, OPT_COUNT, "BIN..."},
    {"save", 0, 0, 0, ""},
};

/* getopt_long's value for options without a short form (above every char). */
#define LONG_TLS_CA 256

static const struct option long_opts[] = {
    {"host", required_argument, NULL, 'H'},
    {"port", required_argument, NULL, 'p'},
    {"unix", required_argument, NULL, 'u'},
    {"address", required_argument, NULL, 'a'},
    {"tls-ca", required_argument, NULL, LONG_TLS_CA},
    {"timeout", required_argument, NULL, 't'},
    {"token-file", required_argument, NULL, 'T'},
    {"out", required_argument, NULL, 'o'},
    {"count", required_argument, NULL, 'n'},
    {"watch", required_argument, NULL, 'w'},
    {"help", no_argument, NULL, 'h'},
    {"version", no_argument, NULL, 'V'},
    {NULL, 0, NULL, 0},
};
/* Leading ':' : a missing value is reported as ':' rather than '?'. */
static const char short_opts[] = ":H:p:u:a:t:T:o:n:w:hV";

/*
 * Negative numbers ("put b -2.5") would read as options. Before getopt sees them they are
 * replaced by the same string without its '-', and remembered here (by address) so that the
 * operand or option value gets its sign back afterwards.
 */
static char **negated;
static int n_negated;

static int looks_negative(const char *s)
{
    return s[0] == '-' &&
           (isdigit((unsigned char)s[1]) || (s[1] == '.' && isdigit((unsigned char)s[2])));
}

static char *unhide(char *s)
{
    for (int i = 0; s != NULL && i < n_negated; i++)
        if (negated[i] == s)
            return s - 1;
    return s;
}

/* The option argv[optind - 1] named, for messages: "--port" or "-p" (without any "=value"). */
static void option_name(char **argv, int ind, int ch, char *buf, size_t cap)
{
    const char *a = ind > 0 ? argv[ind - 1] : NULL;
    if (a != NULL && strncmp(a, "--", 2) == 0) {
        const char *eq = strchr(a, '=');
        snprintf(buf, cap, "%.*s", eq != NULL ? (int)(eq - a) : (int)strlen(a), a);
    } else {
        snprintf(buf, cap, "-%c", ch);
    }
}

/* Parse the command line into a. Returns -1 to go on, or the exit status to end with. */
static int parse_args(int argc, char **argv, args_t *a)
{
    memset(a, 0, sizeof(*a));
    a->host = "127.0.0.1";
    a->port = 8000;
    a->count = -1;
    negated = calloc((size_t)argc + 1, sizeof(*negated));
    if (negated == NULL) {
        fprintf(stderr, "tsctl: out of memory\n");
        return EXIT_FAILED;
    }
    for (int i = 1; i < argc; i++)
        if (looks_negative(argv[i]))
            argv[i] = negated[n_negated++] = argv[i] + 1;
    unsigned given = 0;
    const char *given_name[8] = {0};
    char name[64];
    opterr = 0;
    int ch;
    while ((ch = getopt_long(argc, argv, short_opts, long_opts, NULL)) != -1) {
        char *v = unhide(optarg);
        uint64_t n;
        switch (ch) {
        case 'h':
            fputs(usage_text, stdout);
            return 0;
        case 'V':
            printf("tsctl (libtensorshare %s), protocol version %d\n", TS_VERSION_STRING,
                   TSCTL_PROTOCOL_VERSION);
            return 0;
        case 'H':
            /* Not a host: a scheme or a shard list would be wrapped into "[...]:8000". */
            if (strstr(v, "://") != NULL || strchr(v, ',') != NULL)
                return usage_error("'%s' is not a host for --host; give a whole address with "
                                   "--address",
                                   v);
            a->host = v;
            a->place_given = 1;
            break;
        case 'u':
            a->unix_path = v;
            a->place_given = 1;
            break;
        case 'a':
            if (v[0] == '\0')
                return usage_error("bad value '' for --address");
            a->address = v;
            break;
        case LONG_TLS_CA:
            a->tls_ca = v;
            break;
        case 'T':
            a->token_file = v;
            break;
        case 'p':
            if (parse_u64(v, 1, 65535, &n) != 0)
                return usage_error("bad value '%s' for --port (1 to 65535)", v);
            a->port = (long)n;
            a->place_given = 1;
            break;
        case 't':
            if (parse_u64(v, 1, INT32_MAX, &n) != 0)
                return usage_error("bad value '%s' for --timeout (milliseconds, at least 1)", v);
            a->timeout_ms = (int)n;
            break;
        case 'o':
            a->out = v;
            given |= OPT_OUT;
            given_name[OPT_OUT] = "--out";
            break;
        case 'n':
            if (parse_u64(v, 1, INT32_MAX, &n) != 0)
                return usage_error("bad value '%s' for --count (at least 1)", v);
            a->count = (long)n;
            given |= OPT_COUNT;
            given_name[OPT_COUNT] = "--count";
            break;
        case 'w': {
            char *end;
            errno = 0;
            double s = strtod(v, &end);
            if (end == v || *end != '\0' || errno != 0 || !(s >= WATCH_MIN_SECONDS) ||
                s > WATCH_MAX_SECONDS)
                return usage_error("bad value '%s' for --watch (seconds, %g to %g)", v,
                                   WATCH_MIN_SECONDS, WATCH_MAX_SECONDS);
            a->watch_s = s;
            given |= OPT_WATCH;
            given_name[OPT_WATCH] = "--watch";
            break;
        }
        case ':':
            option_name(argv, optind, optopt, name, sizeof(name));
            return usage_error("option '%s' needs a value", name);
        default: {
            const char *arg = unhide(argv[optind - 1]);
            if (strncmp(arg, "--", 2) == 0 && optopt != 0) {
                option_name(argv, optind, optopt, name, sizeof(name));
                return usage_error("option '%s' takes no value", name);
            }
            if (optopt != 0)
                return usage_error("unknown option '-%c'", optopt);
            return usage_error("unknown option '%s'", arg);
        }
        }
    }
    if (a->address != NULL && a->place_given)
        return usage_error("--address gives the whole address: leave out --host, --port and "
                           "--unix");
    if (optind >= argc)
        return usage_error("no command given");
    a->cmd = unhide(argv[optind]);
    a->nargs = argc - optind - 1;
    a->args = argv + optind + 1;
    for (int i = 0; i < a->nargs; i++)
        a->args[i] = unhide(a->args[i]);
    const struct command *cmd = NULL;
    for (size_t k = 0; k < sizeof(commands) / sizeof(commands[0]); k++)
        if (strcmp(a->cmd, commands[k].name) == 0)
            cmd = &commands[k];
    if (cmd == NULL)
        return usage_error("unknown command '%s'", a->cmd);
    for (unsigned bit = 1; bit < 8; bit <<= 1)
        if ((given & bit) != 0 && (cmd->opts & bit) == 0)
            return usage_error("option '%s' does not apply to %s", given_name[bit], cmd->name);
    if (strcmp(cmd->name, "stats") == 0 && (given & OPT_COUNT) != 0 && (given & OPT_WATCH) == 0)
        return usage_error("option '--count' of stats needs --watch");
    if (a->nargs < cmd->min_args)
        return usage_error("%s needs %s", cmd->name, cmd->operands);
    if (cmd->max_args >= 0 && a->nargs > cmd->max_args)
        return usage_error("unexpected argument '%s' after %s", a->args[cmd->max_args], cmd->name);
    return -1;
}

/*
 * After TS_EAUTH at connect, a hint for what failed, told apart by the library's message (why):
 * a server certificate that failed verification ("TLS: ... certificate verification failed"):
 * the CA it was checked against and how to give another (or, when it names another host, that);
 * a refused handshake (the token): both ways of giving one. A cluster's message names every shard's
 * reason, so it may get both.
 */
static void auth_hint(const char *token_file, const char *tls_ca, const char *why)
{
    int cert = strstr(why, "certificate verification failed") != NULL;
    int token = strstr(why, "handshake refused") != NULL || !cert;
    int name = strstr(why, "hostname mismatch") != NULL || strstr(why, "IP address mismatch");
    const char *env_ca = getenv("TS_TLS_CA");
    if (cert && name)
        fprintf(stderr, "tsctl: hint: the server's certificate does not name the host of the "
                        "address: connect by a name or IP address it carries\n");
    else if (cert && tls_ca != NULL)
        fprintf(stderr,
                "tsctl: hint: the server's certificate did not verify against --tls-ca %s\n",
                tls_ca);
    else if (cert && env_ca != NULL && env_ca[0] != '\0')
        fprintf(stderr,
                "tsctl: hint: the server's certificate did not verify against TS_TLS_CA "
                "(%s); pass its CA with --tls-ca FILE\n",
                env_ca);
    else if (cert)
        fprintf(stderr, "tsctl: hint: the server's certificate did not verify against the system's "
                        "CAs: pass its CA with --tls-ca FILE, or set TS_TLS_CA\n");
    if (!token)
        return;
    const char *env = getenv("TS_AUTH_TOKEN");
    if (token_file != NULL)
        fprintf(stderr, "tsctl: hint: the server refused the token in %s\n", token_file);
    else if (env != NULL && env[0] != '\0')
        fprintf(stderr, "tsctl: hint: the server refused the token in TS_AUTH_TOKEN; give "
                        "another with --token-file FILE\n");
    else
        fprintf(stderr, "tsctl: hint: this server needs a token: pass --token-file FILE, or set "
                        "TS_AUTH_TOKEN\n");
}

int main(int argc, char **argv)
{
    /*
     * A write past the file size limit fails with EFBIG instead of killing tsctl, so that get
     * --out can put the items it took back and remove its temporary file.
     */
    signal(SIGXFSZ, SIG_IGN);
    args_t a;
    int status = parse_args(argc, argv, &a);
    if (status >= 0) {
        free(negated);
        return status;
    }
    char address[PATH_MAX + 16];
    if (a.unix_path != NULL)
        snprintf(address, sizeof(address), "unix:%s", a.unix_path);
    else if (strchr(a.host, ':') != NULL)
        snprintf(address, sizeof(address), "[%s]:%ld", a.host, a.port);
    else
        snprintf(address, sizeof(address), "%s:%ld", a.host, a.port);
    ts_client_options_t opts;
    ts_client_options_init(&opts);
    if (a.timeout_ms > 0) {
        opts.connect_timeout_ms = a.timeout_ms; /* a server that does not answer: about -t */
        opts.request_timeout_ms = a.timeout_ms;
    }
    opts.tls_ca_file = a.tls_ca; /* NULL: TS_TLS_CA, else the system's store */
    static char token[4096];
    if (a.token_file != NULL) {
        if (read_token(a.token_file, token, sizeof(token)) != 0) {
            free(negated);
            return EXIT_USAGE;
        }
        opts.auth_token = token;
    }
    ts_client_t *c;
    int rc = ts_client_open(&c, a.address != NULL ? a.address : address, &opts);
    if (rc != 0) {
        char why[1024];
        snprintf(why, sizeof(why), "%s", ts_last_error());
        status = report("connect", rc);
        if (rc == TS_EINVAL)
            status = EXIT_USAGE; /* a malformed --address or an unreadable --tls-ca */
        if (rc == TS_EAUTH)
            auth_hint(a.token_file, a.tls_ca, why);
        free(negated);
        return status;
    }

    const char *cmd = a.cmd;
    char **args = a.args;
    if (strcmp(cmd, "ping") == 0)
        status = cmd_ping(c);
    else if (strcmp(cmd, "stats") == 0)
        status = a.watch_s > 0 ? cmd_stats_watch(c, a.watch_s, a.count) : cmd_stats_once(c);
    else if (strcmp(cmd, "list") == 0)
        status = cmd_list(c);
    else if (strcmp(cmd, "put") == 0 || strcmp(cmd, "append") == 0)
        status = cmd_store(c, cmd[0] == 'a', args[0], args[1]);
    else if (strcmp(cmd, "get") == 0 || strcmp(cmd, "peek") == 0)
        status = cmd_fetch(c, cmd[0] == 'g', args[0], a.out);
    else if (strcmp(cmd, "delete") == 0)
        status = cmd_delete(c, args[0]);
    else if (strcmp(cmd, "save") == 0)
        status = cmd_save(c);
    else if (strcmp(cmd, "wait") == 0)
        status = cmd_wait(c, args[0], a.nargs > 1 ? args[1] : NULL,
                          a.timeout_ms > 0 ? a.timeout_ms : DEFAULT_WAIT_MS);
    else
        status = cmd_listen(c, a.nargs, args, a.count);
    ts_client_free(c);
    free(negated);
    return status;
}
