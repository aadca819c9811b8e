/*
 * The documents against a running tensord: the STATS table of docs/PROTOCOL.md (section 8.12)
 * lists exactly the keys the server sends, every flag of `tensord --help` appears in the tables
 * of docs/SAFETY.md with the default the help shows, the fixed numbers the documents quote are
 * the server's constants, and behaviours the documents promise (compressed bodies of raw length
 * 0, a failed SAVE and SAVE_FAILING, SHUTTING_DOWN at shutdown) are what tensord does. A document
 * that cannot be read fails the test, never skips it.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "auth.h"
#include "compress.h"
#include "msg.h"
#include "record.h"
#include "test_server_util.h"

/* Keys and flags are short; these bound the tables read from the documents and the daemon. */
#define MAX_KEYS     256
#define MAX_KEY_LEN  64
#define MAX_HELP     (64 * 1024) /* bytes of `tensord --help` output read at most */
#define HELP_WAIT_MS 10000       /* ms; `tensord --help` must be done within this */

static tsh_server srv;

static int start(void **state)
{
    (void)state;
    return tsh_server_start(&srv, NULL);
}

static int stop(void **state)
{
    (void)state;
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

typedef struct keyset {
    char k[MAX_KEYS][MAX_KEY_LEN];
    size_t n;
} keyset;

static int keyset_has(const keyset *s, const char *k)
{
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->k[i], k) == 0)
            return 1;
    return 0;
}

static void keyset_add(keyset *s, const char *k, size_t len, const char *where)
{
    if (len == 0 || len >= MAX_KEY_LEN || s->n >= MAX_KEYS)
        fail_msg("%s: key '%.*s' is empty, too long or one too many", where, (int)len, k);
    char buf[MAX_KEY_LEN];
    memcpy(buf, k, len);
    buf[len] = '\0';
    if (keyset_has(s, buf))
        fail_msg("%s: key '%s' is listed twice", where, buf);
    memcpy(s->k[s->n++], buf, len + 1);
}

/* The section of doc that starts at the heading line head, up to the next heading of any level. */
static const char *section(const char *doc, const char *head, size_t *len)
{
    const char *p = strstr(doc, head);
    if (p == NULL) {
        fail_msg("docs/PROTOCOL.md has no heading '%s'", head);
        *len = 0; /* not reached: fail_msg does not return */
        return doc;
    }
    const char *end = strstr(p + strlen(head), "\n#");
    *len = end == NULL ? strlen(p) : (size_t)(end - p);
    return p;
}

/* The keys of the STATS table: the first cell, in backticks, of every row of section 8.12. */
static void doc_stats_keys(keyset *out)
{
    char *doc = tsh_read_source_file("docs/PROTOCOL.md", NULL);
    if (doc == NULL)
        fail_msg("docs/PROTOCOL.md cannot be read");
    size_t len;
    const char *sec = section(doc, "### 8.12 STATS", &len);
    out->n = 0;
    for (const char *p = sec; p < sec + len;) {
        const char *eol = memchr(p, '\n', (size_t)(sec + len - p));
        if (eol == NULL)
            eol = sec + len;
        if (strncmp(p, "| `", 3) == 0) {
            const char *k = p + 3;
            const char *e = memchr(k, '`', (size_t)(eol - k));
            if (e == NULL)
                fail_msg("docs/PROTOCOL.md 8.12: a row with an unclosed key: %.*s", (int)(eol - p),
                         p);
            keyset_add(out, k, (size_t)(e - k), "docs/PROTOCOL.md 8.12");
        }
        p = eol + 1;
    }
    free(doc);
    if (out->n == 0)
        fail_msg("docs/PROTOCOL.md 8.12 has no STATS table");
}

