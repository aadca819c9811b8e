/*
 * tsctl: the command-line client of tensord, in the spirit of redis-cli.
 *
 *   tsctl [--host H] [--port P] [--unix PATH] [--timeout MS] [--token-file F] COMMAND [ARGS...]
 *
 * Exit status: 0 success, 1 the operation failed (server error, connection), 2 usage error,
 * 3 timed out (wait), 4 not found (get/peek of a missing bin).
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "npy.h"
#include "tensorshare/tensorshare.h"

#define EXIT_FAILED   1
#define EXIT_USAGE    2
#define EXIT_TIMEOUT  3
#define EXIT_NOTFOUND 4
#define SHOW_VALUES   6 /* values printed per tensor in summaries */

static const char usage_text[] =
    "usage: tsctl [--host H] [--port P] [--unix PATH] [--timeout MS] [--token-file F]\n"
    "             COMMAND [ARGS...]\n"
    "\n"
    "Commands:\n"
    "  ping                          round trip to the server\n"
    "  stats                         server statistics\n"
    "  list                          every bin with its items, bytes and version\n"
    "  put BIN VALUE                 replace BIN's content with one item\n"
    "  append BIN VALUE              add one item to BIN\n"
    "                                VALUE: FILE.npy, or a literal such as 3.5 or [1,2,3]\n"
    "                                (literals become float32 tensors)\n"
    "  get BIN [--out FILE.npy]      print and remove BIN's items\n"
    "  peek BIN [--out FILE.npy]     print BIN's items, keeping them\n"
    "                                (--out saves the first tensor of the first item)\n"
    "  delete BIN                    remove BIN\n"
    "  wait BIN [VERSION] [--timeout MS]\n"
    "                                wait until BIN's version passes VERSION (default: the\n"
    "                                current one, i.e. the next change)\n"
    "  listen BIN... [--count N]     print changes as they happen, until Ctrl-C or N of them\n"
    "  save                          ask the server for a snapshot; returns once it is on disk\n"
    "\n"
    "--token-file F reads the server's token from F (trailing whitespace ignored); without it\n"
    "the token comes from TS_AUTH_TOKEN, if set.\n"
    "Defaults: --host 127.0.0.1 --port 8000. Exit status: 0 ok, 1 failed, 2 usage,\n"
    "3 timed out, 4 no such bin.\n";

static int usage(const char *msg)
{
    if (msg != NULL)
        fprintf(stderr, "tsctl: %s\n\n", msg);
    fputs(usage_text, stderr);
    return EXIT_USAGE;
}

/* Report a failed call and map it to an exit status. */
static int report(const char *what, int rc)
{
    const char *msg = ts_client_last_error();
    fprintf(stderr, "tsctl: %s: %s (%s)%s%s\n", what, ts_strerror(rc), ts_err_name(rc),
            msg[0] != '\0' ? ": " : "", msg);
    if (rc == TS_ETIMEDOUT)
        return EXIT_TIMEOUT;
    if (rc == TS_ENOENT)
        return EXIT_NOTFOUND;
    return EXIT_FAILED;
}

/* Parse a non-negative integer argument. 0 or -1. */
static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    if (s[0] == '-' || s[0] == '\0')
        return -1;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0')
        return -1;
    *out = v;
    return 0;
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
            char sub[300];
            if (is_map)
                snprintf(sub, sizeof(sub), "%s", ts_map_key_at(v, i));
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
        ts_value_string(v, &s, &len);
        printf("string \"%.*s\"%s\n", len > 60 ? 60 : (int)len, s, len > 60 ? "..." : "");
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

static int cmd_ping(ts_client_t *c)
{
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    int rc = ts_ping(c);
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (rc != 0)
        return report("ping", rc);
    double ms = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
    printf("PONG (%.3f ms)\n", ms);
    return 0;
}

