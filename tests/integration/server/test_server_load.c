/*
 * tensord under load and at its limits: many concurrent connections, the memory limit, the
 * output limit (slow readers) and the client limit.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "test_server_util.h"

#define N_CONC   200
#define N_ROUNDS 5

static tsh_server srv;

static int stop(void **state)
{
    (void)state;
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

static int start_plain(void **state)
{
    (void)state;
    return tsh_server_start(&srv, NULL);
}

static int start_small_memory(void **state)
{
    (void)state;
    static const char *const args[] = {"--max-memory", "64k", NULL};
    return tsh_server_start(&srv, args);
}

static int start_small_output(void **state)
{
    (void)state;
    static const char *const args[] = {"--max-output", "1m", NULL};
    return tsh_server_start(&srv, args);
}

static int start_few_clients(void **state)
{
    (void)state;
    static const char *const args[] = {"--max-clients", "3", NULL};
    return tsh_server_start(&srv, args);
}

static int start_watch_memory(void **state)
{
    (void)state;
    static const char *const args[] = {"--max-memory", "512k", NULL};
    return tsh_server_start(&srv, args);
}

static int start_few_watches(void **state)
{
    (void)state;
    static const char *const args[] = {"--max-watch", "3", NULL};
    return tsh_server_start(&srv, args);
}

static void test_200_concurrent_connections(void **state)
{
    (void)state;
    static int fds[N_CONC];
    int listener = tsu_client(&srv);
    tsu_frame f;
    assert_int_equal(tsu_send_name(listener, TS_OP_LISTEN, 1, "shared", NULL, 0), 0);
    tsu_expect(listener, &f, TS_OP_LISTEN, 1, TS_ST_OK);
    tsu_frame_free(&f);
    for (int i = 0; i < N_CONC; i++)
        fds[i] = tsu_client(&srv);
    /* Every round: all connections send, then all replies are read, so all are busy at once. */
    for (int r = 0; r < N_ROUNDS; r++) {
        for (int i = 0; i < N_CONC; i++) {
            size_t len;
            uint8_t *rec = tsu_rec_int(i * 100 + r, &len);
            char own[32];
            snprintf(own, sizeof(own), "conn %d", i);
            assert_int_equal(tsu_send_store(fds[i], TS_OP_APPEND, 1, "shared", rec, len), 0);
            assert_int_equal(tsu_send_store(fds[i], TS_OP_PUT, 2, own, rec, len), 0);
            assert_int_equal(tsu_send_get(fds[i], TS_OP_PEEK, 3, own, 0), 0);
            tsu_rec_free(rec, len);
        }
        for (int i = 0; i < N_CONC; i++) {
            tsu_expect(fds[i], &f, TS_OP_APPEND, 1, TS_ST_OK);
            tsu_frame_free(&f);
            tsu_expect(fds[i], &f, TS_OP_PUT, 2, TS_ST_OK);
            tsu_frame_free(&f);
            tsu_expect(fds[i], &f, TS_OP_PEEK, 3, TS_ST_OK);
            assert_int_equal(ts__get_u32le(f.body + 8), 1);
            assert_int_equal(tsu_item_int(f.body + 64, (size_t)ts__get_u64le(f.body + 16)),
                             i * 100 + r);
            tsu_frame_free(&f);
        }
    }
    /* The listener heard every append once, in order of increasing version. */
    uint64_t last = 0;
    for (uint32_t k = 1; k <= N_CONC * N_ROUNDS; k++) {
        tsu_expect(listener, &f, TS_OP_NOTIFY, 0, TS_ST_OK);
        tsu_note note;
        tsu_note_parse(&f, &note);
        assert_int_equal(note.event, TS_NOTE_APPEND);
        assert_int_equal(note.n, k);
        assert_true(note.version > last);
        last = note.version;
        tsu_frame_free(&f);
    }
    assert_int_equal(tsu_stat(listener, "connections"), N_CONC + 1);
    assert_int_equal(tsu_stat(listener, "bins"), N_CONC + 1);
    assert_int_equal(tsu_stat(listener, "items"), N_CONC * N_ROUNDS + N_CONC);
    for (int i = 0; i < N_CONC; i++)
        close(fds[i]);
    close(listener);
}

