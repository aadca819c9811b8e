/*
 * tensord sharding (docs/PROTOCOL.md section 14): a daemon started --shard 1/3 answers every
 * request naming another shard's bin, stream, table, counter, barrier or parameter (uploads
 * included, raw, large and compressed, and the by-reference requests on a unix socket) with
 * WRONG_SHARD and its exact body, does nothing else and keeps the connection; it serves its own
 * names; MGET needs every name owned. With --cluster-map the body names the owner's address and
 * the map's epoch, and SHARD_MAP returns the map. Bad --shard and --cluster-map values exit 2
 * with a message. A bin's versions keep growing across restarts, from a snapshot (the saved
 * counter) and without one (the clock).
 */
#define _GNU_SOURCE /* memfd_create */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "compress.h"
#include "msg.h"
#include "slot.h"
#include "test_harden_util.h"

static tsh_server s;
static uint32_t rid = 100;

static int teardown(void **state)
{
    (void)state;
    if (s.pid > 0)
        tsh_server_stop(&s);
    tsh_server_cleanup(&s);
    return 0;
}

/* A name whose slot shard `want` owns (is_owner) or does not own under the 3-way default split. */
static void pick_name(char *out, size_t cap, const char *prefix, int owned, uint16_t self,
                      const ts__shard_map *map)
{
    for (int i = 0; i < 100000; i++) {
        int n = snprintf(out, cap, "%s%d", prefix, i);
        uint16_t owner = ts__shard_map_owner(map, ts__slot(out, (size_t)n));
        if ((owner == self) == owned)
            return;
    }
    fail_msg("no name found");
}

/* Expect a WRONG_SHARD reply to (op, r) naming name's slot under map, with this daemon's epoch. */
static void expect_wrong(int fd, uint8_t op, uint32_t r, const char *name, const ts__shard_map *map,
                         const char *addr)
{
    tsu_frame f;
    tsu_expect(fd, &f, op, r, TS_ST_WRONG_SHARD);
    ts__msg_wrong_shard w;
    assert_int_equal(ts__msg_wrong_shard_decode(f.body, f.len, &w), 0);
    uint16_t slot = ts__slot(name, strlen(name));
    assert_int_equal(w.slot, slot);
    assert_int_equal(w.owner, ts__shard_map_owner(map, slot));
    assert_int_equal(w.epoch, map->epoch);
    assert_int_equal(w.addr_len, strlen(addr));
    assert_memory_equal(w.addr, addr, w.addr_len);
    assert_true(w.msg_len > 0);
    tsu_frame_free(&f);
}

