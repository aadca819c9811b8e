/*
 * tensord under pressure: 1000 concurrent connections and the ones beyond --max-clients, a
 * listener that never reads while megabytes of changes happen (coalesced, memory bounded,
 * others unaffected), a reader held over the soft output limit (cut off with SLOW_READER), and
 * running out of file descriptors (accepting pauses instead of spinning, then resumes).
 */
#define _GNU_SOURCE /* prlimit */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "test_harden_util.h"

/* The daemon of the running test; a failed assertion leaves it to the teardown to stop. */
static tsh_server s;

static int kill_leftover(void **state)
{
    (void)state;
    if (s.pid > 0) {
        tsh_server_kill(&s);
        tsh_server_cleanup(&s);
    }
    memset(&s, 0, sizeof(s));
    return 0;
}

/* Raise this process's descriptor limit to at least want; fails the test when it cannot. */
static void raise_nofile(rlim_t want)
{
    struct rlimit rl;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_cur >= want)
        return;
    if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < want) {
        print_error("RLIMIT_NOFILE hard limit %llu < %llu\n", (unsigned long long)rl.rlim_max,
                    (unsigned long long)want);
        fail();
    }
    rl.rlim_cur = want;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &rl), 0);
}

/*
 * A TCP connection whose receive buffer is small (set before connecting, so the window is
 * small from the start): unread output backs up in tensord instead of the kernel.
 */
static int connect_small_rcvbuf(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    int sz = 16384;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    return fd;
}

/* Bin b's name: long, so that each notification is a few hundred bytes. */
static void bin_name(char *out, size_t cap, int b)
{
    char pad[201];
    memset(pad, 'x', 200);
    pad[200] = '\0';
    snprintf(out, cap, "bin%03d-%s", b, pad);
}

