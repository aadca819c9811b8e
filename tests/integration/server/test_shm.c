/*
 * Same-host zero copy over raw unix-socket frames (docs/PROTOCOL.md 8.15 to 8.18, the HELLO flag
 * FDS): GET_REF and PEEK_REF of large items (by descriptor, mapped read-only and compared) and
 * small ones (inline); mappings that outlive DELETE and replacement; PUT_FD and APPEND_FD stored
 * without a copy; a writer that keeps its buffer mapped writable (INVALID), or tries to change it
 * after the commit (EPERM); a descriptor that is not a memfd; a frame that claims a descriptor it
 * lacks; too many stray descriptors; FDS refused over TCP; --max-memory against PUT_FD; and a
 * client killed while it holds mappings and has descriptors in flight, after which the daemon's
 * counters and descriptors come back to where they were; large items given back on the reclaim
 * thread.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <dirent.h>
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

#include "alloc.h"
#include "msg.h"
#include "record.h"
#include "test_server_util.h"

#define BIG        ((size_t)3 << 20) /* bytes of tensor data in a large record (over --shm-min) */
#define SMALL      1000              /* bytes of tensor data in a small record */
#define MAX_FDS    64                /* descriptors one received frame may carry */
#define TEST_SLACK (64 * 1024)       /* bytes of memory_used a connection's kept batches may vary */

static tsh_server srv;
static uint32_t rid = 100;

static int start(void **state)
{
    (void)state;
    return tsh_server_start(&srv, NULL);
}

static int start_small_memory(void **state)
{
    (void)state;
    static const char *const args[] = {"--max-memory", "8m", NULL};
    return tsh_server_start(&srv, args);
}

/* Every descriptor frame's first try meets a "full socket" (TSD_FAKE_FD_FULL). */
static int start_fake_full(void **state)
{
    (void)state;
    setenv("TSD_FAKE_FD_FULL", "1000", 1);
    int rc = tsh_server_start(&srv, NULL);
    unsetenv("TSD_FAKE_FD_FULL");
    return rc;
}

static int start_shm_off(void **state)
{
    (void)state;
    static const char *const args[] = {"--shm-min", "0", NULL};
    return tsh_server_start(&srv, args);
}

static int start_no_fds(void **state)
{
    (void)state;
    static const char *const args[] = {"--no-fds", NULL};
    return tsh_server_start(&srv, args);
}

static int stop(void **state)
{
    (void)state;
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

/* ---------------------------------------------------------------------------------------------
 * Frames with descriptors
 */

/* Send a request frame with fds attached to its first byte (SCM_RIGHTS). */
static int send_fds(int fd, uint8_t op, uint32_t id, const void *body, size_t len, const int *fds,
                    int nfds)
{
    uint8_t hdr[TS_HDR_SIZE];
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .request_id = id,
                 .body_len = len};
    ts__hdr_encode(&h, hdr);
    struct iovec iov[2] = {{hdr, sizeof(hdr)}, {(void *)body, len}};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
    } ctl;
    memset(&ctl, 0, sizeof(ctl));
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = len > 0 ? 2 : 1};
    if (nfds > 0) {
        msg.msg_control = ctl.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0)
        return -1;
    /* The rest without descriptors (the socket rarely takes less than a small frame). */
    size_t sent = (size_t)n;
    if (sent < sizeof(hdr)) {
        if (tsh_write_all(fd, hdr + sent, sizeof(hdr) - sent) != 0)
            return -1;
        sent = sizeof(hdr);
    }
    return tsh_write_all(fd, (const uint8_t *)body + (sent - sizeof(hdr)),
                         len - (sent - sizeof(hdr)));
}

/* Read exactly len bytes with recvmsg, appending any descriptors to fds[*nfds]. 0 or -1. */
static int recv_all_fds(int fd, uint8_t *buf, size_t len, int *fds, int *nfds)
{
    size_t got = 0;
    while (got < len) {
        struct iovec iov = {buf + got, len - got};
        union {
            struct cmsghdr align;
            char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        } ctl;
        struct msghdr msg = {.msg_iov = &iov,
                             .msg_iovlen = 1,
                             .msg_control = ctl.buf,
                             .msg_controllen = sizeof(ctl.buf)};
        ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm != NULL; cm = CMSG_NXTHDR(&msg, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
                continue;
            int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k; i++) {
                int d;
                memcpy(&d, CMSG_DATA(cm) + sizeof(int) * (size_t)i, sizeof(int));
                if (*nfds < MAX_FDS)
                    fds[(*nfds)++] = d;
                else
                    close(d);
            }
        }
        got += (size_t)n;
    }
    return 0;
}

