/*
 * The ceiling: the fastest a plain C client/server pair moves the same bytes over the same
 * socket. Blocking sockets, writes of at most 4 MiB (the kernel's tcp_wmem maximum; larger
 * writes are slower), a 64-byte aligned receive buffer that is reused (so no page faults after
 * the first round), and a 1-byte acknowledgement. No framing beyond a 9-byte request header.
 */
#define _GNU_SOURCE
#include "bench.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define CEIL_CHUNK ((size_t)4 << 20) /* bytes; the largest single write */

/* Grow *buf (64-byte aligned, reused between rounds) to at least need bytes. 0 or -1. */
static int ensure_buf(uint8_t **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    bench_free(*buf);
    *buf = bench_alloc(need);
    *cap = *buf != NULL ? need : 0;
    return *buf != NULL ? 0 : -1;
}

/* Serve one connection until it ends. */
static void *serve_conn(void *arg)
{
    int fd = (int)(intptr_t)arg;
    uint8_t *buf = NULL;
    size_t cap = 0;
    uint8_t req[9];
    while (bench_read_all(fd, req, 1) == 0 && req[0] != 'Q') {
        if (bench_read_all(fd, req + 1, 8) != 0)
            break;
        uint64_t len;
        memcpy(&len, req + 1, 8);
        if (ensure_buf(&buf, &cap, (size_t)len) != 0)
            break;
        if (req[0] == 'P') {
            uint8_t ack = 'k';
            if (bench_read_all(fd, buf, (size_t)len) != 0 || bench_write_all(fd, &ack, 1, 0) != 0)
                break;
        } else if (req[0] == 'G') {
            if (bench_write_all(fd, buf, (size_t)len, CEIL_CHUNK) != 0)
                break;
        } else {
            break;
        }
    }
    bench_free(buf);
    close(fd);
    return NULL;
}

int ceiling_serve(const char *port_file, const char *unix_path)
{
    int tfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int ufd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (tfd < 0 || ufd < 0)
        return -1;
    int one = 1;
    (void)setsockopt(tfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof(a);
    struct sockaddr_un u = {.sun_family = AF_UNIX};
    if (strlen(unix_path) >= sizeof(u.sun_path))
        return -1;
    memcpy(u.sun_path, unix_path, strlen(unix_path) + 1);
    (void)unlink(unix_path);
    if (bind(tfd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(tfd, 64) != 0 ||
        getsockname(tfd, (struct sockaddr *)&a, &al) != 0 ||
        bind(ufd, (struct sockaddr *)&u, sizeof(u)) != 0 || listen(ufd, 64) != 0)
        return -1;
    /* Write the port through a temporary file and rename, so a reader never sees half of it. */
    char tmp[512];
    snprintf(tmp, sizeof(tmp), "%s.tmp", port_file);
    FILE *f = fopen(tmp, "w");
    if (f == NULL)
        return -1;
    fprintf(f, "%d\n", ntohs(a.sin_port));
    fclose(f);
    if (rename(tmp, port_file) != 0)
        return -1;
    struct pollfd p[2] = {{.fd = tfd, .events = POLLIN}, {.fd = ufd, .events = POLLIN}};
    for (;;) {
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        for (int i = 0; i < 2; i++) {
            if (!(p[i].revents & POLLIN))
                continue;
            int c = accept4(p[i].fd, NULL, NULL, SOCK_CLOEXEC);
            if (c < 0)
                continue;
            if (i == 0)
                (void)setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
            pthread_t t;
            if (pthread_create(&t, NULL, serve_conn, (void *)(intptr_t)c) != 0) {
                close(c);
                continue;
            }
            pthread_detach(t);
        }
    }
}

/* One round: send size bytes, wait for the ack, ask for them back and receive them. */
static int ceiling_round(int fd, const uint8_t *src, uint8_t *dst, size_t size)
{
    uint8_t req[9];
    uint64_t len = size;
    req[0] = 'P';
    memcpy(req + 1, &len, 8);
    uint8_t ack;
    if (bench_write_all(fd, req, sizeof(req), 0) != 0 ||
        bench_write_all(fd, src, size, CEIL_CHUNK) != 0 || bench_read_all(fd, &ack, 1) != 0)
        return -1;
    req[0] = 'G';
    if (bench_write_all(fd, req, sizeof(req), 0) != 0 || bench_read_all(fd, dst, size) != 0)
        return -1;
    return 0;
}

bench_result ceiling_putget(const bench_target *t, int use_unix, size_t size, int iters)
{
    bench_result res = {0};
    int fd = bench_connect(t, use_unix);
    uint8_t *src = bench_alloc(size);
    uint8_t *dst = bench_alloc(size);
    if (fd < 0 || src == NULL || dst == NULL)
        goto out;
    bench_fill(src, size, 0, 1);
    /* One round first: a new TCP connection is slow until its window has grown. */
    if (ceiling_round(fd, src, dst, size) != 0)
        goto out;
    double t0 = bench_now();
    for (int i = 0; i < iters; i++)
        if (ceiling_round(fd, src, dst, size) != 0)
            goto out;
    res.value = (bench_now() - t0) / iters;
    res.ok = memcmp(src, dst, size) == 0;
out:
    if (fd >= 0) {
        uint8_t q = 'Q';
        (void)bench_write_all(fd, &q, 1, 0);
        close(fd);
    }
    bench_free(src);
    bench_free(dst);
    return res;
}
