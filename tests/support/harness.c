/* Test harness implementation: process control and raw frames. */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int spawn(tsh_server *s, const char *const *extra_args, int port)
{
    const char *bin = getenv("TS_TENSORD");
    if (bin == NULL || bin[0] == '\0') {
        fprintf(stderr, "harness: TS_TENSORD is not set\n");
        return -1;
    }
    char port_file[300], port_arg[16];
    snprintf(port_file, sizeof(port_file), "%s/port", s->dir);
    snprintf(port_arg, sizeof(port_arg), "%d", port);
    unlink(port_file);

    const char *argv[64];
    int n = 0;
    argv[n++] = bin;
    argv[n++] = "--port";
    argv[n++] = port_arg;
    argv[n++] = "--unix";
    argv[n++] = s->unix_path;
    argv[n++] = "--port-file";
    argv[n++] = port_file;
    for (int i = 0; extra_args != NULL && extra_args[i] != NULL && n < 62; i++)
        argv[n++] = extra_args[i];
    argv[n] = NULL;

    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    s->pid = pid;
    for (int i = 0; i < 1500; i++) { /* 15 s */
        FILE *f = fopen(port_file, "r");
        if (f != NULL) {
            int p = 0;
            int ok = fscanf(f, "%d", &p) == 1 && p > 0;
            fclose(f);
            if (ok) {
                s->port = p;
                snprintf(s->addr, sizeof(s->addr), "127.0.0.1:%d", p);
                snprintf(s->unix_addr, sizeof(s->unix_addr), "unix:%s", s->unix_path);
                return 0;
            }
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            fprintf(stderr, "harness: tensord exited during start-up\n");
            s->pid = 0;
            return -1;
        }
        sleep_ms(10);
    }
    fprintf(stderr, "harness: tensord did not start within 15 s\n");
    tsh_server_kill(s);
    return -1;
}

int tsh_server_start(tsh_server *s, const char *const *extra_args)
{
    memset(s, 0, sizeof(*s));
    const char *tmp = getenv("TMPDIR");
    snprintf(s->dir, sizeof(s->dir), "%s/tsh.XXXXXX", tmp != NULL ? tmp : "/tmp");
    if (mkdtemp(s->dir) == NULL)
        return -1;
    snprintf(s->unix_path, sizeof(s->unix_path), "%s/tensord.sock", s->dir);
    return spawn(s, extra_args, 0);
}

int tsh_server_restart(tsh_server *s, const char *const *extra_args)
{
    /* The old port may sit in TIME_WAIT for a moment; tensord sets SO_REUSEADDR. */
    for (int i = 0; i < 50; i++) {
        if (spawn(s, extra_args, s->port) == 0)
            return 0;
        sleep_ms(100);
    }
    return -1;
}

int tsh_server_stop(tsh_server *s)
{
    if (s->pid <= 0)
        return -1;
    kill(s->pid, SIGTERM);
    for (int i = 0; i < 1500; i++) {
        int st;
        pid_t r = waitpid(s->pid, &st, WNOHANG);
        if (r == s->pid) {
            s->pid = 0;
            if (WIFEXITED(st))
                return WEXITSTATUS(st);
            return -1;
        }
        sleep_ms(10);
    }
    fprintf(stderr, "harness: tensord ignored SIGTERM for 15 s, killing it\n");
    tsh_server_kill(s);
    return -1;
}

void tsh_server_kill(tsh_server *s)
{
    if (s->pid <= 0)
        return;
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
}

void tsh_server_cleanup(tsh_server *s)
{
    char path[320];
    snprintf(path, sizeof(path), "%s/port", s->dir);
    unlink(path);
    unlink(s->unix_path);
    /* Anything else a test left there (snapshots) is removed by the test itself. */
    rmdir(s->dir);
}

int tsh_server_alive(tsh_server *s)
{
    if (s->pid <= 0)
        return 0;
    int st;
    if (waitpid(s->pid, &st, WNOHANG) == s->pid) {
        s->pid = 0;
        return 0;
    }
    return kill(s->pid, 0) == 0;
}