/* Receive one frame and the descriptors that came with it. 0 or -1. */
static int recv_frame_fds(int fd, tsu_frame *f, int *fds, int *nfds)
{
    uint8_t hdr[TS_HDR_SIZE];
    *nfds = 0;
    memset(f, 0, sizeof(*f));
    if (recv_all_fds(fd, hdr, sizeof(hdr), fds, nfds) != 0)
        return -1;
    if (ts__hdr_decode(hdr, TS_MAGIC_REP, &f->h) != 0 || f->h.body_len > ((uint64_t)1 << 31))
        return -1;
    if (f->h.body_len > 0) {
        f->body = malloc((size_t)f->h.body_len);
        assert_non_null(f->body);
        f->len = (size_t)f->h.body_len;
        if (recv_all_fds(fd, f->body, f->len, fds, nfds) != 0)
            return -1;
    }
    return 0;
}

/* HELLO with the given flags; returns the flags the server granted (fails the test on error). */
static uint8_t hello_flags(int fd, uint8_t flags)
{
    ts__msg_hello_req m = {.max_version = TS_PROTO_VERSION, .flags = flags};
    uint8_t body[16];
    size_t len;
    assert_int_equal(ts__msg_hello_req_encode(body, sizeof(body), &m, &len), 0);
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, body, len), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    ts__msg_hello_rep rep;
    assert_int_equal(ts__msg_hello_rep_decode(f.body, f.len, &rep), 0);
    tsu_frame_free(&f);
    return rep.flags;
}

/* A unix connection with FDS granted. */
static int fd_client(void)
{
    int fd = tsh_connect_unix(srv.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(hello_flags(fd, TS_HELLO_FDS) & TS_HELLO_FDS, TS_HELLO_FDS);
    return fd;
}

/* A parsed REF_ITEMS reply and its descriptors (closed by ref_free). */
typedef struct ref_reply {
    tsu_frame f;
    ts__msg_ref_items m;
    ts__msg_ref_entry e[TS_MAX_REF_ITEMS];
    int fds[MAX_FDS];
    int nfds;
} ref_reply;

static void ref_free(ref_reply *r)
{
    for (int i = 0; i < r->nfds; i++)
        close(r->fds[i]);
    r->nfds = 0;
    tsu_frame_free(&r->f);
}

/* GET_REF or PEEK_REF of name; checks status OK, the layout and the descriptor count. */
static void get_ref(int fd, uint8_t op, const char *name, uint32_t max_items, ref_reply *r)
{
    uint32_t id = rid++;
    assert_int_equal(tsu_send_get(fd, op, id, name, max_items), 0);
    assert_int_equal(recv_frame_fds(fd, &r->f, r->fds, &r->nfds), 0);
    assert_int_equal(r->f.h.opcode, op);
    assert_int_equal(r->f.h.request_id, id);
    assert_int_equal(r->f.h.status, TS_ST_OK);
    assert_int_equal(ts__msg_ref_decode(r->f.body, r->f.len, &r->m), 0);
    assert_int_equal((int)r->m.n_fds, r->nfds);
    for (uint32_t i = 0; i < r->m.n_items; i++)
        ts__msg_ref_entry_get(&r->m, i, &r->e[i]);
}

/* A read-only mapping of entry i of r (its descriptor); *base and *size for munmap. */
static const uint8_t *map_entry(const ref_reply *r, uint32_t i, void **base, size_t *size)
{
    assert_int_equal(r->e[i].where, TS_REF_FD);
    int k = 0;
    for (uint32_t j = 0; j < i; j++)
        k += r->e[j].where == TS_REF_FD;
    struct stat sb;
    assert_int_equal(fstat(r->fds[k], &sb), 0);
    assert_true((uint64_t)sb.st_size >= r->e[i].file_len);
    void *p = mmap(NULL, (size_t)r->e[i].file_len, PROT_READ, MAP_SHARED, r->fds[k], 0);
    if (p == MAP_FAILED && errno == EPERM)
        p = mmap(NULL, (size_t)r->e[i].file_len, PROT_READ, MAP_PRIVATE, r->fds[k], 0);
    assert_true(p != MAP_FAILED);
    *base = p;
    *size = (size_t)r->e[i].file_len;
    return (const uint8_t *)p + r->e[i].offset;
}

/* The descriptor of entry i of r. */
static int entry_fd(const ref_reply *r, uint32_t i)
{
    int k = 0;
    for (uint32_t j = 0; j < i; j++)
        k += r->e[j].where == TS_REF_FD;
    return r->fds[k];
}

/* A STATS value read over a fresh TCP connection (descriptors never go there). */
static int64_t stat_of(const char *key)
{
    int fd = tsu_client(&srv);
    int64_t v = tsu_stat(fd, key);
    close(fd);
    return v;
}

/* Poll a STATS value until it equals want (at most 5 s); returns the last value seen. */
static int64_t stat_wait(const char *key, int64_t want)
{
    int64_t v = stat_of(key);
    for (int i = 0; i < 100 && v != want; i++) {
        usleep(50000);
        v = stat_of(key);
    }
    return v;
}

/* Descriptors the server holds open whose target starts with prefix (a memfd: "/memfd:NAME"). */
static int server_fds_to(const char *prefix)
{
    char path[64], link[256];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)srv.pid);
    DIR *d = opendir(path);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char p[400];
        snprintf(p, sizeof(p), "%s/%s", path, e->d_name);
        ssize_t k = readlink(p, link, sizeof(link) - 1);
        if (k <= 0)
            continue;
        link[k] = '\0';
        n += strncmp(link, prefix, strlen(prefix)) == 0;
    }
    closedir(d);
    return n;
}

