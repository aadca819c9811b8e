/*
 * Helpers shared by the tensord integration tests: records built with the real encoder or by
 * hand (for invalid ones), request builders and reply parsers over raw sockets.
 */
#ifndef TS_TEST_SERVER_UTIL_H
#define TS_TEST_SERVER_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "harness.h"

/* One received frame; body is malloc'd by the harness (free with tsu_frame_free). */
typedef struct tsu_frame {
    ts__hdr h;
    uint8_t *body;
    size_t len;
} tsu_frame;

void tsu_frame_free(tsu_frame *f);

/* A record of one int value (any int gives a distinct, valid record). ts__free_aligned it. */
uint8_t *tsu_rec_int(int64_t v, size_t *len);
/* A record {"t": uint8 tensor of n bytes, each byte (i + seed) & 0xff}. ts__free_aligned it. */
uint8_t *tsu_rec_bytes(size_t n, unsigned seed, size_t *len);
/* A record whose root is one tensor, with every descriptor field given (may be invalid). */
uint8_t *tsu_rec_tensor_raw(uint8_t dtype, uint8_t ndim, const uint64_t *dims, uint64_t off,
                            uint64_t len, uint64_t data_len, size_t *out_len);
void tsu_rec_free(uint8_t *rec, size_t len);

/* Connect over TCP and say HELLO (no flags); fails the test on error. */
int tsu_client(const tsh_server *s);
/* Receive one frame; 0 or -1. */
int tsu_recv(int fd, tsu_frame *f);
/* Receive one frame and check opcode, request id and status; fails the test otherwise. */
void tsu_expect(int fd, tsu_frame *f, uint8_t op, uint32_t rid, uint16_t status);

/* Send PUT/APPEND with name and record. */
int tsu_send_store(int fd, uint8_t op, uint32_t rid, const char *name, const void *rec, size_t len);
/* Send a request whose body is name (+ extra bytes). */
int tsu_send_name(int fd, uint8_t op, uint32_t rid, const char *name, const void *extra,
                  size_t extra_len);
int tsu_send_get(int fd, uint8_t op, uint32_t rid, const char *name, uint32_t max_items);
int tsu_send_wait(int fd, uint32_t rid, const char *name, uint64_t after, uint32_t timeout_ms);

/* Parse a TS_BIN_STATE body; fails the test when malformed. */
void tsu_state(const tsu_frame *f, uint64_t *version, uint32_t *n);

/* Round trips that assert success; the bin's version / n come back. */
uint64_t tsu_store(int fd, uint8_t op, const char *name, const void *rec, size_t len, uint32_t *n);
/* A put of tsu_rec_int(v). */
uint64_t tsu_put_int(int fd, uint8_t op, const char *name, int64_t v, uint32_t *n);

/* A parsed ITEMS reply: the items point into f.body. */
typedef struct tsu_items {
    tsu_frame f;
    uint64_t version;
    uint32_t n, remaining;
    const uint8_t *item[64];
    uint64_t item_len[64];
} tsu_items;

/* Send GET/PEEK and parse the OK reply (checks the layout and padding). */
void tsu_get(int fd, uint8_t op, const char *name, uint32_t max_items, tsu_items *out);
/* The int of a tsu_rec_int record. */
int64_t tsu_item_int(const uint8_t *rec, size_t len);

/* Read the server's STATS map value for key; fails the test when missing. */
int64_t tsu_stat(int fd, const char *key);

/* Assert that the server still serves a fresh client correctly (put, peek, delete). */
void tsu_check_healthy(const tsh_server *s);

/* Expect an error reply with status on fd, then the connection closed. */
void tsu_expect_error_close(int fd, uint16_t status);

/* Parse a NOTIFY frame. */
typedef struct tsu_note {
    uint64_t version;
    uint32_t n;
    uint8_t event;
    uint8_t flags;
    char name[256];
} tsu_note;
void tsu_note_parse(const tsu_frame *f, tsu_note *n);

#endif /* TS_TEST_SERVER_UTIL_H */