static int cmd_stats(ts_client_t *c)
{
    ts_value_t *stats;
    int rc = ts_stats(c, &stats);
    if (rc != 0)
        return report("stats", rc);
    for (size_t i = 0; i < ts_value_len(stats); i++) {
        const ts_value_t *v = ts_map_value_at(stats, i);
        int64_t n;
        if (ts_value_int(v, &n) == 0)
            printf("%s: %" PRId64 "\n", ts_map_key_at(stats, i), n);
        else
            print_value(v, ts_map_key_at(stats, i), 0);
    }
    ts_value_free(stats);
    return 0;
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
        printf("%-32s %10s %14s %10s\n", "BIN", "ITEMS", "BYTES", "VERSION");
    for (size_t i = 0; i < list->count; i++) {
        const ts_bin_info_t *b = &list->bins[i];
        printf("%-32s %10" PRIu32 " %14" PRIu64 " %10" PRIu64 "\n", b->name, b->n_items, b->bytes,
               b->version);
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

static int cmd_store(ts_client_t *c, int append, int argc, char **argv)
{
    if (argc != 2)
        return usage(append ? "append needs BIN VALUE" : "put needs BIN VALUE");
    ts_value_t *v;
    if (load_value(argv[1], &v) != 0)
        return EXIT_USAGE;
    uint64_t version;
    int rc = append ? ts_append(c, argv[0], v, &version) : ts_put(c, argv[0], v, &version);
    ts_value_free(v);
    if (rc != 0)
        return report(append ? "append" : "put", rc);
    printf("OK version %" PRIu64 "\n", version);
    return 0;
}

static int cmd_fetch(ts_client_t *c, int take, int argc, char **argv)
{
    const char *bin = NULL, *out = NULL;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--out") == 0 && i + 1 < argc)
            out = argv[++i];
        else if (bin == NULL)
            bin = argv[i];
        else
            return usage("too many arguments");
    }
    if (bin == NULL)
        return usage(take ? "get needs BIN" : "peek needs BIN");
    ts_items_t *items;
    int rc = take ? ts_get(c, bin, 0, &items) : ts_peek(c, bin, 0, &items);
    if (rc != 0)
        return report(take ? "get" : "peek", rc);
    size_t n = ts_items_count(items);
    printf("%zu item%s, version %" PRIu64 ", %" PRIu32 " left in the bin\n", n, n == 1 ? "" : "s",
           ts_items_version(items), ts_items_remaining(items));
    for (size_t i = 0; i < n; i++) {
        char path[32];
        snprintf(path, sizeof(path), "item %zu", i);
        print_value(ts_items_at(items, i), path, 0);
    }
    int status = 0;
    if (out != NULL) {
        const ts_tensor_t *t = n > 0 ? first_tensor(ts_items_at(items, 0)) : NULL;
        char err[512];
        if (t == NULL) {
            fprintf(stderr, "tsctl: no tensor to write to %s\n", out);
            status = EXIT_FAILED;
        } else if (ts__npy_write(out, t, err, sizeof(err)) != 0) {
            fprintf(stderr, "tsctl: %s\n", err);
            status = EXIT_FAILED;
        } else {
            printf("wrote %s\n", out);
        }
    }
    ts_items_free(items);
    return status;
}

static int cmd_delete(ts_client_t *c, int argc, char **argv)
{
    if (argc != 1)
        return usage("delete needs BIN");
    uint32_t n;
    int rc = ts_delete(c, argv[0], &n);
    if (rc != 0)
        return report("delete", rc);
    printf("removed %" PRIu32 " item%s\n", n, n == 1 ? "" : "s");
    return 0;
}

/* The bin's current version (0 when it does not exist). */
static int current_version(ts_client_t *c, const char *bin, uint64_t *version)
{
    ts_bin_list_t *list;
    int rc = ts_list(c, &list);
    if (rc != 0)
        return rc;
    *version = 0;
    for (size_t i = 0; i < list->count; i++)
        if (strcmp(list->bins[i].name, bin) == 0)
            *version = list->bins[i].version;
    ts_bin_list_free(list);
    return 0;
}

static int cmd_wait(ts_client_t *c, int argc, char **argv, int timeout_ms)
{
    const char *bin = NULL, *ver = NULL;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--timeout") == 0 && i + 1 < argc) {
            uint64_t t;
            if (parse_u64(argv[++i], &t) != 0 || t > INT32_MAX)
                return usage("bad --timeout");
            timeout_ms = (int)t;
        } else if (bin == NULL) {
            bin = argv[i];
        } else if (ver == NULL) {
            ver = argv[i];
        } else {
            return usage("too many arguments");
        }
    }
    if (bin == NULL)
        return usage("wait needs BIN");
    uint64_t after;
    if (ver != NULL) {
        if (parse_u64(ver, &after) != 0)
            return usage("bad VERSION");
    } else {
        int rc = current_version(c, bin, &after);
        if (rc != 0)
            return report("list", rc);
    }
    uint64_t version = 0;
    uint32_t n = 0;
    int rc = ts_wait(c, bin, after, timeout_ms, &version, &n);
    if (rc == TS_ETIMEDOUT) {
        printf("timed out: version %" PRIu64 ", %" PRIu32 " items\n", version, n);
        return EXIT_TIMEOUT;
    }
    if (rc != 0)
        return report("wait", rc);
    printf("version %" PRIu64 ", %" PRIu32 " items\n", version, n);
    return 0;
}

/* listen: notifications arrive on the client's thread; main waits for Ctrl-C or the count. */
static volatile sig_atomic_t interrupted;
static pthread_mutex_t listen_mu = PTHREAD_MUTEX_INITIALIZER;
static long listen_seen;
static long listen_active;