static void test_out_of_memory_keeps_connection(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(40 << 10, 1, &len);
    uint64_t v = tsu_store(fd, TS_OP_PUT, "a", rec, len, NULL);

    /* Over the limit: OUT_OF_MEMORY, the body is skipped, and the next request (sent in the
     * same write) is answered on the same connection. */
    assert_int_equal(tsu_send_store(fd, TS_OP_APPEND, 5, "b", rec, len), 0);
    assert_int_equal(tsh_send(fd, TS_OP_PING, 6, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_APPEND, 5, TS_ST_OUT_OF_MEMORY);
    assert_true(f.len > 0);
    tsu_frame_free(&f);
    tsu_expect(fd, &f, TS_OP_PING, 6, TS_ST_OK);

    /* A big refused body streams through without being stored. */
    size_t blen;
    uint8_t *big = tsu_rec_bytes(3 << 20, 2, &blen);
    assert_int_equal(tsu_send_store(fd, TS_OP_APPEND, 7, "a", big, blen), 0);
    tsu_expect(fd, &f, TS_OP_APPEND, 7, TS_ST_OUT_OF_MEMORY);
    tsu_frame_free(&f);
    tsu_rec_free(big, blen);

    /* Nothing changed. */
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "a", 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.version, v);
    tsu_frame_free(&it.f);
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, 8, "b", 0), 0);
    tsu_expect(fd, &f, TS_OP_PEEK, 8, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(fd, "oom_rejections"), 2);
    assert_int_equal(tsu_stat(fd, "bytes"), (int64_t)len);
    assert_int_equal(tsu_stat(fd, "bytes_reserved"), 0);
    assert_int_equal(tsu_stat(fd, "protocol_errors"), 0);

    /* Freeing memory makes room again. */
    tsu_items got;
    tsu_get(fd, TS_OP_GET, "a", 0, &got);
    tsu_frame_free(&got.f);
    tsu_store(fd, TS_OP_PUT, "b", rec, len, NULL);
    tsu_rec_free(rec, len);
    close(fd);
}

static void test_slow_reader_is_cut_off(void **state)
{
    (void)state;
    int w = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(256 << 10, 9, &len);
    tsu_store(w, TS_OP_PUT, "big", rec, len, NULL);
    tsu_rec_free(rec, len);

    /* 400 peeks (100 MiB of replies) sent without reading: far past --max-output 1m. */
    int slow = tsu_client(&srv);
    static uint8_t reqs[400 * (TS_HDR_SIZE + 8)];
    size_t pos = 0;
    for (uint32_t i = 0; i < 400; i++) {
        ts__hdr h = {.magic = TS_MAGIC_REQ,
                     .version = TS_PROTO_VERSION,
                     .opcode = TS_OP_PEEK,
                     .request_id = 100 + i,
                     .body_len = 8};
        ts__hdr_encode(&h, reqs + pos);
        memcpy(reqs + pos + TS_HDR_SIZE,
               "\x03"
               "big"
               "\0\0\0\0",
               8);
        pos += TS_HDR_SIZE + 8;
    }
    assert_int_equal(tsh_write_all(slow, reqs, pos), 0);

    /* The others are served meanwhile. */
    tsu_check_healthy(&srv);

    /* The slow one gets the replies that were already on their way, then SLOW_READER. */
    uint32_t replies = 0;
    int saw_slow = 0;
    tsu_frame f;
    while (tsu_recv(slow, &f) == 0) {
        if (f.h.status == TS_ST_SLOW_READER) {
            assert_int_equal(f.h.request_id, 0);
            saw_slow = 1;
            tsu_frame_free(&f);
            break;
        }
        assert_int_equal(f.h.opcode, TS_OP_PEEK);
        assert_int_equal(f.h.request_id, 100 + replies);
        replies++;
        tsu_frame_free(&f);
    }
    assert_true(saw_slow);
    assert_true(replies < 400);
    assert_int_equal(tsh_wait_closed(slow, 5000), 1);
    close(slow);
    assert_int_equal(tsu_stat(w, "slow_readers"), 1);
    close(w);
}

static void test_too_many_clients(void **state)
{
    (void)state;
    int fds[3];
    for (int i = 0; i < 3; i++)
        fds[i] = tsu_client(&srv);
    int extra = tsh_connect_tcp(srv.port);
    assert_true(extra >= 0);
    tsu_frame f;
    assert_int_equal(tsu_recv(extra, &f), 0);
    assert_int_equal(f.h.status, TS_ST_TOO_MANY_CLIENTS);
    assert_int_equal(f.h.request_id, 0);
    assert_true(f.len > 0);
    tsu_frame_free(&f);
    assert_int_equal(tsh_wait_closed(extra, 5000), 1);
    /* Refused connections on their way out do not count as clients. */
    assert_int_equal(tsu_stat(fds[0], "connections"), 3);
    close(extra);
    /* The admitted ones are unaffected; when one leaves, a newcomer gets in. */
    assert_int_equal(tsh_send(fds[0], TS_OP_PING, 1, NULL, 0), 0);
    tsu_expect(fds[0], &f, TS_OP_PING, 1, TS_ST_OK);
    close(fds[2]);
    int64_t n = 3;
    for (int i = 0; i < 200 && n != 2; i++) {
        usleep(10000);
        n = tsu_stat(fds[0], "connections");
    }
    assert_int_equal(n, 2);
    fds[2] = tsu_client(&srv);
    assert_int_equal(tsu_stat(fds[2], "rejected_clients"), 1);
    for (int i = 0; i < 3; i++)
        close(fds[i]);
}