/* The keys of the STATS reply of a running server. */
static void server_stats_keys(keyset *out)
{
    int fd = tsu_client(&srv);
    assert_int_equal(tsh_send(fd, TS_OP_STATS, 1, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_STATS, 1, TS_ST_OK);
    assert_int_equal(ts__record_validate(f.body, f.len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
    uint8_t *copy = ts__malloc_aligned(f.len);
    assert_non_null(copy);
    memcpy(copy, f.body, f.len);
    ts__rbuf *rb = ts__rbuf_new(copy, f.len, NULL);
    assert_non_null(rb);
    ts_value_t *root = ts__record_decode(rb, 0, f.len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__rbuf_unref(rb);
    assert_non_null(root);
    assert_int_equal(ts_value_type(root), TS_TYPE_MAP);
    out->n = 0;
    for (size_t i = 0; i < ts_value_len(root); i++) {
        const char *k = ts_map_key_at(root, i);
        int64_t v;
        assert_non_null(k);
        /* Every value is an int (section 8.12). */
        assert_int_equal(ts_value_int(ts_map_value_at(root, i), &v), 0);
        keyset_add(out, k, strlen(k), "STATS reply");
    }
    ts__record_tree_free(root);
    tsu_frame_free(&f);
    close(fd);
}

static void test_stats_table_matches_server(void **state)
{
    (void)state;
    static keyset doc, got;
    doc_stats_keys(&doc);
    server_stats_keys(&got);
    int bad = 0;
    for (size_t i = 0; i < got.n; i++)
        if (!keyset_has(&doc, got.k[i])) {
            print_error("STATS sends '%s', which docs/PROTOCOL.md 8.12 does not list\n", got.k[i]);
            bad = 1;
        }
    for (size_t i = 0; i < doc.n; i++)
        if (!keyset_has(&got, doc.k[i])) {
            print_error("docs/PROTOCOL.md 8.12 lists '%s', which STATS does not send\n", doc.k[i]);
            bad = 1;
        }
    assert_int_equal(bad, 0);
    assert_int_equal(doc.n, got.n);
}

/* Run `$TS_TENSORD --help` and return its standard output (free it); bounded in time. */
static char *tensord_help(void)
{
    const char *bin = getenv("TS_TENSORD");
    assert_non_null(bin);
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(p[1], STDOUT_FILENO);
        close(p[0]);
        close(p[1]);
        execl(bin, bin, "--help", (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    char *out = malloc(MAX_HELP + 1);
    assert_non_null(out);
    size_t n = 0;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        long spent = (t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000;
        struct pollfd pf = {.fd = p[0], .events = POLLIN};
        if (spent >= HELP_WAIT_MS || poll(&pf, 1, (int)(HELP_WAIT_MS - spent)) <= 0)
            break;
        ssize_t r = read(p[0], out + n, MAX_HELP - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
        if (n == MAX_HELP)
            break;
    }
    close(p[0]);
    out[n] = '\0';
    /* Its output is complete; it exits right after (bounded: HELP_WAIT_MS more at most). */
    int status = 0;
    pid_t w = 0;
    for (int i = 0; i < HELP_WAIT_MS && (w = waitpid(pid, &status, WNOHANG)) == 0; i++)
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    if (w != pid) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        fail_msg("tensord --help did not finish within %d ms", HELP_WAIT_MS);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail_msg("tensord --help did not exit 0");
    return out;
}

/*
 * The default the help shows for a flag: the last "[...]" of its entry (its own line and the
 * continuation lines that follow), the part after " = " when there is one ("[1073741824 = 1g]"
 * is 1g). Empty when the entry shows none.
 */
static void help_default(const char *entry, size_t len, char *out, size_t cap)
{
    const char *open = NULL, *close_b = NULL;
    for (const char *p = entry; p < entry + len; p++)
        if (*p == '[')
            open = p;
    out[0] = '\0';
    if (open == NULL)
        return;
    close_b = memchr(open, ']', (size_t)(entry + len - open));
    assert_non_null(close_b);
    const char *v = open + 1;
    for (const char *p = v; p + 3 <= close_b; p++)
        if (strncmp(p, " = ", 3) == 0)
            v = p + 3;
    size_t n = (size_t)(close_b - v);
    assert_true(n < cap);
    memcpy(out, v, n);
    out[n] = '\0';
}

/*
 * Check every row of doc whose first cell is `flag` or starts with `flag followed by a space:
 * its second cell is the help's default (or starts with it, then a space), or "—" when the help
 * shows none. Returns the number of rows found.
 */
static int check_rows(const char *doc, const char *flag, const char *def)
{
    char pre[MAX_KEY_LEN + 4];
    snprintf(pre, sizeof(pre), "| `%s", flag);
    int rows = 0;
    for (const char *p = doc; (p = strstr(p, pre)) != NULL; p += strlen(pre)) {
        if (p != doc && p[-1] != '\n')
            continue;
        char after = p[strlen(pre)];
        if (after != '`' && after != ' ')
            continue; /* another flag that begins with this one (--output-soft-seconds) */
        const char *c2 = strstr(p + 1, " | ");
        const char *eol = strchr(p, '\n');
        if (c2 == NULL || (eol != NULL && c2 > eol))
            fail_msg("docs/SAFETY.md: the row of %s has no default cell", flag);
        c2 += 3;
        const char *end = strstr(c2, " |");
        assert_non_null(end);
        size_t n = (size_t)(end - c2);
        if (def[0] == '\0') {
            if (n != strlen("—") || strncmp(c2, "—", n) != 0)
                fail_msg("docs/SAFETY.md: %s has no default in --help, the doc says '%.*s'", flag,
                         (int)n, c2);
        } else {
            size_t dl = strlen(def);
            if (n < dl || strncmp(c2, def, dl) != 0 || (n > dl && c2[dl] != ' '))
                fail_msg("docs/SAFETY.md: %s defaults to '%s' in --help, the doc says '%.*s'", flag,
                         def, (int)n, c2);
        }
        rows++;
    }
    return rows;
}

static void test_every_flag_in_safety_doc(void **state)
{
    (void)state;
    char *help = tensord_help();
    char *doc = tsh_read_source_file("docs/SAFETY.md", NULL);
    if (doc == NULL)
        fail_msg("docs/SAFETY.md cannot be read");
    int flags = 0, missing = 0;
    for (const char *p = help; p != NULL && *p != '\0';) {
        const char *eol = strchr(p, '\n');
        const char *next = eol == NULL ? NULL : eol + 1;
        if (strncmp(p, "  --", 4) != 0) {
            p = next;
            continue;
        }
        /* The entry: this line and the more-indented lines after it. */
        const char *end = next;
        while (end != NULL && strncmp(end, "    ", 4) == 0 && strncmp(end, "  --", 4) != 0) {
            const char *e = strchr(end, '\n');
            end = e == NULL ? NULL : e + 1;
        }
        size_t elen = end == NULL ? strlen(p) : (size_t)(end - p);
        char flag[MAX_KEY_LEN];
        size_t fl = strcspn(p + 2, " \n");
        assert_true(fl < sizeof(flag));
        memcpy(flag, p + 2, fl);
        flag[fl] = '\0';
        char def[MAX_KEY_LEN];
        help_default(p, elen, def, sizeof(def));
        if (check_rows(doc, flag, def) == 0) {
            print_error("docs/SAFETY.md has no table row for %s\n", flag);
            missing++;
        }
        flags++;
        p = end;
    }
    free(doc);
    free(help);
    assert_true(flags >= 20);
    assert_int_equal(missing, 0);
}

/* HELLO asking for LZ4; the server must grant it. */
static int lz4_client(void)
{
    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    const uint8_t body[4] = {1, TS_HELLO_LZ4, 0, 0};
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, body, sizeof(body)), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    assert_true(f.len >= 2 && (f.body[1] & TS_HELLO_LZ4));
    tsu_frame_free(&f);
    return fd;
}

/* Send a compressed frame: header with flag 0x01, then body as given (raw_len and block). */
static void send_lz4(int fd, uint8_t op, uint32_t rid, const uint8_t *body, size_t len)
{
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .flags = TS_FLAG_LZ4,
                 .request_id = rid,
                 .body_len = len};
    uint8_t hdr[TS_HDR_SIZE];
    ts__hdr_encode(&h, hdr);
    assert_int_equal(tsh_write_all(fd, hdr, sizeof(hdr)), 0);
    assert_int_equal(tsh_write_all(fd, body, len), 0);
}

/*
 * Section 11: a compressed body of raw length 0 is the one-byte block 0; it reads as an empty
 * body (a PING is answered), any other block (here a trailing byte) is malformed, and a PUT
 * of raw length 0 is too short for a record.
 */
static void test_compressed_raw_len_zero(void **state)
{
    (void)state;
    uint8_t body[10] = {0}; /* raw_len 0, then the block */
    int fd = lz4_client();
    send_lz4(fd, TS_OP_PING, 2, body, 9);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PING, 2, TS_ST_OK);
    assert_int_equal(f.len, 0);
    tsu_frame_free(&f);
    /* A block with a byte after its end. */
    send_lz4(fd, TS_OP_PING, 3, body, 10);
    tsu_expect(fd, &f, TS_OP_PING, 3, TS_ST_BAD_REQUEST);
    tsu_frame_free(&f);
    assert_true(tsh_wait_closed(fd, 5000));
    close(fd);
    /* No block at all: a body under 9 bytes. */
    fd = lz4_client();
    send_lz4(fd, TS_OP_PING, 4, body, 8);
    tsu_expect(fd, &f, TS_OP_PING, 4, TS_ST_BAD_REQUEST);
    tsu_frame_free(&f);
    assert_true(tsh_wait_closed(fd, 5000));
    close(fd);
    /* PUT: raw length 0 cannot hold a name and a record. */
    fd = lz4_client();
    send_lz4(fd, TS_OP_PUT, 5, body, 9);
    tsu_expect(fd, &f, TS_OP_PUT, 5, TS_ST_BAD_REQUEST);
    tsu_frame_free(&f);
    assert_true(tsh_wait_closed(fd, 5000));
    close(fd);
    tsu_check_healthy(&srv);
}

/* Send a request with the given body and expect status (and a reply, the connection open). */
static void expect_status(int fd, uint8_t op, uint32_t rid, const void *body, size_t len,
                          uint16_t status)
{
    assert_int_equal(tsh_send(fd, op, rid, body, len), 0);
    tsu_frame f;
    tsu_expect(fd, &f, op, rid, status);
    tsu_frame_free(&f);
}

/*
 * PROTOCOL.md 8.13 and section 7: a failed SAVE is INTERNAL with the documented message; while
 * snapshots fail, PUT, APPEND, GET and DELETE are refused with SAVE_FAILING before anything else
 * is looked at (a missing bin, a body that would be malformed), the connection stays, reads and
 * SAVE go on, and a SAVE that succeeds ends it.
 */
static void test_save_failing_as_documented(void **state)
{
    (void)state;
    char dsub[300], dgone[310], snap[310];
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    assert_int_equal(tsh_server_stop(&srv), 0);
    snprintf(dsub, sizeof(dsub), "%s/d", srv.dir);
    snprintf(dgone, sizeof(dgone), "%s/d.gone", srv.dir);
    snprintf(snap, sizeof(snap), "%s/snap", dsub);
    assert_int_equal(mkdir(dsub, 0700), 0);
    const char *const args[] = {"--save", snap, "--save-interval", "0", NULL};
    assert_int_equal(tsh_server_restart(&srv, args), 0);
    int fd = tsu_client(&srv);
    tsu_put_int(fd, TS_OP_PUT, "a", 1, NULL);
    expect_status(fd, TS_OP_SAVE, 1, NULL, 0, TS_ST_OK);
    /* Every snapshot fails now, even for root: the directory's name is a plain file. */
    assert_int_equal(rename(dsub, dgone), 0);
    int x = open(dsub, O_WRONLY | O_CREAT | O_EXCL, 0600);
    assert_true(x >= 0);
    close(x);
    tsu_put_int(fd, TS_OP_PUT, "b", 2, NULL);
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 2, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_SAVE, 2, TS_ST_INTERNAL);
    const char *msg = "snapshot failed; see the server log";
    assert_int_equal(f.len, strlen(msg));
    assert_memory_equal(f.body, msg, f.len);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(fd, "last_save_ok"), 0);
    /* Refused before the bin is looked up, and before the body is decoded. */
    uint8_t body[64];
    size_t n = tsh_name_body(body, sizeof(body), "missing", "\0\0\0\0", 4);
    expect_status(fd, TS_OP_GET, 3, body, n, TS_ST_SAVE_FAILING);
    expect_status(fd, TS_OP_DELETE, 4, body, n - 4, TS_ST_SAVE_FAILING);
    expect_status(fd, TS_OP_GET, 5, body, 3, TS_ST_SAVE_FAILING); /* name cut short */
    expect_status(fd, TS_OP_DELETE, 6, "a", 1, TS_ST_SAVE_FAILING);
    /*
     * PROTOCOL.md 8.12: a request refused with SAVE_FAILING counts in its ops_ key, PUT and
     * APPEND as GET and DELETE (their bodies are read and dropped).
     */
    int64_t ops[4];
    const char *const keys[4] = {"ops_put", "ops_append", "ops_get", "ops_delete"};
    for (int i = 0; i < 4; i++)
        ops[i] = tsu_stat(fd, keys[i]);
    size_t rlen;
    uint8_t *rec = tsu_rec_int(3, &rlen);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 21, "c", rec, rlen), 0);
    tsu_expect(fd, &f, TS_OP_PUT, 21, TS_ST_SAVE_FAILING);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_store(fd, TS_OP_APPEND, 22, "c", rec, rlen), 0);
    tsu_expect(fd, &f, TS_OP_APPEND, 22, TS_ST_SAVE_FAILING);
    tsu_frame_free(&f);
    tsu_rec_free(rec, rlen);
    expect_status(fd, TS_OP_GET, 23, body, n, TS_ST_SAVE_FAILING);
    expect_status(fd, TS_OP_DELETE, 24, body, n - 4, TS_ST_SAVE_FAILING);
    for (int i = 0; i < 4; i++)
        if (tsu_stat(fd, keys[i]) != ops[i] + 1)
            fail_msg("%s did not count the request refused with SAVE_FAILING", keys[i]);
    /* Creating a parameter or an embedding table is refused too (a missing bin included). */
    ts__msg_ps_create_req pc = {.name = (const uint8_t *)"missing",
                                .name_len = 7,
                                .optimizer = TS_PS_OPT_SGD,
                                .lr = 0.1,
                                .dim = 4};
    uint8_t pbody[256];
    size_t pn;
    assert_int_equal(ts__msg_ps_create_req_encode(pbody, sizeof(pbody), &pc, &pn), 0);
    expect_status(fd, TS_OP_PS_CREATE, 25, pbody, pn, TS_ST_SAVE_FAILING);
    assert_int_equal(ts__msg_emb_create_req_encode(pbody, sizeof(pbody), &pc, &pn), 0);
    expect_status(fd, TS_OP_EMB_CREATE, 26, pbody, pn, TS_ST_SAVE_FAILING);
    /* Reads go on, LISTEN and UNLISTEN included. */
    n = tsh_name_body(body, sizeof(body), "a", "\0\0\0\0", 4);
    expect_status(fd, TS_OP_PEEK, 7, body, n, TS_ST_OK);
    expect_status(fd, TS_OP_LIST, 8, NULL, 0, TS_ST_OK);
    expect_status(fd, TS_OP_LISTEN, 9, body, n - 4, TS_ST_OK);
    expect_status(fd, TS_OP_UNLISTEN, 10, body, n - 4, TS_ST_OK);
    assert_true(tsu_stat(fd, "writes_refused") >= 4);
    /* Mended: a SAVE succeeds and ends the refusals. */
    assert_int_equal(unlink(dsub), 0);
    assert_int_equal(rename(dgone, dsub), 0);
    expect_status(fd, TS_OP_SAVE, 11, NULL, 0, TS_ST_OK);
    assert_int_equal(tsu_stat(fd, "last_save_ok"), 1);
    n = tsh_name_body(body, sizeof(body), "missing", "\0\0\0\0", 4);
    expect_status(fd, TS_OP_GET, 12, body, n, TS_ST_NOT_FOUND);
    close(fd);
    assert_int_equal(tsh_server_stop(&srv), 0);
    char p[330];
    snprintf(p, sizeof(p), "%s.lock", snap);
    unlink(p);
    unlink(snap);
    rmdir(dsub);
    tsh_server_cleanup(&srv);
}

