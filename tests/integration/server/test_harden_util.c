/* Helpers for the tensord hardening tests (see test_harden_util.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_harden_util.h"

uint64_t th_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void th_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

int th_slow(void)
{
    const char *s = getenv("TS_TEST_SLOW");
    return s != NULL && s[0] == '1' ? 3 : 1;
}

int th_run_tensord(const char *const *args, const char *errfile, int timeout_ms)
{
    const char *bin = getenv("TS_TENSORD");
    if (bin == NULL)
        return -1;
    const char *argv[64];
    int n = 0;
    argv[n++] = bin;
    for (int i = 0; args != NULL && args[i] != NULL && n < 63; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        int fd = open(errfile != NULL ? errfile : "/dev/null", O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 2);
            close(fd);
        }
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    uint64_t end = th_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (th_now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            return -1;
        }
        th_sleep_ms(10);
    }
}

int th_file_contains(const char *file, const char *needle)
{
    FILE *f = fopen(file, "r");
    if (f == NULL)
        return 0;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strstr(buf, needle) != NULL;
}

int th_send_hello(int fd, uint32_t rid, const void *token, size_t len)
{
    uint8_t body[4 + 4096];
    if (len > 4092)
        return -1;
    body[0] = TS_PROTO_VERSION;
    body[1] = 0;
    ts__put_u16le(body + 2, (uint16_t)len);
    if (len > 0)
        memcpy(body + 4, token, len);
    return tsh_send(fd, TS_OP_HELLO, rid, body, 4 + len);
}

int th_recv_reply(int fd, uint32_t rid, tsu_frame *f, int *notes)
{
    for (int i = 0; i < 1000000; i++) {
        if (tsu_recv(fd, f) != 0)
            return -1;
        if (f->h.opcode == TS_OP_NOTIFY && f->h.request_id == 0) {
            if (notes != NULL)
                (*notes)++;
            tsu_frame_free(f);
            continue;
        }
        if (f->h.request_id == rid)
            return 0;
        print_error("unexpected frame op 0x%02x rid %u status %u while waiting for rid %u\n",
                    f->h.opcode, f->h.request_id, f->h.status, rid);
        tsu_frame_free(f);
        return -1;
    }
    return -1;
}

long th_cpu_ms(int pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* Fields after the command name (which may hold spaces) start past the last ')'. */
    char *p = strrchr(buf, ')');
    if (p == NULL)
        return -1;
    unsigned long ut = 0, st = 0;
    /* state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime */
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return -1;
    long hz = sysconf(_SC_CLK_TCK);
    return (long)((ut + st) * 1000u / (unsigned long)(hz > 0 ? hz : 100));
}

void th_small_asan_quarantine(void)
{
    if (th_slow() == 1)
        return;
    static char opts[2048];
    const char *old = getenv("ASAN_OPTIONS");
    snprintf(opts, sizeof(opts), "%s%squarantine_size_mb=16", old != NULL ? old : "",
             old != NULL && old[0] != '\0' ? ":" : "");
    setenv("ASAN_OPTIONS", opts, 1);
}

int th_write_file(const char *path, const void *data, size_t len)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0)
        return -1;
    int ok = write(fd, data, len) == (ssize_t)len;
    return close(fd) == 0 && ok ? 0 : -1;
}

uint8_t *th_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    assert_true(n >= 0);
    assert_int_equal(fseek(f, 0, SEEK_SET), 0);
    uint8_t *b = malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

void th_saving_start(th_saving *f)
{
    assert_int_equal(tsh_server_start(&f->srv, NULL), 0);
    assert_int_equal(tsh_server_stop(&f->srv), 0);
    snprintf(f->snap, sizeof(f->snap), "%s/snap", f->srv.dir);
    snprintf(f->errfile, sizeof(f->errfile), "%s/stderr", f->srv.dir);
    snprintf(f->copy, sizeof(f->copy), "%s/copy", f->srv.dir);
    th_saving_restart(f);
}

void th_saving_restart(th_saving *f)
{
    const char *args[] = {"--save", f->snap, NULL};
    assert_int_equal(tsh_server_restart(&f->srv, args), 0);
}

void th_saving_teardown(th_saving *f)
{
    if (f->srv.pid > 0)
        tsh_server_kill(&f->srv);
    if (f->srv.dir[0] != '\0') {
        /* The snapshot's temporary file and the lock files tensord leaves beside each file. */
        const char *suffix[] = {".tmp", ".lock"};
        const char *base[] = {f->snap, f->copy};
        char p[450];
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 2; j++) {
                snprintf(p, sizeof(p), "%s%s", base[i], suffix[j]);
                unlink(p);
            }
        unlink(f->snap);
        unlink(f->errfile);
        unlink(f->copy);
        tsh_server_cleanup(&f->srv);
    }
    memset(f, 0, sizeof(*f));
}

void th_saving_expect_refused(th_saving *f, const uint8_t *data, size_t len, const char *problem)
{
    assert_int_equal(th_write_file(f->copy, data, len), 0);
    const char *args[] = {"--port", "0", "--save", f->copy, NULL};
    int st = th_run_tensord(args, f->errfile, 20000);
    if (st != 3 || !th_file_contains(f->errfile, f->copy) ||
        !th_file_contains(f->errfile, problem)) {
        print_error("exit %d, want 3 and \"%s\"\n", st, problem);
        fail();
    }
    size_t n;
    uint8_t *after = th_read_file(f->copy, &n);
    assert_int_equal(n, len);
    assert_memory_equal(after, data, len);
    free(after);
}