/* PING answered: the connection is still usable and in step. */
static void expect_usable(int fd)
{
    uint32_t r = rid++;
    assert_int_equal(tsh_send(fd, TS_OP_PING, r, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PING, r, TS_ST_OK);
    tsu_frame_free(&f);
}

/*
 * Send op with a body that opens with name and is otherwise zeros: the shortest such body the
 * request decoder accepts (so the check sees a well-formed request of that opcode).
 */
static void send_named(int fd, uint8_t op, uint32_t r, const char *name)
{
    uint8_t body[512];
    size_t nl = strlen(name);
    if (op == TS_OP_STREAM_JOIN || op == TS_OP_STREAM_READ || op == TS_OP_STREAM_ACK ||
        op == TS_OP_STREAM_LEAVE) {
        /* A group and a member: names of their own, which may not be empty. */
        ts__msg m;
        memset(&m, 0, sizeof(m));
        m.kind = ts__msg_op_info(op)->request;
        m.u.stream_member.name = (const uint8_t *)name;
        m.u.stream_member.name_len = nl;
        m.u.stream_member.group = (const uint8_t *)"g";
        m.u.stream_member.group_len = 1;
        m.u.stream_member.member = (const uint8_t *)"m";
        m.u.stream_member.member_len = 1;
        size_t len = 0;
        assert_int_equal(ts__msg_encode(&m, body, sizeof(body), &len), 0);
        assert_int_equal(tsh_send(fd, op, r, body, len), 0);
        return;
    }
    memset(body, 0, sizeof(body));
    body[0] = (uint8_t)nl;
    memcpy(body + 1, name, nl);
    for (size_t extra = 0; extra <= 200; extra++) {
        ts__msg m;
        if (ts__msg_request_decode(op, body, 1 + nl + extra, &m) == 0) {
            assert_int_equal(tsh_send(fd, op, r, body, 1 + nl + extra), 0);
            return;
        }
    }
    fail_msg("no body of %s that opens with a name decodes", ts__op_name(op));
}

/* Send an upload of op (its fixed fields zero) with the record rec. */
static void send_upload(int fd, uint8_t op, uint32_t r, const char *name, const uint8_t *rec,
                        size_t rec_len)
{
    size_t fixed = ts__msg_op_info(op)->upload_fixed;
    size_t cap = 1 + strlen(name) + fixed + rec_len, len = 0;
    uint8_t *body = malloc(cap);
    assert_non_null(body);
    assert_int_equal(ts__msg_upload_encode(body, cap, (const uint8_t *)name, strlen(name), NULL,
                                           fixed, rec, rec_len, &len),
                     0);
    assert_int_equal(tsh_send(fd, op, r, body, len), 0);
    free(body);
}

/*
 * The opcodes whose request names one bin, stream, table, counter or barrier (no descriptors).
 * Not the embedding tables' EMB_CREATE, EMB_PULL and EMB_PUSH: a table exists on every shard,
 * its rows spread by id (test_ps_cluster).
 */
static const uint8_t named_ops[] = {
    TS_OP_GET,           TS_OP_PEEK,         TS_OP_DELETE,        TS_OP_LISTEN,
    TS_OP_UNLISTEN,      TS_OP_WAIT,         TS_OP_TENSOR_BIN,    TS_OP_READ_ROWS,
    TS_OP_STREAM_CREATE, TS_OP_STREAM_MARK,  TS_OP_STREAM_CREDIT, TS_OP_STREAM_JOIN,
    TS_OP_STREAM_READ,   TS_OP_STREAM_ACK,   TS_OP_STREAM_LEAVE,  TS_OP_STREAM_INFO,
    TS_OP_STREAM_RANGE,  TS_OP_ADD,          TS_OP_TAKE,          TS_OP_BARRIER,
    TS_OP_TABLE_CREATE,  TS_OP_TABLE_SAMPLE, TS_OP_TABLE_UPDATE,  TS_OP_TABLE_REMOVE,
    TS_OP_TABLE_INFO,    TS_OP_PS_CREATE,    TS_OP_PS_PULL};
static const uint8_t upload_ops[] = {TS_OP_PUT,         TS_OP_APPEND,       TS_OP_STREAM_APPEND,
                                     TS_OP_PUT_IF,      TS_OP_TABLE_INSERT, TS_OP_WRITE_ROWS,
                                     TS_OP_GATHER_ROWS, TS_OP_PS_PUSH};

/* Send MGET of n names. */
static void send_mget(int fd, uint32_t r, const char *const *names, uint32_t n)
{
    const uint8_t *p[8];
    size_t l[8];
    for (uint32_t i = 0; i < n; i++) {
        p[i] = (const uint8_t *)names[i];
        l[i] = strlen(names[i]);
    }
    uint8_t body[1024];
    size_t len = 0;
    assert_int_equal(ts__msg_mget_req_encode(body, sizeof(body), n, 0, p, l, &len), 0);
    assert_int_equal(tsh_send(fd, TS_OP_MGET, r, body, len), 0);
}

/* SHARD_MAP, decoded and built into a map (NULL when the daemon is not sharded); *self set. */
static ts__shard_map *shard_map_of(int fd, uint16_t *self, uint64_t *epoch)
{
    uint32_t r = rid++;
    assert_int_equal(tsh_send(fd, TS_OP_SHARD_MAP, r, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_SHARD_MAP, r, TS_ST_OK);
    ts__msg m;
    assert_int_equal(ts__msg_reply_decode(TS_OP_SHARD_MAP, TS_ST_OK, f.body, f.len, &m), 0);
    *self = m.u.shard_map.self;
    *epoch = m.u.shard_map.epoch;
    ts__shard_map *map = NULL;
    if (m.u.shard_map.n_shards > 0)
        assert_int_equal(ts__shard_map_from_msg(&m.u.shard_map, &map), 0);
    tsu_frame_free(&f);
    return map;
}

/* The foreign name of the exact-body check: "params" is slot 1749, shard 0 of 3. */
static void check_exact_body(int fd)
{
    uint32_t r = rid++;
    assert_int_equal(tsu_send_get(fd, TS_OP_GET, r, "params", 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_GET, r, TS_ST_WRONG_SHARD);
    static const char msg[] = "params: slot 1749 belongs to shard 0, not to shard 1 of 3";
    uint8_t want[16 + sizeof(msg) - 1] = {0xD5, 0x06, /* slot 1749 */
                                          0x00, 0x00, /* owner 0 */
                                          0x00, 0x00, /* addr_len 0 */
                                          0x00, 0x00, /* reserved */
                                          0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    memcpy(want + 16, msg, sizeof(msg) - 1);
    assert_int_equal(f.len, sizeof(want));
    assert_memory_equal(f.body, want, sizeof(want));
    tsu_frame_free(&f);
}

static void test_shard_of_three(void **state)
{
    (void)state;
    const char *args[] = {"--shard", "1/3", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    ts__shard_map *map = NULL;
    assert_int_equal(ts__shard_map_default(3, NULL, 1, &map), 0);
    char foreign[64], own[64], own2[64];
    pick_name(foreign, sizeof(foreign), "weights-", 0, 1, map);
    pick_name(own, sizeof(own), "weights-", 1, 1, map);
    pick_name(own2, sizeof(own2), "grads-", 1, 1, map);
    int fd = tsu_client(&s);
    check_exact_body(fd);
    expect_usable(fd);

    /* Every request that names something, one after the other on one connection. */
    for (size_t i = 0; i < TS__ARRAY_SIZE(named_ops); i++) {
        uint32_t r = rid++;
        send_named(fd, named_ops[i], r, foreign);
        expect_wrong(fd, named_ops[i], r, foreign, map, "");
        expect_usable(fd);
    }
    size_t rl = 0;
    uint8_t *rec = tsu_rec_int(7, &rl);
    for (size_t i = 0; i < TS__ARRAY_SIZE(upload_ops); i++) {
        uint32_t r = rid++;
        send_upload(fd, upload_ops[i], r, foreign, rec, rl);
        expect_wrong(fd, upload_ops[i], r, foreign, map, "");
        expect_usable(fd);
    }
    /* A large upload is read and dropped, and the next request is read in step. */
    size_t big_len = 0;
    uint8_t *big = tsu_rec_bytes((size_t)6 << 20, 3, &big_len);
    uint32_t r = rid++;
    send_upload(fd, TS_OP_PUT, r, foreign, big, big_len);
    expect_wrong(fd, TS_OP_PUT, r, foreign, map, "");
    expect_usable(fd);
    tsu_rec_free(big, big_len);

    /* Nothing was made by any of them. */
    assert_int_equal(tsu_stat(fd, "bins"), 0);
    assert_int_equal(tsu_stat(fd, "wrong_shard"),
                     1 + TS__ARRAY_SIZE(named_ops) + TS__ARRAY_SIZE(upload_ops) + 1);
    assert_int_equal(tsu_stat(fd, "shard"), 1);
    assert_int_equal(tsu_stat(fd, "shards"), 3);
    assert_int_equal(tsu_stat(fd, "map_epoch"), 1);

    /* Its own names are served. */
    uint32_t n = 0;
    tsu_put_int(fd, TS_OP_PUT, own, 5, &n);
    tsu_put_int(fd, TS_OP_PUT, own2, 6, &n);
    tsu_put_int(fd, TS_OP_PUT, "{exp7}.params", 7, &n); /* slot 6867: shard 1 */
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, own, 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 5);
    tsu_frame_free(&it.f);

    /* MGET: all owned is served; one foreign name among them refuses the whole request. */
    const char *ok_names[] = {own, own2};
    r = rid++;
    send_mget(fd, r, ok_names, 2);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_MGET, r, TS_ST_OK);
    tsu_frame_free(&f);
    const char *mixed[] = {own, foreign, "params"};
    r = rid++;
    send_mget(fd, r, mixed, 3);
    expect_wrong(fd, TS_OP_MGET, r, foreign, map, "");
    expect_usable(fd);

    /* The local requests are never refused; SHARD_MAP gives the default split. */
    uint16_t self = 0;
    uint64_t epoch = 0;
    ts__shard_map *got = shard_map_of(fd, &self, &epoch);
    assert_non_null(got);
    assert_int_equal(self, 1);
    assert_int_equal(epoch, 1);
    assert_true(ts__shard_map_same(got, map));
    ts__shard_map_free(got);
    assert_int_equal(tsu_stat(fd, "bins"), 3);
    close(fd);
    tsu_rec_free(rec, rl);
    ts__shard_map_free(map);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* A compressed PUT's name is inside its LZ4 block: refused once inflated, connection kept. */
static void test_compressed_upload(void **state)
{
    (void)state;
    const char *args[] = {"--shard", "1/3", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    int fd = tsh_connect_tcp(s.port);
    assert_true(fd >= 0);
    uint8_t hello[4] = {TS_PROTO_VERSION, TS_HELLO_LZ4, 0, 0};
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, hello, sizeof(hello)), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    assert_true(f.body[1] & TS_HELLO_LZ4);
    tsu_frame_free(&f);
    size_t rl = 0;
    uint8_t *rec = tsu_rec_bytes(64 << 10, 0, &rl); /* compresses well */
    size_t raw_cap = 1 + 6 + rl, raw_len = 0;
    uint8_t *raw = malloc(raw_cap);
    assert_non_null(raw);
    assert_int_equal(
        ts__msg_put_encode(raw, raw_cap, (const uint8_t *)"params", 6, rec, rl, &raw_len), 0);
    size_t zcap = ts__lz4_bound(raw_len), zlen = 0;
    uint8_t *z = malloc(TS_HDR_SIZE + zcap);
    assert_non_null(z);
    assert_int_equal(ts__lz4_compress(raw, raw_len, z + TS_HDR_SIZE, zcap, &zlen), 0);
    ts__hdr h = {TS_MAGIC_REQ, TS_PROTO_VERSION, TS_OP_PUT, TS_FLAG_LZ4, 0, 77, zlen};
    ts__hdr_encode(&h, z);
    assert_int_equal(tsh_write_all(fd, z, TS_HDR_SIZE + zlen), 0);
    ts__shard_map *map = NULL;
    assert_int_equal(ts__shard_map_default(3, NULL, 1, &map), 0);
    expect_wrong(fd, TS_OP_PUT, 77, "params", map, "");
    expect_usable(fd);
    assert_int_equal(tsu_stat(fd, "bins"), 0);
    ts__shard_map_free(map);
    free(z);
    free(raw);
    tsu_rec_free(rec, rl);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* Send a frame of op with one descriptor attached to its first byte (SCM_RIGHTS). */
static void send_with_fd(int fd, uint8_t op, uint32_t r, const uint8_t *body, size_t len, int dfd)
{
    uint8_t frame[TS_HDR_SIZE + 300];
    assert_true(len <= sizeof(frame) - TS_HDR_SIZE);
    ts__hdr h = {TS_MAGIC_REQ, TS_PROTO_VERSION, op, 0, 0, r, len};
    ts__hdr_encode(&h, frame);
    memcpy(frame + TS_HDR_SIZE, body, len);
    struct iovec iov = {frame, TS_HDR_SIZE + len};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof(ctl));
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof(ctl.buf);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &dfd, sizeof(int));
    assert_int_equal(sendmsg(fd, &msg, MSG_NOSIGNAL), (ssize_t)(TS_HDR_SIZE + len));
}

/* The by-reference requests (a unix socket granted FDS): GET_REF, PEEK_REF, PUT_FD. */
static void test_by_reference(void **state)
{
    (void)state;
    const char *args[] = {"--shard", "1/3", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    int fd = tsh_connect_unix(s.unix_path);
    assert_true(fd >= 0);
    uint8_t hello[4] = {TS_PROTO_VERSION, TS_HELLO_FDS, 0, 0};
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, hello, sizeof(hello)), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    assert_true(f.body[1] & TS_HELLO_FDS);
    tsu_frame_free(&f);
    ts__shard_map *map = NULL;
    assert_int_equal(ts__shard_map_default(3, NULL, 1, &map), 0);
    uint32_t r = rid++;
    assert_int_equal(tsu_send_get(fd, TS_OP_GET_REF, r, "params", 0), 0);
    expect_wrong(fd, TS_OP_GET_REF, r, "params", map, "");
    r = rid++;
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK_REF, r, "params", 0), 0);
    expect_wrong(fd, TS_OP_PEEK_REF, r, "params", map, "");
    /* PUT_FD: a valid record in a memfd, refused for its name; the descriptor is not kept. */
    size_t rl = 0;
    uint8_t *rec = tsu_rec_int(9, &rl);
    int mfd = memfd_create("test_shard", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    assert_true(mfd >= 0);
    assert_int_equal(write(mfd, rec, rl), (ssize_t)rl);
    uint8_t body[1 + 6 + 8];
    body[0] = 6;
    memcpy(body + 1, "params", 6);
    ts__put_u64le(body + 7, rl);
    r = rid++;
    send_with_fd(fd, TS_OP_PUT_FD, r, body, sizeof(body), mfd);
    expect_wrong(fd, TS_OP_PUT_FD, r, "params", map, "");
    expect_usable(fd);
    assert_int_equal(tsu_stat(fd, "bins"), 0);
    assert_int_equal(tsu_stat(fd, "wrong_shard"), 3);
    close(mfd);
    tsu_rec_free(rec, rl);
    ts__shard_map_free(map);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* Write text to path in the harness's directory. */
static void write_map(char *path, size_t cap, const char *name, const char *text)
{
    snprintf(path, cap, "%s/%s", s.dir, name);
    assert_int_equal(th_write_file(path, text, strlen(text)), 0);
}

static void test_cluster_map(void **state)
{
    (void)state;
    /* The harness makes its directory when it starts: start plain first, then with the map. */
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    int fd = tsu_client(&s);
    uint16_t self = 0;
    uint64_t epoch = 9;
    assert_null(shard_map_of(fd, &self, &epoch));
    assert_int_equal(self, TS_SHARD_NONE);
    assert_int_equal(epoch, 0);
    assert_int_equal(tsu_stat(fd, "shards"), 0);
    assert_int_equal(tsu_stat(fd, "map_epoch"), 0);
    /* Not sharded: every name is served (the exact-body name included). */
    uint32_t n = 0;
    tsu_put_int(fd, TS_OP_PUT, "params", 1, &n);
    assert_int_equal(tsu_stat(fd, "wrong_shard"), 0);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);

    char path[512];
    const char *text = "# three shards, ranged\n"
                       "epoch 5\n"
                       "127.0.0.1:7101 0-99,8000-16383\n"
                       "tcp://127.0.0.1:7102 100-4999\n"
                       "[::1]:7103 5000-7999\n";
    write_map(path, sizeof(path), "map.txt", text);
    const char *args[] = {"--cluster-map", path, "--shard", "2", NULL};
    assert_int_equal(tsh_server_restart(&s, args), 0);
    ts__shard_map *file = NULL;
    assert_int_equal(ts__shard_map_load(path, &file, NULL, 0), 0);
    fd = tsu_client(&s);
    /* "params" (slot 1749) belongs to line 1: its address and the file's epoch come back. */
    uint32_t r = rid++;
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, r, "params", 0), 0);
    expect_wrong(fd, TS_OP_PEEK, r, "params", file, "tcp://127.0.0.1:7102");
    /* "{exp7}.params" (slot 6867) is ours; a slot of line 0's second range is not. */
    tsu_put_int(fd, TS_OP_PUT, "{exp7}.params", 1, &n);
    char far[64];
    for (int i = 0;; i++) {
        snprintf(far, sizeof(far), "k%d", i);
        if (ts__slot(far, strlen(far)) >= 8000)
            break;
    }
    r = rid++;
    assert_int_equal(tsu_send_get(fd, TS_OP_GET, r, far, 0), 0);
    expect_wrong(fd, TS_OP_GET, r, far, file, "127.0.0.1:7101");
    ts__shard_map *got = shard_map_of(fd, &self, &epoch);
    assert_non_null(got);
    assert_int_equal(self, 2);
    assert_int_equal(epoch, 5);
    assert_true(ts__shard_map_same(got, file));
    assert_string_equal(got->addrs[2], "[::1]:7103");
    ts__shard_map_free(got);
    assert_int_equal(tsu_stat(fd, "shard"), 2);
    assert_int_equal(tsu_stat(fd, "map_epoch"), 5);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);

    /* I/N naming the file's line count is the same daemon. */
    const char *args2[] = {"--cluster-map", path, "--shard", "0/3", NULL};
    assert_int_equal(tsh_server_restart(&s, args2), 0);
    fd = tsu_client(&s);
    tsu_put_int(fd, TS_OP_PUT, far, 1, &n);
    close(fd);
    ts__shard_map_free(file);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* tensord with args exits 2 and says want (in its stderr). */