static void on_sigint(int sig)
{
    (void)sig;
    interrupted = 1;
}

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
            fprintf(stderr, "tsctl: subscription ended: %s\n", ts_strerror(status));
        listen_active--;
    } else {
        printf("%s %s version %" PRIu64 " items %" PRIu32 "%s\n", n->bin, event_name(n->event),
               n->version, n->n_items, n->coalesced ? " (coalesced)" : "");
        fflush(stdout);
        if (n->event != TS_EV_DISCONNECTED && n->event != TS_EV_RESUBSCRIBED)
            listen_seen++;
    }
    pthread_mutex_unlock(&listen_mu);
}

static int cmd_listen(ts_client_t *c, int argc, char **argv)
{
    long count = -1;
    int nbins = 0;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--count") == 0 && i + 1 < argc) {
            uint64_t n;
            if (parse_u64(argv[++i], &n) != 0 || n == 0 || n > INT32_MAX)
                return usage("bad --count");
            count = (long)n;
            continue;
        }
        int rc = ts_listen(c, argv[i], on_note, NULL);
        if (rc != 0)
            return report("listen", rc);
        pthread_mutex_lock(&listen_mu);
        listen_active++;
        pthread_mutex_unlock(&listen_mu);
        nbins++;
    }
    if (nbins == 0)
        return usage("listen needs at least one BIN");
    fprintf(stderr, "listening to %d bin%s (Ctrl-C to stop)\n", nbins, nbins == 1 ? "" : "s");
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
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

int main(int argc, char **argv)
{
    const char *host = "127.0.0.1", *unix_path = NULL, *token_file = NULL;
    long port = 8000;
    int timeout_ms = 0;
    int i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(usage_text, stdout);
            return 0;
        }
        if (i + 1 >= argc)
            return usage("missing option value");
        uint64_t n;
        if (strcmp(argv[i], "--host") == 0) {
            host = argv[++i];
        } else if (strcmp(argv[i], "--port") == 0) {
            if (parse_u64(argv[++i], &n) != 0 || n == 0 || n > 65535)
                return usage("bad --port");
            port = (long)n;
        } else if (strcmp(argv[i], "--unix") == 0) {
            unix_path = argv[++i];
        } else if (strcmp(argv[i], "--token-file") == 0) {
            token_file = argv[++i];
        } else if (strcmp(argv[i], "--timeout") == 0) {
            if (parse_u64(argv[++i], &n) != 0 || n == 0 || n > INT32_MAX)
                return usage("bad --timeout");
            timeout_ms = (int)n;
        } else {
            return usage("unknown option");
        }
    }
    if (i >= argc)
        return usage(NULL);
    const char *cmd = argv[i++];
    int nargs = argc - i;
    char **args = argv + i;
    static const char *const known[] = {"ping", "stats",  "list", "put",    "append", "get",
                                        "peek", "delete", "wait", "listen", "save"};
    int ok = 0;
    for (size_t k = 0; k < sizeof(known) / sizeof(known[0]); k++)
        ok |= strcmp(cmd, known[k]) == 0;
    if (!ok)
        return usage("unknown command");

    char address[600];
    if (unix_path != NULL)
        snprintf(address, sizeof(address), "unix:%s", unix_path);
    else if (strchr(host, ':') != NULL)
        snprintf(address, sizeof(address), "[%s]:%ld", host, port);
    else
        snprintf(address, sizeof(address), "%s:%ld", host, port);
    ts_options_t opts;
    ts_options_init(&opts);
    if (timeout_ms > 0)
        opts.request_timeout_ms = timeout_ms;
    static char token[4096];
    if (token_file != NULL) {
        if (read_token(token_file, token, sizeof(token)) != 0)
            return EXIT_USAGE;
        opts.auth_token = token;
    }
    ts_client_t *c;
    int rc = ts_client_open(&c, address, &opts);
    if (rc != 0)
        return report("connect", rc);

    int status;
    if (strcmp(cmd, "ping") == 0)
        status = nargs == 0 ? cmd_ping(c) : usage("ping takes no arguments");
    else if (strcmp(cmd, "stats") == 0)
        status = nargs == 0 ? cmd_stats(c) : usage("stats takes no arguments");
    else if (strcmp(cmd, "list") == 0)
        status = nargs == 0 ? cmd_list(c) : usage("list takes no arguments");
    else if (strcmp(cmd, "put") == 0 || strcmp(cmd, "append") == 0)
        status = cmd_store(c, cmd[0] == 'a', nargs, args);
    else if (strcmp(cmd, "get") == 0 || strcmp(cmd, "peek") == 0)
        status = cmd_fetch(c, cmd[0] == 'g', nargs, args);
    else if (strcmp(cmd, "delete") == 0)
        status = cmd_delete(c, nargs, args);
    else if (strcmp(cmd, "save") == 0)
        status = nargs == 0 ? cmd_save(c) : usage("save takes no arguments");
    else if (strcmp(cmd, "wait") == 0)
        status = cmd_wait(c, nargs, args, timeout_ms > 0 ? timeout_ms : 10000);
    else
        status = cmd_listen(c, nargs, args);
    ts_client_free(c);
    return status;
}
