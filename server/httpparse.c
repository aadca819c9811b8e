/*
 * The request head parser of tensord's HTTP listener (http.c, RFC 9112): request-line CRLF
 * *( field-line CRLF ) CRLF. It needs no loop and no allocation, so the fuzz target
 * (tests/fuzz/fuzz_http.c) compiles it alone.
 */
#include "httpparse.h"

#include <string.h>

/* A tchar of RFC 9110 (methods and field names are made of them). */
static int is_tchar(unsigned char ch)
{
    if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9'))
        return 1;
    return ch != '\0' && strchr("!#$%&'*+-.^_`|~", ch) != NULL;
}

/* Case-insensitive comparison of n bytes at p with the lower-case word w (of length n). */
static int ieq(const char *p, size_t n, const char *w)
{
    if (strlen(w) != n)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (ch >= 'A' && ch <= 'Z')
            ch = (char)(ch - 'A' + 'a');
        if (ch != w[i])
            return 0;
    }
    return 1;
}

/* Whether the comma-separated list at v (n bytes) holds the token w (lower case). */
static int list_has(const char *v, size_t n, const char *w)
{
    size_t i = 0;
    while (i < n) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ','))
            i++;
        size_t s = i;
        while (i < n && v[i] != ',')
            i++;
        size_t e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t'))
            e--;
        if (e > s && ieq(v + s, e - s, w))
            return 1;
    }
    return 0;
}

int tsd_http_parse_head(const char *p, size_t n, tsd_http_req *q)
{
    memset(q, 0, sizeof(*q));
    /* Bare CR, bare LF and NUL are refused anywhere: the line structure must be unambiguous. */
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\0')
            return TSD_HTTP_BAD;
        if (p[i] == '\r' && (i + 1 >= n || p[i + 1] != '\n'))
            return TSD_HTTP_BAD;
        if (p[i] == '\n' && (i == 0 || p[i - 1] != '\r'))
            return TSD_HTTP_BAD;
    }
    const char *end = p + n - 2; /* the last CRLF: every line before it ends with its own */
    /* The request line: method SP target SP HTTP/1.x CRLF, single spaces. */
    const char *s = p;
    while (s < end && is_tchar((unsigned char)*s))
        s++;
    if (s == p || s >= end || *s != ' ')
        return TSD_HTTP_BAD;
    q->method = p;
    q->method_len = (size_t)(s - p);
    const char *t = ++s;
    while (s < end && (unsigned char)*s > ' ' && (unsigned char)*s < 0x7f)
        s++;
    if (s == t || s >= end || *s != ' ' || *t != '/')
        return TSD_HTTP_BAD; /* only origin-form targets: a path starting with '/' */
    q->path = t;
    q->path_len = (size_t)(s - t);
    const char *qm = memchr(t, '?', q->path_len);
    if (qm != NULL)
        q->path_len = (size_t)(qm - t);
    const char *v = ++s;
    const char *eol = v;
    while (eol < end && *eol != '\r')
        eol++;
    if (eol - v != 8 || memcmp(v, "HTTP/", 5) != 0 || v[5] < '0' || v[5] > '9' || v[6] != '.' ||
        v[7] < '0' || v[7] > '9')
        return TSD_HTTP_BAD;
    if (v[5] != '1' || (v[7] != '0' && v[7] != '1'))
        return TSD_HTTP_VERSION;
    q->minor = v[7] - '0';
    /* Field lines: name ":" OWS value OWS CRLF; no folding, no space before the colon. */
    s = eol + 2;
    while (s < end) {
        const char *name = s;
        while (s < end && is_tchar((unsigned char)*s))
            s++;
        if (s == name || s >= end || *s != ':')
            return TSD_HTTP_BAD;
        size_t name_len = (size_t)(s - name);
        s++;
        while (s < end && (*s == ' ' || *s == '\t'))
            s++;
        const char *val = s;
        while (s < end && *s != '\r') {
            unsigned char ch = (unsigned char)*s;
            if ((ch < ' ' && ch != '\t') || ch == 0x7f)
                return TSD_HTTP_BAD;
            s++;
        }
        const char *ve = s;
        while (ve > val && (ve[-1] == ' ' || ve[-1] == '\t'))
            ve--;
        size_t vlen = (size_t)(ve - val);
        s += 2;
        if (ieq(name, name_len, "host")) {
            q->hosts++;
        } else if (ieq(name, name_len, "content-length")) {
            if (vlen == 0 || vlen > 19)
                return TSD_HTTP_BAD;
            uint64_t len = 0;
            for (size_t i = 0; i < vlen; i++) {
                if (val[i] < '0' || val[i] > '9')
                    return TSD_HTTP_BAD;
                len = len * 10u + (uint64_t)(val[i] - '0');
            }
            if (q->lengths++ > 0 && len != q->length)
                return TSD_HTTP_BAD;
            q->length = len;
        } else if (ieq(name, name_len, "transfer-encoding")) {
            q->chunked = 1;
        } else if (ieq(name, name_len, "connection")) {
            q->conn_close |= list_has(val, vlen, "close");
            q->keep_alive |= list_has(val, vlen, "keep-alive");
        }
    }
    /* HTTP/1.1 requires exactly one Host field; more than one is refused as well. */
    if ((q->minor == 1 && q->hosts != 1) || q->hosts > 1)
        return TSD_HTTP_BAD;
    return 0;
}

size_t tsd_http_head_end(const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        /*
         * A bare LF or CR ends the head at once: tsd_http_parse_head refuses it (400), where
         * waiting for a CRLF CRLF that a client using bare LFs never sends would hold the
         * connection until the idle timeout without an answer.
         */
        if (p[i] == '\n' && (i == 0 || p[i - 1] != '\r'))
            return i + 1;
        if (p[i] == '\r' && i + 1 < n && p[i + 1] != '\n')
            return i + 2;
        if (i >= 3 && p[i] == '\n' && p[i - 1] == '\r' && p[i - 2] == '\n' && p[i - 3] == '\r')
            return i + 1;
    }
    return 0;
}