static void expect_exit2(const char *const *args, const char *want)
{
    char err[600];
    snprintf(err, sizeof(err), "%s/stderr.txt", s.dir);
    int rc = th_run_tensord(args, err, 15000);
    if (rc != 2 || !th_file_contains(err, want)) {
        char cmd[700];
        snprintf(cmd, sizeof(cmd), "cat %s >&2", err);
        (void)system(cmd);
        fail_msg("exit %d, want 2 with '%s'", rc, want);
    }
}

static void test_bad_flags(void **state)
{
    (void)state;
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    assert_int_equal(tsh_server_stop(&s), 0);
    expect_exit2((const char *const[]){"--port", "0", "--shard", "3/3", NULL},
                 "bad value for --shard: '3/3'");
    expect_exit2((const char *const[]){"--port", "0", "--shard", "0/0", NULL}, "--shard");
    expect_exit2((const char *const[]){"--port", "0", "--shard", "0/1025", NULL}, "--shard");
    expect_exit2((const char *const[]){"--port", "0", "--shard", "x", NULL}, "--shard");
    expect_exit2((const char *const[]){"--port", "0", "--shard", "1/3x", NULL}, "--shard");
    expect_exit2((const char *const[]){"--port", "0", "--shard", "-1/3", NULL}, "--shard");
    expect_exit2((const char *const[]){"--port", "0", "--shard", "1", NULL},
                 "give I/N (N shards), or --cluster-map");
    expect_exit2((const char *const[]){"--port", "0", "--shard", NULL}, "--shard needs a value");
    char missing[512], bad[512], good[512];
    snprintf(missing, sizeof(missing), "%s/no-such-map", s.dir);
    expect_exit2(
        (const char *const[]){"--port", "0", "--cluster-map", missing, "--shard", "0", NULL},
        "No such file");
    write_map(bad, sizeof(bad), "bad.txt", "a:1 0-100\nb:1 100-16383\n");
    expect_exit2((const char *const[]){"--port", "0", "--cluster-map", bad, "--shard", "0", NULL},
                 "line 2: slot 100 is already owned by line 1");
    write_map(good, sizeof(good), "good.txt", "a:1\nb:1\n");
    expect_exit2((const char *const[]){"--port", "0", "--cluster-map", good, NULL},
                 "--cluster-map needs --shard");
    expect_exit2((const char *const[]){"--port", "0", "--cluster-map", good, "--shard", "2", NULL},
                 "has 2 shards");
    expect_exit2(
        (const char *const[]){"--port", "0", "--cluster-map", good, "--shard", "1/3", NULL},
        "has 2 shards");
}