/*
 * PROTOCOL.md sections 5, 7 and 13: when tensord stops, a pending WAIT is answered SHUTTING_DOWN
 * (an error message as body), then the connection-level SHUTTING_DOWN frame (opcode 0, request
 * id 0) comes, then the end of the stream; tensord exits 0.
 */
static void test_shutdown_sends_shutting_down(void **state)
{
    (void)state;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    int fd = tsu_client(&srv);
    assert_int_equal(tsu_send_wait(fd, 2, "nothing", 0, 60000), 0);
    /* The WAIT is pending once a later request is answered. */
    expect_status(fd, TS_OP_PING, 3, NULL, 0, TS_ST_OK);
    assert_int_equal(kill(srv.pid, SIGTERM), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_WAIT, 2, TS_ST_SHUTTING_DOWN);
    ts__msg_error e;
    assert_int_equal(ts__msg_error_decode(f.body, f.len, &e), 0);
    assert_true(e.len > 0);
    tsu_frame_free(&f);
    tsu_expect(fd, &f, 0, 0, TS_ST_SHUTTING_DOWN);
    assert_int_equal(ts__msg_error_decode(f.body, f.len, &e), 0);
    assert_true(e.len > 0);
    tsu_frame_free(&f);
    assert_true(tsh_wait_closed(fd, 10000));
    close(fd);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* The value of "#define NAME value" in a source file (decimal, an unsigned suffix allowed). */
static unsigned long define_value(const char *file, const char *name)
{
    char *src = tsh_read_source_file(file, NULL);
    if (src == NULL)
        fail_msg("%s cannot be read", file);
    char pat[96];
    snprintf(pat, sizeof(pat), "#define %s ", name);
    const char *p = strstr(src, pat);
    if (p == NULL)
        fail_msg("%s has no %s", file, name);
    p += strlen(pat);
    while (*p == ' ')
        p++;
    char *end;
    unsigned long v = strtoul(p, &end, 10);
    if (end == p)
        fail_msg("%s: %s is not a decimal number", file, name);
    free(src);
    return v;
}

/* doc holds text (formatted with the constant's value). */
static void doc_says(const char *doc_file, const char *text)
{
    char *doc = tsh_read_source_file(doc_file, NULL);
    if (doc == NULL)
        fail_msg("%s cannot be read", doc_file);
    int found = strstr(doc, text) != NULL;
    free(doc);
    if (!found)
        fail_msg("%s does not say \"%s\"", doc_file, text);
}

/* The fixed numbers the documents quote are the server's constants. */
static void test_documented_constants(void **state)
{
    (void)state;
    char t[160];
    unsigned long grace = define_value("server/server.h", "TSD_CLOSE_GRACE_MS");
    snprintf(t, sizeof(t), "`TSD_CLOSE_GRACE_MS` = %lu ms", grace);
    doc_says("docs/PROTOCOL.md", t);
    snprintf(t, sizeof(t), "%lu s (`TSD_CLOSE_GRACE_MS`, %lu ms)", grace / 1000, grace);
    doc_says("docs/PROTOCOL.md", t);
    snprintf(t, sizeof(t), "at most %lu s (`TSD_CLOSE_GRACE_MS`)", grace / 1000);
    doc_says("docs/SAFETY.md", t);
    /* The shutdown's grace is the same constant. */
    snprintf(t, sizeof(t), "`TSD_CLOSE_GRACE_MS` (%lu s) after the stop began", grace / 1000);
    doc_says("docs/PROTOCOL.md", t);
    snprintf(t, sizeof(t), "at the latest %lu s (`TSD_CLOSE_GRACE_MS`) after the stop began",
             grace / 1000);
    doc_says("docs/SAFETY.md", t);
    unsigned long cron = define_value("server/server.h", "TSD_CRON_MS");
    snprintf(t, sizeof(t), "housekeeping timer that runs every %lu ms", cron);
    doc_says("docs/PROTOCOL.md", t);
    unsigned long wake = define_value("server/server.h", "TSD_WAKE_BUDGET");
    snprintf(t, sizeof(t), "| wake-ups | %lu per loop turn (fixed) |", wake);
    doc_says("docs/SAFETY.md", t);
}

/* The stream limits section 12 quotes are the ones src/proto.h gives server and client. */
static void test_stream_limits_documented(void **state)
{
    (void)state;
    char t[160];
    snprintf(t, sizeof(t), "1 to %lu (`TS_STREAM_MAX_READ`)",
             define_value("src/proto.h", "TS_STREAM_MAX_READ"));
    doc_says("docs/PROTOCOL.md", t);
    snprintf(t, sizeof(t), "| %lu (`TS_STREAM_MAX_GROUPS`) |",
             define_value("src/proto.h", "TS_STREAM_MAX_GROUPS"));
    doc_says("docs/PROTOCOL.md", t);
    snprintf(t, sizeof(t), "| %lu (`TS_STREAM_MAX_MEMBERS`) |",
             define_value("src/proto.h", "TS_STREAM_MAX_MEMBERS"));
    doc_says("docs/PROTOCOL.md", t);
    snprintf(t, sizeof(t), "at most %lu ms, 24 h (`TS_STREAM_MAX_LEASE_MS`)",
             define_value("src/proto.h", "TS_STREAM_MAX_LEASE_MS"));
    doc_says("docs/PROTOCOL.md", t);
    snprintf(t, sizeof(t), "0 gives %lu ms (`TS_STREAM_DEFAULT_LEASE_MS`)",
             define_value("src/proto.h", "TS_STREAM_DEFAULT_LEASE_MS"));
    doc_says("docs/PROTOCOL.md", t);
    /* The two limits written as shifts, in the numbers the document gives them. */
    assert_true(TS_STREAM_MAX_ENTRIES == 16777216u);
    doc_says("docs/PROTOCOL.md", "1 to 16777216 (`TS_STREAM_MAX_ENTRIES`, 2^24)");
    assert_true(TS_STREAM_READ_BYTES == (uint64_t)64 * 1024 * 1024);
    doc_says("docs/PROTOCOL.md", "64 MiB (`TS_STREAM_READ_BYTES`)");
}

/* ---------------------------------------------------------------------------------------------
 * The tensor-bin and row examples of docs/PROTOCOL.md 15 ("rows example" markers)
 */

#define ROWS_V0 1764115200000000ull /* the change counter's start in the examples */

/*
 * Parse the dump after "<!-- KIND: NAME -->" (KIND "rows example", or "example" for the stream
 * examples): lines "OFFSET  XX XX ...  annotation", the offset equal to the bytes so far. Returns
 * the byte count, or -1 (missing, twice, malformed).
 */
static long rows_example(const char *doc, const char *kind, const char *name, uint8_t *out,
                         size_t cap)
{
    char marker[96];
    snprintf(marker, sizeof(marker), "<!-- %s: %s -->", kind, name);
    const char *m = strstr(doc, marker);
    if (m == NULL || strstr(m + 1, marker) != NULL)
        return -1;
    const char *p = strstr(m, "```text\n");
    if (p == NULL)
        return -1;
    p += 8;
    size_t n = 0;
    while (strncmp(p, "```", 3) != 0) {
        const char *eol = strchr(p, '\n');
        if (eol == NULL)
            return -1;
        char *end;
        unsigned long off = strtoul(p, &end, 16);
        if (end != p + 4 || off != n)
            return -1;
        p = end;
        for (;;) {
            while (*p == ' ')
                p++;
            const char *hex = "0123456789abcdef";
            const char *hi = p < eol ? strchr(hex, p[0]) : NULL;
            const char *lo = p + 1 < eol ? strchr(hex, p[1]) : NULL;
            if (hi == NULL || lo == NULL || *hi == '\0' || *lo == '\0' ||
                (p + 2 != eol && p[2] != ' '))
                break;
            unsigned v = (unsigned)((hi - hex) * 16 + (lo - hex));
            if (n >= cap)
                return -1;
            out[n++] = (uint8_t)v;
            p += 2;
        }
        p = eol + 1;
    }
    return (long)n;
}

/* A frame header into f; returns TS_HDR_SIZE. */
static size_t rows_hdr(uint8_t *f, int req, uint8_t op, uint32_t rid, uint64_t body_len)
{
    ts__hdr h = {.magic = req ? TS_MAGIC_REQ : TS_MAGIC_REP,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .request_id = rid,
                 .body_len = body_len};
    ts__hdr_encode(&h, f);
    return TS_HDR_SIZE;
}

/* The frame of example name, built with the codec. Returns its length. */
static size_t rows_build(const char *name, uint8_t *f, size_t cap)
{
    size_t len = 0, n = 0;
    uint64_t dims[2] = {4, 2};
    if (strcmp(name, "tensor-bin-req") == 0) {
        ts__msg_tensor_bin_req m = {
            .name = (const uint8_t *)"emb", .name_len = 3, .dtype = 9, .ndim = 2, .dims = {4, 2}};
        assert_int_equal(
            ts__msg_tensor_bin_req_encode(f + TS_HDR_SIZE, cap - TS_HDR_SIZE, &m, &len), 0);
        return rows_hdr(f, 1, TS_OP_TENSOR_BIN, 16, len) + len;
    }
    if (strcmp(name, "tensor-bin-rep") == 0 || strcmp(name, "write-rows-rep") == 0) {
        int tb = name[0] == 't';
        assert_int_equal(ts__msg_bin_state_encode(f + TS_HDR_SIZE, cap - TS_HDR_SIZE,
                                                  ROWS_V0 + (tb ? 47 : 48), 1, &len),
                         0);
        return rows_hdr(f, 0, tb ? TS_OP_TENSOR_BIN : TS_OP_WRITE_ROWS, tb ? 16 : 17, len) + len;
    }
    if (strcmp(name, "write-rows-req") == 0) {
        ts_value_t *m = ts_map_new();
        int64_t shape[2] = {1, 2};
        float row[2] = {1.5f, -2.0f};
        assert_int_equal(ts_map_set(m, "start", ts_int_new(1)), 0);
        assert_int_equal(ts_map_set(m, "rows", ts_tensor_new(TS_FLOAT32, 2, shape, row, TS_COPY)),
                         0);
        uint8_t *rec;
        size_t rl;
        assert_int_equal(ts__record_encode(m, &rec, &rl), 0);
        ts_value_free(m);
        assert_int_equal(ts__msg_put_encode(f + TS_HDR_SIZE, cap - TS_HDR_SIZE,
                                            (const uint8_t *)"emb", 3, rec, rl, &len),
                         0);
        ts__free_aligned(rec, rl);
        return rows_hdr(f, 1, TS_OP_WRITE_ROWS, 17, len) + len;
    }
    if (strcmp(name, "notify-rows") == 0) {
        ts__msg_notify m = {.version = ROWS_V0 + 48,
                            .n_items = 1,
                            .event = TS_NOTE_ROWS,
                            .name = (const uint8_t *)"emb",
                            .name_len = 3};
        assert_int_equal(ts__msg_notify_encode(f + TS_HDR_SIZE, cap - TS_HDR_SIZE, &m, &len), 0);
        return rows_hdr(f, 0, TS_OP_NOTIFY, 0, len) + len;
    }
    if (strcmp(name, "read-rows-req") == 0) {
        ts__msg_read_rows_req m = {
            .name = (const uint8_t *)"emb", .name_len = 3, .start = 1, .end = 3};
        assert_int_equal(ts__msg_read_rows_req_encode(f + TS_HDR_SIZE, cap - TS_HDR_SIZE, &m, &len),
                         0);
        return rows_hdr(f, 1, TS_OP_READ_ROWS, 18, len) + len;
    }
    /* read-rows-rep: rows 1 and 2 after the write, as one record in an items body. */
    uint8_t rec[128];
    uint64_t rl;
    dims[0] = 2;
    assert_int_equal(ts__rows_rec_size(9, 2, dims, &rl), 0);
    size_t head = ts__rows_rec_head_size(2);
    ts__rows_rec_head_write(rec, 9, 2, dims, rl - head);
    float rows[4] = {1.5f, -2.0f, 0.0f, 0.0f};
    memcpy(rec + head, rows, sizeof(rows));
    const uint8_t *recs[1] = {rec};
    assert_int_equal(
        ts__msg_items_encode(f + TS_HDR_SIZE, cap - TS_HDR_SIZE, ROWS_V0 + 48, 1, 1, recs, &rl, &n),
        0);
    return rows_hdr(f, 0, TS_OP_READ_ROWS, 18, n) + n;
}

static const char *const rows_examples[] = {"tensor-bin-req", "tensor-bin-rep", "write-rows-req",
                                            "write-rows-rep", "notify-rows",    "read-rows-req",
                                            "read-rows-rep"};

/* A reply or notification of the running server equals the document's, versions aside. */
static void rows_expect(int fd, const uint8_t *doc_frame, size_t n)
{
    ts__hdr h;
    uint8_t *body = NULL;
    size_t len = 0;
    assert_int_equal(tsh_recv(fd, &h, &body, &len), 0);
    uint8_t got[512];
    assert_true(TS_HDR_SIZE + len <= sizeof(got));
    ts__hdr_encode(&h, got);
    if (len > 0)
        memcpy(got + TS_HDR_SIZE, body, len);
    free(body);
    assert_int_equal(TS_HDR_SIZE + len, n);
    /* Every body here starts with the u64 version, which depends on the server's clock. */
    assert_memory_equal(got, doc_frame, TS_HDR_SIZE);
    assert_memory_equal(got + TS_HDR_SIZE + 8, doc_frame + TS_HDR_SIZE + 8, n - TS_HDR_SIZE - 8);
}

static void test_rows_examples(void **state)
{
    (void)state;
    char *doc = tsh_read_source_file("docs/PROTOCOL.md", NULL);
    if (doc == NULL)
        fail_msg("docs/PROTOCOL.md cannot be read");
    static uint8_t docf[TS__ARRAY_SIZE(rows_examples)][512];
    size_t docn[TS__ARRAY_SIZE(rows_examples)];
    for (size_t i = 0; i < TS__ARRAY_SIZE(rows_examples); i++) {
        long n = rows_example(doc, "rows example", rows_examples[i], docf[i], sizeof(docf[i]));
        if (n < 0)
            fail_msg("docs/PROTOCOL.md: rows example %s is missing or malformed", rows_examples[i]);
        uint8_t built[512];
        size_t bn = rows_build(rows_examples[i], built, sizeof(built));
        if ((size_t)n != bn || memcmp(built, docf[i], bn) != 0)
            fail_msg("docs/PROTOCOL.md: rows example %s is not what the codec writes",
                     rows_examples[i]);
        docn[i] = (size_t)n;
    }
    size_t markers = 0;
    for (const char *p = doc; (p = strstr(p, "<!-- rows example: ")) != NULL; p++)
        markers++;
    assert_int_equal(markers, TS__ARRAY_SIZE(rows_examples));
    free(doc);
    /* The requests, sent as the document shows them, get the document's replies. */
    int fd = tsu_client(&srv);
    assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 9, "emb", NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_LISTEN, 9, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsh_write_all(fd, docf[0], docn[0]), 0);
    rows_expect(fd, docf[1], docn[1]);
    tsu_expect(fd, &f, TS_OP_NOTIFY, 0, TS_ST_OK); /* the creation's event 1 */
    tsu_frame_free(&f);
    assert_int_equal(tsh_write_all(fd, docf[2], docn[2]), 0);
    rows_expect(fd, docf[3], docn[3]);
    rows_expect(fd, docf[4], docn[4]);
    assert_int_equal(tsh_write_all(fd, docf[5], docn[5]), 0);
    rows_expect(fd, docf[6], docn[6]);
    close(fd);
}