/* Descriptors the server process holds open. */
static int server_fd_count(void)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)srv.pid);
    DIR *d = opendir(path);
    assert_non_null(d);
    int n = 0;
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n - 2;
}

/* A memfd holding rec (len bytes) in a file of file_len bytes, unmapped. */
static int memfd_with(const uint8_t *rec, size_t len, size_t file_len)
{
    int fd = memfd_create("test-put", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)file_len), 0);
    assert_true(pwrite(fd, rec, len, 0) == (ssize_t)len);
    return fd;
}

static void send_put_fd(int fd, uint8_t op, uint32_t id, const char *name, uint64_t rec_len,
                        int mfd)
{
    ts__msg_put_fd_req m = {
        .name = (const uint8_t *)name, .name_len = strlen(name), .rec_len = rec_len};
    uint8_t body[300];
    size_t len;
    assert_int_equal(ts__msg_put_fd_req_encode(body, sizeof(body), &m, &len), 0);
    assert_int_equal(send_fds(fd, op, id, body, len, &mfd, mfd >= 0 ? 1 : 0), 0);
}

/* ---------------------------------------------------------------------------------------------
 * Tests
 */

/* GET_REF/PEEK_REF: large by descriptor (sealed, read-only), small inline; mappings outlive. */
static void test_ref_reads(void **state)
{
    (void)state;
    int fd = fd_client();
    size_t big_len, small_len;
    uint8_t *big = tsu_rec_bytes(BIG, 7, &big_len);
    uint8_t *small = tsu_rec_bytes(SMALL, 9, &small_len);
    uint32_t n;
    tsu_store(fd, TS_OP_PUT, "b", big, big_len, &n);
    tsu_store(fd, TS_OP_APPEND, "b", small, small_len, &n);
    assert_int_equal(n, 2);

    ref_reply r;
    get_ref(fd, TS_OP_PEEK_REF, "b", 0, &r);
    assert_int_equal(r.m.n_items, 2);
    assert_int_equal(r.m.remaining, 2);
    assert_int_equal(r.nfds, 1);
    assert_int_equal(r.e[0].where, TS_REF_FD);
    assert_int_equal(r.e[0].length, big_len);
    assert_int_equal(r.e[0].flags, 0);
    assert_int_equal(r.e[1].where, TS_REF_INLINE);
    assert_int_equal(r.e[1].length, small_len);
    assert_memory_equal(r.f.body + r.e[1].offset, small, small_len);
    void *base;
    size_t size;
    const uint8_t *rec = map_entry(&r, 0, &base, &size);
    assert_memory_equal(rec, big, big_len);
    assert_int_equal(ts__record_validate(rec, big_len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
    /* What the client got is read-only for good: sealed against writes, size fixed. */
    int mfd = entry_fd(&r, 0);
    int seals = fcntl(mfd, F_GET_SEALS);
    assert_true(seals >= 0);
    assert_true((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0);
    assert_true((seals & F_SEAL_SHRINK) && (seals & F_SEAL_GROW) && (seals & F_SEAL_SEAL));
    assert_true(mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0) == MAP_FAILED);
    assert_int_equal(errno, EPERM);
    assert_int_equal(pwrite(mfd, "x", 1, 0), -1);
    assert_int_equal(ftruncate(mfd, 0), -1);
    ref_free(&r);

    /* The mapping stays valid and unchanged after DELETE. */
    int tfd = tsu_client(&srv);
    assert_true(stat_of("fds_sent") >= 1);
    assert_int_equal(tsu_send_name(tfd, TS_OP_DELETE, rid++, "b", NULL, 0), 0);
    tsu_frame f;
    tsu_recv(tfd, &f);
    assert_int_equal(f.h.status, TS_ST_OK);
    tsu_frame_free(&f);
    assert_memory_equal(rec, big, big_len);

    /* GET_REF takes the items; a replaced item's mapping stays as it was. */
    size_t big2_len;
    uint8_t *big2 = tsu_rec_bytes(BIG, 11, &big2_len);
    tsu_store(fd, TS_OP_PUT, "c", big, big_len, &n);
    ref_reply r2;
    get_ref(fd, TS_OP_PEEK_REF, "c", 1, &r2);
    void *base2;
    size_t size2;
    const uint8_t *rec2 = map_entry(&r2, 0, &base2, &size2);
    tsu_store(fd, TS_OP_PUT, "c", big2, big2_len, &n);
    assert_memory_equal(rec2, big, big_len);
    ref_free(&r2);
    get_ref(fd, TS_OP_GET_REF, "c", 0, &r2);
    assert_int_equal(r2.m.n_items, 1);
    assert_int_equal(r2.m.remaining, 0);
    void *base3;
    size_t size3;
    const uint8_t *rec3 = map_entry(&r2, 0, &base3, &size3);
    assert_memory_equal(rec3, big2, big2_len);
    ref_free(&r2);
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, rid, "c", 0), 0);
    tsu_expect(fd, &f, TS_OP_PEEK, rid++, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
    assert_memory_equal(rec3, big2, big2_len);
    munmap(base, size);
    munmap(base2, size2);
    munmap(base3, size3);

    /* At most TS_MAX_REF_ITEMS items per reply. */
    for (int i = 0; i < 70; i++)
        tsu_put_int(fd, TS_OP_APPEND, "many", i, &n);
    ref_reply r4;
    get_ref(fd, TS_OP_GET_REF, "many", 0, &r4);
    assert_int_equal(r4.m.n_items, TS_MAX_REF_ITEMS);
    assert_int_equal(r4.m.remaining, 70 - TS_MAX_REF_ITEMS);
    assert_int_equal(tsu_item_int(r4.f.body + r4.e[63].offset, r4.e[63].length), 63);
    ref_free(&r4);
    get_ref(fd, TS_OP_GET_REF, "many", 100, &r4);
    assert_int_equal(r4.m.n_items, 6);
    ref_free(&r4);

    tsu_rec_free(big, big_len);
    tsu_rec_free(big2, big2_len);
    tsu_rec_free(small, small_len);
    close(tfd);
    close(fd);
    /* Every item is gone: no descriptor is held for one any more. */
    assert_int_equal(stat_wait("fds_held", 0), 0);
    assert_int_equal(stat_of("shm_items"), 0);
}

/*
 * Large items dropped (DELETE) are given back on the reclaim thread: STATS counts the releases
 * handed to it, nothing stays pending, and every memfd the items held is closed, both tensord's
 * own (an upload handed out by PEEK_REF, never reused) and a client's PUT_FD buffer.
 */
static void test_reclaim(void **state)
{
    (void)state;
    const size_t big = (size_t)6 << 20; /* over TSD_RECLAIM_MIN (4 MiB) */
    int fd = fd_client();
    int64_t jobs0 = stat_of("reclaim_jobs"), bytes0 = stat_of("reclaim_bytes");
    int base_items = server_fds_to("/memfd:tensord-item");
    size_t len;
    uint8_t *rec = tsu_rec_bytes(big, 21, &len);
    uint32_t n;
    tsu_store(fd, TS_OP_PUT, "own", rec, len, &n);
    ref_reply r;
    get_ref(fd, TS_OP_PEEK_REF, "own", 0, &r);
    assert_int_equal(r.e[0].where, TS_REF_FD);
    void *base;
    size_t size;
    assert_memory_equal(map_entry(&r, 0, &base, &size), rec, len);
    ref_free(&r);
    int mfd = memfd_with(rec, len, len);
    uint32_t id = rid++;
    send_put_fd(fd, TS_OP_PUT_FD, id, "theirs", len, mfd);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PUT_FD, id, TS_ST_OK);
    tsu_frame_free(&f);
    close(mfd);
    assert_int_equal(server_fds_to("/memfd:test-put"), 1);

    for (int i = 0; i < 2; i++) {
        assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, rid, i == 0 ? "own" : "theirs", NULL, 0),
                         0);
        tsu_expect(fd, &f, TS_OP_DELETE, rid++, TS_ST_OK);
        tsu_frame_free(&f);
    }
    assert_int_equal(stat_wait("reclaim_pending_bytes", 0), 0);
    assert_int_equal(stat_of("reclaim_jobs"), jobs0 + 2);
    assert_true(stat_of("reclaim_bytes") >= bytes0 + 2 * (int64_t)len);
    assert_int_equal(stat_of("shm_items"), 0);
    /* The daemon holds neither memfd any more; only the client's mapping keeps its pages. */
    assert_int_equal(server_fds_to("/memfd:test-put"), 0);
    assert_true(server_fds_to("/memfd:tensord-item") <= base_items);
    assert_memory_equal(base, rec, len);
    munmap(base, size);
    tsu_rec_free(rec, len);
    close(fd);
}

