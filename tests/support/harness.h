/*
 * Test harness: start and stop a real tensord on an ephemeral port (and a unix socket), and talk
 * to it over raw sockets with frame helpers. Every wait here is bounded.
 */
#ifndef TS_HARNESS_H
#define TS_HARNESS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto.h"

typedef struct tsh_server {
    pid_t pid;
    int port;            /* TCP port on 127.0.0.1 */
    char dir[256];       /* private temporary directory */
    char unix_path[300]; /* unix socket path inside dir */
    char addr[64];       /* "127.0.0.1:PORT" for ts_client_open */
    char unix_addr[310]; /* "unix:PATH" */
} tsh_server;

/*
 * Start tensord (path from $TS_TENSORD) with --port 0 --unix <dir>/tensord.sock plus extra_args
 * (NULL-terminated, may be NULL). Waits up to 15 s for it to listen. 0 or -1.
 */
int tsh_server_start(tsh_server *s, const char *const *extra_args);
/* Restart a stopped or killed server on the same port and socket path (extra_args as given). */
int tsh_server_restart(tsh_server *s, const char *const *extra_args);
/* SIGTERM, wait up to 15 s (then SIGKILL). Returns the exit status (0 = clean), -1 if killed. */
int tsh_server_stop(tsh_server *s);
/* SIGKILL and reap, leaving the directory in place (for restart). */
void tsh_server_kill(tsh_server *s);
/* Remove the temporary directory (after stop). */
void tsh_server_cleanup(tsh_server *s);
/* 1 while the server process is alive. */
int tsh_server_alive(tsh_server *s);
/* Resident set size of the server in KiB, or -1. */
long tsh_server_rss_kib(tsh_server *s);

/*
 * Read a file of the source tree ($TS_SOURCE_DIR, which ctest sets) whole, NUL-terminated;
 * *len (when not NULL) gets its length. NULL, with the reason on stderr, when the variable is
 * unset or the file cannot be read: tests that check documents fail then, never skip. Free the
 * result with free().
 */
char *tsh_read_source_file(const char *rel, size_t *len);

/* A raw TCP connection to 127.0.0.1:port with 10 s send/receive timeouts, or -1. */
int tsh_connect_tcp(int port);
/* A raw unix-socket connection, or -1. */
int tsh_connect_unix(const char *path);

/* Write all bytes (bounded by the socket timeout). 0 or -1. */
int tsh_write_all(int fd, const void *buf, size_t len);
/* Read exactly len bytes. 0, or -1 on EOF/error/timeout. */
int tsh_read_all(int fd, void *buf, size_t len);

/* Send a request frame with the given opcode, request id and body. 0 or -1. */
int tsh_send(int fd, uint8_t op, uint32_t rid, const void *body, size_t len);
/*
 * Receive one frame (reply or notification). *body is malloc'd (free it), NULL when empty.
 * 0, or -1 on EOF, timeout or a bad header.
 */
int tsh_recv(int fd, ts__hdr *h, uint8_t **body, size_t *len);
/* HELLO with version 1 and no flags; 0 when the server answered OK. */
int tsh_hello(int fd);
/* 1 when the peer closed the connection within timeout_ms (reads and drops data), else 0. */
int tsh_wait_closed(int fd, int timeout_ms);

/* Build "u8 len + name" followed by extra bytes into out (capacity cap); returns the length. */
size_t tsh_name_body(uint8_t *out, size_t cap, const char *name, const void *extra,
                     size_t extra_len);

#endif /* TS_HARNESS_H */