/* ---------------------------------------------------------------------------------------------
 * The stream examples of docs/PROTOCOL.md 15 (test_proto and test_msg check them against the
 * codec): a running tensord answers the document's requests with the document's replies, byte
 * for byte (streams take no versions from the change counter, so nothing differs).
 */

/* The next frame on fd is exactly the document's frame. */
static void stream_expect(int fd, const char *name, const uint8_t *doc_frame, size_t n)
{
    ts__hdr h;
    uint8_t *body = NULL;
    size_t len = 0;
    assert_int_equal(tsh_recv(fd, &h, &body, &len), 0);
    uint8_t got[512];
    assert_true(TS_HDR_SIZE + len <= sizeof(got));
    ts__hdr_encode(&h, got);
    if (len > 0)
        memcpy(got + TS_HDR_SIZE, body, len);
    free(body);
    if (TS_HDR_SIZE + len != n || memcmp(got, doc_frame, n) != 0)
        fail_msg("docs/PROTOCOL.md: tensord's answer differs from example %s", name);
}

static void test_stream_examples(void **state)
{
    (void)state;
    static const char *const names[] = {"stream-create-req", "stream-create-rep",
                                        "stream-append-req", "stream-append-rep",
                                        "stream-read-req",   "stream-read-rep"};
    char *doc = tsh_read_source_file("docs/PROTOCOL.md", NULL);
    if (doc == NULL)
        fail_msg("docs/PROTOCOL.md cannot be read");
    static uint8_t ex[TS__ARRAY_SIZE(names)][512];
    size_t exn[TS__ARRAY_SIZE(names)];
    for (size_t i = 0; i < TS__ARRAY_SIZE(names); i++) {
        long n = rows_example(doc, "example", names[i], ex[i], sizeof(ex[i]));
        if (n < TS_HDR_SIZE)
            fail_msg("docs/PROTOCOL.md: example %s is missing or malformed", names[i]);
        exn[i] = (size_t)n;
    }
    free(doc);
    /* The session of the example: CREATE (2), JOIN (3), APPEND (4), MARK (5), READ (6). */
    int fd = tsu_client(&srv);
    tsu_frame f;
    assert_int_equal(tsh_write_all(fd, ex[0], exn[0]), 0);
    stream_expect(fd, names[1], ex[1], exn[1]);
    static const uint8_t join[] = {5, 't', 'r', 'a', 'i', 'n', 2, 'w', '0', 0, 0, 0, 0, 0, 0, 0, 0};
    assert_int_equal(tsu_send_name(fd, TS_OP_STREAM_JOIN, 3, "ev", join, sizeof(join)), 0);
    tsu_expect(fd, &f, TS_OP_STREAM_JOIN, 3, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsh_write_all(fd, ex[2], exn[2]), 0);
    stream_expect(fd, names[3], ex[3], exn[3]);
    static const uint8_t tag[8] = {1};
    assert_int_equal(tsu_send_name(fd, TS_OP_STREAM_MARK, 5, "ev", tag, sizeof(tag)), 0);
    tsu_expect(fd, &f, TS_OP_STREAM_MARK, 5, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsh_write_all(fd, ex[4], exn[4]), 0);
    stream_expect(fd, names[5], ex[5], exn[5]);
    close(fd);
}