/* --shm-min 0: large items go inline too. */
static void test_shm_off(void **state)
{
    (void)state;
    int fd = fd_client();
    size_t big_len;
    uint8_t *big = tsu_rec_bytes(BIG, 3, &big_len);
    uint32_t n;
    tsu_store(fd, TS_OP_PUT, "b", big, big_len, &n);
    ref_reply r;
    get_ref(fd, TS_OP_PEEK_REF, "b", 0, &r);
    assert_int_equal(r.nfds, 0);
    assert_int_equal(r.e[0].where, TS_REF_INLINE);
    assert_memory_equal(r.f.body + r.e[0].offset, big, big_len);
    ref_free(&r);
    tsu_rec_free(big, big_len);
    close(fd);
}

/* PUT_FD and APPEND_FD: stored without a copy, sealed for good. */
static void test_put_fd(void **state)
{
    (void)state;
    int fd = fd_client();
    size_t len;
    uint8_t *rec = tsu_rec_bytes(BIG, 5, &len);
    int mfd = memfd_with(rec, len, len + 5000);
    uint32_t id = rid++;
    send_put_fd(fd, TS_OP_PUT_FD, id, "p", len, mfd);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PUT_FD, id, TS_ST_OK);
    uint64_t v;
    uint32_t n;
    tsu_state(&f, &v, &n);
    assert_int_equal(n, 1);
    tsu_frame_free(&f);
    /* The writer can no longer change it, by any means. */
    assert_int_equal(pwrite(mfd, "x", 1, 0), -1);
    assert_int_equal(errno, EPERM);
    assert_int_equal(ftruncate(mfd, 0), -1);
    assert_int_equal(errno, EPERM);
    assert_true(mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0) == MAP_FAILED);
    assert_int_equal(errno, EPERM);
    /* Read back plainly and by reference. */
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "p", 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.item_len[0], len);
    assert_memory_equal(it.item[0], rec, len);
    tsu_frame_free(&it.f);
    ref_reply r;
    get_ref(fd, TS_OP_PEEK_REF, "p", 0, &r);
    assert_int_equal(r.e[0].where, TS_REF_FD);
    assert_int_equal(r.e[0].file_len, len + 5000);
    void *base;
    size_t size;
    assert_memory_equal(map_entry(&r, 0, &base, &size), rec, len);
    munmap(base, size);
    ref_free(&r);
    /* APPEND_FD of the same buffer (already sealed) adds an item. */
    id = rid++;
    send_put_fd(fd, TS_OP_APPEND_FD, id, "p", len, mfd);
    tsu_expect(fd, &f, TS_OP_APPEND_FD, id, TS_ST_OK);
    tsu_state(&f, &v, &n);
    assert_int_equal(n, 2);
    tsu_frame_free(&f);
    assert_int_equal(stat_of("puts_fd"), 2);
    close(mfd);
    tsu_rec_free(rec, len);
    close(fd);
}