long tsh_server_rss_kib(tsh_server *s)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)s->pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    long kib = -1;
    while (fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, "VmRSS:", 6) == 0)
            kib = strtol(line + 6, NULL, 10);
    fclose(f);
    return kib;
}

static void set_timeouts(int fd)
{
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

int tsh_connect_tcp(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    set_timeouts(fd);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
}

int tsh_connect_unix(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
    set_timeouts(fd);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int tsh_write_all(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int tsh_read_all(int fd, void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = recv(fd, p, len, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int tsh_send(int fd, uint8_t op, uint32_t rid, const void *body, size_t len)
{
    uint8_t hdr[TS_HDR_SIZE];
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .request_id = rid,
                 .body_len = len};
    ts__hdr_encode(&h, hdr);
    if (tsh_write_all(fd, hdr, sizeof(hdr)) != 0)
        return -1;
    if (len > 0 && tsh_write_all(fd, body, len) != 0)
        return -1;
    return 0;
}

int tsh_recv(int fd, ts__hdr *h, uint8_t **body, size_t *len)
{
    uint8_t hdr[TS_HDR_SIZE];
    *body = NULL;
    *len = 0;
    if (tsh_read_all(fd, hdr, sizeof(hdr)) != 0)
        return -1;
    if (ts__hdr_decode(hdr, TS_MAGIC_REP, h) != 0)
        return -1;
    if (h->body_len > ((uint64_t)1 << 32))
        return -1;
    if (h->body_len > 0) {
        uint8_t *b = malloc(h->body_len);
        if (b == NULL)
            return -1;
        if (tsh_read_all(fd, b, h->body_len) != 0) {
            free(b);
            return -1;
        }
        *body = b;
        *len = h->body_len;
    }
    return 0;
}

int tsh_hello(int fd)
{
    uint8_t body[4] = {TS_PROTO_VERSION, 0, 0, 0};
    if (tsh_send(fd, TS_OP_HELLO, 1, body, sizeof(body)) != 0)
        return -1;
    ts__hdr h;
    uint8_t *b;
    size_t n;
    if (tsh_recv(fd, &h, &b, &n) != 0)
        return -1;
    free(b);
    return h.opcode == TS_OP_HELLO && h.status == TS_ST_OK && h.request_id == 1 ? 0 : -1;
}

int tsh_wait_closed(int fd, int timeout_ms)
{
    uint8_t buf[4096];
    int waited = 0;
    while (waited < timeout_ms) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, 50);
        waited += 50;
        if (r <= 0)
            continue;
        ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
            return 1;
    }
    return 0;
}

size_t tsh_name_body(uint8_t *out, size_t cap, const char *name, const void *extra,
                     size_t extra_len)
{
    size_t nl = strlen(name);
    if (nl > 255 || 1 + nl + extra_len > cap)
        abort();
    out[0] = (uint8_t)nl;
    memcpy(out + 1, name, nl);
    if (extra_len > 0)
        memcpy(out + 1 + nl, extra, extra_len);
    return 1 + nl + extra_len;
}

char *tsh_read_source_file(const char *rel, size_t *len)
{
    const char *dir = getenv("TS_SOURCE_DIR");
    if (dir == NULL) {
        fprintf(stderr, "harness: TS_SOURCE_DIR is not set (ctest sets it to the source tree)\n");
        return NULL;
    }
    char path[4096];
    int w = snprintf(path, sizeof(path), "%s/%s", dir, rel);
    if (w < 0 || (size_t)w >= sizeof(path)) {
        fprintf(stderr, "harness: path too long: %s/%s\n", dir, rel);
        return NULL;
    }
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "harness: cannot open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0)
        size = ftell(f);
    if (size >= 0 && fseek(f, 0, SEEK_SET) == 0)
        buf = malloc((size_t)size + 1);
    if (buf != NULL && fread(buf, 1, (size_t)size, f) != (size_t)size) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf == NULL) {
        fprintf(stderr, "harness: cannot read %s\n", path);
        return NULL;
    }
    buf[size] = '\0';
    if (len != NULL)
        *len = (size_t)size;
    return buf;
}
