/*
 * Fuzz target: the request head parser of tensord's HTTP listener (server/httpparse.c), fed as
 * tensord feeds it: the input is a connection's bytes, cut into heads by tsd_http_head_end within
 * the 8192-byte limit, each head parsed in turn. Properties: a head that does not end with CRLF
 * CRLF (cut at a bare LF or CR) is refused; the parser answers 0, 400 or 505 and
 * nothing else; an accepted head has a tchar method, a path that starts with '/' and holds no '?'
 * or byte outside 0x21-0x7e, pointers inside the head, HTTP/1.0 or 1.1, one Host in 1.1; the
 * same head parsed twice gives the same answer; and a head rebuilt from what was accepted (method,
 * path, version, Host, Content-Length, Connection) is accepted again with the same fields.
 */
#include "fuzz.h"

#include <stdio.h>
#include <string.h>

#include "httpparse.h"

/* server/http.h's TSD_HTTP_MAX_HEAD (that header needs libuv): bytes of one head at most. */
#define MAX_HEAD 8192u

static int tchar(unsigned char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           (ch != '\0' && strchr("!#$%&'*+-.^_`|~", ch) != NULL);
}

static int inside(const char *p, size_t len, const char *head, size_t n)
{
    return p >= head && p + len <= head + n;
}

static void check_head(const char *head, size_t n)
{
    tsd_http_req q, again;
    int rc = tsd_http_parse_head(head, n, &q);
    FZ_CHECK(rc == 0 || rc == TSD_HTTP_BAD || rc == TSD_HTTP_VERSION);
    FZ_CHECK(tsd_http_parse_head(head, n, &again) == rc);
    if (rc != 0)
        return;
    FZ_CHECK(q.method_len > 0 && inside(q.method, q.method_len, head, n));
    for (size_t i = 0; i < q.method_len; i++)
        FZ_CHECK(tchar((unsigned char)q.method[i]));
    FZ_CHECK(q.path_len > 0 && inside(q.path, q.path_len, head, n) && q.path[0] == '/');
    for (size_t i = 0; i < q.path_len; i++)
        FZ_CHECK(q.path[i] > ' ' && q.path[i] < 0x7f && q.path[i] != '?');
    FZ_CHECK(q.minor == 0 || q.minor == 1);
    FZ_CHECK(q.hosts <= 1 && (q.minor == 0 || q.hosts == 1));
    FZ_CHECK(q.lengths == 0 || q.length < 10000000000000000000ull);
    /* Rebuilt from its fields, the request means the same. */
    char re[MAX_HEAD + 256];
    int k = snprintf(re, sizeof(re), "%.*s %.*s HTTP/1.%d\r\n%s", (int)q.method_len, q.method,
                     (int)q.path_len, q.path, q.minor, q.hosts ? "Host: h\r\n" : "");
    FZ_CHECK(k > 0 && (size_t)k < sizeof(re));
    size_t len = (size_t)k;
    if (q.lengths > 0)
        len += (size_t)snprintf(re + len, sizeof(re) - len, "Content-Length: %llu\r\n",
                                (unsigned long long)q.length);
    if (q.chunked)
        len += (size_t)snprintf(re + len, sizeof(re) - len, "Transfer-Encoding: chunked\r\n");
    if (q.conn_close || q.keep_alive)
        len += (size_t)snprintf(
            re + len, sizeof(re) - len, "Connection: %s%s%s\r\n", q.conn_close ? "close" : "",
            q.conn_close && q.keep_alive ? ", " : "", q.keep_alive ? "keep-alive" : "");
    len += (size_t)snprintf(re + len, sizeof(re) - len, "\r\n");
    FZ_CHECK(len < sizeof(re));
    FZ_CHECK(tsd_http_head_end(re, len) == len);
    tsd_http_req r;
    FZ_CHECK(tsd_http_parse_head(re, len, &r) == 0);
    FZ_CHECK(r.method_len == q.method_len && memcmp(r.method, q.method, q.method_len) == 0);
    FZ_CHECK(r.path_len == q.path_len && memcmp(r.path, q.path, q.path_len) == 0);
    FZ_CHECK(r.minor == q.minor && r.hosts == q.hosts && r.length == q.length);
    FZ_CHECK(r.chunked == q.chunked && r.conn_close == q.conn_close);
    FZ_CHECK(r.keep_alive == q.keep_alive);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *p = (const char *)data;
    /* Heads one after another, as pipelined on one connection; past the limit tensord stops. */
    while (size > 0) {
        size_t window = size < MAX_HEAD ? size : MAX_HEAD;
        size_t n = tsd_http_head_end(p, window);
        if (n == 0)
            break;
        FZ_CHECK(n <= window);
        if (n < 4 || memcmp(p + n - 4, "\r\n\r\n", 4) != 0) {
            /* Cut short at a bare LF or CR: refused, never taken for a request. */
            tsd_http_req q;
            FZ_CHECK(tsd_http_parse_head(p, n, &q) == TSD_HTTP_BAD);
        }
        check_head(p, n);
        p += n;
        size -= n;
    }
    return 0;
}