/* The refusals that keep the connection: still mapped writable, not a memfd, past its end. */
static void test_put_fd_refusals(void **state)
{
    (void)state;
    int fd = fd_client();
    size_t len;
    uint8_t *rec = tsu_rec_bytes(SMALL, 1, &len);
    int mfd = memfd_with(rec, len, len);
    void *w = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    assert_true(w != MAP_FAILED);
    uint32_t id = rid++;
    send_put_fd(fd, TS_OP_PUT_FD, id, "w", len, mfd);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PUT_FD, id, TS_ST_INVALID);
    assert_non_null(memmem(f.body, f.len, "mapped writable", 15));
    tsu_frame_free(&f);
    /* Unmapped, the same buffer goes through. */
    munmap(w, len);
    id = rid++;
    send_put_fd(fd, TS_OP_PUT_FD, id, "w", len, mfd);
    tsu_expect(fd, &f, TS_OP_PUT_FD, id, TS_ST_OK);
    tsu_frame_free(&f);
    /* record_len past the file's end. */
    int mfd2 = memfd_with(rec, len, len);
    id = rid++;
    send_put_fd(fd, TS_OP_PUT_FD, id, "w", len + 1, mfd2);
    tsu_expect(fd, &f, TS_OP_PUT_FD, id, TS_ST_INVALID);
    tsu_frame_free(&f);
    /* A file larger than tensord maps: said as such, whatever record_len is. */
    int mfd3 = memfd_with(rec, len, len);
    assert_int_equal(ftruncate(mfd3, (off_t)((uint64_t)1 << 46) + 4096), 0);
    id = rid++;
    send_put_fd(fd, TS_OP_PUT_FD, id, "w", len, mfd3);
    tsu_expect(fd, &f, TS_OP_PUT_FD, id, TS_ST_INVALID);
    assert_non_null(memmem(f.body, f.len, "larger than 2^46 bytes", 22));
    assert_null(memmem(f.body, f.len, "record_len", 10));
    tsu_frame_free(&f);
    close(mfd3);
    /* A regular file is no memfd. */
    char path[400];
    snprintf(path, sizeof(path), "%s/plain.bin", srv.dir);
    int pfd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    assert_true(pfd >= 0);
    assert_true(write(pfd, rec, len) == (ssize_t)len);
    id = rid++;
    send_put_fd(fd, TS_OP_PUT_FD, id, "w", len, pfd);
    tsu_expect(fd, &f, TS_OP_PUT_FD, id, TS_ST_INVALID);
    assert_non_null(memmem(f.body, f.len, "not a sealable memfd", 20));
    tsu_frame_free(&f);
    /* The connection serves on, and only the good PUT_FD was stored. */
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "w", 0, &it);
    assert_int_equal(it.n, 1);
    tsu_frame_free(&it.f);
    close(pfd);
    close(mfd);
    close(mfd2);
    tsu_rec_free(rec, len);
    close(fd);
    assert_int_equal(stat_wait("fds_pending", 0), 0);
}