/* The version a PUT of name gives now. */
static uint64_t put_version(const char *name, int64_t v)
{
    int fd = tsu_client(&s);
    uint32_t n = 0;
    uint64_t version = tsu_put_int(fd, TS_OP_PUT, name, v, &n);
    close(fd);
    return version;
}

static void test_versions_across_restarts(void **state)
{
    (void)state;
    /* From a snapshot: the saved counter. */
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    assert_int_equal(tsh_server_stop(&s), 0);
    char snap[512];
    snprintf(snap, sizeof(snap), "%s/snap.tsd", s.dir);
    const char *args[] = {"--shard", "1/3", "--save", snap, NULL};
    assert_int_equal(tsh_server_restart(&s, args), 0);
    uint64_t v1 = put_version("{exp7}.params", 1);
    assert_int_equal(tsh_server_stop(&s), 0);
    assert_int_equal(access(snap, F_OK), 0);
    assert_int_equal(tsh_server_restart(&s, args), 0);
    int fd = tsu_client(&s);
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "{exp7}.params", 0, &it);
    assert_int_equal(it.version, v1); /* loaded as it was */
    tsu_frame_free(&it.f);
    close(fd);
    uint64_t v2 = put_version("{exp7}.params", 2);
    assert_true(v2 > v1);
    assert_int_equal(tsh_server_stop(&s), 0);

    /* Without a snapshot: the clock, in microseconds, starts the counter above the last run's. */
    const char *plain[] = {"--shard", "1/3", NULL};
    assert_int_equal(tsh_server_restart(&s, plain), 0);
    uint64_t w1 = put_version("{exp7}.params", 1);
    assert_int_equal(tsh_server_stop(&s), 0);
    assert_int_equal(tsh_server_restart(&s, plain), 0);
    uint64_t w2 = put_version("{exp7}.params", 2);
    assert_true(w2 > w1);
    assert_true(w1 > v2); /* the clock moved past the snapshot's counter too */
    assert_int_equal(tsh_server_stop(&s), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_shard_of_three, teardown),
        cmocka_unit_test_teardown(test_compressed_upload, teardown),
        cmocka_unit_test_teardown(test_by_reference, teardown),
        cmocka_unit_test_teardown(test_cluster_map, teardown),
        cmocka_unit_test_teardown(test_bad_flags, teardown),
        cmocka_unit_test_teardown(test_versions_across_restarts, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