/* Subscriptions plus pending WAITs are capped per connection; the refusal keeps the connection. */
static void test_too_many_watches(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    tsu_frame f;
    /* Two subscriptions (listening twice to one bin counts once) and one pending WAIT. */
    assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 1, "a", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LISTEN, 1, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 2, "a", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LISTEN, 2, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 3, "b", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LISTEN, 3, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_wait(fd, 4, "c", 0, 60000), 0);
    /* The fourth of either kind is refused with INVALID, and nothing else changes. */
    assert_int_equal(tsu_send_wait(fd, 5, "d", 0, 60000), 0);
    tsu_expect(fd, &f, TS_OP_WAIT, 5, TS_ST_INVALID);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 6, "e", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LISTEN, 6, TS_ST_INVALID);
    tsu_frame_free(&f);
    /*
     * At the limit, what needs no new place is still answered: a repeated LISTEN, and a WAIT
     * whose condition already holds (answered at once, it never counts).
     */
    assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 60, "a", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LISTEN, 60, TS_ST_OK);
    tsu_frame_free(&f);
    int w2 = tsu_client(&srv);
    uint64_t vz = tsu_put_int(w2, TS_OP_PUT, "z", 1, NULL);
    close(w2);
    assert_int_equal(tsu_send_wait(fd, 61, "z", vz - 1, 60000), 0);
    tsu_expect(fd, &f, TS_OP_WAIT, 61, TS_ST_OK);
    tsu_frame_free(&f);
    /* A WAIT that would wait, even with timeout 0, is checked first: timeout 0 never counts. */
    assert_int_equal(tsu_send_wait(fd, 62, "z", vz, 0), 0);
    tsu_expect(fd, &f, TS_OP_WAIT, 62, TS_ST_TIMEOUT);
    tsu_frame_free(&f);
    /* Ending a subscription frees a place; the connection still works. */
    assert_int_equal(tsu_send_name(fd, TS_OP_UNLISTEN, 7, "b", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_UNLISTEN, 7, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 8, "e", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LISTEN, 8, TS_ST_OK);
    tsu_frame_free(&f);
    /* The pending WAIT is still there: a change to "c" answers it. */
    int other = tsu_client(&srv);
    tsu_put_int(other, TS_OP_PUT, "c", 1, NULL);
    tsu_expect(fd, &f, TS_OP_WAIT, 4, TS_ST_OK);
    tsu_frame_free(&f);
    /* An answered WAIT frees its place too. */
    assert_int_equal(tsu_send_wait(fd, 9, "f", 0, 60000), 0);
    assert_int_equal(tsh_send(fd, TS_OP_PING, 10, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_PING, 10, TS_ST_OK);
    tsu_frame_free(&f);
    close(other);
    close(fd);
}

#define N_MEM_WAITS 8000

/*
 * Pending WAITs and subscriptions count against --max-memory (STATS watch_bytes): past the limit
 * they are refused with OUT_OF_MEMORY, the connection is kept, and closing it returns it all.
 */
static void test_waits_count_against_memory(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    int other = tsu_client(&srv);
    char name[32];
    for (uint32_t i = 0; i < N_MEM_WAITS; i++) {
        snprintf(name, sizeof(name), "w%u", i % 64);
        assert_int_equal(tsu_send_wait(fd, 1 + i, name, 0, 60000), 0);
    }
    assert_int_equal(tsh_send(fd, TS_OP_PING, 99999, NULL, 0), 0);
    /* Only refused WAITs are answered now; the PING comes after them. */
    tsu_frame f;
    uint32_t refused = 0;
    for (uint32_t i = 0; i <= N_MEM_WAITS; i++) {
        assert_int_equal(tsu_recv(fd, &f), 0);
        int ping = f.h.opcode == TS_OP_PING;
        if (!ping) {
            assert_int_equal(f.h.opcode, TS_OP_WAIT);
            assert_int_equal(f.h.status, TS_ST_OUT_OF_MEMORY);
            refused++;
        }
        tsu_frame_free(&f);
        if (ping)
            break;
    }
    assert_true(refused > 0);
    assert_true(refused < N_MEM_WAITS);
    assert_int_equal(tsu_stat(other, "waiters"), N_MEM_WAITS - refused);
    int64_t bytes = tsu_stat(other, "watch_bytes");
    assert_true(bytes >= (int64_t)(N_MEM_WAITS - refused) * 32);
    /* A subscription is refused the same way while the waits hold the memory. */
    assert_int_equal(tsu_send_name(other, TS_OP_LISTEN, 5, "new-bin", NULL, 0), 0);
    tsu_expect(other, &f, TS_OP_LISTEN, 5, TS_ST_OUT_OF_MEMORY);
    tsu_frame_free(&f);
    close(fd);
    int64_t left = 1;
    for (int i = 0; i < 300 && left != 0; i++) {
        usleep(10000);
        left = tsu_stat(other, "watch_bytes");
    }
    assert_int_equal(left, 0);
    assert_int_equal(tsu_stat(other, "waiters"), 0);
    assert_int_equal(tsu_send_name(other, TS_OP_LISTEN, 6, "new-bin", NULL, 0), 0);
    tsu_expect(other, &f, TS_OP_LISTEN, 6, TS_ST_OK);
    tsu_frame_free(&f);
    assert_true(tsu_stat(other, "watch_bytes") > 0);
    close(other);
    tsu_check_healthy(&srv);
}

#define N_WAKE_CONNS 3
#define N_WAKE_PER   1000

/*
 * One change waking more waiters than one loop turn serves: the rest are served on later turns,
 * each exactly once, each with a state that satisfies it. A DELETE that comes in between leaves
 * the waiters not yet served pending (a missing bin satisfies nobody) until the next PUT.
 */
static void test_wake_many_in_turns(void **state)
{
    (void)state;
    int w[N_WAKE_CONNS];
    tsu_frame f;
    for (int k = 0; k < N_WAKE_CONNS; k++) {
        w[k] = tsu_client(&srv);
        for (uint32_t i = 0; i < N_WAKE_PER; i++)
            assert_int_equal(tsu_send_wait(w[k], 1 + i, "hot", 0, 60000), 0);
        assert_int_equal(tsh_send(w[k], TS_OP_PING, 50000, NULL, 0), 0);
        tsu_expect(w[k], &f, TS_OP_PING, 50000, TS_ST_OK);
        tsu_frame_free(&f);
    }
    int listener = tsu_client(&srv);
    assert_int_equal(tsu_send_name(listener, TS_OP_LISTEN, 1, "hot", NULL, 0), 0);
    tsu_expect(listener, &f, TS_OP_LISTEN, 1, TS_ST_OK);
    tsu_frame_free(&f);
    int writer = tsu_client(&srv);
    assert_int_equal(tsu_stat(writer, "waiters"), N_WAKE_CONNS * N_WAKE_PER);

    /* PUT and DELETE in one write, then a second PUT once both are done. */
    size_t len;
    uint8_t *rec = tsu_rec_int(7, &len);
    assert_int_equal(tsu_send_store(writer, TS_OP_PUT, 1, "hot", rec, len), 0);
    assert_int_equal(tsu_send_name(writer, TS_OP_DELETE, 2, "hot", NULL, 0), 0);
    uint64_t v1, vd, v2;
    uint32_t n;
    tsu_expect(writer, &f, TS_OP_PUT, 1, TS_ST_OK);
    tsu_state(&f, &v1, &n);
    tsu_frame_free(&f);
    tsu_expect(writer, &f, TS_OP_DELETE, 2, TS_ST_OK);
    tsu_state(&f, &vd, &n);
    tsu_frame_free(&f);
    v2 = tsu_store(writer, TS_OP_PUT, "hot", rec, len, NULL);
    tsu_rec_free(rec, len);

    static uint8_t seen[N_WAKE_CONNS][N_WAKE_PER + 1];
    memset(seen, 0, sizeof(seen));
    for (int k = 0; k < N_WAKE_CONNS; k++) {
        for (uint32_t i = 0; i < N_WAKE_PER; i++) {
            assert_int_equal(tsu_recv(w[k], &f), 0);
            assert_int_equal(f.h.opcode, TS_OP_WAIT);
            assert_int_equal(f.h.status, TS_ST_OK);
            assert_true(f.h.request_id >= 1 && f.h.request_id <= N_WAKE_PER);
            assert_int_equal(seen[k][f.h.request_id], 0);
            seen[k][f.h.request_id] = 1;
            uint64_t got;
            tsu_state(&f, &got, &n);
            assert_true(got == v1 || got == v2);
            assert_int_equal(n, 1);
            tsu_frame_free(&f);
        }
        /* Nothing more: the next frame is the reply to this PING. */
        assert_int_equal(tsh_send(w[k], TS_OP_PING, 50001, NULL, 0), 0);
        tsu_expect(w[k], &f, TS_OP_PING, 50001, TS_ST_OK);
        tsu_frame_free(&f);
    }
    assert_int_equal(tsu_stat(writer, "waiters"), 0);
    assert_true(tsu_stat(writer, "wake_deferred") >= 1);
    /* The listener saw the three changes (or fewer, coalesced) in version order, ending last. */
    uint64_t last = 0;
    for (int i = 0; i < 3 && last != v2; i++) {
        tsu_note note;
        assert_int_equal(tsu_recv(listener, &f), 0);
        assert_int_equal(f.h.opcode, TS_OP_NOTIFY);
        tsu_note_parse(&f, &note);
        assert_true(note.version > last);
        assert_true(note.version == v1 || note.version == vd || note.version == v2);
        last = note.version;
        tsu_frame_free(&f);
    }
    assert_int_equal(last, v2);

    /* Waiters of a connection that closes while a wake-up is under way are skipped safely. */
    int gone = tsu_client(&srv);
    for (uint32_t i = 0; i < 3 * N_WAKE_PER; i++)
        assert_int_equal(tsu_send_wait(gone, 1 + i, "hot2", 0, 60000), 0);
    assert_int_equal(tsh_send(gone, TS_OP_PING, 50000, NULL, 0), 0);
    tsu_expect(gone, &f, TS_OP_PING, 50000, TS_ST_OK);
    tsu_frame_free(&f);
    rec = tsu_rec_int(8, &len);
    assert_int_equal(tsu_send_store(writer, TS_OP_PUT, 3, "hot2", rec, len), 0);
    close(gone);
    tsu_expect(writer, &f, TS_OP_PUT, 3, TS_ST_OK);
    tsu_frame_free(&f);
    tsu_store(writer, TS_OP_PUT, "hot2", rec, len, NULL);
    tsu_rec_free(rec, len);
    int64_t left = 1;
    for (int i = 0; i < 300 && left != 0; i++) {
        usleep(10000);
        left = tsu_stat(writer, "waiters");
    }
    assert_int_equal(left, 0);
    for (int k = 0; k < N_WAKE_CONNS; k++)
        close(w[k]);
    close(listener);
    close(writer);
    tsu_check_healthy(&srv);
}

static void test_shutdown_with_writes_in_flight(void **state)
{
    (void)state;
    int w = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(8 << 20, 4, &len);
    tsu_store(w, TS_OP_PUT, "big", rec, len, NULL);
    tsu_rec_free(rec, len);
    /* Readers that ask for the big item and never read; a waiter; a listener. */
    int r[3];
    for (int i = 0; i < 3; i++) {
        r[i] = tsu_client(&srv);
        for (uint32_t k = 0; k < 4; k++)
            assert_int_equal(tsu_send_get(r[i], k == 3 ? TS_OP_GET : TS_OP_PEEK, k, "big", 0), 0);
    }
    assert_int_equal(tsu_send_wait(w, 9, "never", 0, 60000), 0);
    assert_int_equal(tsu_send_name(w, TS_OP_LISTEN, 10, "never", NULL, 0), 0);
    tsu_frame f;
    tsu_expect(w, &f, TS_OP_LISTEN, 10, TS_ST_OK);
    tsu_frame_free(&f);
    usleep(100000);
    /* SIGTERM now: tensord must still exit 0 with nothing leaked (checked by stop()). */
    assert_int_equal(tsh_server_stop(&srv), 0);
    for (int i = 0; i < 3; i++)
        close(r[i]);
    close(w);
    assert_int_equal(tsh_server_restart(&srv, NULL), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_200_concurrent_connections, start_plain, stop),
        cmocka_unit_test_setup_teardown(test_out_of_memory_keeps_connection, start_small_memory,
                                        stop),
        cmocka_unit_test_setup_teardown(test_slow_reader_is_cut_off, start_small_output, stop),
        cmocka_unit_test_setup_teardown(test_too_many_clients, start_few_clients, stop),
        cmocka_unit_test_setup_teardown(test_too_many_watches, start_few_watches, stop),
        cmocka_unit_test_setup_teardown(test_shutdown_with_writes_in_flight, start_plain, stop),
        cmocka_unit_test_setup_teardown(test_waits_count_against_memory, start_watch_memory, stop),
        cmocka_unit_test_setup_teardown(test_wake_many_in_turns, start_plain, stop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
