/*
 * The request head parser of tensord's HTTP listener for health and metrics (http.c). Pure: no
 * loop, no allocation, no global state; any thread may call it. docs/METRICS.md lists what it
 * refuses.
 */
#ifndef TSD_HTTPPARSE_H
#define TSD_HTTPPARSE_H

#include <stddef.h>
#include <stdint.h>

/* What tsd_http_parse_head returns besides 0: the HTTP status to answer with. */
#define TSD_HTTP_BAD     400 /* malformed: 400 Bad Request */
#define TSD_HTTP_VERSION 505 /* HTTP other than 1.0 or 1.1: 505 HTTP Version Not Supported */

/* What a request head says that matters here. Its pointers point into the parsed head. */
typedef struct tsd_http_req {
    const char *method; /* method_len tchars */
    size_t method_len;
    const char *path; /* the target up to '?' (it starts with '/') */
    size_t path_len;
    int minor;       /* HTTP/1.minor: 0 or 1 */
    int hosts;       /* Host fields */
    int lengths;     /* Content-Length fields */
    uint64_t length; /* their value (the same in each) */
    int chunked;     /* a Transfer-Encoding field: a body of unknown length */
    int conn_close;  /* Connection: close */
    int keep_alive;  /* Connection: keep-alive */
} tsd_http_req;

/*
 * Parse the head p[0..n), n counting the final CRLF CRLF (tsd_http_head_end). 0 with *q filled;
 * TSD_HTTP_BAD: a line that is not CRLF-terminated (a bare CR or LF), a NUL or another control
 * byte, a request line other than METHOD SP /target SP HTTP/d.d, a field line with no name, a
 * space before its colon or a folded value, a Content-Length that is not a number below 10^19
 * or two that differ, no Host field in HTTP/1.1 or two anywhere; TSD_HTTP_VERSION.
 */
int tsd_http_parse_head(const char *p, size_t n, tsd_http_req *q);

/*
 * The length of the head at the start of p[0..n), through its CRLF CRLF, or 0 when incomplete.
 * A bare LF or bare CR before that ends the head just after it (so that tsd_http_parse_head,
 * which refuses it, answers it at once).
 */
size_t tsd_http_head_end(const char *p, size_t n);

#endif /* TSD_HTTPPARSE_H */