static void ping(int fd, uint32_t rid)
{
    assert_int_equal(tsh_send(fd, TS_OP_PING, rid, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PING, rid, TS_ST_OK);
    tsu_frame_free(&f);
}

#define NCONN 1000

static void test_thousand_connections(void **state)
{
    (void)state;
    raise_nofile(NCONN + 200);
    const char *args[] = {"--max-clients", "1000", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    static int fds[NCONN];
    for (int i = 0; i < NCONN; i++) {
        fds[i] = tsh_connect_tcp(s.port);
        assert_true(fds[i] >= 0);
        assert_int_equal(th_send_hello(fds[i], 1, NULL, 0), 0);
    }
    for (int i = 0; i < NCONN; i++) {
        tsu_frame f;
        tsu_expect(fds[i], &f, TS_OP_HELLO, 1, TS_ST_OK);
        tsu_frame_free(&f);
    }
    assert_int_equal(tsu_stat(fds[0], "connections"), NCONN);
    /* Every one of them is served: a PING each, and a PUT/PEEK on every tenth. */
    for (int i = 0; i < NCONN; i++)
        assert_int_equal(tsh_send(fds[i], TS_OP_PING, 2, NULL, 0), 0);
    for (int i = 0; i < NCONN; i++) {
        tsu_frame f;
        tsu_expect(fds[i], &f, TS_OP_PING, 2, TS_ST_OK);
        tsu_frame_free(&f);
    }
    for (int i = 0; i < NCONN; i += 10) {
        char name[32];
        snprintf(name, sizeof(name), "conn-%d", i);
        tsu_put_int(fds[i], TS_OP_PUT, name, i, NULL);
        tsu_items it;
        tsu_get(fds[(i + 500) % NCONN], TS_OP_PEEK, name, 0, &it);
        assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), i);
        tsu_frame_free(&it.f);
    }
    /* Beyond --max-clients: a clear TOO_MANY_CLIENTS frame, then the close. */
    for (int k = 0; k < 5; k++) {
        int extra = tsh_connect_tcp(s.port);
        assert_true(extra >= 0);
        tsu_frame f;
        assert_int_equal(tsu_recv(extra, &f), 0);
        assert_int_equal(f.h.status, TS_ST_TOO_MANY_CLIENTS);
        assert_int_equal(f.h.request_id, 0);
        assert_true(f.len > 0 && strstr((const char *)f.body, "too many clients") != NULL);
        tsu_frame_free(&f);
        assert_int_equal(tsh_wait_closed(extra, 5000), 1);
        close(extra);
    }
    assert_int_equal(tsu_stat(fds[1], "rejected_clients"), 5);
    /* A place freed is a place taken. */
    close(fds[NCONN - 1]);
    int again = -1;
    for (int tries = 0; tries < 100 && again < 0; tries++) {
        th_sleep_ms(20);
        int fd = tsh_connect_tcp(s.port);
        assert_true(fd >= 0);
        assert_int_equal(th_send_hello(fd, 1, NULL, 0), 0);
        tsu_frame f;
        assert_int_equal(tsu_recv(fd, &f), 0);
        if (f.h.status == TS_ST_OK)
            again = fd;
        else
            close(fd);
        tsu_frame_free(&f);
    }
    assert_true(again >= 0);
    ping(again, 3);
    close(again);
    for (int i = 0; i < NCONN - 1; i++)
        close(fds[i]);
    tsu_check_healthy(&s);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

#define NBINS    50
#define NCHANGES 40000

static void test_listener_never_reads(void **state)
{
    (void)state;
    const char *args[] = {"--notify-backlog", "64k", NULL};
    th_small_asan_quarantine();
    assert_int_equal(tsh_server_start(&s, args), 0);
    int listener = connect_small_rcvbuf(s.port);
    assert_int_equal(tsh_hello(listener), 0);
    for (int b = 0; b < NBINS; b++) {
        char name[256];
        bin_name(name, sizeof(name), b);
        assert_int_equal(tsu_send_name(listener, TS_OP_LISTEN, (uint32_t)(100 + b), name, NULL, 0),
                         0);
        tsu_frame f;
        tsu_expect(listener, &f, TS_OP_LISTEN, (uint32_t)(100 + b), TS_ST_OK);
        tsu_frame_free(&f);
    }
    int writer = tsu_client(&s);
    int other = tsu_client(&s);
    long rss0 = tsh_server_rss_kib(&s);
    uint64_t last[NBINS] = {0};
    size_t rlen;
    uint8_t *rec = tsu_rec_int(1, &rlen);
    /* Small changes, pipelined 100 at a time, while another client keeps pinging. */
    for (int i = 0; i < NCHANGES; i += 100) {
        for (int k = 0; k < 100; k++) {
            char name[256];
            bin_name(name, sizeof(name), (i + k) % NBINS);
            assert_int_equal(
                tsu_send_store(writer, TS_OP_PUT, (uint32_t)(i + k + 1), name, rec, rlen), 0);
        }
        for (int k = 0; k < 100; k++) {
            tsu_frame f;
            tsu_expect(writer, &f, TS_OP_PUT, (uint32_t)(i + k + 1), TS_ST_OK);
            uint64_t v;
            uint32_t n;
            tsu_state(&f, &v, &n);
            last[(i + k) % NBINS] = v;
            tsu_frame_free(&f);
        }
        if (i % 2000 == 0)
            ping(other, (uint32_t)i + 7);
    }
    tsu_rec_free(rec, rlen);
    /* Megabytes of changes: 64 one-MiB records. */
    size_t blen;
    uint8_t *big = tsu_rec_bytes((size_t)1 << 20, 3, &blen);
    for (int i = 0; i < 64; i++) {
        char name[256];
        bin_name(name, sizeof(name), i % 4);
        last[i % 4] = tsu_store(writer, TS_OP_PUT, name, big, blen, NULL);
        if (i % 8 == 0)
            ping(other, 900000u + (uint32_t)i);
    }
    tsu_rec_free(big, blen);
    long rss1 = tsh_server_rss_kib(&s);
    int64_t coalesced = tsu_stat(other, "notes_coalesced");
    print_message("listener: %d changes over %d bins; %lld folded into held notifications; "
                  "server RSS %ld -> %ld KiB\n",
                  NCHANGES + 64, NBINS, (long long)coalesced, rss0, rss1);
    assert_true(coalesced > NCHANGES / 4);
    /* Bounded: the 4 MiB held in bins, buffer reuse, a little for the backlog; not 20000 notes. */
    assert_true(rss1 - rss0 < 48 * 1024);

    /* Now it reads: per bin, versions only grow and end at the bin's last change. */
    uint64_t seen[NBINS] = {0};
    int done = 0, frames = 0, flagged = 0;
    uint64_t deadline = th_now_ms() + 30000u * (uint64_t)th_slow();
    while (done < NBINS && th_now_ms() < deadline) {
        tsu_frame f;
        assert_int_equal(tsu_recv(listener, &f), 0);
        tsu_note note;
        tsu_note_parse(&f, &note);
        tsu_frame_free(&f);
        int b = (int)strtol(note.name + 3, NULL, 10);
        assert_true(b >= 0 && b < NBINS);
        assert_true(note.version > seen[b]);
        assert_true(note.version <= last[b]);
        seen[b] = note.version;
        if (note.version == last[b])
            done++;
        frames++;
        flagged += (note.flags & TS_NOTE_FLAG_COALESCED) != 0;
    }
    print_message("listener received %d notifications (%d flagged coalesced) for %d changes\n",
                  frames, flagged, NCHANGES + 64);
    assert_int_equal(done, NBINS);
    assert_true(flagged > 0);
    assert_true(frames < NCHANGES);
    /* It is still subscribed and current: the next change arrives as it happens. */
    char name7[256];
    bin_name(name7, sizeof(name7), 7);
    tsu_put_int(writer, TS_OP_PUT, name7, 5, NULL);
    tsu_frame f;
    assert_int_equal(tsu_recv(listener, &f), 0);
    tsu_note note;
    tsu_note_parse(&f, &note);
    assert_string_equal(note.name, name7);
    assert_int_equal(note.flags, 0);
    tsu_frame_free(&f);
    close(listener);
    close(writer);
    close(other);
    tsu_check_healthy(&s);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

static void test_soft_output_limit(void **state)
{
    (void)state;
    const char *args[] = {
        "--max-output", "256m", "--output-soft", "2m", "--output-soft-seconds", "1", NULL};
    th_small_asan_quarantine();
    assert_int_equal(tsh_server_start(&s, args), 0);
    int fd = tsu_client(&s);
    size_t blen;
    uint8_t *big = tsu_rec_bytes((size_t)1 << 20, 9, &blen);
    tsu_store(fd, TS_OP_PUT, "weights", big, blen, NULL);
    tsu_rec_free(big, blen);
    close(fd);

    int slow = tsu_client(&s);
    int other = tsu_client(&s);
    long rss0 = tsh_server_rss_kib(&s);
    /*
     * 24 MiB of replies asked for, none read: the kernel's buffers take a few, the rest stays
     * in tensord, under the hard limit but over the soft one.
     */
    for (uint32_t i = 0; i < 24; i++)
        assert_int_equal(tsu_send_get(slow, TS_OP_PEEK, 10 + i, "weights", 0), 0);
    /* Others are served meanwhile, and the slow one is cut off once its second has passed. */
    int cut = 0;
    for (int i = 0; i < 40 && !cut; i++) {
        ping(other, (uint32_t)(50 + i));
        th_sleep_ms(100);
        cut = tsu_stat(other, "slow_readers") > 0;
    }
    assert_true(cut);
    long rss1 = tsh_server_rss_kib(&s);
    /* What it asks after the cut-off is no longer read. */
    for (uint32_t i = 0; i < 8; i++)
        (void)tsu_send_get(slow, TS_OP_PEEK, 100 + i, "weights", 0);
    /*
     * It sees the replies of the one write handed to the socket before the cut-off, then the
     * reason, then the close: the replies still waiting behind that write were dropped.
     */
    int replies = 0;
    for (;;) {
        tsu_frame f;
        assert_int_equal(tsu_recv(slow, &f), 0);
        if (f.h.opcode == 0) {
            assert_int_equal(f.h.status, TS_ST_SLOW_READER);
            assert_true(f.len > 0 && memmem(f.body, f.len, "soft limit", 10) != NULL);
            tsu_frame_free(&f);
            break;
        }
        assert_int_equal(f.h.opcode, TS_OP_PEEK);
        assert_int_equal(f.h.status, TS_ST_OK);
        replies++;
        tsu_frame_free(&f);
    }
    assert_int_equal(tsh_wait_closed(slow, 5000), 1);
    close(slow);
    print_message("soft limit: %d of 24 replies sent before the cut-off; RSS %ld -> %ld KiB\n",
                  replies, rss0, rss1);
    assert_true(replies >= 1 && replies <= 12);
    /* Replies reference the stored item: queueing 24 of them costs no copies. */
    assert_true(rss1 - rss0 < 16 * 1024);
    ping(other, 1);
    close(other);
    tsu_check_healthy(&s);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

#define FD_LIMIT 40
#define FD_CONNS 60

/* 1 when fd becomes readable within ms. */
static int readable(int fd, int ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, ms) == 1;
}

static void test_fd_exhaustion(void **state)
{
    (void)state;
    raise_nofile(FD_CONNS + 100);
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    struct rlimit low = {FD_LIMIT, FD_LIMIT}, orig;
    assert_int_equal(prlimit(s.pid, RLIMIT_NOFILE, NULL, &orig), 0);
    low.rlim_max = orig.rlim_max;
    assert_int_equal(prlimit(s.pid, RLIMIT_NOFILE, &low, NULL), 0);

    int fds[FD_CONNS];
    for (int i = 0; i < FD_CONNS; i++) {
        fds[i] = tsh_connect_tcp(s.port); /* the kernel's listen queue takes them all */
        assert_true(fds[i] >= 0);
        assert_int_equal(th_send_hello(fds[i], 1, NULL, 0), 0);
    }
    th_sleep_ms(500);
    int served[FD_CONNS], n_served = 0;
    for (int i = 0; i < FD_CONNS; i++) {
        served[i] = readable(fds[i], 0);
        n_served += served[i];
    }
    /* Some got a fd, the rest wait; and waiting costs no CPU (no spinning on the listener). */
    assert_true(n_served > 0 && n_served < FD_CONNS);
    long cpu0 = th_cpu_ms(s.pid);
    th_sleep_ms(2000);
    long cpu1 = th_cpu_ms(s.pid);
    print_message("fd limit %d: %d of %d connections served, tensord used %ld ms of CPU in 2 s "
                  "while the rest waited\n",
                  FD_LIMIT, n_served, FD_CONNS, cpu1 - cpu0);
    assert_true(cpu1 - cpu0 < 400 * th_slow());
    assert_true(tsh_server_alive(&s));
    /* Free some: the waiting ones are accepted once accepting resumes, and served. */
    int freed = 0;
    for (int i = 0; i < FD_CONNS && freed < 25; i++) {
        if (served[i]) {
            close(fds[i]);
            fds[i] = -1;
            freed++;
        }
    }
    int late = 0;
    for (int i = 0; i < FD_CONNS && late < 10; i++) {
        if (fds[i] < 0 || served[i])
            continue;
        assert_true(readable(fds[i], 10000));
        tsu_frame f;
        tsu_expect(fds[i], &f, TS_OP_HELLO, 1, TS_ST_OK);
        tsu_frame_free(&f);
        ping(fds[i], 2);
        late++;
    }
    assert_int_equal(late, 10);
    for (int i = 0; i < FD_CONNS; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    assert_int_equal(prlimit(s.pid, RLIMIT_NOFILE, &orig, NULL), 0);
    tsu_check_healthy(&s);
    int fd = tsu_client(&s);
    assert_true(tsu_stat(fd, "accept_pauses") > 0);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_thousand_connections, kill_leftover),
        cmocka_unit_test_teardown(test_listener_never_reads, kill_leftover),
        cmocka_unit_test_teardown(test_soft_output_limit, kill_leftover),
        cmocka_unit_test_teardown(test_fd_exhaustion, kill_leftover),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