/* A PUT_FD frame without its descriptor: BAD_REQUEST, the connection closes. */
static void test_put_fd_missing_descriptor(void **state)
{
    (void)state;
    int fd = fd_client();
    send_put_fd(fd, TS_OP_PUT_FD, rid++, "x", 100, -1);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    tsu_check_healthy(&srv);
}

/* More unclaimed descriptors than TSD_MAX_PENDING_FDS: BAD_REQUEST, closed, none kept after. */
static void test_stray_descriptors(void **state)
{
    (void)state;
    /* libuv keeps a descriptor of its own from the first unix connection on: count it in. */
    close(fd_client());
    (void)stat_of("fds_pending");
    int base_fds = server_fd_count();
    int fd = fd_client();
    int m = memfd_create("stray", MFD_CLOEXEC);
    assert_true(m >= 0);
    int fds[20];
    for (int i = 0; i < 20; i++)
        fds[i] = m;
    /* Sixteen strays are held (a frame may claim them later), the seventeenth is too many. */
    assert_int_equal(send_fds(fd, TS_OP_PING, rid++, NULL, 0, fds, 16), 0);
    tsu_frame f;
    assert_int_equal(tsu_recv(fd, &f), 0);
    assert_int_equal(f.h.status, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(stat_of("fds_pending"), 16);
    assert_int_equal(send_fds(fd, TS_OP_PING, rid++, NULL, 0, fds, 1), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    /*
     * They are closed as the connection starts closing, while the client still holds its end
     * open: within a second, not at the end of the 5 s close grace.
     */
    int64_t pending = stat_of("fds_pending");
    for (int i = 0; i < 20 && pending != 0; i++) {
        usleep(50000);
        pending = stat_of("fds_pending");
    }
    assert_int_equal(pending, 0);
    assert_int_equal(server_fds_to("/memfd:stray"), 0);
    close(fd);
    close(m);
    assert_int_equal(stat_wait("fds_pending", 0), 0);
    /* The server closed every one of them (and the connection: no more descriptors than before). */
    int left = server_fds_to("/memfd:stray");
    for (int i = 0; i < 100 && left > 0; i++) {
        usleep(20000);
        left = server_fds_to("/memfd:stray");
    }
    assert_int_equal(left, 0);
    int now = server_fd_count();
    for (int i = 0; i < 100 && now > base_fds; i++) {
        usleep(20000);
        now = server_fd_count();
    }
    if (now > base_fds)
        print_message("server descriptors: %d, %d before (the loop may open one of its own)\n", now,
                      base_fds);
    assert_true(now <= base_fds + 1);
}

/* FDS is never granted over TCP; the by-reference opcodes close a connection without it. */
static void test_fds_refused_over_tcp(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    assert_int_equal(hello_flags(fd, TS_HELLO_FDS | TS_HELLO_LZ4) & TS_HELLO_FDS, 0);
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK_REF, rid++, "b", 0), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    /* A unix connection that did not ask for FDS is refused PUT_FD the same way. */
    fd = tsh_connect_unix(srv.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(hello_flags(fd, 0) & TS_HELLO_FDS, 0);
    int m = memfd_create("nofds", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    send_put_fd(fd, TS_OP_PUT_FD, rid++, "x", 100, m);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(m);
    close(fd);
    assert_int_equal(stat_wait("fds_pending", 0), 0);
}

/* --max-memory counts the shared buffer's whole file: too large a one is refused. */
static void test_put_fd_max_memory(void **state)
{
    (void)state;
    int fd = fd_client();
    size_t len;
    uint8_t *rec = tsu_rec_bytes(SMALL, 2, &len);
    int mfd = memfd_with(rec, len, (size_t)16 << 20);
    uint32_t id = rid++;
    send_put_fd(fd, TS_OP_PUT_FD, id, "big", len, mfd);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PUT_FD, id, TS_ST_OUT_OF_MEMORY);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, rid, "big", 0), 0);
    tsu_expect(fd, &f, TS_OP_PEEK, rid++, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
    /* A small file fits. */
    int mfd2 = memfd_with(rec, len, len);
    id = rid++;
    send_put_fd(fd, TS_OP_PUT_FD, id, "big", len, mfd2);
    tsu_expect(fd, &f, TS_OP_PUT_FD, id, TS_ST_OK);
    tsu_frame_free(&f);
    close(mfd);
    close(mfd2);
    tsu_rec_free(rec, len);
    close(fd);
}

/*
 * A client killed while it maps items, has a PUT_FD half sent (its descriptor received, the body
 * not) and stray descriptors queued: the daemon lets go of all of it.
 */
static void test_client_killed(void **state)
{
    (void)state;
    int fd = fd_client();
    size_t len;
    uint8_t *rec = tsu_rec_bytes(BIG, 4, &len);
    uint32_t n;
    int base_fds = server_fd_count();
    int64_t base_used = stat_of("used_memory");
    tsu_store(fd, TS_OP_PUT, "k", rec, len, &n);
    for (int round = 0; round < 2; round++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            int cfd = tsh_connect_unix(srv.unix_path);
            uint8_t body[4] = {TS_PROTO_VERSION, TS_HELLO_FDS, 0, 0};
            if (cfd < 0 || tsh_send(cfd, TS_OP_HELLO, 1, body, 4) != 0)
                _exit(2);
            ts__hdr h;
            uint8_t *b;
            size_t bl;
            if (tsh_recv(cfd, &h, &b, &bl) != 0)
                _exit(3);
            free(b);
            /* Map the item by reference and keep the mapping. */
            uint8_t req[16];
            size_t rl = tsh_name_body(req, sizeof(req), "k", "\0\0\0\0", 4);
            if (tsh_send(cfd, TS_OP_PEEK_REF, 2, req, rl) != 0)
                _exit(4);
            tsu_frame f;
            int fds[MAX_FDS], nfds = 0;
            if (recv_frame_fds(cfd, &f, fds, &nfds) != 0 || nfds != 1)
                _exit(5);
            void *p = mmap(NULL, len, PROT_READ, MAP_SHARED, fds[0], 0);
            if (p == MAP_FAILED)
                _exit(6);
            /* Ask for more by reference without reading the replies. */
            for (uint32_t i = 0; i < 8; i++)
                (void)tsh_send(cfd, TS_OP_PEEK_REF, 10 + i, req, rl);
            /* Strays, then a PUT_FD whose descriptor arrives but whose body never does. */
            int m = memfd_create("killed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
            int strays[3] = {m, m, m};
            if (send_fds(cfd, TS_OP_PING, 3, NULL, 0, strays, 3) != 0)
                _exit(7);
            ts__msg_put_fd_req pm = {.name = (const uint8_t *)"k2", .name_len = 2, .rec_len = 64};
            uint8_t pb[32];
            size_t pl;
            ts__msg_put_fd_req_encode(pb, sizeof(pb), &pm, &pl);
            uint8_t hdr[TS_HDR_SIZE];
            ts__hdr ph = {.magic = TS_MAGIC_REQ,
                          .version = TS_PROTO_VERSION,
                          .opcode = TS_OP_PUT_FD,
                          .request_id = 4,
                          .body_len = pl};
            ts__hdr_encode(&ph, hdr);
            struct iovec iov = {hdr, sizeof(hdr)};
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
            memcpy(CMSG_DATA(cm), &m, sizeof(int));
            if (sendmsg(cfd, &msg, MSG_NOSIGNAL) != (ssize_t)sizeof(hdr))
                _exit(8);
            usleep(100000);
            if (round == 0)
                _exit(0);
            raise(SIGKILL);
            _exit(9);
        }
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (round == 0)
            assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        else
            assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
        assert_int_equal(stat_wait("fds_pending", 0), 0);
    }
    /* The item is still served, and once it is gone nothing is held for it. */
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "k", 0, &it);
    assert_int_equal(it.n, 1);
    assert_memory_equal(it.item[0], rec, len);
    tsu_frame_free(&it.f);
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, rid, "k", NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_DELETE, rid++, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(stat_wait("fds_held", 0), 0);
    assert_int_equal(stat_of("shm_items"), 0);
    /* Memory comes back (within the output batches the connection keeps for reuse). */
    int64_t used = stat_of("used_memory");
    for (int i = 0; i < 100 && used > base_used + TEST_SLACK; i++) {
        usleep(50000);
        used = stat_of("used_memory");
    }
    assert_true(used <= base_used + TEST_SLACK);
    assert_int_equal(stat_of("bytes"), 0);
    /* No memfd is left open: neither the items' nor the ones the killed clients sent. */
    int left = server_fds_to("/memfd:");
    for (int i = 0; i < 100 && left > 0; i++) {
        usleep(20000);
        left = server_fds_to("/memfd:");
    }
    assert_int_equal(left, 0);
    int now = server_fd_count();
    for (int i = 0; i < 100 && now > base_fds; i++) {
        usleep(20000);
        now = server_fd_count();
    }
    assert_true(now <= base_fds + 1);
    tsu_rec_free(rec, len);
    close(fd);
}