/* ---------------------------------------------------------------------------------------------
 * The by-reference examples of docs/PROTOCOL.md 15 ("ref example" markers): FDS, PUT_FD, PEEK_REF
 */

#define REF_DATA      ((size_t)4 << 20) /* bytes of tensor data of the PUT_FD example's record */
#define REF_FILE      4198400u          /* bytes of its memfd (the record rounded up to pages) */
#define REF_MAX_FRAME 512               /* bytes; the largest ref example frame, with room */

/* The dump after "<!-- ref example: NAME -->", its offsets checked. Byte count, or -1. */
static long ref_example(const char *doc, const char *name, uint8_t *out, size_t cap)
{
    char marker[96];
    snprintf(marker, sizeof(marker), "<!-- ref example: %s -->", name);
    const char *m = strstr(doc, marker);
    if (m == NULL || strstr(m + 1, marker) != NULL)
        return -1;
    const char *p = strstr(m, "```text\n");
    if (p == NULL)
        return -1;
    p += 8;
    size_t n = 0;
    while (strncmp(p, "```", 3) != 0) {
        const char *eol = strchr(p, '\n');
        if (eol == NULL)
            return -1;
        char *end;
        unsigned long off = strtoul(p, &end, 16);
        if (end != p + 4 || off != n)
            return -1;
        p = end;
        for (;;) {
            while (*p == ' ')
                p++;
            static const char hex[] = "0123456789abcdef";
            const char *hi = p + 1 < eol && p[0] != '\0' ? strchr(hex, p[0]) : NULL;
            const char *lo = hi != NULL && p[1] != '\0' ? strchr(hex, p[1]) : NULL;
            if (hi == NULL || lo == NULL || (p + 2 != eol && p[2] != ' '))
                break;
            if (n >= cap)
                return -1;
            out[n++] = (uint8_t)((hi - hex) * 16 + (lo - hex));
            p += 2;
        }
        p = eol + 1;
    }
    return (long)n;
}

