/*
 * Helpers for the tensord hardening tests: running tensord to check how it exits, HELLO with a
 * token, tolerant request/reply exchanges over raw sockets, and process measurements.
 */
#ifndef TS_TEST_HARDEN_UTIL_H
#define TS_TEST_HARDEN_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "test_server_util.h"

/*
 * Run tensord with args (NULL-terminated) until it exits or timeout_ms passes (then it is
 * killed and -1 returned). Its stderr goes to errfile (may be NULL). Returns the exit status.
 */
int th_run_tensord(const char *const *args, const char *errfile, int timeout_ms);
/* 1 when file contains needle. */
int th_file_contains(const char *file, const char *needle);

/* Send HELLO with token (len bytes, may be 0). */
int th_send_hello(int fd, uint32_t rid, const void *token, size_t len);

/*
 * Receive frames until the reply to rid (notifications are skipped and counted in *notes when
 * notes is not NULL). 0 with *f filled, or -1 when the connection ended or timed out.
 */
int th_recv_reply(int fd, uint32_t rid, tsu_frame *f, int *notes);

/* CPU time (user + system) of a process in milliseconds, or -1. */
long th_cpu_ms(int pid);
/* Milliseconds of a monotonic clock. */
uint64_t th_now_ms(void);
/* Sleep ms milliseconds. */
void th_sleep_ms(int ms);
/* The test's scale for durations: TS_TEST_SLOW=1 (sanitizer builds) gives 3, else 1. */
int th_slow(void);
/*
 * Before starting a tensord whose memory a test bounds: under ASan, freed memory sits in a
 * quarantine (256 MiB by default) and would count as resident; keep it small. No-op otherwise.
 */
void th_small_asan_quarantine(void);
/* Write len bytes to path (0600). 0 or -1. */
int th_write_file(const char *path, const void *data, size_t len);
/* The whole file at path in a new buffer (free() it; one byte more than *len); asserts. */
uint8_t *th_read_file(const char *path, size_t *len);

/*
 * A tensord that snapshots (--save) into its own directory, and the files the snapshot tests
 * keep beside it there: snap (the --save file), errfile (a stderr log) and copy (a second
 * snapshot file a test writes or loads).
 */
typedef struct th_saving_s {
    tsh_server srv;
    char snap[400], errfile[400], copy[400];
} th_saving;
/* Start tensord with --save snap (the paths are known once its directory exists); asserts. */
void th_saving_start(th_saving *f);
/* Restart it with the same --save; asserts. */
void th_saving_restart(th_saving *f);
/* Kill it if it runs, remove the files and the directory, and zero f. */
void th_saving_teardown(th_saving *f);
/*
 * Write data to f->copy and check that a tensord started with --save on it refuses it: exit
 * status 3, a message naming the file and problem, and the file left as it was; asserts.
 */
void th_saving_expect_refused(th_saving *f, const uint8_t *data, size_t len, const char *problem);

#endif /* TS_TEST_HARDEN_UTIL_H */
