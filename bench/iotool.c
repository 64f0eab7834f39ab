/*
 * iotool: the writer and reader used on BOTH sides of every comparison in
 * `make bench` (mtcfs and raw tmpfs), so the per-call cost of the tool is
 * the same everywhere and as small as a C loop allows.
 *
 * Each command times itself with CLOCK_MONOTONIC from just before the first
 * open() to just after the last close() (process start-up is not counted;
 * close() is, because mtcfs seals a file at close) and prints
 * "<seconds> <bytes>" on stdout.
 *
 *   iotool write PATH SIZE BS FSYNC
 *       one file of SIZE bytes written front to back with BS-byte write()s;
 *       fsync() before close() when FSYNC is 1.
 *   iotool read PATH BS
 *       read the whole file with BS-byte read()s.
 *   iotool tree ROOT NDIRS NFILES SIZE BS FSYNC
 *       mkdir ROOT/d000 .. (NDIRS of them), then NFILES files of SIZE bytes
 *       spread round-robin over them: open, write, [fsync], close each.
 *
 * Built by bench/common.py with `cc -O2`; no dependencies beyond libc.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_BS (64L << 20)

static char *buf;

static void die(const char *what, const char *path)
{
    fprintf(stderr, "iotool: %s %s: %s\n", what, path ? path : "", strerror(errno));
    exit(1);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static long long parse(const char *s)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < 0) {
        fprintf(stderr, "iotool: bad number %s\n", s);
        exit(2);
    }
    return v;
}

static void alloc_buf(long long bs)
{
    if (bs <= 0 || bs > MAX_BS) {
        fprintf(stderr, "iotool: block size must be 1..%ld\n", MAX_BS);
        exit(2);
    }
    if (posix_memalign((void **)&buf, 4096, (size_t)bs))
        die("posix_memalign", NULL);
    /* Not zeros: nothing on the way can treat the data as special. */
    for (long long i = 0; i < bs; i++)
        buf[i] = (char)(i * 131 + 7);
}

static void write_one(const char *path, long long size, long long bs, int do_fsync)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        die("open", path);
    long long done = 0;
    while (done < size) {
        size_t n = (size_t)(size - done < bs ? size - done : bs);
        ssize_t w = write(fd, buf, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            die("write", path);
        }
        done += w;
    }
    if (do_fsync && fsync(fd))
        die("fsync", path);
    if (close(fd))
        die("close", path);
}

int main(int argc, char **argv)
{
    if (argc == 6 && !strcmp(argv[1], "write")) {
        long long size = parse(argv[3]), bs = parse(argv[4]);
        int do_fsync = (int)parse(argv[5]);
        alloc_buf(bs);
        double t0 = now();
        write_one(argv[2], size, bs, do_fsync);
        printf("%.9f %lld\n", now() - t0, size);
        return 0;
    }
    if (argc == 4 && !strcmp(argv[1], "read")) {
        long long bs = parse(argv[3]), total = 0;
        alloc_buf(bs);
        double t0 = now();
        int fd = open(argv[2], O_RDONLY);
        if (fd < 0)
            die("open", argv[2]);
        for (;;) {
            ssize_t r = read(fd, buf, (size_t)bs);
            if (r < 0) {
                if (errno == EINTR)
                    continue;
                die("read", argv[2]);
            }
            if (r == 0)
                break;
            total += r;
        }
        if (close(fd))
            die("close", argv[2]);
        printf("%.9f %lld\n", now() - t0, total);
        return 0;
    }
    if (argc == 8 && !strcmp(argv[1], "tree")) {
        const char *root = argv[2];
        long long ndirs = parse(argv[3]), nfiles = parse(argv[4]);
        long long size = parse(argv[5]), bs = parse(argv[6]);
        int do_fsync = (int)parse(argv[7]);
        char path[4096];
        if (ndirs < 1) {
            fprintf(stderr, "iotool: NDIRS must be >= 1\n");
            return 2;
        }
        alloc_buf(bs);
        double t0 = now();
        for (long long d = 0; d < ndirs; d++) {
            snprintf(path, sizeof path, "%s/d%03lld", root, d);
            if (mkdir(path, 0755) && errno != EEXIST)
                die("mkdir", path);
        }
        for (long long i = 0; i < nfiles; i++) {
            snprintf(path, sizeof path, "%s/d%03lld/f%06lld", root, i % ndirs, i);
            write_one(path, size, bs, do_fsync);
        }
        printf("%.9f %lld\n", now() - t0, size * nfiles);
        return 0;
    }
    fprintf(stderr,
            "usage: iotool write PATH SIZE BS FSYNC\n"
            "       iotool read PATH BS\n"
            "       iotool tree ROOT NDIRS NFILES SIZE BS FSYNC\n");
    return 2;
}