typedef struct ref_ex {
    uint8_t b[REF_MAX_FRAME];
    size_t n;
} ref_ex;

/* Load example name and check it against the codec: the body decodes and encodes back. */
static void ref_load(const char *doc, const char *name, ref_ex *e)
{
    long n = ref_example(doc, name, e->b, sizeof(e->b));
    if (n < TS_HDR_SIZE)
        fail_msg("docs/PROTOCOL.md: ref example %s is missing or malformed", name);
    e->n = (size_t)n;
    ts__hdr h;
    uint8_t magic = e->b[0] == TS_MAGIC_REP ? TS_MAGIC_REP : TS_MAGIC_REQ;
    assert_int_equal(ts__hdr_decode(e->b, magic, &h), 0);
    if (h.body_len != e->n - TS_HDR_SIZE)
        fail_msg("docs/PROTOCOL.md: ref example %s: body_len is not its body", name);
    ts__msg m;
    const uint8_t *body = e->b + TS_HDR_SIZE;
    size_t len = e->n - TS_HDR_SIZE;
    int rc = magic == TS_MAGIC_REQ ? ts__msg_request_decode(h.opcode, body, len, &m)
                                   : ts__msg_reply_decode(h.opcode, h.status, body, len, &m);
    if (rc != 0)
        fail_msg("docs/PROTOCOL.md: ref example %s does not decode (%d)", name, rc);
    uint8_t again[REF_MAX_FRAME];
    size_t alen = 0;
    assert_int_equal(ts__msg_encode(&m, again, sizeof(again), &alen), 0);
    if (alen != len || memcmp(again, body, len) != 0)
        fail_msg("docs/PROTOCOL.md: ref example %s is not what the encoder writes", name);
}

