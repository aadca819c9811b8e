/*
 * Health and Prometheus metrics over HTTP (http.c, metrics.c). tensord answers a few plain
 * HTTP/1.1 requests on a listener of its own (--http-port), on the same loop thread as the
 * binary protocol: GET (or HEAD) /healthz, /readyz and /metrics. docs/METRICS.md documents the
 * endpoints, every metric and the limits below. Nothing here is thread-safe; the loop thread
 * calls all of it.
 */
#ifndef TSD_HTTP_H
#define TSD_HTTP_H

#include "server.h"

/*
 * Limits. A scraper or a probe sends one small request at a time, so each is far beyond what
 * they need and small enough that the HTTP side can never cost the binary protocol much memory
 * or loop time: at most TSD_HTTP_MAX_CONNS connections of TSD_HTTP_MAX_HEAD bytes of input and
 * one response each.
 */
#define TSD_HTTP_MAX_HEAD  8192u /* bytes; a request line and headers, the blank line included */
#define TSD_HTTP_MAX_CONNS 64u   /* HTTP connections at once; more are closed as they come */
/*
 * ms; a connection must complete each request (its whole head) and have each response taken
 * within this long, and is closed after this long idle, so a stalled or trickling client cannot
 * keep one of the TSD_HTTP_MAX_CONNS places. Checked every TSD_HTTP_SWEEP_MS.
 */
#define TSD_HTTP_IDLE_MS  10000u
#define TSD_HTTP_SWEEP_MS 1000u /* ms; period of the idle check */
#define TSD_HTTP_BACKLOG  64    /* connections; the listen queue */
/* Connections accepted per readable event, so that a flood of them cannot hold the loop. */
#define TSD_HTTP_ACCEPT_BATCH 16u
/* ms; accepting pauses this long when the process is out of descriptors. */
#define TSD_HTTP_ACCEPT_PAUSE_MS 1000u
/*
 * After a response that ends the connection, tensord sends FIN and reads and drops what the
 * client still sends until it closes, at most this many bytes and this long (then it closes
 * anyway): closing with input unread would reset the connection, which can destroy the
 * response before the client reads it.
 */
#define TSD_HTTP_DRAIN_MAX (1024u * 1024u) /* bytes */
#define TSD_HTTP_DRAIN_MS  5000u           /* ms */

typedef struct tsd_http tsd_http;

/*
 * Listen for HTTP on --http-host (else --host) and --http-port, and write the bound port to
 * --http-port-file when given (atomically). Call once, after the binary listeners are up: the
 * daemon is ready then. 0, or a negative libuv code (logged).
 */
int tsd_http_start(tsd_server *srv);
/*
 * The shutdown began: /readyz answers 503 from now on, and the HTTP handles stop keeping the
 * loop running, so they serve until everything else is done. No-op without a listener.
 */
void tsd_http_stopping(tsd_server *srv);
/*
 * The loop has run out: close the listener and every HTTP connection (run the loop once more
 * for their close callbacks, which free what is left). No-op without a listener.
 */
void tsd_http_close(tsd_server *srv);

/* The HTTP side's own counters (all 0 without a listener). */
typedef struct tsd_http_stats {
    uint64_t requests;    /* requests answered, whatever the status */
    uint64_t rejected;    /* connections closed at once: TSD_HTTP_MAX_CONNS were open */
    uint64_t connections; /* open now */
} tsd_http_stats;
void tsd_http_stats_get(const tsd_server *srv, tsd_http_stats *st);

/* A growing text buffer (metrics.c). failed: an allocation failed, the text is incomplete. */
typedef struct tsd_text {
    char *p;
    size_t len, cap;
    int failed;
} tsd_text;
/* Free the buffer's memory (the struct may be reused, zeroed). */
void tsd_text_free(tsd_text *t);

/*
 * Append the metrics page of srv to t: Prometheus text exposition format 0.0.4, every name
 * prefixed tensord_ (docs/METRICS.md lists them). Its cost grows with the opcodes, statuses and
 * buckets, never with bins, items or connections. 0, or TS_ENOMEM (t->failed set).
 */
int tsd_metrics_render(const tsd_server *srv, tsd_text *t);

#endif /* TSD_HTTP_H */