/*
 * Replies with descriptors keep their place: a client that pipelines plain PEEKs of a large item,
 * PEEK_REFs and PINGs without reading fills the socket, so descriptor frames wait behind
 * unwritten replies (and meet a full socket); read afterwards, every reply comes in request order
 * and each PEEK_REF carries its one descriptor with its own frame.
 */
static void test_ref_order_under_backlog(void **state)
{
    (void)state;
    int fd = fd_client();
    size_t big_len, mid_len;
    uint8_t *big = tsu_rec_bytes(BIG, 8, &big_len);
    uint8_t *mid = tsu_rec_bytes((size_t)2 << 20, 6, &mid_len);
    uint32_t n;
    tsu_store(fd, TS_OP_PUT, "big", big, big_len, &n);
    tsu_store(fd, TS_OP_PUT, "mid", mid, mid_len, &n);
    enum { ROUNDS = 12 };
    uint32_t first = rid;
    for (int r = 0; r < ROUNDS; r++) {
        assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, rid++, "mid", 0), 0);
        assert_int_equal(tsu_send_get(fd, TS_OP_PEEK_REF, rid++, "big", 0), 0);
        assert_int_equal(tsh_send(fd, TS_OP_PING, rid++, NULL, 0), 0);
    }
    usleep(300000);
    void *maps[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        static const uint8_t ops[3] = {TS_OP_PEEK, TS_OP_PEEK_REF, TS_OP_PING};
        for (int k = 0; k < 3; k++) {
            tsu_frame f;
            int fds[MAX_FDS], nfds;
            assert_int_equal(recv_frame_fds(fd, &f, fds, &nfds), 0);
            assert_int_equal(f.h.request_id, first + (uint32_t)(3 * r + k));
            assert_int_equal(f.h.opcode, ops[k]);
            assert_int_equal(f.h.status, TS_ST_OK);
            assert_int_equal(nfds, k == 1 ? 1 : 0);
            if (k == 1) {
                ts__msg_ref_items m;
                assert_int_equal(ts__msg_ref_decode(f.body, f.len, &m), 0);
                ts__msg_ref_entry e;
                ts__msg_ref_entry_get(&m, 0, &e);
                maps[r] = mmap(NULL, (size_t)e.file_len, PROT_READ, MAP_SHARED, fds[0], 0);
                assert_true(maps[r] != MAP_FAILED);
                assert_memory_equal(maps[r], big, big_len);
                munmap(maps[r], (size_t)e.file_len);
                close(fds[0]);
            } else if (k == 0) {
                assert_int_equal(f.len,
                                 ts__items_head_size(1) + mid_len + ts__msg_items_pad(mid_len));
            }
            tsu_frame_free(&f);
        }
    }
    assert_true(stat_of("fds_sent") >= ROUNDS);
    tsu_rec_free(big, big_len);
    tsu_rec_free(mid, mid_len);
    close(fd);
}