/* A frame from a running tensord equals example e but for the bytes [from, to) of its body. */
static void ref_same(const ref_ex *e, const char *name, const uint8_t *hdr, const uint8_t *body,
                     size_t len, size_t from, size_t to)
{
    if (memcmp(hdr, e->b, TS_HDR_SIZE) != 0 || len != e->n - TS_HDR_SIZE)
        fail_msg("tensord's %s differs from the document's (header)", name);
    for (size_t i = 0; i < len; i++)
        if ((i < from || i >= to) && body[i] != e->b[TS_HDR_SIZE + i])
            fail_msg("tensord's %s differs from the document's at body byte %zu", name, i);
}

/* Receive one frame (header into hdr, body malloc'd) and the descriptors that came with it. */
static void ref_recv(int fd, uint8_t hdr[TS_HDR_SIZE], uint8_t **body, size_t *len, int *fds,
                     int *nfds)
{
    uint8_t *dst = hdr;
    size_t want = TS_HDR_SIZE, got = 0;
    *nfds = 0;
    *body = NULL;
    for (int part = 0; part < 2; part++) {
        while (got < want) {
            struct iovec iov = {dst + got, want - got};
            union {
                struct cmsghdr align;
                char buf[CMSG_SPACE(sizeof(int) * 4)];
            } ctl;
            struct msghdr msg = {.msg_iov = &iov,
                                 .msg_iovlen = 1,
                                 .msg_control = ctl.buf,
                                 .msg_controllen = sizeof(ctl.buf)};
            ssize_t r = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
            assert_true(r > 0);
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c))
                for (size_t i = 0; c->cmsg_type == SCM_RIGHTS &&
                                   i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int) && *nfds < 4;
                     i++)
                    memcpy(&fds[(*nfds)++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            got += (size_t)r;
        }
        if (part == 0) {
            want = (size_t)ts__get_u64le(hdr + 16);
            assert_true(want <= REF_MAX_FRAME);
            *body = malloc(want > 0 ? want : 1);
            assert_non_null(*body);
            dst = *body;
            got = 0;
        }
    }
    *len = want;
}

static void test_ref_examples(void **state)
{
    (void)state;
    char *doc = tsh_read_source_file("docs/PROTOCOL.md", NULL);
    if (doc == NULL)
        fail_msg("docs/PROTOCOL.md cannot be read");
    static ref_ex hreq, hrep, preq, prep, kreq, krep;
    ref_load(doc, "hello-fds-req", &hreq);
    ref_load(doc, "hello-fds-rep", &hrep);
    ref_load(doc, "put-fd-req", &preq);
    ref_load(doc, "put-fd-rep", &prep);
    ref_load(doc, "peek-ref-req", &kreq);
    ref_load(doc, "peek-ref-rep", &krep);
    int markers = 0;
    for (const char *p = doc; (p = strstr(p, "<!-- ref example: ")) != NULL; p++)
        markers++;
    assert_int_equal(markers, 6);
    free(doc);
    /* The story: PEEK_REF sees the version after PUT_FD's and the APPEND's. */
    assert_true(ts__get_u64le(krep.b + TS_HDR_SIZE) == ts__get_u64le(prep.b + TS_HDR_SIZE) + 1);

    /* The same session against tensord: the same bytes but versions and server_id. */
    int fd = tsh_connect_unix(srv.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(tsh_write_all(fd, hreq.b, hreq.n), 0);
    uint8_t hdr[TS_HDR_SIZE];
    uint8_t *body;
    size_t len;
    int fds[4], nfds;
    ref_recv(fd, hdr, &body, &len, fds, &nfds);
    ref_same(&hrep, "HELLO reply", hdr, body, len, 16, 24);
    free(body);

    size_t rec_len;
    uint8_t *rec = tsu_rec_bytes(REF_DATA, 3, &rec_len);
    assert_int_equal(rec_len, ts__get_u64le(preq.b + preq.n - 8));
    int mfd = memfd_create("doc-example", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(mfd >= 0);
    assert_int_equal(ftruncate(mfd, REF_FILE), 0);
    assert_true(pwrite(mfd, rec, rec_len, 0) == (ssize_t)rec_len);
    struct iovec iov = {preq.b, preq.n};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof(ctl));
    struct msghdr msg = {.msg_iov = &iov,
                         .msg_iovlen = 1,
                         .msg_control = ctl.buf,
                         .msg_controllen = sizeof(ctl.buf)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &mfd, sizeof(int));
    assert_true(sendmsg(fd, &msg, MSG_NOSIGNAL) == (ssize_t)preq.n);
    ref_recv(fd, hdr, &body, &len, fds, &nfds);
    ref_same(&prep, "PUT_FD reply", hdr, body, len, 0, 8);
    uint64_t v_put = ts__get_u64le(body);
    free(body);

    size_t ilen;
    uint8_t *irec = tsu_rec_int(41, &ilen);
    assert_int_equal(tsu_send_store(fd, TS_OP_APPEND, 3, "frames", irec, ilen), 0);
    ref_recv(fd, hdr, &body, &len, fds, &nfds);
    assert_int_equal(ts__get_u16le(hdr + 4), TS_ST_OK);
    free(body);

    assert_int_equal(tsh_write_all(fd, kreq.b, kreq.n), 0);
    ref_recv(fd, hdr, &body, &len, fds, &nfds);
    ref_same(&krep, "PEEK_REF reply", hdr, body, len, 0, 8);
    assert_true(ts__get_u64le(body) == v_put + 1);
    assert_memory_equal(body + 128, irec, ilen);
    assert_int_equal(nfds, 1);
    void *map = mmap(NULL, REF_FILE, PROT_READ, MAP_SHARED, fds[0], 0);
    if (map == MAP_FAILED && errno == EPERM)
        map = mmap(NULL, REF_FILE, PROT_READ, MAP_PRIVATE, fds[0], 0);
    assert_true(map != MAP_FAILED);
    assert_memory_equal(map, rec, rec_len);
    munmap(map, REF_FILE);
    close(fds[0]);
    free(body);
    tsu_rec_free(irec, ilen);
    tsu_rec_free(rec, rec_len);
    close(mfd);
    close(fd);
}

/* ---------------------------------------------------------------------------------------------
 * The token proof examples of docs/PROTOCOL.md 4 ("example" markers): the frames the codec
 * writes, with the proofs computed by src/auth.c from the documented token and nonces.
 */
static void test_auth_examples(void **state)
{
    (void)state;
    char *doc = tsh_read_source_file("docs/PROTOCOL.md", NULL);
    assert_non_null(doc);
    static const char token[] = "s3cret-token";
    uint8_t cn[TS_MSG_AUTH_NONCE_SIZE], sn[TS_MSG_AUTH_NONCE_SIZE];
    for (int i = 0; i < TS_MSG_AUTH_NONCE_SIZE; i++) {
        cn[i] = (uint8_t)i;
        sn[i] = (uint8_t)(0x80 + i);
    }
    uint8_t cproof[TS_MSG_TOKEN_PROOF_SIZE], sproof[TS_MSG_TOKEN_PROOF_SIZE];
    ts__auth_proof(token, strlen(token), TS_AUTH_CLIENT, cn, sn, cproof);
    ts__auth_proof(token, strlen(token), TS_AUTH_SERVER, cn, sn, sproof);
    static const char *const names[] = {"auth-challenge-req", "auth-challenge-rep",
                                        "hello-proof-req", "hello-proof-rep"};
    for (size_t k = 0; k < TS__ARRAY_SIZE(names); k++) {
        uint8_t docf[256], built[256];
        long n = rows_example(doc, "example", names[k], docf, sizeof(docf));
        if (n < 0)
            fail_msg("docs/PROTOCOL.md: example %s is missing or malformed", names[k]);
        size_t bn = 0, len = 0;
        if (k < 2) {
            bn = rows_hdr(built, k == 0, TS_OP_AUTH_CHALLENGE, 1, TS_MSG_AUTH_NONCE_SIZE);
            memcpy(built + bn, k == 0 ? cn : sn, TS_MSG_AUTH_NONCE_SIZE);
            bn += TS_MSG_AUTH_NONCE_SIZE;
        } else if (k == 2) {
            ts__msg_hello_req m = {.max_version = 1,
                                   .flags = TS_HELLO_TOKEN_PROOF,
                                   .token_len = TS_MSG_TOKEN_PROOF_SIZE,
                                   .token = cproof};
            assert_int_equal(ts__msg_hello_req_encode(built + TS_HDR_SIZE,
                                                      sizeof(built) - TS_HDR_SIZE, &m, &len),
                             0);
            bn = rows_hdr(built, 1, TS_OP_HELLO, 2, len) + len;
        } else {
            ts__msg_hello_rep m = {.version = 1,
                                   .flags = TS_HELLO_TOKEN_PROOF,
                                   .max_body = (uint64_t)1 << 30,
                                   .server_id = 0x0123456789abcdefull,
                                   .proof = sproof};
            assert_int_equal(ts__msg_hello_rep_encode(built + TS_HDR_SIZE,
                                                      sizeof(built) - TS_HDR_SIZE, &m, &len),
                             0);
            bn = rows_hdr(built, 0, TS_OP_HELLO, 2, len) + len;
        }
        if ((size_t)n != bn || memcmp(docf, built, bn) != 0)
            fail_msg("docs/PROTOCOL.md: example %s is not what the code writes", names[k]);
    }
    free(doc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_auth_examples),
        cmocka_unit_test_setup_teardown(test_stats_table_matches_server, start, stop),
        cmocka_unit_test(test_every_flag_in_safety_doc),
        cmocka_unit_test(test_documented_constants),
        cmocka_unit_test(test_stream_limits_documented),
        cmocka_unit_test_setup_teardown(test_compressed_raw_len_zero, start, stop),
        cmocka_unit_test(test_save_failing_as_documented),
        cmocka_unit_test(test_shutdown_sends_shutting_down),
        cmocka_unit_test_setup_teardown(test_rows_examples, start, stop),
        cmocka_unit_test_setup_teardown(test_ref_examples, start, stop),
        cmocka_unit_test_setup_teardown(test_stream_examples, start, stop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