/* Large uploads over TCP stay on the heap (cheaper to receive): by reference they go inline. */
static void test_tcp_upload_on_heap(void **state)
{
    (void)state;
    int tfd = tsu_client(&srv);
    size_t big_len;
    uint8_t *big = tsu_rec_bytes(BIG, 12, &big_len);
    uint32_t n;
    tsu_store(tfd, TS_OP_PUT, "t", big, big_len, &n);
    assert_int_equal(stat_of("shm_items"), 0);
    int fd = fd_client();
    ref_reply r;
    get_ref(fd, TS_OP_PEEK_REF, "t", 0, &r);
    assert_int_equal(r.nfds, 0);
    assert_int_equal(r.e[0].where, TS_REF_INLINE);
    assert_memory_equal(r.f.body + r.e[0].offset, big, big_len);
    ref_free(&r);
    /* The same record over the unix socket lands in a memfd. */
    tsu_store(fd, TS_OP_PUT, "t", big, big_len, &n);
    assert_int_equal(stat_of("shm_items"), 1);
    tsu_rec_free(big, big_len);
    close(fd);
    close(tfd);
}

/* --no-fds: nobody can map an upload, so a large one on the unix socket stays on the heap. */
static void test_no_fds_upload_on_heap(void **state)
{
    (void)state;
    int fd = tsh_connect_unix(srv.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(hello_flags(fd, TS_HELLO_FDS) & TS_HELLO_FDS, 0);
    size_t big_len;
    uint8_t *big = tsu_rec_bytes(BIG, 13, &big_len);
    uint32_t n;
    tsu_store(fd, TS_OP_PUT, "n", big, big_len, &n);
    assert_int_equal(stat_of("shm_items"), 0);
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "n", 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.item_len[0], big_len);
    assert_memory_equal(it.item[0], big, big_len);
    tsu_frame_free(&it.f);
    tsu_rec_free(big, big_len);
    close(fd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_ref_reads, start, stop),
        cmocka_unit_test_setup_teardown(test_shm_off, start_shm_off, stop),
        cmocka_unit_test_setup_teardown(test_tcp_upload_on_heap, start, stop),
        cmocka_unit_test_setup_teardown(test_no_fds_upload_on_heap, start_no_fds, stop),
        cmocka_unit_test_setup_teardown(test_ref_order_under_backlog, start, stop),
        cmocka_unit_test_setup_teardown(test_ref_order_under_backlog, start_fake_full, stop),
        cmocka_unit_test_setup_teardown(test_ref_reads, start_fake_full, stop),
        cmocka_unit_test_setup_teardown(test_put_fd, start, stop),
        cmocka_unit_test_setup_teardown(test_put_fd_refusals, start, stop),
        cmocka_unit_test_setup_teardown(test_put_fd_missing_descriptor, start, stop),
        cmocka_unit_test_setup_teardown(test_stray_descriptors, start, stop),
        cmocka_unit_test_setup_teardown(test_fds_refused_over_tcp, start, stop),
        cmocka_unit_test_setup_teardown(test_put_fd_max_memory, start_small_memory, stop),
        cmocka_unit_test_setup_teardown(test_client_killed, start, stop),
        cmocka_unit_test_setup_teardown(test_reclaim, start, stop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
